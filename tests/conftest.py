"""Shared fixtures. Fake modules live only here, for testing flashfix's own mechanism;
every engine behaviour is tested against the real engines (tests/engine_env.py)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT = "FLASHFIX_RESULT="

FAKE_ENGINE = '''
def helper(a, b):
    return a + b

class Engine:
    def compute(self, x):
        return helper(x, 1)

    def other(self):
        return "other"
'''

FIXED_ENGINE = FAKE_ENGINE.replace("helper(x, 1)", "helper(x, 2)")  # the fake engine once the fix is in

FAKE_PATCHES = '''
import ast
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.registry import Patch, Shape, SetAttr, FIXED, BUGGY, UNKNOWN

calls = []

def probe(trees):
    tree = trees["fakeeng.core"]
    node = _source.find_def(tree, "Engine.compute")
    if node is None:
        return Shape(UNKNOWN, "no Engine.compute")
    if "helper(x, 2)" in ast.unparse(node):
        return Shape(FIXED, "compute already adds 2")
    return Shape(BUGGY, "compute adds 1")

def edit(node, mark):
    call = _source.name_calls(node, "helper")[0]
    call.args[1] = ast.Constant(2)
    _source.insert_before(node, call, mark)

def prepare(modules):
    import os
    calls.append(1)
    mod = modules["fakeeng.core"]
    changes = [_registry.rewrite(mod.Engine.compute, edit, "fake-compute"),
               SetAttr(mod.Engine, "other", lambda self: "patched other")]
    if os.environ.get("FAKE_SECOND_PART") == "break":
        class Broken:
            def __init__(self): self.name = "broken"
            def apply(self): raise RuntimeError("second part cannot apply")
            def undo(self): pass
        changes.append(Broken())
    return changes

PATCHES = (
    Patch(
        id="fake-compute", engine="fakeeng", targets=("fakeeng.core",), versions="<2",
        upstream="https://example.invalid/pr/1", fixed_in="2.0", delete_when="fakeeng 2.0 is the oldest supported",
        summary="compute adds 2", probe=probe, prepare=prepare,
    ),
)
'''


@pytest.fixture
def fake_site(tmp_path):
    """A directory with a fake engine 'fakeeng' (version from FAKE_VERSION, default 1.0) and its patch module."""

    def make(version="1.0", engine_source=FAKE_ENGINE, patches=FAKE_PATCHES, extra=None):
        site = tmp_path / "site"
        (site / "fakeeng").mkdir(parents=True, exist_ok=True)
        (site / "fakeeng" / "__init__.py").write_text("")
        if engine_source is not None:
            (site / "fakeeng" / "core.py").write_text(engine_source)
        for name, text in (extra or {}).items():  # more files, relative to the site
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            (site / name).write_text(text)
        dist = site / ("fakeeng-%s.dist-info" % version)
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeeng\nVersion: %s\n" % version)
        (site / "fake_patches.py").write_text(patches)
        return site

    return make


PRELUDE = '''
import json, sys
def report(**kw):
    print("FLASHFIX_RESULT=" + json.dumps(kw, default=repr), flush=True)
def use_fake():
    import flashfix
    flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
    flashfix.activate()
def state():
    import flashfix
    return {r["id"]: r for r in flashfix.status()}["fake-compute"]
'''


def run_py(code, site=None, env=None, python=sys.executable, check=True):
    """Run ``code`` in a fresh interpreter; returns (results, completed process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    paths = [str(REPO)] + ([str(site)] if site else [])
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    full_env.update(env or {})
    proc = subprocess.run([python, "-c", PRELUDE + textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError("exit %d\nstdout:\n%s\nstderr:\n%s" % (proc.returncode, proc.stdout, proc.stderr))
    results = [json.loads(l[len(RESULT):]) for l in proc.stdout.splitlines() if l.startswith(RESULT)]
    return results, proc


# ``flashfix doctor`` run on a fake site: the fake engine's pack is named in PATCH_MODULES first (an entry-point
# pack for an engine flashfix does not watch is skipped), then the package's own __main__ runs.
FAKE_DOCTOR = ("import runpy, sys, flashfix; flashfix.PATCH_MODULES['fakeeng'] = 'fake_patches'; "
               "sys.argv[0] = 'flashfix'; runpy.run_module('flashfix', run_name='__main__', alter_sys=True)")

# Activated first (the code read before the module runs, ``prepare_ahead``), or the engine imported first (from
# the loaded function, ``prepare``).
IMPORT_ORDERS = {"ahead": "use_fake()\nimport fakeeng.core as core", "loaded": "import fakeeng.core as core\nuse_fake()"}


def fake_doctor_row(site, strict=False, patch_id="fake-compute"):
    """(exit status, ``patch_id``'s row) of ``flashfix doctor --json`` on ``site`` (the engine not imported)."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
               PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    proc = subprocess.run([sys.executable, "-c", FAKE_DOCTOR, "doctor", "--json"] + ["--strict"] * strict,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, {r["id"]: r for r in json.loads(proc.stdout)}[patch_id]
