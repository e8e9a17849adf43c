"""Regression tests for the hardening issue (#9): each scenario failed on flashfix 0.1.0.

Every scenario that depends on import order runs in a fresh interpreter (conftest.run_py),
with the fake engine ``fakeeng`` that conftest builds; the installs (setuptools editable,
path editable, sourceless) are real installs made by real build back-ends.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import FAKE_ENGINE, FAKE_PATCHES, REPO, run_py

# --- 1. __future__ flags survive the recompile ------------------------------------------------

FUTURE_ENGINE = '''from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nowhere import Missing


def helper(a, b):
    return a + b


class Engine:
    def compute(self, x):
        def inner(y: Missing) -> Missing:
            return y

        return helper(inner(x), 1)

    def other(self):
        return "other"
'''


def test_future_flags_kept(fake_site):
    site = fake_site(engine_source=FUTURE_ENGINE)
    (r,), _ = run_py('''
        import __future__
        import fakeeng.core as core
        flag = __future__.annotations.compiler_flag
        before = bool(core.Engine.compute.__code__.co_flags & flag)
        use_fake()
        value = core.Engine().compute(1)  # 0.1.0: NameError: name 'Missing' is not defined
        report(state=state()["state"], value=value, before=before,
               after=bool(core.Engine.compute.__code__.co_flags & flag))
    ''', site)
    assert r == {"state": "applied", "value": 3, "before": True, "after": True}


# --- 2. the whole code-object tree is compared before a swap -----------------------------------

TAGGED_ENGINE = FAKE_ENGINE.replace("        return helper(x, 1)", '''        tag = "abc"
        def nested():
            return 7.5
        return helper(x, 1)''')


@pytest.mark.parametrize("old, new", [('"abc"', '"xyz"'), ("7.5", "8.5"), ("tag = ", "tog = ")])
def test_constant_or_local_edited_after_import_is_refused(fake_site, old, new):
    site = fake_site(engine_source=TAGGED_ENGINE)
    (r,), _ = run_py('''
        import fakeeng.core as core, pathlib
        code = core.Engine.compute.__code__
        p = pathlib.Path(core.__file__)
        p.write_text(p.read_text().replace(%r, %r, 1))
        use_fake()
        report(state=state()["state"], reason=state()["reason"], same=core.Engine.compute.__code__ is code)
    ''' % (old, new), site)
    assert r["state"] == "unknown-shape" and r["same"], r
    assert "differs from the loaded code" in r["reason"]


# --- 3. functions that name themselves --------------------------------------------------------

SELF_NAMING_ENGINE = FAKE_ENGINE.replace("        return helper(x, 1)", '''        assert isinstance(self, Engine)
        return helper(x, 1)''')


def test_method_naming_its_own_class_is_patched(fake_site):
    site = fake_site(engine_source=SELF_NAMING_ENGINE)
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], reason=state()["reason"], value=core.Engine().compute(1))
    ''', site)
    assert (r["state"], r["value"]) == ("applied", 3), r


SELF_CALLING = '''
def countdown(n):
    return 0 if n <= 0 else 1 + countdown(n - 1)


def make(base):
    def walk(n):
        return base if n <= 0 else walk(n - 1)
    return walk


class Tree:
    def depth(self, n):
        return 0 if n <= 0 else Tree.depth(self, n - 1) + 1
'''


def test_rewrite_accepts_recursion_and_self_reference(tmp_path):
    (tmp_path / "ff_self.py").write_text(SELF_CALLING)
    code = '''
        import sys
        sys.path.insert(0, %r)
        import ff_self
        from flashfix.core import source as _source
        out = {}
        for name, func in (("countdown", ff_self.countdown), ("walk", ff_self.make(5)), ("depth", ff_self.Tree.depth)):
            marked, plain = _source.rewrite(func, lambda node: None)
            out[name] = _source.code_difference(plain, func.__code__)
        report(**out)
    ''' % str(tmp_path)
    (r,), _ = run_py(code)
    assert r == {"countdown": None, "walk": None, "depth": None}


# --- 4 and 5. kinds of install: doctor equals runtime -----------------------------------------

DOCTOR_AND_RUNTIME = '''
    import flashfix
    from flashfix.tools import doctor as _doctor
    use_fake()
    rows, _ = _doctor.diagnose()
    doctor = {x["id"]: [x["verdict"], x["reason"]] for x in rows}["fake-compute"]
    waiting = state()["state"]
    import fakeeng.core as core
    try:
        value = core.Engine().compute(1)
    except Exception as exc:
        value = repr(exc)
    report(doctor=doctor, waiting=waiting, state=state()["state"], reason=state()["reason"], value=value,
           heavy=sorted(m for m in ("torch", "vllm", "sglang") if m in sys.modules))
'''


def test_sourceless_install_is_unknown_shape_and_strict_fails(fake_site):
    site = fake_site()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-b", str(site / "fakeeng")], check=True)
    for source in (site / "fakeeng").glob("*.py"):
        source.unlink()
    (r,), _ = run_py(DOCTOR_AND_RUNTIME, site)
    assert r["doctor"][0] == "unknown-shape" and "source not available" in r["doctor"][1], r
    assert r["state"] == "unknown-shape" and "source not available" in r["reason"], r
    assert r["value"] == 2
    _, proc = run_py("use_fake(); import fakeeng.core", site, env={"FLASHFIX_STRICT": "1"}, check=False)
    assert proc.returncode != 0 and "PatchError" in proc.stderr and "source not available" in proc.stderr


def _uv():
    import shutil

    return shutil.which("uv") or pytest.fail("uv is not on PATH: run the README's test command")


PYPROJECTS = {
    "setuptools": '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
                  '[project]\nname = "fakeeng"\nversion = "1.0"\n[tool.setuptools]\npackages = ["fakeeng"]\n',
    "hatchling": '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
                 '[project]\nname = "fakeeng"\nversion = "1.0"\n[tool.hatch.build.targets.wheel]\npackages = ["fakeeng"]\n',
}


@pytest.mark.parametrize("backend", ["setuptools", "hatchling", "regular"])
def test_install_kinds_doctor_equals_runtime(tmp_path, backend):
    """A real editable install by setuptools (flat layout: its __editable___ finder on
    sys.meta_path), by hatchling (a .pth path entry), and a regular install: the doctor's
    verdict, the state before import and the runtime state agree, and the bug is fixed."""
    project = tmp_path / "project"
    (project / "fakeeng").mkdir(parents=True)
    (project / "fakeeng" / "__init__.py").write_text("")
    (project / "fakeeng" / "core.py").write_text(FAKE_ENGINE)
    (project / "pyproject.toml").write_text(PYPROJECTS.get(backend, PYPROJECTS["hatchling"]))
    venv = tmp_path / "venv"
    subprocess.run([_uv(), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    args = ["packaging", "-e", str(project)] if backend != "regular" else ["packaging", str(project)]
    subprocess.run([_uv(), "pip", "install", "-q", "--python", str(python), *args], check=True)
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "fake_patches.py").write_text(FAKE_PATCHES)
    if backend == "setuptools":  # the layout under test: a meta-path finder, no path entry
        finders = subprocess.run([str(python), "-c", "import sys; print([getattr(f, \"__module__\", \"\") for f in sys.meta_path])"],
                                 capture_output=True, text=True, check=True).stdout
        assert "__editable___fakeeng" in finders, finders
    (r,), _ = run_py(DOCTOR_AND_RUNTIME, patches, python=str(python))
    assert r["doctor"][0] == "patch", r
    assert r["waiting"] == "waiting"
    assert r["state"] == "applied" and r["value"] == 3, r


# --- 6. strict mode cannot be bypassed --------------------------------------------------------

def test_strict_import_fails_every_time(fake_site):
    site = fake_site(engine_source="class Engine:\n    pass\n")
    (r,), _ = run_py('''
        use_fake()
        outcomes = []
        for attempt in range(3):
            try:
                import fakeeng.core
                outcomes.append("imported")
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        report(outcomes=outcomes, state=state()["state"])
    ''', site, env={"FLASHFIX_STRICT": "1"})
    assert r == {"outcomes": ["PatchError"] * 3, "state": "unknown-shape"}


def test_strict_malformed_value_fails_every_time(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        outcomes = []
        for attempt in range(3):
            try:
                import fakeeng.core
                outcomes.append("imported")
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        report(outcomes=outcomes, patched="fakeeng.core" in sys.modules)
    ''', site, env={"FLASHFIX_STRICT": "1", "FLASHFIX_LOG_LEVEL": "LOUD"})
    assert r == {"outcomes": ["PatchError"] * 3, "patched": False}


def test_strict_failure_before_the_registry_is_not_swallowed(fake_site):
    broken = FAKE_PATCHES + "\nraise RuntimeError('patch module cannot load')\n"
    site = fake_site(patches=broken)
    code = '''
        use_fake()
        outcomes = []
        for attempt in range(2):
            try:
                import fakeeng.core
                outcomes.append(fakeeng.core.Engine().compute(1))
            except Exception as exc:
                outcomes.append("%s: %s" % (type(exc).__name__, exc))
        report(outcomes=outcomes)
    '''
    (r,), proc = run_py(code, site, env={"FLASHFIX_STRICT": "1"})
    assert len(r["outcomes"]) == 2
    for outcome in r["outcomes"]:  # the import fails, both times, naming the pack and the cause
        assert outcome.startswith("PatchError: flashfix strict mode: pack flashfix (entry point fakeeng = fake_patches"
                                  ) and "patch module cannot load" in outcome, outcome
    (r,), proc = run_py(code, site)  # not strict: the engine imports, the failure is logged
    assert r == {"outcomes": [2, 2]} and "patch module cannot load" in proc.stderr


# --- 7. threads -----------------------------------------------------------------------------

THREAD_PATCHES = FAKE_PATCHES.replace('''def prepare(modules):
    import os''', '''def prepare(modules):
    import os, fakeeng.slow  # an import inside prepare(), which another thread is running''') + '''
def other_probe(trees):
    return Shape(BUGGY, "other")

def other_prepare(modules):
    mod = modules["fakeeng.other"]
    return [SetAttr(mod, "value", 2)]

PATCHES = PATCHES + (
    Patch(id="fake-other", engine="fakeeng", targets=("fakeeng.other",), versions="<2", upstream="-",
          fixed_in="2.0", delete_when="-", summary="value 2", probe=other_probe, prepare=other_prepare),
)
'''


def test_threads_importing_watched_modules_do_not_deadlock(fake_site):
    site = fake_site(patches=THREAD_PATCHES, extra={
        "fakeeng/slow.py": "import time\ntime.sleep(0.3)\nimport fakeeng.other\n",
        "fakeeng/other.py": "import time\ntime.sleep(0.2)\nvalue = 1\n",
        "fakeeng/plain1.py": "import time\ntime.sleep(0.1)\n",
        "fakeeng/plain2.py": "x = 1\n",
    })
    (r,), _ = run_py('''
        import threading, importlib, time
        use_fake()
        import fakeeng
        errors = []
        def load(name, delay):
            time.sleep(delay)
            try:
                importlib.import_module(name)
            except Exception as exc:
                errors.append(repr(exc))
        names = [("fakeeng.slow", 0), ("fakeeng.core", 0.1), ("fakeeng.plain1", 0.05), ("fakeeng.plain2", 0.15)]
        threads = [threading.Thread(target=load, args=item, daemon=True) for item in names]
        for t in threads: t.start()
        for t in threads: t.join(20)
        import flashfix
        states = {x["id"]: x["state"] for x in flashfix.status() if x["engine"] == "fakeeng"}
        import fakeeng.core, fakeeng.other
        report(hung=[t.is_alive() for t in threads], errors=errors, states=states,
               value=fakeeng.core.Engine().compute(1), other=fakeeng.other.value)
    ''', site)
    assert r["hung"] == [False] * 4 and r["errors"] == []
    assert r["states"] == {"fake-compute": "applied", "fake-other": "applied"}
    assert (r["value"], r["other"]) == (3, 2)


# --- 8. torch.compile traces patched code as it traces the original ----------------------------

TORCH_ENGINE = '''import torch


def helper(a, b):
    return a + b


class Engine:
    def compute(self, x):
        return helper(x, 1) * torch.ones(2)

    def other(self):
        return "other"
'''


def test_torch_compile_fullgraph_traces_the_patched_code(fake_site):
    """In a real torch (SGLang 0.5.17's environment): ``torch.compile(fullgraph=True)`` of a
    patched function that has not run yet traces (0.1.0: Unsupported, every time), computes
    the fixed value, and records ``ran``; an eager call then drops the marker."""
    import engine_env

    site = fake_site(engine_source=TORCH_ENGINE)
    code = PRELUDE_FOR_ENGINE_ENV + '''
import torch
use_fake()
import fakeeng.core as core
from flashfix.core import registry as _registry
change = _registry._sites["fake-compute:Engine.compute"]
engine = core.Engine()
compiled = torch.compile(core.Engine.compute, backend="eager", fullgraph=True)
first = compiled(engine, torch.tensor(1.0)).tolist()
ran_after_compiled = state()["ran"]
still_marked = core.Engine.compute.__code__ is change.marked
eager = engine.compute(torch.tensor(1.0)).tolist()
original_traced = torch.compile(lambda x: core.helper(x, 1) * torch.ones(2), backend="eager", fullgraph=True)(
    torch.tensor(1.0)).tolist()
report(first=first, ran=ran_after_compiled, still_marked=still_marked, eager=eager,
       plain=core.Engine.compute.__code__ is change.plain, again=compiled(engine, torch.tensor(1.0)).tolist(),
       original=original_traced)
'''
    (r,) = engine_env.run("sglang==0.5.17", code, pythonpath=os.pathsep.join([str(REPO), str(site)]))
    assert r["first"] == [3.0, 3.0] and r["ran"] is True and r["still_marked"] is True
    assert r["eager"] == [3.0, 3.0] and r["plain"] is True and r["again"] == [3.0, 3.0]
    assert r["original"] == [2.0, 2.0]


PRELUDE_FOR_ENGINE_ENV = __import__("conftest").PRELUDE


# --- 9. callbacks never lost -------------------------------------------------------------------

def test_activated_from_inside_the_target_import(fake_site):
    activating = "import ff_activate\n" + FAKE_ENGINE
    site = fake_site(engine_source=activating, extra={"ff_activate.py": textwrap.dedent('''
        import flashfix
        flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
        flashfix.activate()
    ''')})
    (r,), _ = run_py('''
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1))
    ''', site)
    assert r == {"state": "applied", "value": 3}
    # also when the next thing the process does is import something else
    (r,), _ = run_py('''
        import fakeeng.core as core
        import json  # already imported: no finder call; a new module is:
        import fakeeng.plain
        value = core.Engine().compute(1)
        report(value=value, state=state()["state"])
    ''', fake_site(engine_source=activating, extra={"fakeeng/plain.py": ""}))
    assert r == {"value": 3, "state": "applied"}


def test_target_without_loader_is_unknown_shape_not_waiting(fake_site):
    site = fake_site(engine_source=None, extra={"fakeeng/core/readme.txt": "a namespace package"})
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core
        report(state=state()["state"], reason=state()["reason"])
    ''', site)
    assert r["state"] == "unknown-shape" and "source not available" in r["reason"], r


# --- 10. reload and sys.modules replacement ----------------------------------------------------

def test_reload_reapplies(fake_site):
    site = fake_site()
    (r,), proc = run_py('''
        import importlib
        use_fake()
        import fakeeng.core as core
        first = core.Engine().compute(1)
        importlib.reload(core)
        second = core.Engine().compute(1)
        s = state()
        import flashfix
        flashfix.revert()
        report(first=first, second=second, state=s["state"], reverted=core.Engine().compute(1))
    ''', site)
    assert r == {"first": 3, "second": 3, "state": "applied", "reverted": 2}
    assert "re-applied fake-compute" in proc.stderr


def test_module_replacing_itself_never_breaks_the_import(fake_site):
    replacing = FAKE_ENGINE + "\nimport sys\nclass _Nameless:\n    __slots__ = ()\nsys.modules[__name__] = _Nameless()\n"
    site = fake_site(engine_source=replacing)
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        report(kind=type(core).__name__, state=state()["state"])
    ''', site)
    assert r["kind"] == "_Nameless"
    assert r["state"] in ("failed", "unknown-shape")


# --- 11. no parsed tree outlives the decision ----------------------------------------------------

def test_parsed_trees_dropped_after_decision(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core
        from flashfix.core import source as _source
        report(state=state()["state"], trees=len(_source._parsed))
    ''', site)
    assert r == {"state": "applied", "trees": 0}


# --- 12. controls ------------------------------------------------------------------------------

def test_controls_accept_what_logging_accepts():
    from flashfix.core import config as _config

    ids = {"a", "b"}
    assert _config.parse(ids, {"FLASHFIX_DISABLE": "a,"}).problems == ()
    assert _config.parse(ids, {"FLASHFIX_DISABLE": "a,"}).disabled == {"a"}
    both = _config.parse(ids, {"FLASHFIX_DISABLE": "all,a"})
    assert both.disable_all and both.problems == ()
    assert _config.parse(ids, {"FLASHFIX_DISABLE": " , ,"}).problems == ()
    assert _config.parse(ids, {"FLASHFIX_LOG_LEVEL": "warn"}).log_level == 30
    assert _config.parse(ids, {"FLASHFIX_LOG_LEVEL": "10"}).log_level == 10
    assert _config.parse(ids, {"FLASHFIX_LOG_LEVEL": "Fatal"}).log_level == 50
    bad = _config.parse(ids, {"FLASHFIX_LOG_LEVEL": "loud", "FLASHFIX_DISABLE": "c"})
    assert len(bad.problems) == 2


def test_disable_all_in_a_list_installs_no_hook(fake_site):
    (r,), _ = run_py('''
        import flashfix
        report(finder=any(getattr(f, "flashfix_finder", False) for f in sys.meta_path))
    ''', env={"FLASHFIX_DISABLE": "all, fake-compute"})
    assert r == {"finder": False}


# --- 13. logging reaches the application's handlers ---------------------------------------------

def test_logs_reach_the_application_once_it_configures_logging(fake_site):
    site = fake_site()
    _, proc = run_py('''
        import logging
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s %(levelname)s %(message)s")
        use_fake()
        import fakeeng.core
    ''', site)
    assert "APP flashfix INFO applied fake-compute" in proc.stdout
    assert "applied fake-compute" not in proc.stderr
    _, proc = run_py('use_fake(); import fakeeng.core', site)  # no logging configured: stderr
    assert "flashfix INFO [pid" in proc.stderr and "applied fake-compute" in proc.stderr


def test_zipped_install_doctor_equals_runtime(fake_site, tmp_path):
    """The engine imported from a zip on sys.path (zipimport): read through the loader."""
    import zipfile

    site = fake_site()
    archive = tmp_path / "engine.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(site.rglob("*")):
            if path.is_file() and path.name != "fake_patches.py":
                zf.write(path, path.relative_to(site).as_posix())
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "fake_patches.py").write_text(FAKE_PATCHES)
    code = "sys.path.insert(0, %r)\n" % str(archive) + textwrap.dedent(DOCTOR_AND_RUNTIME)
    (r,), _ = run_py(code, patches)
    assert r["doctor"][0] == "patch", r
    assert r["state"] == "applied" and r["value"] == 3, r


def test_status_after_a_failed_import_left_a_namespace_package_orphaned(fake_site):
    """A failed (e.g. concurrent) import can leave ``pkg.ns`` in sys.modules without ``pkg``;
    a namespace package's path then cannot be recomputed. status() and the doctor still answer."""
    site = fake_site(engine_source=None, patches=FAKE_PATCHES.replace('"fakeeng.core"', '"fakeeng.ns.core"'),
                     extra={"fakeeng/ns/core.py": FAKE_ENGINE})
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.ns.core as core
        applied = state()["state"]
        del sys.modules["fakeeng"]
        from flashfix.tools import doctor as _doctor
        rows, _ = _doctor.diagnose()
        report(applied=applied, state=state()["state"],
               doctor={x["id"]: x["verdict"] for x in rows}["fake-compute"])
    ''', site)
    assert r == {"applied": "applied", "state": "applied", "doctor": "patch"}
