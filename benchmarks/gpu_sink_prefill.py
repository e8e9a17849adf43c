"""Sink-aware paged prefill on a GPU: vLLM's pre-fix path (FlashInfer's generic wrapper given
``sinks=``, which fa2/fa3 ignore) against the path flashfix's ``vllm-sink-prefill`` patch takes
(its ``edit_factory`` makes the factory build the sink wrapper, its ``edit_forward`` dispatches
the call), both against a float64 reference. bf16, page size 16, 16 query / 2 KV heads, head_dim 64.

    python benchmarks/gpu_sink_prefill.py [--deadline SECONDS]

Runs backend ``auto`` and ``fa2`` forced (what SM12x runs), each in two processes (full
attention cases, sliding-window case) so their JIT builds overlap. Prints markdown tables
and writes ``$OUT/gpu_sink_prefill.json`` when OUT is set. Goal: flashfix <= 0.005.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_common as common  # noqa: E402

GOAL = 0.005


def child(backend, window):
    import flashfix  # noqa: F401  (flashfix's hooks first, as in production)
    from flashfix.tools import gpu_checks as checks

    common.emit({"env": common.environment()})
    cases = [c for c in checks.SINK_CASES if (c[2] >= 0) == window]
    checks.sink_prefill(backend, cases=cases, log=lambda row: common.emit({"row": row}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "WINDOW"))
    parser.add_argument("--deadline", type=float, default=0)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1] == "window")

    deadline = common.deadline_from(args.deadline)
    children = [common.Child(__file__, ["--child", backend, window], common.cache_dir("sink-%s-%s" % (backend, window)),
                             deadline=deadline)
                for backend in ("auto", "fa2") for window in ("full", "window")]
    rows, env, problems = common.gather(children)
    order = {name: i for i, (name, _, _) in enumerate(__import__("flashfix.tools.gpu_checks", fromlist=["_"]).SINK_CASES)}
    rows.sort(key=lambda r: (r["backend"] != "auto", order.get(r["case"], 99)))
    from _gpu_common import markdown, write_json

    print("## Sink-aware prefill (vllm-sink-prefill)\n")
    print(common.header(env) + "\n")
    print(markdown(rows, [
        ("case", "case"), ("backend asked", "backend"),
        ("kernel (pre-fix / flashfix)", lambda r: "%s / %s" % (r.get("kernel_backend_pre_fix"), r.get("kernel_backend_flashfix"))),
        ("pre-fix: generic wrapper, sinks=", "err_pre_fix"),
        ("pre-fix vs no-sink reference", "err_pre_fix_vs_no_sinks"),
        ("flashfix: sink wrapper", "err_flashfix"),
        ("ms pre-fix", "ms_pre_fix"), ("ms flashfix", "ms_flashfix"),
        ("goal met", lambda r: "yes" if r["err_flashfix"] <= GOAL else "NO"),
    ]))
    for p in problems:
        print("\nchild %s exited %s after %ss:\n%s" % (p["child"], p["rc"], p["wall_s"], p["tail"]))
    ok = bool(rows) and all(r["err_flashfix"] <= GOAL for r in rows) and not problems
    write_json("gpu_sink_prefill.json", {"env": env, "goal": GOAL, "rows": rows, "problems": problems,
                                         "child_wall_s": {c.label: c.wall_s for c in children}, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
