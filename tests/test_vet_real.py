"""``flashfix doctor --path/--python`` and ``flashfix diff`` on real engine releases.

Every outside view of an environment must say what ``flashfix doctor`` says when run inside
it (``python -m flashfix doctor --json`` in that environment, flashfix from this checkout):

* ``--path`` on the released wheels (SGLang 0.5.11 to 0.5.23, each with the FlashInfer release
  its environment resolved to; FlashInfer 0.6.17 and 0.7.4 alone), read from the zip; the
  files each verdict was read from have the same sha256 as the installed files;
* ``--path`` on site-packages folders (the vLLM releases), on an unpacked wheel, and on a
  folder that ``pip install --target`` filled;
* ``--python`` on the interpreter of every engine environment: the same rows, provenance
  included.

``flashfix diff`` on each patch on a real affected release, in one engine process per
environment (tests/vet_diff_check.py): SGLang 0.5.17 (the three SGLang patches and FlashInfer
0.6.15.post1's flashinfer-sink-jit-name) and the vLLM pre-fix shape derived from 0.28.0 (with
FlashInfer 0.6.16.post3): compiling the diff's "after" side gives the very code the runtime
swaps in.

Wheels are downloaded once into ~/.cache/flashfix-wheels (tests/vet_helpers.py).
"""

import ast
import functools
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_env  # noqa: E402
import vet_helpers as v  # noqa: E402

SGLANG = ["0.5.11", "0.5.13", "0.5.14", "0.5.17", "0.5.18", "0.5.23"]
VLLM = ["0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.33.0"]
ENGINE_ENVS = ["sglang==" + r for r in SGLANG] + ["vllm==" + r for r in VLLM]


@functools.lru_cache(maxsize=None)
def inside(requirement):
    return v.doctor_inside(engine_env.env_python(requirement))


@functools.lru_cache(maxsize=None)
def flashinfer_of(requirement):
    """The FlashInfer release installed in an engine environment."""
    (row,) = [r for r in inside(requirement) if r["engine"] == "flashinfer-python"]
    return row["engine_version"]


def module_digests(rows):
    return {key: sha for key, sha in v.digests(rows).items()}


def test_every_engine_environment_is_checked():
    assert sorted(ENGINE_ENVS) == sorted(engine_env.RELEASES)


@pytest.mark.parametrize("requirement", ENGINE_ENVS)
def test_python_view_equals_the_doctor_inside(requirement):
    python = engine_env.env_python(requirement)
    outside = v.doctor_json("--python", python)
    assert outside == inside(requirement)  # verdicts, reasons, versions and every file read with its sha256
    engine = requirement.split("==")[0]
    assert any(r["engine"] == engine and r["verdict"] != "not-installed" for r in outside)
    assert all(r["sources"] for r in outside if r["verdict"] != "not-installed")


@pytest.mark.parametrize("release", SGLANG)
def test_wheels_read_from_the_zip_equal_the_doctor_inside(release):
    requirement = "sglang==" + release
    sglang_wheel = v.wheel(requirement)
    flashinfer_wheel = v.wheel("flashinfer-python==" + flashinfer_of(requirement))
    rows = v.doctor_json("--path", sglang_wheel, "--path", flashinfer_wheel)
    assert v.verdicts(rows) == v.verdicts(inside(requirement))
    # the same bytes were read: each wheel member has the sha256 of the file installed from it
    assert v.digests(rows) == v.digests(inside(requirement))
    for row in rows:
        for source in row["sources"]:
            assert source["file"].startswith(source["archive"] + "!/")
            of_flashinfer = (source.get("module") or "").split(".")[0] == "flashinfer" or \
                source.get("distribution") == "flashinfer-python"  # an sglang row's `requires` reads it too
            wheel_path = flashinfer_wheel if of_flashinfer else sglang_wheel
            assert source["archive"] == str(wheel_path)
            assert len(source["archive_sha256"]) == 64


@pytest.mark.parametrize("release", VLLM)
def test_site_packages_folder_equals_the_doctor_inside(release):
    requirement = "vllm==" + release
    rows = v.doctor_json("--path", v.site_packages(engine_env.env_python(requirement)))
    assert rows == inside(requirement)


def test_unpacked_wheel_tree_with_a_flashinfer_wheel(tmp_path):
    requirement = "sglang==0.5.17"
    with zipfile.ZipFile(v.wheel(requirement)) as archive:
        archive.extractall(tmp_path / "tree")
    rows = v.doctor_json("--path", tmp_path / "tree", "--path", v.wheel("flashinfer-python==" + flashinfer_of(requirement)))
    assert v.verdicts(rows) == v.verdicts(inside(requirement))
    assert v.digests(rows) == v.digests(inside(requirement))
    assert [r["verdict"] for r in rows if r["engine"] == "sglang"] == v.release_verdicts("sglang", "0.5.17")
    assert [r["verdict"] for r in rows if r["engine"] == "flashinfer-python"] == ["patch"]  # its JIT-name fix, read in the wheel
    assert {r["verdict"] for r in rows if r["engine"] == "vllm"} == {"not-installed"}


@pytest.mark.parametrize("release, verdict", [("0.6.17", "patch"), ("0.7.4", "fixed-upstream")])
def test_flashinfer_wheel_alone(tmp_path, release, verdict):
    wheel = v.wheel("flashinfer-python==" + release)
    target = tmp_path / "target"
    subprocess.run(["uv", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True)
    here = v.doctor_inside(sys.executable, [target])  # an interpreter with that FlashInfer installed (on its path)
    from_zip = v.doctor_json("--path", wheel)
    from_folder = v.doctor_json("--path", target)
    assert v.verdicts(from_zip) == v.verdicts(from_folder) == v.verdicts(here)
    assert from_folder == here
    assert v.digests(from_zip) == v.digests(here)
    (row,) = [r for r in from_zip if r["engine"] == "flashinfer-python"]
    assert (row["engine_version"], row["verdict"]) == (release, verdict)


def test_strict_fails_a_candidate_with_an_unknown_shape(tmp_path):
    """The CI recipe: an affected release whose code flashfix does not recognise fails the
    pipeline under --strict (exit 1); without --strict it is reported and the exit is 0."""
    with zipfile.ZipFile(v.wheel("sglang==0.5.17")) as archive:
        archive.extractall(tmp_path / "tree")
    backend = tmp_path / "tree" / "sglang" / "srt" / "layers" / "attention" / "flashinfer_backend.py"
    text = backend.read_text()
    old = "o2, s2 = prefill_wrapper_paged.forward_return_lse(\n"
    assert text.count(old) == 1
    backend.write_text(text.replace(old, old + "                    *extra_args,\n"))
    proc = v.cli("doctor", "--strict", "--path", tmp_path / "tree")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "sglang-fp8-kv-scales: sglang 0.5.17 is affected but its code has an unknown shape" in proc.stderr
    assert "Traceback" not in proc.stderr
    loose = v.cli("doctor", "--path", tmp_path / "tree")
    assert loose.returncode == 0 and "unknown-shape" in loose.stdout
    diff = v.cli("diff", "sglang-fp8-kv-scales", "--path", tmp_path / "tree")
    assert diff.returncode == 0
    assert diff.stdout.splitlines()[1].startswith(  # the declaration's nearest candidate, and how it differs
        "sglang-fp8-kv-scales (sglang 0.5.17): not applied: unknown-shape: the call "
        "prefill_wrapper_paged.forward_return_lse at line 1375 passes *args/**kwargs"), diff.stdout


# --- flashfix diff -------------------------------------------------------------------------------


@pytest.mark.parametrize("release", SGLANG)
def test_diff_of_a_wheel_names_the_wheel_and_applies_to_its_members(release):
    wheel = v.wheel("sglang==" + release)
    ids = ["sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune", "sglang-vision-config"]
    proc = v.cli("diff", "--path", wheel, *ids)
    assert proc.returncode == 0, proc.stderr
    verdicts = {r["id"]: r for r in inside("sglang==" + release)}
    applies = [pid for pid in ids if verdicts[pid]["verdict"] == "patch"]
    for pid in ids:
        row = verdicts[pid]
        if pid in applies:
            assert "%s (sglang %s): applies (%s)" % (pid, release, row["reason"]) in proc.stdout
        else:
            assert "%s (sglang %s): not applied: %s: %s\n" % (pid, release, row["verdict"], row["reason"]) in proc.stdout
    rewrites = [(old, hunks) for old, new, hunks in v.file_diffs(proc.stdout) if new.endswith("(as flashfix runs it)")]
    assert len(rewrites) == len(applies)
    assert proc.stdout.count("until its first run it also runs one marker line") == len(applies)
    assert "written whole" not in proc.stdout  # every edit is a splice of the installed lines
    with zipfile.ZipFile(wheel) as archive:
        for old, hunks in rewrites:
            assert old.split("!/")[0] == str(wheel)
            installed = archive.read(old.split("!/")[1]).decode()
            after = v.apply_unified_diff(installed, hunks)  # every context line matches the wheel's file
            ast.parse(after)
            removed = sum(1 for line in hunks if line.startswith("-"))
            added = sum(1 for line in hunks if line.startswith("+"))
            assert removed <= 3 and 0 < added <= 4, hunks  # only the changed statements' lines


@functools.lru_cache(maxsize=None)
def diff_check(requirement, mode):
    script = (Path(__file__).with_name("vet_diff_check.py")).read_text()
    merged = {}
    for item in engine_env.run(requirement, script, env={"VET_TESTS": str(Path(__file__).resolve().parent),
                                                         "VET_MODE": mode}, timeout=900):
        merged.update(item)
    return merged


def assert_diff_is_what_runs(result, patch_id, kinds):
    assert result["diff"]["heavy"] == [], "computing the diff imported %s" % result["diff"]["heavy"]
    assert result["states"][patch_id] == "applied"
    check = result["checks"][patch_id]
    assert [row["kind"] for row in check["rows"]] == kinds
    assert check["planned"] == check["runtime"] == len(kinds)
    expected_runtime = {"rewrite": "SwapCode", "replace": "SetAttr", "add-name": "SetAttr", "series": "SwapCode"}
    for row in check["rows"]:
        assert row["runtime"] == expected_runtime[row["kind"]], row
        if row["kind"] == "rewrite":
            assert row["qualname"][0] == row["qualname"][1] and row["site"][0] == row["site"][1]
            assert row["same_file_text"]
            assert row["read_ahead"] and row["ahead_equals_after"] == [True, True], row
            # compiled from the printed diff's "after" side: the code swapped in, whole code tree
            assert row["diff_equals_plain"] is None, row
            assert row["diff_equals_marked"] is None, row
            assert not row["marker_in_plain"] and row["marker_in_marked"]
            # and the runtime compiled the very text: positions (lines and columns) are the text's
            assert row["positions_equal_plain"] and row["positions_equal_marked"], row
            assert row["ast_positions_differ"], "the positions check could not tell"
        elif row["kind"] == "series":  # planned on the code the earlier members leave: that text, compiled, is the series'
            assert row["qualname"][0] == row["qualname"][1] and row["sections"] >= 1, row
            assert row["diff_equals_series"] is None and row["earlier_in_runtime"], row
        elif row["kind"] == "replace":
            assert row["owner"][0] == row["owner"][1] and row["name"][0] == row["name"][1]
            assert row["value_is_replacement"]
            origin, first, last, filename, firstline = row["delegate"]
            assert origin == filename and first <= firstline <= last
        else:
            assert row["module"][0] == row["module"][1] and row["name"][0] == row["name"][1]
            assert row["value_named"], row  # the global set is the very object the diff names
            if row["defined"] is not None:  # None: not a def the source shows (e.g. an lru_cache(...) assignment)
                origin, first, filename, firstline = row["defined"]
                assert (origin, first) == (filename, firstline)


@pytest.mark.parametrize("patch_id, kinds", [
    ("sglang-fp8-kv-scales", ["rewrite"]),
    ("sglang-sm120-fp8-autotune", ["add-name", "rewrite"]),
    ("sglang-vision-config", ["rewrite"]),
    ("flashinfer-sink-jit-name", ["replace"]),
])
def test_diff_is_what_runs_sglang_0_5_17(patch_id, kinds):
    assert_diff_is_what_runs(diff_check("sglang==0.5.17", "installed"), patch_id, kinds)


def test_diff_of_a_patch_judged_on_an_earlier_ones_code_sglang_0_5_11():
    """sglang-swa-full-attn-ragged-prefix completes #26513 (sglang-swa-ragged-prefix-extend-slots, before it in
    update_sliding_window's series): its diff is its own hunk on the code that one leaves, and that text compiles
    to the code the registry composes for the two."""
    assert_diff_is_what_runs(diff_check("sglang==0.5.11", "installed"), "sglang-swa-full-attn-ragged-prefix", ["series"])


@pytest.mark.parametrize("patch_id, kinds", [
    ("vllm-sink-prefill", ["add-name", "rewrite", "rewrite"]),
    ("flashinfer-sink-jit-name", ["replace"]),
])
def test_diff_is_what_runs_vllm_prefix_shape(patch_id, kinds):
    result = diff_check("vllm==0.28.0", "vllm-prefix")
    assert_diff_is_what_runs(result, patch_id, kinds)
    if patch_id == "vllm-sink-prefill":
        text = result["diff"]["text"]
        assert "--- %s\n" % result["prefix_path"] in text  # the derived file, as the import system finds it
        assert "+                    if isinstance(prefill_wrapper, BatchAttentionWithAttentionSinkWrapper):" in text


def test_diff_of_the_vllm_prefix_tree_from_outside(tmp_path):
    """docs/diff.md's vLLM example: the derived pre-fix tree read with --path, next to the
    FlashInfer of the vLLM 0.28.0 environment."""
    site = v.site_packages(engine_env.env_python("vllm==0.28.0"))
    tree = v.write_prefix_tree(tmp_path / "tree", site / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py")
    rows = v.doctor_json("--path", tree, "--path", site)
    assert {r["id"]: r["verdict"] for r in rows}["vllm-sink-prefill"] == "patch"
    proc = v.cli("diff", "vllm-sink-prefill", "--path", tree, "--path", site)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "vllm-sink-prefill (vllm 0.27.2.dev41+g0123abc): applies" in out
    assert "BatchAttentionWithAttentionSinkWrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper" in out
    assert "%s line " % (site / "flashinfer" / "attention" / "_core.py") in out
    rewrites = [h for old, new, h in v.file_diffs(out) if new.endswith("(as flashfix runs it)")]
    assert len(rewrites) == 2  # the factory and forward, each rewritten from the installed file
    installed = (tree / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py").read_text()
    fixed = (site / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py").read_text()
    from flashfix.core import source as _source

    afters = [ast.parse(v.apply_unified_diff(installed, hunk)) for hunk in rewrites]
    # the forward that runs is, statement for statement, 0.28.0's (the marker-free side) ...
    theirs = _source.find_def(ast.parse(fixed), "FlashInferImpl.forward")
    assert [ast.dump(_source.find_def(a, "FlashInferImpl.forward")) == ast.dump(theirs) for a in afters].count(True) == 1
    # ... and the factory that runs builds the sink wrapper, as 0.28.0's does
    factories = [ast.unparse(_source.find_def(a, "FlashInferMetadataBuilder._get_prefill_wrapper")) for a in afters]
    assert ["BatchAttentionWithAttentionSinkWrapper(" in f for f in factories].count(True) == 1
    # without a FlashInfer next to it, the doctor refuses as prepare() would (it takes the sink wrapper from
    # there), with the runtime's reason, and diff shows the patch not applied
    reason = ("the new code reads BatchAttentionWithAttentionSinkWrapper, which vllm.v1.attention.backends.flashinfer "
              "lacks, and the installed flashinfer has no BatchAttentionWithAttentionSinkWrapper")
    rows = {r["id"]: (r["verdict"], r["reason"]) for r in v.doctor_json("--path", tree)}
    assert rows["vllm-sink-prefill"] == ("unknown-shape", reason), rows
    alone = v.cli("diff", "vllm-sink-prefill", "--path", tree)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.splitlines()[1] == (
        "vllm-sink-prefill (vllm 0.27.2.dev41+g0123abc): not applied: unknown-shape: " + reason)
