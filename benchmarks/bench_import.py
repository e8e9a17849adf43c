"""What an engine process pays for flashfix when it imports its patch targets: wall time and peak memory.

In a real engine environment, fresh processes import the targets (``bench_memory.TARGETS``) with flashfix active
and with ``FLASHFIX_DISABLE=all``, interleaved in pairs, and each reports the seconds from its start to the end
of those imports and its peak resident set (``VmHWM``). Two bytecode modes: ``not written`` (the machine's
``PYTHONDONTWRITEBYTECODE=1``: nothing compiled, neither flashfix nor the engine) and ``compiled`` (every
module's bytecode cached first, under a private ``PYTHONPYCACHEPREFIX``, so the installed engine is not
touched). flashfix is imported from a copy made at the start (compiled in that mode, as an image installs it).
Prints the medians per column and the median of the paired ratios and differences; the goal (issue 35) is at
most 1.01x and +1 MiB.

    python benchmarks/bench_import.py [--pairs 4] [--release sglang==0.5.17 --release vllm==0.28.0]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import REPO, TARGETS  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))

# Also the seconds spent inside flashfix (its import, its post-import callbacks, its read-ahead before a
# target runs): a figure the noise of a whole engine import (about +-3 %% here) does not drown.
OWN = r'''
import os, time
_t = time.perf_counter()
import flashfix
OWN = [time.perf_counter() - _t]
if os.environ.get("FLASHFIX_DISABLE") != "all":
    from flashfix.core import registry as _r
    def timed(call):
        def run(*args):
            t = time.perf_counter()
            try:
                return call(*args)
            finally:
                OWN[0] += time.perf_counter() - t
        return run
    flashfix._call, _r._before_target = timed(flashfix._call), timed(_r._before_target)
'''

CHILD = r'''
import importlib, time
for name in %r:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print("RESULT=%%d" %% int(status["VmHWM"].split()[0]))
print("OWN=%%.4f" %% OWN[0])
print("FROM=" + flashfix.__file__)
'''


def run(python, env, code):
    start = time.perf_counter()  # run from the copy's folder: ``-c`` puts the working directory first on sys.path
    proc = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=900,
                          cwd=env["PYTHONPATH"])
    wall = time.perf_counter() - start
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT=")]
    own = [float(l[4:]) for l in proc.stdout.splitlines() if l.startswith("OWN=")]
    if not line:
        raise SystemExit("child failed:\n%s" % proc.stderr[-3000:])
    where = [l[5:] for l in proc.stdout.splitlines() if l.startswith("FROM=")]
    if not where or not where[0].startswith(env["PYTHONPATH"]):
        raise SystemExit("the child imported flashfix from %s, not from the copy in %s" % (where, env["PYTHONPATH"]))
    return wall, int(line[0][7:]) / 1024, own[0] if own else 0.0


def measure(requirement, pairs, mode, tmp, decisions="prepared"):
    import engine_env

    python = engine_env.env_python(requirement)
    engine = requirement.split("==")[0]
    root = Path(tmp) / requirement.replace("==", "-") / mode.replace(" ", "-")
    shutil.copytree(REPO / "flashfix", root / "flashfix", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env.update(PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", FLASHFIX_LOG_LEVEL="WARNING")
    if decisions == "none":
        env["FLASHFIX_CACHE_DIR"] = "off"
    code = OWN + CHILD % (TARGETS[engine],)
    if mode == "compiled":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / ("pycache-" + engine))
        subprocess.run([str(python), "-m", "compileall", "-q", str(root / "flashfix")], env=env, check=True)
        for disable in ("all", ""):  # warm: the engine's (and flashfix's) bytecode written once
            run(python, dict(env, FLASHFIX_DISABLE=disable), code)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if decisions == "prepared":  # the image build step: decisions stored beside flashfix's copy
        subprocess.run([str(python), "-m", "flashfix", "prepare"], env=env, check=True, capture_output=True, cwd=str(root))
    active, disabled = [], []
    for i in range(pairs):
        order = (("active", ""), ("disabled", "all")) if i % 2 == 0 else (("disabled", "all"), ("active", ""))
        for name, disable in order:
            (active if name == "active" else disabled).append(run(python, dict(env, FLASHFIX_DISABLE=disable), code))
    return {
        "release": requirement, "mode": mode, "pairs": pairs, "decisions": decisions,
        "disabled_s": statistics.median(d[0] for d in disabled), "active_s": statistics.median(a[0] for a in active),
        "ratio": statistics.median(a[0] / d[0] for a, d in zip(active, disabled)),
        "peak_added_mib": statistics.median(a[1] - d[1] for a, d in zip(active, disabled)),
        "own_s": statistics.median(a[2] for a in active),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--release", action="append")
    parser.add_argument("--decisions", action="append", choices=("prepared", "none"),
                        help="prepared: `flashfix prepare` run first (the image build step); none: FLASHFIX_CACHE_DIR=off "
                             "(default: prepared)")
    args = parser.parse_args()
    print("| release | bytecode | decisions | disabled | active | ratio (median of pairs) | peak RSS added | in flashfix |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for requirement in args.release or ["sglang==0.5.17", "vllm==0.28.0"]:
            for decisions in args.decisions or ["prepared"]:
                for mode in ("not written", "compiled"):
                    r = measure(requirement, args.pairs, mode, os.path.join(tmp, decisions), decisions)
                    print("| %s | %s | %s | %.2f s | %.2f s | %.3fx | %+.2f MiB | %.3f s (%.2f %%) |" % (
                        r["release"], r["mode"], decisions, r["disabled_s"], r["active_s"], r["ratio"],
                        r["peak_added_mib"], r["own_s"], 100 * r["own_s"] / r["disabled_s"]), flush=True)
    print("(%d interleaved pairs of fresh processes per row; in flashfix: median seconds inside flashfix's import and "
          "hooks, and its share of the disabled import; targets: %s; goal: <= 1.01x, <= +1 MiB)" % (
        args.pairs, "; ".join("%s: %s" % (k, ", ".join(v)) for k, v in TARGETS.items())))


if __name__ == "__main__":
    main()
