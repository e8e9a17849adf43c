"""flashfix._versions against packaging's SpecifierSet(spec, prereleases=True), the reference it
replaces for the patches' version gates."""

import itertools
import json

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from conftest import REPO
from flashfix import _registry, _versions

SWEPT = sorted({r["version"] for r in json.loads((REPO / "benchmarks" / "results" / "sweep.json").read_text())["releases"]})
EDGES = [
    "0.27.0.dev0", "0.27.0", "0.27.0rc1", "0.27.0.post1", "0.27.0+cu130", "0.27.2.dev41+g0123abc", "0.26.9",
    "0.27", "0.27.0.0", "v0.27.0", "1!0.1", "0.5.1", "0.5.1.post3", "0.5.0rc2", "0.5.1a1", "0.5.1.dev3",
    "0.5.1-1", "0.5.1-r2", "0.5.1_rc_1", "0.5.1.ALPHA2", "0.5.1c1", "0.5.1pre1", "0.5.1preview", "0.5.1.b",
    "0.5.1+local.7.abc", "0.5.1+7", "0.5.1+abc", "0.5.1+ABC.1-2_3", "0.7.4", "0.7.4rc1", "0.7.4.dev0",
    "0.7.4+cu128", "0.7.3.post2", "0.2.9", "0.2.9.dev1", "0.2.10", " 0.6.17 ", "0.7.4.post1",
    "0.5.1.post3.dev0", "0.5.1.post4.dev0", "0.27.0.dev1", "0.27.0.dev0+x", "0.5.1rc1.post1", "0.5.1rc2",
    "0.5.1rc1+l", "0.5.1.post3+l", "1.0a1.post2.dev3", "0.dev0", "0", "0.0.0.post0",
    "not a version", "0.5.1.foo", "", "1.0+", "1.0+a..b",
]
BOUNDS = ["0.5.1", "0.27.0.dev0", "0.27.0", "0.7.4", "0.2.9", "0.5.1.post3", "0.5.1rc1", "0.27", "1!0.1",
          "0.5.1+abc", "0.5.1.post3.dev1", "1.0a1.post2", "0.dev0", "0"]
OPS = ["==", "!=", "<=", ">=", "<", ">"]


def reference(spec, version):
    try:
        parsed = Version(version)
    except InvalidVersion:
        return "invalid"
    return SpecifierSet(spec, prereleases=True).contains(parsed, prereleases=True)


def ours(spec, version):
    try:
        return _versions.contains(spec, version)
    except ValueError:
        return "invalid"


def specs():
    for op, bound in itertools.product(OPS, BOUNDS):
        if "+" in bound and op not in ("==", "!="):
            continue  # not a valid specifier at all
        yield op + bound
    yield ">=0.2.9,<0.7.4"
    yield ">=0.5.1"
    yield ">=0.27.0.dev0"
    yield " >= 0.5.1 , != 0.5.3 "


@pytest.mark.parametrize("spec", list(specs()))
def test_same_answers_as_packaging(spec):
    versions = SWEPT + EDGES
    assert len(SWEPT) > 90
    got = {v: ours(spec, v) for v in versions}
    assert _versions.UNSUPPORTED not in got.values()
    assert got == {v: reference(spec, v) for v in versions}


@pytest.mark.parametrize("spec", ["~=0.5.1", "==0.5.*", "===0.5.1", "", ">=0.5.1,~=0.5"])
def test_other_clauses_are_left_to_packaging(spec):
    assert _versions.contains(spec, "0.5.2") is _versions.UNSUPPORTED
    patch = type("P", (), {"versions": spec})
    assert _registry.in_range(patch, "0.5.2") == SpecifierSet(spec, prereleases=True).contains("0.5.2", prereleases=True)


def test_declared_ranges_are_evaluated_here():
    # every patch's declared range takes the fast path (no packaging import in the doctor)
    _registry.load_all()
    assert len(_registry._patches) >= 5
    for patch in _registry._patches.values():
        assert _versions.contains(patch.versions, "0.1") is not _versions.UNSUPPORTED, patch.id
