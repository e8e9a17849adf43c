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


def _workspace(device="cuda"):
    import torch

    return torch.empty(WORKSPACE_BYTES if device == "cuda" else 8, dtype=torch.uint8, device=device)


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

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __bool__(cls):
        _read(cls, "bool")
        return True

    def __iter__(cls):
        _read(cls, "iter")
        return iter(())


_reads = []  # while a check records: [stand-in use, ...]
_recording = []


def _read(cls, what):
    if _recording and cls.__dict__.get("_stand_in"):
        _reads.append("%s %s" % (cls.__qualname__, what))


_stand_ins = {}


def _stand_in(name):
    if name not in _stand_ins:
        _stand_ins[name] = _StandIn(name.rsplit(".", 1)[-1], (), {"__qualname__": name, "_stand_in": True})
    return _stand_ins[name]


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
        import importlib.util

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
    import importlib
    import sys

    from flashfix.core import locate as _locate
    from flashfix.core import registry as _registry

    patch = next(p for p in _registry.load_all() if p.id == patch_id)
    others = [p.id for p in _registry.load_all() if p.engine == patch.engine and p.id != patch_id]
    os.environ["FLASHFIX_DISABLE"] = ",".join(filter(None, [os.environ.get("FLASHFIX_DISABLE")] + others))
    del _registry._config_cache[:]
    reader = _locate.open_path(path) if path else _locate.reader()
    with _locate.reading(reader):
        (target,) = _registry.targets_of(patch)
        if path:  # after flashfix's finder, before the installed engine's
            at = next((i + 1 for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_finder", False)), 0)
            sys.meta_path.insert(at, EngineModuleFinder(reader, target))
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
        import sys

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
        taken, self.log = self.log, []
        return taken


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


def _where(func):
    return "%s:%d" % (func.__code__.co_filename, func.__code__.co_firstlineno)


def _same(a, b):
    import torch

    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))


# --- sglang-fp8-kv-scales: FlashInferAttnBackend.forward_extend ---------------------------------


def sglang_fp8(path=None, head_dims=(64, 128), requests=FP8_REQUESTS, k_scale=K_SCALE, v_scale=V_SCALE, seed=0,
               fi=None):
    """SGLang's own ``forward_extend`` (patched, and as released) over an FP8 e4m3 cache with
    scales far from 1: the ragged + paged branch against float64, and the controls that must not
    change (no prefix, paged-only, scales 1.0); then ``revert()``. ``fi``: a FlashInfer stand-in
    (CPU tests), else the real one."""
    import torch

    t0 = time.time()
    os.environ.setdefault("SGLANG_ENABLE_TORCH_COMPILE", "0")  # set by ServerArgs before 0.5.1's module reads it
    module, record, version = engine_module("sglang-fp8-kv-scales", path)
    head = {"engine": "sglang", "engine_version": version, "file": module.__file__,
            "state": record["state"], "reason": record["reason"]}
    if record["state"] != "applied":
        return [dict(head, case="not applied", error="the patch is %s: %s" % (record["state"], record["reason"]))]
    live, original = live_and_original(record, "FlashInferAttnBackend.forward_extend")
    cls = getattr(module, "FlashInferAttnBackend")
    device = "cuda" if fi is None else "cpu"
    if fi is None:
        import flashinfer as fi
    calls = Calls(live.__code__.co_filename)
    rows = []
    for head_dim in head_dims:
        sm_scale = head_dim ** -0.5
        gen = torch.Generator(device=device).manual_seed(seed)
        new_lens = [n for _, n in requests]
        qo = torch.tensor([0] + list(itertools.accumulate(new_lens)), dtype=torch.int32)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

        q, k, v = rand(qo[-1], NUM_QO_HEADS, head_dim), rand(qo[-1], NUM_KV_HEADS, head_dim), rand(qo[-1], NUM_KV_HEADS, head_dim)

        def case(scales, prefix_lens, use_ragged, no_prefix, causal_paged):
            cache = PagedBatch([(1, p) for p in prefix_lens], kv_dtype=torch.float8_e4m3fn, page_size=1,
                               head_dim=head_dim, seed=seed, k_scale=scales[0], v_scale=scales[1], device=device)
            ragged = calls.watch("ragged", fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="auto"))
            ragged.plan(qo, qo, NUM_QO_HEADS, NUM_KV_HEADS, head_dim, causal=True, q_data_type=torch.bfloat16)
            paged = calls.watch("paged", fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
            paged.plan(qo, cache.kv_indptr, cache.kv_indices, cache.last_page_len, NUM_QO_HEADS, NUM_KV_HEADS,
                       head_dim, 1, causal=causal_paged, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
            pool = types.SimpleNamespace(get_kv_buffer=lambda layer_id: (cache.k_cache, cache.v_cache))
            # self, layer and forward_batch: what forward_extend reads, 0.5.1 to 0.5.17
            backend = object.__new__(cls)
            backend.__dict__.update(
                forward_metadata=types.SimpleNamespace(prefill_wrappers=[paged], use_ragged=use_ragged,
                                                       extend_no_prefix=no_prefix, multi_item_params=None),
                num_wrappers=1, prefill_wrapper_ragged=ragged, token_to_kv_pool=pool,
                prefill_uses_dequant_workspace=False, is_dllm_model=False)
            layer = types.SimpleNamespace(
                layer_id=0, is_cross_attention=False, logit_cap=0.0, scaling=sm_scale, sliding_window_size=-1,
                tp_q_head_num=NUM_QO_HEADS, tp_k_head_num=NUM_KV_HEADS, tp_v_head_num=NUM_KV_HEADS,
                head_dim=head_dim, attn_type=module.AttentionType.DECODER,
                # as RadixAttention holds a checkpoint's KV scales: a 0-dim tensor (0.5.1's k_scale)
                # and, from 0.5.2, the floats k_scale_float / v_scale_float read by the paged calls
                k_scale=torch.tensor(scales[0], device=device), v_scale=torch.tensor(scales[1], device=device),
                k_scale_float=scales[0], v_scale_float=scales[1])
            batch = types.SimpleNamespace(out_cache_loc=None, token_to_kv_pool=pool)
            return cache, (backend, q, k, v, layer, batch), {"save_kv_cache": False}

        def run(func, scales=(k_scale, v_scale), prefix=[p for p, _ in requests], use_ragged=True, no_prefix=False,
                causal_paged=False, float_scales=False):
            cache, args, kwargs = case(scales, prefix, use_ragged, no_prefix, causal_paged)
            if float_scales:
                args[4].k_scale, args[4].v_scale = scales
            # AttentionType is only compared, by identity, with layer.attn_type (set from it above)
            return drive(func, args, kwargs, calls, allowed=[module.AttentionType.__qualname__]) + (cache,)

        def reference_of(cache, paged_only=False):
            refs = []
            for i in range(len(requests)):
                a, b = int(qo[i]), int(qo[i + 1])
                ks, vs = [cache.request_kv(i, "k")], [cache.request_kv(i, "v")]
                if not paged_only:
                    ks.append(k[a:b].double())
                    vs.append(v[a:b].double())
                refs.append(reference(q[a:b], torch.cat(ks), torch.cat(vs), sm_scale, causal=True))
            return torch.cat(refs).reshape(len(q), -1)

        def err(out, cache, **kw):
            return None if out is None or device == "cpu" else rel_l2(out, reference_of(cache, **kw))

        base = dict(head, head_dim=head_dim, requests=[list(r) for r in requests], k_scale=k_scale, v_scale=v_scale,
                    function="FlashInferAttnBackend.forward_extend", line=_where(original))
        # the fix: ragged + paged
        t = time.time()
        o_old, c_old, e_old, cache = run(original)
        o_new, c_new, e_new, _ = run(live)
        row = dict(base, case="ragged+paged, FP8 e4m3", err_pre_fix=err(o_old, cache), err_flashfix=err(o_new, cache),
                   calls_pre_fix=c_old, calls_flashfix=c_new, error_pre_fix=e_old, error_flashfix=e_new,
                   seconds=round(time.time() - t, 1))
        rows.append(row)
        if e_new and not e_old:  # does the engine's own paged-only call (flashfix leaves it) fail the same way?
            e_p = run(original, prefix=[p + n for p, n in requests], use_ragged=False, causal_paged=True)[2]
            if e_p and e_p.split(":")[0] == e_new.split(":")[0]:
                row["mismatch"] = ("engine/FlashInfer mismatch present without flashfix: the engine's own paged-only "
                                   "forward, unpatched, fails the same way (%s)" % e_p)
                o1, c1, e1, _ = run(original, float_scales=True)
                o2, c2, e2, _ = run(live, float_scales=True)
                rows.append(dict(base, case="ragged+paged, FP8 e4m3, layer.k_scale/v_scale given as floats",
                                 err_pre_fix=err(o1, cache), err_flashfix=err(o2, cache), calls_pre_fix=c1,
                                 calls_flashfix=c2, error_pre_fix=e1, error_flashfix=e2))
        # controls: the fix must change nothing there
        for name, kw in (("control: no prefix", dict(no_prefix=True)),
                         ("control: paged-only", dict(prefix=[p + n for p, n in requests], use_ragged=False, causal_paged=True)),
                         ("control: scales 1.0", dict(scales=(1.0, 1.0)))):
            o1, c1, e1, _ = run(original, **kw)
            o2, c2, e2, _ = run(live, **kw)
            rows.append(dict(base, case=name, control=True, bitwise_equal=_same(o1, o2), calls_pre_fix=c1,
                             calls_flashfix=c2, error_pre_fix=e1, error_flashfix=e2))
            if row.get("mismatch") and (e1 or e2 or "").split(":")[0] == e_new.split(":")[0]:
                rows[-1]["mismatch"] = row["mismatch"]  # the same engine/FlashInfer mismatch
    from flashfix.core import registry as _registry

    _registry.revert("sglang-fp8-kv-scales")
    rows.append(dict(head, case="revert() restores the original output", control=True,
                     bitwise_equal=_same(run(live)[0], o_old)))
    for r in rows:
        r.setdefault("seconds", round(time.time() - t0, 1))
    return rows


# --- vllm-sink-prefill: FlashInferMetadataBuilder._get_prefill_wrapper and FlashInferImpl.forward ---


def _provided(module, fi):
    """Module globals the check sets while it runs (restored after): the GPU capability vLLM's
    gates ask (SM12x, always faked) and the NHD layout; where the module was loaded with stand-in
    imports, the helpers ``forward`` calls, as vLLM defines them for the check's bf16 tensors.
    docs/gpu.md says why each is faithful."""
    import torch

    values = {"current_platform": types.SimpleNamespace(is_device_capability_family=lambda family: family == 120),
              "get_kv_cache_layout": lambda: "NHD"}
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
            kwargs["backend"] = "fa2"
            _init(self, *args, **kwargs)
        cls.__init__ = forced
    return saved


def vllm_sink(path=None, cases=("no prefix", "sliding window 128"), seed=0, fi=None):
    """vLLM's own prefill-wrapper factory and ``FlashInferImpl.forward`` (patched, and as
    released) on a paged prefill of a model with attention sinks, against float64; controls:
    no sinks, and a GPU the build does not serve sinks on; then ``revert()``."""
    import torch

    t0 = time.time()
    module, record, version = engine_module("vllm-sink-prefill", path)
    head = {"engine": "vllm", "engine_version": version, "file": module.__file__, "state": record["state"],
            "reason": record["reason"]}
    if record["state"] != "applied":
        return [dict(head, case="not applied", error="the patch is %s: %s" % (record["state"], record["reason"]))]
    factory, factory_0 = live_and_original(record, "FlashInferMetadataBuilder._get_prefill_wrapper")
    forward, forward_0 = live_and_original(record, "FlashInferImpl.forward")
    device = "cuda" if fi is None else "cpu"
    if fi is None:
        import flashinfer as fi
    provided = _provided(module, fi)
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
    cache_config = types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout)
    rows = []
    try:
        for name, seqs, window_left in [c for c in SINK_CASES if c[0] in cases]:
            sm_scale = HEAD_DIM ** -0.5
            batch = PagedBatch(seqs, seed=seed, device=device)
            # the cache as vLLM lays it out for NHD: [blocks, tokens, heads, K|V], handed to forward as
            # the view that forward's stride order turns back into it
            memory = torch.empty(len(batch.kv_indices), PAGE_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16,
                                 device=device)
            k_view, v_view = memory.split(HEAD_DIM, dim=-1)
            k_view.copy_(batch.k_cache)
            v_view.copy_(batch.v_cache)
            kv_cache = memory.permute(*sorted(range(len(order)), key=order.__getitem__))

            def run(make, fwd, has_sinks=True, sm12x=True):
                cap = 120 if sm12x else 80  # an SM12x GPU, or an Ampere one (no sink support there)
                module.current_platform.is_device_capability = lambda c: c in (cap, divmod(cap, 10))
                module.current_platform.is_device_capability_family = lambda family: family // 10 == cap // 10
                builder = object.__new__(module.FlashInferMetadataBuilder)
                builder.__dict__.update(
                    has_sinks=has_sinks, use_dcp=False, cache_config=cache_config, is_kvcache_nvfp4=False,
                    nvfp4_fa2=False, nvfp4_trtllm=False, q_data_type_prefill=torch.bfloat16,
                    kv_cache_dtype=torch.bfloat16, head_dim=HEAD_DIM, window_left=window_left,
                    _prefill_wrapper=None, _noncausal_prefill_wrapper=None,
                    _workspace_buffer=_workspace(device))
                wrapper, _, error = drive(make, (builder,), {"causal": True}, calls)
                if error:
                    return None, [], error, None
                calls.watch("prefill", wrapper, names=("run",))
                batch.plan(wrapper, sm_scale, window_left)
                impl = object.__new__(module.FlashInferImpl)
                impl.__dict__.update(
                    num_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, scale=sm_scale, cache_config=cache_config,
                    sinks=batch.sinks, kv_cache_dtype="auto", is_kvcache_nvfp4=False, window_left=window_left,
                    nvfp4_fa2=False, nvfp4_trtllm=False,
                    logits_soft_cap=None, dcp_world_size=1, bmm1_scale=None, bmm2_scale=None, o_sf_scale=None,
                    _nvfp4_fp8_out=None)
                layer = types.SimpleNamespace(_q_scale_float=1.0, _k_scale_float=1.0, _v_scale_float=1.0,
                                              _q_scale=torch.tensor(1.0), _o_scale_float=None)
                n = len(batch.q)
                metadata = types.SimpleNamespace(
                    kv_cache_layout=layout, num_actual_tokens=n, num_decode_tokens=0, num_prefill_tokens=n, num_decodes=0, num_prefills=len(seqs),
                    use_cascade=False, cascade_wrapper=None, causal=True, q_data_type_prefill=torch.bfloat16,
                    q_data_type_decode=torch.bfloat16, prefill=module.FIPrefill(wrapper=wrapper), decode=None)
                output = torch.empty_like(batch.q)
                out, took, error = drive(fwd, (impl, layer, batch.q, batch.q, batch.q, kv_cache, metadata, output), {}, calls)
                return (output if error is None else None), took, error, type(wrapper).__name__

            base = dict(head, window_left=window_left, seqs=[list(s) for s in seqs],
                        function="FlashInferImpl.forward", line=_where(forward_0), factory_line=_where(factory_0))
            t = time.time()
            o_old, c_old, e_old, w_old = run(factory_0, forward_0)
            o_new, c_new, e_new, w_new = run(factory, forward)
            err = (lambda o: None) if device == "cpu" else (lambda o: None if o is None else rel_l2(o, batch.reference(sm_scale, window_left)))
            rows.append(dict(base, case="sink prefill, " + name, err_pre_fix=err(o_old), err_flashfix=err(o_new),
                             wrapper_pre_fix=w_old, wrapper_flashfix=w_new, calls_pre_fix=c_old, calls_flashfix=c_new,
                             error_pre_fix=e_old, error_flashfix=e_new, seconds=round(time.time() - t, 1)))
            for label, kw in (("control: no sinks", dict(has_sinks=False)),
                              ("control: a GPU without sink support (not SM12x)", dict(sm12x=False))):
                o1, c1, e1, w1 = run(factory_0, forward_0, **kw)
                o2, c2, e2, w2 = run(factory, forward, **kw)
                rows.append(dict(base, case="%s, %s" % (label, name), control=True, bitwise_equal=_same(o1, o2),
                                 wrapper_pre_fix=w1, wrapper_flashfix=w2, calls_pre_fix=c1, calls_flashfix=c2,
                                 error_pre_fix=e1, error_flashfix=e2))
        from flashfix.core import registry as _registry

        _registry.revert("vllm-sink-prefill")
        rows.append(dict(head, case="revert() restores the original output", control=True,
                         bitwise_equal=_same(run(factory, forward)[0], o_old)))
    finally:
        module.__dict__.update(saved)
        for cls, init in forced:
            cls.__init__ = init
    for r in rows:
        r.setdefault("seconds", round(time.time() - t0, 1))
    return rows

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


__all__ = ["sglang_fp8", "vllm_sink", "sink_sequence", "reference", "rel_l2", "engine_module"]
