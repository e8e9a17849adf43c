"""A declaration that adds a keyword parameter to a function and passes it from a caller (issue 34 item 4:
``Rule(..., parameters="name=default")``), on a small engine: one hunk gives ``Updater.call`` a keyword-only
``window=-1`` and uses it, another passes ``window=`` from ``Updater.update``; applied whole or not at all.

Before this, a declaration could change function bodies only: the new keyword was a free name (unknown-shape)
and the caller's call a TypeError. Checked: both import orders (code made before the module ran, and from the
loaded function); the signature, ``__kwdefaults__`` and behaviour patched and after ``revert``; a series (a
body-only patch of ``call`` first) reverted in both orders; ``flashfix diff`` writing the parameter on the def's
own line with the engine's comments kept; the refusals (a parameter of that name already there, ``**kwargs``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from conftest import FAKE_DOCTOR, IMPORT_ORDERS, REPO, run_py  # noqa: E402

ENGINE = '''
def begin(**kw):
    return kw


class Updater:
    def call(self, n, ragged=False,
             scale=None,
             ):
        # plan it
        return begin(n=n, scale=scale)

    def update(self, n, size):
        return self.call(n, ragged=False)
'''

PACK = '''
from flashfix.semantic import Backport, Rule

SCALE = Backport(
    id="fake-scale", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Updater.call", before="begin(n=n, scale=scale)", after="begin(n=n, scale=scale or 1.0)",
    summary="a body-only fix first in call's series", doc="Why: a test. Delete when: never.")

WINDOW = Backport(
    id="fake-window", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/2",
    summary="call takes the window; update passes it", doc="Why: a test. Delete when: never.",
    hunks=(Rule("fakeeng.core", "Updater.call", parameters="window=-1", before="begin($$$A, **$$$KW)",
                after="begin($$$A, **$$$KW, window=window)", fixed_if="begin($$$_, window=$_, **$$$_)"),
           Rule("fakeeng.core", "Updater.update", before="self.call($$$A, **$$$KW)",
                after="self.call($$$A, **$$$KW, window=size)")))

PATCHES = (SCALE, WINDOW)
'''

CODE = '''
import inspect
import flashfix
flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
%s
def seen():
    u = core.Updater()
    return {"update": u.update(3, 7), "call": u.call(3), "signature": str(inspect.signature(core.Updater.call)),
            "kwdefaults": core.Updater.call.__kwdefaults__}
out = {"states": {r["id"]: r["state"] for r in flashfix.status() if r["id"].startswith("fake")}, "patched": seen(),
       "reasons": [r["reason"] for r in flashfix.status() if r["id"].startswith("fake")]}
flashfix.revert(*FIRST)
out["one reverted"] = seen()
out["states after"] = {r["id"]: r["state"] for r in flashfix.status() if r["id"].startswith("fake")}
flashfix.revert("fake-scale", "fake-window")
out["reverted"] = seen()
report(**out)
'''

RELEASED = {"update": {"n": 3, "scale": None}, "call": {"n": 3, "scale": None},
            "signature": "(self, n, ragged=False, scale=None)", "kwdefaults": None}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
@pytest.mark.parametrize("first", [("fake-window",), ("fake-scale",)])
def test_parameter_added_with_its_caller_then_reverted(fake_site, order, first):
    site = fake_site(engine_source=ENGINE, patches=PACK)
    (r,), _ = run_py("FIRST = %r\n" % (first,) + CODE % IMPORT_ORDERS[order], site=site)
    assert r["states"] == {"fake-scale": "applied", "fake-window": "applied"}, r
    assert r["patched"] == {"update": {"n": 3, "scale": 1.0, "window": 7}, "call": {"n": 3, "scale": 1.0, "window": -1},
                            "signature": "(self, n, ragged=False, scale=None, *, window=-1)",
                            "kwdefaults": {"window": -1}}, r
    if first == ("fake-window",):  # the body-only fix stays, the signature goes back
        assert r["one reverted"] == dict(RELEASED, update={"n": 3, "scale": 1.0}, call={"n": 3, "scale": 1.0}), r
    else:  # the parameter stays, compiled without the other fix
        assert r["one reverted"] == dict(r["patched"], update={"n": 3, "scale": None, "window": 7},
                                         call={"n": 3, "scale": None, "window": -1}), r
    assert r["states after"][first[0]] == "disabled", r
    assert r["reverted"] == RELEASED, r


def test_diff_writes_the_parameter_on_the_defs_own_line(fake_site):
    site = fake_site(engine_source=ENGINE, patches=PACK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)])
    proc = subprocess.run([sys.executable, "-c", FAKE_DOCTOR, "diff", "fake-window"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "written whole by ast.unparse" not in out, out
    changed = [line for line in out.splitlines() if line[:1] in ("+", "-") and not line.startswith(("+++", "---"))]
    assert changed == ["-             scale=None,", "+             scale=None, *, window=-1,",
                       "-        return begin(n=n, scale=scale)", "+        return begin(n=n, scale=scale, window=window)",
                       "-        return self.call(n, ragged=False)", "+        return self.call(n, ragged=False, window=size)"], out
    assert "         # plan it\n" in out, out  # the engine's comment, as context


@pytest.mark.parametrize("signature, reason", [
    ("def call(self, n, ragged=False, scale=None, window=0):", "already takes a parameter window"),
    ("def call(self, n, ragged=False, scale=None, **extra):", "takes **extra"),
])
def test_refused_where_the_parameter_cannot_be_added(fake_site, signature, reason):
    engine = ENGINE.replace("def call(self, n, ragged=False,\n             scale=None,\n             ):", signature)
    assert engine != ENGINE
    site = fake_site(engine_source=engine, patches=PACK)
    (r,), _ = run_py('''
        import flashfix
        flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
        flashfix.activate()
        from fakeeng import core
        row = {r["id"]: r for r in flashfix.status()}["fake-window"]
        report(state=row["state"], reason=row["reason"], update=core.Updater().update(3, 7))
    ''', site=site)
    assert r["state"] == "unknown-shape" and reason in r["reason"], r
    assert "window" not in r["update"], r  # the caller is the release's too: nothing half-applied


def test_from_stored_decisions_the_parameter_is_given_its_default(fake_site, tmp_path):
    """``flashfix prepare`` stores the compiled code only; the default comes from the declaration when it is
    swapped in, so an engine process deciding from the store runs the same code with the same defaults."""
    site, store = fake_site(engine_source=ENGINE, patches=PACK), tmp_path / "store"
    (p,), _ = run_py('''
        import contextlib, io
        import flashfix
        flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
        from flashfix.tools import cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(["prepare"])
        report(code=code, lines=out.getvalue().splitlines())
    ''', site=site, env={"FLASHFIX_CACHE_DIR": str(store)})
    assert p["code"] == 0 and any(l.startswith("fake-window") and "stored (patch)" in l for l in p["lines"]), p
    for order in sorted(IMPORT_ORDERS):
        (r,), _ = run_py('''
            import logging
            lines = []
            class Keep(logging.Handler):
                def emit(self, record): lines.append(record.getMessage())
            logging.getLogger("flashfix").addHandler(Keep())
            import flashfix
            flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
            %s
            report(update=core.Updater().update(3, 7), kwdefaults=core.Updater.call.__kwdefaults__,
                   stored=[l for l in lines if "decided from the decision stored" in l])
        ''' % IMPORT_ORDERS[order].replace("\n", "\n            "), site=site,
            env={"FLASHFIX_CACHE_DIR": str(store), "FLASHFIX_LOG_LEVEL": "DEBUG"})
        assert r["update"] == {"n": 3, "scale": 1.0, "window": 7} and r["kwdefaults"] == {"window": -1}, (order, r)
        assert any("fake-window" in l for l in r["stored"]), (order, r)
