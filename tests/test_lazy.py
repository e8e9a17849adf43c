"""flashfix.core.lazy: a process lets go of the matcher, the source reader and the renderer once its patches
are decided, and keeps them where something else holds them. A fake engine (tests/conftest.py) with a
declarative pack; the real engines' processes are checked in test_engine_start."""

import textwrap

from conftest import run_py

PACK = '''
from flashfix.semantic import Backport, find, pattern

def context(tree, func):
    assert find(pattern("helper($$$_)"), [func])  # the matcher, reached through flashfix.semantic
    return {}

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Engine.compute", before="helper($X, 1)", after="helper($X, 2)",
    context=context, summary="compute adds 2", doc="Why: a test. Delete when: never."),)
'''

HEAVY = '''
import gc, sys, types
from flashfix.core import lazy

def heavy():
    gc.collect()
    held = sorted({o.__module__ for o in gc.get_objects()
                   if isinstance(o, (types.FunctionType, type)) and o.__module__ in lazy.HEAVY})
    return [name for name in lazy.HEAVY if name in sys.modules], held
'''


def test_the_heavy_modules_are_let_go_of_once_decided_and_come_back_for_the_next_decision(fake_site):
    site = fake_site(patches=PACK)
    (r,), proc = run_py(HEAVY + textwrap.dedent('''
        use_fake()
        import importlib
        import fakeeng.core as core
        after_import = heavy()
        value = core.Engine().compute(5)
        first = state()["state"]
        after_status = heavy()
        importlib.reload(core)  # decided again: the heavy modules are imported again, then let go of
        again, again_value, after_reload = state()["state"], core.Engine().compute(5), heavy()
        import flashfix
        flashfix.revert("fake-compute")  # the changes were kept by the registry, not by the heavy modules
        report(after_import=after_import, after_status=after_status, value=value, first=first, again=again,
               again_value=again_value, after_reload=after_reload, reverted=core.Engine().compute(5))
    '''), site)
    assert r["first"] == "applied" and r["value"] == 7 and r["reverted"] == 6, r
    assert r["again"] == "applied" and r["again_value"] == 7, (r, proc.stderr[-2000:])
    for key in ("after_import", "after_status", "after_reload"):
        assert r[key] == [[], []], (key, r[key])


def test_a_heavy_module_held_by_someone_else_is_kept_and_never_copied(fake_site):
    """conftest's pack imports flashfix.core.source itself: the process keeps it, and the registry goes on using
    that same module object (a second copy would not be the pack's)."""
    site = fake_site()
    (r,), _ = run_py(HEAVY + textwrap.dedent('''
        use_fake()
        import fakeeng.core as core
        import fake_patches
        report(state=state()["state"], same=sys.modules.get("flashfix.core.source") is fake_patches._source,
               value=core.Engine().compute(5))
    '''), site)
    assert r == {"state": "applied", "same": True, "value": 7}


def test_the_collector_is_left_as_found(fake_site):
    """The decision freezes what the process held and unfreezes it after (lazy.using); objects the application
    froze itself stay frozen (unfreezing them would leave none)."""
    site = fake_site(patches=PACK)
    results, _ = run_py('''
        import gc
        use_fake()
        import fakeeng.core
        plain = gc.get_freeze_count()
        report(plain=plain)
    ''', site)
    assert results == [{"plain": 0}]
    results, _ = run_py('''
        import gc
        gc.freeze()
        frozen = gc.get_freeze_count()
        use_fake()
        import fakeeng.core as core
        report(frozen_before=frozen > 0, still=gc.get_freeze_count() > frozen // 2, value=core.Engine().compute(5))
    ''', site)
    assert results == [{"frozen_before": True, "still": True, "value": 7}]


def test_decisions_in_two_threads_let_go_only_when_both_are_done(fake_site):
    site = fake_site(patches=PACK, extra={"fakeeng/other.py": "from fakeeng.core import helper\n"})
    (r,), _ = run_py(HEAVY + textwrap.dedent('''
        import threading
        from flashfix.core import lazy
        use_fake()
        seen = []
        def hold():  # an entry point running in another thread while the engine is imported in this one
            with lazy.using():
                from flashfix import semantic
                semantic.pattern("x")  # imports the matcher inside this entry point
                started.set()
                done.wait(60)
                seen.append("flashfix.core.matcher" in sys.modules)
        started, done = threading.Event(), threading.Event()
        thread = threading.Thread(target=hold)
        thread.start()
        started.wait(60)
        import fakeeng.core as core
        during = "flashfix.core.matcher" in sys.modules
        done.set()
        thread.join(60)
        report(during=during, seen=seen, value=core.Engine().compute(5), after=heavy())
    '''), site)
    assert r == {"during": True, "seen": [True], "value": 7, "after": [[], []]}, r
