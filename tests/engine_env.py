"""Real engine environments for the tests: one virtual environment per engine release.

Each release is resolved as of its own date (``uv pip install --exclude-newer``), because
today's dependencies break older releases at import time (see README, "Engine
environments"). Environments live under ``$FLASHFIX_ENGINE_ROOT`` (default
``~/.cache/flashfix-engines``) and share uv's cache, so a second install of a release takes
seconds. Usable as a script: ``python tests/engine_env.py vllm==0.28.0 sglang==0.5.17``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# The interpreter running the tests: uv cannot download one here, and 3.11 is what CI has.
PYTHON = sys.executable

# release -> (resolve-as-of date, extra uv arguments). The date is the wheel's date plus three days.
RELEASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm==0.27.1": ("2026-08-14", ()),
    "vllm==0.28.0": ("2026-08-28", ()),
    "vllm==0.29.0": ("2026-09-12", ()),
    "vllm==0.30.0": ("2026-09-25", ()),
    "vllm==0.33.0": ("2026-11-04", ()),
    "sglang==0.5.11": ("2026-05-10", ()),
    "sglang==0.5.13": ("2026-06-14", ()),
    "sglang==0.5.14": ("2026-06-29", ()),
    "sglang==0.5.17": ("2026-08-11", ()),
    # 0.5.18 pins cuda-tile==1.6.0rc5, a stub that downloads from an unreachable host; the
    # real cuda-tile 1.6.0 that replaces it was published on 2026-09-10, after the cutoff.
    "sglang==0.5.18": ("2026-08-24", ("--override", "{overrides}", "--exclude-newer-package", "cuda-tile=2026-09-12")),
    "sglang==0.5.23": ("2026-11-02", ()),
}
OVERRIDES = "cuda-tile==1.6.0\n"


def root() -> Path:
    return Path(os.environ.get("FLASHFIX_ENGINE_ROOT", Path.home() / ".cache" / "flashfix-engines"))


def uv() -> str:
    beside = Path(sys.executable).with_name("uv")  # the test extra's, not a shim that depends on PYENV_ROOT
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found:
        return found
    raise RuntimeError("uv is not on PATH; run the README's test command, which installs it")


def env_python(requirement: str) -> Path:
    """Return the python of a ready environment for ``requirement`` (e.g. ``vllm==0.28.0``), creating it if needed."""
    if requirement not in RELEASES:
        raise KeyError(f"no resolution date recorded for {requirement!r}; add it to RELEASES")
    date, extra = RELEASES[requirement]
    venv = root() / requirement.replace("==", "-")
    python = venv / "bin" / "python"
    marker = venv / ".flashfix-ready"
    if marker.exists():
        return python
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([uv(), "venv", "-q", "--python", PYTHON, str(venv)], check=True)
    overrides = venv / "overrides.txt"
    overrides.write_text(OVERRIDES)
    args = [a.format(overrides=overrides) for a in extra]
    subprocess.run(
        [uv(), "pip", "install", "-q", "--python", str(python), "--exclude-newer", date, *args, requirement],
        check=True,
    )
    marker.write_text(requirement + "\n")
    return python


if __name__ == "__main__":
    for req in sys.argv[1:] or list(RELEASES):
        print(req, env_python(req), flush=True)


def site_packages(python) -> Path:
    """The site-packages folder of the virtual environment whose interpreter is ``python``."""
    import glob

    (found,) = glob.glob(str(Path(python).parent.parent / "lib" / "python*" / "site-packages"))
    return Path(found)


def installed_path(requirement: str, relative: str = "") -> Path:
    """``relative`` (e.g. ``"sglang/srt/layers/attention/flashinfer_backend.py"``) inside the site-packages
    of ``requirement``'s environment (built if missing); the site-packages folder itself for ``""``."""
    found = site_packages(env_python(requirement))
    return found / relative if relative else found


REPO = Path(__file__).resolve().parents[1]
RESULT = "FLASHFIX_RESULT="


def run(requirement: str, code: str, env: dict | None = None, timeout: int = 900, pythonpath: str | None = None) -> list:
    """Run ``code`` in a fresh process of ``requirement``'s environment, flashfix importable from
    this checkout. The code reports by printing lines ``FLASHFIX_RESULT=<json>``; their values
    come back as a list. A non-zero exit raises with the process's output."""
    import json

    python = env_python(requirement)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    full_env.update({"PYTHONPATH": pythonpath or str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    proc = subprocess.run([str(python), "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{requirement}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    run.last_stderr = proc.stderr
    return [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
