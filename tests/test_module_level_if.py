"""A module-top-level (or class-body) hunk whose statement sits inside a top-level ``if``: only the changed
statement runs, in the module's (class's) namespace, and what it binds is set there (revertible). Before: the
whole ``if`` block ran again, so a registration in it happened twice (``revert()`` left the duplicate), a line
``flashfix diff`` shows as unchanged was rebound to a new object, and a block whose condition did not hold said
``applied`` while nothing changed. Now that block is ``not-affected``, naming the condition; a block where
nothing next to the change tells whether it ran is ``unknown-shape`` for the doctor and the runtime alike. A
fake engine (tests/conftest.py) with a declarative pack; the doctor runs as ``python -m flashfix doctor`` does."""

import os
import subprocess
import sys

import pytest
from conftest import FAKE_DOCTOR, REPO, run_py
from conftest import IMPORT_ORDERS as ORDERS
from conftest import fake_doctor_row as doctor

BLOCK = '''
if FAST:
    TABLE = {"page": 1}
    register(TABLE)
    LIMIT = 1
else:
    LIMIT = 4
'''

# target: (engine source, ``function``, the namespace the block runs in)
TARGETS = {
    "module": ('''import os

REGISTRY = []
FAST = os.environ.get("FAKE_FAST", "1") == "1"

def register(item):
    REGISTRY.append(item)
''' + BLOCK, None, "core"),
    "class": ('''import os

REGISTRY = []
FAST = os.environ.get("FAKE_FAST", "1") == "1"

def register(item):
    REGISTRY.append(item)

class Config:''' + BLOCK.replace("\n", "\n    ").rstrip() + "\n", "Config", "core.Config"),
}


def condition_line(target):
    return TARGETS[target][0].splitlines().index(("    " if target == "class" else "") + "if FAST:") + 1


PACK = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function=%r, before=%r, after=%r,
    summary="a new limit", doc="Why: a test. Delete when: never."),)
'''

CHECK = '''
import flashfix
%s
space = %s
def seen():
    return dict(limit=space.LIMIT, registered=len(core.REGISTRY),
                same=bool(core.REGISTRY) and vars(space).get("TABLE") is core.REGISTRY[0],
                names=sorted(k for k in vars(space) if not k.startswith("__")))
row = {r["id"]: r for r in flashfix.status()}["fake-compute"]
patched = seen()
flashfix.revert("fake-compute")
report(state=row["state"], reason=row["reason"], patched=patched, reverted=seen())
'''


def site_for(fake_site, target, before="LIMIT = 1", after="LIMIT = 2", engine=None):
    source, function = TARGETS[target][:2]
    return fake_site(engine_source=engine or source, patches=PACK % (function, before, after))


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_only_the_changed_statement_runs_and_revert_leaves_the_block_as_it_ran(fake_site, target, order):
    """Before: ``register(TABLE)`` ran again (two entries, and two after revert()), and ``TABLE`` was rebound to a
    new dict, no longer the one registered."""
    site = site_for(fake_site, target)
    (r,), _ = run_py(CHECK % (ORDERS[order], TARGETS[target][2]), site)
    assert r["state"] == "applied", r
    assert r["patched"]["limit"] == 2 and r["patched"]["registered"] == 1 and r["patched"]["same"], r
    assert r["reverted"]["limit"] == 1 and r["reverted"]["registered"] == 1 and r["reverted"]["same"], r
    assert r["reverted"]["names"] == r["patched"]["names"], r  # nothing left behind, nothing added
    code, row = doctor(site)
    assert (code, row["verdict"]) == (0, "patch"), row


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_block_whose_condition_did_not_hold_is_not_applied(fake_site, target, order):
    """Before: ``applied`` (the ``else`` branch ran again, binding the same 4), the limit unchanged."""
    site = site_for(fake_site, target)
    (r,), _ = run_py(CHECK % (ORDERS[order], TARGETS[target][2]), site,
                     env={"FAKE_FAST": "0", "FLASHFIX_STRICT": "1"})  # not-affected: strict mode lets it be
    assert r["state"] == "not-affected", r
    assert "under a condition, line %d, that did not hold" % condition_line(target) in r["reason"], r
    assert r["patched"] == r["reverted"] and r["patched"]["limit"] == 4 and r["patched"]["registered"] == 0, r
    assert doctor(site)[1]["verdict"] == "patch"  # the doctor cannot evaluate the condition: the runtime does


REGISTERS_ONLY = '''
REGISTRY = []

def register(item):
    REGISTRY.append(item)

if len(REGISTRY) == 0:
    register("slow")
'''


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_block_where_nothing_tells_whether_it_ran_is_unknown_shape_for_the_doctor_and_the_runtime(fake_site, order):
    """A changed call alone in an ``if`` binds nothing that shows whether the block ran: both refuse it, the
    engine untouched. Before: the whole block ran again (the condition evaluated anew) and said ``applied``."""
    site = site_for(fake_site, "module", 'register("slow")', 'register("fast")', REGISTERS_ONLY)
    (r,), _ = run_py('''
import flashfix
%s
report(row={r["id"]: r for r in flashfix.status()}["fake-compute"], registry=core.REGISTRY)
''' % ORDERS[order], site)
    assert r["row"]["state"] == "unknown-shape" and r["registry"] == ["slow"], r
    code, row = doctor(site)
    assert row["verdict"] == "unknown-shape" and row["reason"] == r["row"]["reason"], (row, r)
    assert "core.py is under a condition (line 7), and no statement next to it tells whether it ran" in row[
        "reason"], row
    assert row["reason"].startswith("line 8 of "), row


IMPORTS = '''import os

FAST = os.environ.get("FAKE_FAST", "1") == "1"
if FAST:
    from json import dumps
else:
    dumps = repr
'''


@pytest.mark.parametrize("fast", ["1", "0"])
def test_a_statement_added_after_an_import_in_the_block_runs_only_where_the_import_did(fake_site, fast):
    """As ``sglang-merge-state-launch-limit``: the import before the new line tells whether the block ran. Before:
    with the ``else`` branch taken, ``applied``, ``ENCODE`` bound to ``repr``."""
    site = site_for(fake_site, "module", "from json import dumps", "from json import dumps\nENCODE = dumps", IMPORTS)
    (r,), _ = run_py('''
import flashfix, json
%s
row = {r["id"]: r for r in flashfix.status()}["fake-compute"]
encode = getattr(core, "ENCODE", None)
flashfix.revert("fake-compute")
report(state=row["state"], reason=row["reason"], encode=encode is json.dumps, dumps=core.dumps is json.dumps,
       left=hasattr(core, "ENCODE"))
''' % ORDERS["loaded"], site, env={"FAKE_FAST": fast})
    if fast == "1":
        assert (r["state"], r["encode"], r["dumps"], r["left"]) == ("applied", True, True, False), r
    else:
        assert (r["state"], r["encode"], r["dumps"], r["left"]) == ("not-affected", False, False, False), r
        assert "fakeeng.core.dumps is bound to something else in this process (bound at line 5 under a condition, " \
               "line 4, that did not hold" in r["reason"], r


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_diff_shows_the_one_changed_line(fake_site, target):
    """``flashfix diff`` prints the one changed line of the block, and the runtime compiles that same text."""
    site = site_for(fake_site, target)
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
               PYTHONPATH=os.pathsep.join([str(REPO), str(site)]))
    proc = subprocess.run([sys.executable, "-c", FAKE_DOCTOR, "diff", "fake-compute"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    changed = [line[0] + line[1:].strip() for line in proc.stdout.splitlines()
               if line[:1] in ("+", "-") and line[:3] not in ("+++", "---")]
    assert changed == ["-LIMIT = 1", "+LIMIT = 2"], proc.stdout
