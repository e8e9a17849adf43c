"""The SGLang patches (flashfix/sglang_patch.py, upstream PR #34217) against real SGLang wheels.

One process per release runs tests/sglang_real_check.py: the doctor's judgement with nothing
of the engine imported, then the real modules imported with flashfix active, SGLang's own
functions exercised (``ModelConfig`` from local config.json files, the FlashInfer autotune
decision over a table of GPUs and settings, ``FlashInferAttnBackend.forward_extend`` with
recording wrappers), then ``flashfix.revert()`` and the same exercises again, which is
SGLang as released. Engine imports take about a minute, so every assertion for one release
reads that one process's report.
"""

import functools
from pathlib import Path

import pytest

import engine_env

FP8 = "sglang-fp8-kv-scales"
AUTOTUNE = "sglang-sm120-fp8-autotune"
VISION = "sglang-vision-config"
DRAFT, MLA_DRAFT = "sglang-eagle-draft-graph-kv-indices", "sglang-eagle-mla-draft-graph-kv-indices"
HEADS = "sglang-per-layer-heads-plan"
SWA_FULL, SWA_PREFIX = "sglang-swa-full-attn-ragged-prefix", "sglang-swa-ragged-prefix-extend-slots"
SWA_PREFIX_OLD_ID = "sglang-swa-ragged-prefix-slots-0.5.10"  # sglang#26513 on 0.5.1-0.5.10 (with call_begin_forward's custom-mask parameter)
IDS = (FP8, AUTOTUNE, VISION, DRAFT, MLA_DRAFT, HEADS, SWA_FULL)

PATCH = {FP8: "patch", AUTOTUNE: "patch", VISION: "patch", DRAFT: "fixed-upstream", MLA_DRAFT: "fixed-upstream",
         HEADS: "patch", SWA_FULL: "patch"}
FIXED = dict.fromkeys(IDS, "fixed-upstream")
NO_FP8_AUTOTUNE = dict(PATCH, **{AUTOTUNE: "not-affected"})
EXPECTED = {  # release -> doctor verdict per patch (read off the wheels; see sglang_patch.py)
    "0.5.11": dict(NO_FP8_AUTOTUNE, **{DRAFT: "patch", MLA_DRAFT: "patch"}),  # SWA_FULL: after SWA_PREFIX (#26513)
    "0.5.13": NO_FP8_AUTOTUNE,
    "0.5.14": PATCH,
    "0.5.17": dict(PATCH, **{HEADS: "fixed-upstream"}),
    "0.5.18": dict(FIXED, **{SWA_FULL: "patch"}),
    "0.5.23": FIXED,
}
AUTOTUNE_SITE = {
    "0.5.11": "ModelRunner._should_run_flashinfer_autotune",
    "0.5.13": "ModelRunner._should_run_flashinfer_autotune",
    "0.5.14": "BaseRunner._should_run_flashinfer_autotune",
    "0.5.17": "should_run_flashinfer_autotune",
    "0.5.18": "should_run_flashinfer_autotune",
    "0.5.23": "should_run_flashinfer_autotune",
}
CLAMP = "sglang-trtllm-fp8-moe-swiglu-limit"  # function from 0.5.18; carried with FlashInfer 0.6.18 (0.5.19's pin)
for _release, _verdicts in EXPECTED.items():
    EXPECTED[_release] = dict(_verdicts, **{CLAMP: {"0.5.18": "known-unfixed", "0.5.23": "fixed-upstream"}.get(
        _release, "not-affected")}, **{"sglang-cross-attn-decode-plan-lens": "fixed-upstream",  # fixed in 0.5.10
                                       "sglang-sm100-cutlass-head-dims": "fixed-upstream" if _release == "0.5.23" else "patch",
                                       "sglang-mla-indptr-padded-batch": {"0.5.11": "not-affected", "0.5.13": "not-affected",
                                                                          "0.5.23": "fixed-upstream"}.get(_release, "patch")})
SOFT_CAP = "sglang-flashinfer-logit-softcap-plan"
MERGE_LIMIT, MERGE_BASE = "sglang-merge-state-launch-limit", "sglang-merge-state-fallback-lse-base"  # sglang#23993
for _release, _verdicts in EXPECTED.items():
    _verdicts[MERGE_LIMIT] = "patch" if _release == "0.5.11" else "fixed-upstream"
    _verdicts[MERGE_BASE] = "not-affected" if _release == "0.5.11" else "patch"
    _verdicts["sglang-mla-chunked-prefix-lse-base"] = "patch"  # sglang#40903: no release has the fix
    _verdicts["sglang-piecewise-graph-paged-prefill"] = "fixed-upstream"  # sglang#20061, fixed in 0.5.10
    _verdicts[SOFT_CAP] = "patch"  # sglang#33915 (flashfix's own): no release has the fix
    _verdicts[SWA_PREFIX] = "patch" if _release == "0.5.11" else "fixed-upstream"  # sglang#26513, fixed in 0.5.13
    # its 0.5.1-0.5.10 form: on 0.5.11 the fix is SWA_PREFIX's, earlier in the series
    _verdicts[SWA_PREFIX_OLD_ID] = "covered" if _release == "0.5.11" else "fixed-upstream"
    _verdicts["sglang-encoder-only-paged-causal"] = _verdicts["sglang-encoder-only-ragged-causal"] = "fixed-upstream"  # 0.5.11
    _verdicts["sglang-triton-per-layer-heads-buffers"] = (  # sglang#32625's Triton half, fixed in 0.5.17
        "patch" if _release in ("0.5.11", "0.5.13", "0.5.14") else "fixed-upstream")
    _verdicts["sglang-swa-paged-plan-window-left"] = (  # sglang#31501, fixed in 0.5.16
        "patch" if _release in ("0.5.11", "0.5.13", "0.5.14") else "fixed-upstream")
# What they change exists only where FlashInfer is available (``if is_flashinfer_available():``), which a CPU
# process is not: there the runtime reads not-affected, nothing bound to change (tests/test_merge_state_heads.py
# applies them with FlashInfer's module imported).
UNBOUND_ON_CPU = (MERGE_LIMIT, MERGE_BASE)
RELEASES = list(EXPECTED)
SCRIPT = Path(__file__).with_name("sglang_real_check.py")


@functools.lru_cache(maxsize=None)
def report(release):
    merged = {}
    for item in engine_env.run("sglang==" + release, SCRIPT.read_text(), timeout=900):
        merged.update(item)
    return merged


def applied(release):
    return [pid for pid in IDS if EXPECTED[release][pid] == "patch"]


@pytest.mark.parametrize("release", RELEASES)
def test_doctor_verdicts_without_importing_the_engine(release):
    doctor = report(release)["doctor"]
    assert doctor["heavy"] == [], "the doctor's judgement imported %s" % doctor["heavy"]
    assert {pid: verdict for pid, (verdict, _) in doctor["verdicts"].items()} == EXPECTED[release]


@pytest.mark.parametrize("release", RELEASES)
def test_runtime_state_matches_the_doctor(release):
    r = report(release)
    runtime = {pid: row["state"] for pid, row in r["status"].items()}
    doctor = {pid: verdict for pid, (verdict, _) in r["doctor"]["verdicts"].items()}
    assert runtime == {pid: ("not-affected" if pid in UNBOUND_ON_CPU else "applied") if v == "patch" else v
                       for pid, v in doctor.items()}, r["status"]
    for pid in UNBOUND_ON_CPU:
        if doctor[pid] == "patch":
            assert "not bound in this process" in r["status"][pid]["reason"] or "FlashInfer unavailable" in r[
                "status"][pid]["reason"], r["status"][pid]
    assert r["functions"]["autotune_site"][1] == AUTOTUNE_SITE[release]


@pytest.mark.parametrize("release", RELEASES)
def test_untouched_where_not_applied(release):
    r = report(release)
    for pid in IDS:
        if pid == HEADS and EXPECTED[release][SOFT_CAP] == "patch":  # the updaters' __init__ is the soft cap's function too
            assert not r["functions"]["untouched"][pid] and r["reverted"]["code_restored"][pid], r["functions"]
        elif pid not in applied(release):
            assert r["functions"]["untouched"][pid], "%s changed code it should leave alone" % pid
            assert r["after_run"]["changes"][pid] == []
            assert not r["after_run"]["ran"][pid]
    assert all(r["reverted"]["same_objects"].values())


@pytest.mark.parametrize("release", [v for v in RELEASES if applied(v)])
def test_revert_restores_the_same_functions(release):
    r = report(release)
    for pid in applied(release):
        assert not r["functions"]["untouched"][pid], "%s: applied but the code is the file's" % pid
        assert r["after_run"]["ran"][pid], "%s: the marker never reported a run" % pid
        assert r["after_run"]["markers_dropped"][pid] == [True] * (2 if pid == HEADS else 1)  # HEADS: two hunks
        assert r["reverted"]["code_restored"][pid] and r["reverted"]["code_changed_by_revert"][pid]
        assert r["reverted"]["state"][pid] == "disabled"
    assert all(r["reverted"]["same_objects"].values())
    assert not any(r["reverted"]["sm120_global_added"].values())


@pytest.mark.parametrize("release", RELEASES)
def test_vision_config_null_is_not_image_understandable(release):
    r = report(release)
    fixed_here = EXPECTED[release][VISION] in ("patch", "fixed-upstream")
    for column in ("with", "without"):
        vision = r[column]["vision"]
        assert all("error" not in row for row in vision.values()), vision
        assert vision["llama_vision_null"]["has_attr"] and not vision["llama_vision_null"]["tower"]
        assert vision["llava"] == {"image": True, "has_attr": True, "tower": True}
        assert vision["llama_plain"]["image"] is False
    assert r["with"]["vision"]["llama_vision_null"]["image"] is (not fixed_here)
    released_bug = EXPECTED[release][VISION] == "patch"
    assert r["without"]["vision"]["llama_vision_null"]["image"] is released_bug


def _calls(case):
    assert "error" not in case, case
    return {(c["wrapper"], c["method"]): c for c in case["calls"]}


@pytest.mark.parametrize("release", RELEASES)
def test_forward_extend_passes_fp8_scales_to_the_paged_lse_call(release):
    r = report(release)
    with_fix, without = r["with"]["forward_extend"], r["without"]["forward_extend"]
    paged_lse = ("paged", "forward_return_lse")
    ragged_lse = ("ragged", "forward_return_lse")
    scaled = _calls(with_fix["ragged_with_prefix"])
    assert (scaled[paged_lse]["k_scale"], scaled[paged_lse]["v_scale"]) == (0.05, 0.07)
    assert (scaled[ragged_lse]["k_scale"], scaled[ragged_lse]["v_scale"]) == ("absent", "absent")
    released = _calls(without["ragged_with_prefix"])
    if EXPECTED[release][FP8] == "patch":  # the bug as released: the cached prefix is read unscaled
        assert (released[paged_lse]["k_scale"], released[paged_lse]["v_scale"]) == ("absent", "absent")
    else:
        assert released == scaled
    if EXPECTED[release][SWA_PREFIX] == "patch":  # sglang#26513 carried: the ragged pass gets the layer's window too
        assert scaled[ragged_lse] == dict(released[ragged_lse], keywords=sorted(released[ragged_lse]["keywords"] + [
            "window_left"])), (scaled[ragged_lse], released[ragged_lse])
    else:
        assert released[ragged_lse] == scaled[ragged_lse]
    # The paged-only and the no-prefix ragged paths are the same with and without flashfix.
    for case in ("paged", "ragged_no_prefix"):
        assert _calls(with_fix[case]) == _calls(without[case])
    paged = _calls(with_fix["paged"])[("paged", "forward")]
    assert (paged["k_scale"], paged["v_scale"]) == (0.05, 0.07)
    assert _calls(with_fix["ragged_no_prefix"])[("ragged", "forward")]["k_scale"] == "absent"
    # Without FP8 scales the added keywords are None: FlashInfer's defaults, the call as before.
    unscaled = _calls(with_fix["ragged_with_prefix_no_scales"])[paged_lse]
    assert (unscaled["k_scale"], unscaled["v_scale"]) in [(None, None), ("absent", "absent")]
    for case in CASES_WITH_SHAPE:
        assert with_fix[case]["shape"] == without[case]["shape"] == [3, 16]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("pid, exercise", [(DRAFT, "draft_graph"), (MLA_DRAFT, "mla_draft_graph")])
def test_draft_graph_kv_indices_rows_hold_every_topk_branch(release, pid, exercise):
    # SGLang's own {FlashInfer,FlashInferMLA}MultiStepDraftBackend.init_cuda_graph_state: the fixed width is
    # 0.5.13's draft_kv_indices_buffer_width(max_bs, topk, max_context_len), what the draft kernel fills for a
    # full batch at the longest context (seq_lens_sum * topk + topk * max_bs * steps, seq_lens = context - steps)
    r = report(release)
    widths = {"topk4": 8 * 4 * 64, "topk1": 8 * 1 * 64}
    for case, width in widths.items():
        fixed = r["with"][exercise][case]
        assert fixed["buffer"] == [3, width], fixed
        assert fixed["rows"] == [[width]] * 2, fixed  # steps - 1 draft backends, each handed a full row
    released = r["without"][exercise]
    if EXPECTED[release][pid] == "patch":  # the bug as released: topk > 1 gets a row topk times too short
        assert released["topk4"]["buffer"] == [3, 8 * 64] and released["topk4"]["rows"] == [[8 * 64]] * 2
    else:
        assert released == r["with"][exercise]
    assert released["topk1"] == r["with"][exercise]["topk1"]  # topk 1: unchanged
    derived = r["derived"][pid]  # from 0.5.13 on: upstream's change reverted in a copy of the module
    if EXPECTED[release][pid] == "patch":
        assert derived is None
        return
    assert derived["verdict"][0] == "patch", derived["verdict"]
    assert derived["derived"]["topk4"]["buffer"] == [3, 8 * 64]  # the derived code is the bug
    assert derived["patched"] == derived["release"] == r["without"][exercise]  # patched: the release
    assert derived["undone"] == derived["derived"]


@pytest.mark.parametrize("release", RELEASES)
def test_indices_updaters_plan_for_the_widest_layer(release):
    # SGLang's own FlashInferIndicesUpdater{Decode,Prefill}.__init__, tensor-parallel size 2, a model of
    # 16 heads whose layers have 16, 24, 16: the plan must hold 24 // 2 query heads (0.5.17's count)
    r = report(release)
    fixed = {"per_layer/Decode": 12, "per_layer/Prefill": 12, "uniform/Decode": 8, "uniform/Prefill": 8}
    assert r["with"]["plan_heads"] == fixed
    if EXPECTED[release][HEADS] == "patch":  # as released: the wider layers run on a 16-head plan
        assert r["without"]["plan_heads"] == dict(fixed, **{"per_layer/Decode": 8, "per_layer/Prefill": 8})
    else:
        assert r["without"]["plan_heads"] == fixed
    derived = r["derived"][HEADS]  # from 0.5.17 on: upstream's change reverted in a copy of the module
    if EXPECTED[release][HEADS] == "patch":
        assert derived is None
        return
    assert derived["verdict"][0] == "patch", derived["verdict"]
    assert derived["derived"]["per_layer/Decode"] == derived["derived"]["per_layer/Prefill"] == 8  # the bug
    assert derived["patched"] == derived["release"] == fixed
    assert derived["undone"] == derived["derived"]


SWA_PLANS = {  # update_sliding_window, window 4, (prefix, extend) = (6, 3), (2, 5): each wrapper's plan
    "swa_prefix_only": {"lens": [4, 2], "sum": 6, "start": [2, 0], "mask": True},  # #26513 (0.5.13 on)
    "swa_whole": {"lens": [7, 7], "sum": 14, "start": [2, 0], "mask": False},
    "full_prefix_only": {"lens": [6, 2], "sum": 8, "start": None, "mask": False},  # the fix (0.5.21 on)
    "full_whole": {"lens": [9, 7], "sum": 16, "start": [0, 0], "mask": False},
}


@pytest.mark.parametrize("release", RELEASES)
def test_swa_full_attention_wrapper_reads_the_prefix_only_on_the_ragged_path(release):
    # SGLang's own FlashInferIndicesUpdaterPrefill.update_sliding_window, call_begin_forward recorded:
    # on the ragged path the full-attention wrapper must cover the cached prefix only, from slot 0
    r, plans = report(release), SWA_PLANS
    paged = [plans["swa_whole"], plans["full_whole"]]  # paged-only: whole sequences, before and after
    verdict = EXPECTED[release][SWA_FULL]
    fixed = [plans["swa_prefix_only"], plans["full_prefix_only"]]
    bug = [plans["swa_prefix_only"], plans["full_whole"]]
    if verdict == "not-affected":  # before #26513: both wrappers cover the extend slots, with or without flashfix
        fixed = bug = [plans["swa_whole"], plans["full_whole"]]
    if EXPECTED[release][SWA_PREFIX] == "patch":  # 0.5.11: #26513 carried, this fix judged on its code
        bug = [plans["swa_whole"], plans["full_whole"]]
    assert r["with"]["swa_plan"] == {"ragged": fixed, "paged": paged}
    assert r["without"]["swa_plan"] == {"ragged": bug if verdict == "patch" else fixed, "paged": paged}
    derived = r["derived"][SWA_FULL]  # from the first fixed release on: upstream's change reverted in a copy
    if verdict != "fixed-upstream":
        assert derived is None
        return
    assert derived["verdict"][0] == "patch", derived["verdict"]
    assert derived["derived"]["ragged"] == [plans["swa_prefix_only"], plans["full_whole"]]  # the bug
    assert derived["patched"] == derived["release"] == r["with"]["swa_plan"]
    assert derived["undone"] == derived["derived"]


CASES_WITH_SHAPE = ("ragged_with_prefix", "paged", "ragged_no_prefix", "ragged_with_prefix_no_scales")
MODELOPT_FP8 = ("modelopt", "modelopt_fp8", "modelopt_mixed")


def _rule(row, archs):
    """The decision for the stand-in runner (MoE and FP4/FP8 GEMM backends on auto), with the
    modelopt FP8 GEMM autotuned on the compute-capability majors ``archs``."""
    major = row["cap"][0]
    if row["disabled"] or not (row["quant"] in MODELOPT_FP8 and major in archs) or major < 9:
        return False
    return row["mode"] != "draft-asked-as-target"


@pytest.mark.parametrize("release", [v for v in RELEASES if EXPECTED[v][AUTOTUNE] == "patch"])
def test_autotune_decision_table(release):
    r = report(release)
    with_fix, without = r["with"]["autotune"], r["without"]["autotune"]
    assert with_fix and len(with_fix) == len(without)
    assert {row["mode"] for row in with_fix} >= {"none", "target", "draft-asked-as-target"}
    changed = []
    for patched, released in zip(with_fix, without):
        key = {k: patched[k] for k in ("cap", "quant", "disabled", "mode")}
        assert key == {k: released[k] for k in key}
        assert patched["decision"] is _rule(patched, (10, 12)), ("upstream rule", patched)
        assert released["decision"] is _rule(released, (10,)), ("released rule", released)
        assert not (released["decision"] and not patched["decision"]), ("a yes became no", key)
        if patched["decision"] != released["decision"]:
            changed.append(key)
    # Only SM120 with a modelopt FP8 checkpoint, autotune enabled, on the asking side, changes.
    assert changed and all(k["cap"] == [12, 0] and k["quant"] in MODELOPT_FP8 and not k["disabled"]
                           and k["mode"] != "draft-asked-as-target" for k in changed), changed


def test_autotune_fix_reaches_imported_copies():
    # 0.5.15 to 0.5.17: base_runner.py does `from ...flashinfer_autotune import
    # should_run_flashinfer_autotune`; the code swap changes that same function object.
    assert report("0.5.17")["copies"] == {"base_runner": True}


def test_autotune_helper_added_to_module_globals_when_not_imported_locally():
    # Released code imports is_sm100_supported inside the function; a variant of 0.5.17's
    # module that imports it at the top gets is_sm120_supported as a second, revertible change.
    variant = report("0.5.17")["global_variant"]
    assert variant == {"had_global": False, "changes": ["SetAttr", "SwapCode"], "released": False,
                       "added_is_utils_helper": True, "patched": True, "after_undo": False,
                       "global_removed": True}, variant


ALONE = r'''
import json, sys
from types import SimpleNamespace
import flashfix
import importlib
from flashfix import sglang_patch
site_module = sglang_patch.SM120_FP8_AUTOTUNE.targets()[0]
module = importlib.import_module(site_module)  # only the module that defines the decision
import torch
from sglang.srt.utils import common
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda device=None: (12, 0)
if not torch.version.cuda:
    torch.version.cuda = "12.9"
for name in dir(common):
    if name.startswith("is_") and hasattr(getattr(common, name), "cache_clear"):
        getattr(common, name).cache_clear()
server_args = SimpleNamespace(disable_flashinfer_autotune=False, moe_runner_backend="auto", moe_a2a_backend="none",
                              speculative_moe_runner_backend=None, speculative_moe_a2a_backend=None,
                              flashinfer_autotune_skip_ops=None)
runner = SimpleNamespace(device="cuda", server_args=server_args, model_config=SimpleNamespace(quantization="modelopt_fp8"),
                         spec_algorithm=SimpleNamespace(is_speculative=lambda: False), is_draft_worker=False)
qualname = dict(sglang_patch.AUTOTUNE_SITES)[site_module]
if "." in qualname:
    cls, name = qualname.split(".")
    decision = getattr(module, cls).__dict__[name](SimpleNamespace(model_runner=runner))
else:
    decision = getattr(module, qualname)(runner)
row = next(r for r in flashfix.status() if r["id"] == sglang_patch.AUTOTUNE_ID)
print("FLASHFIX_RESULT=" + json.dumps({"site": site_module, "decision": bool(decision), "state": row["state"],
      "model_runner_loaded": "sglang.srt.model_executor.model_runner" in sys.modules}))
'''


@pytest.mark.parametrize("release", [v for v in RELEASES if EXPECTED[v][AUTOTUNE] == "patch"])
def test_autotune_fixed_when_only_its_own_module_is_imported(release):
    # SGLang's own autotune tests import the defining module alone: the patch must not wait
    # for model_runner. SM120 with a modelopt FP8 checkpoint: autotune, as upstream decides.
    (r,) = engine_env.run("sglang==" + release, ALONE)
    assert r["model_runner_loaded"] is False
    assert r["site"] == {"0.5.14": "sglang.srt.model_executor.runner.base_runner"}.get(
        release, "sglang.srt.model_executor.runner.flashinfer_autotune")
    assert r["state"] == "applied" and r["decision"] is True


@pytest.mark.parametrize("release", ["0.5.18", "0.5.23"])
def test_trtllm_fp8_clamp_falls_back_to_swiglu_limit(release):
    """The release's own function builds the per-expert clamp; 0.5.18 drops swiglu_limit, 0.5.23 (fixed)
    uses it, and 0.5.18 with the declaration's edit builds exactly what 0.5.23 builds."""
    r = report(release)["clamp"]
    fixed = {"limit_only": [10.0] * 4, "both": [3.0] * 4, "none": None}
    if release == "0.5.23":
        assert r["probe"] == "fixed" and r["released"] == fixed, r
        return
    assert r["probe"] == "buggy", r
    assert r["released"] == dict(fixed, limit_only=None), r  # the bug as released: no clamp
    assert r["patched"] == fixed, r
    assert r["undone"] == r["released"], r
