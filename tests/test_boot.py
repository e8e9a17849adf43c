"""The start-up hook (startup/_flashfix_boot.py), as flashfix.pth runs it, with fake engine
packages: this tests flashfix's own mechanism, not an engine."""

import textwrap

from conftest import REPO, run_py

BOOT = '''
import importlib.machinery, sys, _imp
import _flashfix_boot  # what flashfix.pth does at start
seen = {}

class Watch:
    """Records whether flashfix's own code runs while Python's global import lock is held."""
    def find_spec(self, name, path=None, target=None):
        if name != "flashfix":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader
        class Loader:
            def create_module(self, spec):
                return None
            def exec_module(self, module):
                seen["lock_held"] = _imp.lock_held()
                real.exec_module(module)
        spec.loader = Loader()
        return spec

sys.meta_path.insert(0, Watch())
boot_index = [i for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_boot", False)]
'''


def _fake_engines(tmp_path):
    for name in ("vllm", "sglang"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            "import sys\nLOADED_FLASHFIX = 'flashfix' in sys.modules\nfrom . import sub\n")
        (tmp_path / name / "sub.py").write_text("")
    return tmp_path


def _run(code, site):
    return run_py(BOOT + textwrap.dedent(code), site, env={"PYTHONPATH": "%s:%s:%s" % (REPO / "startup", REPO, site)})


def test_flashfix_loads_when_the_engine_code_runs_outside_the_import_lock(tmp_path):
    # The earlier boot imported flashfix inside find_spec, where Python holds its global import
    # lock: a thread importing flashfix at that moment (holding flashfix's module lock, waiting
    # for the global one) deadlocked with it, which Python's deadlock detection cannot see.
    site = _fake_engines(tmp_path)
    (r,), proc = _run('''
        assert "flashfix" not in sys.modules
        import colorsys  # a module that is not an engine loads nothing
        before = "flashfix" in sys.modules
        import vllm, flashfix
        from importlib.machinery import SourceFileLoader
        mine = [(i, type(f).__name__) for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_finder", False)]
        report(before=before, lock_held=seen["lock_held"], loaded_at_engine_code=vllm.LOADED_FLASHFIX,
               loader=type(vllm.__loader__).__name__, spec_loader=type(vllm.__spec__.loader).__name__,
               patch_module="flashfix.vllm_patch" in sys.modules, generation=flashfix.generation("vllm"),
               finders=mine, boot_index=boot_index)
    ''', site)
    assert r["before"] is False
    assert r["lock_held"] is False
    assert r["loaded_at_engine_code"] is True
    assert r["loader"] == r["spec_loader"] == "SourceFileLoader"  # no trace of the boot loader
    assert r["patch_module"] is True and r["generation"] == 1  # the engine's callbacks ran, once
    # replaced in place, nothing else left; the start-up finder had moved back to the front,
    # ahead of Watch, when the import system asked it about a module
    assert r["boot_index"] == [1] and r["finders"] == [[0, "_Finder"]]


def test_second_engine_and_start_entry_point_after_activation(tmp_path):
    site = _fake_engines(tmp_path)
    (r,), proc = _run('''
        import vllm
        _flashfix_boot.activate()  # flashfix.start's entry point, after activation: nothing added
        import sglang, flashfix
        report(sglang_module="flashfix.sglang_patch" in sys.modules, generation=flashfix.generation("sglang"),
               finders=sum(1 for f in sys.meta_path if getattr(f, "flashfix_finder", False)))
    ''', site)
    assert r == {"sglang_module": True, "generation": 1, "finders": 1}
    assert proc.stderr == ""


def test_start_entry_point_installs_one_boot_finder(tmp_path):
    (r,), _ = _run('''
        _flashfix_boot.activate(); _flashfix_boot.activate()
        report(boots=sum(1 for f in sys.meta_path if getattr(f, "flashfix_boot", False)),
               flashfix="flashfix" in sys.modules)
    ''', tmp_path)
    assert r == {"boots": 1, "flashfix": False}


def test_engines_imported_from_threads_at_once(tmp_path):
    # Two engines and flashfix itself imported from three threads at the same moment, in fresh
    # interpreters: every import completes and each engine's callbacks run exactly once.
    site = _fake_engines(tmp_path)
    code = '''
        import threading
        start = threading.Barrier(3)
        errors = []
        def imp(name):
            start.wait()
            try:
                __import__(name)
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=imp, args=(n,)) for n in ("vllm", "sglang", "flashfix")]
        for t in threads: t.start()
        for t in threads: t.join(60)
        import flashfix
        report(alive=sum(t.is_alive() for t in threads), errors=errors,
               generations=[flashfix.generation("vllm"), flashfix.generation("sglang")],
               finders=sum(1 for f in sys.meta_path if getattr(f, "flashfix_finder", False)))
    '''
    for _ in range(10):
        (r,), _ = _run(code, site)
        assert r == {"alive": 0, "errors": [], "generations": [1, 1], "finders": 1}
