"""``flashfix verify``'s numeric checks, on a GPU: relative L2 error of the whole output against float64 computed
from exactly the values the kernel reads; torch and FlashInfer are imported inside the functions. Each engine check
(``sglang_fp8``, ``sglang_plan``, ``sglang_merge``, ``sglang_mla_chunk``, ``vllm_forward``, ``vllm_lse``) runs the engine's patched
functions (installed, or loaded by ``EngineModuleFinder`` with stand-in engine imports) and the code kept for
``revert`` on the same inputs, building only what the function reads; it counts the FlashInfer calls made from the
engine's file (``Calls``) and fails a function that read a stand-in (``drive``). ``sink_sequence``: sink wrappers
in one process (JIT names).
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
SINK_CASES = (("no prefix", [(1, 1), (57, 57), (300, 300)], -1), ("sliding window 128", [(400, 400), (128, 1000)], 128))

# (prefix tokens in the FP8 cache, new tokens) per request
FP8_REQUESTS = ((100, 37), (500, 128), (1000, 1), (64, 300))
K_SCALE, V_SCALE = 0.05, 0.07
SHARING_CASES = (("requests with a cached prefix", [(n, p + n) for p, n in FP8_REQUESTS], -1),)
HEADS_CASES = (("requests with a cached prefix", [(n, p + n) for p, n in FP8_REQUESTS if n > 1], -1),)  # no decode


# --- common -----------------------------------------------------------------------------------
def rel_l2(out, ref):
    """Relative L2 error in float64, ``out`` read in ``ref``'s shape; NaN/inf in ``out`` give
    ``inf``; None without an output (the run failed) or a reference (a CPU test)."""
    if out is None or ref is None:
        return None
    out = out.double().reshape(ref.shape)
    if not out.isfinite().all():
        return math.inf
    return float((out - ref).norm() / ref.norm())


def reference(q, k, v, sm_scale, *, window_left=-1, sinks=None, soft_cap=None):
    """float64 causal attention of one request, q [n, Hq, D], k/v [m, Hkv, D], query i at position m - n + i;
    ``sinks`` (natural-log logits per query head) join the softmax denominator only, as in FlashInfer;
    ``soft_cap`` > 0: logits ``soft_cap * tanh(logit / soft_cap)`` before the mask, as FlashInfer caps them."""
    import torch
    (n, hq, _), (m, hkv, _) = q.shape, k.shape
    k, v = (x.double().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * sm_scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = torch.arange(n, device=q.device)[:, None] + (m - n)
    key = torch.arange(m, device=q.device)[None, :]
    allowed = key <= pos
    if window_left >= 0:
        allowed &= pos - key <= window_left
    scores = scores.masked_fill(~allowed, -math.inf)
    # no sinks: a sink of -inf, which changes neither the maximum nor the denominator
    sink = sinks.double().view(hq, 1, 1) if sinks is not None else torch.full(
        (hq, 1, 1), -math.inf, dtype=torch.float64, device=q.device)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - top)
    return torch.einsum("hnm,mhd->nhd", weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top)), v)


def _prefix_reference(q, k, v, qo, prefix_kv, sm_scale, soft_cap=None, window_left=-1):
    """float64 causal attention, [tokens, -1], of each request's new tokens (rows ``qo[i]:qo[i + 1]``) over its
    cached prefix (``prefix_kv(i)``: float64 k, v) and themselves, logits soft-capped by ``soft_cap`` (> 0), keys
    within ``window_left`` of the query (>= 0); None on the CPU (tests' FlashInfer)."""
    import torch
    if q.device.type == "cpu":
        return None
    ref = [reference(q[a:b], torch.cat([prefix_kv(i)[0], k[a:b].double()]), torch.cat([prefix_kv(i)[1], v[a:b].double()]),
                     sm_scale, soft_cap=soft_cap, window_left=window_left) for i, (a, b) in enumerate(zip(qo.tolist(), qo[1:].tolist()))]
    return torch.cat(ref).reshape(len(q), -1)


def _args(func, **values):
    """The arguments of ``func`` after ``self`` that ``values`` names (releases name them differently)."""
    code = func.__code__
    return {n: values[n] for n in code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount] if n in values}


def _workspace(device="cuda", size=384 << 20):  # SGLang's default size
    import torch
    return torch.empty(size if device == "cuda" else 8, dtype=torch.uint8, device=device)


class PagedBatch:
    """A batch of requests over a paged cache (NHD, ``(k_cache, v_cache)``), pages shuffled."""

    def __init__(self, seqs, *, kv_dtype=None, page_size=PAGE_SIZE, head_dim=HEAD_DIM, seed=0,
                 k_scale=1.0, v_scale=1.0, device="cuda", qo_heads=NUM_QO_HEADS):
        import torch
        kv_dtype = kv_dtype or torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(seed)
        self.seqs, self.page_size, self.head_dim, self.scales = list(seqs), page_size, head_dim, (k_scale, v_scale)
        pages_per = [-(-kv // page_size) for _, kv in self.seqs]
        total_pages = sum(pages_per)
        order = torch.randperm(total_pages, generator=gen, device=device).to(torch.int32)
        shape = (total_pages, page_size, NUM_KV_HEADS, head_dim)
        true_k, true_v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) for _ in "kv")
        # what the cache holds, and the values a correct read of it yields
        self.k_cache, self.v_cache = (true_k / k_scale).to(kv_dtype), (true_v / v_scale).to(kv_dtype)
        self.k_read, self.v_read = self.k_cache.double() * k_scale, self.v_cache.double() * v_scale
        self.q = torch.randn(sum(n for n, _ in self.seqs), qo_heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
        self.sinks = (torch.randn(qo_heads, generator=gen, device=device) * 2 + 3).float()
        self.qo_indptr = torch.tensor([0, *itertools.accumulate(n for n, _ in self.seqs)], dtype=torch.int32)
        self.kv_indptr = torch.tensor([0, *itertools.accumulate(pages_per)], dtype=torch.int32)
        last = [kv - (pages - 1) * page_size for (_, kv), pages in zip(self.seqs, pages_per)]
        self.last_page_len, self.kv_indices, self.kv_dtype = torch.tensor(last, dtype=torch.int32), order, kv_dtype

    def request_kv(self, index, which):
        """float64 [kv_len, Hkv, D] of request ``index`` as a correct read sees it."""
        cache = self.k_read if which == "k" else self.v_read
        start, end = int(self.kv_indptr[index]), int(self.kv_indptr[index + 1])
        return cache[self.kv_indices[start:end].long()].reshape(-1, NUM_KV_HEADS, self.head_dim)[: self.seqs[index][1]]

    def reference(self, sm_scale, window_left=-1, sinks=True):
        import torch
        qo = self.qo_indptr.tolist()
        return torch.cat([reference(self.q[qo[i]:qo[i + 1]], self.request_kv(i, "k"), self.request_kv(i, "v"), sm_scale,
                                    window_left=window_left, sinks=self.sinks if sinks else None) for i in range(len(self.seqs))])

    def plan(self, wrapper, sm_scale, window_left):
        """``plan()`` as vLLM's FlashInfer metadata builder calls it for a prefill (bf16 queries and output)."""
        wrapper.plan(qo_indptr=self.qo_indptr, paged_kv_indptr=self.kv_indptr, paged_kv_indices=self.kv_indices, causal=True,
                     paged_kv_last_page_len=self.last_page_len, num_qo_heads=self.q.shape[1], num_kv_heads=NUM_KV_HEADS,
                     head_dim_qk=self.head_dim, page_size=self.page_size, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=None, q_data_type=self.q.dtype, kv_data_type=self.kv_dtype, o_data_type=self.q.dtype)


# --- the engine's own code: installed, or loaded from a wheel or tree with stand-in imports ----
class _StandIn(type):
    """The type of every stand-in: a class (an engine class may derive from it) whose attributes, calls,
    subscripts and ``|`` are stand-ins (one per name); each use while ``_reads`` records is noted."""

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
    """``import`` of ``target`` reads its source from ``reader`` (``locate.open_path``), as does each module of
    ``real`` the reader holds (engine kernels a check runs, which import no other engine module); every other
    module of the engine's top package is a stand-in. Put after flashfix's finder, so the registry hooks the
    target's import as it hooks the installed engine's."""

    def __init__(self, reader, target, real=()):
        self.reader, self.target, self.top = reader, target, target.split(".")[0]
        self.found = {name: found for name in (target,) + tuple(real) for found in [reader.find(name)]
                      if found is not None and found.text is not None}
        if target not in self.found:
            raise ImportError("%s holds no source of %s" % (reader.describe(), target))

    def find_spec(self, name, path=None, target=None):
        if name in self.found:
            return importlib.util.spec_from_file_location(name, self.found[name].origin, loader=self)
        if name.split(".")[0] == self.top:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None if spec.name in self.found else _StandInModule(spec.name)

    def exec_module(self, module):
        if module.__name__ in self.found:
            found = self.found[module.__name__]
            exec(compile(found.text, found.origin, "exec"), module.__dict__)

    def get_source(self, name):
        return self.found[name].text if name in self.found else None


def engine_module(patch_id, path=None, real=()):
    """``(module, patch record, engine version)``: the patch's target module as the runtime leaves it, installed
    or loaded from ``path`` (a wheel or tree, with stand-in engine imports but ``real``'s); the engine's other
    patches disabled, except those before it in the series of a function it rewrites (it is judged on their code)."""
    from flashfix.core import locate as _locate, paths as _paths
    from flashfix.core import registry as _registry
    patches = _registry.load_all()
    patch = next(p for p in patches if p.id == patch_id)
    mine = _registry._declared_functions(patch)
    before = {p.id for p in patches[:patches.index(patch)] if mine & _registry._declared_functions(p)}
    others = [p.id for p in patches if p.engine == patch.engine and p.id != patch_id and p.id not in before]
    os.environ["FLASHFIX_DISABLE"] = ",".join(filter(None, [os.environ.get("FLASHFIX_DISABLE")] + others))
    os.environ.setdefault("SGLANG_ENABLE_TORCH_COMPILE", "0")  # set by ServerArgs before SGLang 0.5.1's module reads it
    del _registry._config_cache[:]
    tree = _paths.open_path(os.path.abspath(path)) if path else None  # the module's __file__ is absolute
    # the tree first, then this interpreter (its real FlashInfer, which the new code may take names from)
    reader = _paths.Composite([tree, _locate.reader()]) if path else _locate.reader()
    with _locate.reading(reader):
        (target,) = _registry.targets_of(patch)
        if path:  # after flashfix's finder, before the installed engine's
            at = next((i + 1 for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_finder", False)), 0)
            sys.meta_path.insert(at, EngineModuleFinder(tree, target, real))
        module = importlib.import_module(target)
    return module, _registry._records[patch_id], _locate.version(patch.engine) if not path else reader.version(patch.engine)


class Calls:
    """Counts the FlashInfer wrapper calls made from the engine's file, with their line."""

    def __init__(self, engine_file):
        self.file, self.log = engine_file, []

    def watch(self, label, wrapper, names=("forward", "forward_return_lse", "run")):
        for name in names:
            def counted(*args, _m=getattr(wrapper, name), _n=name, **kwargs):
                caller = sys._getframe(1)
                if caller.f_code.co_filename == self.file:
                    self.log.append("%s.%s line %d" % (label, _n, caller.f_lineno))
                return _m(*args, **kwargs)

            wrapper.__dict__[name] = counted
        return wrapper


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
    taken, calls.log = calls.log, []
    return out, taken, error


def _same(a, b):  # two runs' (output, FlashInfer calls, error, ...): bitwise equal outputs, or the same error
    return a[0].equal(b[0]) if a[0] is not None and b[0] is not None else a[0] is b[0] is None and a[2] == b[2]


def _pair(rows, row, run, original, live, err=None, controls=(), **kw):
    """Add ``row`` with ``run(function, **kw)`` of the code as released and as patched: the FlashInfer
    calls and errors of each, and the errors against float64 (``err(output, *what run gave after its
    error)``) or, for a control, whether they are bitwise equal; then a row per control ``(name, kw)``.
    Returns what the released code's run gave."""
    t, base = time.time(), dict(row)
    (o1, c1, e1, *x1), (o2, c2, e2, *x2) = r1, r2 = run(original, **kw), run(live, **kw)
    row.update(calls_pre_fix=c1, calls_flashfix=c2, error_pre_fix=e1, error_flashfix=e2, seconds=round(time.time() - t, 1),
               bitwise_equal=_same(r1, r2))
    if err is None:
        row.update(control=True)
    else:
        row.update(err_pre_fix=err(o1, *x1), err_flashfix=err(o2, *x2))
    rows.append(row)
    for name, ckw in controls:
        _pair(rows, dict(base, case="control: " + name), run, original, live, **ckw)
    return r1


def _engine(patch_id, path, functions, fi, real=()):
    """``(module, rows, head, [(live, original), ...], FlashInfer, device)`` of a check (``rows`` says why when
    the patch is not applied); ``fi``: a FlashInfer stand-in (CPU tests, device "cpu"), else the real one. A name
    of ``functions`` is a rewritten function (its qualified name holds it) or a global the patch rebinds."""
    module, record, version = engine_module(patch_id, path, real)
    head = {"engine": patch_id.split("-")[0], "engine_version": version, "file": module.__file__,
            "state": record["state"], "reason": record["reason"]}
    if record["state"] != "applied":
        return module, [dict(head, case="not applied", error="the patch is %(state)s: %(reason)s" % record)], head, [], fi, ""
    pairs = []
    for name in functions:  # the function whose qualified name holds ``name``: live, and the code kept for ``revert``
        rebound = [(c.value, c.old) for c in record["changes"] if getattr(c, "name", None) == name]
        if rebound:  # a global the patch rebinds: its value, and the engine's own (the engine module's file)
            pairs.append(rebound[0])
            continue
        f, old = next((c.func, c.old) for c in record["changes"] if name in getattr(getattr(c, "func", None), "__qualname__", ""))
        pairs.append((f, types.FunctionType(old, f.__globals__, f.__name__, f.__defaults__, f.__closure__)))
        pairs[-1][1].__qualname__, pairs[-1][1].__kwdefaults__ = f.__qualname__, f.__kwdefaults__
    code = lambda o: getattr(o, "__code__", None) or getattr(getattr(o, "__wrapped__", None), "__code__", None)  # noqa: E731
    head.update(functions=["%s (%s:%s)" % (o.__qualname__, getattr(code(o), "co_filename", "?"),
                                           getattr(code(o), "co_firstlineno", "?")) for _, o in pairs])
    return module, [], head, pairs, importlib.import_module("flashinfer") if fi is None else fi, "cuda" if fi is None else "cpu"


def _revert(patch_id, rows, head, same):
    from flashfix.core import registry as _registry
    _registry.revert(patch_id)
    rows.append(dict(head, case="revert() restores the original output", control=True, bitwise_equal=same()))
    return rows


# --- sglang-fp8-kv-scales: FlashInferAttnBackend.forward_extend ---------------------------------
def _extend(module, func, calls, wrappers, ragged, cache, q, k, v, use_ragged, no_prefix=False, scales=(1.0, 1.0),
            tensors=(1.0, 1.0), heads=NUM_QO_HEADS, cross=None, logit_cap=0.0, window=-1, attn_type="DECODER"):
    """SGLang's ``forward_extend`` (``forward_decode``) driven with ``self``, ``layer`` and ``forward_batch`` holding
    what it reads, 0.5.1 to 0.5.20: a decoder layer (two wrappers: a sliding-window backend's full-attention layer;
    ``cross`` not None: a cross-attention backend's cross or self-attention layer), the KV pool's buffer ``cache``;
    ``logit_cap``: the layer's attention logit soft cap (RadixAttention's, 0.0: none); ``window``: a sliding-window
    layer's ``sliding_window_size`` (-1: a full-attention layer); ``attn_type``: the layer's ``AttentionType``."""
    pool = types.SimpleNamespace(get_kv_buffer=lambda layer_id: (cache.k_cache, cache.v_cache))
    backend = object.__new__(module.FlashInferAttnBackend)
    backend.__dict__.update(
        forward_metadata=types.SimpleNamespace(prefill_wrappers=wrappers, use_ragged=use_ragged, extend_no_prefix=no_prefix,
                                               multi_item_params=None, decode_wrappers=wrappers),
        num_wrappers=len(wrappers), prefill_wrapper_ragged=ragged, token_to_kv_pool=pool,
        prefill_uses_dequant_workspace=False, decode_uses_dequant_workspace=False, is_dllm_model=False)
    if len(wrappers) > 1:
        backend.dispatch_reason = getattr(module.WrapperDispatch, "SLIDING_WINDOW" if cross is None else "CROSS_ATTENTION")
    head_dim = cache.head_dim
    layer = types.SimpleNamespace(
        layer_id=0, is_cross_attention=bool(cross), logit_cap=logit_cap, scaling=head_dim ** -0.5, sliding_window_size=window,
        tp_q_head_num=heads, tp_k_head_num=NUM_KV_HEADS, tp_v_head_num=NUM_KV_HEADS, head_dim=head_dim,
        attn_type=getattr(module.AttentionType, attn_type), k_scale=tensors[0], v_scale=tensors[1],
        k_scale_float=scales[0], v_scale_float=scales[1])
    batch = types.SimpleNamespace(out_cache_loc=None, encoder_out_cache_loc=None, token_to_kv_pool=pool)
    # AttentionType is only compared, by identity, with layer.attn_type (taken from it above)
    return drive(func, (backend, q, k, v, layer, batch), {"save_kv_cache": False}, calls,
                 allowed=[module.AttentionType.__qualname__])


def sglang_fp8(path=None, head_dims=(64, 128), requests=FP8_REQUESTS, scales=(K_SCALE, V_SCALE), seed=0, fi=None):
    """SGLang's own ``forward_extend`` (patched, and as released) over an FP8 e4m3 cache with scales far
    from 1: the ragged + paged branch against float64, and the controls that must not change (no
    prefix, paged-only, scales 1.0); then ``revert()``."""
    import torch
    module, rows, head, pairs, fi, device = _engine("sglang-fp8-kv-scales", path, ["FlashInferAttnBackend.forward_extend"], fi)
    if not pairs:
        return rows
    (live, original), = pairs
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
            # a checkpoint's KV scales as RadixAttention holds them: 0-dim tensors (what 0.5.1's paged
            # calls pass) and, from 0.5.2, the floats k_scale_float / v_scale_float that they pass
            tensors = [s if floats else torch.tensor(s, device=device) for s in scales]
            return _extend(module, func, calls, [paged], ragged, cache, q, k, v, use_ragged, no_prefix, scales, tensors) + (cache,)

        def err(out, cache):
            return rel_l2(out, _prefix_reference(q, k, v, qo, lambda i: (cache.request_kv(i, "k"), cache.request_kv(
                i, "v")), head_dim ** -0.5))

        base = dict(head, head_dim=head_dim, requests=[list(r) for r in requests], scales=list(scales))
        released = _pair(rows, dict(base, case="ragged+paged, FP8 e4m3"), run, original, live, err, [("no prefix", dict(
            no_prefix=True)), ("paged-only", dict(kv_lens=whole, use_ragged=False)), ("scales 1.0", dict(scales=(1.0, 1.0)))])
        main = rows[-4]
        if main["error_flashfix"] and not main["error_pre_fix"]:
            # does the engine's own paged-only call, which flashfix leaves alone, fail the same way?
            same = run(original, kv_lens=whole, use_ragged=False)[2]
            if same and same.split(":")[0] == main["error_flashfix"].split(":")[0]:
                for r in [main] + [r for r in rows[-3:] if (r["error_flashfix"] or r["error_pre_fix"] or "").split(":")[0]
                                   == same.split(":")[0]]:
                    r["mismatch"] = ("engine/FlashInfer mismatch present without flashfix: the engine's own paged-only "
                                     "forward, unpatched, fails the same way (%s)" % same)
                _pair(rows, dict(base, case="ragged+paged, FP8 e4m3, layer.k_scale/v_scale as floats"), run, original,
                      live, err, floats=True)
    return _revert("sglang-fp8-kv-scales", rows, head, lambda: _same(run(live), released))


# --- sglang-merge-state-*: the merge of forward_extend's ragged and paged parts --------------------------
MERGE_TRITON = ("sglang.srt.layers.attention.triton_ops.merge_state", "sglang.kernels.ops.attention.merge_state")


def _triton_merge_ln(v_a, s_a, v_b, s_b, output=None, output_lse=None):
    """SGLang's ``merge_state_triton`` as its Triton kernel computes it (natural-log LSEs, max-subtracted),
    written in torch: where no GPU runs the kernel (CPU tests)."""
    import torch
    top = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - top), torch.exp(s_b - top)
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return v.to(v_a.dtype), torch.log(w_a + w_b) + top


def _torch_triton_merge():
    """``_triton_merge_ln`` as ``merge_state_triton`` of every ``MERGE_TRITON`` module (CPU tests)."""
    for modname in MERGE_TRITON:
        sys.modules[modname] = types.ModuleType(modname)
        sys.modules[modname].merge_state_triton = _triton_merge_ln


def sglang_merge(patch_id, path=None, heads=(96, 64), head_dim=128, requests=FP8_REQUESTS, seed=0, fi=None):
    """SGLang's own merge of forward_extend's ragged (new tokens) and paged (cached prefix) outputs, as
    released and patched (0.5.1-0.5.12: the module's ``merge_state``; from 0.5.13: ``_safe_merge_state``),
    with the engine's own Triton merge (``MERGE_TRITON``, loaded for real; ``_triton_merge_ln`` with a
    FlashInfer stand-in): bf16, head_dim 128, past FlashInfer merge_state's launch limit (``heads[0]``)
    against float64, then below it (a control); then ``revert()``."""
    import torch
    name = "merge_state" if patch_id == "sglang-merge-state-launch-limit" else "_safe_merge_state"
    if fi is not None:  # a CPU test: the Triton merge's math in torch, where the engine imports it from
        _torch_triton_merge()
    module, rows, head, pairs, fi, device = _engine(patch_id, path, [name], fi, real=MERGE_TRITON)
    if not pairs:
        return rows
    (live, original), = pairs
    calls, bf16, inputs = Calls(module.__file__), torch.bfloat16, {}
    qo = torch.tensor([0, *itertools.accumulate(n for _, n in requests)], dtype=torch.int32)

    def parts(h):  # what forward_extend merges: FlashInfer's outputs and base-2 LSEs, and the float64 answer
        if h not in inputs:
            gen = torch.Generator(device=device).manual_seed(seed)
            q, k, v = (torch.randn(qo[-1], n, head_dim, generator=gen, device=device).to(bf16)
                       for n in (h, NUM_KV_HEADS, NUM_KV_HEADS))
            cache = PagedBatch([(1, p) for p, _ in requests], kv_dtype=bf16, page_size=1, head_dim=head_dim, seed=seed,
                               device=device)
            # 96 heads split over the H200's SMs need more than SGLang's default 384 MiB of fa2 scratch
            ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device, 1 << 30), "NHD", backend="auto")
            ragged.plan(qo, qo, h, NUM_KV_HEADS, head_dim, causal=True, q_data_type=bf16)
            paged = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device, 1 << 30), "NHD", backend="fa2")
            paged.plan(qo, cache.kv_indptr, cache.kv_indices, cache.last_page_len, h, NUM_KV_HEADS, head_dim, 1,
                       causal=False, q_data_type=bf16, kv_data_type=bf16)
            (o1, s1), (o2, s2) = ragged.run(q, k, v, return_lse=True), paged.run(q, (cache.k_cache, cache.v_cache),
                                                                                 return_lse=True)
            inputs[h] = (o1, s1, o2, s2), _prefix_reference(q, k, v, qo, lambda i: (
                cache.request_kv(i, "k"), cache.request_kv(i, "v")), head_dim ** -0.5)
        return inputs[h]

    def merged(func, *args):  # a failed launch stays pending in CUDA: raised here, as the engine's next launch would
        error = out = None
        try:
            out = func(*args)
        except Exception as exc:
            error = exc
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.ones(1, device=device).add_(1).item()
        except Exception as exc:
            error = error or exc
        if error is not None:
            raise error
        return out[0]

    def run(func, h=heads[0]):
        return drive(merged, (func,) + parts(h)[0], {}, calls)

    base = dict(head, head_dim=head_dim, requests=[list(r) for r in requests], kv_heads=NUM_KV_HEADS)
    released = _pair(rows, dict(base, case="ragged+paged, %d query heads (past merge_state's launch limit)" % heads[0]),
                     run, original, live, lambda out: rel_l2(out, parts(heads[0])[1]),
                     [("%d query heads (within the limit)" % h, dict(h=h)) for h in heads[1:]])
    return _revert(patch_id, rows, head, lambda: _same(run(getattr(module, name) if name == "merge_state" else live),
                                                       released))


# --- sglang-mla-chunked-prefix-lse-base: FlashInferMhaChunkKVRunner.forward and the chunk merge -----------
MLA_REQUESTS = ((300, 64), (1000, 17), (4000, 128))  # (cached prefix, new tokens) per request


def _engine_triton_merge():
    """The engine's ``merge_state_triton`` (``MERGE_TRITON``: where the release has it), else None."""
    for modname in MERGE_TRITON:
        try:
            merge = importlib.import_module(modname).merge_state_triton
        except (ImportError, AttributeError):
            continue
        if not isinstance(merge, _StandIn):
            return merge
    return None


def sglang_mla_chunk(patch_id, path=None, requests=MLA_REQUESTS, chunks=(1, 4), heads=16, seed=0, fi=None):
    """SGLang's own ``FlashInferMhaChunkKVRunner.forward``, as released and patched, on DeepSeek's MLA prefill
    shapes (MHA, qk 192, vo 128, bf16): the new tokens (ragged, causal, with LSE), then the cached prefix in
    ``chunks[0]`` chunks, merged as ``_chunked_prefix_attn_mha`` merges (chunk first) with the engine's own Triton
    merge (natural-log LSEs, as sgl_kernel's merge_state_v2), against float64; then per further chunk count, and
    a control (new tokens without LSE: bitwise equal); then ``revert()``."""
    import torch
    if fi is not None:  # a CPU test: the Triton merge's math in torch, where the engine imports it from
        _torch_triton_merge()
    module, rows, head, pairs, fi, device = _engine(patch_id, path, ["forward"], fi, real=MERGE_TRITON)
    if not pairs:
        return rows
    merge = _engine_triton_merge()
    if merge is None:
        return [dict(head, case="not run", error="the release has no merge_state_triton (%s)" % ", ".join(MERGE_TRITON))]
    (live, original), = pairs
    calls, bf16, gen = Calls(module.__file__), torch.bfloat16, torch.Generator(device=device).manual_seed(seed)
    dk, dv, sm_scale = 192, 128, 192 ** -0.5
    qo = torch.tensor([0, *itertools.accumulate(n for _, n in requests)], dtype=torch.int32)
    q, k = (torch.randn(qo[-1], heads, dk, generator=gen, device=device).to(bf16) for _ in "qk")
    v = torch.randn(qo[-1], heads, dv, generator=gen, device=device).to(bf16)
    prefix = [(torch.randn(p, heads, dk, generator=gen, device=device).to(bf16),
               torch.randn(p, heads, dv, generator=gen, device=device).to(bf16)) for p, _ in requests]
    ragged = calls.watch("new tokens", fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
    ragged.plan(qo, qo, heads, heads, dk, head_dim_vo=dv, causal=True, q_data_type=bf16)
    planned = {}

    def chunked(n):  # the prefix in n chunks per request: (wrapper, k, v) per chunk, planned as update_wrapper plans
        if n not in planned:
            planned[n] = []
            for j in range(n):
                parts = [(pk[p * j // n:p * (j + 1) // n], pv[p * j // n:p * (j + 1) // n])
                         for (pk, pv), (p, _) in zip(prefix, requests)]
                kv = torch.tensor([0, *itertools.accumulate(len(a) for a, _ in parts)], dtype=torch.int32)
                w = calls.watch("chunk %d/%d" % (j + 1, n), fi.BatchPrefillWithRaggedKVCacheWrapper(
                    _workspace(device), "NHD", backend="fa2"))
                w.begin_forward(qo_indptr=qo, kv_indptr=kv, num_qo_heads=heads, num_kv_heads=heads, head_dim_qk=dk,
                                head_dim_vo=dv, q_data_type=bf16, causal=False)
                planned[n].append((w, torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])))
        return planned[n]

    runner = object.__new__(module.FlashInferMhaChunkKVRunner)
    layer = types.SimpleNamespace(logit_cap=0.0, tp_q_head_num=heads, tp_k_head_num=heads, tp_v_head_num=heads,
                                  head_dim=dk, v_head_dim=dv, scaling=sm_scale)

    def run(func, n=chunks[0], lse=True):
        runner.__dict__.update(ragged_wrapper=ragged, chunk_ragged_wrappers=[w for w, _, _ in chunked(n)])
        batch = types.SimpleNamespace(attn_attend_prefix_cache=False, prefix_chunk_idx=-1, mha_return_lse=lse)
        out, taken, error = drive(func, (runner, q, k, v, layer, batch), {}, calls)
        if error or not lse:  # no merge: the output (0.5.1's runner returns an LSE all the same)
            return out[0] if isinstance(out, tuple) else out, taken, error
        acc, acc_lse = out
        for j, (_, kc, vc) in enumerate(chunked(n)):
            batch.attn_attend_prefix_cache, batch.prefix_chunk_idx = True, j
            part, more, error = drive(func, (runner, q, kc, vc, layer, batch), {}, calls)
            taken += more
            if error:
                return None, taken, error
            acc, acc_lse = merge(part[0], part[1], acc, acc_lse)
        return acc, taken, None

    ref = _prefix_reference(q, k, v, qo, lambda i: (prefix[i][0].double(), prefix[i][1].double()), sm_scale)
    base = dict(head, requests=[list(r) for r in requests], heads=heads, head_dim=[dk, dv])
    released = _pair(rows, dict(base, case="cached prefix in %d chunk(s) + new tokens, merged" % chunks[0]), run,
                     original, live, lambda o: rel_l2(o, ref), [("new tokens without LSE", dict(lse=False))])
    for n in chunks[1:]:
        _pair(rows, dict(base, case="cached prefix in %d chunk(s) + new tokens, merged" % n), run, original, live,
              lambda o: rel_l2(o, ref), n=n)
    return _revert(patch_id, rows, head, lambda: _same(run(live), released))


# --- vLLM's FlashInferImpl.forward: sinks (with the builder's prefill-wrapper factory), FP8 KV sharing ---
def _provide(module, always=(), stand_in_only=()):
    """Set module globals while a check runs (returns what to restore): ``always`` where the module has
    them, ``stand_in_only`` where they are stand-ins (engine helpers, as docs/gpu.md lists them)."""
    values = {k: v for k, v in dict(always).items() if k in module.__dict__}
    values.update({k: v for k, v in dict(stand_in_only).items() if isinstance(getattr(module, k, None), _StandIn)})
    saved = {k: getattr(module, k) for k in values}
    module.__dict__.update(values)
    return saved


def vllm_forward(patch_id, path=None, cases=(), seed=0, fi=None):
    """vLLM's own ``FlashInferImpl.forward`` (patched, and as released) on a paged prefill, against float64; then
    ``revert()``. Sinks, with the builder's prefill-wrapper factory (controls: no sinks, a GPU without sink support).
    FP8 KV sharing: a layer reading another's FP8 cache, uint8 as vLLM stores it (controls: a layer owning it, bf16).
    Layer heads: the builder's own ``__init__`` and ``build`` plan a group of 32-head layers of a 16-head model (control: 16)."""
    import collections
    import torch
    NS, LAYERS = types.SimpleNamespace, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    sink, heads = (patch_id == "vllm-%s" % n for n in ("sink-prefill", "layer-heads-plan"))
    module, rows, head, pairs, fi, device = _engine(patch_id, path, ["FlashInferMetadataBuilder._get_prefill_wrapper",
        "FlashInferImpl.forward", "FlashInferMetadataBuilder.__init__"][2 if heads else 0 if sink else 1:2 + heads], fi)
    if not pairs:
        return rows
    (factory, factory_0), (forward, forward_0) = pairs[0], (module.FlashInferImpl.forward,) * 2 if heads else pairs[-1]
    saved = _provide(module, {"current_platform": NS(), "get_kv_cache_layout": lambda: "NHD"} | ({  # Triton's kernel, in torch
        "_copy_page_indices_kernel": collections.defaultdict(lambda: lambda out, table, stride, indptr, **_: [out[a:b].copy_(
            table[i, :b - a]) for i, (a, b) in enumerate(zip(indptr.tolist(), indptr[1:].tolist()))])} if isinstance(
        module.__dict__.get("triton"), _StandIn) else {}), {
        "is_quantized_kv_cache": lambda dtype: dtype != "auto", "FP8_DTYPE": torch.float8_e4m3fn,
        "canonicalize_singleton_dim_strides": lambda t: t,  # the check's tensors have no size-1 dim
        "get_flashinfer_layout_string": lambda layout: "NHD", "cdiv": lambda a, b: -(-a // b), "PIN_MEMORY": False,
        "envs": NS(VLLM_BATCH_INVARIANT=False, VLLM_USE_V2_MODEL_RUNNER=False), "CUDAGraphMode": NS(FULL="FULL"),
        "KVQuantMode": NS(NONE="NONE"), "get_dcp_group": lambda: NS(world_size=1, rank_in_group=0), "is_pin_memory_available": bool,
        "split_decodes_and_prefills": lambda m, **_: (0, m.num_reqs, 0, m.num_actual_tokens),  # every request >1 token
        "can_use_trtllm_attention": lambda *a: False, "use_trtllm_attention": lambda *a, **k: False,  # SM90
        "get_per_layer_parameters": lambda *a: {}, "infer_global_hyperparameters": lambda p: NS(
            sm_scale=HEAD_DIM ** -0.5, window_left=-1, logits_soft_cap=None, has_sinks=False, has_same_window_lefts=True,
            has_same_all_params=True), "CpuGpuBuffer": lambda *size, dtype, device, **_: NS(
            cpu=(c := torch.zeros(size, dtype=dtype)), np=c.numpy(), gpu=torch.zeros(size, dtype=dtype, device=device))})
    saved_config = _provide(sys.modules["vllm.config"], *[{"get_layers_from_vllm_config": lambda config, cls, names: {  # the
        n: config.compilation_config.static_forward_context[n] for n in names}}] * 2)  # helper's; vLLM's drops non-layers
    forced = [(c, c.__dict__["__init__"]) for c in (fi.BatchPrefillWithPagedKVCacheWrapper, fi.BatchAttentionWithAttentionSinkWrapper)
              if device == "cuda" and "__init__" in c.__dict__]
    for cls, init in forced:  # FlashInfer's wrappers built with backend="fa2" (what SM12x runs) while the check runs
        cls.__init__ = lambda self, *args, _init=init, **kwargs: _init(self, *args, **dict(kwargs, backend="fa2"))
    calls = Calls(forward.__code__.co_filename)
    if "get_kv_cache_layout" in module.__dict__:  # up to 0.28: one global layout
        layout, order = None, module.FlashInferBackend.get_kv_cache_stride_order()
    else:  # from 0.29 the builder and impl read their cache config's resolved layout
        layout = (NS(name="LBNHC", layer_view_order=(0, 2, 1, 3)) if isinstance(
            module.KVCacheLayout, _StandIn) else module.KVCacheLayout.LBNHC)
        order = layout.layer_view_order
    common = dict(cache_config=NS(get_resolved_kv_cache_layout=lambda: layout, cache_dtype="auto"), window_left=None,
                  is_kvcache_nvfp4=False, nvfp4_fa2=False, nvfp4_trtllm=False)
    bf16, sm_scale = torch.bfloat16, HEAD_DIM ** -0.5
    try:
        for name, seqs, window_left in [c for c in (SINK_CASES if sink else HEADS_CASES if heads else SHARING_CASES)
                                        if not cases or c[0] in cases]:
            batches = {"auto": PagedBatch(seqs, seed=seed, device=device), "fp8": PagedBatch(
                seqs, kv_dtype=torch.float8_e4m3fn, k_scale=K_SCALE, v_scale=V_SCALE, seed=seed, device=device),
                       "wide": PagedBatch(seqs, seed=seed, device=device, qo_heads=2 * NUM_QO_HEADS)}
            common["window_left"], main = window_left, ("fp8", "auto", "wide")[sink + 2 * heads]  # main: the main case's batch

            def run(patched, has_sinks=True, sm12x=True, shared=not sink and not heads, kv=main):
                (make, fwd), batch = (factory, forward) if patched else (factory_0, forward_0), batches[kv]
                cap = 120 if sm12x else 80  # an SM12x GPU, or an Ampere one (no sink support there)
                module.current_platform.is_device_capability = lambda c: c in (cap, divmod(cap, 10))
                module.current_platform.is_device_capability_family = lambda family: family // 10 == cap // 10
                impl = object.__new__(module.FlashInferImpl)
                impl.__dict__.update(common, num_heads=batch.q.shape[1], num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                                     scale=sm_scale, sinks=batch.sinks if sink else None, kv_cache_dtype=kv.replace("wide", "auto"),
                                     bmm2_scale=None, logits_soft_cap=None, dcp_world_size=1, bmm1_scale=None, o_sf_scale=None,
                                     _nvfp4_fp8_out=None, kv_sharing_target_layer_name=LAYERS[0] if shared else None)
                n, lens = len(batch.q), torch.tensor([s for _, s in seqs], dtype=torch.int32)
                # the metadata forward reads, and (layer heads) the common metadata build reads
                metadata = NS(kv_cache_layout=layout, num_actual_tokens=n, num_decode_tokens=0, num_prefill_tokens=n, num_decodes=0,
                              num_prefills=len(seqs), use_cascade=False, cascade_wrapper=None, causal=True, decode=None, q_data_type=bf16,
                              q_data_type_prefill=bf16, q_data_type_decode=bf16, num_reqs=len(seqs), max_seq_len=int(lens.max()),
                              seq_lens_cpu=lens, seq_lens=lens.to(device), query_start_loc_cpu=batch.qo_indptr, slot_mapping=None,
                              query_start_loc=batch.qo_indptr.to(device), block_table_tensor=torch.nn.utils.rnn.pad_sequence(
                                  batch.kv_indices.split(batch.kv_indptr.diff().tolist()), batch_first=True))
                wrapper, took = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"), []
                if heads:  # a 16-head model's KV-cache group of ``impl``'s layers: the engine builds and plans it
                    config = NS(model_config=NS(max_model_len=4096, dtype=bf16, get_num_attention_heads=lambda p: NUM_QO_HEADS),
                                attention_config=NS(disable_flashinfer_q_quantization=False, use_trtllm_attention=None),
                                compilation_config=NS(cudagraph_mode=NS(decode_mode=lambda: None),
                                                      static_forward_context=dict.fromkeys(LAYERS, NS(impl=impl))),
                                cache_config=common["cache_config"], scheduler_config=NS(max_num_seqs=8),
                                parallel_config=NS(dcp_kv_cache_interleave_size=1, dcp_comm_backend="ag_rs"), speculative_config=None,
                                use_v2_model_runner=False)
                    spec = NS(block_size=PAGE_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=bf16,
                              kv_quant_mode=module.KVQuantMode.NONE)
                    # vLLM's AttentionMetadataBuilder where a stand-in (after it in the MRO): what it sets (no spec decode)
                    builder = object.__new__(types.new_class("Builder", (module.FlashInferMetadataBuilder, type("Base", (), {
                        "__init__": lambda self, *a: self.__dict__.update(zip(("kv_cache_spec", "layer_names", "vllm_config", "device"), a)),
                        "_init_reorder_batch_threshold": lambda self, t, **_: setattr(self, "reorder_batch_threshold", t)}))))
                    # the engine's __init__ (``make``), then its build, planning on the check's (watched) wrapper
                    metadata, took, error = drive(lambda m=metadata: make(builder, spec, list(LAYERS), config, torch.device(
                        device)) or builder.__dict__.update(_workspace_buffer=_workspace(device), _prefill_wrapper=calls.watch(
                            "prefill", wrapper, ("plan", "run"))) or builder.build(0, m), (), {}, calls)
                else:
                    builder = object.__new__(module.FlashInferMetadataBuilder)
                    builder.__dict__.update(common, has_sinks=has_sinks, use_dcp=False, q_data_type_prefill=bf16, kv_cache_dtype=bf16,
                                            head_dim=HEAD_DIM, _prefill_wrapper=None, _noncausal_prefill_wrapper=None,
                                            _workspace_buffer=_workspace(device))
                    wrapper, _, error = drive(make, (builder,), {"causal": True}, calls) if sink else (wrapper, [], None)
                    if not error:
                        calls.watch("prefill", wrapper, names=("run",))
                        batch.plan(wrapper, sm_scale, window_left)
                        metadata.prefill = module.FIPrefill(wrapper=wrapper)
                if error:
                    return None, took, error
                layer = NS(_q_scale_float=1.0, _k_scale_float=batch.scales[0], _o_scale_float=None,
                           _v_scale_float=batch.scales[1], _q_scale=torch.tensor(1.0))
                # the cache as vLLM allocates it for NHD ([blocks, 2, tokens, heads, D] to 0.27, then K|V in the last
                # dim; FP8 as uint8), handed to forward as the view that forward's stride order turns back into it
                memory = (torch.cat, torch.stack)[len(order) == 5]([batch.k_cache, batch.v_cache], 1 if len(order) == 5 else -1)
                kv_cache = memory.view(torch.uint8 if kv == "fp8" else bf16).permute(*sorted(range(len(order)), key=order.__getitem__))
                output = torch.empty_like(batch.q)
                _, more, error = drive(fwd, (impl, layer, batch.q, batch.q, batch.q, kv_cache, metadata, output), {}, calls)
                return (output if error is None else None), ["built " + type(wrapper).__name__] + took + more, error

            ref = None if device == "cpu" else batches[main].reference(sm_scale, window_left, sink)
            base = dict(head, window_left=window_left, seqs=[list(s) for s in seqs])
            controls = (("no sinks", dict(has_sinks=False)), ("a GPU without sink support", dict(sm12x=False))) if sink \
                else (("a model whose layers all have its 16 heads", dict(kv="auto")),) if heads \
                else (("a layer that owns its cache", dict(shared=False)), ("a bf16 cache", dict(kv="auto")))
            released = _pair(rows, dict(base, case=("sink prefill, " if sink else "group of 32-head layers of a 16-head model, "
                                                    if heads else "prefill, FP8 e4m3 cache of a KV-sharing layer, ") + name),
                             run, False, True, lambda o: rel_l2(o, ref), [("%s, %s" % (label, name), kw) for label, kw in controls])
        return _revert(patch_id, rows, head, lambda: _same(run(True), released))
    finally:
        module.__dict__.update(saved)
        sys.modules["vllm.config"].__dict__.update(saved_config)
        for cls, init in forced:
            cls.__init__ = init


# --- vLLM #52796: FlashInfer's base-2 LSE handed to a natural-log merge --------------------------
def _merge_ln(output, prefix, prefix_lse, suffix, suffix_lse, *_):
    """vLLM's ``merge_attn_states`` (its CUDA op and Triton kernel compute this): the two partial
    outputs weighted by their LSEs ([heads, tokens]) read as natural log, written into ``output``."""
    top = prefix_lse.maximum(suffix_lse).float()
    p, s = ((lse.float() - top).exp().T.unsqueeze(-1) for lse in (prefix_lse, suffix_lse))
    return output.copy_((prefix.float() * p + suffix.float() * s) / (p + s))


LSE_REQUESTS = ((64, 100), (2000, 128))  # (cached prefix, new tokens) per request


def vllm_lse(patch_id, path=None, requests=LSE_REQUESTS, seed=0, fi=None):
    """vLLM's own functions that hand FlashInfer's LSE to a merge (#52796), patched and as released,
    on requests with a cached prefix, merged as ``merge_attn_states`` merges, against float64; then
    ``revert()``. MLA: the new-token and context-chunk runs (control: no LSE); DCP: the wrapper's ``run``."""
    import torch
    mla = patch_id != "vllm-dcp-prefill-lse"
    module, rows, head, pairs, fi, device = _engine(patch_id, path, ["new_tokens", "context_chunk"] if mla else ["run"], fi)
    if not pairs:
        return rows
    calls, bf16, gen = Calls(pairs[0][0].__code__.co_filename), torch.bfloat16, torch.Generator(device=device).manual_seed(seed)
    qo = torch.tensor([0, *itertools.accumulate(n for _, n in requests)], dtype=torch.int32)
    # DeepSeek's MLA prefill: 16 heads, qk 192 (nope 128 + rope 64), v 128; DCP: the sink checks' shapes
    heads, kv_heads, dk, dv = (16, 16, 192, 128) if mla else (NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM)
    q, k, v = (torch.randn(qo[-1], h, d, generator=gen, device=device).to(bf16) for h, d in
               ((heads, dk), (kv_heads, dk), (kv_heads, dv)))
    sm_scale, out = dk ** -0.5, torch.empty(len(q), heads, dv, dtype=bf16, device=device)
    ragged = calls.watch("new tokens", fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
    ragged.plan(qo, qo, heads, kv_heads, dk, head_dim_vo=dv, causal=True, sm_scale=sm_scale, q_data_type=bf16)
    saved = {}
    if mla:  # the context's K/V as the MLA prefill gathers them: ragged, one chunk
        ctx = torch.tensor([0, *itertools.accumulate(p for p, _ in requests)], dtype=torch.int32)
        kc, vc = (torch.randn(ctx[-1], heads, d, generator=gen, device=device).to(bf16) for d in (dk, dv))
        chunk = calls.watch("context chunk", fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
        chunk.plan(qo, ctx, heads, heads, dk, head_dim_vo=dv, causal=False, sm_scale=sm_scale, q_data_type=bf16)
        prefix_kv = lambda i: (kc[ctx[i]:ctx[i + 1]].double(), vc[ctx[i]:ctx[i + 1]].double())
        owner = object.__new__(getattr(module, pairs[0][0].__qualname__.split(".")[0]))  # the backend, or MLACommonImpl
        prefill = object.__new__(module.__dict__.get("FlashInferPrefillMetadata") or type("M", (), {}))  # 0.20 reads it
        for o in (owner, prefill):
            o.__dict__.update(_prefill_main=ragged, _prefill_chunks=[chunk], prefill_main=ragged, prefill_chunks=[chunk])
        values = dict(prefill=prefill, chunk=types.SimpleNamespace(index=0), chunk_idx=0, q=q)

        def run(funcs, lse=True):
            (new, calls_new, e1), (old, calls_old, e2) = (drive(f, (owner,), _args(f, k=kk, v=vv, return_softmax_lse=lse,
                                                                                   **values), calls)
                                                          for f, kk, vv in zip(funcs, (k, kc), (v, vc)))
            if not lse or e1 or e2:
                return new, calls_new + calls_old, e1 or e2
            return _merge_ln(out.clone(), old[0], old[1], new[0], new[1]), calls_new + calls_old, None
    else:  # the DCP context: a paged cache holding the prefix, planned non-causal as BatchDCPPrefillWrapper.plan does
        cache = PagedBatch([(n, p) for p, n in requests], seed=seed, device=device)
        paged = calls.watch("context", fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
        paged.plan(qo, cache.kv_indptr, cache.kv_indices, cache.last_page_len, heads, kv_heads, dk, cache.page_size,
                   causal=False, sm_scale=sm_scale, q_data_type=bf16, kv_data_type=bf16)
        q, prefix_kv = cache.q, lambda i: (cache.request_kv(i, "k"), cache.request_kv(i, "v"))
        wrapper = object.__new__(module.BatchDCPPrefillWrapper)
        # world size 1: the all-gather and the LSE combine across ranks are identities
        wrapper.__dict__.update(_context=paged, _new_tokens=ragged, _dcp_combine=lambda o, lse, group, return_lse: (o, lse))
        saved = _provide(module, {"get_dcp_group": lambda: types.SimpleNamespace(all_gather=lambda t, dim: t)},
                         {"merge_attn_states": _merge_ln})
        layer = types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)

        def run(funcs):
            return drive(funcs[0], (wrapper, layer, q, (cache.k_cache, cache.v_cache), k, v, out.clone()), {}, calls)

    ref = _prefix_reference(q, k, v, qo, prefix_kv, sm_scale)
    live, original = zip(*pairs)
    base = dict(head, requests=[list(r) for r in requests], heads=[heads, kv_heads], head_dim=[dk, dv])
    try:
        released = _pair(rows, dict(base, case="cached prefix + new tokens, merged"), run, original, live,
                         lambda o: rel_l2(o, ref), [("new tokens without LSE", dict(lse=False))] if mla else ())
        return _revert(patch_id, rows, head, lambda: _same(run(live), released))
    finally:
        module.__dict__.update(saved)


# --- SGLang's planning: the prefill and decode index updaters ------------------------------------

SWA_REQUESTS, SWA_WINDOW = ((100, 37), (500, 128), (64, 300)), 128  # (cached prefix, new tokens); window
# a sliding-window layer's: new tokens within the window (the ragged pass is planned without one in every release
# this fix serves, sglang#31501), prefixes shorter and longer than it
SWA_LAYER_REQUESTS = ((100, 37), (500, 128), (300, 64), (1000, 1))
XATTN_REQUESTS = ((1601, 5), (1601, 7), (40, 3), (700, 1))  # (encoder tokens, decoder tokens)


def sglang_plan(patch_id, path=None, requests=None, window=SWA_WINDOW, head_dim=128, seed=0, fi=None):
    """SGLang's own planning (patched, and as released), then its forward, against float64; then ``revert()``.
    ``forward_extend`` of a ragged extend over a cached prefix whose extend slots hold garbage: SWA, a full-attention
    layer (control: paged-only); per-layer heads, the 32-head layer of [16, 32] (control: no per-layer counts).
    Cross-attention: ``forward_decode`` of a cross-attention layer, its decode wrappers planned as a CUDA graph's
    replay plans them, by ``fast_decode_plan`` (controls: the self-attention layer; the plan at capture).
    Paged window (sglang#31501): a sliding-window layer's paged-only extend, its new tokens' K/V in the cache, the
    updater's ``call_begin_forward`` the patch's or the release's (controls: a full-attention layer; the ragged
    extend)."""
    import collections
    import torch
    swa, cross, layer, old, paged = (patch_id == "sglang-%s" % n for n in (
        "swa-full-attn-ragged-prefix", "cross-attn-decode-plan-lens", "swa-ragged-prefix-extend-slots",
        "swa-ragged-prefix-slots-0.5.10", "swa-paged-plan-window-left"))
    layer = layer or old  # sglang#26513 (old: on 0.5.1-0.5.10, with the custom-mask parameter of call_begin_forward)
    swa = swa or layer or paged  # layer: sglang#26513, a sliding-window layer (its patch rewrites forward_extend too)
    requests = requests or (XATTN_REQUESTS if cross else SWA_LAYER_REQUESTS if layer or paged else SWA_REQUESTS)
    module, rows, head, pairs, fi, device = _engine(patch_id, path, [
        "update_sliding_window" if swa else "update_cross_attention" if cross else "Prefill.__init__"] + (
        ["forward_extend"] if layer else []) + (["Prefill.call_begin_forward"] if paged or old else []), fi)
    if not pairs:
        return rows
    # (the updater's function, the forward it is followed by), live and kept: the patch's own forward_extend where it
    # rewrites one (each run with its own), else the live forward for both
    forward = getattr(module.FlashInferAttnBackend, "forward_%s" % ("decode" if cross else "extend"))
    ((live, original), (live_forward, original_forward)) = pairs[:2] if layer else pairs[:1] + [(forward, forward)]
    planner = dict(zip(("live", "original"), pairs[-1])) if paged or old else {}  # the updater's call_begin_forward
    live, original = (live, live_forward, planner.get("live")), (original, original_forward, planner.get("original"))
    calls, bs, i32, bf16 = Calls(live[0].__code__.co_filename), len(requests), torch.int32, torch.bfloat16
    cache = PagedBatch([(1 if cross else n, p + n) for p, n in requests], page_size=1, head_dim=head_dim, seed=seed,
                       device=device)  # cross: a request's encoder slots, then its decoder's; one query token
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    heads, labels = NUM_QO_HEADS * (1 if swa or cross else 2), ("swa", "full") if swa else ("", "") if cross else ("",)
    q, k, v = (torch.randn(len(cache.q), h, head_dim, generator=gen, device=device).to(bf16)
               for h in (heads, NUM_KV_HEADS, NUM_KV_HEADS))
    prefix, new = (torch.tensor(x, dtype=i32, device=device) for x in zip(*requests))
    seq = new if cross else prefix + new  # the lengths the updater gets: cross, the decoder's (encoder_lens: prefix)
    req_to_token = torch.zeros(bs, int((prefix + new).max()), dtype=i32, device=device)
    for i, (p, _) in enumerate(requests):  # the request's slots; its extend slots hold garbage until written
        slots = cache.kv_indices[int(cache.kv_indptr[i]):int(cache.kv_indptr[i + 1])]
        req_to_token[i, :len(slots)] = slots
        if paged:  # a paged-only extend reads its new tokens' K/V from the cache: written before it runs
            rows_ = slice(int(cache.qo_indptr[i]), int(cache.qo_indptr[i + 1]))
            cache.k_cache[slots[p:].long()], cache.v_cache[slots[p:].long()] = k[rows_].unsqueeze(1), v[rows_].unsqueeze(1)
        elif not cross:
            cache.k_cache[slots[p:].long()] = cache.v_cache[slots[p:].long()] = 30.0

    def gather(table, rows, lens, indptr, start, out, *_, **__):  # SGLang's Triton kernel (page size 1), in torch
        for i, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
            s = 0 if start is None else int(start[i])
            out[int(indptr[i]):int(indptr[i]) + n] = table[r, s:s + n]

    # where the slots are read from: self.req_to_token (to 0.5.18), a KVIndexTable (0.5.19), its translator (0.5.20)
    view = types.SimpleNamespace(is_translated=False, ids=req_to_token, row_ids=torch.arange(bs, device=device),
                                 row_stride=req_to_token.shape[1], entry_page_size=1)
    table = types.SimpleNamespace(reads_are_translated=False, fill_packed_read_stream=lambda req_pool_indices, seq_lens,
                                  indptr, total_tokens, out, kv_start_idx, **_: gather(
                                      req_to_token, req_pool_indices, seq_lens, indptr, kv_start_idx, out))
    saved = _provide(module, stand_in_only={
        "create_flashinfer_kv_indices_triton": collections.defaultdict(lambda: gather), "get_attention_tp_size": lambda: 1,
        "get_parallel": lambda: types.SimpleNamespace(attn_tp_size=1),
        "get_forward_context": lambda: None})  # 0.5.10: None outside a piecewise CUDA graph
    if cross:  # the replay's plans counted: the engine's own fast_decode_plan (to 0.5.2) or FlashInfer's
        saved["fast_decode_plan"] = module.fast_decode_plan
        calls.watch("replay", module, ("fast_decode_plan",))
    cls = module.FlashInferIndicesUpdaterDecode if cross else module.FlashInferIndicesUpdaterPrefill
    # what the updater holds (SWA, cross: set here; per-layer heads: read by its own __init__ from these two)
    backend = types.SimpleNamespace(kv_index_translator=table, dq_paged_kernel_lens=None, dispatch_reason=None, page_size=1,
                                    num_wrappers=1, flashinfer_kv_cache_dtype=bf16, _swa_kv_pool=None,
                                    kv_last_page_len=torch.ones(bs, dtype=i32, device=device))
    runner = types.SimpleNamespace(kv_cache_dtype=bf16, dtype=bf16, sliding_window_size=window if swa else None,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                   token_to_kv_pool_allocator=None)

    def run(func, use_ragged=not paged, per_layer=(NUM_QO_HEADS, 2 * NUM_QO_HEADS), cross_layer=True, replay=True,
            sliding=layer or paged):
        workspace, names = _workspace(device), ("forward", "forward_return_lse", "begin_forward")
        backend.__dict__.update(kv_indptr=[torch.zeros(bs + 1, dtype=i32, device=device) for _ in labels],
                                qo_indptr=[torch.zeros(bs + 1, dtype=i32, device=device) for _ in labels],
                                prefill_wrapper_ragged=calls.watch("ragged", fi.BatchPrefillWithRaggedKVCacheWrapper(
                                    workspace, "NHD", backend="fa2"), names))
        # cross: as SGLang's CUDA-graph capture builds them; no tensor cores: the plan every release can call in FI 0.6
        wrappers = [calls.watch(n, fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=False, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=torch.zeros(len(cache.kv_indices), dtype=i32, device=device),
            paged_kv_last_page_len_buffer=backend.kv_last_page_len), names) for n, indptr in zip(
            ("decoder", "encoder"), backend.kv_indptr)] if cross else [calls.watch(
            "paged " + n, fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2"), names) for n in labels]
        runner.model_config = types.SimpleNamespace(
            num_attention_heads=NUM_QO_HEADS, head_dim=head_dim, get_num_kv_heads=lambda tp: NUM_KV_HEADS,
            hf_text_config=types.SimpleNamespace(num_attention_heads_per_layer=per_layer))
        updater = object.__new__(cls)
        if swa or cross:
            updater.__dict__.update(
                backend.__dict__, num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, data_type=bf16,
                q_data_type=bf16, sliding_window_size=window, req_to_token=req_to_token, token_to_kv_pool_allocator=None,
                attn_backend=backend, logits_soft_cap=None)  # (what sglang-flashinfer-logit-softcap-plan's __init__ sets)
            (update, extend, plan), took, error = func, [], None
            if plan is not None:  # the patch's, or the release's, planning under the release's update_sliding_window
                updater.call_begin_forward = types.MethodType(plan, updater)
        else:
            _, took, error = drive(func[0], (updater, runner, backend), {}, calls)
            update, extend = cls.update_single_wrapper, func[1]
        for step in range(2 if cross and replay else 1):  # cross: a CUDA graph's capture, then its replay
            if step:  # what capture leaves: each wrapper plans by fast_decode_plan, from lengths on the CPU
                for w in wrappers:
                    w.begin_forward = functools.partial(module.fast_decode_plan, w)
            if not error:
                _, more, error = drive(update, (updater,), _args(
                    update, req_pool_indices=torch.arange(bs, device=device), seq_lens=seq, seq_lens_cpu=seq.cpu(),
                    seq_lens_sum=int(seq.sum()), prefix_lens=prefix, prefill_wrappers=wrappers, decode_wrappers=wrappers,
                    use_ragged=use_ragged, encoder_lens=prefix if cross else None, spec_info=None,
                    extend_prefix_lens_cpu=prefix.tolist(), kv_view=view), calls)
                took += more
        if error:
            return None, took, error
        out, more, error = _extend(module, extend, calls, wrappers, backend.prefill_wrapper_ragged, cache, q,
                                   *((None, None) if cross else (k, v)), use_ragged, heads=heads,
                                   cross=cross_layer if cross else None, window=window if sliding else -1)
        return out, took + more, error

    # cross: a decode query attends to its encoder's K/V alone
    ref = _prefix_reference(q, *((k[:0], v[:0]) if cross else (k, v)), cache.qo_indptr, lambda i: tuple(
        cache.request_kv(i, x)[:requests[i][0]] for x in "kv"), head_dim ** -0.5, window_left=window if layer or paged else -1)
    base = dict(head, requests=[list(r) for r in requests], head_dim=head_dim, layer_heads=heads, window=window if swa else -1)
    case, controls = (("paged-only extend over a cached prefix, sliding-window layer", [
        ("a full-attention layer", dict(sliding=False)), ("ragged extend", dict(use_ragged=True))])) if paged else (
        ("ragged extend over a cached prefix, %s layer" % ("sliding-window" if layer else "full-attention"), [
            ("paged-only extend", dict(use_ragged=False))]) if swa else ("cross-attention decode, planned as a CUDA graph replays", [
            ("the self-attention layer", dict(cross_layer=False)), ("the plan at capture", dict(replay=False))]) if cross else (
        "ragged extend over a cached prefix, 32-head layer", [("a model without per-layer head counts", dict(per_layer=None))]))
    try:
        released = _pair(rows, dict(base, case=case), run, original, live, lambda o: rel_l2(o, ref), controls)
        return _revert(patch_id, rows, head, lambda: _same(run(live), released))
    finally:
        module.__dict__.update(saved)


# --- sglang-flashinfer-logit-softcap-plan: the indices updaters' plans, then forward_extend / forward_decode ----
SOFTCAP_REQUESTS = ((100, 37), (500, 128), (64, 300))  # (cached prefix, new tokens)
SOFTCAP_DECODE = (1000, 37, 500, 300)  # decode requests' KV lengths (one query token each)
SOFTCAP_Q_SCALE = 8.0  # queries times this: |q.k| * sm_scale reaches ~35-45, where a cap of 30 or 50 bends the logits


def sglang_softcap(patch_id, path=None, caps=(50.0, 30.0), seed=0, fi=None, requests=SOFTCAP_REQUESTS, decode=SOFTCAP_DECODE,
                   head_dim=128, q_scale=SOFTCAP_Q_SCALE, tensor_cores=(False, True)):
    """SGLang's own indices updaters (``__init__`` reading the model's cap, ``update_single_wrapper`` ->
    ``call_begin_forward`` planning; all four functions as released, or all as patched), then its ``forward_extend``
    / ``forward_decode`` with a layer whose ``logit_cap`` is the cap, against float64 capped attention; per cap:
    a ragged extend over a cached prefix, a paged-only extend, decode (CUDA-graph wrappers planned as at capture,
    then as a replay plans them, by ``fast_decode_plan``; without and with tensor cores). Controls: a model
    without a cap (logit_cap 0.0), bitwise equal; then ``revert()``."""
    import collections
    import torch
    names = ("Prefill.__init__", "Prefill.call_begin_forward", "Decode.__init__", "Decode.call_begin_forward")
    module, rows, head, pairs, fi, device = _engine(patch_id, path, list(names), fi)
    if not pairs:
        return rows
    classes = {"Prefill": module.FlashInferIndicesUpdaterPrefill, "Decode": module.FlashInferIndicesUpdaterDecode}
    slots = [(classes[n.split(".")[0]], n.split(".", 1)[1]) for n in names]
    live, original = ([p[i] for p in pairs] for i in (0, 1))
    calls, i32, bf16, sm_scale = Calls(live[0].__code__.co_filename), torch.int32, torch.bfloat16, head_dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    kinds = getattr(module, "IdSpaceKind", None)  # 0.5.23: read_kind, compared by SGLang's translator alone
    allowed = [kinds.__qualname__] if isinstance(kinds, _StandIn) else []
    watched = ("forward", "forward_return_lse", "begin_forward")

    def gather(table, rows_, lens, indptr, start, out, *_, **__):  # SGLang's Triton kernel (page size 1), in torch
        for i, (r, n) in enumerate(zip(rows_.tolist(), lens.tolist())):
            s = 0 if start is None else int(start[i])
            out[int(indptr[i]):int(indptr[i]) + n] = table[r, s:s + n]

    def batch(seqs, prefix):  # a paged cache (page size 1) and its req_to_token, and what the updater reads
        cache = PagedBatch(seqs, page_size=1, head_dim=head_dim, seed=seed, device=device)
        bs = len(seqs)
        req_to_token = torch.zeros(bs, max(kv for _, kv in seqs), dtype=i32, device=device)
        for i in range(bs):
            slots_ = cache.kv_indices[int(cache.kv_indptr[i]):int(cache.kv_indptr[i + 1])]
            req_to_token[i, :len(slots_)] = slots_
        # where the slots are read from: self.req_to_token (to 0.5.18), a KVIndexTable (0.5.19), its translator
        # (0.5.20: fill_packed_read_stream; 0.5.23: pack_read_stream with a KVLocPlan)
        fill = lambda req_pool_indices, seq_lens, indptr, out, kv_start_idx=None, **_: gather(  # noqa: E731
            req_to_token, req_pool_indices, seq_lens, indptr, kv_start_idx, out)
        table = types.SimpleNamespace(reads_are_translated=False, fill_packed_read_stream=fill,
                                      pack_read_stream=lambda plan, **kw: fill(**kw))
        view = types.SimpleNamespace(is_translated=False, ids=req_to_token, row_ids=torch.arange(bs, device=device),
                                     row_stride=req_to_token.shape[1], entry_page_size=1)
        return cache, req_to_token, table, view

    def setup(cache, req_to_token, table, cap, wrappers_of):
        bs = len(cache.seqs)
        backend = types.SimpleNamespace(
            kv_index_translator=table, dq_paged_kernel_lens=None, dispatch_reason=None, page_size=1, num_wrappers=1,
            flashinfer_kv_cache_dtype=bf16, _swa_kv_pool=None, kv_last_page_len=torch.ones(bs, dtype=i32, device=device),
            kv_indptr=[torch.zeros(bs + 1, dtype=i32, device=device)], qo_indptr=[torch.zeros(bs + 1, dtype=i32, device=device)])
        wrappers = wrappers_of(backend)
        # the model's attention layers (RadixAttention: layer_id, logit_cap), and a module that is none
        layers = [types.SimpleNamespace(layer_id=i, logit_cap=cap) for i in range(2)] + [types.SimpleNamespace()]
        runner = types.SimpleNamespace(
            kv_cache_dtype=bf16, dtype=bf16, sliding_window_size=None, token_to_kv_pool_allocator=None,
            req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
            model=types.SimpleNamespace(modules=lambda: iter(layers)),
            model_config=types.SimpleNamespace(
                num_attention_heads=NUM_QO_HEADS, head_dim=head_dim, get_num_kv_heads=lambda *_: NUM_KV_HEADS,
                get_max_num_attention_heads=lambda: NUM_QO_HEADS,
                hf_text_config=types.SimpleNamespace(num_attention_heads_per_layer=None)))
        return backend, runner, wrappers

    def update(cls, updater, backend, runner, cache, view, prefix, seq, **kw):
        _, took, error = drive(cls.__init__, (updater, runner, backend), {}, calls, allowed)
        if error:
            return took, error
        bs = len(cache.seqs)
        _, more, error = drive(cls.update_single_wrapper, (updater,), _args(
            cls.update_single_wrapper, req_pool_indices=torch.arange(bs, device=device), seq_lens=seq,
            seq_lens_cpu=seq.cpu(), seq_lens_sum=int(seq.sum()), prefix_lens=prefix, encoder_lens=None, spec_info=None,
            extend_prefix_lens_cpu=None if prefix is None else prefix.tolist(), kv_view=view, plan=None, **kw), calls, allowed)
        return took + more, error

    # prefill: new tokens' K/V in the cache too (a paged-only extend reads them there), queries scaled
    pre = batch([(n, p + n) for p, n in requests], None)
    p_cache = pre[0]
    q, k, v = (torch.randn(len(p_cache.q), NUM_QO_HEADS if x == "q" else NUM_KV_HEADS, head_dim, generator=gen,
                           device=device) * (q_scale if x == "q" else 1.0) for x in "qkv")
    q, k, v = (x.to(bf16) for x in (q, k, v))
    prefix, new = (torch.tensor(x, dtype=i32, device=device) for x in zip(*requests))
    for i, (p, _) in enumerate(requests):
        a, b = int(p_cache.qo_indptr[i]), int(p_cache.qo_indptr[i + 1])
        slots_ = p_cache.kv_indices[int(p_cache.kv_indptr[i]):int(p_cache.kv_indptr[i + 1])][p:].long()
        p_cache.k_cache[slots_], p_cache.v_cache[slots_] = k[a:b, None], v[a:b, None]
    # decode: one query token per request over its whole KV
    dec = batch([(1, n) for n in decode], None)
    d_cache = dec[0]
    dq = (torch.randn(len(decode), NUM_QO_HEADS, head_dim, generator=gen, device=device) * q_scale).to(bf16)
    d_lens = torch.tensor(decode, dtype=i32, device=device)
    no_kv = torch.empty(0, NUM_KV_HEADS, head_dim, device=device)

    def prefill(cap, use_ragged=True):
        cache, req_to_token, table, view = pre
        workspace = _workspace(device)
        ragged = calls.watch("ragged", fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa2"), watched)
        backend, runner, wrappers = setup(cache, req_to_token, table, cap, lambda b: [calls.watch(
            "paged", fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2"), watched)])
        backend.prefill_wrapper_ragged = ragged
        cls = module.FlashInferIndicesUpdaterPrefill
        took, error = update(cls, object.__new__(cls), backend, runner, cache, view, prefix, prefix + new,
                             prefill_wrappers=wrappers, use_ragged=use_ragged)
        if error:
            return None, took, error
        out, more, error = _extend(module, module.FlashInferAttnBackend.forward_extend, calls, wrappers, ragged, cache,
                                   q, k, v, use_ragged, logit_cap=cap)
        return out, took + more, error

    def decoding(cap, tc=False, replay=True):
        cache, req_to_token, table, view = dec
        workspace = _workspace(device)
        backend, runner, wrappers = setup(cache, req_to_token, table, cap, lambda b: [calls.watch(
            "decode", fi.BatchDecodeWithPagedKVCacheWrapper(  # as SGLang's CUDA-graph capture builds them
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=b.kv_indptr[0],
                paged_kv_indices_buffer=torch.zeros(len(cache.kv_indices), dtype=i32, device=device),
                paged_kv_last_page_len_buffer=b.kv_last_page_len), watched)])
        cls, took, error = module.FlashInferIndicesUpdaterDecode, [], None
        updater = object.__new__(cls)
        for step in range(2 if replay else 1):  # a CUDA graph's capture, then its replay
            if step:  # what capture leaves: each wrapper plans by fast_decode_plan
                for w in wrappers:
                    w.begin_forward = functools.partial(module.fast_decode_plan, w)
            more, error = update(cls, updater, backend, runner, cache, view, None, d_lens, decode_wrappers=wrappers)
            took += more
            if error:
                return None, took, error
        out, more, error = _extend(module, module.FlashInferAttnBackend.forward_decode, calls, wrappers, None, cache,
                                   dq, None, None, False, logit_cap=cap)
        return out, took + more, error

    def run(funcs, mode="ragged", cap=0.0, tc=False, replay=True):
        """``mode`` with the updaters' four functions ``funcs`` (as released, or as patched) in their classes."""
        kept = [(cls, attr, cls.__dict__[attr]) for cls, attr in slots]
        for (cls, attr), func in zip(slots, funcs):
            setattr(cls, attr, func)
        try:
            if mode == "decode":
                return decoding(cap, tc, replay)
            return prefill(cap, use_ragged=mode == "ragged")
        finally:
            for cls, attr, func in kept:
                setattr(cls, attr, func)

    saved = _provide(module, stand_in_only={
        "create_flashinfer_kv_indices_triton": collections.defaultdict(lambda: gather), "get_attention_tp_size": lambda: 1,
        "get_parallel": lambda: types.SimpleNamespace(attn_tp_size=1, attn_dcp_size=1),
        "get_forward_context": lambda: None})  # 0.5.10: None outside a piecewise CUDA graph
    saved["fast_decode_plan"] = module.fast_decode_plan  # the replay's plans counted: FlashInfer's (the engine's to 0.5.2)
    calls.watch("replay", module, ("fast_decode_plan",))
    p_ref = lambda cap: _prefix_reference(q, k, v, p_cache.qo_indptr, lambda i: tuple(  # noqa: E731
        p_cache.request_kv(i, x)[:requests[i][0]] for x in "kv"), sm_scale, soft_cap=cap)
    d_ref = lambda cap: _prefix_reference(dq, no_kv, no_kv, d_cache.qo_indptr, lambda i: (  # noqa: E731
        d_cache.request_kv(i, "k"), d_cache.request_kv(i, "v")), sm_scale, soft_cap=cap)
    base = dict(head, requests=[list(r) for r in requests], decode_kv_lens=list(decode), head_dim=head_dim, q_scale=q_scale)
    cases = [("ragged extend over a cached prefix", "ragged", {}, p_ref), ("paged-only extend", "paged", {}, p_ref)]
    for tc in tensor_cores:
        name = "decode%s, CUDA-graph wrappers" % (", tensor cores" if tc else "")
        cases += [(name + ", planned at capture", "decode", dict(tc=tc, replay=False), d_ref),
                  (name + ", planned as a replay plans (fast_decode_plan)", "decode", dict(tc=tc), d_ref)]
    try:
        for cap in caps:
            for name, mode, kw, ref_of in cases:
                ref = ref_of(cap)
                _pair(rows, dict(base, case="logit cap %g: %s" % (cap, name), cap=cap), run, original, live,
                      lambda o, ref=ref: rel_l2(o, ref), mode=mode, cap=cap, **kw)
        for name, mode, kw, _ in cases:
            _pair(rows, dict(base, case="control: a model without a cap, " + name, cap=0.0), run, original, live,
                  mode=mode, cap=0.0, **kw)
        released = run(original, "ragged", caps[0])
        return _revert(patch_id, rows, head, lambda: _same(run(live, "ragged", caps[0]), released))
    finally:
        module.__dict__.update(saved)


# --- (c) sink wrappers of different configurations in one process -----------------------------
def sink_sequence(configs, backend="fa2", seqs=((57, 57), (300, 300), (128, 1000)), seed=0, log=None):
    """Build, plan and run one sink wrapper per ``(kv dtype name, head_dim)`` of ``configs`` in this process,
    in order (run it in a fresh one: the collision is per process); each wrapper's error against float64."""
    import torch
    import flashinfer
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    caught, messages = logging.Handler(logging.WARNING), []
    caught.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("flashfix").addHandler(caught)
    rows = []
    for index, (kv_name, head_dim) in enumerate(configs):
        kv_dtype, sm_scale = dtypes[kv_name], 1.0 / math.sqrt(head_dim)
        batch = PagedBatch(seqs, kv_dtype=kv_dtype, head_dim=head_dim, seed=seed + index)
        t0 = time.time()
        wrapper = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            _workspace(), "NHD", backend=backend, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
            head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=-1)
        build_s = time.time() - t0
        batch.plan(wrapper, sm_scale, -1)
        out = wrapper.run(batch.q, (batch.k_cache, batch.v_cache), batch.sinks, sm_scale)
        torch.cuda.synchronize()
        rows.append({"step": index + 1, "kv": kv_name, "head_dim": head_dim, "backend": backend, "err": rel_l2(out, batch.reference(
            sm_scale)), "nan": float((~torch.isfinite(out.float())).float().mean()), "build_s": round(build_s, 1)})
        if log:
            log(rows[-1])
    logging.getLogger("flashfix").removeHandler(caught)
    return {"rows": rows, "flashfix_warnings": messages}

