"""FlashInfer's sink-wrapper JIT kernel-name collision, without and with flashfix's
``flashinfer-sink-jit-name`` patch. Each sequence (bf16 KV then FP8 KV, the reverse, head_dim
64 then 128) runs in a process of its own, since the collision is per process; every wrapper
is checked against a float64 reference. fa2 forced (what SM12x runs; ``auto`` on SM90 picks fa3
for bf16 and fa2 for FP8, whose names then differ anyway).

    python benchmarks/gpu_sink_jit_name.py [--deadline SECONDS]

JIT caches: processes that share a cache directory run one after another (without the patch,
FlashInfer rebuilds the colliding name's sources on disk, so two such processes must not
overlap); independent groups run in parallel. Prints a markdown table and writes
``$OUT/gpu_sink_jit_name.json`` when OUT is set. Goal with flashfix: <= 0.005 for every wrapper.
"""

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_common as common  # noqa: E402

GOAL = 0.005
SEQUENCES = {
    "bf16 KV then FP8 KV": "bf16:64,fp8:64",
    "FP8 KV then bf16 KV": "fp8:64,bf16:64",
    "head_dim 64 then 128": "bf16:64,bf16:128",
}
# cache group -> runs in order: (sequence, flashfix on?)
GROUPS = {
    "g1": [("bf16 KV then FP8 KV", True), ("bf16 KV then FP8 KV", False)],
    "g2": [("FP8 KV then bf16 KV", True), ("FP8 KV then bf16 KV", False)],
    "g3": [("head_dim 64 then 128", False)],
    "g4": [("head_dim 64 then 128", True)],
}


def child(spec):
    import flashfix  # noqa: F401  (installs the hook: the patch applies when flashinfer is imported)
    from flashfix.tools import gpu_checks as checks

    configs = [(kv, int(d)) for kv, d in (item.split(":") for item in spec.split(","))]
    common.emit({"env": common.environment()})
    result = checks.sink_sequence(configs, log=lambda row: common.emit({"row": row}))
    common.emit({"done": result, "patch_state": common.sink_patch_state()})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--deadline", type=float, default=0)
    args = parser.parse_args()
    if args.child:
        return child(args.child)

    deadline = common.deadline_from(args.deadline)
    runs, env, lock = [], {}, threading.Lock()

    def group(name, items):
        cache = common.cache_dir("jit-name-" + name)
        for sequence, patched in items:
            extra = {} if patched else {"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"}
            c = common.Child(__file__, ["--child", SEQUENCES[sequence]], cache, env=extra, deadline=deadline,
                             label="%s, flashfix %s" % (sequence, "on" if patched else "off")).wait()
            run = {"sequence": sequence, "flashfix": "on" if patched else "off", "rows": [], "warnings": [],
                   "patch_state": None, "wall_s": c.wall_s, "rc": c.proc.returncode}
            for result in c.results:
                if "env" in result:
                    env.update(result["env"])
                if "row" in result:
                    run["rows"].append(result["row"])
                if "done" in result:
                    run["warnings"] = result["done"]["flashfix_warnings"]
                    run["patch_state"] = result["patch_state"]
            if c.failed():
                run["tail"] = c.tail()
            with lock:
                runs.append(run)

    threads = [threading.Thread(target=group, args=item) for item in GROUPS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs.sort(key=lambda r: (list(SEQUENCES).index(r["sequence"]), r["flashfix"] == "on"))
    table = []
    for run in runs:
        for row in run["rows"]:
            table.append(dict(row, sequence=run["sequence"], flashfix=run["flashfix"], patch_state=run["patch_state"],
                              renamed="yes" if (row["step"] == 2 and run["warnings"]) else ""))
    from _gpu_common import markdown, write_json

    print("## Sink-wrapper JIT name collision (flashinfer-sink-jit-name)\n")
    print(common.header(env) + "\n")
    print(markdown(table, [
        ("sequence (one process)", "sequence"), ("flashfix", "flashfix"), ("step", "step"),
        ("KV dtype", "kv"), ("head_dim", "head_dim"), ("rel. L2 error", "err"), ("non-finite", "nan"),
        ("build s", "build_s"), ("renamed by flashfix", "renamed"),
    ]))
    for run in runs:
        if run.get("tail"):
            print("\n%s, flashfix %s exited %s:\n%s" % (run["sequence"], run["flashfix"], run["rc"], run["tail"]))
    patched = [row for run in runs if run["flashfix"] == "on" for row in run["rows"]]
    ok = (len(runs) == 6 and all(run["rc"] == 0 for run in runs) and len(patched) == 6
          and all(row["err"] <= GOAL for row in patched))
    write_json("gpu_sink_jit_name.json", {"env": env, "goal": GOAL, "runs": runs, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
