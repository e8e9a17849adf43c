"""Resident memory that flashfix adds to an engine process.

In a real engine environment, a fresh process imports the patch targets (flashfix active, or
``FLASHFIX_DISABLE=all``), alternating, and reports its resident set (``VmRSS``) and peak
(``VmHWM``) after a ``gc.collect()``, and the bytes in pymalloc's allocated blocks (the small
objects alive, whatever arenas the allocator keeps around them). Prints the medians per column and the median of the
paired differences; then the same process imports what a serving process imports next (``SERVING``)
and reports its resident set again. flashfix is imported from a copy with its bytecode compiled (as installed
in an image), so the figure is flashfix's, not the compiler's.

    python benchmarks/bench_memory.py [--runs 3] [--release sglang==0.5.17 --release vllm==0.28.0]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

TARGETS = {
    "sglang": ["sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.configs.model_config",
               "sglang.srt.model_executor.runner.flashinfer_autotune", "sglang.srt.model_executor.model_runner"],
    "vllm": ["vllm.v1.attention.backends.flashinfer"],
}

# Then what a serving process imports next (the engine entry point, scheduler, worker): memory the
# parser and compiler freed while patching is reused there, so the second figure is what stays.
SERVING = {
    "sglang": ["sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker"],
    "vllm": ["vllm.entrypoints.llm", "vllm.v1.engine.core"],
}

CHILD = r'''
import gc, importlib, json, sys


def imported(names):
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {key: int(status[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def blocks():
    """KiB in pymalloc's allocated blocks (the small objects alive), read after the RSS; None without
    pymalloc (``PYTHONMALLOC=malloc``)."""
    import os, re, tempfile
    saved, out = os.dup(2), tempfile.TemporaryFile()
    os.dup2(out.fileno(), 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    out.seek(0)
    found = re.search(rb"# bytes in allocated blocks\s*=\s*([\d,]+)", out.read())
    return int(found.group(1).replace(b",", b"")) // 1024 if found else None


first = imported(%r)
first["blocks"] = blocks()
states = {}
if "flashfix" in sys.modules:
    states = {r["id"]: r["state"] for r in sys.modules["flashfix"].status()}
then = imported(%r)
print("RESULT=" + json.dumps({"rss": first["VmRSS"], "hwm": first["VmHWM"], "blocks": first["blocks"],
                             "serving": then["VmRSS"], "states": states}))
'''


def compiled_copy(root):
    """flashfix copied with its bytecode compiled, as an image installs it: under
    PYTHONDONTWRITEBYTECODE=1 the checkout's modules would be compiled in every process, and
    the compiler's memory would count as flashfix's."""
    shutil.copytree(REPO / "flashfix", Path(root) / "flashfix", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(root) / "flashfix")], check=True)
    return root


def measure(requirement, runs, path):
    import engine_env

    python = engine_env.env_python(requirement)
    engine = requirement.split("==")[0]
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    base.update(PYTHONPATH=str(path), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", FLASHFIX_LOG_LEVEL="WARNING")
    columns = {"active": "import flashfix\n", "disabled": ""}
    values = {name: [] for name in columns}
    states = None
    for _ in range(runs):
        for name, prefix in columns.items():
            env = dict(base, FLASHFIX_DISABLE="all") if name == "disabled" else base
            proc = subprocess.run([str(python), "-c", prefix + CHILD % (TARGETS[engine], SERVING[engine])], env=env,
                                  capture_output=True, text=True, timeout=900)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT=")]
            if not line:
                raise SystemExit("%s: child failed:\n%s" % (requirement, proc.stderr[-3000:]))
            result = json.loads(line[0][7:])
            values[name].append(result)
            if name == "active":
                states = result["states"]
    row = {"release": requirement, "runs": runs, "states": {k: v for k, v in (states or {}).items()
                                                             if k.startswith(engine)}}
    for key in ("rss", "hwm", "blocks", "serving"):
        if any(v[key] is None for v in values["active"] + values["disabled"]):
            row[key + "_active_mib"] = row[key + "_disabled_mib"] = row[key + "_added_mib"] = None
            continue
        row[key + "_active_mib"] = statistics.median(v[key] for v in values["active"]) / 1024
        row[key + "_disabled_mib"] = statistics.median(v[key] for v in values["disabled"]) / 1024
        row[key + "_added_mib"] = statistics.median(
            a[key] - d[key] for a, d in zip(values["active"], values["disabled"])) / 1024
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--release", action="append")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = compiled_copy(tmp)
        rows = [measure(r, args.runs, path) for r in (args.release or ["sglang==0.5.17", "vllm==0.28.0"])]
    if args.json:
        print(json.dumps(rows))
        return
    print("| release | patches | RSS active / disabled | RSS added | peak RSS added | small objects added | added, serving modules imported too |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        blocks = "n/a" if r["blocks_added_mib"] is None else "%+.2f MiB" % r["blocks_added_mib"]
        print("| %s | %s | %.1f / %.1f MiB | %+.2f MiB | %+.2f MiB | %s | %+.2f MiB |" % (
            r["release"], ", ".join("%s %s" % kv for kv in sorted(r["states"].items())), r["rss_active_mib"],
            r["rss_disabled_mib"], r["rss_added_mib"], r["hwm_added_mib"], blocks, r["serving_added_mib"]))
    print("(%d alternating fresh processes per column, medians; targets imported: %s; then: %s)" % (
        args.runs, "; ".join("%s: %s" % (k, ", ".join(v)) for k, v in TARGETS.items()),
        "; ".join("%s: %s" % (k, ", ".join(v)) for k, v in SERVING.items())))


if __name__ == "__main__":
    main()
