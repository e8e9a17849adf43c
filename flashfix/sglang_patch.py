"""SGLang patches: backports of sgl-project/sglang PR #34217 (merged 2026-08-10, first in 0.5.18).

That PR fixes three unrelated small things; each is its own declaration (``flashfix.semantic``:
the upstream change as before -> after code), judged, disabled (``FLASHFIX_DISABLE=<id>``) and
deleted on its own. Importing this module imports no SGLang, torch or FlashInfer module; every
probe decides from the source text alone. Checked with the engine imported on 0.5.11, 0.5.13,
0.5.14, 0.5.17, 0.5.18 and 0.5.23 (tests/test_sglang_real.py), and on every final release from
0.5.1 on from its wheel's source (scripts/sweep_releases.py, tests/test_sweep.py).
"""

from flashfix.core.registry import ABSENT, Shape
from flashfix.semantic import Backport, find, pattern

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


PATCHES = (FP8_KV_SCALES, SM120_FP8_AUTOTUNE, VISION_CONFIG)


# --- known, not carried (the doctor names them: ``known-unfixed``) -----------------------------

from flashfix.semantic import Known, Rule  # noqa: E402

KNOWN = (Known(
    id="sglang-mla-chunked-prefix-lse-base", engine="sglang", versions=">=0.5.1",
    upstream="https://github.com/sgl-project/sglang/issues/40903",
    summary="MLA chunked-prefix attention on the FlashInfer backend hands FlashInfer's base-2 LSE to merge_state_v2, "
            "which takes natural-log LSE: cached prefix and new tokens are mis-weighted on every long prefix-cache hit "
            "(DeepSeek V2/V3/R1 and other MLA models)",
    why_not="no upstream fix is merged (sglang#35045 is open); FlashInfer's own natural-log option (lse_base=\"ln\", "
            "flashinfer#5257) is newer than every release's FlashInfer",
    shape=Rule("sglang.srt.layers.attention.flashinfer_mla_backend", "FlashInferMhaChunkKVRunner.forward", every=True,
               absent_unless_mentioned="FlashInferMhaChunkKVRunner",
               before="$W.forward_return_lse($$$A, **$$$KW)", after="$W.forward_return_lse($$$A, **$$$KW, lse_base=\"ln\")",
               fixed_if=("$_.forward_return_lse($$$_, lse_base=\"ln\", **$$$_)",
                         "$_.forward_return_lse($$$_, return_lse_base_on_e=True, **$$$_)", "math.log(2)")),
),)


# --- MoE and crash fixes ------------------------------------------------------------------------

TRTLLM_FP8_SWIGLU_LIMIT = Backport(
    id="sglang-trtllm-fp8-moe-swiglu-limit", engine="sglang", fixed_in="0.5.20",
    # 0.5.18 pins flashinfer-python 0.6.17, whose DeepSeek-FP8 block-scale MoE raises on any clamp
    # (flashinfer#4405 is in 0.6.18): with h22b's gate, `requires={"flashinfer-python": ">=0.6.18"}`
    # and versions=">=0.5.18".
    versions=">=0.5.19", upstream="https://github.com/sgl-project/sglang/pull/39920",
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
    as upstream. Affected: 0.5.18 and 0.5.19 (the function first appears in 0.5.18); carried on 0.5.19
    only, whose FlashInfer 0.6.18 accepts a clamp on the DeepSeek-FP8 kernel.

    Delete when: flashfix no longer supports SGLang older than 0.5.20.""")

PATCHES += (TRTLLM_FP8_SWIGLU_LIMIT,)
