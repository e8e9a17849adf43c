"""Numeric checks of the FlashInfer paths flashfix changes, run on the engines' own code, on a GPU,
against float64 references (``flashfix verify``). torch and FlashInfer are imported inside the
functions, never when this module loads.

``sglang_fp8`` and ``vllm_sink`` take the patched function objects of the engine (installed, or
loaded from a wheel or tree by ``EngineModuleFinder``, the engine modules it imports replaced by
stand-ins) and the original code flashfix keeps for ``revert``, build only the call's arguments
(``self``, the layer, the batch or metadata, holding what the function reads), run both on the
same inputs, count the FlashInfer calls made from the engine's file (``Calls``) and report any
stand-in the function read (``drive``: it cannot be driven). ``sink_sequence`` builds several
sink wrappers in one process (the JIT kernel-name collision). Errors are relative L2 errors of
the whole output against float64 computed from exactly the values the kernel reads.
"""

import functools
import importlib.util
import itertools
import logging
import math
import os
import sys
import time
import types

# Shapes of the checks (the shared notes' measurements use the same).
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 16, 2, 64, 16

# (name, [(new tokens, kv length), ...], window_left)
SINK_CASES = (
    ("no prefix", [(1, 1), (57, 57), (300, 300)], -1),
    ("sliding window 128", [(400, 400), (128, 1000)], 128),
)
SINK = "BatchAttentionWithAttentionSinkWrapper"

# (prefix tokens in the FP8 cache, new tokens) per request
FP8_REQUESTS = ((100, 37), (500, 128), (1000, 1), (64, 300))
K_SCALE, V_SCALE = 0.05, 0.07


# --- common -----------------------------------------------------------------------------------


def rel_l2(out, ref):
    """Relative L2 error in float64; NaN/inf in ``out`` give ``inf``."""
    import torch

    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def reference(q, k, v, sm_scale, *, window_left=-1, sinks=None):
    """float64 causal attention of one request. q [n, Hq, D], k/v [m, Hkv, D]; query i sits at
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
    allowed = key <= pos
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


def _workspace(device="cuda"):
    import torch

    return torch.empty(128 << 20 if device == "cuda" else 8, dtype=torch.uint8, device=device)


class PagedBatch:
    """A batch of requests over a paged cache (NHD, ``(k_cache, v_cache)``), pages shuffled."""

    def __init__(self, seqs, *, kv_dtype=None, page_size=PAGE_SIZE, head_dim=HEAD_DIM, seed=0,
                 k_scale=1.0, v_scale=1.0, device="cuda"):
        import torch

        kv_dtype = kv_dtype or torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(seed)
        self.seqs, self.page_size, self.head_dim = list(seqs), page_size, head_dim
        pages_per = [-(-kv // page_size) for _, kv in self.seqs]
        total_pages = sum(pages_per)
        order = torch.randperm(total_pages, generator=gen, device=device).to(torch.int32)
        shape = (total_pages, page_size, NUM_KV_HEADS, head_dim)
        true_k = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        true_v = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        # what the cache holds, and the values a correct read of it yields
        self.k_cache = (true_k / k_scale).to(kv_dtype)
        self.v_cache = (true_v / v_scale).to(kv_dtype)
        self.k_read = self.k_cache.double() * k_scale
        self.v_read = self.v_cache.double() * v_scale
        self.q = torch.randn(sum(n for n, _ in self.seqs), NUM_QO_HEADS, head_dim, generator=gen,
                             device=device).to(torch.bfloat16)
        self.sinks = (torch.randn(NUM_QO_HEADS, generator=gen, device=device) * 2 + 3).float()
        self.qo_indptr = torch.tensor([0, *itertools.accumulate(n for n, _ in self.seqs)], dtype=torch.int32)
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(pages_per)], dtype=torch.int32)
        last = [kv - (pages - 1) * page_size for (_, kv), pages in zip(self.seqs, pages_per)]
        self.last_page_len = torch.tensor(last, dtype=torch.int32)
        self.kv_indices = order
        self.kv_dtype = kv_dtype

    def request_kv(self, index, which):
        """float64 [kv_len, Hkv, D] of request ``index`` as a correct read sees it."""
        cache = self.k_read if which == "k" else self.v_read
        start, end = int(self.kv_indptr[index]), int(self.kv_indptr[index + 1])
        pages = cache[self.kv_indices[start:end].long()]
        return pages.reshape(-1, NUM_KV_HEADS, self.head_dim)[: self.seqs[index][1]]

    def reference(self, sm_scale, window_left=-1):
        import torch

        outs = []
        for i, (n, _) in enumerate(self.seqs):
            q = self.q[int(self.qo_indptr[i]):int(self.qo_indptr[i + 1])]
            outs.append(reference(q, self.request_kv(i, "k"), self.request_kv(i, "v"), sm_scale,
                                  window_left=window_left, sinks=self.sinks))
        return torch.cat(outs)

    def plan(self, wrapper, sm_scale, window_left):
        """``plan()`` as vLLM's FlashInfer metadata builder calls it for a prefill."""
        import torch

        wrapper.plan(qo_indptr=self.qo_indptr, paged_kv_indptr=self.kv_indptr, paged_kv_indices=self.kv_indices,
                     paged_kv_last_page_len=self.last_page_len, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS,
                     head_dim_qk=self.head_dim, page_size=self.page_size, causal=True, sm_scale=sm_scale,
                     window_left=window_left, logits_soft_cap=None, q_data_type=torch.bfloat16,
                     kv_data_type=self.kv_dtype, o_data_type=torch.bfloat16)


# --- the engine's own code: installed, or loaded from a wheel or tree with stand-in imports ----


class _StandIn(type):
    """The type of every stand-in: a class, so an engine class may derive from it; any
    attribute, call, subscript or ``|`` of it is another stand-in (the same one per name). Each
    use while ``_reads`` records is noted: the check says which the engine's function read."""

    def __getattr__(cls, name):
        if name.startswith("__") or not cls.__dict__.get("_stand_in"):
            raise AttributeError(name)
        _read(cls, name)
        return _stand_in("%s.%s" % (cls.__qualname__, name))

    def __call__(cls, *args, **kwargs):
        if not cls.__dict__.get("_stand_in"):
            return super().__call__(*args, **kwargs)  # an engine class derived from a stand-in
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return args[0]  # a decorator: the function as written (as a disabled debug decorator leaves it)
        _read(cls, "()")
        return _stand_in(cls.__qualname__ + "()")

    def __getitem__(cls, other):  # Generic[...] bases, X | None annotations
        return cls

    __or__ = __ror__ = __getitem__

    def __bool__(cls):
        _read(cls, "bool")
        return True


_reads = []  # while a check records: [stand-in use, ...]
_recording = []


def _read(cls, what):
    if _recording and cls.__dict__.get("_stand_in"):
        _reads.append("%s %s" % (cls.__qualname__, what))


@functools.cache
def _stand_in(name):
    return _StandIn(name.rsplit(".", 1)[-1], (), {"__qualname__": name, "_stand_in": True})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(self.__name__ + "." + name)


class EngineModuleFinder:
    """``import`` of ``target`` reads its source from ``reader`` (a wheel or tree,
    ``locate.open_path``); every other module of the engine's top package is a stand-in module
    (torch, FlashInfer and the standard library are real). Put after flashfix's finder, so the
    registry hooks the target's import as it hooks the installed engine's."""

    def __init__(self, reader, target):
        self.reader, self.target, self.top = reader, target, target.split(".")[0]
        self.found = reader.find(target)
        if self.found is None or self.found.text is None:
            raise ImportError("%s holds no source of %s" % (reader.describe(), target))

    def find_spec(self, name, path=None, target=None):
        if name == self.target:
            return importlib.util.spec_from_file_location(name, self.found.origin, loader=self)
        if name.split(".")[0] == self.top:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None if spec.name == self.target else _StandInModule(spec.name)

    def exec_module(self, module):
        if module.__name__ == self.target:
            exec(compile(self.found.text, self.found.origin, "exec"), module.__dict__)

    def get_source(self, name):
        return self.found.text if name == self.target else None


def engine_module(patch_id, path=None):
    """``(module, patch record, engine version)``: the patch's target module as the runtime
    leaves it, from the installed engine (``path`` None) or loaded from ``path`` (a wheel or
    tree, its engine imports stand-ins); the other patches of the engine are disabled."""
    from flashfix.core import locate as _locate
    from flashfix.core import registry as _registry

    patch = next(p for p in _registry.load_all() if p.id == patch_id)
    others = [p.id for p in _registry.load_all() if p.engine == patch.engine and p.id != patch_id]
    os.environ["FLASHFIX_DISABLE"] = ",".join(filter(None, [os.environ.get("FLASHFIX_DISABLE")] + others))
    del _registry._config_cache[:]
    tree = _locate.open_path(os.path.abspath(path)) if path else None  # the module's __file__ is absolute
    # the tree first, then this interpreter (its real FlashInfer, which the new code may take names from)
    reader = _locate.Composite([tree, _locate.reader()]) if path else _locate.reader()
    with _locate.reading(reader):
        (target,) = _registry.targets_of(patch)
        if path:  # after flashfix's finder, before the installed engine's
            at = next((i + 1 for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_finder", False)), 0)
            sys.meta_path.insert(at, EngineModuleFinder(tree, target))
        module = importlib.import_module(target)
    return module, _registry._records[patch_id], _locate.version(patch.engine) if not path else reader.version(patch.engine)


def live_and_original(record, qualname):
    """The engine's function as patched (the live object) and the original code flashfix keeps
    for ``revert``, as a function of its own."""
    change = next(c for c in record["changes"] if getattr(c, "func", None) is not None
                  and c.func.__qualname__ == qualname)
    f = change.func
    original = types.FunctionType(change.old, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    original.__qualname__, original.__kwdefaults__ = f.__qualname__, f.__kwdefaults__
    return f, original


class Calls:
    """Counts the FlashInfer wrapper calls made from the engine's file, with their line."""

    def __init__(self, engine_file):
        self.file, self.log = engine_file, []

    def watch(self, label, wrapper, names=("forward", "forward_return_lse", "run")):
        for name in names:
            method = getattr(wrapper, name)

            def counted(*args, _m=method, _n=name, **kwargs):
                caller = sys._getframe(1)
                if caller.f_code.co_filename == self.file:
                    self.log.append("%s.%s line %d" % (label, _n, caller.f_lineno))
                return _m(*args, **kwargs)

            wrapper.__dict__[name] = counted
        return wrapper

    def take(self):
        return [self.log.pop(0) for _ in list(self.log)]


def drive(func, args, kwargs, calls, allowed=()):
    """``func(*args, **kwargs)``: ``(output, FlashInfer calls, error)``; stand-in reads other
    than ``allowed`` (name prefixes) make it an error: the function read what verify cannot build."""
    del _reads[:]
    _recording.append(1)
    try:
        out, error = func(*args, **kwargs), None
    except Exception as exc:
        out, error = None, "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    finally:
        _recording.pop()
    unknown = sorted({r for r in _reads if not r.startswith(tuple(allowed))})
    if unknown and error is None:
        error = "cannot be driven: read stand-in(s) verify does not build: %s" % ", ".join(unknown)
    return out, calls.take(), error


def _same(a, b):
    import torch

    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))


def _pair(rows, row, run, original, live, err=None, **kw):
    """Add ``row`` with ``run(function, **kw)`` of the code as released and as patched: their
    errors against float64 (``err(output, case)``) or, for a control, whether they are bitwise
    equal; the FlashInfer calls and errors of each. Returns the released code's output."""
    t = time.time()
    (o1, c1, e1, x1), (o2, c2, e2, x2) = run(original, **kw), run(live, **kw)
    row.update(calls_pre_fix=c1, calls_flashfix=c2, error_pre_fix=e1, error_flashfix=e2, seconds=round(time.time() - t, 1))
    if err is None:
        row.update(control=True, bitwise_equal=_same(o1, o2))
    else:
        row.update(err_pre_fix=err(o1, x1), err_flashfix=err(o2, x2))
    rows.append(row)
    return o1


def _engine(patch_id, path, functions):
    """``(module, rows, head, [(live, original), ...])`` of a check; ``rows`` says why when the
    patch is not applied (then nothing can be driven)."""
    module, record, version = engine_module(patch_id, path)
    head = {"engine": patch_id.split("-")[0], "engine_version": version, "file": module.__file__,
            "state": record["state"], "reason": record["reason"]}
    if record["state"] != "applied":
        return module, [dict(head, case="not applied", error="the patch is %(state)s: %(reason)s" % record)], head, []
    pairs = [live_and_original(record, f) for f in functions]
    head.update(functions=["%s (%s:%d)" % (f, o.__code__.co_filename, o.__code__.co_firstlineno)
                           for f, (_, o) in zip(functions, pairs)])
    return module, [], head, pairs


def _revert(patch_id, rows, head, same):
    from flashfix.core import registry as _registry

    _registry.revert(patch_id)
    rows.append(dict(head, case="revert() restores the original output", control=True, bitwise_equal=same()))
    return rows


# --- sglang-fp8-kv-scales: FlashInferAttnBackend.forward_extend ---------------------------------


def sglang_fp8(path=None, head_dims=(64, 128), requests=FP8_REQUESTS, scales=(K_SCALE, V_SCALE), seed=0, fi=None):
    """SGLang's own ``forward_extend`` (patched, and as released) over an FP8 e4m3 cache with
    scales far from 1: the ragged + paged branch against float64, and the controls that must not
    change (no prefix, paged-only, scales 1.0); then ``revert()``. ``fi``: a FlashInfer stand-in
    (CPU tests), else the real one."""
    import torch

    os.environ.setdefault("SGLANG_ENABLE_TORCH_COMPILE", "0")  # set by ServerArgs before 0.5.1's module reads it
    module, rows, head, pairs = _engine("sglang-fp8-kv-scales", path, ["FlashInferAttnBackend.forward_extend"])
    if not pairs:
        return rows
    (live, original), = pairs
    device = "cuda" if fi is None else "cpu"
    if fi is None:
        import flashinfer as fi
    calls = Calls(live.__code__.co_filename)
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    prefix, whole = [p for p, _ in requests], [p + n for p, n in requests]
    qo = torch.tensor([0, *itertools.accumulate(n for _, n in requests)], dtype=torch.int32)
    for head_dim in head_dims:
        gen = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (torch.randn(qo[-1], h, head_dim, generator=gen, device=device).to(bf16)
                   for h in (NUM_QO_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))

        def run(func, scales=scales, kv_lens=prefix, use_ragged=True, no_prefix=False, floats=False):
            cache = PagedBatch([(1, n) for n in kv_lens], kv_dtype=fp8, page_size=1, head_dim=head_dim, seed=seed,
                               k_scale=scales[0], v_scale=scales[1], device=device)
            ragged = calls.watch("ragged", fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="auto"))
            ragged.plan(qo, qo, NUM_QO_HEADS, NUM_KV_HEADS, head_dim, causal=True, q_data_type=bf16)
            paged = calls.watch("paged", fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
            paged.plan(qo, cache.kv_indptr, cache.kv_indices, cache.last_page_len, NUM_QO_HEADS, NUM_KV_HEADS, head_dim,
                       1, causal=not use_ragged, q_data_type=bf16, kv_data_type=fp8)
            pool = types.SimpleNamespace(get_kv_buffer=lambda layer_id: (cache.k_cache, cache.v_cache))
            # self, layer and forward_batch: what forward_extend reads, 0.5.1 to 0.5.17
            backend = object.__new__(module.FlashInferAttnBackend)
            backend.__dict__.update(
                forward_metadata=types.SimpleNamespace(prefill_wrappers=[paged], use_ragged=use_ragged,
                                                       extend_no_prefix=no_prefix, multi_item_params=None),
                num_wrappers=1, prefill_wrapper_ragged=ragged, token_to_kv_pool=pool,
                prefill_uses_dequant_workspace=False, is_dllm_model=False)
            # a checkpoint's KV scales as RadixAttention holds them: 0-dim tensors (what 0.5.1's paged
            # calls pass) and, from 0.5.2, the floats k_scale_float / v_scale_float that they pass
            tensors = [s if floats else torch.tensor(s, device=device) for s in scales]
            layer = types.SimpleNamespace(
                layer_id=0, is_cross_attention=False, logit_cap=0.0, scaling=head_dim ** -0.5, sliding_window_size=-1,
                tp_q_head_num=NUM_QO_HEADS, tp_k_head_num=NUM_KV_HEADS, tp_v_head_num=NUM_KV_HEADS, head_dim=head_dim,
                attn_type=module.AttentionType.DECODER, k_scale=tensors[0], v_scale=tensors[1],
                k_scale_float=scales[0], v_scale_float=scales[1])
            batch = types.SimpleNamespace(out_cache_loc=None, token_to_kv_pool=pool)
            # AttentionType is only compared, by identity, with layer.attn_type (taken from it above)
            return drive(func, (backend, q, k, v, layer, batch), {"save_kv_cache": False}, calls,
                         allowed=[module.AttentionType.__qualname__]) + (cache,)

        def err(out, cache):
            if out is None or device == "cpu":
                return None
            ref = [reference(q[qo[i]:qo[i + 1]], torch.cat([cache.request_kv(i, "k"), k[qo[i]:qo[i + 1]].double()]),
                             torch.cat([cache.request_kv(i, "v"), v[qo[i]:qo[i + 1]].double()]), head_dim ** -0.5)
                   for i in range(len(requests))]
            return rel_l2(out, torch.cat(ref).reshape(len(q), -1))

        base = dict(head, head_dim=head_dim, requests=[list(r) for r in requests], scales=list(scales))
        released = _pair(rows, dict(base, case="ragged+paged, FP8 e4m3"), run, original, live, err)
        main = rows[-1]
        if main["error_flashfix"] and not main["error_pre_fix"]:
            # does the engine's own paged-only call, which flashfix leaves alone, fail the same way?
            same = run(original, kv_lens=whole, use_ragged=False)[2]
            if same and same.split(":")[0] == main["error_flashfix"].split(":")[0]:
                main["mismatch"] = ("engine/FlashInfer mismatch present without flashfix: the engine's own paged-only "
                                    "forward, unpatched, fails the same way (%s)" % same)
                _pair(rows, dict(base, case="ragged+paged, FP8 e4m3, layer.k_scale/v_scale as floats"), run, original,
                      live, err, floats=True)
        for name, kw in (("no prefix", dict(no_prefix=True)), ("paged-only", dict(kv_lens=whole, use_ragged=False)),
                         ("scales 1.0", dict(scales=(1.0, 1.0)))):
            _pair(rows, dict(base, case="control: " + name), run, original, live, **kw)
            if main.get("mismatch") and (rows[-1]["error_flashfix"] or rows[-1]["error_pre_fix"] or "").split(":")[0] \
                    == same.split(":")[0]:
                rows[-1]["mismatch"] = main["mismatch"]
    return _revert("sglang-fp8-kv-scales", rows, head, lambda: _same(run(live)[0], released))


# --- vllm-sink-prefill: FlashInferMetadataBuilder._get_prefill_wrapper and FlashInferImpl.forward ---


def _provided(module):
    """Module globals the check sets while it runs (restored after): the GPU vLLM's gates ask
    about (answered per run), and where the module was loaded with stand-in imports, the helpers
    the functions call, as vLLM defines them for the check's bf16 NHD cache (docs/gpu.md)."""
    import torch

    values = {"current_platform": types.SimpleNamespace(), "get_kv_cache_layout": lambda: "NHD"}
    stand_in_only = {"is_quantized_kv_cache": lambda dtype: dtype != "auto",
                     "canonicalize_singleton_dim_strides": lambda t: t,  # the check's tensors have no size-1 dim
                     "FP8_DTYPE": torch.float8_e4m3fn, "get_flashinfer_layout_string": lambda layout: "NHD"}
    values.update({k: v for k, v in stand_in_only.items() if isinstance(module.__dict__.get(k), _StandIn)})
    return {k: v for k, v in values.items() if k in module.__dict__}


def _forcing_fa2(classes):
    """Construct FlashInfer's wrappers with ``backend="fa2"`` (what SM12x runs) while the check runs."""
    saved = [(c, c.__dict__["__init__"]) for c in classes if "__init__" in c.__dict__]
    for cls, init in saved:
        def forced(self, *args, _init=init, **kwargs):
            _init(self, *args, **dict(kwargs, backend="fa2"))
        cls.__init__ = forced
    return saved


def vllm_sink(path=None, cases=("no prefix", "sliding window 128"), seed=0, fi=None):
    """vLLM's own prefill-wrapper factory and ``FlashInferImpl.forward`` (patched, and as
    released) on a paged prefill of a model with attention sinks, against float64; controls:
    no sinks, and a GPU the build serves no sinks on; then ``revert()``."""
    import torch

    module, rows, head, pairs = _engine("vllm-sink-prefill", path, [
        "FlashInferMetadataBuilder._get_prefill_wrapper", "FlashInferImpl.forward"])
    if not pairs:
        return rows
    (factory, factory_0), (forward, forward_0) = pairs
    device = "cuda" if fi is None else "cpu"
    if fi is None:
        import flashinfer as fi
    provided = _provided(module)
    saved = {k: module.__dict__[k] for k in provided}
    module.__dict__.update(provided)
    forced = _forcing_fa2([fi.BatchPrefillWithPagedKVCacheWrapper, getattr(fi, SINK)]) if device == "cuda" else []
    calls = Calls(forward.__code__.co_filename)
    if "get_kv_cache_layout" in module.__dict__:  # up to 0.28: one global layout
        layout, order = None, module.FlashInferBackend.get_kv_cache_stride_order()
    else:  # from 0.29 the builder and impl read their cache config's resolved layout
        layout = (types.SimpleNamespace(name="LBNHC", layer_view_order=(0, 2, 1, 3)) if isinstance(
            module.KVCacheLayout, _StandIn) else module.KVCacheLayout.LBNHC)
        order = layout.layer_view_order
    common = dict(cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout), window_left=None,
                  is_kvcache_nvfp4=False, nvfp4_fa2=False, nvfp4_trtllm=False)
    bf16, sm_scale = torch.bfloat16, HEAD_DIM ** -0.5
    try:
        for name, seqs, window_left in [c for c in SINK_CASES if c[0] in cases]:
            batch = PagedBatch(seqs, seed=seed, device=device)
            common["window_left"] = window_left
            # the cache as vLLM lays it out for NHD, [blocks, tokens, heads, K|V], handed to forward as
            # the view that forward's stride order turns back into it
            memory = torch.cat([batch.k_cache, batch.v_cache], dim=-1)
            kv_cache = memory.permute(*sorted(range(len(order)), key=order.__getitem__))

            def run(patched, has_sinks=True, sm12x=True):
                make, fwd = (factory, forward) if patched else (factory_0, forward_0)
                cap = 120 if sm12x else 80  # an SM12x GPU, or an Ampere one (no sink support there)
                module.current_platform.is_device_capability = lambda c: c in (cap, divmod(cap, 10))
                module.current_platform.is_device_capability_family = lambda family: family // 10 == cap // 10
                builder = object.__new__(module.FlashInferMetadataBuilder)
                builder.__dict__.update(common, has_sinks=has_sinks, use_dcp=False, q_data_type_prefill=bf16,
                                        kv_cache_dtype=bf16, head_dim=HEAD_DIM, _prefill_wrapper=None,
                                        _noncausal_prefill_wrapper=None, _workspace_buffer=_workspace(device))
                wrapper, _, error = drive(make, (builder,), {"causal": True}, calls)
                if error:
                    return None, [], error, None
                calls.watch("prefill", wrapper, names=("run",))
                batch.plan(wrapper, sm_scale, window_left)
                impl = object.__new__(module.FlashInferImpl)
                impl.__dict__.update(common, num_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                                     scale=sm_scale, sinks=batch.sinks, kv_cache_dtype="auto", logits_soft_cap=None,
                                     dcp_world_size=1, bmm1_scale=None, bmm2_scale=None, o_sf_scale=None,
                                     _nvfp4_fp8_out=None)
                layer = types.SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0, _v_scale_float=1.0,
                                              _q_scale=torch.tensor(1.0), _o_scale_float=None)
                n = len(batch.q)
                metadata = types.SimpleNamespace(
                    kv_cache_layout=layout, num_actual_tokens=n, num_decode_tokens=0, num_prefill_tokens=n,
                    num_decodes=0, num_prefills=len(seqs), use_cascade=False, cascade_wrapper=None, causal=True,
                    q_data_type_prefill=bf16, q_data_type_decode=bf16, prefill=module.FIPrefill(wrapper=wrapper),
                    decode=None)
                output = torch.empty_like(batch.q)
                _, took, error = drive(fwd, (impl, layer, batch.q, batch.q, batch.q, kv_cache, metadata, output), {},
                                       calls)
                return (output if error is None else None), ["built " + type(wrapper).__name__] + took, error, None

            def err(out, _):
                return None if out is None or device == "cpu" else rel_l2(out, batch.reference(sm_scale, window_left))

            base = dict(head, window_left=window_left, seqs=[list(s) for s in seqs])
            released = _pair(rows, dict(base, case="sink prefill, " + name), run, False, True, err)
            for label, kw in (("no sinks", dict(has_sinks=False)), ("a GPU without sink support", dict(sm12x=False))):
                _pair(rows, dict(base, case="control: %s, %s" % (label, name)), run, False, True, **kw)
        return _revert("vllm-sink-prefill", rows, head, lambda: _same(run(True)[0], released))
    finally:
        module.__dict__.update(saved)
        for cls, init in forced:
            cls.__init__ = init


# --- (c) sink wrappers of different configurations in one process -----------------------------


def sink_sequence(configs, backend="fa2", seqs=((57, 57), (300, 300), (128, 1000)), seed=0, log=None):
    """Build, plan and run one sink wrapper per ``(kv dtype name, head_dim)`` in ``configs``, in
    this process, in order; rows with each wrapper's error against float64. Meant for a fresh
    process (the collision is per process)."""
    import torch
    import flashinfer

    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    caught, messages = logging.Handler(logging.WARNING), []
    caught.emit = lambda record: messages.append(record.getMessage())
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
               "err": rel_l2(out, batch.reference(sm_scale)), "nan": float((~torch.isfinite(out.float())).float().mean()),
               "build_s": round(build_s, 1)}
        rows.append(row)
        if log:
            log(row)
    logging.getLogger("flashfix").removeHandler(caught)
    return {"rows": rows, "flashfix_warnings": messages}


__all__ = ["sglang_fp8", "vllm_sink", "sink_sequence", "reference", "rel_l2", "engine_module"]
