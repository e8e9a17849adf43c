"""vLLM patches: one declaration each, its ``doc`` says why, how, upstream, affected and when to delete it."""

import ast

from flashfix.core import lazy as _lazy
from flashfix.core.registry import ABSENT, Shape, ShapeError
from flashfix.semantic import Backport, Rule, find, match, pattern

_source = _lazy.Module("flashfix.core.source")  # a pack holds no reader or matcher object (flashfix.core.lazy)

PATCH_ID = "vllm-sink-prefill"
TARGET = "vllm.v1.attention.backends.flashinfer"
SINK_WRAPPER = "BatchAttentionWithAttentionSinkWrapper"
GENERIC_WRAPPER = "BatchPrefillWithPagedKVCacheWrapper"
BUILDER = "FlashInferMetadataBuilder"
FACTORY = BUILDER + "._get_prefill_wrapper"
SUPPORTS_SINK = "FlashInferBackend.supports_sink"
# Builder attributes the sink branch reads; the builder must set each.
_BUILDER_ATTRS = ("has_sinks", "is_kvcache_nvfp4", "q_data_type_prefill", "kv_cache_dtype", "head_dim", "window_left")

NVFP4_REFUSAL = ("FlashInfer cannot prefill with attention sinks from an NVFP4 KV cache (flashfix %s: the sink "
                 "wrapper does not read NVFP4); use a bf16 or FP8 KV cache or another attention backend" % PATCH_ID)


# --- $GPUS: where the build admits sinks while prefill runs the generic wrapper ------------------


# Returns of a gate that admit sinks only where prefill runs trtllm-gen, which applies them: the
# argument-less ``supports_trtllm_attention()`` of builds up to 0.24 (whose ``use_trtllm_attention(
# has_sinks=True)`` then routes prefill and decode of a sink model to trtllm-gen), or one asked
# ``is_prefill=True``. A gate returning nothing or False refuses sinks.
# Built when a probe runs, not at import: an engine process deciding from stored decisions builds no pattern.
_TRTLLM_PREFILL = lambda: [pattern(p % f) for f in ("supports_trtllm_attention", "$_.supports_trtllm_attention")  # noqa: E731
                           for p in ("%s()", "%s(is_prefill=True, **$$$_)")]
# A capability test of vLLM's platform interface: ``P.is_device_capability[_family](N)``.
_CAPABILITY = lambda: [pattern("$P.%s($C)" % name) for name in ("is_device_capability", "is_device_capability_family")]  # noqa: E731


def _admits_no_generic_prefill(value):
    return (value is None or isinstance(value, ast.Constant) and value.value is False
            or any(find(p, [value]) for p in _TRTLLM_PREFILL()))


def _capability_receivers(test, local_names):
    """The names ``test`` asks for the GPU (capability tests, alone or joined by ``or``);
    ShapeError otherwise."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return set().union(*(_capability_receivers(value, local_names) for value in test.values))
    for p in _CAPABILITY():
        b = {}
        if (match(p, test, b) and isinstance(b["P"], ast.Name) and b["P"].id not in local_names
                and isinstance(b["C"], ast.Constant) and type(b["C"].value) is int):
            return {b["P"].id}
    raise ShapeError("%s admits sinks with a generic prefill under `%s`, which is not a device-capability test "
                     "of a module global: cannot tell on which GPUs" % (SUPPORTS_SINK, ast.unparse(test)))


def sink_gpu_test(supports_sink):
    """The capability test under which the build's ``supports_sink`` admits attention sinks
    while prefill stays on FlashInfer's generic wrapper, or None when there is no such GPU.

    ``supports_sink`` is read as a sequence of ``if TEST: return VALUE`` gates and a final
    ``return``. A gate returning False refuses; a return that requires
    ``supports_trtllm_attention(is_prefill=True)`` admits sinks only where prefill runs
    trtllm-gen (SM100), which applies them; any other admitting gate (vLLM: ``return
    supports_trtllm_attention(is_prefill=False)``, decode only) admits sinks on the GPUs its TEST
    names while prefill runs the generic wrapper: those GPUs need the sink wrapper. The TESTs
    of all such gates, joined by ``or``, are returned (the AST node itself). ShapeError, with
    the reason, when the body is not of that form."""
    local_names = set()
    gates = []
    body = supports_sink.body
    for index, stmt in enumerate(body):
        if index == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # the docstring
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            local_names.update((alias.asname or alias.name).split(".")[0] for alias in stmt.names)
            continue
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Return):
            if _admits_no_generic_prefill(stmt.body[0].value):
                continue
            _capability_receivers(stmt.test, local_names)
            gates.append(stmt.test)
            continue
        if isinstance(stmt, ast.Return) and index == len(body) - 1:
            if _admits_no_generic_prefill(stmt.value):
                continue
            raise ShapeError("%s ends with `return %s`: it admits sinks with a generic prefill on GPUs that no "
                             "capability test names" % (SUPPORTS_SINK, ast.unparse(stmt.value)))
        raise ShapeError("%s has a statement flashfix does not read (line %d: `%s`): cannot tell on which GPUs "
                         "it admits sinks with a generic prefill"
                         % (SUPPORTS_SINK, stmt.lineno, ast.unparse(stmt).splitlines()[0]))
    if len(gates) < 2:
        return gates[0] if gates else None
    return ast.BoolOp(op=ast.Or(), values=gates)


def _sink_gpus(tree, factory):
    """The declaration's context: ``{"GPUS": test}`` (``sink_gpu_test``), not-affected when no GPU
    needs the fix, a ShapeError (unknown shape) when it cannot tell or the builder lacks what the
    sink branch reads."""
    supports = _source.find_def(tree, SUPPORTS_SINK)
    if supports is None:
        raise ShapeError("not found: %s" % SUPPORTS_SINK)
    gpus = sink_gpu_test(supports)
    if gpus is None:
        return Shape(ABSENT, "%s admits sinks only where prefill runs trtllm-gen (which applies them): FlashInfer's "
                             "generic prefill never sees sinks" % SUPPORTS_SINK)
    assigned = {t.attr for n in ast.walk(_source.find_def(tree, BUILDER)) for t in ast.walk(n)
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(t, ast.Attribute)
                and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    lacking = [a for a in _BUILDER_ATTRS if a not in assigned]
    if lacking:
        raise ShapeError("%s never sets %s" % (BUILDER, ", ".join(lacking)))
    return {"GPUS": gpus}


def _sink_wrapper_is_generic(module):
    """vLLM's ``plan()`` and ``forward``'s checks accept the sink wrapper only as a generic one."""
    import flashinfer

    sink = getattr(flashinfer, SINK_WRAPPER, None)
    if sink is not None and not issubclass(sink, getattr(module, GENERIC_WRAPPER, ())):
        raise ShapeError("flashinfer's %s is not a %s (forward's checks would refuse it)" % (SINK_WRAPPER, GENERIC_WRAPPER))


# A string, not the module docstring: ``python -OO`` drops docstrings, and a declaration needs its doc.
_SINK_DOC = """vllm-sink-prefill (vLLM PR #52148)
    Why: PR #49718 let vLLM's FlashInfer backend serve attention-sink models (GPT-OSS) on SM12x,
    sinks applied by the XQA decode kernel (``supports_sink`` admits family 120 with a decode-only
    gate), but prefill still runs FlashInfer's generic ``BatchPrefillWithPagedKVCacheWrapper``,
    whose ``run(..., sinks=...)`` accepts the sinks and never reads them: silently wrong output
    (GSM8K 0.0 for GPT-OSS-20b on a DGX Spark). 0.30.0 admits SM90 the same way.
    How: two hunks and a global, applied together or not at all. The prefill-wrapper factory
    builds ``BatchAttentionWithAttentionSinkWrapper`` into each slot for sink models on the GPUs
    that ``supports_sink`` admits with a decode-only gate (``$GPUS``, read from the build's own
    gates: procedural, see ``_sink_gpus``); ``forward`` runs it with the sinks and the scale
    ``sm_scale * q_scale * k_scale`` (v_scale separate) and runs any other wrapper as before,
    without ``sinks=``. The sink class is added to the module's globals from ``flashinfer``.
    Upstream's fix differs between the two slots, so ``fixed_if`` recognises it instead of the
    after-forms, and the derived pre-fix shapes come from reverting upstream's change
    (tests/vllm_prefix_shape.py). Long form: docs/patches/vllm-sink-prefill.md.
    Affected: no PyPI release (0.27.1 and older admit sinks only with trtllm-gen prefill; 0.28.0
    has the fix); main-branch builds between #49718 and #52148 (``0.27.2.devN``, ``0.28.0.devN``,
    vendor containers) and forks without #52148. The range is open above: the probe answers
    "patch" only when every pre-fix fact holds at once.
    Delete when: the oldest supported vLLM is 0.28.0, or no main-branch build from before
    2026-08-13 (nor a fork without #52148) is in use.
"""

SINK_PREFILL = Backport(
    id=PATCH_ID, engine="vllm", versions=">=0.27.0.dev0", fixed_in="0.28.0",
    upstream="https://github.com/vllm-project/vllm/pull/52148",
    summary="prefill with attention sinks uses FlashInfer's sink wrapper on the GPUs where the build serves "
            "sinks with a generic prefill, instead of silently dropping sinks",
    doc=_SINK_DOC, needs={SINK_WRAPPER: "flashinfer"}, context=_sink_gpus, check=_sink_wrapper_is_generic,
    hunks=(
        Rule(TARGET, FACTORY, every=True, fixed_if=SINK_WRAPPER,
             fixed="%s builds %s for sink models (vLLM PR #52148 is in)" % (FACTORY, SINK_WRAPPER),
             buggy="sinks admitted with a generic prefill where `{GPUS}`, but prefill runs the generic FlashInfer "
                   "wrapper, which ignores sinks on fa2/fa3",
             constraints={"SLOT": "_prefill_wrapper|_noncausal_prefill_wrapper"},
             before="$SELF.$SLOT = BatchPrefillWithPagedKVCacheWrapper($WS, $LAYOUT, backend=$B)",
             after="""
if $SELF.has_sinks and $GPUS:
    if $SELF.is_kvcache_nvfp4:
        raise NotImplementedError(%r)
    $RAN
    $SELF.$SLOT = BatchAttentionWithAttentionSinkWrapper(
        $WS, $LAYOUT, backend="auto", q_data_type=$SELF.q_data_type_prefill, kv_data_type=$SELF.kv_cache_dtype,
        head_dim_qk=$SELF.head_dim, head_dim_vo=$SELF.head_dim, window_left=$SELF.window_left)
else:
    $SELF.$SLOT = BatchPrefillWithPagedKVCacheWrapper($WS, $LAYOUT, backend=$B)
""" % NVFP4_REFUSAL),
        Rule(TARGET, "FlashInferImpl.forward", fixed_if="isinstance(prefill_wrapper, %s)" % SINK_WRAPPER,
             constraints={"KW": "kv_cache_sf=.*"},
             before="prefill_wrapper.run($Q, $KV, q_scale=$QS, k_scale=$KS, v_scale=$VS, out=$OUT, sinks=$SINKS, "
                    "**$$$KW)",
             after="""
if isinstance(prefill_wrapper, BatchAttentionWithAttentionSinkWrapper):
    $RAN
    assert $SINKS is not None
    prefill_wrapper.run($Q, $KV, $SINKS, $SELF.scale * $QS * $KS, v_scale=$VS, out=$OUT)
else:
    prefill_wrapper.run($Q, $KV, q_scale=$QS, k_scale=$KS, v_scale=$VS, out=$OUT, **$$$KW)
"""),
    ))



# --- vLLM PR #52796: FlashInfer's base-2 LSE merged as a natural-log one ------------------------
# Three declarations for the one PR: the FlashInfer and TRT-LLM MLA prefill backends are imported
# lazily, only the one selected, and the DCP wrapper lives in the backend module; a patch applies
# once all its targets are imported, so one declaration over the three would wait for all three.

def log2_lse_to_ln(lse):
    """A base-2 log-sum-exp in natural-log units (vLLM 0.29.0 adds a helper of this name)."""
    return lse * 0.6931471805599453  # ln 2


_LSE_DOC = """Why: FlashInfer's prefill wrappers and TRT-LLM's ragged DeepSeek prefill return the
    log-sum-exp in base 2; vLLM's ``merge_attn_states`` (and the MLA chunked-context merge) read it
    as natural log, so on every prefill that merges two partial attentions (%s) the two parts are
    mis-weighted: silently wrong output, 3 %% to 17 %% relative L2 on an H200.
    How: the LSE is multiplied by ln 2 where the wrapper returns it, as upstream does
    (``log2_lse_to_ln``, added to the module from flashfix where the release lacks it).%s
    Affected: 0.20.0 to 0.28.0 (fixed upstream in 0.29.0).

    Delete when: flashfix no longer supports vLLM older than 0.29.0."""
_LSE = dict(engine="vllm", versions=">=0.20", fixed_in="0.29.0", upstream="https://github.com/vllm-project/vllm/pull/52796",
            needs={"log2_lse_to_ln": "flashfix.vllm_patch"})
_MLA_LSE_RETURN = dict(before="return $O, $L", after="return $O, log2_lse_to_ln($L)",
                       constraints={"L": r".*\.transpose\(0, 1\)(\.contiguous\(\))?"},
                       buggy="{name} (line {line}) returns FlashInfer's base-2 LSE `{L}` unconverted")
_MLA_LAYOUT = "\n    The code moved: ``MLACommonImpl._run_prefill_*_%s`` in 0.20.x, the prefill backend classes from 0.21.0."


def _mla_lse(id, module, cls, suffix, what):
    """The MLA prefill backend's two LSE returns (new tokens, context chunk), in both layouts."""
    old = "vllm.model_executor.layers.attention.mla_attention"
    hunks = tuple(Rule(module, "%s.run_prefill_%s" % (cls, part), **_MLA_LSE_RETURN)
                  for part in ("new_tokens", "context_chunk"))
    return Backport(id=id, hunks=hunks, summary="%s: the returned LSE is converted from base 2 to natural log" % what,
                    sites=(tuple((old, "MLACommonImpl._run_prefill_%s_%s" % (p, suffix)) for p in ("new_tokens", "context_chunk")),
                           tuple((h.module, h.function) for h in hunks)),
                    doc=_LSE_DOC % ("MLA prefill over a cached prefix or chunked context, with %s" % what,
                                    _MLA_LAYOUT % suffix), **_LSE)


MLA_FI_LSE = _mla_lse("vllm-mla-flashinfer-lse", "vllm.v1.attention.backends.mla.prefill.flashinfer",
                      "FlashInferPrefillBackend", "fi", "FlashInfer MLA prefill")
MLA_TRTLLM_LSE = _mla_lse("vllm-mla-trtllm-ragged-lse", "vllm.v1.attention.backends.mla.prefill.trtllm_ragged",
                          "TrtllmRaggedPrefillBackend", "trtllm_ragged", "TRT-LLM ragged MLA prefill")
DCP_LSE = Backport(
    id="vllm-dcp-prefill-lse", module=TARGET, function="BatchDCPPrefillWrapper.run", every=True,
    before="$L = $L.transpose(0, 1).contiguous()", after="$L = log2_lse_to_ln($L.transpose(0, 1).contiguous())",
    summary="FlashInfer DCP prefill: the context and new-token LSEs are converted from base 2 to natural log "
            "before they are merged", doc=_LSE_DOC % ("FlashInfer prefill with decode context parallelism, "
                                                        "``BatchDCPPrefillWrapper.run``", ""), **_LSE)


# --- vLLM PR #48003: DCP page counts from global lengths, shared seq_lens mutated ----------------

DCP_PAGE_COUNTS = Backport(
    id="vllm-dcp-page-counts", engine="vllm", versions=">=0.20", fixed_in="0.30.0",
    upstream="https://github.com/vllm-project/vllm/pull/48003",
    module=TARGET, function=BUILDER + ".build", fixed_if="$S = $S.clone()",
    where="(seq_lens_np + ($PS - 1)) // $PS", fixed="{name} copies the lengths before the DCP subtraction (PR #48003 is in)",
    buggy="{name} (line {line}) counts pages from the global lengths and subtracts in place from the shared `{S}`",
    before="""
if self.use_dcp:
    assert $S is not None
    if $NP > 0:
        $$$PRE
        $S[$ND:] = $S[$ND:] - $QL
    $S = get_dcp_local_seq_lens($S, $$$A)
""", after="""
if self.use_dcp:
    assert $S is not None
    if $NP > 0:
        $S = $S.clone()
        $$$PRE
        $S[$ND:] = $S[$ND:] - $QL
    $S = get_dcp_local_seq_lens($S, $$$A)
    seq_lens_np = $S.numpy()
    num_blocks_np = (seq_lens_np + ($PS - 1)) // $PS
""",
    summary="FlashInfer with DCP: paged-KV page counts and last-page lengths from the rank-local lengths, and the "
            "shared seq_lens_cpu left unmodified",
    doc="""Why: with decode context parallelism, ``FlashInferMetadataBuilder.build`` takes the page counts
    (``num_blocks_np``, a view ``seq_lens_np``) from the global sequence lengths before converting them to
    this rank's share, so the paged-KV indptr/indices/last-page lengths planned for FlashInfer's native
    paths describe pages the rank does not hold; and it subtracts the prefill query lengths from
    ``common_attn_metadata.seq_lens_cpu`` in place, which other KV-cache groups built from the same
    metadata then read (a hybrid model's second group subtracts again): silently wrong attention.
    How: as upstream, the lengths are cloned before the in-place subtraction, and ``seq_lens_np`` and
    ``num_blocks_np`` are computed again from the rank-local lengths (the release's own page size).
    Affected: 0.20.0 to 0.29.0 (fixed upstream in 0.30.0).

    Delete when: flashfix no longer supports vLLM older than 0.30.0.""")


# --- FP8 KV cache on KV-sharing layers (fixed in vLLM 0.22.0) ---------------------------------

FP8_KV_SHARING = Backport(
    id="vllm-fp8-kv-sharing-view", engine="vllm", versions=">=0.20", fixed_in="0.22.0",
    upstream="https://github.com/vllm-project/vllm/compare/v0.21.0...v0.22.0",
    module=TARGET, function="FlashInferImpl.forward", fixed_if="$KV.view(fp8_view_dtype)",
    before="self.kv_sharing_target_layer_name is None and is_quantized_kv_cache($D)",
    after="is_quantized_kv_cache($D)",
    summary="FlashInferImpl.forward views a quantized KV cache as FP8 on KV-sharing layers too",
    doc="""Why: vLLM stores an FP8 KV cache as uint8 bytes and ``forward`` views it as FP8 before
    FlashInfer reads it, but skips the view on a layer that shares another layer's cache
    (``kv_sharing_target_layer_name`` set: Gemma-3n, Hunyuan, cross-layer-sharing models); FlashInfer
    then receives a uint8 cache. Its wrapper ``run`` rejects that (a dtype ``ValueError``: the
    request fails; measured on the H200 with FlashInfer 0.6.17, and 0.6.8.post1's source does the
    same); the TRT-LLM kernels (SM100) take uint8 for NVFP4, wrong attention (not measured here).
    How: the view is taken whatever the layer's sharing (a view of the shared tensor, no copy).
    Affected: 0.20.0 to 0.21.0 (0.22.0 views every uint8 FP8 cache).

    Delete when: flashfix no longer supports vLLM older than 0.22.0.""")



# --- attention sinks refreshed on a weight reload (fixed in vLLM 0.26.0) -----------------------

SINKS_RELOAD = Backport(
    id="vllm-sinks-weight-reload", engine="vllm", versions=">=0.20", fixed_in="0.26.0",
    upstream="https://github.com/vllm-project/vllm/pull/48251",
    summary="FlashInferImpl keeps the sinks parameter and refreshes its float32 copy on every weight load",
    doc="""Why: ``FlashInferImpl.process_weights_after_loading`` replaces a bf16 ``sinks`` parameter by
    a float32 copy once; on a later weight load (RL weight sync, ``reload_weights``) the copy is
    already float32, so it is kept, and attention runs with the first checkpoint's sinks: silently
    wrong output until restart (GPT-OSS, bf16 sinks, trtllm-gen / XQA).
    How: ``__init__`` keeps the parameter (``_sinks_source``); each weight load converts it again, or
    copies it into the existing float32 tensor (its address stays, for captured CUDA graphs).
    Affected: 0.20.0 to 0.25.1 (0.26.0 refreshes the copy, vLLM #48251).

    Delete when: flashfix no longer supports vLLM older than 0.26.0.""",
    hunks=(Rule(TARGET, "FlashInferImpl.__init__", fixed_if="$SELF._sinks_source",
                before="$SELF.sinks: $T = None", after="$SELF.sinks: $T = None\n$SELF._sinks_source = sinks"),
           Rule(TARGET, "FlashInferImpl.process_weights_after_loading", fixed_if="$SELF._sinks_source",
                before="""
if $SELF.sinks is not None and $SELF.sinks.dtype != torch.float32:
    $SELF.sinks = $SELF.sinks.to(torch.float32)
""", after="""
if $SELF._sinks_source is not None:
    if $SELF.sinks is None or $SELF.sinks.dtype != torch.float32 or $SELF._sinks_source.dtype == torch.float32:
        $SELF.sinks = $SELF._sinks_source.to(torch.float32)
    else:
        $SELF.sinks.copy_($SELF._sinks_source)
""")))



# --- vLLM PR #38895: DCP's ragged new-token wrapper told the KV-cache layout ---------------------

DCP_RAGGED_LAYOUT = Backport(
    id="vllm-dcp-ragged-layout", engine="vllm", versions=">=0.20", fixed_in="0.22.0",
    upstream="https://github.com/vllm-project/vllm/pull/38895",
    module=TARGET, function="BatchDCPPrefillWrapper.__init__",
    before="BatchPrefillWithRaggedKVCacheWrapper($WS, get_kv_cache_layout())",
    after="BatchPrefillWithRaggedKVCacheWrapper($WS)",
    summary="FlashInfer DCP prefill: the new tokens' ragged wrapper reads key/value as the NHD tensors they are",
    doc="""Why: ``BatchDCPPrefillWrapper`` builds its ragged wrapper for the new tokens with the paged
    KV cache's layout; with an HND cache (SM100, where trtllm-gen requires it) FlashInfer reads the
    new tokens' key/value, which are [tokens, heads, dim] (NHD) tensors, as [heads, tokens, dim]:
    the new tokens' attention is computed over the wrong elements.
    How: the ragged wrapper gets FlashInfer's default layout, NHD, as upstream does.
    Affected: 0.20.0 to 0.21.0 (fixed upstream in 0.22.0).

    Delete when: flashfix no longer supports vLLM older than 0.22.0.""")

PATCHES = (SINK_PREFILL, MLA_FI_LSE, MLA_TRTLLM_LSE, DCP_LSE, DCP_PAGE_COUNTS, FP8_KV_SHARING, SINKS_RELOAD,
           DCP_RAGGED_LAYOUT)


# --- known, not carried (the doctor names them: ``known-unfixed``) -----------------------------


KNOWN = ()  # vllm-trtllm-multi-cta-kv-counter was dropped (issue 36): not a correctness bug, FlashInfer allocates
# the counter itself when the caller passes none (flashinfer#3582), and 0.33.0 is the first release that passes one


# --- MoE and crash fixes ------------------------------------------------------------------------

TRTLLM_FP8_SWIGLU = dict(  # upstream's 0.29.0 form (tests derive the pre-fix shape from it)
    module="vllm.model_executor.layers.fused_moe.experts.trtllm_fp8_moe",
    function="TrtLlmFp8ExpertsBase.is_supported_config",
    before="""
if not $OK or $CFG.num_experts <= 2048:
    return $OK, $WHY
return False, $TOO_MANY""",
    after="""
if not $OK:
    return $OK, $WHY
if ($CFG.swiglu_limit is not None or $CFG.swiglu_alpha is not None or $CFG.swiglu_beta is not None) and (
        weight_key, activation_key) != (kMxfp8Static, kMxfp8Dynamic):
    return False, "the TRTLLM FP8 kernels apply the SwiGLU alpha/beta/clamp parameters only for MXFP8 weights"
if $CFG.num_experts > 2048:
    return False, $TOO_MANY
return True, None""")

TRTLLM_FP8_SWIGLU_GATE = Backport(
    id="vllm-trtllm-fp8-moe-swiglu-gate", engine="vllm", versions=">=0.28", fixed_in="0.29.0",
    upstream="https://github.com/vllm-project/vllm/pull/54160", **TRTLLM_FP8_SWIGLU,
    fixed_if="$_.swiglu_limit is not None",  # 0.30.0 (vLLM #55069) also admits DeepSeek-FP8
    absent_unless_mentioned="is_supported_config",
    fixed="{name} refuses a SwiGLU clamp/alpha/beta it cannot apply",
    buggy="{name} (line {line}) admits models with a SwiGLU clamp/alpha/beta on every FP8 scheme",
    summary="TRT-LLM FP8 MoE is not selected for a model with a SwiGLU clamp/alpha/beta unless its weights are MXFP8",
    doc="""Why: the TRT-LLM FP8 MoE experts are chosen for models whose config sets swiglu_limit/alpha/
    beta, but only FlashInfer's MXFP8 kernel applies them: the per-tensor kernel has no clamp
    (silently unclamped SwiGLU, wrong output) and FlashInfer 0.6.16's DeepSeek-FP8 kernel raises on
    one. How: is_supported_config refuses such a model unless its weights are MXFP8, so vLLM's oracle
    picks another MoE backend, as upstream. Affected: 0.28.0, the only release where the class
    defines is_supported_config (0.22.0 to 0.27.1 inherit the generic one: the same selection, not
    carried). Open above: a later build with the pre-fix shape loses nothing by falling back.

    Delete when: flashfix no longer supports vLLM 0.28.""")

PATCHES += (TRTLLM_FP8_SWIGLU_GATE,)


# --- FlashInfer workspace sized for the prefill chunk's heads (fixed in vLLM 0.26.0) -------------

WORKSPACE_SIZE = Backport(
    id="vllm-prefill-workspace-size", engine="vllm", versions=">=0.20", fixed_in="0.26.0",
    upstream="https://github.com/vllm-project/vllm/pull/48428",
    module=TARGET, function=BUILDER + "._get_workspace_buffer", fixed_if="$B = max($B, $_)",
    buggy="{name} (line {line}) allocates the fixed default workspace whatever the prefill chunk's heads",
    before="""
if envs.VLLM_BATCH_INVARIANT:
    $B = $BI""",
    after="""
if envs.VLLM_BATCH_INVARIANT:
    $B = $BI
else:
    $B = max($B, $SELF.vllm_config.scheduler_config.max_num_batched_tokens * $SELF.num_qo_heads * $SELF.head_dim * 16)""",
    summary="the FlashInfer workspace is at least max_num_batched_tokens x query heads x head_dim x 16 bytes, so "
            "wide-head models do not overflow it at prefill",
    memory="the FlashInfer workspace becomes max(the release's default, ~394 MiB; max_num_batched_tokens x "
           "query heads per rank x head_dim x 16 B): e.g. 32,768 batched tokens, 64 heads, head_dim 128: 4 GiB; "
           "8,192 tokens, 64 heads, head_dim 64: 512 MiB",
    doc="""Why: FlashInfer's prefill temporaries grow with the prefill chunk's tokens x query heads x
    head_dim, but the builder allocates the fixed default workspace (VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE,
    ~394 MiB): a wide-head model at the default 8192-token chunk outgrows it, and FlashInfer raises
    instead of growing it (seen on SM120): the engine fails at its first large prefill.
    How: outside batch-invariant mode the workspace is the larger of the default and that estimate
    (16 bytes an element, as upstream). Affected: 0.20.0 to 0.25.1 (0.26.0 sizes it, vLLM #48428).

    Delete when: flashfix no longer supports vLLM older than 0.26.0.""")

PATCHES += (WORKSPACE_SIZE,)


# --- vLLM PR #53111: XQA decode given a head_dim it cannot serve --------------------------------

_DECODE_KERNEL = "$_.flashinfer_trtllm_api_decode_kernel"


def _xqa_decode(tree, func):
    """Before 0.25 the builder chooses no XQA decode kernel (nothing to fall back from). Only the
    function is read: walking the module would parse all of its runs (+0.4 MiB on vLLM 0.28.0)."""
    return {} if find(pattern(_DECODE_KERNEL), [func]) else Shape(
        ABSENT, "%s.__init__ chooses no FlashInfer decode kernel (no XQA decode in this release)" % BUILDER)


XQA_HEAD_DIM = Backport(
    id="vllm-xqa-head-dim", engine="vllm", versions=">=0.25", fixed_in="0.29.0",
    upstream="https://github.com/vllm-project/vllm/pull/53111",
    module=TARGET, function=BUILDER + ".__init__", context=_xqa_decode,
    before="$SELF.flashinfer_trtllm_api_decode_kernel: $T = $KERNEL",
    after="""
$SELF.flashinfer_trtllm_api_decode_kernel: $T = $KERNEL
if $SELF.flashinfer_trtllm_api_decode_kernel == FlashInferDecodeKernel.XQA and not (
        16 <= $SELF.head_dim <= 256 and $SELF.head_dim % 16 == 0):
    logger.warning_once("flashfix: XQA decode cannot serve head_dim=%d; native FlashInfer decode is used for this "
                        "KV-cache group", $SELF.head_dim)
    $SELF.use_trtllm_decode_attention = False
    $SELF.flashinfer_trtllm_api_decode_kernel = None""",
    fixed_if=("16 <= $_.head_dim <= 256", "_is_xqa_head_dim_supported($_)"),
    buggy="{name} (line {line}) chooses XQA decode whatever the head_dim",
    summary="FlashInfer decode falls back from XQA to the native kernel for KV-cache groups whose head_dim XQA "
            "cannot serve (16 to 256, a multiple of 16)",
    doc="""Why: the builder picks the XQA decode kernel (SM90; SM12x from 0.28) for every KV-cache group,
    but FlashInfer's XQA takes head_dim 16 to 256 in steps of 16: a model with wider heads (Gemma 4's
    global-attention layers, head_dim 512) fails at engine start ("Invalid head_dim: 512").
    How: right after the kernel is chosen, a group whose head_dim XQA cannot serve is given native
    FlashInfer decode (one warning), as upstream; other groups keep XQA. Affected: 0.25.0 (the first
    release with XQA decode) to 0.28.0; 0.30.0 moved the test to _is_xqa_head_dim_supported.

    Delete when: flashfix no longer supports vLLM older than 0.29.0.""")

PATCHES += (XQA_HEAD_DIM,)


# --- vLLM PR #42650: the plan's query-head count from the group's own layers -------------------

def get_num_attention_heads_from_layers(vllm_config, layer_names):
    """Per-rank query heads of the named attention layers (vLLM 0.25.0 has a helper of this name,
    which asserts they agree; this plans for the largest), or None where none is registered."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    return max((getattr(layer, "impl", layer).num_heads for layer in layers.values()), default=None)


LAYER_HEADS_PLAN = Backport(
    id="vllm-layer-heads-plan", engine="vllm", versions=">=0.20", fixed_in="0.25.0",
    upstream="https://github.com/vllm-project/vllm/pull/42650",
    module=TARGET, function=BUILDER + ".__init__", needs={"get_num_attention_heads_from_layers": "flashfix.vllm_patch"},
    before="$SELF.num_qo_heads = $SELF.model_config.get_num_attention_heads($PC)",
    after="$SELF.num_qo_heads = get_num_attention_heads_from_layers(vllm_config, layer_names) or "
          "$SELF.model_config.get_num_attention_heads($PC)",
    buggy="{name} (line {line}) plans FlashInfer for the model-wide query-head count, not its layers'",
    summary="FlashInfer plans each KV-cache group for its own layers' query-head count, not the model-wide one",
    doc="""Why: the metadata builder plans FlashInfer (num_qo_heads) with the model-wide head count, but
    the kernels take the heads from q. A group whose layers have more heads (Laguna's
    num_attention_heads_per_layer, 0.21 on; a speculative draft with other heads than its target)
    runs on a plan made for fewer: the rows past the planned work are silently wrong (vllm#41651).
    How: the count is read from the group's registered attention layers, the model-wide one where
    none is registered, as upstream (its helper, from flashfix where the release lacks it).
    Affected: 0.20.0 to 0.21.0 and 0.23.0 to 0.24.0 (0.22.0 had the fix; #43241 dropped it in 0.23.0;
    #47039 restored it in 0.25.0).

    Delete when: flashfix no longer supports vLLM older than 0.25.0.""")

PATCHES += (LAYER_HEADS_PLAN,)


# --- vLLM PR #46993: each MLA metadata builder gets its own prefill backend ---------------------

def clone_mla_prefill_backend(backend):
    """A fresh MLA prefill backend of the same class and configuration (vLLM 0.25.0's
    ``MLAPrefillBackend.clone``): its prepared metadata and FlashInfer wrappers are its own."""
    return type(backend)(num_heads=backend.num_heads, scale=backend.scale, kv_lora_rank=backend.kv_lora_rank,
                         qk_nope_head_dim=backend.qk_nope_head_dim, qk_rope_head_dim=backend.qk_rope_head_dim,
                         v_head_dim=backend.v_head_dim, vllm_config=backend.vllm_config)


def _prefill_backend_objects(tree, func):
    """0.20.x picks the MLA prefill path inside MLACommonImpl: no prefill backend object to share."""
    return {} if find(pattern("$_.prefill_backend"), [func]) else Shape(
        ABSENT, "MLACommonMetadataBuilder.__init__ takes no prefill backend object (MLA prefill is chosen per impl)")


MLA_PREFILL_BACKEND_PER_BUILDER = Backport(
    id="vllm-mla-prefill-backend-per-builder", engine="vllm", versions=">=0.21", fixed_in="0.25.0",
    upstream="https://github.com/vllm-project/vllm/pull/46993",
    module="vllm.model_executor.layers.attention.mla_attention", function="MLACommonMetadataBuilder.__init__",
    context=_prefill_backend_objects, needs={"clone_mla_prefill_backend": "flashfix.vllm_patch"},
    before="$SELF._prefill_backend = $L.prefill_backend", after="$SELF._prefill_backend = clone_mla_prefill_backend($L.prefill_backend)",
    fixed_if="$_.prefill_backend.clone()", fixed="{name} clones the layer's prefill backend (vLLM PR #46993 is in)",
    buggy="{name} (line {line}) shares the layer's MLA prefill backend, and its prepared metadata, between builders",
    summary="MLA: each metadata builder (one per micro-batch with DBO) gets its own prefill backend, so one "
            "micro-batch's prefill no longer runs on another's prepared metadata and FlashInfer plans",
    memory="one MLA prefill backend per metadata builder instead of one per layer group: with DBO, one more per "
           "micro-batch, each with its own planned FlashInfer wrappers and prepared metadata (and, where the "
           "release's backend allocates one at construction, its own prefill workspace)",
    doc="""Why: the MLA prefill backends (FlashInfer, TRT-LLM ragged, FlashAttention) keep the prepared
    prefill metadata, and the FlashInfer prefill backend its planned wrappers, on the backend object;
    MLACommonMetadataBuilder takes the layer's one instance. With dual-batch overlap (DBO) a builder
    per micro-batch builds before any forward runs, so micro-batch 0's prefill runs with micro-batch
    1's sequence lengths and plans: silently wrong output or an illegal memory access.
    How: as upstream, each builder gets a fresh instance of the same class and configuration (0.25.0's
    MLAPrefillBackend.clone, from flashfix where the release lacks it).
    Affected: 0.21.0 (the first with prefill backend objects) to 0.24.0 (fixed upstream in 0.25.0).

    Delete when: flashfix no longer supports vLLM older than 0.25.0.""")

PATCHES += (MLA_PREFILL_BACKEND_PER_BUILDER,)


# --- MLA's absorbed weights keep their storage across a weight reload (vLLM PR #48251, 0.32.0) -----

_MLA = "vllm.model_executor.layers.attention.mla_attention"
_MLA_WEIGHTS = "MLAAttention.process_weights_after_loading"


def keep_storage(layer, name, tensor):
    """``layer.<name> = tensor``, as the release binds it, except on a reload: where a tensor of the same
    shape, dtype and device is bound there already, ``tensor`` is copied into it, so that its storage,
    which CUDA graphs captured before the reload read, holds the new weights (what vLLM's
    ``replace_parameter(..., prefer_copy=True)`` does from 0.26.0)."""
    import torch

    old = getattr(layer, name, None)
    if (isinstance(old, torch.Tensor) and old is not tensor and old.shape == tensor.shape
            and old.dtype == tensor.dtype and old.device == tensor.device):
        with torch.no_grad():
            old.copy_(tensor)
    else:
        setattr(layer, name, tensor)


def _qrep_weights(tree, func):
    """The DCP query-replicated copy of W_UK_T is first made in 0.27.0."""
    return {} if find(pattern("$_.W_UK_T_dcp_qrep"), [func]) else Shape(
        ABSENT, "%s makes no DCP query-replicated W_UK_T (first in 0.27.0)" % _MLA_WEIGHTS)


_RELOAD_WHY = """Why: MLAAttention.process_weights_after_loading derives %s from
    kv_b_proj's weights and binds %s to a new tensor on every weight load. On a reload (RL weight sync,
    ``reload_weights``) the CUDA graphs captured at start-up still read the first tensor's storage:
    MLA models (DeepSeek V2/V3/R1, Kimi) decode with the first checkpoint's weights%s, silently wrong
    until restart. The FP8 and other quantised checkpoints always hit it (dequantisation makes a new
    tensor); bf16 ones where the reload does not write kv_b_proj in place.
    How: as upstream's ``prefer_copy=True``, the new value is copied into the tensor already bound
    where shape, dtype and device agree (``keep_storage``); the first load binds it as the release does.
    No memory beyond the release's: it held one such tensor, and still holds one."""

MLA_WEIGHTS_RELOAD = Backport(
    id="vllm-mla-weights-reload", engine="vllm", versions=">=0.20", fixed_in="0.26.0",
    upstream="https://github.com/vllm-project/vllm/pull/48251", module=_MLA, function=_MLA_WEIGHTS,
    needs={"keep_storage": "flashfix.vllm_patch"},
    before="$SELF.W_UV = $UV.transpose(0, 1)\n$SELF.W_UK_T = $UK.permute(1, 2, 0)",
    after='keep_storage($SELF, "W_UV", $UV.transpose(0, 1))\nkeep_storage($SELF, "W_UK_T", $UK.permute(1, 2, 0))',
    fixed_if=('replace_parameter($_, "W_UV", $_, **$$$_)', "keep_storage($_, \"W_UV\", $_)"),
    fixed="{name} refreshes W_UV and W_UK_T in place on a reload (vLLM PR #48251 is in: `{form}`)",
    buggy="{name} (line {line}) binds W_UV and W_UK_T to new tensors on every weight load",
    summary="MLA: W_UV and W_UK_T are refreshed in place on a weight reload, so CUDA graphs captured before it "
            "read the new weights",
    doc=_RELOAD_WHY % ("W_UV and W_UK_T", "them", "") + """
    Affected: 0.20.0 to 0.25.1 (0.26.0 calls replace_parameter(..., prefer_copy=True), vLLM #48251).

    Delete when: flashfix no longer supports vLLM older than 0.26.0.""")

MLA_QREP_WEIGHTS_RELOAD = Backport(
    id="vllm-mla-dcp-qrep-weights-reload", engine="vllm", versions=">=0.27", fixed_in="0.32.0",
    upstream="https://github.com/vllm-project/vllm/compare/v0.31.0...v0.32.0 (PR not identified; the same "
             "prefer_copy as vLLM PR #48251)", module=_MLA, function=_MLA_WEIGHTS, context=_qrep_weights,
    needs={"keep_storage": "flashfix.vllm_patch"},
    before="$SELF.W_UK_T_dcp_qrep = $G.all_gather($$$A, **$$$KW)",
    after='keep_storage($SELF, "W_UK_T_dcp_qrep", $G.all_gather($$$A, **$$$KW))',
    fixed_if=('replace_parameter($_, "W_UK_T_dcp_qrep", $_, **$$$_)', "keep_storage($_, \"W_UK_T_dcp_qrep\", $_)"),
    fixed="{name} refreshes W_UK_T_dcp_qrep in place on a reload (`{form}`)",
    buggy="{name} (line {line}) binds W_UK_T_dcp_qrep to a new all-gathered tensor on every weight load",
    summary="MLA with decode context parallelism and query replication: the all-gathered W_UK_T is refreshed in "
            "place on a weight reload, so CUDA graphs captured before it read the new weights",
    doc=_RELOAD_WHY % ("the DCP query-replicated W_UK_T_dcp_qrep (an all_gather of W_UK_T)", "it",
                       " under DCP with query replication") + """
    Affected: 0.27.0 (the first with W_UK_T_dcp_qrep) to 0.31.0 (0.32.0 calls replace_parameter on it).
    W_UV and W_UK_T themselves are vllm-mla-weights-reload's (fixed in 0.26.0).

    Delete when: flashfix no longer supports vLLM older than 0.32.0.""")

PATCHES += (MLA_WEIGHTS_RELOAD, MLA_QREP_WEIGHTS_RELOAD)
