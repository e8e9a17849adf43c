"""The import-hook and start-up mechanism under the conditions that broke it: strict mode when
flashfix cannot be imported or activates inside a target's own import, a deadlock from deciding
inside a finder, loaders that broke ``copy``, and finders placed ahead of flashfix's. Each runs in
a fresh interpreter; fake modules where the subject is the import system itself, real SGLang
0.5.17 where strict mode matters to an engine."""

import textwrap

from conftest import FAKE_PATCHES, REPO, run_py

# The test interpreter may have another copy of flashfix installed (its flashfix.pth imported
# that copy's start-up hook already): put this checkout's in its place, as flashfix.pth would.
OWN_BOOT = '''
import sys
for _f in [f for f in sys.meta_path if getattr(f, "flashfix_boot", False)]:
    sys.meta_path.remove(_f)
sys.modules.pop("_flashfix_boot", None)
sys.path.insert(0, %r)
import _flashfix_boot
''' % str(REPO / "startup")

OUTCOMES = '''
def attempt(name, times=1):
    import importlib
    out = []
    for _ in range(times):
        try:
            importlib.import_module(name)
            out.append("imported")
        except Exception as exc:
            out.append(type(exc).__name__)
    return out
'''

ACTIVATE_INSIDE = textwrap.dedent('''
    import flashfix  # a plugin loader or library that activates flashfix inside the target's import
    flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
    flashfix.activate()
''')


def _fake_engines(tmp_path, names=("vllm",)):
    for name in names:
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("from . import sub\n")
        (tmp_path / name / "sub.py").write_text("")
    (tmp_path / "ff_unrelated.py").write_text("")
    return tmp_path


# --- 1. strict mode when flashfix itself cannot be imported ----------------------------------

def test_strict_engine_import_fails_when_flashfix_cannot_be_imported(tmp_path):
    """A stale or shadowing ``flashfix`` earlier on sys.path whose ``__init__`` raises: under
    strict mode the engine import fails, every time, naming the cause; without it, one line."""
    site = _fake_engines(tmp_path / "site")
    shadow = tmp_path / "shadow"
    (shadow / "flashfix").mkdir(parents=True)
    (shadow / "flashfix" / "__init__.py").write_text("raise RuntimeError('stale flashfix copy')\n")
    code = OWN_BOOT + OUTCOMES + '''
sys.path.insert(0, SHADOW)  # ahead of the working directory too
try:
    import vllm
    first = "imported"
except Exception as exc:
    first = "%s: %s" % (type(exc).__name__, exc)
report(first=first, again=attempt("vllm", 2), unrelated=attempt("ff_unrelated"))
'''.replace("SHADOW", repr(str(shadow)))
    env = {"PYTHONPATH": str(site)}
    (r,), proc = run_py(code, env=dict(env, FLASHFIX_STRICT="1"))
    assert r["first"].startswith("ImportError: flashfix strict mode"), r
    assert "stale flashfix copy" in r["first"] and "vllm" in r["first"]
    assert r["again"] == ["ImportError", "ImportError"] and r["unrelated"] == ["imported"]
    (r,), proc = run_py(code, env=env)
    assert r == {"first": "imported", "again": ["imported", "imported"], "unrelated": ["imported"]}
    assert proc.stderr.count("auto-activation skipped") == 1 and "stale flashfix copy" in proc.stderr


# --- 2. strict mode when flashfix activates inside the target's own import --------------------

def test_strict_failure_lands_on_the_target_not_on_an_unrelated_import(fake_site):
    site = fake_site(engine_source="import ff_activate\nclass Engine:\n    pass\n",
                     extra={"ff_activate.py": ACTIVATE_INSIDE, "ff_unrelated.py": ""})
    (r,), _ = run_py(OUTCOMES + textwrap.dedent('''
        report(target=attempt("fakeeng.core", 3), unrelated=attempt("ff_unrelated"), state=state()["state"],
               in_modules="fakeeng.core" in sys.modules)
    '''), site, env={"FLASHFIX_STRICT": "1"})
    # main: ["imported", "imported", "imported"], and ff_unrelated's import raised the PatchError
    assert r == {"target": ["PatchError"] * 3, "unrelated": ["imported"], "state": "unknown-shape",
                 "in_modules": False}


def test_strict_failure_lands_on_the_target_imported_in_another_thread(fake_site):
    """flashfix activated in one thread while another thread is inside the target's import:
    the failure is raised by that import, in that thread."""
    site = fake_site(engine_source="import ff_sync\nff_sync.started.set()\nff_sync.go.wait(30)\nclass Engine:\n    pass\n",
                     extra={"ff_sync.py": "import threading\nstarted, go = threading.Event(), threading.Event()\n",
                            "ff_unrelated.py": ""})
    (r,), _ = run_py(OUTCOMES + textwrap.dedent('''
        import threading, ff_sync
        got = {}
        t = threading.Thread(target=lambda: got.update(target=attempt("fakeeng.core")))
        t.start()
        ff_sync.started.wait(30)
        use_fake()  # here, while the other thread runs fakeeng.core's code
        ff_sync.go.set()
        t.join(30)
        report(target=got.get("target"), unrelated=attempt("ff_unrelated"), later=attempt("fakeeng.core"))
    '''), site, env={"FLASHFIX_STRICT": "1"})
    assert r == {"target": ["PatchError"], "unrelated": ["imported"], "later": ["PatchError"]}


def test_activation_inside_the_target_import_applies_and_leaves_no_trace(fake_site):
    probe = ACTIVATE_INSIDE + textwrap.dedent('''
        import copy, importlib.machinery, pickle, sys
        spec = sys.modules["fakeeng.core"].__spec__  # still being imported: flashfix watches its end
        during = [spec.__class__.__name__, isinstance(spec, importlib.machinery.ModuleSpec),
                  type(copy.deepcopy(spec)) is importlib.machinery.ModuleSpec,
                  type(pickle.loads(pickle.dumps(spec))) is importlib.machinery.ModuleSpec]
    ''')
    site = fake_site(engine_source="import ff_activate\n" + __import__("conftest").FAKE_ENGINE,
                     extra={"ff_activate.py": probe})
    (r,), _ = run_py('''
        import importlib.machinery
        import fakeeng.core as core
        import ff_activate
        report(value=core.Engine().compute(1), state=state()["state"],
               spec_type=type(core.__spec__) is importlib.machinery.ModuleSpec,
               loader_type=type(core.__loader__).__name__, during=ff_activate.during)
    ''', site)
    assert r == {"value": 3, "state": "applied", "spec_type": True, "loader_type": "SourceFileLoader",
                 "during": ["ModuleSpec", True, True, True]}


# --- 11. no decision inside a finder -----------------------------------------------------------

LOCK_PATCHES = FAKE_PATCHES.replace('''def prepare(modules):
    import os''', '''def prepare(modules):
    import os, _imp, importlib
    calls.append(_imp.lock_held())
    if os.environ.get("FF_PREPARE_IMPORTS"):
        importlib.import_module(os.environ["FF_PREPARE_IMPORTS"])''')


def test_deferred_decision_never_runs_under_the_global_import_lock(fake_site):
    site = fake_site(engine_source="import ff_activate\n" + __import__("conftest").FAKE_ENGINE, patches=LOCK_PATCHES,
                     extra={"ff_activate.py": ACTIVATE_INSIDE, "ff_unrelated.py": ""})
    (r,), _ = run_py('''
        import fakeeng.core as core
        import ff_unrelated  # main decided here, inside flashfix's find_spec
        import fake_patches
        report(lock_held=[c for c in fake_patches.calls if c is not 1], state=state()["state"], value=core.Engine().compute(1))
    ''', site)
    assert r == {"lock_held": [False], "state": "applied", "value": 3}


def test_no_deadlock_with_an_import_in_another_thread(fake_site):
    """prepare() imports a module another thread is importing, whose code imports in turn.
    main ran prepare() inside find_spec (global import lock held): both threads hung."""
    site = fake_site(engine_source="import ff_activate\n" + __import__("conftest").FAKE_ENGINE, patches=LOCK_PATCHES,
                     extra={"ff_activate.py": ACTIVATE_INSIDE, "ff_unrelated.py": "",
                            "fakeeng/slow.py": "import time\ntime.sleep(1.0)\nimport fakeeng.plain3\n",
                            "fakeeng/plain3.py": ""})
    (r,), _ = run_py('''
        import os, threading, time, importlib
        errors = []
        def load(name, delay):
            time.sleep(delay)
            try:
                importlib.import_module(name)
                if name == "fakeeng.core":
                    importlib.import_module("ff_unrelated")
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=load, args=("fakeeng.slow", 0), daemon=True),
                   threading.Thread(target=load, args=("fakeeng.core", 0.3), daemon=True)]
        for t in threads: t.start()
        for t in threads: t.join(20)
        hung = [t.is_alive() for t in threads]
        report(hung=hung, errors=errors, state=None if any(hung) else state()["state"])
        sys.stdout.flush()
        os._exit(0)  # a hung thread holds the import lock: do not wait for it at exit
    ''', site, env={"FF_PREPARE_IMPORTS": "fakeeng.slow"})
    assert r == {"hung": [False, False], "errors": [], "state": "applied"}


# --- 8. specs and loaders look the same with flashfix and without -----------------------------

SURFACE = '''
import copy, importlib, importlib.machinery, importlib.resources, importlib.util, pickle, pkgutil, warnings
warnings.simplefilter("ignore", DeprecationWarning)

def attempt_call(f):
    try:
        return f()
    except BaseException as exc:
        return "raised " + type(exc).__name__

def spec_surface(name):
    spec = importlib.util.find_spec(name)
    loader = spec.loader
    again = importlib.util.find_spec(name)
    return {
        "class": loader.__class__.__name__,
        "isinstance": isinstance(loader, importlib.machinery.SourceFileLoader),
        "repr": repr(loader).split(" object at ")[0],
        "equal_specs": spec == again,
        "hash_equal": attempt_call(lambda: hash(loader) == hash(again.loader)),
        "copy": attempt_call(lambda: type(copy.copy(loader)).__name__),
        "copy_equal": attempt_call(lambda: copy.copy(loader) == loader),
        "deepcopy_loader": attempt_call(lambda: type(copy.deepcopy(loader)).__name__),
        "deepcopy_spec": attempt_call(lambda: type(copy.deepcopy(spec).loader).__name__),
        "pickle_spec": attempt_call(lambda: type(pickle.loads(pickle.dumps(spec)).loader).__name__),
        "pickle_loader": attempt_call(lambda: type(pickle.loads(pickle.dumps(loader))).__name__),
        "get_filename": loader.get_filename(name).endswith(".py"),
        "is_package": loader.is_package(name),
        "pkgutil": attempt_call(lambda: pkgutil.get_loader(name).__class__.__name__),
        "dir": sorted(a for a in dir(loader) if not a.startswith("__")) == sorted(
            a for a in dir(importlib.machinery.SourceFileLoader(name, spec.origin)) if not a.startswith("__")),
    }

def module_surface(name):
    module = importlib.import_module(name)
    out = {
        "loader_type": type(module.__loader__).__name__,
        "same_loader": module.__spec__.loader is module.__loader__,
        "spec_type": type(module.__spec__) is importlib.machinery.ModuleSpec,
        "found_after": importlib.util.find_spec(name) is module.__spec__,
        "deepcopy_spec": attempt_call(lambda: type(copy.deepcopy(module.__spec__).loader).__name__),
        "pickle_spec": attempt_call(lambda: type(pickle.loads(pickle.dumps(module.__spec__)).loader).__name__),
    }
    if hasattr(module, "__path__"):
        out["resources"] = attempt_call(lambda: sorted(p.name for p in importlib.resources.files(name).iterdir()
                                                       if p.name.endswith(".py")))
        out["iter_modules"] = sorted(m.name for m in pkgutil.iter_modules(module.__path__))
    return out
'''


def test_engine_spec_and_module_surface_is_the_same_with_flashfix(fake_site, tmp_path):
    site = fake_site()
    _fake_engines(site)
    code = OWN_BOOT + SURFACE + '''
if MODE == "flashfix":
    use_fake()  # the flashfix finder watches vllm, fakeeng and fakeeng.core
elif MODE == "none":
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "flashfix_finder", False)]
# MODE "boot": the start-up finder alone, which hands vllm its loader
report(before={n: spec_surface(n) for n in ("vllm", "fakeeng", "fakeeng.core")},
       after={n: module_surface(n) for n in ("vllm", "fakeeng", "fakeeng.core")})
'''
    (with_ff,), _ = run_py("MODE = 'flashfix'\n" + code, site)
    (boot_only,), _ = run_py("MODE = 'boot'\n" + code, site)
    (without,), _ = run_py("MODE = 'none'\n" + code, site)
    assert without["before"]["vllm"]["class"] == "SourceFileLoader"
    assert with_ff == without
    assert boot_only == without


# --- 10. a finder placed ahead of flashfix's ----------------------------------------------------

REDIRECT = '''
import importlib.machinery, importlib.util
class Redirect:
    """Serves NAMES from DIR, put at sys.meta_path[0] after start-up (an editable redirector)."""
    def __init__(self, names, where):
        self.names, self.where = names, where
    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path or [self.where])
'''


def test_engine_served_by_a_finder_put_ahead_after_start_up(tmp_path):
    site = _fake_engines(tmp_path / "site")
    other = _fake_engines(tmp_path / "other")
    code = OWN_BOOT + REDIRECT + '''
sys.meta_path.insert(0, Redirect(NAMES, %r))
import vllm
FOLLOW
report(patch_module="flashfix.vllm_patch" in sys.modules, served_by_redirect=vllm.__file__.startswith(%r),
       front=type(sys.meta_path[0]).__name__)
''' % (str(other), str(other))
    env = {"PYTHONPATH": str(site)}
    # the redirector serves the top package only; its submodule reaches the start-up finder
    (r,), _ = run_py(code.replace("NAMES", "('vllm',)").replace("FOLLOW", ""), env=env)
    assert r == {"patch_module": True, "served_by_redirect": True, "front": "_Finder"}
    # it serves every module of the engine: flashfix comes in with the next module imported
    (r,), _ = run_py(code.replace("NAMES", "('vllm', 'vllm.sub')").replace("FOLLOW", "import ff_unrelated"), env=env)
    assert r == {"patch_module": True, "served_by_redirect": True, "front": "_Finder"}


def test_target_served_by_a_finder_put_ahead_after_activation(fake_site, tmp_path):
    site = fake_site()
    (r,), _ = run_py(REDIRECT + textwrap.dedent('''
        use_fake()
        sys.meta_path.insert(0, Redirect(("fakeeng.core",), None))
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1), front=type(sys.meta_path[0]).__name__)
    '''), site)
    assert r == {"state": "applied", "value": 3, "front": "_Finder"}


# --- real SGLang 0.5.17: strict mode with activation inside the target's own import ------------

REAL_STRICT = OUTCOMES + SURFACE + '''
import importlib.machinery, importlib.util, json, os, py_compile, sys, tempfile
NAME = "sglang.srt.configs.model_config"
import sglang
assert "flashfix" not in sys.modules and "_flashfix_boot" not in sys.modules
tmp = tempfile.mkdtemp()
pyc = os.path.join(tmp, "model_config.pyc")
py_compile.compile(importlib.util.find_spec(NAME).origin, cfile=pyc, doraise=True)
open(os.path.join(tmp, "ff_unrelated.py"), "w").close()
sys.path.insert(0, tmp)

class PluginInside(importlib.machinery.SourcelessFileLoader):
    """The real module from its compiled file alone (a sourceless install), with a plugin loader
    that activates flashfix inside its import."""
    def exec_module(self, module):
        import flashfix
        flashfix.activate()
        super().exec_module(module)

class Sourceless:
    def find_spec(self, name, path=None, target=None):
        if name == NAME:
            return importlib.util.spec_from_file_location(name, pyc, loader=PluginInside(name, pyc))

sys.meta_path.insert(0, Sourceless())
target = attempt(NAME, 2)
unrelated = attempt("ff_unrelated")
import flashfix
states = {r["id"]: [r["state"], r["reason"]] for r in flashfix.status()}
watched = [n for n in flashfix.watched() if n not in sys.modules and n.startswith("sglang.") and n != NAME]
print("FLASHFIX_RESULT=" + json.dumps({"target": target, "unrelated": unrelated, "states": states,
                                       "surface": spec_surface(watched[0]) if watched else None}))
'''


def test_real_sglang_strict_failure_lands_on_the_target():
    import engine_env

    (r,) = engine_env.run("sglang==0.5.17", REAL_STRICT, env={"FLASHFIX_STRICT": "1"})
    # main: target ["imported", "imported"]; the PatchError came from ff_unrelated's import
    assert r["target"] == ["PatchError", "PatchError"], r
    assert r["unrelated"] == ["imported"]
    state, reason = r["states"]["sglang-vision-config"]
    assert state == "unknown-shape" and "source not available" in reason
    surface = r["surface"]  # a watched engine module not imported yet: its loader is the real one to all eyes
    assert surface is not None and surface["class"] == "SourceFileLoader" and surface["isinstance"]
    assert surface["deepcopy_spec"] == surface["pickle_spec"] == surface["copy"] == "SourceFileLoader"


def test_saved_meta_path_put_back_after_activation(fake_site):
    """A harness that saves sys.meta_path at start-up and puts the copy back later brings back
    the retired start-up finder and drops flashfix's: the start-up finder hands over again."""
    site = fake_site()
    (r,), _ = run_py(OWN_BOOT + textwrap.dedent('''
        saved = sys.meta_path[:]
        use_fake()  # activation: flashfix's finder takes the start-up finder's place
        sys.meta_path[:] = saved
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1),
               finders=[type(f).__name__ for f in sys.meta_path if getattr(f, "flashfix_finder", False)])
    '''), site)
    assert r == {"state": "applied", "value": 3, "finders": ["_Finder"]}
