"""The catalogue's vLLM fixes against real vLLM releases from PyPI (CPU, nothing skipped).

vLLM #52796 (FlashInfer's base-2 LSE merged as natural log: ``vllm-mla-flashinfer-lse``,
``vllm-mla-trtllm-ragged-lse``, ``vllm-dcp-prefill-lse``), #48003 (DCP page counts and the shared
``seq_lens_cpu``: ``vllm-dcp-page-counts``), the FP8 KV-sharing view (``vllm-fp8-kv-sharing-view``),
the sinks refreshed on a weight reload (``vllm-sinks-weight-reload``) and DCP's ragged wrapper layout
(#38895, ``vllm-dcp-ragged-layout``, checked without an engine process only: its edit gives back the
release's own ``__init__``).

One process per release runs tests/vllm_catalogue_check.py (vLLM's own functions on CPU, FlashInfer
replaced by a CPU stand-in that returns a base-2 LSE as FlashInfer does; see that file):

* 0.28.0 (affected by all but the FP8 fix): patched, the merged prefill over a cached context
  matches attention over the whole sequence and the LSEs are 0.29.0's; reverted, it is 10 % off.
  The DCP page counts are 0.30.0's patched, the global ones reverted.
* 0.29.0 (first with #52796, still without #48003): the LSE reference; page counts as for 0.28.0.
* 0.30.0 (first with #48003): the page-count reference, and the pre-fix shape derived from it
  (#48003 reverted) patched back to the same result.
* 0.28.0 also runs the FP8 view statement of a KV-sharing layer (its own, 0.22.0's form; the pre-0.22
  one; that one as the declaration edits it) and, the same way, ``process_weights_after_loading``
  around a second weight load (0.26.0's refresh taken out, then edited back).
* Without an engine process: the pre-fix shapes derived from the first fixed releases' installed
  files (``semantic.derive_prefix``) are judged ``patch``, and the declaration's edit gives back
  the fixed release's functions, statement for statement.
"""

import ast
import copy
import functools
import json
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402

this_checkout.flashfix()
from flashfix import semantic, vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

SCRIPT = TESTS / "vllm_catalogue_check.py"
LSE_IDS = ("vllm-mla-flashinfer-lse", "vllm-mla-trtllm-ragged-lse", "vllm-dcp-prefill-lse")
PAGES, FP8, RELOAD = "vllm-dcp-page-counts", "vllm-fp8-kv-sharing-view", "vllm-sinks-weight-reload"
PATCHES = {p.id: p for p in vllm_patch.PATCHES}


def installed(requirement, module):
    return engine_env.installed_path(requirement, module.replace(".", "/") + ".py")


@functools.lru_cache(maxsize=None)
def release_run(requirement, *argv):
    results = engine_env.run(requirement, SCRIPT.read_text().replace("__file__", repr(str(SCRIPT))), timeout=900,
                             env={"CATALOGUE_ARGV": json.dumps(argv)} if argv else None)
    merged = {}
    for result in results:
        merged.update(result)
    return merged


def test_0_28_0_patched_matches_the_fixed_releases_and_reverted_is_wrong():
    old, lse_fixed, pages_fixed = release_run("vllm==0.28.0"), release_run("vllm==0.29.0"), release_run("vllm==0.30.0")
    assert old["doctor"] == {"verdicts": dict({i: "patch" for i in LSE_IDS + (PAGES,)}, **{
        FP8: "fixed-upstream", RELOAD: "fixed-upstream"}), "heavy": []}
    assert old["state"] == dict({i: "applied" for i in LSE_IDS + (PAGES,)}, **{FP8: "fixed-upstream",
                                                                             RELOAD: "fixed-upstream"})
    assert all(old["with"]["ran"][i] for i in LSE_IDS + (PAGES,)), old["with"]["ran"]
    for case in ("fi", "trtllm", "dcp"):
        with_fix, without, fixed = (r["lse"][case] for r in (old["with"], old["without"], lse_fixed["with"]))
        assert with_fix["error"] < 1e-12 and fixed["error"] < 1e-12, (case, with_fix, fixed)
        assert with_fix["lse"] == pytest.approx(fixed["lse"], abs=1e-8), case  # 0.29.0's natural-log LSE
        assert without["error"] > 0.05, (case, without)  # the bug: parts weighted by a base-2 LSE
        assert without["lse"] == pytest.approx([x / 0.6931471805599453 for x in fixed["lse"]], abs=1e-7)
    assert old["with"]["pages"] == pages_fixed["with"]["pages"] == {
        "pages": [3, 2], "lengths": [35, 25], "seq_lens_after": [100, 70],  # rank-local, shared lengths untouched
        "plan": {"qo_indptr_cpu": [0, 30, 50], "paged_kv_indptr_cpu": [0, 3, 5], "paged_kv_indices": [0, 1, 2, 8, 9],
                 "paged_kv_last_page_len_cpu": [3, 9]}}
    assert old["without"]["pages"]["pages"] == [7, 5] and old["without"]["pages"]["seq_lens_after"] == [70, 50]


def test_fp8_view_on_kv_sharing_layers_pre_0_22_shape_edited_to_the_release_view():
    # 0.28.0's own view statement (0.22.0's form), the pre-0.22 statement and that statement as the
    # declaration edits it, each run in the release's module namespace on a uint8-stored cache of a
    # KV-sharing layer: the pre-fix one hands FlashInfer uint8 (read as NVFP4), the edited one FP8
    sharing = release_run("vllm==0.28.0")["sharing"]
    assert sharing.pop("shape") == "buggy"
    for dtype, fp8 in (("fp8", "torch.float8_e4m3fn"), ("fp8_e5m2", "torch.float8_e5m2"), ("auto", "torch.bfloat16")):
        assert sharing["release/" + dtype] == sharing["edited/" + dtype] == fp8, sharing
    assert sharing["pre/fp8"] == sharing["pre/fp8_e5m2"] == "torch.uint8"


def test_sinks_refreshed_on_a_second_weight_load_pre_0_26_shape_edited_to_the_release():
    # 0.28.0's FlashInferImpl with the 0.26.0 refresh taken out: patch; edited, __init__ is the
    # release's and process_weights_after_loading, run twice around a new checkpoint loaded into the
    # bf16 sinks parameter, leaves the release's float32 sinks (same tensor); the pre-fix one is stale
    reload = release_run("vllm==0.28.0")["reload"]
    assert reload["verdict"] == "patch" and reload["init_as_release"], reload
    assert reload["release"] == reload["edited"] == {"dtype": "torch.float32", "values": [2.0] * 4, "same_tensor": True}
    assert reload["pre"]["values"] == [0.5] * 4  # the first checkpoint's sinks


def test_0_29_0_fixed_lse_and_patched_page_counts():
    run = release_run("vllm==0.29.0")
    assert run["doctor"]["verdicts"] == dict({i: "fixed-upstream" for i in LSE_IDS + (FP8, RELOAD)}, **{PAGES: "patch"})
    assert run["state"][PAGES] == "applied" and run["with"]["ran"][PAGES]
    assert run["with"]["lse"] == run["without"]["lse"]  # fixed upstream: nothing of flashfix in these
    assert run["with"]["pages"] == release_run("vllm==0.30.0")["with"]["pages"]
    assert run["without"]["pages"]["lengths"] == [70, 50]


def revert_48003(source):
    """0.30.0's flashinfer.py with #48003 taken out: no clone before the in-place DCP subtraction,
    and the page counts computed before the DCP-local conversion (as 0.29.0 does)."""
    tree = ast.parse(source)
    build = _source.find_def(tree, vllm_patch.BUILDER + ".build")
    clone = semantic.find(semantic.pattern("$S = $S.clone()"), [build])
    assert len(clone) == 1
    for block in (n.body for n in ast.walk(build) if hasattr(n, "body") and isinstance(n.body, list)):
        if clone[0][0] in block:
            block.remove(clone[0][0])
    body = build.body
    (counts,) = [s for s in body if isinstance(s, ast.If) and ast.unparse(s.test) == "seq_lens_cpu is not None"
                 and "num_blocks_np" in ast.unparse(s)]
    (dcp,) = [s for s in body if isinstance(s, ast.If) and ast.unparse(s.test) == "self.use_dcp"
              and "get_dcp_local_seq_lens" in ast.unparse(s)]
    body.remove(counts)
    body.insert(body.index(dcp), counts)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def test_derived_pre_48003_shape_is_restored_to_0_30_0(tmp_path):
    release = installed("vllm==0.30.0", vllm_patch.TARGET)
    derived = tmp_path / "flashinfer_prefix.py"
    derived.write_text(revert_48003(release.read_text()))
    assert _registry.judge(PATCHES[PAGES], {vllm_patch.TARGET: ast.parse(derived.read_text())}, "0.30.0")[0] == "patch"
    run = release_run("vllm==0.30.0", str(derived), str(release))
    assert run["state"][PAGES] == "applied"
    assert run["with"]["pages"] == run["release"]["pages"]  # patched: the release's own result
    assert run["without"]["pages"]["pages"] == [7, 5]  # the derived shape has the bug back
    fixed = release_run("vllm==0.30.0")
    assert fixed["doctor"]["verdicts"] == {i: "fixed-upstream" for i in LSE_IDS + (PAGES, FP8, RELOAD)}
    assert fixed["with"] == dict(fixed["without"], ran={i: False for i in LSE_IDS + (PAGES, FP8, RELOAD)})


@pytest.mark.parametrize("patch_id, module, release", [
    ("vllm-mla-flashinfer-lse", "vllm.v1.attention.backends.mla.prefill.flashinfer", "0.29.0"),
    ("vllm-mla-trtllm-ragged-lse", "vllm.v1.attention.backends.mla.prefill.trtllm_ragged", "0.29.0"),
    ("vllm-dcp-prefill-lse", vllm_patch.TARGET, "0.29.0"),
    ("vllm-dcp-ragged-layout", vllm_patch.TARGET, "0.28.0"),  # fixed in 0.22.0, the same form as 0.28.0's
])
def test_derived_pre_fix_shapes_are_edited_back_to_the_release(patch_id, module, release):
    # upstream's change turned back in the release's own file (semantic.derive_prefix): a pre-fix
    # shape the doctor patches, whose functions the declaration edits back into the release's
    patch = PATCHES[patch_id]
    fixed_text = installed("vllm==" + release, module).read_text()
    derived = semantic.derive_prefix(patch, fixed_text)
    fixed, prefix = ast.parse(fixed_text), ast.parse(derived)
    assert _registry.judge(patch, {module: fixed}, release)[0] == "fixed-upstream"
    assert _registry.judge(patch, {module: prefix}, release)[0] == "patch"
    shape, located, given = patch.rule.shape(lambda m: prefix)
    for rule, _, qualname, _ in located:
        edited = _source.find_def(prefix, qualname)
        assert ast.dump(edited) != ast.dump(_source.find_def(fixed, qualname))
        mark = ast.Expr(ast.Constant("mark"))
        rule.edit(edited, mark, given=given)
        for node in ast.walk(edited):  # the one-time marker goes before the edited statement, at any depth
            if isinstance(getattr(node, "body", None), list) and mark in node.body:
                node.body.remove(mark)
        assert ast.dump(edited) == ast.dump(_source.find_def(fixed, qualname)), qualname
