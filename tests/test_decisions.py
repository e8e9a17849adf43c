"""Stored decisions (``flashfix prepare``, ``flashfix.core.decisions``): reused only on the very source they were
judged on, and then the same as deciding from source.

On SGLang 0.5.17's own code: ``flashfix prepare`` stores every patch's decision; an engine process importing
its targets then decides each patch from the store (no source read) and ends with the same states, reasons and
the same compiled code as a process with ``FLASHFIX_CACHE_DIR=off``. On a small engine written here: an entry
is not used once the target's source, the pack's declaration or a module the probe read has changed, or when
the entry is damaged, and an engine process never writes one.
"""

import json
import os
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
from conftest import FIXED_ENGINE, run_py  # noqa: E402

SGLANG_TARGETS = ["sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.configs.model_config",
                  "sglang.srt.model_executor.runner.flashinfer_autotune", "sglang.srt.model_executor.model_runner"]

PREPARE = '''
import contextlib, io, json
from flashfix.tools import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = cli.main(["prepare"])
print("FLASHFIX_RESULT=" + json.dumps({"code": code, "lines": out.getvalue().splitlines()}), flush=True)
'''

ENGINE = '''
import importlib, json, logging, sys
class Keep(logging.Handler):
    lines = []
    def emit(self, record): self.lines.append(record.getMessage())
logging.getLogger("flashfix").addHandler(Keep())  # FLASHFIX_LOG_LEVEL=DEBUG
import flashfix
from flashfix.core import registry
for name in %r:
    importlib.import_module(name)
flat = lambda c: [c.co_code.hex(), list(c.co_names), [flat(k) if hasattr(k, "co_code") else repr(k) for k in c.co_consts]]
code = {}
for pid, record in registry._records.items():
    for change in record["changes"]:
        if hasattr(change, "plain"):
            code["%%s %%r" %% (pid, change)] = [flat(c) for c in (change.marked, change.plain, change.func.__code__)]
print("FLASHFIX_RESULT=" + json.dumps({
    "states": {r["id"]: [r["state"], r["reason"]] for r in flashfix.status() if r["engine"] in ("sglang", "flashinfer-python")},
    "stored": sorted(l.split(":")[0] for l in Keep.lines if "decided from the decision stored" in l),
    "code": code}), flush=True)
'''


DOCTOR = PREPARE.replace('["prepare"]', '["doctor"]')


def test_stored_decisions_on_sglang_decide_as_the_source_does(tmp_path):
    store = tmp_path / "decisions"
    env = {"FLASHFIX_CACHE_DIR": str(store), "FLASHFIX_LOG_LEVEL": "DEBUG"}
    (before,) = engine_env.run("sglang==0.5.17", DOCTOR, env=env)  # the doctor says whether prepare has run
    assert re.search(r"; decisions stored: 0/(\d+) \(run flashfix prepare\)$", before["lines"][-1]), before
    (prepared,) = engine_env.run("sglang==0.5.17", PREPARE, env=env)
    assert prepared["code"] == 0, prepared
    stored = [l.split()[0] for l in prepared["lines"] if " stored (" in l]
    assert len(stored) >= 15 and "sglang-fp8-kv-scales" in stored and "flashinfer-sink-jit-name" in stored, prepared
    assert not [l for l in prepared["lines"] if l.startswith("vllm-")], prepared  # vLLM is not installed there
    entries = sorted(os.listdir(store))
    (after,) = engine_env.run("sglang==0.5.17", DOCTOR, env=env)
    total = re.search(r"0/(\d+) ", before["lines"][-1]).group(1)
    assert after["lines"][-1].endswith("; decisions stored: %s/%s" % (total, total)), after["lines"][-1]
    (cached,) = engine_env.run("sglang==0.5.17", ENGINE % (SGLANG_TARGETS,), env=env)
    assert sorted(os.listdir(store)) == entries  # the engine process wrote nothing
    (fresh,) = engine_env.run("sglang==0.5.17", ENGINE % (SGLANG_TARGETS,), env={"FLASHFIX_CACHE_DIR": "off", "FLASHFIX_LOG_LEVEL": "DEBUG"})
    assert fresh["stored"] == []
    decided = [i for i, (state, _) in fresh["states"].items() if state != "waiting"]
    assert len(cached["stored"]) >= 12 and set(cached["stored"]) <= set(decided), cached["stored"]
    assert cached["states"] == fresh["states"], json.dumps([cached["states"], fresh["states"]], indent=1)
    assert [s for s, _ in fresh["states"].values()].count("applied") >= 6, fresh["states"]
    assert cached["code"] == fresh["code"] and len(fresh["code"]) >= 6, sorted(fresh["code"])



FAKE_PREPARE = '''
import contextlib, io
import flashfix
flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
from flashfix.tools import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = cli.main(["prepare"])
report(code=code, lines=out.getvalue().splitlines())
'''

FAKE_RUN = '''
import logging
lines = []
class Keep(logging.Handler):
    def emit(self, record): lines.append(record.getMessage())
logging.getLogger("flashfix").addHandler(Keep())  # FLASHFIX_LOG_LEVEL=DEBUG
%s
report(state=state()["state"], reason=state()["reason"], value=core.Engine().compute(1),
       stored=any("decided from the decision stored" in l for l in lines))
'''


def _fake_run(site, store, order="ahead"):
    from conftest import IMPORT_ORDERS

    (r,), _ = run_py(FAKE_RUN % IMPORT_ORDERS[order], site=site, env={"FLASHFIX_CACHE_DIR": str(store),
                                                                    "FLASHFIX_LOG_LEVEL": "DEBUG"})
    return r


def _prepare(site, store):
    (r,), _ = run_py(FAKE_PREPARE, site=site, env={"FLASHFIX_CACHE_DIR": str(store)})
    assert r["code"] == 0 and any(l.startswith("fake-compute") and "stored (patch)" in l for l in r["lines"]), r
    return r


def test_a_stored_decision_is_used_only_on_the_source_it_was_made_on(fake_site, tmp_path):
    site, store = fake_site(), tmp_path / "store"
    r = _fake_run(site, store)  # nothing stored yet: decided from source, nothing written
    assert (r["state"], r["value"], r["stored"]) == ("applied", 3, False), r
    assert not store.exists()
    _prepare(site, store)
    for order in ("ahead", "loaded"):  # read ahead of the module, or decided once it is imported
        r = _fake_run(site, store, order)
        assert (r["state"], r["value"], r["stored"]) == ("applied", 3, True), (order, r)
    (site / "fakeeng" / "core.py").write_text(FIXED_ENGINE)  # the engine's source changes: judged again
    r = _fake_run(site, store)
    assert (r["state"], r["value"], r["stored"]) == ("fixed-upstream", 3, False), r


def test_a_changed_declaration_or_a_damaged_entry_is_judged_from_source(fake_site, tmp_path):
    site, store = fake_site(), tmp_path / "store"
    _prepare(site, store)
    assert _fake_run(site, store)["stored"] is True
    pack = site / "fake_patches.py"
    pack.write_text(pack.read_text().replace('versions="<2"', 'versions="<1"'))  # the pack changed since
    r = _fake_run(site, store)
    assert (r["state"], r["stored"]) == ("unknown-shape", False), r
    assert "outside <1" in r["reason"], r
    pack.write_text(pack.read_text().replace('versions="<1"', 'versions="<2"'))
    _prepare(site, store)
    assert _fake_run(site, store)["stored"] is True
    for entry in store.iterdir():
        entry.write_bytes(entry.read_bytes()[:7])  # cut short: not marshal data any more
    r = _fake_run(site, store)
    assert (r["state"], r["value"], r["stored"]) == ("applied", 3, False), r
    off = _fake_run(site, "off")
    assert (off["state"], off["stored"]) == ("applied", False), off


def test_prepare_says_when_it_cannot_write(fake_site, tmp_path):
    site, blocker = fake_site(), tmp_path / "a-file"
    blocker.write_text("not a folder")
    (r,), proc = run_py(FAKE_PREPARE, site=site, env={"FLASHFIX_CACHE_DIR": str(blocker / "decisions")})
    assert r["code"] == 1 and any(l.startswith("fake-compute") and "cannot be written" in l for l in r["lines"]), r
    assert "cannot be written: run it as who installs flashfix" in proc.stderr, proc.stderr
