"""A FlashInfer stand-in that records every wrapper call and its arguments (CPU tests of verify's
engine checks: tests/test_verify_engine_code.py)."""
import contextlib, sys, types
import torch

LOG = []


def _desc(v):
    if isinstance(v, torch.Tensor):
        return "tensor%s%s" % (list(v.shape), str(v.dtype).replace("torch.", " "))
    if isinstance(v, (tuple, list)):
        return [_desc(x) for x in v]
    return v if v is None or isinstance(v, (int, float, str, bool)) else type(v).__name__


class _Wrapper:
    def __init__(self, *args, **kwargs):
        LOG.append([type(self).__name__, "init", _desc(args), {k: _desc(v) for k, v in kwargs.items()}])
        self._window_left, self._logits_soft_cap, self._sm_scale, self._causal = -1, 0.0, None, True

    def plan(self, *args, **kwargs):
        self._note("plan", args, kwargs)
        self._planned(kwargs)

    def _planned(self, kwargs):
        self._kv_data_type = kwargs.get("kv_data_type")
        self._sm_scale = kwargs.get("sm_scale")
        self._window_left = kwargs.get("window_left", -1)
        self._causal = kwargs.get("causal", True)

    def begin_forward(self, *args, **kwargs):
        self._note("begin_forward", args, kwargs)
        self._planned(kwargs)

    def _note(self, name, args, kwargs):
        LOG.append([type(self).__name__, name, _desc(args), {k: _desc(v) for k, v in sorted(kwargs.items())}])

    def forward(self, q, *args, **kwargs):
        self._note("forward", args, kwargs)
        return torch.zeros_like(q)

    def forward_return_lse(self, q, *args, **kwargs):
        self._note("forward_return_lse", args, kwargs)
        # as run's: a causal and a non-causal pass differ in output and LSE, so a merge depends on the LSE's base
        v = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        causal = kwargs.get("causal", self._causal)
        out = torch.full((*q.shape[:2], q.shape[-1] if v is None else v.shape[-1]), 2.0 if causal else 1.0, dtype=q.dtype)
        return out, torch.full(q.shape[:2], 1.0 if causal else 3.0)

    def run(self, q, *args, **kwargs):
        self._note("run", args, kwargs)
        cache = args[0] if args else None
        k = cache[0] if isinstance(cache, (tuple, list)) else cache
        if getattr(self, "_kv_data_type", None) is not None and isinstance(k, torch.Tensor) and k.dtype != self._kv_data_type:
            raise ValueError("The dtype of k %s does not match the kv_data_type %s specified in plan function."
                             % (k.dtype, self._kv_data_type))  # as FlashInfer's run checks it
        if kwargs.get("out") is not None:
            kwargs["out"].fill_(1.0 if type(self).__name__.startswith("BatchAttention") else 0.0)
        # a causal (new tokens) and a non-causal (context) pass give different outputs and LSEs, so that
        # a merge of the two depends on how their LSEs are read
        out = torch.full((*q.shape[:2], kwargs["v"].shape[-1] if "v" in kwargs else q.shape[-1]),
                         2.0 if self._causal else 1.0, dtype=q.dtype)
        return (out, torch.full(q.shape[:2], 1.0 if self._causal else 3.0)) if kwargs.get("return_lse") else out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    pass


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    pass


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    pass


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """With ``use_cuda_graph``, its buffers as FlashInfer keeps them; every plan of the kernels (``plan`` of
    its module, as a fast_decode_plan calls it) records the lengths on the CPU that it schedules from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_cuda_graph_enabled, self.use_tensor_cores = kwargs.get("use_cuda_graph"), kwargs.get("use_tensor_cores")
        self._paged_kv_indices_buf = kwargs.get("paged_kv_indices_buffer")
        self._fixed_batch_size = len(kwargs.get("paged_kv_last_page_len_buffer", ()))
        self.device, self._float_workspace_buffer, self._int_workspace_buffer = "cpu", None, None
        self._pin_memory_int_workspace_buffer = None
        self._cached_module = types.SimpleNamespace(plan=lambda *a: LOG.append([type(self).__name__, "plan", a[3].tolist()]))


def fast_decode_plan(self, indptr, indices, last_page_len, *args, global_override_indptr_cpu=None, **kwargs):
    """FlashInfer's: the kernels' plan from the CPU lengths given (SGLang's), else from ``indptr``."""
    self._cached_module.plan(None, None, None, indptr.cpu() if global_override_indptr_cpu is None else
                             global_override_indptr_cpu)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Wrapper,), {})
        setattr(self, name, value)
        return value


def install(into_sys_modules=True):
    """The fake package; in sys.modules too unless the real FlashInfer is to stay (an installed engine
    imports much more of it at module level)."""
    fi = _Module("flashinfer")
    fi.__path__ = []
    for cls in (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, BatchAttentionWithAttentionSinkWrapper,
                BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan):
        setattr(fi, cls.__name__, cls)
    if not torch.cuda.is_available():  # SGLang's own fast_decode_plan (to 0.5.2) enters the wrapper's device
        torch.cuda.device = lambda device: contextlib.nullcontext()
    fi.__version__ = "0.0-fake"
    cascade = _Module("flashinfer.cascade")
    cascade.merge_state = lambda o1, s1, o2, s2: (o1 + o2, s1)
    fi.cascade = cascade
    if not into_sys_modules:
        return fi
    sys.modules["flashinfer"] = fi
    sys.modules["flashinfer.cascade"] = cascade
    for sub in ("decode", "prefill", "utils", "jit", "sampling", "norm"):
        m = _Module("flashinfer." + sub)
        m.__path__ = []
        sys.modules["flashinfer." + sub] = m
        setattr(fi, sub, m)
    return fi
