"""A FlashInfer stand-in that records every wrapper call and its arguments (CPU tests of verify's
engine checks: tests/test_verify_engine_code.py)."""
import sys, types
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
        self._sm_scale = kwargs.get("sm_scale")
        self._window_left = kwargs.get("window_left", -1)
        self._causal = kwargs.get("causal", True)

    def begin_forward(self, *args, **kwargs):
        self._note("begin_forward", args, kwargs)
        self.plan(*args, **kwargs)

    def _note(self, name, args, kwargs):
        LOG.append([type(self).__name__, name, _desc(args), {k: _desc(v) for k, v in sorted(kwargs.items())}])

    def forward(self, q, *args, **kwargs):
        self._note("forward", args, kwargs)
        return torch.zeros_like(q)

    def forward_return_lse(self, q, *args, **kwargs):
        self._note("forward_return_lse", args, kwargs)
        return torch.zeros_like(q), torch.zeros(q.shape[:2])

    def run(self, q, *args, **kwargs):
        self._note("run", args, kwargs)
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
    for cls in (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, BatchAttentionWithAttentionSinkWrapper):
        setattr(fi, cls.__name__, cls)
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
