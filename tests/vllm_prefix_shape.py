"""Helpers for tests/test_vllm_real.py that run inside a vLLM environment.

``derive_prefix_source`` rebuilds the pre-#52148 shape of ``vllm/v1/attention/backends/flashinfer.py``
from an installed release that carries the fix (0.28.0 to 0.33.0), at test time: it removes exactly
what PR #52148 added (the ``BatchAttentionWithAttentionSinkWrapper`` import, the two sink branches
of the prefill wrapper factory, SM12x-only up to 0.29.0 and SM90-or-SM12x from 0.30.0, the
``isinstance`` dispatch in ``forward``) and puts back what it removed (the ``sinks=self.sinks``
keyword of the generic prefill call). Everything else, ``supports_sink`` included, stays as that
release has it. Nothing is copied from upstream.

The rest is the recording harness for the differential test: FlashInfer wrapper classes replaced by
recorders, stand-in builder / impl / layer / metadata objects carrying just what the code reads.
"""

import ast
import copy
import importlib
import importlib.util
import sys
import types

SINK = "BatchAttentionWithAttentionSinkWrapper"
TARGET = "vllm.v1.attention.backends.flashinfer"


def _find(tree, qualname):
    node = tree
    for part in qualname.split("."):
        node = next(c for c in node.body if getattr(c, "name", None) == part)
    return node


def _sink_branch_gpus(stmt):
    """For the factory's ``if self.has_sinks and <gpus>: ... BatchAttentionWithAttentionSinkWrapper(...)``
    statement, ``<gpus>``; None for any other statement."""
    if not isinstance(stmt, ast.If):
        return None
    test = stmt.test
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and len(test.values) == 2
            and ast.unparse(test.values[0]) == "self.has_sinks"):
        return None
    builds_sink = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == SINK
                      for body_stmt in stmt.body for n in ast.walk(body_stmt))
    return test.values[1] if builds_sink else None


def sink_branch_gpu_tests(fixed_source):
    """The capability tests of the release's own sink branches (as source text), in order."""
    factory = _find(ast.parse(fixed_source), "FlashInferMetadataBuilder._get_prefill_wrapper")
    return [ast.unparse(_sink_branch_gpus(n)) for n in ast.walk(factory) if _sink_branch_gpus(n) is not None]


def _replace_ifs(func, predicate, replacement):
    """Replace every ``if`` statement of ``func`` that satisfies ``predicate``; return the count."""
    count = 0
    for parent in ast.walk(func):
        for field in ("body", "orelse"):
            block = getattr(parent, field, None)
            if not isinstance(block, list):
                continue
            new = []
            for stmt in block:
                if isinstance(stmt, ast.If) and predicate(stmt):
                    new.extend(replacement(stmt))
                    count += 1
                else:
                    new.append(stmt)
            block[:] = new
    return count


def derive_prefix_source(fixed_source):
    """The pre-fix module source, derived from a fixed release's source. Raises if the fixed
    source does not have exactly the pieces #52148 added."""
    tree = ast.parse(fixed_source)

    # 1. the import name
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "flashinfer"
               and any(a.name == SINK for a in n.names)]
    assert len(imports) == 1, imports
    imports[0].names = [a for a in imports[0].names if a.name != SINK]

    # 2. the two sink branches of the factory: keep their else bodies
    factory = _find(tree, "FlashInferMetadataBuilder._get_prefill_wrapper")
    n = _replace_ifs(factory, lambda stmt: _sink_branch_gpus(stmt) is not None, lambda stmt: stmt.orelse)
    assert n == 2, n

    # 3. the isinstance dispatch in forward: back to the generic call, with sinks=self.sinks
    forward = _find(tree, "FlashInferImpl.forward")

    def is_dispatch(stmt):
        return ast.unparse(stmt.test) == "isinstance(prefill_wrapper, %s)" % SINK

    def generic_with_sinks(stmt):
        assert len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.Expr), ast.unparse(stmt)
        call = copy.deepcopy(stmt.orelse[0])
        assert ast.unparse(call.value.func) == "prefill_wrapper.run"
        assert "sinks" not in [k.arg for k in call.value.keywords]
        call.value.keywords.append(ast.keyword("sinks", ast.parse("self.sinks", mode="eval").body))
        return [call]

    n = _replace_ifs(forward, is_dispatch, generic_with_sinks)
    assert n == 1, n

    ast.fix_missing_locations(tree)
    assert not any(isinstance(x, ast.Name) and x.id == SINK for x in ast.walk(tree)), "sink wrapper still referenced"
    return ast.unparse(tree) + "\n"


class _VariantLoader:
    """Executes ``source`` for a module whose ``__file__`` is ``path`` (so the loaded code
    differs from the file on disk, as after someone else's in-memory patch)."""

    def __init__(self, path, source):
        self.path, self.source = path, source

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(compile(self.source, self.path, "exec"), module.__dict__)


class PrefixFinder:
    """A meta-path finder that serves ``TARGET`` from another file. Placed after flashfix's
    finder, so flashfix's post-import hook still wraps the loader, as for the real module."""

    def __init__(self, path, loaded_source=None):
        self.path, self.loaded_source = path, loaded_source

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        loader = None if self.loaded_source is None else _VariantLoader(self.path, self.loaded_source)
        return importlib.util.spec_from_file_location(fullname, self.path, loader=loader)


def install_prefix_module(tmpdir, fixed_path, alter_loaded=None):
    """Write the derived pre-fix file and make ``import TARGET`` load it. Returns its path.
    ``alter_loaded(source) -> source``: execute that instead of the file's text."""
    import os

    with open(fixed_path) as handle:
        source = derive_prefix_source(handle.read())
    path = os.path.join(tmpdir, "flashinfer_prefix.py")
    with open(path, "w") as handle:
        handle.write(source)
    loaded = None if alter_loaded is None else alter_loaded(source)
    finders = sys.meta_path
    position = next((i + 1 for i, f in enumerate(finders) if getattr(f, "flashfix_finder", False)), 0)
    finders.insert(position, PrefixFinder(path, loaded))
    return path


def forward_with_extra_statement(source):
    """The same module with one more statement at the top of ``FlashInferImpl.forward``."""
    tree = ast.parse(source)
    forward = _find(tree, "FlashInferImpl.forward")
    forward.body.insert(1, ast.parse("layer = layer").body[0])  # after the docstring
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


def load_copy(path, name):
    """Execute ``path`` as a second, independent module called ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- recording harness ----------------------------------------------------------------------------


def describe(value):
    """A comparable, JSON-able description of an argument."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), list(value.stride()), value.data_ptr()]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [describe(v) for v in value]]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return ["object", type(value).__name__]


def make_recorders(log):
    """Recorder classes for the two FlashInfer prefill wrappers (the sink one a subclass of
    the generic one, as in FlashInfer) and the DCP wrapper."""

    class RecordingPrefill:
        kind = "generic"

        def __init__(self, *args, **kwargs):
            log.append(["ctor", self.kind, describe(args), {k: describe(v) for k, v in sorted(kwargs.items())}])
            # what plan() would set and forward asserts
            self._window_left = None
            self._logits_soft_cap = 0.0
            self._sm_scale = None
            self._causal = None

        def run(self, *args, **kwargs):
            log.append(["run", self.kind, describe(args), {k: describe(v) for k, v in sorted(kwargs.items())}])

    class RecordingSinkPrefill(RecordingPrefill):
        kind = "sink"

    class RecordingDCP:
        def __init__(self, *args, **kwargs):
            log.append(["ctor", "dcp", describe(args), {k: describe(v) for k, v in sorted(kwargs.items())}])

    return RecordingPrefill, RecordingSinkPrefill, RecordingDCP


def fake_capability(platform, capability):
    """Make ``platform`` report a GPU of ``capability`` (e.g. 121, 90, 100): only
    ``get_device_capability`` is replaced; the family and exact-capability tests are vLLM's own."""
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(*divmod(capability, 10))
    type(platform).get_device_capability = classmethod(lambda cls, device_id=0: cap)


def nhd_layout(module):
    """Make the release lay its KV cache out as NHD without an engine config, in its own terms:
    up to 0.28 the global override ``set_kv_cache_layout("NHD")`` (returns None); from 0.29 the
    builder and impl read ``self.cache_config.get_resolved_kv_cache_layout()``, so the stand-ins
    get a cache config resolving to ``KVCacheLayout.LBNHC`` (FlashInfer's NHD), returned here."""
    if hasattr(module, "get_kv_cache_layout"):
        from vllm.v1.attention.backends.utils import set_kv_cache_layout

        set_kv_cache_layout("NHD")
        return None
    return module.KVCacheLayout.LBNHC


def stand_in_cache(module, layout, *, num_blocks, block_size, num_kv_heads, head_size, dtype):
    """A zero KV cache of one layer, shaped as the release expects for an NHD layout."""
    import torch

    if layout is None:
        shape = module.FlashInferBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    else:  # physical [blocks, tokens, heads, K|V content] for LBNHC
        shape = (num_blocks, block_size, num_kv_heads, 2 * head_size)
    return torch.zeros(shape, dtype=dtype)


def _cache_config(layout):
    return types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout)


def stand_in_builder(cls, *, has_sinks, kv_dtype, q_dtype, workspace, head_dim=64, window_left=-1, layout=None):
    builder = object.__new__(cls)
    builder.has_sinks = has_sinks
    builder.use_dcp = False
    builder.is_kvcache_nvfp4 = False
    builder.nvfp4_fa2 = builder.nvfp4_trtllm = False
    builder.cache_config = _cache_config(layout)
    builder.q_data_type_prefill = q_dtype
    builder.kv_cache_dtype = kv_dtype
    builder.head_dim = head_dim
    builder.window_left = window_left
    builder._prefill_wrapper = None
    builder._noncausal_prefill_wrapper = None
    builder._workspace_buffer = workspace
    return builder


def stand_in_impl(cls, *, sinks, kv_cache_dtype, num_heads=8, num_kv_heads=2, head_size=64, window_left=-1,
                  layout=None):
    impl = object.__new__(cls)
    impl.cache_config = _cache_config(layout)
    impl.nvfp4_fa2 = impl.nvfp4_trtllm = False
    impl._nvfp4_fp8_out = None
    impl.num_heads = num_heads
    impl.num_kv_heads = num_kv_heads
    impl.head_size = head_size
    impl.scale = head_size ** -0.5
    impl.sinks = sinks
    impl.kv_cache_dtype = kv_cache_dtype
    impl.is_kvcache_nvfp4 = False
    impl.window_left = window_left
    impl.logits_soft_cap = None
    impl.dcp_world_size = 1
    impl.bmm1_scale = None
    impl.bmm2_scale = None
    impl.o_sf_scale = None
    return impl


def stand_in_layer(q, k, v):
    import torch

    return types.SimpleNamespace(_q_scale_float=q, _k_scale_float=k, _v_scale_float=v,
                                 _q_scale=torch.tensor(q), _k_scale=torch.tensor(k), _v_scale=torch.tensor(v),
                                 _o_scale_float=None)


def stand_in_metadata(module, wrapper, *, num_tokens, causal, q_dtype, layout=None):
    return types.SimpleNamespace(
        kv_cache_layout=layout,
        num_actual_tokens=num_tokens, num_decode_tokens=0, num_prefill_tokens=num_tokens, num_decodes=0,
        num_prefills=1, use_cascade=False, cascade_wrapper=None, causal=causal,
        q_data_type_prefill=q_dtype, q_data_type_decode=q_dtype,
        prefill=module.FIPrefill(wrapper=wrapper), decode=None,
    )
