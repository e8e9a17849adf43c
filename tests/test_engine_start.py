"""Engine-start smoke test: the built wheel, activated only by each engine's own plugin loader
(called twice, as engines may), in a fresh process of a real engine environment. flashfix must
announce itself once and leave each patch in the state its doctor predicted."""

import json
import subprocess

import pytest

import engine_env
from conftest import REPO

EXPECTED_STATE = {"patch": "applied", "fixed-upstream": "fixed-upstream", "not-affected": "not-affected",
                  "unknown-shape": "unknown-shape", "disabled": "disabled", "not-installed": "not-installed"}

DOCTOR = '''
import json, subprocess, sys
out = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--json"], capture_output=True, text=True, check=True)
print("FLASHFIX_RESULT=" + json.dumps(json.loads(out.stdout)))
'''

SMOKE = '''
import importlib, json, sys
assert "flashfix" not in sys.modules
LOADER
assert "flashfix" in sys.modules, "the plugin loader did not load flashfix"
from flashfix import _registry, _plugin
_plugin.register()  # a third activation in the same process
for patch in _registry.load_all():
    for target in patch.targets:
        try:
            importlib.import_module(target)
        except ImportError:
            pass  # a target that this release does not have
import flashfix
print("FLASHFIX_RESULT=" + json.dumps({r["id"]: r["state"] for r in flashfix.status()}))
'''

LOADERS = {
    "vllm": "from vllm.plugins import load_general_plugins\nload_general_plugins()\nload_general_plugins()",
    "sglang": "from sglang.srt.plugins import load_plugins\nload_plugins()\nload_plugins()",
}


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """The built wheel unpacked into a plain directory: importable through PYTHONPATH, entry points
    visible, but its .pth not processed, so the plugin loader is the only way in."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(["uv", "build", "-q", "--wheel", "-o", str(root / "dist"), str(REPO)], check=True)
    wheel = next((root / "dist").glob("*.whl"))
    target = root / "overlay"
    subprocess.run(["uv", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True)
    return target


@pytest.mark.parametrize("requirement", ["vllm==0.28.0", "sglang==0.5.17"])
def test_engine_plugin_loader_activates_flashfix_once(requirement, overlay):
    engine = requirement.split("==")[0]
    (doctor,) = engine_env.run(requirement, DOCTOR, pythonpath=str(overlay))
    (states,) = engine_env.run(requirement, SMOKE.replace("LOADER", LOADERS[engine]), pythonpath=str(overlay))
    stderr = engine_env.run.last_stderr
    assert stderr.count("loaded by an engine plugin loader") == 1, stderr[-3000:]
    for row in doctor:
        if row["verdict"] == "not-installed":
            continue
        assert states[row["id"]] == EXPECTED_STATE[row["verdict"]], (row, states)
        if row["verdict"] == "patch":
            assert stderr.count("applied %s " % row["id"]) == 1
    assert any(row["engine"] == ("vllm" if engine == "vllm" else "sglang") and row["verdict"] != "not-installed"
               for row in doctor)
