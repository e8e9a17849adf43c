"""The patching mechanism, with a fake engine (the only fake in the suite). Every scenario
runs in a fresh interpreter because import order is what is being tested."""

from conftest import FIXED_ENGINE, run_py


def test_hook_fires_on_later_import(fake_site):
    site = fake_site()
    (r,), proc = run_py('''
        use_fake()
        before = state()["state"]
        import fakeeng.core as core
        from fakeeng.core import helper
        e = core.Engine()
        ran_before = state()["ran"]
        value = e.compute(5)
        report(before=before, after=state()["state"], value=value, other=e.other(), ran_before=ran_before,
               ran_after=state()["ran"], value_again=e.compute(5))
    ''', site)
    assert r["before"] == "waiting"
    assert r["after"] == "applied"
    assert r["value"] == 7 and r["value_again"] == 7  # helper(x, 2) instead of helper(x, 1)
    assert r["other"] == "patched other"
    assert r["ran_before"] is False and r["ran_after"] is True
    assert proc.stderr.count("applied fake-compute") == 1
    assert "pid" in proc.stderr


def test_already_imported_module_is_patched_at_once(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        import fakeeng.core as core
        original = core.Engine.compute
        use_fake()
        report(state=state()["state"], value=core.Engine().compute(1), same=core.Engine.compute is original)
    ''', site)
    assert r == {"state": "applied", "value": 3, "same": True}


def test_marker_leaves_the_code_after_first_run(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        from flashfix.core import registry as _registry
        change = _registry._sites["fake-compute:Engine.compute"]
        first = core.Engine.compute.__code__ is change.marked
        core.Engine().compute(1)
        ran = dict(first=first, then_plain=core.Engine.compute.__code__ is change.plain, let_go=change.marked is None,
                   names=list(core.Engine.compute.__code__.co_names))
        import flashfix
        flashfix.revert()
        report(reverted=core.Engine().compute(1), **ran)
    ''', site)
    assert r["first"] and r["then_plain"] and r["let_go"]
    assert r["reverted"] == 2, r  # the original code back, from the plain code the function ran
    assert "mark_ran" not in r["names"]


def test_idempotent_across_activation_paths(fake_site):
    site = fake_site()
    (r,), proc = run_py('''
        import flashfix, importlib
        from flashfix import _plugin
        use_fake()
        _plugin.register()
        import fakeeng.core as core
        flashfix.activate(); _plugin.register(); use_fake()
        import fake_patches
        report(prepares=len(fake_patches.calls), value=core.Engine().compute(1), state=state()["state"],
               finders=sum(1 for f in sys.meta_path if getattr(f, "flashfix_finder", False)))
    ''', site)
    assert r == {"prepares": 1, "value": 3, "state": "applied", "finders": 1}
    assert proc.stderr.count("applied fake-compute") == 1


def test_atomic_second_part_failure_leaves_nothing_applied(fake_site):
    site = fake_site()
    (r,), proc = run_py('''
        import fakeeng.core as core
        original_code = core.Engine.compute.__code__
        original_other = core.Engine.__dict__["other"]
        use_fake()
        s = state()
        report(state=s["state"], reason=s["reason"], code_same=core.Engine.compute.__code__ is original_code,
               other_same=core.Engine.__dict__["other"] is original_other, value=core.Engine().compute(1))
    ''', site, env={"FAKE_SECOND_PART": "break"})
    assert r["state"] == "failed"
    assert "second part cannot apply" in r["reason"]
    assert r["code_same"] and r["other_same"] and r["value"] == 2
    assert "left as it was" in proc.stderr


def test_revert_restores_the_same_objects(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        import fakeeng.core as core
        compute, code, other = core.Engine.compute, core.Engine.compute.__code__, core.Engine.__dict__["other"]
        use_fake()
        patched = core.Engine().compute(1)
        import flashfix
        flashfix.revert()
        report(patched=patched, value=core.Engine().compute(1), func=core.Engine.compute is compute,
               code=core.Engine.compute.__code__ is code, other=core.Engine.__dict__["other"] is other,
               state=state()["state"], reason=state()["reason"])
    ''', site)
    assert r["patched"] == 3 and r["value"] == 2
    assert r["func"] and r["code"] and r["other"]
    assert r["state"] == "disabled" and "revert" in r["reason"]


def test_fixed_upstream_and_version_gate(fake_site):
    site = fake_site(engine_source=FIXED_ENGINE)
    (r,), _ = run_py('''
        import fakeeng.core as core
        code = core.Engine.compute.__code__
        use_fake()
        report(state=state()["state"], same=core.Engine.compute.__code__ is code)
    ''', site)
    assert r == {"state": "fixed-upstream", "same": True}
    # the version gate: the fixed shape is fixed-upstream whatever the version says, and the
    # pre-fix shape is patched inside the range (1.99, a 1.5 dev build) but not at 2.0
    for version, expected in (("1.99", "applied"), ("1.5.dev3", "applied"), ("2.0", "unknown-shape")):
        site = fake_site(version=version)
        for stale in site.glob("fakeeng-*.dist-info"):
            if stale.name != "fakeeng-%s.dist-info" % version:
                import shutil
                shutil.rmtree(stale)
        (r,), _ = run_py('''
            import fakeeng.core as core
            use_fake()
            report(state=state()["state"], version=state()["engine_version"], value=core.Engine().compute(1))
        ''', site)
        assert (r["state"], r["version"]) == (expected, version)
        assert r["value"] == (3 if expected == "applied" else 2)


def test_pre_fix_shape_outside_version_range_is_unknown(fake_site):
    site = fake_site(version="3.0")
    (r,), proc = run_py('''
        import fakeeng.core as core
        code = core.Engine.compute.__code__
        use_fake()
        report(state=state()["state"], reason=state()["reason"], same=core.Engine.compute.__code__ is code)
    ''', site)
    assert r["state"] == "unknown-shape" and r["same"]
    assert "outside <2" in r["reason"]
    # out of the affected range, even strict mode leaves the engine running
    _, proc = run_py('use_fake(); import fakeeng.core', site, env={"FLASHFIX_STRICT": "1"})
    assert proc.returncode == 0


def test_source_changed_after_import_is_unknown_shape_and_strict_fails_loudly(fake_site):
    site = fake_site()
    code = '''
        import fakeeng.core as core, pathlib
        p = pathlib.Path(core.__file__)
        p.write_text(p.read_text().replace("helper(x, 1)", "helper(x, 1) * 1"))
        use_fake()
        report(state=state()["state"], reason=state()["reason"], value=core.Engine().compute(1))
    '''
    (r,), _ = run_py(code, site)
    assert r["state"] == "unknown-shape"
    assert "differs from the loaded code" in r["reason"]
    assert r["value"] == 2
    # strict: an affected version whose code has an unknown shape fails at the engine's import
    site = fake_site(engine_source="class Engine:\n    pass\n")
    _, proc = run_py('use_fake(); import fakeeng.core', site, env={"FLASHFIX_STRICT": "1"}, check=False)
    assert proc.returncode != 0
    assert "PatchError" in proc.stderr and "fake-compute" in proc.stderr and "no Engine.compute" in proc.stderr
    _, proc = run_py('use_fake(); import fakeeng.core', site)
    assert proc.returncode == 0 and "left untouched: no Engine.compute" in proc.stderr


def test_disable_by_id_and_all(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1))
    ''', site, env={"FLASHFIX_DISABLE": "fake-compute"})
    assert r == {"state": "disabled", "value": 2}
    (r,), _ = run_py('''
        import flashfix
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1),
               finder=any(getattr(f, "flashfix_finder", False) for f in sys.meta_path))
    ''', site, env={"FLASHFIX_DISABLE": "all"})
    assert r == {"state": "disabled", "value": 2, "finder": False}


def test_bad_environment_values_give_one_clear_message(fake_site):
    site = fake_site()
    (r,), proc = run_py('''
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1))
    ''', site, env={"FLASHFIX_DISABLE": "fake-compute,nope", "FLASHFIX_STRICT": "maybe", "FLASHFIX_LOG_LEVEL": "LOUD"})
    assert r == {"state": "disabled", "value": 2}
    err = proc.stderr
    assert err.count("unknown patch id(s) 'nope'") == 1
    assert "valid: all, memory, fake-compute" in err and "vllm-sink-prefill" in err
    assert "FLASHFIX_STRICT='maybe' is not a boolean" in err
    assert "FLASHFIX_LOG_LEVEL='LOUD' is not a level" in err
    assert "Traceback" not in err
    # strict mode turns a malformed value into a hard error at the engine's import, with the same sentence
    _, proc = run_py('use_fake(); import fakeeng.core', site,
                     env={"FLASHFIX_DISABLE": "nope", "FLASHFIX_STRICT": "1"}, check=False)
    assert proc.returncode != 0 and "unknown patch id(s) 'nope'" in proc.stderr


def test_failing_hook_never_breaks_the_import(fake_site):
    site = fake_site()
    (site / "fake_patches.py").write_text((site / "fake_patches.py").read_text().replace(
        "def prepare(modules):", "def prepare(modules):\n    raise KeyError('boom')\n\ndef _unused(modules):"))
    (r,), proc = run_py('''
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(1))
    ''', site)
    assert r == {"state": "failed", "value": 2}
    assert "boom" in proc.stderr


def test_log_level_quiets_info(fake_site):
    site = fake_site()
    code = 'use_fake(); import fakeeng.core; report(state=state()["state"])'
    (r,), proc = run_py(code, site, env={"FLASHFIX_LOG_LEVEL": "debug"})
    assert r["state"] == "applied" and "applied fake-compute" in proc.stderr  # the line exists at DEBUG ...
    (r,), proc = run_py(code, site, env={"FLASHFIX_LOG_LEVEL": "warning"})
    assert r["state"] == "applied" and "applied fake-compute" not in proc.stderr  # ... and WARNING hides it


def test_status_lists_every_patch_without_importing_engines():
    (r,), _ = run_py('''
        import flashfix
        rows = flashfix.status()
        report(ids=sorted(x["id"] for x in rows), keys=sorted(rows[0]),
               heavy=[m for m in ("torch", "vllm", "sglang", "flashinfer", "wrapt") if m in sys.modules])
    ''')
    assert {"vllm-sink-prefill", "sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune", "sglang-vision-config"} <= set(r["ids"])
    assert {"id", "state", "reason", "engine_version", "ran"} <= set(r["keys"])
    assert r["heavy"] == []




def test_revert_by_id_and_unknown_id(fake_site):
    site = fake_site()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        import flashfix
        try:
            flashfix.revert("no-such-patch")
            error = None
        except ValueError as exc:
            error = str(exc)
        still = state()["state"]
        flashfix.revert("fake-compute")
        report(error=error, still=still, after=state()["state"], value=core.Engine().compute(1))
    ''', site)
    assert "unknown patch id(s) 'no-such-patch'" in r["error"] and "fake-compute" in r["error"]
    assert r["still"] == "applied" and r["after"] == "disabled" and r["value"] == 2


def test_missing_target_module_reads_not_affected_like_the_doctor(fake_site):
    site = fake_site()
    (site / "fakeeng" / "core.py").unlink()
    (r,), _ = run_py('''
        use_fake()
        import fakeeng
        from flashfix.tools import doctor as _doctor
        rows, _ = _doctor.diagnose()
        doctor = {x["id"]: x["verdict"] for x in rows}["fake-compute"]
        report(state=state()["state"], doctor=doctor)
    ''', site)
    assert r == {"state": "not-affected", "doctor": "not-affected"}


# The same fix as FAKE_PATCHES' hand-written patch, declared: a declaration is judged and its code compiled
# from the source just before its target runs (registry._read_ahead), then checked against the loaded code.
BACKPORT = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Engine.compute", before="helper($X, 1)", after="helper($X, 2)",
    summary="compute adds 2", doc="Why: a test. How: the second argument. Delete when: never."),)
'''


def test_declaration_is_read_ahead_of_its_target(fake_site):
    site = fake_site(patches=BACKPORT)
    (r,), proc = run_py('''
        use_fake()
        import flashfix
        seen = []
        flashfix.before_run("fakeeng.core", lambda module: seen.append(sorted(k for k in vars(module) if k[:2] != "__")))
        import fakeeng.core as core
        from flashfix.core import registry as _registry
        record = _registry._records["fake-compute"]
        change = record["changes"][0]
        refused = [_registry.swap(core.Engine.other, "fake-compute", "Engine.compute", change.old, change.marked, change.plain),
                   _registry.swap(core.Engine.compute, "fake-compute", "Engine.compute", change.old, change.marked,
                                  change.plain)]  # other's qualname; compute now runs the marked code, not change.old
        report(state=state()["state"], value=core.Engine().compute(5), ahead=record["ahead"], code_ahead=change.ahead,
               seen=seen, refused=refused, line=core.Engine.compute.__code__.co_firstlineno, ahead_left=list(_registry._ahead))
    ''', site, env={"FLASHFIX_LOG_LEVEL": "DEBUG"})
    assert r["seen"] == [[]]  # the callback ran before the module's code
    assert r["state"] == "applied" and r["value"] == 7
    assert r["ahead"] is True and r["code_ahead"] is True, r
    assert r["refused"] == [None, None] and r["line"] == 6 and r["ahead_left"] == []
    assert "judged from the source read just before fakeeng.core ran" in proc.stderr


def test_a_file_changed_after_the_read_ahead_is_read_again(fake_site):
    site = fake_site(patches=BACKPORT)
    (r,), _ = run_py('''
        use_fake()
        import pathlib
        import fakeeng, flashfix  # fakeeng's import hooks the patch (and its read-ahead) first
        path = pathlib.Path(fakeeng.__file__).with_name("core.py")
        flashfix.before_run("fakeeng.core", lambda module: path.write_text("# added after the read-ahead\\n" + path.read_text()))
        import fakeeng.core as core
        from flashfix.core import registry as _registry
        record = _registry._records["fake-compute"]
        report(state=state()["state"], value=core.Engine().compute(5), ahead=record["ahead"],
               code_ahead=record["changes"][0].ahead, line=core.Engine.compute.__code__.co_firstlineno)
    ''', site)
    assert r == {"state": "applied", "value": 7, "ahead": False, "code_ahead": False, "line": 7}


def test_a_failing_before_run_callback_never_fails_the_import(fake_site):
    site = fake_site(patches=BACKPORT)
    (r,), proc = run_py('''
        use_fake()
        import flashfix

        def refuse(module):
            raise flashfix.HookAbort("refused")

        flashfix.before_run("fakeeng.core", refuse)
        import fakeeng.core as core
        report(state=state()["state"], value=core.Engine().compute(5))
    ''', site, env={"FLASHFIX_STRICT": "1"})
    assert r == {"state": "applied", "value": 7}
    assert "fakeeng.core (before it ran) failed" in proc.stderr and "refused" in proc.stderr


KINDS_ENGINE = '''from __future__ import annotations


def helper(a, b):
    return a + b


class Base:
    def compute(self, x):
        return 0


class Engine(Base):
    def compute(self, x: int) -> int:
        return super().compute(x) + helper(x, 1)

    class Inner:
        def __scale(self):
            return 3

        def go(self, x):
            return helper(x, 1) * self.__scale()

    @staticmethod
    def stat(x):
        return helper(x, 1)


async def acompute(x):
    return helper(x, 1)


def gen(x):
    yield helper(x, 1)
'''

KINDS_PATCHES = '''
from flashfix.semantic import Backport

PATCHES = tuple(Backport(
    id=id, engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function=function, before="helper($X, 1)", after="helper($X, 2)",
    summary="adds 2", doc="Why: a test. How: the second argument. Delete when: never.")
    for id, function in [("fake-compute", "Engine.compute"), ("fake-inner", "Engine.Inner.go"),
                         ("fake-stat", "Engine.stat"), ("fake-async", "acompute"), ("fake-gen", "gen")])
'''


def test_read_ahead_compiles_every_kind_of_function_as_loaded(fake_site):
    """Zero-argument super() (a __class__ cell), a nested class's private name, a staticmethod, a coroutine,
    a generator, ``from __future__ import annotations``: the code compiled ahead is what the module loads,
    so each is swapped from the read-ahead; and again after a reload."""
    site = fake_site(engine_source=KINDS_ENGINE, patches=KINDS_PATCHES)
    (first, again), _ = run_py('''
        use_fake()
        import asyncio, importlib
        import fakeeng.core as core
        from flashfix.core import registry as _registry

        def look():
            records = {k: v for k, v in _registry._records.items() if k.startswith("fake-")}
            report(states=sorted({r["state"] for r in records.values()}),
                   ahead=sorted({c.ahead for r in records.values() for c in r["changes"]}),
                   values=[core.Engine().compute(5), core.Engine.Inner().go(5), core.Engine.stat(5),
                           asyncio.run(core.acompute(5)), next(core.gen(5))])

        look()
        importlib.reload(core)
        look()
    ''', site)
    for r in (first, again):
        assert r == {"states": ["applied"], "ahead": [True], "values": [7, 21, 7, 7, 7]}, r
