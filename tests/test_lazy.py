"""flashfix.core.lazy and the host process: the matcher, the source reader and the renderer are imported only
when something is decided, and flashfix never touches the application's process state to save their memory: no
garbage-collector call (``gc.freeze``/``unfreeze``/``collect``), no module taken out of ``sys.modules``, under
threads and every start method. A fake engine (tests/conftest.py) with a declarative pack; the real engines'
processes are checked in test_engine_start."""

import textwrap

import pytest
from conftest import run_py

PACK = '''
import gc, os
from flashfix.semantic import Backport, find, pattern

def context(tree, func):
    assert find(pattern("helper($$$_)"), [func])  # the matcher, reached through flashfix.semantic
    if os.environ.get("APP_FREEZES_DURING_DECISION"):
        gc.freeze()  # what another thread of the application may do at this moment (before forking workers)
    if os.environ.get("FORK_DURING_DECISION"):
        pid = os.fork()
        if pid == 0:  # a worker forked while flashfix decides
            os._exit(0 if gc.get_freeze_count() == int(os.environ["FORK_DURING_DECISION"]) else 3)
        _, status = os.waitpid(pid, 0)
        FORKED.append(os.waitstatus_to_exitcode(status))
    return {}

FORKED = []

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Engine.compute", before="helper($X, 1)", after="helper($X, 2)",
    context=context, summary="compute adds 2", doc="Why: a test. Delete when: never."),)
'''

RECORD = '''
import gc, sys
from flashfix.core import lazy
calls = []
for _name in ("freeze", "unfreeze", "collect"):
    def _recorder(*a, _name=_name, _real=getattr(gc, _name)):
        calls.append(_name)
        return _real(*a)
    setattr(gc, _name, _recorder)
'''


def test_deciding_makes_no_collector_call_and_takes_no_module_out(fake_site):
    """Before: the decision froze, collected and unfroze the application's objects, and deleted the heavy modules
    (and the package attribute ``flashfix.core.source``, which the application had imported itself)."""
    site = fake_site(patches=PACK)
    (r,), _ = run_py(RECORD + textwrap.dedent('''
        import flashfix.core.source  # the application (or a pack's hook) imports one of the heavy modules itself
        use_fake()
        before = dict(sys.modules)
        import importlib
        import fakeeng.core as core
        value, first = core.Engine().compute(5), state()["state"]
        importlib.reload(core)  # decided again
        again, again_value = state()["state"], core.Engine().compute(5)
        gone = [n for n, m in before.items() if sys.modules.get(n) is not m]
        flashfix.revert("fake-compute")
        report(calls=calls, gone=gone, attribute=callable(flashfix.core.source.module_file), value=value,
               first=first, again=again, again_value=again_value, reverted=core.Engine().compute(5),
               heavy=[n for n in lazy.HEAVY if n in sys.modules])
    '''), site)
    assert r["calls"] == [] and r["gone"] == [] and r["attribute"] is True, r
    assert (r["first"], r["value"], r["again"], r["again_value"], r["reverted"]) == ("applied", 7, "applied", 7, 6), r
    assert "flashfix.core.matcher" in r["heavy"], r  # imported to decide, and kept, as any module


def test_an_application_freeze_during_a_decision_is_kept_and_a_forked_child_sees_the_parents_collector(fake_site):
    site = fake_site(patches=PACK)
    (r,), _ = run_py(RECORD + textwrap.dedent('''
        use_fake()
        import fakeeng.core as core
        import fake_patches
        report(frozen=gc.get_freeze_count(), calls=calls, value=core.Engine().compute(5))
    '''), site, env={"APP_FREEZES_DURING_DECISION": "1"})
    assert r["frozen"] > 1000 and set(r["calls"]) == {"freeze"} and r["value"] == 7, r  # the application's own calls only
    (r,), _ = run_py('''
        import gc
        use_fake()
        import fakeeng.core as core
        import fake_patches
        report(forked=fake_patches.FORKED, frozen=gc.get_freeze_count(), value=core.Engine().compute(5))
    ''', site, env={"FORK_DURING_DECISION": "0"})
    assert r["forked"] and set(r["forked"]) == {0} and (r["frozen"], r["value"]) == (0, 7), r


WORKER = '''
import gc

def work(_):
    import flashfix
    flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
    flashfix.activate()  # a worker's interpreter start (the .pth in a real install)
    import fakeeng.core as core
    record = {r["id"]: r for r in flashfix.status()}["fake-compute"]
    return core.Engine().compute(5), gc.get_freeze_count(), record["state"]
'''


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_workers_of_every_start_method_are_patched_and_keep_a_plain_collector(fake_site, method):
    site = fake_site(patches=PACK, extra={"fake_workers.py": WORKER})
    (r,), _ = run_py('''
        import gc, multiprocessing
        import fake_workers
        use_fake()
        import fakeeng.core as core
        parent = core.Engine().compute(5)
        with multiprocessing.get_context("%s").Pool(2) as pool:
            children = pool.map(fake_workers.work, range(2))
        report(parent=parent, children=children, frozen=gc.get_freeze_count())
    ''' % method, site)
    assert r == {"parent": 7, "children": [[7, 0, "applied"]] * 2, "frozen": 0}, r


def test_a_process_that_decides_nothing_never_imports_the_deciding_code(fake_site):
    """No engine imported, or every patch disabled: the matcher, the reader and the renderer are never imported."""
    site = fake_site(patches=PACK)
    for env, code in (({}, "import json"), ({"FLASHFIX_DISABLE": "all"}, "import fakeeng.core")):
        (r,), _ = run_py('''
            import flashfix.core.lazy as lazy
            use_fake()
            %s
            report(heavy=[n for n in lazy.HEAVY if n in sys.modules])
        ''' % code, site, env=env)
        assert r == {"heavy": []}, (env, r)


def test_a_heavy_module_held_by_someone_else_is_the_one_the_registry_uses(fake_site):
    """conftest's pack imports flashfix.core.source itself: the registry goes on using that same module object."""
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        import fake_patches
        report(state=state()["state"], same=sys.modules.get("flashfix.core.source") is fake_patches._source,
               value=core.Engine().compute(5))
    ''', site)
    assert r == {"state": "applied", "same": True, "value": 7}
