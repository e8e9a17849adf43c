"""How long ``flashfix doctor --path <wheel>`` takes: whole command, and where the time goes.

For each case the command ``python -m flashfix doctor --json --path ...`` is run ``--runs``
times in fresh processes (flashfix from this checkout, bytecode cached), and the median,
minimum and maximum wall times are printed; then, in this process, one reading of the same
wheels split into opening the zip, the doctor's work (reading and parsing the sources, the
probes) and hashing the whole wheel for the provenance. ``--python`` on an engine
environment is timed the same way when one exists.

    PYTHONPATH=. python benchmarks/bench_doctor_path.py [--runs 15]

Wheels come from ~/.cache/flashfix-wheels (tests/vet_helpers.py downloads them).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import vet_helpers  # noqa: E402

CASES = [
    ("SGLang 0.5.17 wheel", ["sglang==0.5.17"]),
    ("FlashInfer 0.6.17 wheel", ["flashinfer-python==0.6.17"]),
    ("FlashInfer 0.7.4 wheel (101 MB)", ["flashinfer-python==0.7.4"]),
    ("SGLang 0.5.17 + FlashInfer 0.6.15.post1 wheels", ["sglang==0.5.17", "flashinfer-python==0.6.15.post1"]),
]


def wall(args, env, runs):
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "flashfix", *args], env=env, check=True, stdout=subprocess.DEVNULL,
                       cwd=str(REPO))
        times.append(time.perf_counter() - start)
    return times[1:]  # the first run warms the page cache and the bytecode cache


def breakdown(wheels):
    from flashfix.tools import doctor as _doctor
    from flashfix.core import paths as _paths

    start = time.perf_counter()
    readers = [_paths.open_path(w) for w in wheels]
    reader = readers[0] if len(readers) == 1 else _paths.Composite(readers)
    opened = time.perf_counter()
    _doctor.diagnose(reader)
    diagnosed = time.perf_counter()
    hashed_start = time.perf_counter()
    for r in readers:
        r._archive_sha256 = None
        r.archive_sha256()
    hashed = time.perf_counter()
    return opened - start, diagnosed - opened, hashed - hashed_start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    print("python %s, %d runs per case (median / min / max wall time of the whole command)" % (
        sys.version.split()[0], args.runs))
    for label, requirements in CASES:
        wheels = [vet_helpers.wheel(r) for r in requirements]
        command = ["doctor", "--json"] + [x for w in wheels for x in ("--path", str(w))]
        times = wall(command, env, args.runs)
        open_s, doctor_s, hash_s = breakdown(wheels)
        print("%-48s %6.3f s  (min %.3f, max %.3f)   in-process: open zip %.3f s, doctor %.3f s "
              "(of which wheel sha256 %.3f s)" % (label, statistics.median(times), min(times), max(times),
                                                  open_s, doctor_s, hash_s))
    engine = Path.home() / ".cache" / "flashfix-engines" / "sglang-0.5.17" / "bin" / "python"
    if engine.exists():
        times = wall(["doctor", "--json", "--python", str(engine)], env, args.runs)
        print("%-48s %6.3f s  (min %.3f, max %.3f)" % ("--python (SGLang 0.5.17 environment)",
                                                     statistics.median(times), min(times), max(times)))
        inside = []
        for _ in range(args.runs + 1):
            start = time.perf_counter()
            subprocess.run([str(engine), "-m", "flashfix", "doctor", "--json"], env=env, check=True,
                           stdout=subprocess.DEVNULL, cwd=str(REPO))
            inside.append(time.perf_counter() - start)
        inside = inside[1:]
        print("%-48s %6.3f s  (min %.3f, max %.3f)" % ("inside that environment (for comparison)",
                                                     statistics.median(inside), min(inside), max(inside)))


if __name__ == "__main__":
    main()
