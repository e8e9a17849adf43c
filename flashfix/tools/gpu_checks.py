"""Numeric checks of the FlashInfer paths flashfix changes, on a GPU, against float64 references.

Used by the benchmark scripts (``benchmarks/gpu_*.py``) and meant for a ``flashfix verify``
command. Imported on demand only: torch and FlashInfer are imported inside the functions,
never when this module loads. Nothing here needs vLLM or SGLang: their code paths are driven
through flashfix's own patch code applied to small stand-ins defined below (a metadata
builder, ``FlashInferImpl.forward``, ``FlashInferAttnBackend.forward_extend``) that hold the
engines' pre-fix call statements.

Three checks:

``sink_prefill``     paged prefill of a model with attention sinks: FlashInfer's generic
                     wrapper given ``sinks=`` (the pre-fix vLLM path, which drops the sinks)
                     against the path flashfix's vLLM patch takes (its factory hunk makes the
                     factory build the sink wrapper, its forward hunk dispatches the call).
``fp8_paged``        SGLang's ragged + paged prefill over an FP8 (e4m3) cache with scales far
                     from 1, merged by log-sum-exp: the paged read without the scales (pre-fix)
                     against the call flashfix's SGLang patch produces.
``sink_sequence``    several sink wrappers built one after another in one process (the JIT
                     kernel-name collision): run it in a fresh process per sequence.

Errors are relative L2 errors ``|out - ref| / |ref|`` of the whole output, with the reference
computed in float64 from exactly the values the kernel reads (bf16 inputs, dequantised FP8).
"""

import itertools
import logging
import math
import os
import time
import types

# Shapes of the checks (the shared notes' measurements use the same).
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 16, 2, 64, 16
WORKSPACE_BYTES = 128 * 1024 * 1024

# (name, [(new tokens, kv length), ...], window_left)
SINK_CASES = (
    ("no prefix", [(1, 1), (57, 57), (300, 300)], -1),
    ("cached prefix", [(20, 500), (128, 1000)], -1),
    ("sliding window 128", [(400, 400), (128, 1000)], 128),
    ("8 x 2048", [(2048, 2048)] * 8, -1),
)
TIMED_CASE = "8 x 2048"
SINK = "BatchAttentionWithAttentionSinkWrapper"

# (prefix tokens in the FP8 cache, new tokens) per request
FP8_REQUESTS = ((100, 37), (500, 128), (1000, 1), (64, 300))
K_SCALE, V_SCALE = 0.05, 0.07


# --- common -----------------------------------------------------------------------------------


def environment():
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import flashinfer

        info["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:  # reported, the checks will fail on their own
        info["flashinfer"] = "import failed: %r" % (exc,)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["capability"] = "%d.%d" % (props.major, props.minor)
    else:
        info["gpu"] = None
    from flashfix import __version__

    info["flashfix"] = __version__
    return info


def rel_l2(out, ref):
    """Relative L2 error in float64; NaN/inf in ``out`` give ``inf``."""
    import torch

    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def nan_fraction(out):
    import torch

    return float((~torch.isfinite(out.float())).float().mean())


def reference(q, k, v, sm_scale, *, causal=True, window_left=-1, sinks=None):
    """float64 attention of one request. q [n, Hq, D], k/v [m, Hkv, D]; query i sits at
    position m - n + i; ``sinks`` (natural-log logits per query head) join the softmax
    denominator only, as FlashInfer's AttentionSink variant does."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    n, hq, _ = q.shape
    m, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * sm_scale
    pos = torch.arange(n, device=q.device)[:, None] + (m - n)
    key = torch.arange(m, device=q.device)[None, :]
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= key <= pos
    if window_left >= 0:
        allowed &= pos - key <= window_left
    scores = scores.masked_fill(~allowed, -math.inf)
    top = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.double().view(hq, 1, 1)
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - top)
    return torch.einsum("hnm,mhd->nhd", weights / denom, v)


def time_ms(fn, warmup=3, iters=20):
    """Median time of ``fn()`` in milliseconds (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _workspace():
    import torch

    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


class PagedBatch:
    """A batch of requests over a paged cache (NHD, ``(k_cache, v_cache)``), pages shuffled."""

    def __init__(self, seqs, *, kv_dtype=None, page_size=PAGE_SIZE, head_dim=HEAD_DIM, seed=0,
                 k_scale=1.0, v_scale=1.0):
        import torch

        kv_dtype = kv_dtype or torch.bfloat16
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.seqs, self.page_size, self.head_dim = list(seqs), page_size, head_dim
        pages_per = [-(-kv // page_size) for _, kv in self.seqs]
        total_pages = sum(pages_per)
        order = torch.randperm(total_pages, generator=gen, device="cuda").to(torch.int32)
        shape = (total_pages, page_size, NUM_KV_HEADS, head_dim)
        true_k = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        true_v = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
        # what the cache holds, and the values a correct read of it yields
        self.k_cache = (true_k / k_scale).to(kv_dtype)
        self.v_cache = (true_v / v_scale).to(kv_dtype)
        self.k_read = self.k_cache.double() * k_scale
        self.v_read = self.v_cache.double() * v_scale
        self.q = torch.randn(sum(n for n, _ in self.seqs), NUM_QO_HEADS, head_dim, generator=gen,
                             device="cuda").to(torch.bfloat16)
        self.sinks = (torch.randn(NUM_QO_HEADS, generator=gen, device="cuda") * 2 + 3).float()
        qo, kv_ind, last = [0], [0], []
        for (n, kv), pages in zip(self.seqs, pages_per):
            qo.append(qo[-1] + n)
            kv_ind.append(kv_ind[-1] + pages)
            last.append(kv - (pages - 1) * page_size)
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32)
        self.kv_indptr = torch.tensor(kv_ind, dtype=torch.int32)
        self.last_page_len = torch.tensor(last, dtype=torch.int32)
        self.kv_indices = order
        self.kv_dtype = kv_dtype

    def request_kv(self, index, which):
        """float64 [kv_len, Hkv, D] of request ``index`` as a correct read sees it."""
        cache = self.k_read if which == "k" else self.v_read
        start, end = int(self.kv_indptr[index]), int(self.kv_indptr[index + 1])
        pages = cache[self.kv_indices[start:end].long()]
        return pages.reshape(-1, NUM_KV_HEADS, self.head_dim)[: self.seqs[index][1]]

    def reference(self, sm_scale, window_left=-1, sinks=True):
        import torch

        outs = []
        for i, (n, _) in enumerate(self.seqs):
            q = self.q[int(self.qo_indptr[i]):int(self.qo_indptr[i + 1])]
            outs.append(reference(q, self.request_kv(i, "k"), self.request_kv(i, "v"), sm_scale,
                                  window_left=window_left, sinks=self.sinks if sinks else None))
        return torch.cat(outs)

    def plan(self, wrapper, sm_scale, window_left, q_dtype=None, kv_dtype=None):
        """``plan()`` as vLLM's FlashInfer metadata builder calls it for a prefill."""
        import torch

        wrapper.plan(
            qo_indptr=self.qo_indptr,
            paged_kv_indptr=self.kv_indptr,
            paged_kv_indices=self.kv_indices,
            paged_kv_last_page_len=self.last_page_len,
            num_qo_heads=NUM_QO_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim_qk=self.head_dim,
            page_size=self.page_size,
            causal=True,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=None,
            q_data_type=q_dtype or torch.bfloat16,
            kv_data_type=kv_dtype or self.kv_dtype,
            o_data_type=torch.bfloat16,
        )


# --- (a) sink-aware prefill: vLLM's pre-fix path against flashfix's --------------------------


class _VllmImplStandIn:
    """The part of vLLM's ``FlashInferImpl`` that the sink-prefill patch rewrites: its
    ``forward`` holds the pre-fix prefill call statement exactly as vLLM had it."""

    def __init__(self, scale, sinks):
        self.scale = scale
        self.sinks = sinks

    def forward(self, layer, prefill_wrapper, prefill_query, kv_cache_for_fi, out_prefill, kv_cache_sf):
        prefill_wrapper.run(prefill_query, kv_cache_for_fi, q_scale=layer._q_scale_float, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, out=out_prefill, kv_cache_sf=kv_cache_sf, sinks=self.sinks)
        return out_prefill


def _twin(original):
    """A copy of the function ``original``, to be patched in its place (the patch ids loaded)."""
    from flashfix.core import registry as _registry

    _registry.load_all()  # the patch ids must be known for its run markers
    twin = types.FunctionType(original.__code__, original.__globals__, original.__name__, original.__defaults__,
                              original.__closure__)
    twin.__qualname__ = original.__qualname__
    return twin


def _rewritten_copy(original, edit, patch_id="vllm-sink-prefill"):
    """A copy of ``original`` with a patch's edit (a declaration's hunk) applied through the
    registry's rewrite, as the patch does to the engine's own function."""
    from flashfix.core import registry as _registry

    twin = _twin(original)
    _registry.rewrite(twin, edit, patch_id).apply()
    return twin


def _fixed_vllm_forward():
    """The stand-in ``forward`` with the forward hunk of flashfix's declaration, as the runtime edits it."""
    from flashfix import vllm_patch

    return _rewritten_copy(_VllmImplStandIn.forward, vllm_patch.SINK_PREFILL.rule.hunks[1].edit)


_STAND_IN_BACKEND = "auto"  # the generic wrapper's backend in the stand-in factory (set per check)


def _prefix_vllm_factory(self, causal=True):
    """vLLM's pre-fix ``FlashInferMetadataBuilder._get_prefill_wrapper``, reduced to its two
    constructions of the generic wrapper (the statements flashfix's factory edit rewrites)."""
    if causal:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(), get_kv_cache_layout(), backend=_STAND_IN_BACKEND)
        return self._prefill_wrapper
    if self._noncausal_prefill_wrapper is None:
        self._noncausal_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(), get_kv_cache_layout(), backend=_STAND_IN_BACKEND)
    return self._noncausal_prefill_wrapper


# The GPU test that vLLM's pre-fix ``supports_sink`` admits sinks with (SM12x); the stand-in
# ``current_platform`` below answers it as an SM12x GPU would, on any GPU.
SINK_GPUS = "current_platform.is_device_capability_family(120)"


_fixed_factory = []


def _fixed_vllm_factory():
    """The stand-in factory with the factory hunk of flashfix's declaration (``$GPUS`` as below), made once
    per process (it reads its classes from the module globals at each call)."""
    import ast
    import functools

    from flashfix import vllm_patch

    if not _fixed_factory:
        edit = functools.partial(vllm_patch.SINK_PREFILL.rule.hunks[0].edit, given={
            "GPUS": ast.parse(SINK_GPUS, mode="eval").body})
        _fixed_factory.append(_rewritten_copy(_prefix_vllm_factory, edit))
    return _fixed_factory[0]


def _vllm_stand_ins(backend, window_left, workspace_for, sink_cls=None, generic_cls=None):
    """(pre-fix ``_get_prefill_wrapper``, flashfix's factory, builder) for a layer group with sinks.
    The factories' module globals (the wrapper classes, the platform and the layout) are set
    here: FlashInfer's classes by default, the sink wrapper forced to ``backend``."""
    import torch

    if sink_cls is None or generic_cls is None:
        import flashinfer

        sink_cls, generic_cls = flashinfer.BatchAttentionWithAttentionSinkWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper

    if backend == "auto":
        sink_for_module = sink_cls
    else:  # what an SM12x GPU gets: fa2 (the factory itself always asks for "auto")
        class sink_for_module(sink_cls):
            def __init__(self, *args, **kwargs):
                kwargs["backend"] = backend
                super().__init__(*args, **kwargs)

    globals().update({
        SINK: sink_for_module,  # the name part C of the patch adds to vLLM's module
        "BatchPrefillWithPagedKVCacheWrapper": generic_cls,
        "current_platform": types.SimpleNamespace(is_device_capability_family=lambda family: family == 120),
        "get_kv_cache_layout": lambda: "NHD",
        "_STAND_IN_BACKEND": backend,
    })

    def builder():
        return types.SimpleNamespace(
            has_sinks=True, use_dcp=False, is_kvcache_nvfp4=False, q_data_type_prefill=torch.bfloat16,
            kv_cache_dtype=torch.bfloat16, head_dim=HEAD_DIM, window_left=window_left, _prefill_wrapper=None,
            _noncausal_prefill_wrapper=None, _get_workspace_buffer=workspace_for)

    return _prefix_vllm_factory, _fixed_vllm_factory(), builder


def sink_prefill(backend="auto", cases=SINK_CASES, timed=TIMED_CASE, seed=0, log=None):
    """Rows ``{case, backend, wrapper_*, err_prefix_fix, err_flashfix, err_prefix_fix_vs_no_sinks, ...}``."""
    import torch

    sm_scale = 1.0 / math.sqrt(HEAD_DIM)
    layer = types.SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0, _v_scale_float=1.0)
    fixed_forward = _fixed_vllm_forward()
    rows = []
    for case_index, (name, seqs, window_left) in enumerate(cases):
        t0 = time.time()
        batch = PagedBatch(seqs, seed=seed + case_index)
        impl = _VllmImplStandIn(sm_scale, batch.sinks)
        workspaces = []

        def workspace_for():
            workspaces.append(_workspace())
            return workspaces[-1]

        original, factory, make_builder = _vllm_stand_ins(backend, window_left, workspace_for)
        kv = (batch.k_cache, batch.v_cache)
        ref = batch.reference(sm_scale, window_left)
        ref_no_sinks = batch.reference(sm_scale, window_left, sinks=False)

        old_builder = make_builder()
        old_wrapper = original(old_builder, causal=True)
        batch.plan(old_wrapper, sm_scale, window_left)
        out_old = torch.empty_like(batch.q)

        def run_old():
            _VllmImplStandIn.forward(impl, layer, old_wrapper, batch.q, kv, out_old, None)

        run_old()
        new_builder = make_builder()
        new_wrapper = factory(new_builder, causal=True)
        batch.plan(new_wrapper, sm_scale, window_left)
        out_new = torch.empty_like(batch.q)

        def run_new():
            fixed_forward(impl, layer, new_wrapper, batch.q, kv, out_new, None)

        run_new()
        torch.cuda.synchronize()
        row = {
            "case": name, "backend": backend, "window_left": window_left,
            "seqs": [list(s) for s in seqs],
            "wrapper_pre_fix": type(old_wrapper).__name__,
            "wrapper_flashfix": (SINK if isinstance(new_wrapper, globals()[SINK]) else type(new_wrapper).__name__),
            "kernel_backend_pre_fix": getattr(old_wrapper, "_backend", None),
            "kernel_backend_flashfix": getattr(new_wrapper, "_backend", None),
            "err_pre_fix": rel_l2(out_old, ref),
            "err_flashfix": rel_l2(out_new, ref),
            "err_pre_fix_vs_no_sinks": rel_l2(out_old, ref_no_sinks),
            "nan_flashfix": nan_fraction(out_new),
        }
        if name == timed:
            row["ms_pre_fix"] = time_ms(run_old)
            row["ms_flashfix"] = time_ms(run_new)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        if log:
            log(row)
        del old_wrapper, new_wrapper, workspaces[:]
    return rows


# --- (b) FP8 paged read with scales on SGLang's ragged + paged prefill ------------------------


class _SglangBackendStandIn:
    """The part of SGLang's ``FlashInferAttnBackend.forward_extend`` that the FP8 patch
    rewrites: the paged-only call (which passes the scales) and the ragged + paged split
    (whose paged ``forward_return_lse`` does not), merged as SGLang merges them."""

    def __init__(self, prefill_wrapper_ragged, prefill_wrapper_paged):
        self.prefill_wrapper_ragged = prefill_wrapper_ragged
        self.prefill_wrapper_paged = prefill_wrapper_paged

    def forward_extend(self, q, k, v, layer, kv_cache, use_ragged):
        prefill_wrapper_paged = self.prefill_wrapper_paged
        if not use_ragged:
            return prefill_wrapper_paged.forward(q, kv_cache, causal=True, sm_scale=layer.scaling, k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)
        o1, s1 = self.prefill_wrapper_ragged.forward_return_lse(q, k, v, causal=True, sm_scale=layer.scaling)
        o2, s2 = prefill_wrapper_paged.forward_return_lse(q, kv_cache, causal=False, sm_scale=layer.scaling)
        o, _ = merge_state(o1, s1, o2, s2)
        return o


def _fixed_sglang_forward_extend():
    """A subclass of the stand-in whose ``forward_extend`` has the FP8 declaration's own edit."""
    from flashfix import sglang_patch

    patch = sglang_patch.FP8_KV_SCALES
    twin = _rewritten_copy(_SglangBackendStandIn.forward_extend, patch.rule.hunks[0].edit, patch.id)
    return type("FlashInferAttnBackendTwin", (_SglangBackendStandIn,), {"forward_extend": twin})


def fp8_paged(requests=FP8_REQUESTS, k_scale=K_SCALE, v_scale=V_SCALE, kv_dtype=None, seed=0, log=None):
    """Rows for the ragged + paged extend over an FP8 cache: pre-fix (no scales) and flashfix."""
    import torch
    import flashinfer
    from flashinfer.cascade import merge_state as fi_merge_state

    kv_dtype = kv_dtype or torch.float8_e4m3fn
    globals()["merge_state"] = fi_merge_state
    sm_scale = 1.0 / math.sqrt(HEAD_DIM)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # the cached prefix: page size 1 as SGLang's FlashInfer backend uses
    prefix = PagedBatch([(1, p) for p, _ in requests], kv_dtype=kv_dtype, page_size=1, seed=seed,
                        k_scale=k_scale, v_scale=v_scale)
    new_lens = [n for _, n in requests]
    total_new = sum(new_lens)
    q = torch.randn(total_new, NUM_QO_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    k_new = torch.randn(total_new, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(total_new, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(new_lens)), dtype=torch.int32)

    refs = []
    for i in range(len(requests)):
        a, b = int(qo_indptr[i]), int(qo_indptr[i + 1])
        k_all = torch.cat([prefix.request_kv(i, "k"), k_new[a:b].double()])
        v_all = torch.cat([prefix.request_kv(i, "v"), v_new[a:b].double()])
        refs.append(reference(q[a:b], k_all, v_all, sm_scale, causal=True))
    ref = torch.cat(refs)

    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), "NHD", backend="auto")
    ragged.plan(qo_indptr, qo_indptr, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True,
                q_data_type=torch.bfloat16)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD", backend="fa2")
    paged.plan(qo_indptr, prefix.kv_indptr, prefix.kv_indices, prefix.last_page_len, NUM_QO_HEADS, NUM_KV_HEADS,
               HEAD_DIM, 1, causal=False, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    layer = types.SimpleNamespace(scaling=sm_scale, k_scale_float=k_scale, v_scale_float=v_scale)
    kv_cache = (prefix.k_cache, prefix.v_cache)

    old = _SglangBackendStandIn(ragged, paged)
    new = _fixed_sglang_forward_extend()(ragged, paged)
    out_old = old.forward_extend(q, k_new, v_new, layer, kv_cache, True)
    out_new = new.forward_extend(q, k_new, v_new, layer, kv_cache, True)
    torch.cuda.synchronize()
    row = {
        "case": "ragged+paged, %s cache, k_scale %g, v_scale %g" % (str(kv_dtype).rsplit(".", 1)[-1], k_scale, v_scale),
        "requests": [list(r) for r in requests],
        "err_pre_fix": rel_l2(out_old, ref),
        "err_flashfix": rel_l2(out_new, ref),
        "nan_pre_fix": nan_fraction(out_old),
        "ms_pre_fix": time_ms(lambda: old.forward_extend(q, k_new, v_new, layer, kv_cache, True)),
        "ms_flashfix": time_ms(lambda: new.forward_extend(q, k_new, v_new, layer, kv_cache, True)),
        "kernel_backend_ragged": getattr(ragged, "_backend", None),
        "kernel_backend_paged": getattr(paged, "_backend", None),
    }
    row["wall_s"] = round(time.time() - t0, 1)
    if log:
        log(row)
    return [row]


# --- (c) sink wrappers of different configurations in one process -----------------------------


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def sink_sequence(configs, backend="fa2", seqs=((57, 57), (300, 300), (128, 1000)), seed=0, log=None):
    """Build, plan and run one sink wrapper per ``(kv dtype name, head_dim)`` in ``configs``, in
    this process, in order; rows with each wrapper's error against float64. Meant for a fresh
    process (the collision is per process)."""
    import torch
    import flashinfer

    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    caught = _Warnings()
    logging.getLogger("flashfix").addHandler(caught)
    rows = []
    for index, (kv_name, head_dim) in enumerate(configs):
        kv_dtype = dtypes[kv_name]
        sm_scale = 1.0 / math.sqrt(head_dim)
        batch = PagedBatch(seqs, kv_dtype=kv_dtype, head_dim=head_dim, seed=seed + index)
        t0 = time.time()
        wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            _workspace(), "NHD", backend=backend, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
            head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=-1)
        build_s = time.time() - t0
        batch.plan(wrapper, sm_scale, -1)
        out = wrapper.run(batch.q, (batch.k_cache, batch.v_cache), batch.sinks, sm_scale)
        torch.cuda.synchronize()
        row = {"step": index + 1, "kv": kv_name, "head_dim": head_dim, "backend": backend,
               "err": rel_l2(out, batch.reference(sm_scale)), "nan": nan_fraction(out),
               "build_s": round(build_s, 1)}
        rows.append(row)
        if log:
            log(row)
    logging.getLogger("flashfix").removeHandler(caught)
    return {"rows": rows, "flashfix_warnings": caught.messages}


def sink_patch_state():
    """flashfix's state of the JIT-name patch in this process."""
    try:
        from flashfix.core import registry as _registry

        for row in _registry.status():
            if row["id"] == "flashinfer-sink-jit-name":
                return row["state"]
    except Exception as exc:
        return "status failed: %r" % (exc,)
    return "absent"


def markdown(rows, columns):
    """A markdown table of ``rows`` (dicts) with ``columns`` [(header, key or callable)]."""

    def cell(row, key):
        value = key(row) if callable(key) else row.get(key, "")
        if isinstance(value, float):
            if math.isinf(value):
                return "inf (NaN)"
            return "%.4g" % value
        return str(value)

    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k) for _, k in columns) + " |")
    return "\n".join(lines)


def write_json(name, payload):
    """Write ``payload`` to ``$OUT/<name>`` when OUT is set; returns the path or None."""
    import json

    out = os.environ.get("OUT")
    if not out:
        return None
    path = os.path.join(out, name)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, default=repr)
    return path


__all__ = ["environment", "sink_prefill", "fp8_paged", "sink_sequence", "reference", "rel_l2", "markdown"]
