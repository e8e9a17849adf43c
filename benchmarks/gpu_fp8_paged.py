"""FP8 (e4m3) paged read on SGLang's ragged + paged prefill: the new tokens through the ragged
wrapper, the cached prefix through the paged wrapper (fa2, page size 1, k_scale 0.05,
v_scale 0.07), merged by log-sum-exp as ``FlashInferAttnBackend.forward_extend`` does. The
paged read without the scales (pre-fix SGLang) against the call that flashfix's
``sglang-fp8-kv-scales`` patch produces (its own ``prepare`` applied to a stand-in of
``forward_extend``), both against a float64 reference.

    python benchmarks/gpu_fp8_paged.py [--deadline SECONDS]

Prints a markdown table and writes ``$OUT/gpu_fp8_paged.json`` when OUT is set. Goal:
flashfix <= 0.01.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_common as common  # noqa: E402

GOAL = 0.01


def warm(what):
    """Build one JIT module the check needs, so that builds overlap (same cache directory)."""
    import torch
    import flashinfer
    from flashfix.tools import gpu_checks as checks

    if what == "paged":
        batch = checks.PagedBatch([(1, 3)], kv_dtype=torch.float8_e4m3fn, page_size=1)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(checks._workspace(), "NHD", backend="fa2")
        wrapper.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_len, checks.NUM_QO_HEADS,
                     checks.NUM_KV_HEADS, checks.HEAD_DIM, 1, causal=False, q_data_type=torch.bfloat16,
                     kv_data_type=torch.float8_e4m3fn)
    else:
        from flashinfer.cascade import merge_state

        v = torch.zeros(2, checks.NUM_QO_HEADS, checks.HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        s = torch.zeros(2, checks.NUM_QO_HEADS, device="cuda", dtype=torch.float32)
        merge_state(v, s, v, s)
    torch.cuda.synchronize()


def child():
    import flashfix  # noqa: F401
    from flashfix.tools import gpu_checks as checks

    common.emit({"env": common.environment()})
    checks.fp8_paged(log=lambda row: common.emit({"row": row}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--warm")
    parser.add_argument("--deadline", type=float, default=0)
    args = parser.parse_args()
    if args.warm:
        return warm(args.warm)
    if args.child:
        return child()

    deadline = common.deadline_from(args.deadline)
    cache = common.cache_dir("fp8-paged")
    warmers = [common.Child(__file__, ["--warm", w], cache, deadline=deadline) for w in ("paged", "merge")]
    main_child = common.Child(__file__, ["--child"], cache, deadline=deadline)
    rows, env, problems = common.gather(warmers + [main_child])
    from _gpu_common import markdown, write_json

    print("## FP8 paged read with scales (sglang-fp8-kv-scales)\n")
    print(common.header(env) + "\n")
    print(markdown(rows, [
        ("case", "case"), ("requests (prefix, new)", lambda r: " ".join("%d+%d" % tuple(x) for x in r["requests"])),
        ("kernels (ragged / paged)", lambda r: "%s / %s" % (r.get("kernel_backend_ragged"), r.get("kernel_backend_paged"))),
        ("pre-fix: no scales", "err_pre_fix"), ("flashfix: scales passed", "err_flashfix"),
        ("ms pre-fix", "ms_pre_fix"), ("ms flashfix", "ms_flashfix"),
        ("goal met", lambda r: "yes" if r["err_flashfix"] <= GOAL else "NO"),
    ]))
    for p in problems:
        print("\nchild %s exited %s after %ss:\n%s" % (p["child"], p["rc"], p["wall_s"], p["tail"]))
    ok = bool(rows) and all(r["err_flashfix"] <= GOAL for r in rows) and not problems
    write_json("gpu_fp8_paged.json", {"env": env, "goal": GOAL, "rows": rows, "problems": problems,
                                      "child_wall_s": {c.label: c.wall_s for c in warmers + [main_child]}, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
