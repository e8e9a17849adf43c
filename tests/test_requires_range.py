"""``requires`` judged on a release read, not installed (issue 35 item 8): a release that declares a range for the
dependency a fix needs (vLLM 0.28.0: ``xgrammar<1.0.0,>=0.2.1``) reads ``patch``, saying that it depends on which
one is installed and what the release allows, not ``known-unfixed (not installed)``; and the dependency's own
wheel can be given as a second ``--path``, to judge it as installed. The release's real code and METADATA (the
target module and its packages, zipped as a wheel holds them), its real xgrammar 0.2.3 METADATA, and a real pack
wheel built with uv."""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

import engine_env
from conftest import REPO
from test_packs import make_project, uv

TARGET = "vllm/v1/attention/backends/flashinfer.py"
PACK = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="ffx-xg-heads", engine="vllm", versions=">=0.28,<0.29", fixed_in="0.29.0",
    upstream="https://example.invalid/pr/1", module="vllm.v1.attention.backends.flashinfer",
    function="FlashInferBackend.get_supported_head_sizes", before="[64, 128, 256, 512]", after="[64, 128, 256]",
    requires={"xgrammar": "%s"}, summary="a fix that needs a newer xgrammar",
    doc="Why: a test of requires. Delete when: never."),)
'''


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("rq")
    (site,) = (engine_env.env_python("vllm==0.28.0").parent.parent / "lib").glob("python*/site-packages")
    release = root / "vllm-0.28.0-subset.whl"
    with zipfile.ZipFile(release, "w") as z:
        z.write(site / "vllm-0.28.0.dist-info" / "METADATA", "vllm-0.28.0.dist-info/METADATA")
        parts = TARGET.split("/")
        for depth in range(1, len(parts)):
            z.write(site.joinpath(*parts[:depth], "__init__.py"), "/".join(parts[:depth] + ["__init__.py"]))
        z.write(site / TARGET, TARGET)
    dependency = root / "xgrammar-0.2.3-metadata.whl"
    with zipfile.ZipFile(dependency, "w") as z:
        z.write(site / "xgrammar-0.2.3.dist-info" / "METADATA", "xgrammar-0.2.3.dist-info/METADATA")
    packs = {}
    for name, spec in (("new", ">=0.2.7"), ("old", ">=0.2.2")):
        project = make_project(root / name, "ffx-xg-" + name, "ffx_xg_" + name, PACK % spec, entry="vllm")
        subprocess.run([uv(), "build", "-q", "--wheel", "-o", str(root / name / "dist"), str(project)], check=True)
        (packs[name],) = (root / name / "dist").glob("*.whl")
    return release, dependency, packs


def doctor(*paths):
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}, PYTHONPATH=str(REPO))
    args = [a for p in paths for a in ("--path", str(p))]
    proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--json", "--run-packs"] + args, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)}["ffx-xg-heads"]


def test_a_declared_range_reads_as_depending_on_what_is_installed(wheels):
    release, _, packs = wheels
    row = doctor(release, packs["new"])
    assert row["verdict"] == "patch", row
    assert "depends on which xgrammar is installed" in row["reason"], row
    assert "xgrammar>=0.2.7 needed, the release allows xgrammar<1.0.0,>=0.2.1" in row["reason"], row


def test_a_dependency_wheel_beside_the_release_is_judged_as_installed(wheels):
    release, dependency, packs = wheels
    row = doctor(release, packs["new"], dependency)
    assert row["verdict"] == "known-unfixed" and "xgrammar 0.2.3 is installed" in row["reason"], row
    row = doctor(release, packs["old"], dependency)
    assert row["verdict"] == "patch" and "depends on" not in row["reason"], row


def test_a_dependency_wheel_alone_is_still_refused(wheels):
    _, dependency, _ = wheels
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--path", str(dependency)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "holds none of" in proc.stderr, proc.stderr
