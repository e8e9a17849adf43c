"""Concurrent imports of real SGLang modules, with and without flashfix, alternating.

Four threads import ``model_runner``, ``flashinfer_backend``, ``model_config`` and the
autotune module at once, in a fresh process per run; a run fails when any thread raises
(SGLang's own modules sometimes fail this way without flashfix: a circular ImportError) or
hangs. Prints the failure counts of both columns and the errors seen, so a difference that
flashfix makes would show.

    python benchmarks/concurrent_imports.py [--runs 8] [--release sglang==0.5.17]
"""

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

CHILD = r'''
import importlib, json, threading
names = ["sglang.srt.model_executor.model_runner", "sglang.srt.layers.attention.flashinfer_backend",
         "sglang.srt.configs.model_config", "sglang.srt.model_executor.runner.flashinfer_autotune"]
errors = []
barrier = threading.Barrier(len(names))
def load(name):
    barrier.wait()
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors.append("%s: %s" % (type(exc).__name__, str(exc)[:120]))
threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in names]
for t in threads: t.start()
for t in threads: t.join(600)
hung = sum(t.is_alive() for t in threads)
states = {}
try:
    import flashfix
    states = {r["id"]: r["state"] for r in flashfix.status() if r["engine"] == "sglang"}
except Exception as exc:
    states = {"error": repr(exc)}
print("RESULT=" + json.dumps({"errors": errors, "hung": hung, "states": states}), flush=True)
import os
os._exit(0)
'''


def main():
    import engine_env

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--release", default="sglang==0.5.17")
    args = parser.parse_args()
    python = engine_env.env_python(args.release)
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    base.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    columns = {"with flashfix": dict(base), "FLASHFIX_DISABLE=all": dict(base, FLASHFIX_DISABLE="all")}
    failures = collections.Counter()
    kinds = collections.defaultdict(collections.Counter)
    for run in range(args.runs):
        for column, env in columns.items():
            code = "import flashfix\n" + CHILD if column == "with flashfix" else CHILD
            proc = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=900)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT=")]
            result = json.loads(lines[0][7:]) if lines else {"errors": ["exit %d" % proc.returncode], "hung": 0}
            bad = bool(result["errors"] or result["hung"])
            failures[column] += bad
            for error in result["errors"]:
                kinds[column][error.split(":")[0]] += 1
            print("run %d %-22s %s %s" % (run + 1, column, "FAIL" if bad else "ok", result.get("states", "")),
                  flush=True)
    for column in columns:
        print("%-22s failed %d of %d runs; errors: %s" % (column, failures[column], args.runs, dict(kinds[column])))


if __name__ == "__main__":
    main()
