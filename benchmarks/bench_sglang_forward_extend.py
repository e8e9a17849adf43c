"""Per-call cost that ``sglang-fp8-kv-scales`` adds to ``FlashInferAttnBackend.forward_extend``.

On the CPU, in the SGLang 0.5.17 environment (tests/engine_env.py): SGLang's real
``forward_extend`` runs on a backend whose FlashInfer wrappers are stand-ins that return
preallocated tensors, so the time measured is the function's own Python work (views,
metadata reads, the call with its keywords), which is where the patch adds something: two
keyword arguments on one call. The patched code (marker already dropped) and the released
code are swapped into the same function object round by round, interleaved, and each round
times many calls. Prints the median nanoseconds per call of each, their difference and ratio,
for the path the patch changes (ragged + paged with a cached prefix) and for the paged path
it does not change (a control: its difference is the noise floor).

    python benchmarks/bench_sglang_forward_extend.py [--rounds 41] [--calls 4000]
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASE = "sglang==0.5.17"

INNER = r'''
import gc, json, statistics, sys, time
from types import SimpleNamespace
import flashfix
import torch
import sglang.srt.layers.attention.flashinfer_backend as fb
from flashfix import semantic, sglang_patch

ROUNDS, CALLS = %(rounds)d, %(calls)d
state = {r["id"]: r["state"] for r in flashfix.status()}
assert state["sglang-fp8-kv-scales"] == "applied", state
func = semantic.function_at(fb, "FlashInferAttnBackend.forward_extend")

HEADS, KV_HEADS, DIM, TOKENS = 8, 2, 64, 16
out = torch.zeros(TOKENS, HEADS, DIM)
lse = torch.zeros(TOKENS, HEADS)

class Wrapper:  # a FlashInfer prefill wrapper that does no work
    def forward(self, q, *args, **kw):
        return out
    def forward_return_lse(self, q, *args, **kw):
        return out, lse

cache = (torch.zeros(64, KV_HEADS, DIM), torch.zeros(64, KV_HEADS, DIM))
pool = SimpleNamespace(get_kv_buffer=lambda layer_id: cache)
for name in ("_safe_merge_state", "merge_state"):
    if name in func.__code__.co_names:  # the CUDA merge kernel is not there on a CPU machine
        setattr(fb, name, lambda o1, s1, o2, s2: (o1, s1))

def backend(use_ragged, no_prefix):
    b = object.__new__(fb.FlashInferAttnBackend)
    b.__dict__.update(
        forward_metadata=SimpleNamespace(prefill_wrappers=[Wrapper()], use_ragged=use_ragged,
                                         extend_no_prefix=no_prefix, multi_item_params=None,
                                         swa_out_cache_loc=None),
        num_wrappers=1, prefill_wrapper_ragged=Wrapper(), prefill_uses_dequant_workspace=False,
        token_to_kv_pool=pool, is_dllm_model=False)
    return b

layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
                        head_dim=DIM, scaling=DIM ** -0.5, logit_cap=0.0, sliding_window_size=-1,
                        is_cross_attention=False, attn_type=fb.AttentionType.DECODER,
                        k_scale=None, v_scale=None, k_scale_float=0.05, v_scale_float=0.07)
batch = SimpleNamespace(out_cache_loc=None, encoder_out_cache_loc=None, token_to_kv_pool=pool)
q = torch.randn(TOKENS, HEADS * DIM)
k = torch.randn(TOKENS, KV_HEADS * DIM)
v = torch.randn(TOKENS, KV_HEADS * DIM)
paths = {"ragged+paged, cached prefix (patched call)": backend(True, False),
         "paged only (control, unchanged)": backend(False, False)}

for b in paths.values():
    b.forward_extend(q, k, v, layer, batch, save_kv_cache=False)  # first run drops the marker
patched = func.__code__
flashfix.revert()
released = func.__code__
assert released is not patched

def per_call(b):
    fe = b.forward_extend
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        fe(q, k, v, layer, batch, False)
    return (time.perf_counter_ns() - start) / CALLS

results = {}
gc.disable()
for name, b in paths.items():
    times = {"released": [], "patched": []}
    for code in (released, patched):  # warm up both
        func.__code__ = code
        per_call(b)
    for i in range(ROUNDS):
        order = (("released", released), ("patched", patched)) if i %% 2 == 0 else (("patched", patched), ("released", released))
        for label, code in order:
            func.__code__ = code
            times[label].append(per_call(b))
    med = {label: statistics.median(t) for label, t in times.items()}
    results[name] = {"released_ns": med["released"], "patched_ns": med["patched"],
                     "added_ns": med["patched"] - med["released"], "ratio": med["patched"] / med["released"],
                     # each round times both codes back to back: the median of their differences
                     # is the least sensitive to the machine's drift
                     "added_paired_ns": statistics.median(p - r for p, r in zip(times["patched"], times["released"])),
                     "released_iqr": statistics.quantiles(times["released"], n=4)[::2],
                     "patched_iqr": statistics.quantiles(times["patched"], n=4)[::2]}
func.__code__ = released
print("FLASHFIX_RESULT=" + json.dumps({"torch": torch.__version__, "python": sys.version.split()[0],
                                       "rounds": ROUNDS, "calls": CALLS, "results": results}))
'''


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import engine_env

    (data,) = engine_env.run(RELEASE, INNER % {"rounds": args.rounds, "calls": args.calls})
    print("%s on the CPU (python %s, torch %s): %d rounds x %d calls, interleaved; median ns per call"
          % (RELEASE, data["python"], data["torch"], data["rounds"], data["calls"]))
    print("%-44s %12s %12s %10s %14s %8s" % ("path", "released", "patched", "added", "added (paired)", "ratio"))
    for name, r in data["results"].items():
        print("%-44s %12.0f %12.0f %+10.0f %+14.0f %8.4f" % (name, r["released_ns"], r["patched_ns"], r["added_ns"],
                                                            r["added_paired_ns"], r["ratio"]))
    for name, r in data["results"].items():
        print("  %s: quartiles released %s, patched %s" % (
            name, "/".join("%.0f" % x for x in r["released_iqr"]), "/".join("%.0f" % x for x in r["patched_iqr"])))
    print(json.dumps(data))


if __name__ == "__main__":
    main()
