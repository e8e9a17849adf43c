"""Start-up cost of flashfix's auto-activation, and the time of ``import flashfix``.

Builds the wheel, makes four virtual environments from the same interpreter (flashfix
absent; the *floor*: a one-line ``.pth`` importing a 4-line compiled module, the least any
``.pth`` activation can cost; flashfix installed with bytecode compiled at install, as in an
image; installed without compiled bytecode, which under PYTHONDONTWRITEBYTECODE=1 recompiles
at every start), then times ``python -c pass`` in them, interleaved, and prints medians,
ratios to the bare interpreter and the difference to the floor.

    python benchmarks/bench_startup.py [--runs 40] [--json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_env(root, name, wheel=None, compile_bytecode=True):
    env = root / name
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env)], check=True)
    if wheel:
        args = ["uv", "pip", "install", "-q", "--python", str(env / "bin" / "python"), str(wheel)]
        if compile_bytecode:
            args.insert(3, "--compile-bytecode")
        subprocess.run(args, check=True)
    return env / "bin" / "python"


FLOOR_MODULE = "import sys\n\nvalue = 1\nsys.flags\n"


def make_floor(root):
    """The floor: a .pth line importing a 4-line module, compiled."""
    python = make_env(root, "floor")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "ff_floor.py").write_text(FLOOR_MODULE)
    Path(purelib, "ff_floor.pth").write_text("import ff_floor\n")
    subprocess.run([str(python), "-m", "compileall", "-q", str(Path(purelib, "ff_floor.py"))], check=True)
    return python


def wall(cmd, env):
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=tempfile.gettempdir())
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("FLASHFIX_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run(["uv", "build", "-q", "--wheel", "-o", str(root / "dist"), str(REPO)], check=True)
        wheel = next((root / "dist").glob("*.whl"))
        pythons = {
            "absent": make_env(root, "absent"),
            "floor": make_floor(root),
            "compiled": make_env(root, "compiled", wheel, True),
            "uncompiled": make_env(root, "uncompiled", wheel, False),
        }
        for python in pythons.values():  # warm the page cache
            for _ in range(3):
                wall([str(python), "-c", "pass"], env)
        times = {name: [] for name in pythons}
        for _ in range(args.runs):
            for name, python in pythons.items():
                times[name].append(wall([str(python), "-c", "pass"], env))
        # import flashfix alone, in-process: the environment without flashfix, the compiled package on PYTHONPATH
        site = subprocess.run([str(pythons["compiled"]), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
        probe = ("import time; t = time.perf_counter(); import flashfix; "
                 "print((time.perf_counter() - t) * 1e3)")
        imports = []
        for _ in range(args.runs):
            out = subprocess.run([str(pythons["absent"]), "-c", probe], env=dict(env, PYTHONPATH=site),
                                 capture_output=True, text=True, check=True, cwd=tmp).stdout
            imports.append(float(out))
        # the .pth processing alone, timed in-process (far less noisy than whole-process wall time):
        # site.addsitedir() on the installed site-packages, from an interpreter started without it
        addsite = {}
        for name in ("absent", "floor", "compiled", "uncompiled"):
            purelib = subprocess.run([str(pythons[name]), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     env=env, capture_output=True, text=True, check=True).stdout.strip()
            code = ("import site, sys, time; t = time.perf_counter(); site.addsitedir(%r); "
                    "print((time.perf_counter() - t) * 1e3)" % purelib)
            addsite[name] = [float(subprocess.run([str(pythons["absent"]), "-c", code], env=env, capture_output=True,
                                                  text=True, check=True, cwd=tmp).stdout) for _ in range(args.runs)]
    base = statistics.median(times["absent"])
    labels = {"absent": "bare (flashfix absent)", "floor": "floor: .pth + 4-line compiled module",
              "compiled": "flashfix, bytecode compiled at install", "uncompiled": "flashfix, no compiled bytecode"}
    figures = {
        "python": sys.version.split()[0], "runs": args.runs,
        "wall_ms": {name: {"label": labels[name], "median": statistics.median(times[name]) * 1e3,
                           "ratio_to_bare": statistics.median(times[name]) / base,
                           "over_floor_paired": statistics.median(a - b for a, b in zip(times[name], times["floor"])) * 1e3}
                    for name in pythons},
        "import_flashfix_ms": statistics.median(imports),
        "site_packages_in_process_ms": {name: {"median": statistics.median(v), "min": min(v)}
                                        for name, v in addsite.items()},
    }
    if args.json:
        print(json.dumps(figures))
        return
    print("python %s, %d interleaved runs each, PYTHONDONTWRITEBYTECODE=1" % (figures["python"], args.runs))
    print("| environment | median `python -c pass` | ratio to bare | over the floor (paired median) |")
    print("| --- | --- | --- | --- |")
    for row in figures["wall_ms"].values():
        print("| %s | %.2f ms | %.3f | %+.3f ms |" % (row["label"], row["median"], row["ratio_to_bare"],
                                                    row["over_floor_paired"]))
    print("floor over bare: %+.3f ms (paired median)"
          % (statistics.median(a - b for a, b in zip(times["floor"], times["absent"])) * 1e3))
    print("`import flashfix` alone (bytecode compiled, hook installed, no engine): median %.3f ms"
          % figures["import_flashfix_ms"])
    for name, values in figures["site_packages_in_process_ms"].items():
        print("processing the installed site-packages (flashfix.pth included), in-process, %s: median %.3f ms, "
              "min %.3f ms" % (name, values["median"], values["min"]))

if __name__ == "__main__":
    main()
