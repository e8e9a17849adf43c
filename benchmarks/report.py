"""Every overhead of flashfix, measured side by side in one run, printed as one table.

    python benchmarks/report.py [--quick]

Runs, on this machine: the start-up benchmark (bare interpreter, the floor of any ``.pth``
activation, flashfix; interleaved), ``import flashfix``, ``flashfix doctor`` in each engine
environment of the test suite (best of 7), the per-call costs on the engines' hot paths
(benchmarks/bench_vllm_forward.py, bench_sglang_forward_extend.py) and the resident memory
added to an engine process (bench_memory.py). Each underlying benchmark also runs alone.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(REPO / "tests"))


def run(args, **kw):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=REPO, **kw)
    if proc.returncode:
        raise SystemExit("%s failed:\n%s%s" % (args[0], proc.stdout[-2000:], proc.stderr[-2000:]))
    return proc.stdout


def doctor_time(python, extra_env=None, args=(), runs=7):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env.update(PYTHONPATH=str(REPO), **(extra_env or {}))
    best = None
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([str(python), "-m", "flashfix", "doctor", "--json", *args], env=env, capture_output=True,
                       check=True, cwd="/")
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    return best


def pass_time(python, runs=7):
    best = None
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([str(python), "-c", "pass"], check=True)
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    return best


def main():
    import engine_env

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    args = parser.parse_args()
    rows = []

    startup = run([BENCH / "bench_startup.py", "--runs", 20 if args.quick else 60])
    table = {m.group(1): (float(m.group(2)), float(m.group(3)), m.group(4)) for m in re.finditer(
        r"^\| ([^|]+?) \| ([\d.]+) ms \| ([\d.]+) \| ([+-][\d.]+ ms) \|$", startup, re.M)}
    for label, (ms, ratio, over) in table.items():
        rows.append(("start-up, `python -c pass`", label, "%.2f ms, ratio %.3f to bare, %s over the floor"
                     % (ms, ratio, over)))
    for line in startup.splitlines():
        if line.startswith("`import flashfix` alone"):
            rows.append(("`import flashfix`", "compiled, no engine", line.split("median ")[-1]))
        if line.startswith("processing the installed site-packages") and ("floor" in line or "compiled:" in line):
            rows.append(("site-packages processing, in-process", line.split("in-process, ")[1].split(":")[0],
                         line.split(": ", 1)[1]))

    sglang = engine_env.env_python("sglang==0.5.17")
    vllm = engine_env.env_python("vllm==0.28.0")
    bare = Path(sys.executable)
    rows.append(("doctor (best of 7)", "`python -c pass` for scale", "%.3f s" % pass_time(bare)))
    rows.append(("doctor (best of 7)", "no engine", "%.3f s" % doctor_time(bare)))
    rows.append(("doctor (best of 7)", "SGLang 0.5.17 + FlashInfer 0.6.15.post1", "%.3f s" % doctor_time(sglang)))
    rows.append(("doctor (best of 7)", "vLLM 0.28.0 + FlashInfer 0.6.16.post3", "%.3f s" % doctor_time(vllm)))
    sites = [str(next((p.parent.parent / "lib").glob("python*/site-packages"))) for p in (sglang, vllm)]
    rows.append(("doctor (best of 7)", "vLLM + SGLang + FlashInfer (`--path` both site-packages)",
                 "%.3f s" % doctor_time(bare, args=("--path", sites[0], "--path", sites[1]))))

    calls = ["--calls", 500, "--rounds", 7] if args.quick else []
    for line in run([BENCH / "bench_vllm_forward.py", *calls]).splitlines():
        if line.startswith("| forward,") or line.startswith("| call statement"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append(("per call, vLLM pre-fix shape", cells[0], "%s ns -> %s ns, added %s ns" % tuple(cells[1:4])))
        if line.startswith("_get_prefill_wrapper"):
            rows.append(("per call, vLLM pre-fix shape", "prefill factory, wrapper cached", line.split(": ", 1)[1]))
    rounds = ["--rounds", 11, "--calls", 1000] if args.quick else []
    data = json.loads(run([BENCH / "bench_sglang_forward_extend.py", *rounds]).strip().splitlines()[-1])
    for name, r in data["results"].items():
        rows.append(("per call, SGLang 0.5.17 `forward_extend`", name, "%.0f ns -> %.0f ns, added %+.0f ns (paired)"
                     % (r["released_ns"], r["patched_ns"], r["added_paired_ns"])))

    memory = json.loads(run([BENCH / "bench_memory.py", "--runs", 2 if args.quick else 3, "--json"]))
    for r in memory:
        rows.append(("memory (RSS after importing the targets)", "%s (%s)" % (r["release"], ", ".join(
            "%s %s" % kv for kv in sorted(r["states"].items()))), "%+.2f MiB over FLASHFIX_DISABLE=all (%.1f MiB), "
            "peak %+.2f MiB" % (r["rss_added_mib"], r["rss_disabled_mib"], r["hwm_added_mib"])))

    print("flashfix overheads: Python %s on %s, %d CPUs (%s)" % (
        platform.python_version(), platform.machine(), os.cpu_count(), platform.platform()))
    print()
    print("| what | case | figure |")
    print("| --- | --- | --- |")
    for what, case, figure in rows:
        print("| %s | %s | %s |" % (what, case, figure))


if __name__ == "__main__":
    main()
