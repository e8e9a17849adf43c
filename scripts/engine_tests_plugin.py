"""pytest plugin for scripts/engine_tests.py, loaded with ``-p engine_tests_plugin`` inside an engine
environment: imports flashfix before any test module (so its hooks are in place before the engine is
imported; under FLASHFIX_DISABLE=all that import installs nothing), records every test's outcome and,
at the end, what flashfix did in this process, as JSON in $ENGINE_TESTS_OUT."""

import json
import os
import sys

import flashfix

_outcomes = {}  # nodeid -> passed / failed / skipped / error
_seconds = {}  # test file -> seconds spent in its tests (setup, call, teardown)


def pytest_collectreport(report):
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "error"
    elif report.skipped:  # a module that skips itself at import (no GPU, say): one id for the whole file
        _outcomes[report.nodeid] = "skipped"


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _seconds[path] = _seconds.get(path, 0.0) + report.duration
    if report.skipped:
        outcome = "skipped"
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.when == "call":
        outcome = "passed"
    else:
        return
    if _outcomes.get(report.nodeid) in (None, "passed", "skipped"):  # a teardown error overrides a pass
        _outcomes[report.nodeid] = outcome


def pytest_sessionfinish(session, exitstatus):
    status = flashfix.status()
    engines = {row["engine"] for row in status} | {"flashinfer"}
    imported = sorted(name for name in sys.modules if name.split(".")[0] in engines)
    with open(os.environ["ENGINE_TESTS_OUT"], "w") as out:
        json.dump({"outcomes": _outcomes, "status": status, "imported": imported, "exitstatus": int(exitstatus), "file_seconds": _seconds,
                   "flashfix": flashfix.__file__}, out, default=str)
