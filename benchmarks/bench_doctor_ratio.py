"""The doctor's time as a ratio to its own library-import floor (goal: at most 2.5x).

For each engine environment, ``python -m flashfix doctor --json`` and the floor, the same
interpreter running ``import importlib.metadata, packaging.specifiers, ast, json`` (what the
doctor cannot do without), are run alternately in fresh processes, ``--runs`` times each. The
ratio of the medians is printed, twice: with flashfix's and ``packaging``'s bytecode compiled
(as ``pip install --compile`` leaves an image), and without any (``PYTHONDONTWRITEBYTECODE=1``
and copies that hold no ``__pycache__``). Both commands of a pair see the same copies.

    python benchmarks/bench_doctor_ratio.py [--runs 21] [--env sglang==0.5.17 --env vllm==0.28.0]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

FLOOR = "import importlib.metadata, packaging.specifiers, ast, json"
GOAL = 2.5


def copies(python, root, compiled):
    """Copies of this checkout's flashfix and of ``python``'s packaging under ``root``."""
    source = subprocess.run([str(python), "-c", "import os, packaging; print(os.path.dirname(packaging.__file__))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "flashfix", root / "flashfix", ignore=skip)
    shutil.copytree(source, root / "packaging", ignore=skip)
    if compiled:
        subprocess.run([str(python), "-m", "compileall", "-q", str(root)], check=True)
    return root


def wall(cmd, env):
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def measure(python, runs, compiled):
    with tempfile.TemporaryDirectory() as tmp:
        root = copies(python, Path(tmp), compiled)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_") and k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPATH"] = str(root)
        if not compiled:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        doctor, floor = [str(python), "-m", "flashfix", "doctor", "--json"], [str(python), "-c", FLOOR]
        wall(doctor, env), wall(floor, env)  # warm the file cache
        pairs = [(wall(doctor, env), wall(floor, env)) for _ in range(runs)]
    d, f = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    return {"doctor_s": round(d, 4), "floor_s": round(f, 4), "ratio": round(d / f, 2), "runs": runs}


def main():
    import engine_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--env", action="append", help="an engine release of tests/engine_env.py (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = {}
    for req in args.env or ["sglang==0.5.17", "vllm==0.28.0"]:
        python = engine_env.env_python(req)
        for compiled in (True, False):
            r = out["%s, %s" % (req, "compiled" if compiled else "no bytecode")] = measure(python, args.runs, compiled)
            if not args.json:
                print("%-34s doctor %.3f s  floor %.3f s  ratio %.2f (goal <= %.1f)%s" % (
                    "%s, %s" % (req, "compiled" if compiled else "no bytecode"), r["doctor_s"], r["floor_s"],
                    r["ratio"], GOAL, "" if r["ratio"] <= GOAL else "  NOT MET"), flush=True)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
