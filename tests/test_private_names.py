"""Private (name-mangled) names: a declaration's ``function="Planner.__wants_vision"`` (as ``__qualname__`` spells
it, and as the source's ``def __wants_vision`` inside ``class Planner``) is the attribute ``_Planner__wants_vision``
at run time. Before: the doctor said ``patch`` (it reads the source), the runtime looked the method up unmangled,
found nothing, called that "defined under a condition that did not hold" and said ``not-affected``, and strict mode
passed with the bug still running. Now the runtime finds it mangled and applies the fix, the rewritten code of a
method keeps Python's mangling of ``self.__x``, and a name the source defines outside any condition that is not
bound at run time is ``unknown-shape`` (strict mode fails), never ``not-affected``. A fake engine (tests/conftest.py)
with a declarative pack; the doctor runs as ``python -m flashfix doctor --json`` does, in a process that watches
the fake engine."""

import pytest
from conftest import IMPORT_ORDERS as ORDERS, run_py
from conftest import fake_doctor_row as doctor

ENGINE = '''
def helper(a, b):
    return a + b

class Planner:
    def __init__(self):
        self.__step = 10

    def __wants_vision(self, x):
        return helper(x, 1)

    def plan(self, x):
        return self.__wants_vision(x)

    def scaled(self, x):
        return helper(x, 1)

    def __scaled_privately(self, x):
        return helper(x, 1)

    def scaled_privately(self, x):
        return self.__scaled_privately(x)
'''

PACK = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function=%r, before="helper($X, 1)", after=%r,
    summary="adds 2", doc="Why: a test. Delete when: never."),)
'''

# ``python -m flashfix doctor --json`` in a process that watches the fake engine (as ``use_fake`` does)
def pack(function="Planner.__wants_vision", after="helper($X, 2)"):
    return PACK % (function, after)




@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_private_method_is_patched_and_reverted(fake_site, order):
    """Before: not-affected ("defined under a condition that did not hold"), the method still adding 1."""
    site = fake_site(engine_source=ENGINE, patches=pack())
    (r,), _ = run_py('''
        import flashfix
        %s
        from flashfix.core import registry
        first = dict(state(), ahead=registry._records["fake-compute"].get("ahead"))
        value = core.Planner().plan(5)
        fixed_code = core.Planner._Planner__wants_vision.__code__
        flashfix.revert("fake-compute")
        report(state=first["state"], ahead=first["ahead"], value=value, reverted=core.Planner().plan(5),
               after=state()["state"], name=fixed_code.co_name,
               qualname=getattr(fixed_code, "co_qualname", "Planner.__wants_vision"))
    ''' % ORDERS[order].replace("\n", "\n        "), site)
    assert (r["state"], r["value"], r["after"], r["reverted"]) == ("applied", 7, "disabled", 6), r
    assert r["ahead"] is (order == "ahead"), r
    assert (r["name"], r["qualname"]) == ("__wants_vision", "Planner.__wants_vision"), r


def test_the_doctor_says_what_the_runtime_does_for_a_private_method(fake_site):
    """Before: the doctor said patch, the runtime not-affected; strict mode passed with the bug running."""
    site = fake_site(engine_source=ENGINE, patches=pack())
    code, row = doctor(site, strict=True)
    (r,), _ = run_py('''
        use_fake()
        import fakeeng.core as core
        report(state=state()["state"], reason=state()["reason"], value=core.Planner().plan(5))
    ''', site, env={"FLASHFIX_STRICT": "1"})
    assert row["verdict"] == "patch" and code == 0, row
    assert {"patch": "applied"}[row["verdict"]] == r["state"] and r["value"] == 7, (row, r)


def test_a_method_whose_new_code_reads_a_private_attribute_keeps_the_mangling(fake_site):
    """``self.__step`` in the new code of a public method and of a private one reads ``self._Planner__step``: the
    code is recompiled inside a class named as the method's own (before: the private method was not patched)."""
    for function, call in (("Planner.scaled", "scaled"), ("Planner.__scaled_privately", "scaled_privately")):
        site = fake_site(engine_source=ENGINE, patches=pack(function, "helper($X, self.__step)"))
        (r,), _ = run_py('''
            import flashfix
            use_fake()
            import fakeeng.core as core
            applied = state()["state"]
            value = getattr(core.Planner(), %r)(5)
            names = getattr(core.Planner, %r).__code__.co_names
            flashfix.revert("fake-compute")
            report(state=applied, value=value, names=names,
                   reverted=getattr(core.Planner(), %r)(5))
        ''' % (call, core_attr(function), call), site)
        assert (r["state"], r["value"], r["reverted"]) == ("applied", 15, 6), (function, r)
        assert "_Planner__step" in r["names"] and "__step" not in r["names"], (function, r)


def core_attr(function):
    name = function.split(".")[1]
    return "_Planner" + name if name.startswith("__") else name


REMOVED = ENGINE + '''
del Planner._Planner__wants_vision  # bound where the source defines it, then gone: no condition to blame
'''

CONDITIONAL = '''
def helper(a, b):
    return a + b

class Planner:
    if False:  # what the source defines under a condition that does not hold here
        def __wants_vision(self, x):
            return helper(x, 1)

    def plan(self, x):
        return 0
'''


STRICT = '''
import flashfix
try:
    %s
except flashfix.PatchError as exc:
    error = str(exc)
else:
    error = None
report(state=state()["state"], reason=state()["reason"], error=error)
'''


def strictly(order, site):
    """The fake patch's state and reason, and the PatchError strict mode raised (None: none), in ``order``."""
    (r,), _ = run_py(STRICT % ORDERS[order].replace("\n", "\n    "), site, env={"FLASHFIX_STRICT": "1"})
    return r


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_name_unbound_outside_any_condition_is_unknown_shape_and_fails_strict_mode(fake_site, order):
    """Before: not-affected, with "defined under a condition that did not hold", and strict mode passed."""
    r = strictly(order, fake_site(engine_source=REMOVED, patches=pack()))
    assert r["state"] in ("unknown-shape", "failed") and r["error"], r
    assert "not found bound where the source defines it" in r["reason"], r
    assert "condition that did not hold" not in r["reason"], r
    # a def under a condition that did not hold is still not-affected, and strict mode lets it be
    r = strictly(order, fake_site(engine_source=CONDITIONAL, patches=pack()))
    assert (r["state"], r["error"]) == ("not-affected", None) and "under a condition, line 6," in r["reason"], r


CLASS_BODY = '''
class Tuner:
    __limit = 1

    def limit(self):
        return self.__limit
'''

CLASS_PACK = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Tuner", before="__limit = 1", after="__limit = 2",
    summary="limit 2", doc="Why: a test. Delete when: never."),)
'''


def test_a_class_body_backport_that_spells_a_private_name_is_refused_by_the_doctor_as_at_run_time(fake_site):
    """A class body's new statements run compiled outside the class, where ``__limit`` would not be mangled.
    Before: applied, setting ``Tuner.__limit`` beside ``Tuner._Tuner__limit``, the bug still running."""
    site = fake_site(engine_source=CLASS_BODY, patches=CLASS_PACK)
    code, row = doctor(site, strict=True)
    r = strictly("ahead", site)
    assert (row["verdict"], r["state"]) == ("unknown-shape", "unknown-shape") and r["error"] and code == 1, (row, r)
    assert row["reason"] == r["reason"] and "private name __limit" in r["reason"], (row, r)
