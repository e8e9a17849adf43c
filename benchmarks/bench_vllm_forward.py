"""CPU cost that vllm-sink-prefill adds to vLLM's ``FlashInferImpl.forward`` (and to the
prefill wrapper factory), patched vs unpatched, on the same stand-in.

    python3 benchmarks/bench_vllm_forward.py [--calls N] [--rounds R]

Runs in the vLLM 0.28.0 environment (tests/engine_env.py; re-executes itself there). The
pre-fix module is derived from the installed 0.28.0 source (tests/vllm_prefix_shape.py) and
imported with flashfix active, which patches it. The same ``forward`` function object is then
timed with its patched code (marker-free) and with its original code, alternately, on one
prefill batch whose FlashInfer wrapper is a no-op (so the figures are the Python cost of
``forward`` itself). Cases: the generic wrapper (every GPU without sinks, and non-SM12x GPUs)
and the sink wrapper (SM12x with sinks; unpatched code passes ``sinks=`` to the generic call).
Goal: at most 0.3 us added per call. Prints a table; writes $OUT/bench_vllm_forward.json if OUT is set.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GOAL_NS = 300.0


def call_site(self, layer, prefill_wrapper, prefill_query, kv_cache_for_fi, out_prefill, kv_cache_sf):
    """The pre-fix prefill call statement of vLLM's forward, alone (rewritten like forward)."""
    prefill_wrapper.run(prefill_query, kv_cache_for_fi, q_scale=layer._q_scale_float, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, out=out_prefill, kv_cache_sf=kv_cache_sf, sinks=self.sinks)


def timed_rounds(func, args, codes, calls, rounds):
    """Alternate ``func``'s code between ``codes`` (label -> code); per-call ns samples per label."""
    samples = {label: [] for label in codes}
    for code in codes.values():  # warm up (specialisation) both
        func.__code__ = code
        for _ in range(calls):
            func(*args)
    labels = list(codes)
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else labels[::-1]):
            func.__code__ = codes[label]
            start = time.perf_counter_ns()
            for _ in range(calls):
                func(*args)
            samples[label].append((time.perf_counter_ns() - start) / calls)
    return samples


def summary(name, samples):
    patched, unpatched = statistics.median(samples["patched"]), statistics.median(samples["unpatched"])
    diffs = sorted(p - u for p, u in zip(samples["patched"], samples["unpatched"]))
    q = len(diffs) // 4
    return {"case": name, "unpatched_ns": unpatched, "patched_ns": patched,
            "added_ns_median_paired": statistics.median(diffs), "added_ns_iqr": [diffs[q], diffs[-q - 1]],
            "added_ns_min_vs_min": min(samples["patched"]) - min(samples["unpatched"]), "ratio": patched / unpatched}


def inner(calls, rounds):
    import importlib
    import tempfile

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import flashfix
    from flashfix import vllm_patch
    from flashfix.core import registry as _registry
    from flashfix.core import source as _source
    import vllm_prefix_shape as h

    target = vllm_patch.TARGET
    h.install_prefix_module(tempfile.mkdtemp(), _source.module_file(target))
    mod = importlib.import_module(target)
    row = next(r for r in flashfix.status() if r["id"] == vllm_patch.PATCH_ID)
    assert row["state"] == "applied", row

    import torch
    from vllm.v1.attention.backends.utils import set_kv_cache_layout

    set_kv_cache_layout("NHD")
    torch.set_num_threads(1)
    forward = mod.FlashInferImpl.forward
    swap = _registry._sites[vllm_patch.PATCH_ID + ":FlashInferImpl.forward"]
    codes = {"patched": swap.plain, "unpatched": swap.old}

    class NoopGeneric(mod.BatchPrefillWithPagedKVCacheWrapper):
        def __init__(self):  # no FlashInfer state: forward only reads these
            self._window_left, self._logits_soft_cap, self._sm_scale, self._causal = -1, 0.0, None, True

        def run(self, *args, **kwargs):
            return None

    class NoopSink(NoopGeneric, mod.BatchAttentionWithAttentionSinkWrapper):
        pass

    T, H, KVH, D = 16, 8, 2, 64
    query = torch.randn(T, H, D, dtype=torch.bfloat16)
    key = torch.randn(T, KVH, D, dtype=torch.bfloat16)
    value = torch.randn(T, KVH, D, dtype=torch.bfloat16)
    output = torch.zeros(T, H, D, dtype=torch.bfloat16)
    kv_cache = torch.zeros(mod.FlashInferBackend.get_kv_cache_shape(8, 16, KVH, D), dtype=torch.bfloat16)
    layer = h.stand_in_layer(1.0, 1.0, 1.0)

    def setup(wrapper_cls, sinks):
        impl = h.stand_in_impl(mod.FlashInferImpl, sinks=sinks, kv_cache_dtype="auto", num_heads=H,
                               num_kv_heads=KVH, head_size=D)
        wrapper = wrapper_cls()
        wrapper._sm_scale = impl.scale
        meta = h.stand_in_metadata(mod, wrapper, num_tokens=T, causal=True, q_dtype=torch.bfloat16)
        return impl, meta

    results = []
    cases = [("generic wrapper (no sinks, or not SM12x)", NoopGeneric, None),
             ("sink wrapper (SM12x with sinks)", NoopSink, torch.randn(H, dtype=torch.float32))]
    for name, wrapper_cls, sinks in cases:
        impl, meta = setup(wrapper_cls, sinks)
        samples = timed_rounds(forward, (impl, layer, query, key, value, kv_cache, meta, output), codes, calls, rounds)
        results.append(summary("forward, " + name, samples))
    forward.__code__ = swap.plain

    # the changed statement alone: same rewrite, no torch work around it (a precise figure)
    import types

    globals()["BatchAttentionWithAttentionSinkWrapper"] = mod.BatchAttentionWithAttentionSinkWrapper
    twin = types.FunctionType(call_site.__code__, globals(), "call_site")
    site_change = _registry.rewrite(twin, vllm_patch.edit_forward, vllm_patch.PATCH_ID)
    site_codes = {"patched": site_change.plain, "unpatched": site_change.old}
    for name, wrapper_cls, sinks in cases:
        impl, _ = setup(wrapper_cls, sinks)
        args = (impl, layer, wrapper_cls(), query, (kv_cache, kv_cache), output, None)
        samples = timed_rounds(twin, args, site_codes, calls * 20, rounds)
        results.append(summary("call statement only, " + name, samples))

    # the factory: vLLM calls it once per batch build; with the wrapper already cached
    builder = h.stand_in_builder(mod.FlashInferMetadataBuilder, has_sinks=True, kv_dtype=torch.bfloat16,
                                 q_dtype=torch.bfloat16, workspace=torch.zeros(8, dtype=torch.uint8))
    builder._prefill_wrapper = NoopSink()
    factory_swap = _registry._sites["%s:%s" % (vllm_patch.PATCH_ID, vllm_patch.FACTORY)]
    factory = factory_swap.func  # the build's own function, rewritten in place (no wrapper)
    h.fake_capability(mod.current_platform, 121)
    factory_ns = {}
    for label, code in (("patched", factory_swap.plain), ("unpatched", factory_swap.old)):
        factory.__code__ = code
        best = []
        for _ in range(rounds):
            start = time.perf_counter_ns()
            for _ in range(calls):
                factory(builder, True)
            best.append((time.perf_counter_ns() - start) / calls)
        factory_ns[label] = statistics.median(best)
    factory.__code__ = factory_swap.plain
    return {"torch": torch.__version__, "python": sys.version.split()[0], "calls": calls, "rounds": rounds,
            "forward": results, "factory": factory_ns}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--inner", action="store_true")
    args = parser.parse_args()
    if args.inner:
        print("RESULT=" + json.dumps(inner(args.calls, args.rounds)), flush=True)
        return 0

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import engine_env

    python = engine_env.env_python("vllm==0.28.0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env.update({"PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": "", "FLASHFIX_LOG_LEVEL": "WARNING"})
    proc = subprocess.run([str(python), __file__, "--inner", "--calls", str(args.calls), "--rounds", str(args.rounds)],
                          env=env, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT=")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    res = json.loads(lines[-1][len("RESULT="):])
    print("vllm-sink-prefill: CPU cost of FlashInferImpl.forward (prefill-only batch, no-op wrapper), "
          "vLLM 0.28.0 pre-fix shape, torch %s, Python %s, %d calls x %d rounds\n"
          % (res["torch"], res["python"], res["calls"], res["rounds"]))
    print("| case | unpatched ns/call | patched ns/call | added ns (median of paired rounds) | added ns IQR | ratio "
          "| goal <= %d ns |" % GOAL_NS)
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for r in res["forward"]:
        met = r["added_ns_median_paired"] <= GOAL_NS
        ok &= met
        print("| %s | %.0f | %.0f | %+.0f | %+.0f .. %+.0f | %.4f | %s |" % (
            r["case"], r["unpatched_ns"], r["patched_ns"], r["added_ns_median_paired"], r["added_ns_iqr"][0],
            r["added_ns_iqr"][1], r["ratio"], "yes" if met else "NO"))
    f = res["factory"]
    print("\n_get_prefill_wrapper with the wrapper cached (once per batch build): unpatched %.0f ns, patched %.0f ns "
          "(%+.0f ns)" % (f["unpatched"], f["patched"], f["patched"] - f["unpatched"]))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_vllm_forward.json"), "w") as handle:
            json.dump({**res, "goal_ns": GOAL_NS, "ok": ok}, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
