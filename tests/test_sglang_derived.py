"""The SGLang patches on pre-fix shapes derived from releases that carry PR #34217 (0.5.18, 0.5.23).

No SGLang release after 0.5.17 lacks #34217, but a fork or backport branch of a later release
can. For each release, tests/sglang_prefix_shape.py reverts #34217's FP8-scale and vision
changes in the installed files at test time, each derived from its flashfix declaration (the
backport applied after -> before, ``flashfix.semantic.derive_prefix``; written to temporary files); one process
of that release's environment then serves the derived files under the real module names and runs
tests/sglang_real_check.py, the same exercises as for the released versions: SGLang's own
``forward_extend`` with recording wrappers, ``ModelConfig`` from local config.json files, with
flashfix applied and after ``flashfix.revert()``. The patched derived code must behave exactly as
the release does (its report from tests/test_sglang_real.py), the reverted one shows the bug.

The version gate: ``sglang_patch`` declares ``versions=">=0.5.1"``, open above, so a build that
says 0.5.18 or later is patched where its code is the pre-fix shape (it was ``<0.5.18``, which
refused these shapes). The derived process would widen a range that leaves the release out; the
test asserts that nothing needed widening. #34217's autotune change is not derived (see sglang_prefix_shape.py).
"""

import ast
import functools
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import sglang_prefix_shape as derive  # noqa: E402
import test_sglang_real as released  # noqa: E402  (the releases' own reports, one process each)
import this_checkout  # noqa: E402

this_checkout.flashfix()
from flashfix.core import source as _source  # noqa: E402

FP8, AUTOTUNE, VISION = released.FP8, released.AUTOTUNE, released.VISION
DERIVED = (FP8, VISION)
ENCODER = ("sglang-encoder-only-paged-causal", "sglang-encoder-only-ragged-causal")  # fixed in 0.5.11
LATER = (released.DRAFT, released.MLA_DRAFT, released.HEADS)  # fixed before 0.5.18: fixed-upstream here (their derived shapes: test_sglang_real)
SWA_FULL = released.SWA_FULL  # fixed in 0.5.21: patch on 0.5.18, fixed-upstream on 0.5.23
CLAMP = "sglang-trtllm-fp8-moe-swiglu-limit"  # fixed in 0.5.20; 0.5.18 pins a FlashInfer without the clamp
XATTN = "sglang-cross-attn-decode-plan-lens"  # fixed in 0.5.10
PCG = "sglang-piecewise-graph-paged-prefill"  # sglang#20061, fixed in 0.5.10
WINDOW = "sglang-swa-paged-plan-window-left"  # sglang#31501, fixed in 0.5.16
TRITON_HEADS = "sglang-triton-per-layer-heads-buffers"  # sglang#32625, fixed in 0.5.17
CUTLASS_DIMS = "sglang-sm100-cutlass-head-dims"  # fixed in 0.5.21: a pre-fix shape on 0.5.18
MLA_PADDED = "sglang-mla-indptr-padded-batch"  # fixed in 0.5.20: 0.5.18's own (not derived) MLA module has the bug
MLA_LSE = "sglang-mla-chunked-prefix-lse-base"  # sglang#40903: no release has the fix
SOFT_CAP = "sglang-flashinfer-logit-softcap-plan"  # sglang#33915: no release has the fix
MERGE_LIMIT, MERGE_BASE = released.MERGE_LIMIT, released.MERGE_BASE  # sglang#23993 in both; its fallback unfixed
RELEASES = ("0.5.18", "0.5.23")
WIDENED = ">=0.5.11"  # the oldest SGLang release the tests cover, no upper bound
STANDARD_CONFIG_SHOWS_VISION_BUG = {"0.5.18": True, "0.5.23": False}

PREAMBLE = r"""
import dataclasses, json, sys, tempfile
from importlib.metadata import version as _version
sys.path.insert(0, %r)
import sglang_prefix_shape as _derive
import flashfix
from flashfix import sglang_patch as _sp
from flashfix.core import registry as _reg
from flashfix.core import source as _src

def _report(key, value):
    print("FLASHFIX_RESULT=" + json.dumps({key: value}, default=str), flush=True)

_installed = {name: _src.module_file(name) for name in _derive.DERIVE}
_paths = _derive.write_derived(tempfile.mkdtemp(prefix="ffx-derived-"), _installed)
_trees = {name: _src.parse_file(path) for name, path in _paths.items()}
_version_now = _version("sglang")

def _targets(patch):
    return {t: _trees[t] if t in _trees else _src.module_ast(t) for t in _reg.targets_of(patch)}

_shipped = list(_sp.PATCHES)
_widened = [p if _reg.in_range(p, _version_now) else dataclasses.replace(p, versions=%r) for p in _shipped]
_report("derived_doctor", {
    "version": _version_now,
    "flashfix": flashfix.__file__,
    "probe": {p.id: [p.probe(_targets(p)).kind, p.probe(_targets(p)).reason] for p in _shipped},
    "shipped": {p.id: list(_reg.judge(p, _targets(p), _version_now)) + [p.versions] for p in _shipped},
    "widened": {p.id: list(_reg.judge(p, _targets(p), _version_now)) + [p.versions] for p in _widened},
    "heavy": sorted(m for m in ("sglang", "torch", "flashinfer", "transformers") if m in sys.modules),
})
_sp.PATCHES = tuple(_widened)  # registered by the check below (its _registry.load_all())
_derive.install(_paths)
import importlib as _il
_report("derived_loaded", {name: _il.import_module(name).__file__ == path for name, path in _paths.items()})

# More ModelConfig cases, exercised around the check's flashfix.revert(): patched, reverted, and with
# the release's own ModelConfig.__init__ compiled into the same function (``_registry.rewrite`` with
# the body taken from the installed release file). From 0.5.23 the flag also needs is_multimodal,
# which a text-only llama config has only under the transformers backend: that case shows the bug.
import copy as _copy, os as _os
_VISION_NULL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "vision_config": None}
_extra_dirs = {}
for _name, _content in {"vision_null": _VISION_NULL,
                        "plain": {k: v for k, v in _VISION_NULL.items() if k != "vision_config"}}.items():
    _extra_dirs[_name] = tempfile.mkdtemp(prefix="ffx-extra-")
    with open(_os.path.join(_extra_dirs[_name], "config.json"), "w") as _handle:
        json.dump(_content, _handle)

def _vision_extra():
    from sglang.srt.configs.model_config import ModelConfig
    out = {}
    for name, path in _extra_dirs.items():
        for impl in ("auto", "transformers"):
            try:
                config = ModelConfig(path, model_impl=impl)
                out[name + "/" + impl] = {
                    "image": bool(config.is_image_understandable_model),
                    "multimodal": bool(getattr(config, "is_multimodal", False)),
                    "has_attr": hasattr(config.hf_config, "vision_config"),
                    "tower": getattr(config.hf_config, "vision_config", None) is not None}
            except Exception as exc:
                out[name + "/" + impl] = {"error": repr(exc)[:400]}
    return out

def _release_init_swap():
    from sglang.srt.configs import model_config
    func = model_config.ModelConfig.__dict__["__init__"]
    release = _src.find_def(_src.parse_file(_installed[_derive.MODEL_CONFIG]), "ModelConfig.__init__")
    def edit(def_node, mark):
        def_node.body = _copy.deepcopy(release.body)
    return _reg.rewrite(func, edit, "test-release-code")

_revert = flashfix.revert
def _revert_around_extra(*ids):
    extra = {"with": _vision_extra()}
    result = _revert(*ids)
    extra["without"] = _vision_extra()
    swap = _release_init_swap()  # the reverted function is the derived file's again
    swap.apply()
    try:
        extra["release"] = _vision_extra()
    finally:
        swap.undo()
    _report("vision_extra", extra)
    return result
flashfix.revert = _revert_around_extra
""" % (str(TESTS), WIDENED)


@functools.lru_cache(maxsize=None)
def report(release):
    merged = {}
    code = PREAMBLE + released.SCRIPT.read_text()
    for item in engine_env.run("sglang==" + release, code, timeout=900):
        merged.update(item)
    return merged


def installed(release, module):
    python = engine_env.env_python("sglang==" + release)
    (site,) = python.parent.parent.glob("lib/python*/site-packages")
    return site.joinpath(*module.split(".")).with_suffix(".py")


# --- AST only: the derivations revert exactly one piece each --------------------------------------


@pytest.mark.parametrize("release", RELEASES)
def test_derivation_reverts_one_piece_each(release):
    for module, qualname in ((derive.FLASHINFER_BACKEND, "FlashInferAttnBackend.forward_extend"),
                             (derive.MODEL_CONFIG, "ModelConfig.__init__")):
        fixed_source = installed(release, module).read_text()
        fixed = ast.parse(fixed_source)
        prefix = ast.parse(derive.DERIVE[module](fixed_source))
        # the rest of the module is the release's, statement for statement
        for tree in (fixed, prefix):
            cls, name = qualname.split(".")
            owner = _source.find_def(tree, cls)
            owner.body = [s for s in owner.body if getattr(s, "name", None) != name]
        assert ast.unparse(prefix) == ast.unparse(fixed), module
    # the function itself: one call loses two keywords / one test is spelled with hasattr
    backend = derive.DERIVE[derive.FLASHINFER_BACKEND](installed(release, derive.FLASHINFER_BACKEND).read_text())
    lse = [ast.unparse(c) for c in ast.walk(_source.find_def(ast.parse(backend), "FlashInferAttnBackend.forward_extend"))
           if isinstance(c, ast.Call) and ast.unparse(c.func) == "prefill_wrapper_paged.forward_return_lse"]
    assert len(lse) == 1 and "k_scale" not in lse[0] and "v_scale" not in lse[0], lse
    config = ast.unparse(_source.find_def(ast.parse(derive.DERIVE[derive.MODEL_CONFIG](
        installed(release, derive.MODEL_CONFIG).read_text())), "ModelConfig.__init__"))
    assert "hasattr(self.hf_config, 'vision_config')" in config and "'vision_config', None) is not None" not in config
    assert sorted(derive.DERIVE) == sorted([derive.FLASHINFER_BACKEND, derive.MODEL_CONFIG])  # every declaration


@pytest.mark.parametrize("release", RELEASES)
def test_autotune_change_has_no_pre_fix_shape_in_the_release(release):
    # Why #34217's autotune part is not derived: the release's modelopt-FP8 decision is one helper
    # call (SM90, SM100 or SM120), with no is_sm100_supported() operand that the fix widened.
    values, calls_sm100 = derive.autotune_fp8_condition(installed(release, derive.AUTOTUNE).read_text())
    assert values == ["flashinfer_per_tensor_fp8_supported()"] and calls_sm100 is False, (values, calls_sm100)


# --- one process per release: the derived modules under the real names ----------------------------


@pytest.mark.parametrize("release", RELEASES)
def test_derived_doctor(release):
    d = report(release)["derived_doctor"]
    assert d["version"] == release
    assert Path(d["flashfix"]).resolve().parents[1] == TESTS.parent, d["flashfix"]
    assert d["heavy"] == [], "the doctor's judgement imported %s" % d["heavy"]
    # the probes recognise the pre-fix shape of the two derived parts; autotune stays fixed
    swa_fixed = release == "0.5.23"
    assert {pid: kind for pid, (kind, _) in d["probe"].items()} == dict(
        {FP8: "buggy", VISION: "buggy", AUTOTUNE: "fixed", SWA_FULL: "fixed" if swa_fixed else "buggy",
         CLAMP: "fixed" if swa_fixed else "buggy", CUTLASS_DIMS: "fixed" if swa_fixed else "buggy",
         MLA_PADDED: "fixed" if swa_fixed else "buggy", MERGE_LIMIT: "fixed", MERGE_BASE: "buggy", MLA_LSE: "buggy",
         SOFT_CAP: "buggy"},
        **dict.fromkeys(LATER + (XATTN, PCG, TRITON_HEADS, released.SWA_PREFIX, released.SWA_PREFIX_OLD_ID, WINDOW) + ENCODER, "fixed")), d["probe"]
    # the shipped declarations (open above: a later build without #34217 is the same code) patch it
    assert {pid: v[0] for pid, v in d["shipped"].items()} == dict(
        {FP8: "patch", VISION: "patch", AUTOTUNE: "fixed-upstream", SWA_FULL: "fixed-upstream" if swa_fixed else "patch",
         CLAMP: "fixed-upstream" if swa_fixed else "known-unfixed",  # 0.5.18's FlashInfer 0.6.17 takes no clamp
         CUTLASS_DIMS: "fixed-upstream" if swa_fixed else "patch", MLA_PADDED: "fixed-upstream" if swa_fixed else "patch",
         MERGE_LIMIT: "fixed-upstream", MERGE_BASE: "patch", MLA_LSE: "patch", SOFT_CAP: "patch"},
        **dict.fromkeys(LATER + (XATTN, PCG, TRITON_HEADS, released.SWA_PREFIX, released.SWA_PREFIX_OLD_ID, WINDOW) + ENCODER, "fixed-upstream")), d["shipped"]
    assert d["widened"] == d["shipped"]  # nothing needed widening


@pytest.mark.parametrize("release", RELEASES)
def test_derived_patched_at_runtime_and_reverted(release):
    r = report(release)
    assert r["derived_loaded"] == {derive.FLASHINFER_BACKEND: True, derive.MODEL_CONFIG: True}
    states = {pid: row["state"] for pid, row in r["status"].items()}
    assert states == dict({FP8: "applied", VISION: "applied", SWA_FULL: "fixed-upstream" if release == "0.5.23" else
                           "applied", CLAMP: "fixed-upstream" if release == "0.5.23" else "known-unfixed",
                           CUTLASS_DIMS: "fixed-upstream" if release == "0.5.23" else "applied",
                           MLA_PADDED: "fixed-upstream" if release == "0.5.23" else "applied",
                           MLA_LSE: "applied", SOFT_CAP: "applied", MERGE_BASE: "not-affected"},  # MERGE_BASE: defined only where FlashInfer is available: not on a CPU
                          **dict.fromkeys((AUTOTUNE, XATTN, PCG, TRITON_HEADS, MERGE_LIMIT, released.SWA_PREFIX, released.SWA_PREFIX_OLD_ID, WINDOW) + LATER + ENCODER,
                                          "fixed-upstream")), r["status"]
    assert r["functions"]["autotune_site"][1] == "should_run_flashinfer_autotune"
    for pid in DERIVED:
        assert not r["functions"]["untouched"][pid], "%s: applied but the code is the file's" % pid
        assert r["after_run"]["ran"][pid], "%s: the marker never reported a run" % pid
        assert r["after_run"]["markers_dropped"][pid] == [True]
        assert r["reverted"]["code_restored"][pid] and r["reverted"]["code_changed_by_revert"][pid]
        assert r["reverted"]["state"][pid] == "disabled"
    for pid in (AUTOTUNE,) + LATER:  # released.HEADS's function, the updaters' __init__, is the soft cap's too
        assert r["functions"]["untouched"][pid] is (pid != released.HEADS) and r["after_run"]["changes"][pid] == []
        assert not r["after_run"]["ran"][pid]
    assert r["reverted"]["code_restored"][released.HEADS]  # the soft cap reverted: the release's __init__ again
    assert all(r["reverted"]["same_objects"].values()) and len(r["reverted"]["same_objects"]) == 6


@pytest.mark.parametrize("release", RELEASES)
def test_derived_patched_behaves_as_the_release(release):
    ours, theirs = report(release), released.report(release)
    assert theirs["status"][FP8]["state"] == theirs["status"][VISION]["state"] == "fixed-upstream"
    # differential: the patched derived code, call by call and flag by flag, is the release's own
    for exercise in ("forward_extend", "vision"):
        assert ours["with"][exercise] == theirs["with"][exercise], exercise
        assert ours["with"][exercise] == theirs["without"][exercise], exercise  # the release, untouched
    lse = released._calls(ours["with"]["forward_extend"]["ragged_with_prefix"])[("paged", "forward_return_lse")]
    assert (lse["k_scale"], lse["v_scale"]) == (0.05, 0.07)
    assert ours["with"]["vision"]["llama_vision_null"]["image"] is False
    # the derived code without flashfix is the bug: the cached prefix read unscaled, a null vision
    # tower counted as image understanding; nothing else differs
    bug = ours["without"]
    lse = released._calls(bug["forward_extend"]["ragged_with_prefix"])[("paged", "forward_return_lse")]
    assert (lse["k_scale"], lse["v_scale"]) == ("absent", "absent")
    for case in ("paged", "ragged_no_prefix"):
        assert bug["forward_extend"][case] == theirs["with"]["forward_extend"][case]
    # the check's own configs: the null-tower llama is flagged on 0.5.18; from 0.5.23 the flag also needs
    # is_multimodal, which that config has only under the transformers backend (the extra cases below)
    assert bug["vision"]["llama_vision_null"]["image"] is STANDARD_CONFIG_SHOWS_VISION_BUG[release]
    assert {k: v for k, v in bug["vision"].items() if k != "llama_vision_null"} == \
        {k: v for k, v in theirs["with"]["vision"].items() if k != "llama_vision_null"}
    # more configs, against the release's own ModelConfig.__init__ in the same process
    extra = ours["vision_extra"]
    assert all("error" not in row for column in extra.values() for row in column.values()), extra
    assert extra["with"] == extra["release"], extra
    changed = {case for case in extra["release"] if extra["without"][case] != extra["release"][case]}
    assert changed, "no config shows the derived bug"
    for case in changed:  # the bug: a null vision tower counted as image understanding, where the flag is live
        assert case.startswith("vision_null/") and extra["without"][case]["image"] is True, extra
        assert extra["release"][case]["image"] is False and extra["release"][case]["has_attr"] is True, extra
        assert extra["release"][case]["tower"] is False, extra
    assert ("vision_null/transformers" in changed) and (("vision_null/auto" in changed) is
                                                        STANDARD_CONFIG_SHOWS_VISION_BUG[release]), changed
    # the autotune decision is the release's own code in both processes (not derived, not patched)
    assert ours["with"]["autotune"] is None and theirs["with"]["autotune"] is None
