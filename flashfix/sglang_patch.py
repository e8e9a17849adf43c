"""SGLang patches: backports of sgl-project/sglang PR #34217 (first in 0.5.18), #27338, #27460 and #23993
(0.5.13), #31501 (0.5.16), #38590 (0.5.20), of FlashInfer-backend fixes first released in 0.5.10, 0.5.17 and
0.5.21 (PRs not identified), and fixes of flashfix's own that no release has (#23993's fallback given base-2 LSEs, the MLA
chunk runner's LSE base, the logit soft cap at plan time).

#34217 fixes three unrelated small things; each is its own declaration (``flashfix.semantic``:
the upstream change as before -> after code), judged, disabled (``FLASHFIX_DISABLE=<id>``) and
deleted on its own. Importing this module imports no SGLang, torch or FlashInfer module; every
probe decides from the source text alone. Checked with the engine imported on 0.5.11, 0.5.13,
0.5.14, 0.5.17, 0.5.18 and 0.5.23 (tests/test_sglang_real.py), and on every final release from
0.5.1 on from its wheel's source (scripts/sweep_releases.py, tests/test_sweep.py).
"""
# Silent wrong-output fixes of the FlashInfer backend found in the releases (survey of every final release
# 0.5.1 to 0.5.23, flashinfer_backend.py and flashinfer_mla_backend.py), and where they stand here:
# * #31501 (0.5.16; 0.5.1-0.5.15 affected): the paged-only SWA prefill plans its wrapper without
#   ``window_left``: carried (sglang-swa-paged-plan-window-left), with the keyword parameter upstream adds
#   to FlashInferIndicesUpdaterPrefill.call_begin_forward (``Rule(parameters=...)``).
# * #26513 (0.5.13; 0.5.1-0.5.12): the ragged + paged SWA extend reads not-yet-written slots. Carried
#   (sglang-swa-ragged-prefix-extend-slots from 0.5.11; on 0.5.1-0.5.10, whose call_begin_forward takes no
#   custom mask, sglang-swa-ragged-prefix-slots-0.5.10, which adds 0.5.11's parameter).
# * 0.5.11 (PR not identified; 0.5.1-0.5.10.post1): encoder-only layers run causal in forward_extend:
#   carried as sglang-encoder-only-paged-causal and sglang-encoder-only-ragged-causal (series with the
#   FP8-scale patch).


import ast
import sys

from flashfix.core import lazy as _lazy
from flashfix.core.registry import ABSENT, FIXED, Shape, ShapeError
from flashfix.semantic import Backport, Rule, find, pattern

_source = _lazy.Module("flashfix.core.source")  # a pack holds no reader or matcher object (flashfix.core.lazy)

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34217"
FIXED_IN = "0.5.18"
# Open above on purpose: a post-release or vendor build numbered 0.5.18 or later without #34217 is
# the same code and gets the same fix (tested on 0.5.18's and 0.5.23's source with #34217
# reverted, tests/test_sglang_derived.py); the probes answer "patch" only on the pre-fix shape.
VERSIONS = ">=0.5.1"
FP8_ID, AUTOTUNE_ID, VISION_ID = "sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune", "sglang-vision-config"

FP8_KV_SCALES = Backport(
    id=FP8_ID, engine="sglang", versions=VERSIONS, upstream=UPSTREAM, fixed_in=FIXED_IN,
    module="sglang.srt.layers.attention.flashinfer_backend", function="FlashInferAttnBackend.forward_extend",
    before="prefill_wrapper_paged.forward_return_lse($Q, $KV, **$$$KW)",
    after="prefill_wrapper_paged.forward_return_lse($Q, $KV, **$$$KW, k_scale=$K, v_scale=$V)",
    where="prefill_wrapper_paged.forward($$$_, k_scale=$K, v_scale=$V, **$$$_)",
    fixed="the paged forward_return_lse in forward_extend passes k_scale/v_scale",
    buggy="the paged forward_return_lse in forward_extend (line {line}) omits k_scale/v_scale that the paged "
          "forward call passes ({K}, {V})",
    summary="FlashInferAttnBackend.forward_extend: the paged forward_return_lse of the ragged+paged "
            "prefill now gets k_scale/v_scale, so an FP8 KV cache prefix is read scaled",
    doc="""Why: of forward_extend's paged FlashInfer calls, forward (and forward_decode) pass the FP8
    KV-cache scales; forward_return_lse of the ragged+paged split (an extend over a cached prefix)
    does not, so an FP8 prefix is read unscaled (relative error 187 on an H200, 0.0033 scaled).
    How: the call gets the very scale expressions the sibling paged forward passes ($K, $V bind
    0.5.1's layer.k_scale and 0.5.2+'s layer.k_scale_float alike). Without scales both are None.
    Affected: every final release from 0.5.1 to 0.5.17.

    Delete when: flashfix no longer supports SGLang older than 0.5.18.""")


AUTOTUNE_SITES = (  # where the decision lives, oldest layout first
    ("sglang.srt.model_executor.model_runner", "ModelRunner._should_run_flashinfer_autotune"),  # 0.5.6-0.5.13
    ("sglang.srt.model_executor.runner.base_runner", "BaseRunner._should_run_flashinfer_autotune"),  # 0.5.14
    ("sglang.srt.model_executor.runner.flashinfer_autotune", "should_run_flashinfer_autotune"),  # 0.5.15+
)


def _fp8_condition(tree, func):
    """0.5.6 to 0.5.13 decide autotuning for the MoE and FP4 GEMMs only: no FP8 condition to widen."""
    if find(pattern("is_sm100_supported"), [func]) or find(pattern('"modelopt_fp8"'), [func]):
        return {}
    return Shape(ABSENT, "the autotune decision (%s) has no FP8-GEMM condition" % func.name)


SM120_FP8_AUTOTUNE = Backport(
    id=AUTOTUNE_ID, engine="sglang", versions=VERSIONS, upstream=UPSTREAM, fixed_in=FIXED_IN,
    sites=AUTOTUNE_SITES, module=AUTOTUNE_SITES[0][0], function=AUTOTUNE_SITES[0][1],
    before="$$$A and is_sm100_supported()", constraints={"A": ".*modelopt_fp8.*"},
    after="$$$A and (is_sm100_supported() or is_sm120_supported())",
    needs={"is_sm120_supported": "sglang.srt.utils"}, context=_fp8_condition, absent_unless_mentioned="autotun",
    fixed_if=("is_sm120_supported", "flashinfer_per_tensor_fp8_supported"), fixed="the autotune decision calls {form}()",
    buggy="{name} (line {line}) autotunes the modelopt FP8 GEMM on SM100 only",
    summary="FlashInfer autotune decision: the modelopt FP8 GEMM is autotuned on SM120 as on SM100",
    doc="""Why: SGLang autotunes the modelopt FP8 GEMM only under ``model_uses_modelopt_fp8 and
    is_sm100_supported()``; SM120 (RTX PRO 6000, RTX 50xx) runs the same tunable FlashInfer CUTLASS
    kernel but untuned, on its default tactic, for the server's life: slower, not wrong.
    How: that one ``and`` operand gains ``or is_sm120_supported()``; every other "no" (not CUDA,
    disabled, compute capability < 9, speculative-draft rules) stays no. ``is_sm120_supported`` is
    set on the module as a global from sglang.srt.utils where the module lacks it (a second,
    revertible change). The decision moves between releases (AUTOTUNE_SITES): the patch waits for
    the module that defines it, found from the source when ``sglang`` is imported. 0.5.1 to
    0.5.5.post3 have no FlashInfer autotune at all (nothing there mentions autotuning); from 0.5.18
    the decision calls ``flashinfer_per_tensor_fp8_supported()`` (fixed upstream, not derivable).
    Affected: 0.5.14 to 0.5.17.

    Delete when: flashfix no longer supports SGLang older than 0.5.18.""")


VISION_CONFIG = Backport(
    id=VISION_ID, engine="sglang", versions=VERSIONS, upstream=UPSTREAM, fixed_in=FIXED_IN,
    module="sglang.srt.configs.model_config", function="ModelConfig.__init__", absent_unless_mentioned="is_image_understandable_model",
    inside="self.is_image_understandable_model = $_",
    before='hasattr($X, "vision_config")', after='getattr($X, "vision_config", None) is not None',
    fixed="is_image_understandable_model tests getattr(..., 'vision_config', None) is not None",
    buggy="is_image_understandable_model (line {line}) tests hasattr(..., 'vision_config')",
    summary="ModelConfig.is_image_understandable_model: true only if hf_config.vision_config is not None",
    doc="""Why: several config classes (deepseek_ocr, deepseekvl2, janus_pro, ...) and any config.json
    with "vision_config": null carry the attribute set to None; such a text-only model is then
    reported image-capable (/model_info) and warmed up with an image request.
    Affected: 0.5.5.post1 (where the attribute first appears) to 0.5.17; 0.5.1 to 0.5.5 never
    mention it (not affected), unless ModelConfig has a base class that might set it.

    Delete when: flashfix no longer supports SGLang older than 0.5.18.""")



DRAFT_GRAPH_ID, MLA_DRAFT_GRAPH_ID = "sglang-eagle-draft-graph-kv-indices", "sglang-eagle-mla-draft-graph-kv-indices"
_DRAFT_ROW = dict(  # the multi-step draft backends' init_cuda_graph_state, FlashInfer and FlashInfer-MLA alike
    versions=">=0.5.1", fixed_in="0.5.13", function="init_cuda_graph_state",
    before="(self.speculative_num_steps, $BS * self.max_context_len)",
    after="(self.speculative_num_steps, $BS * self.topk * self.max_context_len)",
    fixed_if=("draft_kv_indices_buffer_width($$$_)", "(self.speculative_num_steps, $BS * self.topk * self.max_context_len)"),
    fixed="the draft CUDA-graph kv_indices row has the topk factor (`{form}`)",
    buggy="{name} (line {line}) sizes each step's kv_indices row {BS} * max_context_len, without topk")
_DRAFT_MEMORY = ("cuda_graph_kv_indices grows topk-fold: 4 B x speculative_num_steps x max_bs x topk x "
                 "max_context_len (the release: without topk); e.g. 3 steps, max_bs 64, topk 4, context 131072: "
                 "384 MiB instead of 96 MiB; topk 1 unchanged")
_DRAFT_DOC = """Why: the draft-decode kernel (generate_draft_decode_kv_indices) packs topk branches per
    sequence into each step's row of ``cuda_graph_kv_indices``, up to seq_lens_sum * topk entries;
    the eager path sizes its rows batch * topk * max_context_len, the CUDA-graph buffer only
    max_bs * max_context_len. With EAGLE topk > 1 and long contexts the kernel writes past its row
    into the next step's indices and past the buffer: wrong draft tokens, or memory corruption.
    How: the row width gains the topk factor, as 0.5.13's draft_kv_indices_buffer_width computes.
    topk == 1 (the default for many setups) is unchanged.
    Affected: every final release from 0.5.1 to 0.5.12.post1.

    Delete when: flashfix no longer supports SGLang older than 0.5.13."""

EAGLE_DRAFT_GRAPH_KV_INDICES = Backport(
    id=DRAFT_GRAPH_ID, engine="sglang", upstream="https://github.com/sgl-project/sglang/pull/27338",
    module="sglang.srt.layers.attention.flashinfer_backend", **dict(
        _DRAFT_ROW, function="FlashInferMultiStepDraftBackend.init_cuda_graph_state"), memory=_DRAFT_MEMORY,
    summary="EAGLE multi-step draft with the FlashInfer CUDA graph: each step's kv_indices row holds "
            "topk branches per sequence, so the draft kernel no longer writes past it",
    doc=_DRAFT_DOC)

EAGLE_MLA_DRAFT_GRAPH_KV_INDICES = Backport(
    id=MLA_DRAFT_GRAPH_ID, engine="sglang", upstream="https://github.com/sgl-project/sglang/pull/27460",
    module="sglang.srt.layers.attention.flashinfer_mla_backend", **dict(
        _DRAFT_ROW, function="FlashInferMLAMultiStepDraftBackend.init_cuda_graph_state"), memory=_DRAFT_MEMORY,
    summary="EAGLE multi-step draft with the FlashInfer-MLA CUDA graph (DeepSeek MTP): each step's kv_indices "
            "row holds topk branches per sequence",
    doc="The same bug and fix as " + DRAFT_GRAPH_ID + ", in the MLA backend's draft backend.\n    " + _DRAFT_DOC)


PLAN_HEADS_ID = "sglang-per-layer-heads-plan"
_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"
_PLAN_HEADS = dict(
    before="$MC.num_attention_heads // $TP",
    after='max(getattr($MC.hf_text_config, "num_attention_heads_per_layer", None) or [$MC.num_attention_heads]) // $TP',
    inside="self.num_qo_heads = $_", constraints={"MC": r"model_runner\.model_config"},
    fixed_if=("$_.get_max_num_attention_heads()",
              'max(getattr($_.hf_text_config, "num_attention_heads_per_layer", None) or [$_]) // $_'),
    fixed="{name} plans for the largest per-layer head count (`{form}`)",
    buggy="{name} (line {line}) plans every layer for {MC}.num_attention_heads query heads")

PER_LAYER_HEADS_PLAN = Backport(
    id=PLAN_HEADS_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.17",
    upstream="https://github.com/sgl-project/sglang/pull/32625",
    hunks=(Rule(_BACKEND, "FlashInferIndicesUpdaterDecode.__init__", **_PLAN_HEADS),
           Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.__init__", **_PLAN_HEADS)),
    summary="FlashInfer decode/prefill plans are made for the largest per-layer query-head count, so layers "
            "with more heads than the model-wide count are not run on a plan made for fewer",
    doc="""Why: FlashInfer bakes num_qo_heads into each plan(), and the indices updaters plan once per
    batch for every layer with ``model_config.num_attention_heads // tp``. A model whose layers
    differ in head count (``hf_text_config.num_attention_heads_per_layer``: Laguna from 0.5.13, or an
    out-of-tree model) runs its wider layers on a plan for fewer heads: silently corrupted output.
    How: both updaters plan for the largest per-layer count (0.5.17's
    ModelConfig.get_max_num_attention_heads, written inline: older ModelConfig lacks it); a model
    without per-layer counts plans exactly as before. Over-planning is safe.
    Affected: 0.5.1 to 0.5.16 have the code (0.5.13 to 0.5.16 ship a model that reaches it).

    Delete when: flashfix no longer supports SGLang older than 0.5.17.""")


SWA_FULL_RAGGED_ID, SWA_PREFIX_ID = "sglang-swa-full-attn-ragged-prefix", "sglang-swa-ragged-prefix-extend-slots"


# --- sglang#26513 (0.5.13): the sliding-window wrapper of a ragged extend reads unwritten slots ---------------

def swa_prefix_custom_mask(window, prefix_lens, seq_lens, kv_start_idx):
    """The custom mask of a sliding-window layer's paged pass in a ragged extend (sglang#26513's, written anew):
    request by request, its new tokens (rows, at positions ``prefix_lens[i]`` on) against the cached keys it
    reads (columns, ``kv_start_idx[i]`` to ``prefix_lens[i]``), true where the key is within ``window`` of the
    query, flattened and joined as FlashInfer's ``custom_mask`` takes it. None where no key falls outside (or
    no request has a prefix): the plan then stays without a mask, as the release's."""
    if window is None or window < 0:
        return None
    import torch

    device, blocks, outside = prefix_lens.device, [], False
    for prefix, start, new in zip(prefix_lens.tolist(), kv_start_idx.tolist(), (seq_lens - prefix_lens).tolist()):
        if prefix <= start or new <= 0:  # nothing cached read, or no new token: no rows or no columns
            continue
        queries = torch.arange(prefix, prefix + new, device=device).unsqueeze(1)
        keys = torch.arange(start, prefix, device=device).unsqueeze(0)
        block = queries - keys <= window
        outside = outside or not bool(block.all())
        blocks.append(block.reshape(-1))
    return torch.cat(blocks) if outside else None


def _custom_mask_parameter(tree):
    """Whether the release's ``call_begin_forward`` takes ``cross_attention_custom_mask`` (0.5.11 on)."""
    updater = _source.find_def(tree, "FlashInferIndicesUpdaterPrefill.call_begin_forward")
    args = updater.args if updater is not None else None
    return args is not None and "cross_attention_custom_mask" in [a.arg for a in args.args + args.kwonlyargs]


def _takes_custom_mask(tree, func):
    """0.5.11 on, where ``call_begin_forward`` takes a custom mask for a normal extend; older releases are
    ``SWA_PREFIX_OLD_ID``'s, which adds the parameter."""
    if _custom_mask_parameter(tree):
        return {}
    return Shape(ABSENT, "FlashInferIndicesUpdaterPrefill.call_begin_forward takes no custom mask before 0.5.11: "
                         "#26513 is carried there as %s, which adds the parameter" % SWA_PREFIX_OLD_ID)


def _takes_no_custom_mask(tree, func):
    """0.5.1 to 0.5.10 only: from 0.5.11 the parameter exists and ``SWA_PREFIX_ID`` carries #26513 (from 0.5.13
    the update_sliding_window hunk's fixed form says fixed-upstream, before this is asked)."""
    if not _custom_mask_parameter(tree):
        return {}
    return Shape(ABSENT, "FlashInferIndicesUpdaterPrefill.call_begin_forward takes a custom mask (0.5.11 on): #26513 "
                         "is carried there as %s" % SWA_PREFIX_ID)


SWA_PREFIX_OLD_ID = "sglang-swa-ragged-prefix-slots-0.5.10"
# update_sliding_window and forward_extend: sglang#26513 on every release 0.5.1-0.5.12.post1
_SWA_PREFIX_HUNKS = (Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.update_sliding_window", before="""
if $ID == 0:
    paged_kernel_lens = torch.minimum($$$M)
    $$$SWA
else:
    $$$FULL
kv_start_idx = seq_lens - paged_kernel_lens
use_sliding_window_kv_pool = $POOL
self.call_begin_forward($$$A, **$$$KW)""", after="""
swa_paged_custom_mask = None
if $ID == 0:
    if use_ragged:
        # the new tokens' K/V are written after this pass: read the cached prefix, its last window only
        effective_start = torch.clamp(prefix_lens - self.sliding_window_size, min=0)
        paged_kernel_lens = prefix_lens - effective_start
        paged_kernel_lens_sum = paged_kernel_lens.sum().item()
        kv_start_idx = effective_start
        swa_paged_custom_mask = swa_prefix_custom_mask(self.sliding_window_size, prefix_lens, seq_lens, effective_start)
    else:
        paged_kernel_lens = torch.minimum($$$M)
        $$$SWA
        kv_start_idx = seq_lens - paged_kernel_lens
else:
    $$$FULL
    kv_start_idx = seq_lens - paged_kernel_lens
use_sliding_window_kv_pool = $POOL
self.call_begin_forward($$$A, **$$$KW, cross_attention_custom_mask=swa_paged_custom_mask)""",
                fixed_if=("$_._build_swa_prefix_custom_mask($$$_)", "swa_prefix_custom_mask($$$_)"),
                fixed="{name} plans the sliding-window wrapper of a ragged extend over the cached prefix (`{form}`)",
                buggy="{name} (line {line}) plans the sliding-window wrapper of a ragged extend over the extend "
                      "slots too, whose K/V are written only after it"),
           Rule(_BACKEND, "FlashInferAttnBackend.forward_extend", before="""
$R1 = self.prefill_wrapper_ragged.forward_return_lse($$$A, **$$$KW)
$R2 = prefill_wrapper_paged.forward_return_lse($$$B, **$$$KW2)""", after="""
$R1 = self.prefill_wrapper_ragged.forward_return_lse($$$A, **$$$KW, window_left=$WL)
$R2 = prefill_wrapper_paged.forward_return_lse($$$B, **$$$KW2, window_left=$WL)""",
                where="prefill_wrapper_paged.forward($$$_, window_left=$WL, **$$$_)",
                fixed_if="$_.forward_return_lse($$$_, window_left=$_, **$$$_)",
                fixed="{name} passes window_left to both passes of the ragged + paged split",
                buggy="{name} (line {line}): the ragged + paged split's forward_return_lse calls pass no window_left"))
SWA_RAGGED_PREFIX_SLOTS = Backport(
    id=SWA_PREFIX_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.13",
    upstream="https://github.com/sgl-project/sglang/pull/26513", context=_takes_custom_mask,
    needs={"swa_prefix_custom_mask": "flashfix.sglang_patch"},
    hunks=_SWA_PREFIX_HUNKS,
    summary="sliding-window models, ragged + paged extend over a cached prefix: the sliding-window layers' paged "
            "pass reads the prefix's last window, masked per query, not the extend slots written after it",
    doc="""Why: on a prefix-cache hit, forward_extend runs the new tokens through the ragged wrapper and
    the cached prefix through the paged one (causal=False), then merges; the new tokens' K/V are
    written to the cache only afterwards. The sliding-window wrapper is planned over the window
    before each request's end, extend slots included, and with no mask: every query of a
    sliding-window layer (Gemma 2/3, GPT-OSS, ...) attends to stale cache contents and to prefix keys
    outside its window.
    How: as upstream, on the ragged path the sliding-window wrapper is planned over the prefix's
    last ``sliding_window_size`` tokens with a custom mask that keeps each query's window (none where
    every key is in it); the paged-only path and the full-attention wrapper are unchanged (the
    latter: sglang-swa-full-attn-ragged-prefix, next in this series). Both forward_return_lse calls
    get the layer's window_left, the expression the paged forward beside them passes; FlashInfer
    reads it only from a module planned with a window, which these releases do not plan
    (sglang#31501), so the mask is what keeps the window. The mask is built on the host from the
    lengths (one device-to-host copy per plan, as upstream).
    Affected: 0.5.1 to 0.5.12.post1; this id on 0.5.11 to 0.5.12.post1, whose call_begin_forward
    takes a custom mask (0.5.1 to 0.5.10: %s, which adds the parameter).

    Delete when: flashfix no longer supports SGLang older than 0.5.13.""" % SWA_PREFIX_OLD_ID)

SWA_RAGGED_PREFIX_SLOTS_OLD = Backport(
    id=SWA_PREFIX_OLD_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.13",
    upstream="https://github.com/sgl-project/sglang/pull/26513", context=_takes_no_custom_mask,
    needs={"swa_prefix_custom_mask": "flashfix.sglang_patch"},
    hunks=(Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.call_begin_forward", before="custom_mask = None",
                after="custom_mask = cross_attention_custom_mask", parameters="cross_attention_custom_mask=None",
                fixed_if=False,  # 0.5.11's form, which is not the fix: from 0.5.13 update_sliding_window's form says fixed
                buggy="{name} (line {line}) plans a normal extend with no custom mask and takes none"),) + _SWA_PREFIX_HUNKS,
    summary="sliding-window models, ragged + paged extend over a cached prefix (0.5.1 to 0.5.10): as "
            "sglang-swa-ragged-prefix-extend-slots, call_begin_forward given the custom-mask parameter 0.5.11 added",
    doc="""Why: as sglang-swa-ragged-prefix-extend-slots (sglang#26513): the sliding-window layers' paged pass
    of a ragged extend over a cached prefix reads extend slots whose K/V are written only after it,
    and prefix keys outside each query's window.
    How: the same two hunks as that patch (update_sliding_window plans the sliding-window wrapper
    over the prefix's last window with a per-query mask; forward_extend's two forward_return_lse
    calls get window_left), and a third: FlashInferIndicesUpdaterPrefill.call_begin_forward gains the
    keyword-only parameter ``cross_attention_custom_mask=None``, which 0.5.11 added (as a positional
    one), and plans a normal extend with it instead of no mask; speculative extends keep their own.
    Every other caller passes nothing and gets exactly the release's plan.
    Affected: 0.5.1 to 0.5.10.post1 (0.5.11 and 0.5.12.post1: sglang-swa-ragged-prefix-extend-slots).

    Delete when: flashfix no longer supports SGLang older than 0.5.11.""")




def _after_26513(tree, func):
    """Before sglang#26513 (0.5.1 to 0.5.12) the SWA wrapper's ragged plan is wrong too, in another
    shape: this fix completes #26513 (upstream's, or flashfix's ``sglang-swa-ragged-prefix-extend-slots``
    earlier in the series) and has nothing to complete without it."""
    if find(pattern("$_._build_swa_prefix_custom_mask($$$_)"), [func]) or find(pattern("swa_prefix_custom_mask($$$_)"), [func]):
        return {}
    return Shape(ABSENT, "update_sliding_window predates sglang#26513 (no prefix-only plan for the SWA wrapper), "
                         "which this fix completes: %s or %s comes first in its series" % (SWA_PREFIX_ID, SWA_PREFIX_OLD_ID))


SWA_FULL_ATTN_RAGGED_PREFIX = Backport(
    id=SWA_FULL_RAGGED_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.21",
    upstream="https://github.com/sgl-project/sglang/compare/v0.5.20...v0.5.21 (PR number not identified)",
    module=_BACKEND, function="FlashInferIndicesUpdaterPrefill.update_sliding_window", context=_after_26513,
    before="paged_kernel_lens = seq_lens\npaged_kernel_lens_sum = seq_lens_sum\nkv_start_idx = seq_lens - paged_kernel_lens",
    after="""
if use_ragged:
    paged_kernel_lens = prefix_lens
    paged_kernel_lens_sum = prefix_lens.sum().item()
    kv_start_idx = None
else:
    paged_kernel_lens = seq_lens
    paged_kernel_lens_sum = seq_lens_sum
    kv_start_idx = seq_lens - paged_kernel_lens
""", fixed_if="paged_kernel_lens = prefix_lens",
    fixed="the full-attention wrapper of a ragged SWA extend is planned over the cached prefix only",
    buggy="{name} (line {line}): the full-attention wrapper of a ragged SWA extend is planned over whole "
          "sequences, extend slots not yet written included",
    summary="SWA models, ragged extend over a cached prefix: the full-attention layers' paged pass reads the "
            "prefix only, not the extend slots whose K/V are written after it",
    doc="""Why: on a prefix-cache hit, forward_extend runs the new tokens through the ragged wrapper and
    the cached prefix through the paged one (causal=False), then merges; the new tokens' K/V are
    written to the cache only afterwards. #26513 (0.5.13) planned the sliding-window wrapper over the
    prefix; the full-attention wrapper of the same models (Gemma 2/3, GPT-OSS, ...) stayed planned
    over prefix + extend, so every query also attends to the extend slots' stale cache contents.
    How: as upstream, on the ragged path the full-attention wrapper is planned over prefix_lens from
    slot 0 (upstream sums the host copy of the prefix lengths where the release has it; this sums
    the device tensor, as the SWA branch beside it does). The paged-only path is unchanged.
    Affected: 0.5.1 to 0.5.20; to 0.5.12.post1 judged on the code #26513's backport leaves
    (sglang-swa-ragged-prefix-extend-slots, on 0.5.1 to 0.5.10 its -0.5.10 form), before it in
    update_sliding_window's series (see _after_26513).

    Delete when: flashfix no longer supports SGLang older than 0.5.21.""")


PATCHES = (FP8_KV_SCALES, SM120_FP8_AUTOTUNE, VISION_CONFIG, EAGLE_DRAFT_GRAPH_KV_INDICES,
           EAGLE_MLA_DRAFT_GRAPH_KV_INDICES, PER_LAYER_HEADS_PLAN, SWA_RAGGED_PREFIX_SLOTS, SWA_RAGGED_PREFIX_SLOTS_OLD,
           SWA_FULL_ATTN_RAGGED_PREFIX)


# --- known, not carried (the doctor names them: ``known-unfixed``) -----------------------------

from flashfix.semantic import Known, Rule  # noqa: E402

KNOWN = ()


# --- MoE and crash fixes ------------------------------------------------------------------------

TRTLLM_FP8_SWIGLU_LIMIT = Backport(
    id="sglang-trtllm-fp8-moe-swiglu-limit", engine="sglang", fixed_in="0.5.20", versions=">=0.5.18",
    requires={"flashinfer-python": ">=0.6.18"}, upstream="https://github.com/sgl-project/sglang/pull/39920",
    module="sglang.srt.layers.quantization.fp8", function="Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params",
    absent_unless_mentioned="_prepare_flashinfer_trtllm_activation_params",
    fixed="{name} falls back to swiglu_limit for the clamp", buggy="{name} (line {line}) builds the clamp from gemm1_clamp_limit only",
    before="""
for $N, $V in (("gemm1_alpha", $C.gemm1_alpha), ("gemm1_beta", $C.gemm1_beta), ("gemm1_clamp_limit", $C.gemm1_clamp_limit)):
    $$$BODY""",
    after="""
clamp_limit = $C.gemm1_clamp_limit if $C.gemm1_clamp_limit is not None else $C.swiglu_limit
for $N, $V in (("gemm1_alpha", $C.gemm1_alpha), ("gemm1_beta", $C.gemm1_beta), ("gemm1_clamp_limit", clamp_limit)):
    $$$BODY""",
    summary="flashinfer_trtllm FP8 MoE: the per-expert gemm1 clamp falls back to the model's swiglu_limit",
    doc="""Why: models with a clamped SwiGLU (GLM-5.3-Flash, swiglu_limit=10) carry the clamp in
    MoeRunnerConfig.swiglu_limit; the flashinfer_trtllm FP8 path builds its per-expert clamp tensor
    from gemm1_clamp_limit only, which stays None: the experts run an unclamped SwiGLU, no error
    (GSM8K 0.928 against 0.936 with triton). How: the clamp is gemm1_clamp_limit, else swiglu_limit,
    as upstream. Affected: 0.5.18 and 0.5.19 (the function first appears in 0.5.18). Carried where
    flashinfer-python is 0.6.18 or newer (0.5.19's pin; flashinfer#4405): 0.6.17, 0.5.18's pin, raises
    on any clamp in the DeepSeek-FP8 block-scale MoE, so there it is known-unfixed.

    Delete when: flashfix no longer supports SGLang older than 0.5.20.""")

PATCHES += (TRTLLM_FP8_SWIGLU_LIMIT,)


# --- cross-attention decode planned with the decoder's lengths (fixed in SGLang 0.5.10) -----------

CROSS_ATTN_DECODE_PLAN = Backport(
    id="sglang-cross-attn-decode-plan-lens", engine="sglang", versions=">=0.5.1", fixed_in="0.5.10",
    upstream="https://github.com/sgl-project/sglang/compare/v0.5.9...v0.5.10",
    module=_BACKEND, function="FlashInferIndicesUpdaterDecode.update_cross_attention",
    before="$SELF.call_begin_forward($$$A, seq_lens_cpu=seq_lens_cpu, **$$$KW)",
    after="$SELF.call_begin_forward($$$A, seq_lens_cpu=seq_lens_cpu if wrapper_id == 0 else encoder_lens.cpu(), **$$$KW)",
    fixed_if="$_.call_begin_forward($$$_, seq_lens_cpu=kv_lens_cpu, **$$$_)",  # upstream names the lengths
    buggy="{name} (line {line}) plans the cross-attention wrapper with the decoder's CPU lengths",
    summary="FlashInfer decode of encoder-decoder models: the cross-attention wrapper is planned with the encoder "
            "lengths, not the decoder's",
    doc="""Why: for encoder-decoder (cross-attention) models, ``update_cross_attention`` plans two decode
    wrappers, the decoder's own tokens (wrapper 0) and the encoder's (wrapper 1), but hands both the
    decoder's ``seq_lens_cpu``. Under CUDA graphs the wrappers plan through FlashInfer's
    ``fast_decode_plan``, which takes those CPU lengths as the KV layout it schedules (split-KV
    tiles): the encoder wrapper's work is sized for the decoder's lengths, so encoder KV beyond them
    is not scheduled (mllama-style models: silently wrong cross-attention; read from FlashInfer's
    plan, not measured on a GPU). How: wrapper 1 gets the encoder lengths on the CPU, as upstream. Affected: 0.5.1 to 0.5.9 (0.5.10 passes ``kv_lens_cpu`` per wrapper; PR not identified).

    Delete when: flashfix no longer supports SGLang older than 0.5.10.""")

PATCHES += (CROSS_ATTN_DECODE_PLAN,)


# --- SM100 CUTLASS ragged prefill kept to the head dims FlashInfer instantiates (fixed in 0.5.21) ---

SM100_CUTLASS_HEAD_DIMS = Backport(
    id="sglang-sm100-cutlass-head-dims", engine="sglang", versions=">=0.5.1", fixed_in="0.5.21",
    upstream="https://github.com/sgl-project/sglang/compare/v0.5.20...v0.5.21 (PR number not identified)",
    module=_BACKEND, function="FlashInferAttnBackend.__init__",
    before='fmha_backend = "cutlass"',
    after='''
if (model_runner.model_config.head_dim, getattr(model_runner.model_config, "v_head_dim", None)
        or model_runner.model_config.head_dim) in ((64, 64), (128, 128), (192, 128)):
    fmha_backend = "cutlass"
else:
    fmha_backend = "fa2"''',
    fixed_if=("cutlass_supported_head_dims", "$_ in ((64, 64), (128, 128), (192, 128))"),
    fixed="the SM100 ragged prefill uses CUTLASS only for the head dims FlashInfer instantiates",
    buggy="{name} (line {line}) gives the SM100 ragged prefill CUTLASS whatever the model's head dims",
    summary="SM100 (B200/GB200) ragged prefill: FlashInfer's CUTLASS FMHA only for head dims 64/64, 128/128 and "
            "192/128, FA2 for the others (Gemma, Qwen3.5: head_dim 256) instead of failing at the first prefill",
    doc="""Why: on SM100 the backend builds its ragged prefill wrapper with FlashInfer's CUTLASS FMHA
    backend for every model, but that kernel is instantiated for (head_dim_qk, head_dim_vo) 64/64,
    128/128 and 192/128 only (fmha_cutlass_sm100.cu: "Unsupported head dimensions"): a model with
    head_dim 256 (Gemma 2/3, Qwen3.5, ...) fails at its first prefill with no prefix.
    How: as upstream, CUTLASS is kept for those three shapes and FA2 is used for the others (a model
    config without v_head_dim has v_head_dim = head_dim). The piecewise-CUDA-graph exception stays.
    Affected: every final release from 0.5.1 to 0.5.20, on SM100.

    Delete when: flashfix no longer supports SGLang older than 0.5.21.""")

PATCHES += (SM100_CUTLASS_HEAD_DIMS,)


# --- sglang#38590: FlashInfer-MLA indptr buffers sized for the padded batch (fixed in 0.5.20) ------

_MLA = "sglang.srt.layers.attention.flashinfer_mla_backend"


def padded_max_batch_size(model_runner):
    """The request count the runners pad a batch to under MLP sync, by the release's own rule (what its
    FlashInferAttnBackend sizes its indptr buffers for): ``_cuda_graph_capture_max_bs(server_args, n)`` in
    0.5.14-0.5.16, ``get_cuda_graph_max_batch_size(server_args, n)`` in 0.5.17-0.5.18, ``(n)`` from 0.5.19."""
    import inspect

    from sglang.srt.layers.attention import flashinfer_backend as fb

    n, pad = model_runner.req_to_token_pool.size, getattr(fb, "_cuda_graph_capture_max_bs", None)
    if pad is None:
        pad = fb.get_cuda_graph_max_batch_size
        if len(inspect.signature(pad).parameters) == 1:
            return pad(n)
    return pad(model_runner.server_args, n)


def _padding_rule(tree, func):
    """Before 0.5.14 the release has no padded-batch rule to size by (0.5.14 added it to flashinfer_backend,
    whose parallel layout both backends then read from sglang.srt.runtime_context)."""
    if any(isinstance(n, ast.ImportFrom) and n.module == "sglang.srt.runtime_context" for n in tree.body):
        return {}
    return Shape(ABSENT, "the release has no padded-batch rule to size by: 0.5.1-0.5.9 never pad a batch past the request "
                         "pool; 0.5.10-0.5.13's CUDA-graph runner does (known-unfixed sglang-flashinfer-indptr-padded-batch)")


MLA_INDPTR_PADDED_BATCH = Backport(
    id="sglang-mla-indptr-padded-batch", engine="sglang", versions=">=0.5.14", fixed_in="0.5.20",
    upstream="https://github.com/sgl-project/sglang/pull/38590", context=_padding_rule,
    needs={"padded_max_batch_size": "flashfix.sglang_patch"},
    hunks=(Rule(_MLA, "FlashInferMLAAttnBackend.__init__", before="max_bs = model_runner.req_to_token_pool.size",
                after="max_bs = padded_max_batch_size(model_runner)", fixed_if="max_bs = get_cuda_graph_max_batch_size($_)",
                buggy="{name} (line {line}) sizes kv_indptr/qo_indptr for the request pool, not the padded batch"),
           Rule(_MLA, "FlashInferMLAMultiStepDraftBackend.__init__", before="max_bs = $P.size * self.topk",
                after="max_bs = padded_max_batch_size(model_runner) * self.topk",
                fixed_if="max_bs = get_cuda_graph_max_batch_size($_) * self.topk")),
    summary="FlashInfer-MLA kv_indptr/qo_indptr/q_indptr_decode are sized for the batch the runners pad to under "
            "MLP sync, so DP attention / DeepEP with a request cap that is no multiple of attn_tp starts",
    doc="""Why: under MLP sync (DP attention, DeepEP, MegaMoE) the eager and CUDA-graph runners pad the
    request count to the attention-TP alignment, so the warm-up and the largest captured decode batch
    can exceed ``req_to_token_pool.size``; FlashInfer-MLA (and its multi-step draft backend) sized its
    indptr buffers for the pool: a shape error at start-up (``--max-running-requests 3`` with attn_tp 2).
    How: as upstream, the buffers are sized by the release's own padded-batch rule, the one its
    FlashInferAttnBackend uses (``padded_max_batch_size``: the rule's three spellings).
    Affected: 0.5.14 to 0.5.19 (0.5.10 to 0.5.13 too, which have no rule to size by: see _padding_rule).

    Delete when: flashfix no longer supports SGLang older than 0.5.20.""")

PATCHES += (MLA_INDPTR_PADDED_BATCH,)
KNOWN += (Known(
    id="sglang-flashinfer-indptr-padded-batch", engine="sglang", versions=">=0.5.10,<0.5.14",
    upstream="https://github.com/sgl-project/sglang/compare/v0.5.13.post1...v0.5.14",
    summary="FlashInfer and FlashInfer-MLA size kv_indptr/qo_indptr for the request pool, while the CUDA-graph runner "
            "pads the batch to the attention-TP alignment (DP attention, TBO; sglang#20978, from 0.5.10): start-up crash "
            "when the request cap is no multiple of it",
    why_not="the release has no padded-batch rule to size by (0.5.14 added one); padding it here would copy the "
            "runner's rule, whose inputs differ from release to release"),)


# --- MLA chunked-prefix attention: FlashInfer's base-2 LSE handed to natural-log merges (flashfix's own) ------

_MLA_BACKEND = "sglang.srt.layers.attention.flashinfer_mla_backend"
LN2 = 0.6931471805599453


def lse_to_natural_log(result):
    """``(output, lse)`` of FlashInfer's ``forward_return_lse`` with the LSE as a natural log (FlashInfer's is base 2),
    for SGLang's merges, which take natural logs; an output without an LSE as it is."""
    if isinstance(result, tuple):
        out, lse = result
        return out, lse * LN2
    return result


def _returns_lse(tree, func):
    """The runner asks FlashInfer for an LSE (0.5.1 always, later releases where the caller merges)."""
    if not find(pattern("$_.forward_return_lse($$$_, **$$$_)"), [func]):
        return Shape(ABSENT, "%s calls no forward_return_lse: it returns no LSE" % func.name)
    return {}


MLA_CHUNKED_PREFIX_LSE = Backport(
    id="sglang-mla-chunked-prefix-lse-base", engine="sglang", versions=">=0.5.1",
    fixed_in="none (0.5.23, the latest release, has the bug)",
    upstream="https://github.com/sgl-project/sglang/issues/40903 (flashfix's own fix; open PR sglang#35045)",
    module=_MLA_BACKEND, function="FlashInferMhaChunkKVRunner.forward", absent_unless_mentioned="FlashInferMhaChunkKVRunner",
    before="return $O", after="return lse_to_natural_log($O)", context=_returns_lse,
    needs={"lse_to_natural_log": "flashfix.sglang_patch"},
    fixed_if=("lse_to_natural_log($$$_)", "$_.forward_return_lse($$$_, lse_base=\"ln\", **$$$_)",
              "$_.forward_return_lse($$$_, return_lse_base_on_e=True, **$$$_)", "math.log(2)"),
    fixed="{name} converts FlashInfer's LSE to natural log (`{form}`)",
    buggy="{name} (line {line}) returns FlashInfer's base-2 LSE to merge_state, which reads natural logs (flashfix's "
          "own fix: no SGLang release has one; sglang#35045 is open)",
    summary="MLA chunked-prefix attention (FlashInfer MLA backend): the chunk runner returns natural-log LSEs, so "
            "SGLang's merge_state weighs the cached prefix chunks and the new tokens right",
    doc="""Why: with an MLA model (DeepSeek V2/V3/R1, Kimi) on the FlashInfer MLA backend, an extend over a
    cached prefix attends to the new tokens (ragged, causal) and to the prefix in chunks, through
    FlashInferMhaChunkKVRunner.forward, and merges the parts with SGLang's merge_state
    (``_chunked_prefix_attn_mha``: sgl_kernel's merge_state_v2 or its Triton twin), which computes the
    weights as exp(lse). FlashInfer's forward_return_lse returns log2-sum-exp2: the parts are
    mis-weighted, 0.16 relative L2 off float64 on an H200 (0.0035 converted; docs/gpu.md), the newest tokens
    under-attended, on every long prefix-cache hit. vLLM fixed the same in #52796.
    How: the runner's result, where it is ``(output, lse)``, gets ``lse * ln 2``. Its LSEs go only to
    those merges (forward_batch.mha_return_lse is set by the models that merge, and attn_attend_prefix_cache
    by their chunk loop). Steps aside where the function converts already: sglang#35045's ``math.log(2)``,
    or FlashInfer's natural-log option (``lse_base="ln"``, flashinfer#5257; or ``return_lse_base_on_e``).
    Affected: every final release from 0.5.1 (0.5.23 is the latest checked).

    Delete when: SGLang converts the LSE in the runner (the probe then reads fixed-upstream).""")
PATCHES += (MLA_CHUNKED_PREFIX_LSE,)


# --- FlashInfer merge_state beyond its launch limit: sglang#23993 (0.5.13), and its fallback's LSE base ------

MERGE_STATE_MAX_THREADS = 1024  # FlashInfer's MergeState launches head_dim / vec_size x num_heads threads per block


def merge_base2(merge, v_a, s_a, v_b, s_b):
    """``merge`` (a merge of two partial attentions whose LSEs are natural logs: SGLang's Triton
    ``merge_state_triton``) given FlashInfer's base-2 LSEs, returning a base-2 LSE as FlashInfer's
    ``merge_state`` does."""
    v, s = merge(v_a, s_a * LN2, v_b, s_b * LN2)
    return v, (s / LN2 if s is not None else None)


def merge_state_launches(v):
    """Can FlashInfer's ``merge_state`` launch for ``v`` ([tokens, heads, head_dim])? Its block is
    head_dim / vec_size threads (vec_size: 16 bytes, at least head_dim / 32 elements) by num_heads."""
    head_dim = v.shape[2]
    return v.shape[1] * (head_dim // max(16 // v.element_size(), head_dim // 32)) <= MERGE_STATE_MAX_THREADS


def merge_state_any_heads(merge_state, merge_state_triton):
    """FlashInfer's ``merge_state`` where it can launch, else SGLang's Triton merge given natural-log
    LSEs (``merge_base2``): sglang#23993's dispatch with the fallback's LSE base right."""

    def merge(v_a, s_a, v_b, s_b):
        if merge_state_launches(v_a):
            return merge_state(v_a, s_a, v_b, s_b)
        return merge_base2(merge_state_triton, v_a, s_a, v_b, s_b)

    merge.__wrapped__ = merge_state
    return merge


def _extend_merges(tree, func):
    """forward_extend merges the ragged and paged parts with the module's ``merge_state``: rebinding it is the fix."""
    extend = _source.find_def(tree, "FlashInferAttnBackend.forward_extend")
    if extend is None or not find(pattern("merge_state($$$_)"), [extend]):
        raise ShapeError("FlashInferAttnBackend.forward_extend does not call merge_state(...): the rebinding would "
                         "not reach the ragged + paged merge")
    return {}


_MERGE_WHY = """Why: forward_extend's ragged + paged split (an extend over a cached prefix, the default
    FlashInfer path) merges the two parts with FlashInfer's ``merge_state``, whose kernel launches
    head_dim / vec_size x num_heads threads per block: above 1,024 (in bf16, more than 64 query heads
    per rank at head_dim 128, more than 32 at 256) it cannot launch. On an H200 (FlashInfer 0.6.17)
    96 heads at head_dim 128 give ``MergeState kernel launch failed: invalid argument``, and the
    pending CUDA error fails the process's next launch too. sglang#23993 (0.5.13) falls back to
    SGLang's Triton ``merge_state_triton`` there, which reads natural-log LSEs, while FlashInfer's
    are base 2: the fallback's output is 15 % off in relative L2 (0.0027 for FlashInfer's merge,
    and for the fallback given converted LSEs; benchmarks/gpu_merge_state_heads.py)."""

MERGE_STATE_LAUNCH_LIMIT = Backport(
    id="sglang-merge-state-launch-limit", engine="sglang", versions=">=0.5.1", fixed_in="0.5.13",
    upstream="https://github.com/sgl-project/sglang/pull/23993", module=_BACKEND, function=None,
    before="from flashinfer.cascade import merge_state",
    after="from flashinfer.cascade import merge_state\nmerge_state = merge_state_any_heads(merge_state, merge_state_triton)",
    needs={"merge_state_any_heads": "flashfix.sglang_patch",
           "merge_state_triton": "sglang.srt.layers.attention.triton_ops.merge_state"},
    context=_extend_merges, fixed_if="merge_state_triton($$$_)",
    fixed="the module falls back to merge_state_triton where FlashInfer's merge_state cannot launch",
    buggy="forward_extend merges with FlashInfer's merge_state at any head count (imported at line {line})",
    summary="ragged + paged extend: FlashInfer's merge_state is used only where its kernel can launch, else "
            "SGLang's Triton merge with the LSEs converted to natural log",
    doc=_MERGE_WHY + """
    How: as sglang#23993 (``merge_state_any_heads``: the same thread count test), with the fallback's
    LSEs multiplied by ln 2 and its output LSE divided back (``merge_base2``). The module's
    ``merge_state`` is rebound, so forward_extend (which sglang-fp8-kv-scales may rewrite) is not
    edited; below the limit the call goes to FlashInfer's merge_state as before.
    Affected: 0.5.1 to 0.5.12.post1 (a crash); 0.5.13 on: see sglang-merge-state-fallback-lse-base.

    Delete when: flashfix no longer supports SGLang older than 0.5.13.""")

MERGE_FALLBACK_LSE_BASE = Backport(
    id="sglang-merge-state-fallback-lse-base", engine="sglang", versions=">=0.5.13",
    fixed_in="none (0.5.23, the latest release, has the bug)",
    upstream="none (flashfix's own: sglang#23993's Triton fallback reads FlashInfer's base-2 LSE as natural log)",
    module=_BACKEND, function="_safe_merge_state",
    before="return merge_state_triton($A, $SA, $B, $SB)", after="return merge_base2(merge_state_triton, $A, $SA, $B, $SB)",
    needs={"merge_base2": "flashfix.sglang_patch"}, absent_unless_mentioned="_safe_merge_state",
    buggy="{name} (line {line}) gives merge_state_triton FlashInfer's base-2 LSEs",
    summary="ragged + paged extend past FlashInfer merge_state's launch limit: the Triton fallback gets natural-log "
            "LSEs, so the context and new tokens are weighted right",
    doc=_MERGE_WHY + """
    How: the fallback's LSEs are multiplied by ln 2 and its output LSE divided back (``merge_base2``).
    Only models past the limit reach the line (more than 64 query heads per rank at head_dim 128).
    Affected: every release from 0.5.13 (0.5.23 is the latest checked).

    Delete when: SGLang converts the LSE there (the probe then reads an unknown shape and leaves it).""")

PATCHES += (MERGE_STATE_LAUNCH_LIMIT, MERGE_FALLBACK_LSE_BASE)


# --- sglang#20061: a piecewise-CUDA-graph extend over a cached prefix takes the paged path (fixed in 0.5.10) ---

_PCG_RUNNER = "sglang.srt.model_executor.piecewise_cuda_graph_runner"
_PCG_FLAG = []  # the release's is_in_piecewise_cuda_graph, once found


def is_in_piecewise_cuda_graph():
    """The release's own ``is_in_piecewise_cuda_graph()``: true while its PiecewiseCudaGraphRunner plans, captures
    or replays a batch. It lives beside the ``enable_piecewise_cuda_graph`` the runner enters: in the runner's
    module in 0.5.5.post1 and .post2, in sglang.srt.compilation.piecewise_context_manager from 0.5.5.post3."""
    if not _PCG_FLAG:
        import importlib
        import sys

        enable = importlib.import_module(_PCG_RUNNER).enable_piecewise_cuda_graph
        _PCG_FLAG.append(getattr(sys.modules[enable.__module__], "is_in_piecewise_cuda_graph"))
    return _PCG_FLAG[0]()


def _graph_flag_module(runner):
    """The module that defines the ``enable_piecewise_cuda_graph`` the runner module enters, or None."""
    for node in runner.body:
        if isinstance(node, ast.FunctionDef) and node.name == "enable_piecewise_cuda_graph":
            return _PCG_RUNNER
        if isinstance(node, ast.ImportFrom) and not node.level and any(
                a.name == "enable_piecewise_cuda_graph" and a.asname is None for a in node.names):
            return node.module
    return None


def _planned_under_graph_flag(tree, func):
    """The fix reads the runner's flag when the batch is planned: that says "inside the piecewise graph" only where
    PiecewiseCudaGraphRunner.replay plans the batch inside ``with enable_piecewise_cuda_graph()`` (0.5.5.post1 to
    0.5.9). 0.5.4 to 0.5.5 plan it in ModelRunner.forward_extend, before the runner is entered, with no flag."""
    runner = _source.module_ast(_PCG_RUNNER)
    if runner is _source.SOURCELESS:
        raise ShapeError("the source of %s is not available: cannot tell where a piecewise-graph batch is planned"
                         % _PCG_RUNNER)
    replay = _source.find_def(runner, "PiecewiseCudaGraphRunner.replay") if runner is not None else None
    if replay is None:
        return Shape(ABSENT, "no piecewise CUDA graph runner (%s.PiecewiseCudaGraphRunner.replay): no extend runs "
                             "inside a piecewise graph" % _PCG_RUNNER)
    flagged = [w for w in ast.walk(replay) if isinstance(w, ast.With) and any(
        isinstance(i.context_expr, ast.Call) and ast.unparse(i.context_expr.func) == "enable_piecewise_cuda_graph"
        for i in w.items)]
    if not (flagged and find(pattern("$_.init_forward_metadata($$$_)"), flagged)):
        return Shape(ABSENT, "PiecewiseCudaGraphRunner.replay plans no batch inside `with enable_piecewise_cuda_graph()` "
                             "(0.5.4 to 0.5.5 plan it before the runner, with no flag to read): the bug is there, not "
                             "carried (known-unfixed sglang-piecewise-graph-ragged-prefix-unflagged)")
    where = _graph_flag_module(runner)
    if where is None or not _source.binds(where, "is_in_piecewise_cuda_graph"):
        raise ShapeError("PiecewiseCudaGraphRunner.replay plans inside enable_piecewise_cuda_graph(), but %s" % (
            "%s does not define is_in_piecewise_cuda_graph beside it" % where if where else
            "%s neither defines nor imports enable_piecewise_cuda_graph by that name" % _PCG_RUNNER))
    return {}


# Open above, as sglang-cross-attn-decode-plan-lens: a later build without the fix, planned under the same flag, gets
# it too; 0.5.10 on read fixed-upstream.
PIECEWISE_GRAPH_PAGED_PREFILL = Backport(
    id="sglang-piecewise-graph-paged-prefill", engine="sglang", versions=">=0.5.5.post1", fixed_in="0.5.10",
    upstream="https://github.com/sgl-project/sglang/issues/20061 (fixed in v0.5.9...v0.5.10, PR not identified; "
             "the qo_indptr padding of the same release is #21452)",
    module=_BACKEND, function="FlashInferAttnBackend.init_forward_metadata", context=_planned_under_graph_flag,
    inside="use_ragged = $_", before="not self.enable_deterministic",
    after="not self.enable_deterministic and not is_in_piecewise_cuda_graph()",
    needs={"is_in_piecewise_cuda_graph": "flashfix.sglang_patch"},
    fixed_if=("is_in_piecewise_cuda_graph()", "is_in_tc_piecewise_cuda_graph()"),
    fixed="{name} takes the paged prefill inside a piecewise CUDA graph (`{form}`)",
    buggy="{name} (line {line}) plans a piecewise-CUDA-graph extend on the ragged + paged split",
    summary="piecewise CUDA graph + prefix cache on the FlashInfer backend: an extend planned inside the piecewise "
            "graph takes the paged prefill, not the ragged + paged split",
    doc="""Why: with the piecewise CUDA graph (--enable-piecewise-cuda-graph; on by default from 0.5.6
    unless --disable-piecewise-cuda-graph) and the radix cache, an extend over a cached prefix that the
    piecewise runner replays gives wrong output on the FlashInfer backend (sglang#20061, reported on
    0.5.5 to 0.5.9). The runner pads the batch's tokens to the captured size and plans it with the real
    batch, and FlashInferAttnBackend.init_forward_metadata chooses the ragged + paged split (new tokens
    ragged, prefix paged, merged); the FlashInfer-MLA backend already refuses that split there
    (its comment: piecewise CUDA graphs need the paged prefill with a prefix cache).
    How: as upstream, ``use_ragged`` is also false while ``is_in_piecewise_cuda_graph()``: the batch
    writes its new K/V to the cache first and reads prefix and new tokens in one paged pass. The flag
    is the release's own, wherever it defines it (``is_in_piecewise_cuda_graph`` of this module: the
    runner's module in 0.5.5.post1/.post2, piecewise_context_manager from 0.5.5.post3), set on the
    backend module as a global. Outside the piecewise graph (eager extends, batches above the largest
    captured size) nothing changes. Not carried: 0.5.10's dummy request padding qo_indptr/kv_indptr to
    the captured size (#21452, with ForwardContext.num_tokens): only FlashInfer 0.6.7 and newer need it
    (their run() rejects q.shape[0] != qo_indptr[-1], ragged or paged, with or without this patch);
    these releases pin FlashInfer 0.5.0 to 0.6.3, which leave the padded rows unwritten.
    Affected: 0.5.5.post1 to 0.5.9 (0.5.4 to 0.5.5 too, with no flag to read: see
    _planned_under_graph_flag; 0.5.10 on read ``is_in_piecewise_cuda_graph()``, from 0.5.14
    ``is_in_tc_piecewise_cuda_graph()``).

    Delete when: flashfix no longer supports SGLang older than 0.5.10.""")

PATCHES += (PIECEWISE_GRAPH_PAGED_PREFILL,)
KNOWN += (Known(
    id="sglang-piecewise-graph-ragged-prefix-unflagged", engine="sglang", versions=">=0.5.4,<0.5.5.post1",
    upstream="https://github.com/sgl-project/sglang/issues/20061",
    shape=Rule(_BACKEND, "FlashInferAttnBackend.init_forward_metadata", inside="use_ragged = $_",
               before="not self.enable_deterministic",
               after="not self.enable_deterministic and not is_in_piecewise_cuda_graph()",
               fixed_if=("is_in_piecewise_cuda_graph()", "is_in_tc_piecewise_cuda_graph()")),
    summary="piecewise CUDA graph (--enable-piecewise-cuda-graph) + prefix cache on the FlashInfer backend: an extend "
            "over a cached prefix run in the piecewise graph takes the ragged + paged split (wrong output, sglang#20061)",
    why_not="the fix reads is_in_piecewise_cuda_graph() when the batch is planned; these releases have no such flag "
            "and plan the batch in ModelRunner.forward_extend before the piecewise runner is chosen, so the backend "
            "cannot tell a piecewise-graph batch from an eager one (carried from 0.5.5.post1 as "
            "sglang-piecewise-graph-paged-prefill)"),)


# --- sglang#32625, the Triton half: decode buffers sized for the largest per-layer head count (0.5.17) ---

_TRITON = "sglang.srt.layers.attention.triton_backend"
_TRITON_HEADS = dict(_PLAN_HEADS, inside="self.num_head = $_",
                     fixed="{name} sizes its buffers for the largest per-layer head count (`{form}`)",
                     buggy="{name} (line {line}) sizes the decode buffers for {MC}.num_attention_heads query heads")

TRITON_PER_LAYER_HEADS = Backport(
    id="sglang-triton-per-layer-heads-buffers", engine="sglang", versions=">=0.5.1", fixed_in="0.5.17",
    upstream="https://github.com/sgl-project/sglang/pull/32625",
    hunks=(Rule(_TRITON, "TritonAttnBackend.__init__", **_TRITON_HEADS),
           Rule(_TRITON, "TritonMultiStepDraftBackend.__init__", **_TRITON_HEADS)),
    summary="Triton attention backend: the split-KV decode buffers (attn_logits, attn_lse) are sized for the "
            "largest per-layer query-head count, so a wider layer's decode no longer writes past them",
    memory="attn_logits and attn_lse (eager and CUDA-graph) grow by the largest per-layer head count over the "
           "model-wide one: (max_bs or max_num_tokens) x heads x max_kv_splits x (v_head_dim + 1) x 4 B; a model "
           "without per-layer head counts is unchanged",
    doc="""Why: the Triton backend sizes its split-KV decode scratch (attn_logits, attn_lse, their
    CUDA-graph copies) for ``model_config.num_attention_heads // tp`` heads, while each layer's
    decode kernel writes one row per head of that layer. A model whose layers differ in head count
    (``hf_text_config.num_attention_heads_per_layer``: Laguna from 0.5.13) writes its wider layers
    past the buffers: out-of-bounds writes, corrupted output or a crash, on --attention-backend
    triton (and the Triton draft backend). The FlashInfer half of the same PR is
    sglang-per-layer-heads-plan.
    How: as there, the backend and its draft backend take the largest per-layer count (0.5.17's
    ModelConfig.get_max_num_attention_heads, written inline); a model without per-layer counts is
    sized exactly as before.
    Affected: 0.5.1 to 0.5.16 have the code (0.5.13 to 0.5.16 ship a model that reaches it).

    Delete when: flashfix no longer supports SGLang older than 0.5.17.""")

PATCHES += (TRITON_PER_LAYER_HEADS,)


# --- attention logit soft-capping never reaches FlashInfer's plans: sglang#33915 (flashfix's own) -------------

SOFT_CAP_ID = "sglang-flashinfer-logit-softcap-plan"


def model_logits_soft_cap(model_runner):
    """The attention logit soft cap that all of ``model_runner``'s attention layers share (their ``logit_cap``), or
    None where none caps (or there is no model to read). Layers that disagree, or cap by other than tanh (the one
    form FlashInfer has), raise: one plan serves every layer of a batch, so no cap would be right for all."""
    model, torch = getattr(model_runner, "model", None), sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):  # no model loaded (a stand-in runner: none to read)
        return None
    caps, methods = {}, set()
    for layer in model.modules():
        cap = getattr(layer, "logit_cap", None)
        if not isinstance(cap, (int, float)) or not hasattr(layer, "layer_id"):  # not an attention layer (RadixAttention)
            continue
        caps.setdefault(float(cap or 0.0), layer.layer_id)
        if cap and cap > 0:
            methods.add(getattr(layer, "logit_capping_method", "tanh"))
    if len(caps) > 1 or methods - {"tanh"}:
        raise ValueError(
            "flashfix %s: the attention layers of this model %s; the FlashInfer backend plans one kernel for every "
            "layer and caps with tanh only, so it cannot run them as the model defines. Use another attention backend "
            "(--attention-backend triton), or FLASHFIX_DISABLE=%s to run as the release does (uncapped)" % (
                SOFT_CAP_ID, "cap their logits differently (%s)" % ", ".join(
                    "%g from layer %s" % item for item in sorted(caps.items())) if len(caps) > 1 else
                "cap by %s" % ", ".join(sorted(methods - {"tanh"})), SOFT_CAP_ID))
    cap = next(iter(caps), 0.0)
    return cap if cap > 0 else None


_NO_CAP = {}
_TAKES_CAP = {}  # plan function -> whether it takes logits_soft_cap


def soft_cap_plan_kwargs(begin_forward, cap):
    """``plan()`` keywords for the soft cap ``cap``: none where there is no cap (the release's call, exactly), or
    where the plan function takes none (SGLang's fast_prefill_plan, a CUDA-graph replay that reuses the kernel
    module its capture planned, with the cap)."""
    if cap is None:
        return _NO_CAP
    func = getattr(begin_forward, "func", begin_forward)  # functools.partial(fast_decode_plan, wrapper)
    func = getattr(func, "__func__", func)  # a bound method: its function
    takes = _TAKES_CAP.get(func)
    if takes is None:
        import inspect

        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            params = ()
        takes = _TAKES_CAP[func] = any(p.name == "logits_soft_cap" or p.kind == p.VAR_KEYWORD for p in params)
    return {"logits_soft_cap": cap} if takes else _NO_CAP


_SOFT_CAP_INIT = dict(
    before="$SELF.q_data_type = $MR.dtype",
    after="$SELF.q_data_type = $MR.dtype\n$SELF.logits_soft_cap = model_logits_soft_cap($MR)",
    fixed="{name} reads the model's logit soft cap (`{form}`)",
    buggy="{name} (line {line}) keeps no logit soft cap for its plans, which FlashInfer then runs uncapped "
          "(flashfix's own fix: no SGLang release has one; sglang#34093 and #38525 are open)")
_SOFT_CAP_PLAN = dict(
    before="$W.begin_forward($$$A, **$$$KW, **$$$SPLAT)",  # SPLAT: 0.5.14's **paged_plan_kwargs (host layout only)
    after="$W.begin_forward($$$A, **$$$KW, **$$$SPLAT, **soft_cap_plan_kwargs($W.begin_forward, $SELF.logits_soft_cap))",
    every=True, fixed_if=("$_($$$_, logits_soft_cap=$_, **$$$_)", "soft_cap_plan_kwargs($_, $_)",
                          '$_["logits_soft_cap"] = $_'),  # a plan call, or a dict of plan keywords, given the cap
    fixed="{name} plans with the logit soft cap (`{form}`)",
    buggy="{name} (line {line}) plans without logits_soft_cap, so FlashInfer picks its uncapped kernel (flashfix's "
          "own fix: no SGLang release has one; sglang#34093 and #38525 are open)")

SOFT_CAP_PLAN = Backport(
    id=SOFT_CAP_ID, engine="sglang", versions=">=0.5.1", fixed_in="none (0.5.23, the latest release, has the bug)",
    upstream="https://github.com/sgl-project/sglang/issues/33915 (flashfix's own fix; open PRs sglang#34093, #38525)",
    needs={"model_logits_soft_cap": "flashfix.sglang_patch", "soft_cap_plan_kwargs": "flashfix.sglang_patch"},
    hunks=(Rule(_BACKEND, "FlashInferIndicesUpdaterDecode.__init__", **_SOFT_CAP_INIT),
           Rule(_BACKEND, "FlashInferIndicesUpdaterDecode.call_begin_forward", **_SOFT_CAP_PLAN),
           Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.__init__", **_SOFT_CAP_INIT),
           Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.call_begin_forward", **_SOFT_CAP_PLAN)),
    summary="models with attention logit soft-capping (Gemma-2: 50, Grok: 30) are capped on the FlashInfer backend: "
            "the decode, ragged and paged plans get the cap, which FlashInfer reads only when it picks the kernel",
    doc="""Why: since FlashInfer 0.2, whether a kernel soft-caps is fixed when plan()/begin_forward()
    picks its module; the cap passed to forward() later is read only by a module planned with one.
    SGLang plans without it, so Gemma-2 and Grok run uncapped in decode and in ragged and paged
    prefill: 11 % to 40 % off the capped reference once logits are large (docs/gpu.md).
    How: each indices updater reads the cap its model's attention layers share (a model whose layers
    disagree, or cap other than by tanh, stops at start-up with the reason: no single plan is right),
    and every plan call passes it, fast_decode_plan's CUDA-graph replay included; a model without a
    cap plans exactly as the release. SGLang's fast_prefill_plan takes no cap and gets none: it reuses
    the module its capture planned. Steps aside where a plan call passes ``logits_soft_cap`` already
    (the open PRs' form).
    Affected: every final release from 0.5.1 (0.5.23 is the latest checked).

    Delete when: SGLang plans with the cap (the probe then reads fixed-upstream).""")
PATCHES += (SOFT_CAP_PLAN,)


# --- sglang#31501 (0.5.16): the paged-only prefill plans its sliding-window wrapper without the window ----------

SWA_PAGED_PLAN_WINDOW = Backport(
    id="sglang-swa-paged-plan-window-left", engine="sglang", versions=">=0.5.1", fixed_in="0.5.16",
    upstream="https://github.com/sgl-project/sglang/pull/31501",
    hunks=(Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.call_begin_forward", parameters="window_left=-1",
                before="wrapper_paged.begin_forward($$$A, **$$$KW, **$$$SPLAT)",  # SPLAT: 0.5.14's **paged_plan_kwargs
                after="wrapper_paged.begin_forward($$$A, **$$$KW, **$$$SPLAT, "
                      "**({'window_left': window_left} if window_left >= 0 else {}))",
                fixed_if=('$_["window_left"] = window_left', "wrapper_paged.begin_forward($$$_, window_left=$_, **$$$_)"),
                fixed="{name} plans the paged wrapper with the caller's window_left (`{form}`)",
                buggy="{name} (line {line}) plans the paged wrapper without window_left, so FlashInfer picks a module "
                      "with no window mask"),
           Rule(_BACKEND, "FlashInferIndicesUpdaterPrefill.update_sliding_window",
                before="self.call_begin_forward($$$A, **$$$KW)", where="for $ID in range(2):\n    $$$_",
                after="self.call_begin_forward($$$A, **$$$KW, window_left=self.sliding_window_size if $ID == 0 and not "
                      "use_ragged and spec_info is None else -1)",
                fixed_if="self.call_begin_forward($$$_, window_left=$_, **$$$_)",
                fixed="{name} passes the sliding-window wrapper's window to its plan (`{form}`)",
                buggy="{name} (line {line}) plans the sliding-window wrapper of a paged-only prefill without its window")),
    summary="sliding-window models, paged-only prefill (piecewise CUDA-graph prefill, deterministic mode, "
            "SGLANG_FLASHINFER_USE_PAGED, multimodal): the sliding-window wrapper is planned with the window",
    doc="""Why: FlashInfer fixes whether a prefill kernel masks a sliding window when plan() picks its
    module: window_left given at forward() is read only by a module planned with a window. SGLang's
    paged-only prefill of a sliding-window layer (Gemma 2/3, GPT-OSS, ...) plans without it and trims
    the KV only per request (the window before each request's first new token), so each later new
    token attends up to that many tokens beyond its window: silently wrong output wherever an extend
    runs paged-only.
    How: as upstream, FlashInferIndicesUpdaterPrefill.call_begin_forward gains a keyword parameter
    ``window_left=-1`` (keyword-only here) and plans the paged wrapper with it when it is set; the
    sliding-window wrapper's plan in update_sliding_window passes the layer's window, on the paged-only
    path without speculative input (the ragged path keeps -1: its prefix pass is what
    sglang-swa-ragged-prefix-extend-slots masks). Every other plan is the release's exact call.
    Both hunks apply or neither; the parameter is added before any caller passes it.
    Affected: 0.5.1 to 0.5.15 (0.5.14 and 0.5.15 plan through ``**paged_plan_kwargs``, passed on as it is).

    Delete when: flashfix no longer supports SGLang older than 0.5.16.""")
PATCHES += (SWA_PAGED_PLAN_WINDOW,)


# --- encoder-only layers run causal on the FlashInfer backend (fixed in 0.5.11, PR not identified) ------------

ENCODER_PAGED_ID, ENCODER_RAGGED_ID = "sglang-encoder-only-paged-causal", "sglang-encoder-only-ragged-causal"
_ENCODER_UPSTREAM = "https://github.com/sgl-project/sglang/compare/v0.5.10.post1...v0.5.11 (PR not identified)"
_ENCODER_WHY = """Why: encoder-only models (BERT-style embedding and reranking models: their RadixAttention
    layers are AttentionType.ENCODER_ONLY) need bidirectional attention; sglang#6230 made
    forward_extend's ragged pass non-causal for them."""

ENCODER_ONLY_PAGED_CAUSAL = Backport(
    id=ENCODER_PAGED_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.11", upstream=_ENCODER_UPSTREAM,
    module=_BACKEND, function="FlashInferAttnBackend.forward_extend",
    before="prefill_wrapper_paged.forward($$$A, causal=not $L.is_cross_attention, **$$$KW)",
    after="prefill_wrapper_paged.forward($$$A, causal=not $L.is_cross_attention and $L.attn_type != "
          "AttentionType.ENCODER_ONLY, **$$$KW)",
    fixed_if="$_.attn_type != AttentionType.ENCODER_ONLY",
    fixed="{name}'s paged-only forward is non-causal for encoder-only layers (`{form}`)",
    buggy="{name} (line {line}): the paged-only forward is causal for encoder-only layers",
    summary="encoder-only models (embeddings, rerankers) on the FlashInfer backend: the paged-only prefill runs "
            "their layers bidirectionally, not causally",
    doc=_ENCODER_WHY + """ The paged-only path (use_ragged off: deterministic inference, piecewise
    CUDA graphs, SGLANG_FLASHINFER_USE_PAGED, ...) kept ``causal=not layer.is_cross_attention``, so
    every token of an encoder-only layer saw only the tokens before it: silently wrong embeddings.
    How: as 0.5.11, the paged forward is non-causal for cross-attention and encoder-only layers alike.
    Affected: 0.5.1 to 0.5.10.post1.

    Delete when: flashfix no longer supports SGLang older than 0.5.11.""")


def _ragged_causal(tree, func):
    """The ragged pass of the ragged + paged split is causal for every layer: 0.5.1 to 0.5.5.post3 pass
    ``causal=True``; 0.5.6 to 0.5.10.post1 pass ``causal=causal`` after resetting it to True for every model but
    a diffusion LM. 0.5.11 passes the ``causal`` computed from the layer's kind, with no reset."""
    if find(pattern("self.prefill_wrapper_ragged.forward_return_lse($$$_, causal=True, **$$$_)"), [func]) or find(
            pattern("if not self.is_dllm_model:\n    causal = True"), [func]):
        return {}
    return Shape(FIXED, "%s's ragged pass takes the causal flag of the layer's kind (0.5.11's form)" % func.name)


ENCODER_ONLY_RAGGED_CAUSAL = Backport(
    id=ENCODER_RAGGED_ID, engine="sglang", versions=">=0.5.1", fixed_in="0.5.11", upstream=_ENCODER_UPSTREAM,
    module=_BACKEND, function="FlashInferAttnBackend.forward_extend", context=_ragged_causal,
    before="self.prefill_wrapper_ragged.forward_return_lse($$$A, causal=$C, **$$$KW)", constraints={"C": r"True|causal"},
    after="self.prefill_wrapper_ragged.forward_return_lse($$$A, causal=not (layer.is_cross_attention or layer.attn_type "
          "== AttentionType.ENCODER_ONLY), **$$$KW)",
    fixed="{name}'s ragged pass is non-causal for encoder-only layers",
    buggy="{name} (line {line}): the ragged pass of the ragged + paged split is causal for every layer, encoder-only "
          "ones included",
    summary="encoder-only models on the FlashInfer backend, extend over a cached prefix: the ragged pass of the "
            "ragged + paged split runs their layers bidirectionally, not causally",
    doc=_ENCODER_WHY + """ The ragged pass of the ragged + paged split (an extend over a cached
    prefix) stayed causal for them: 0.5.1 to 0.5.5.post3 pass ``causal=True``, and 0.5.6 to
    0.5.10.post1 reset ``causal = True`` for every model but a diffusion LM before the call.
    How: the call gets the flag the lines before it compute from the layer's kind (non-causal for
    cross-attention and encoder-only layers), as 0.5.11 passes it; a decoder layer, and a diffusion
    LM's, get exactly what they got (the reset of 0.5.6 to 0.5.10 is left in place, now unread).
    Affected: 0.5.1 to 0.5.10.post1.

    Delete when: flashfix no longer supports SGLang older than 0.5.11.""")
PATCHES += (ENCODER_ONLY_PAGED_CAUSAL, ENCODER_ONLY_RAGGED_CAUSAL)
