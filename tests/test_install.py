"""The built wheel, installed into a fresh virtual environment: auto-activation in every
kind of Python process, the console script, and the engines' plugin entry points."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

CHECK = '''
import sys
finder = any(getattr(f, "flashfix_finder", False) for f in sys.meta_path)
heavy = [m for m in ("torch", "vllm", "sglang", "flashinfer", "wrapt", "flashfix") if m in sys.modules]
import flashfix
print("CHILD", "_flashfix_boot" in sys.modules, finder, heavy, flashfix.watched())
'''


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    dist = root / "dist"
    subprocess.run(["uv", "build", "-q", "-o", str(dist), str(REPO)], check=True)  # sdist, and a wheel built from it
    wheel = next(dist.glob("flashfix-*.whl"))
    assert next(dist.glob("flashfix-*.tar.gz"))
    env_dir = root / "venv"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), "--compile-bytecode", str(wheel)], check=True)
    return env_dir


def _run(venv, code, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("FLASHFIX_")}
    env.update(kw.pop("env", {}))
    return subprocess.run([str(venv / "bin" / "python"), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120, **kw)


def _child_line(out):
    lines = [l for l in out.splitlines() if l.startswith("CHILD")]
    assert len(lines) == 1, out
    return lines[0]


EXPECTED = "CHILD True True [] ['flashinfer', 'sglang', 'vllm']"  # boot loaded, finder in place, nothing else


def test_fresh_interpreter_is_activated_without_importing_anything_heavy(venv):
    proc = _run(venv, CHECK)
    assert proc.returncode == 0, proc.stderr
    assert _child_line(proc.stdout) == EXPECTED
    assert proc.stderr == ""


def test_multiprocessing_spawn_child_is_activated(venv):
    code = '''
        import multiprocessing as mp, subprocess, sys
        CHECK = %r
        def child():
            exec(CHECK, {})
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            p = ctx.Process(target=child)
            p.start(); p.join()
            sys.exit(p.exitcode)
    ''' % CHECK
    script = venv / "spawn_child.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run([str(venv / "bin" / "python"), str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _child_line(proc.stdout) == EXPECTED


def test_subprocess_child_is_activated(venv):
    proc = _run(venv, '''
        import subprocess, sys
        out = subprocess.run([sys.executable, "-c", %r], capture_output=True, text=True).stdout
        print(out, end="")
    ''' % CHECK)
    assert proc.returncode == 0, proc.stderr
    assert _child_line(proc.stdout) == EXPECTED


def test_disable_all_skips_even_the_hook(venv):
    proc = _run(venv, CHECK,
                env={"FLASHFIX_DISABLE": "all"})
    assert _child_line(proc.stdout) == "CHILD True False [] []"


def test_broken_package_never_breaks_interpreter_start(venv, tmp_path):
    # A flashfix that raises on import (shadowing the installed one) must not stop Python from
    # starting (it is not even imported then), nor the engine's import that loads it.
    bad = tmp_path / "flashfix"
    bad.mkdir()
    (bad / "__init__.py").write_text("raise RuntimeError('broken install')\n")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    proc = _run(venv, "print('STARTED')", env={"PYTHONPATH": str(tmp_path)}, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip() == "STARTED" and proc.stderr == ""
    proc = _run(venv, "import vllm; print('IMPORTED')", env={"PYTHONPATH": str(tmp_path)}, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip() == "IMPORTED"
    assert proc.stderr.count("flashfix: auto-activation skipped: RuntimeError('broken install')") == 1
    assert "Traceback" not in proc.stderr


def test_console_script_and_module_entry(venv):
    doctor = subprocess.run([str(venv / "bin" / "flashfix"), "doctor", "--json"], capture_output=True, text=True)
    assert doctor.returncode == 0, doctor.stderr
    rows = json.loads(doctor.stdout)
    assert {r["id"] for r in rows} >= {"vllm-sink-prefill", "sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune",
                                       "sglang-vision-config"}
    for row in rows:
        assert {"id", "engine", "engine_version", "verdict", "reason"} <= set(row)
        assert row["verdict"] == "not-installed"
    version = subprocess.run([str(venv / "bin" / "python"), "-m", "flashfix", "--version"], capture_output=True, text=True)
    import flashfix

    assert version.stdout.strip() == "flashfix %s" % flashfix.__version__


def test_wheel_ships_startup_files_and_plugin_entry_points(venv):
    proc = _run(venv, '''
        import sysconfig, os
        from importlib.metadata import entry_points
        site = sysconfig.get_paths()["purelib"]
        print(sorted(f for f in os.listdir(site) if f.startswith("flashfix.")))
        # PEP 829 (Python 3.15+): the .start file names an entry point that resolves and runs
        import pkgutil
        (entry,) = open(os.path.join(site, "flashfix.start")).read().split()
        pkgutil.resolve_name(entry)()
        for group in ("vllm.general_plugins", "sglang.srt.plugins"):
            (ep,) = [e for e in entry_points(group=group) if e.name == "flashfix"]
            ep.load()()
            print(group, ep.value)
    ''')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "['flashfix.pth', 'flashfix.start']",  # and _flashfix_boot.py (checked in the first test)
        "vllm.general_plugins flashfix._plugin:register",
        "sglang.srt.plugins flashfix._plugin:register",
    ]
