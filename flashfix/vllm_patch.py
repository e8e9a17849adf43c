"""vLLM patches.

vllm-sink-prefill
=================

Why
    PR #49718 let vLLM's FlashInfer backend serve models with attention sinks (GPT-OSS and
    others) on SM12x GPUs (RTX 50xx, RTX PRO 6000, DGX Spark / GB10): sinks are applied by
    the XQA decode kernel there, and ``FlashInferBackend.supports_sink()`` admits capability
    family 120. Prefill, however, still went through FlashInfer's generic
    ``BatchPrefillWithPagedKVCacheWrapper``. Its ``run(..., sinks=...)`` accepts the sinks
    argument, but the fa2/fa3 kernels that SM12x uses never read it: every prefill token is
    attended as if the model had no sinks. The output is silently wrong (GSM8K 0.0 for
    GPT-OSS-20b on a DGX Spark upstream; relative error 0.4 to 0.6 against a reference in our
    own measurement, see shared notes).

How
    One patch, three changes, applied together or not at all:

    A. ``FlashInferMetadataBuilder._get_prefill_wrapper`` is replaced by a function
       (``prefill_factory``) that, when the layer group has sinks, DCP is off and the GPU is
       of capability family 120, builds FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``
       (with the prefill query dtype, the KV-cache dtype, the head dim and the sliding window
       it needs at construction) for the causal or non-causal slot and caches it where the
       original would. Every other case is handed to the original function. An NVFP4 KV
       cache with sinks on SM12x is refused with a ``NotImplementedError`` (the sink wrapper
       cannot read NVFP4).
    B. ``FlashInferImpl.forward`` gets new code (``_registry.rewrite``: same function object,
       so no per-call wrapper): the generic ``prefill_wrapper.run(..., sinks=...)``
       statement becomes a dispatch on the wrapper's type. The sink wrapper is run with the
       sinks as a positional argument and the q and k scales folded into the softmax scale;
       the generic wrapper is run as before, without the ignored ``sinks=`` keyword. Cost per
       call: one ``isinstance`` and one global lookup.
    C. The pre-fix module does not import ``BatchAttentionWithAttentionSinkWrapper``; the
       name is added to the module's globals (taken from ``flashinfer``), which both A (at
       call time) and B (as a global) look up.

    The result is what upstream PR #52148 does (vLLM 0.28.0), written independently here.
    The sink wrapper is a subclass of the generic one, so vLLM's ``plan()`` call and the
    assertions in ``forward`` accept it unchanged.

Upstream
    https://github.com/vllm-project/vllm/pull/52148 (merged 2026-08-13, first release
    0.28.0; 0.30.0 widened the same branch to SM90).

Affected versions
    No PyPI release: 0.27.1 and older do not serve sinks with FlashInfer on SM12x
    (``supports_sink`` admits SM100 only), 0.28.0 and later carry the fix. Affected are
    builds from vLLM's main branch between #49718 and #52148: nightly wheels and vendor
    containers, which report dev versions such as ``0.27.2.devN+g<sha>`` or
    ``0.28.0.devN``. The range ``>=0.27.0.dev0`` has no upper bound on purpose: the shape
    probe only answers "patch" when all three pre-fix facts hold at once (``supports_sink``
    admits SM12x, the factory has no sink branch, ``forward`` passes ``sinks=`` to the
    generic ``run``), and in that shape the change is correct whatever the version string
    says (a fork or a backport branch may carry #49718 without #52148). Releases with the
    fix are recognised by shape and left alone.

Delete when
    The oldest vLLM that flashfix supports is 0.28.0 or later, or no supported deployment
    runs a main-branch build from before 2026-08-13.
"""

import ast
import copy
import functools
import inspect

from flashfix import _registry, _source
from flashfix._source import ShapeError

PATCH_ID = "vllm-sink-prefill"
TARGET = "vllm.v1.attention.backends.flashinfer"
SINK_WRAPPER = "BatchAttentionWithAttentionSinkWrapper"
GENERIC_WRAPPER = "BatchPrefillWithPagedKVCacheWrapper"
BUILDER = "FlashInferMetadataBuilder"
FACTORY = BUILDER + "._get_prefill_wrapper"
FORWARD = "FlashInferImpl.forward"
SUPPORTS_SINK = "FlashInferBackend.supports_sink"

# Builder attributes the sink branch reads; checked against the source before patching.
_BUILDER_ATTRS = ("has_sinks", "use_dcp", "is_kvcache_nvfp4", "q_data_type_prefill", "kv_cache_dtype",
                  "head_dim", "window_left", "_prefill_wrapper", "_noncausal_prefill_wrapper")
# Keywords of the generic prefill run call in the pre-fix forward.
_RUN_NEEDED = {"q_scale", "k_scale", "v_scale", "out", "sinks"}
_RUN_ALLOWED = _RUN_NEEDED | {"kv_cache_sf"}


# --- reading the source -----------------------------------------------------------------------


def _mentions(node, name):
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _admits_sm12x(func_def):
    """Does this ``supports_sink`` body test for capability family 120 (or an SM12x capability)?"""
    for call in _source.method_calls(func_def, "is_device_capability_family"):
        if call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == 120:
            return True
    for call in _source.method_calls(func_def, "is_device_capability"):
        if call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value in (120, 121):
            return True
    return False


def _is_prefill_run(call):
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "run" and isinstance(func.value, ast.Name)
            and func.value.id == "prefill_wrapper")


def _find_sink_run(def_node):
    """The one statement ``prefill_wrapper.run(q, kv, ..., sinks=...)`` in ``forward``:
    returns (block, index, call). ShapeError unless there is exactly one, of the known form."""
    calls = [c for c in ast.walk(def_node) if isinstance(c, ast.Call) and _is_prefill_run(c)
             and any(kw.arg == "sinks" for kw in c.keywords)]
    if len(calls) != 1:
        raise ShapeError("expected one prefill_wrapper.run(..., sinks=...) call in forward, found %d" % len(calls))
    call = calls[0]
    if len(call.args) != 2 or any(isinstance(a, ast.Starred) for a in call.args):
        raise ShapeError("prefill_wrapper.run(...) does not take exactly two positional arguments")
    names = [kw.arg for kw in call.keywords]
    if None in names or len(set(names)) != len(names):
        raise ShapeError("prefill_wrapper.run(...) uses **kwargs or repeats a keyword")
    if not _RUN_NEEDED <= set(names) or not set(names) <= _RUN_ALLOWED:
        raise ShapeError("prefill_wrapper.run(...) keywords are %s, expected %s (optionally kv_cache_sf)"
                         % (sorted(names), sorted(_RUN_NEEDED)))
    block, index = _source.statement_of(def_node, call)
    if not (isinstance(block[index], ast.Expr) and block[index].value is call):
        raise ShapeError("prefill_wrapper.run(..., sinks=...) is not a statement of its own")
    return block, index, call


def _defs(tree):
    return {qualname: _source.find_def(tree, qualname) for qualname in (SUPPORTS_SINK, FACTORY, FORWARD)}


def probe(trees):
    """Shape of the FlashInfer backend, from its source only (no import)."""
    tree = trees[TARGET]
    found = _defs(tree)
    missing = [name for name, node in found.items() if node is None]
    if found[FACTORY] is not None and _mentions(found[FACTORY], SINK_WRAPPER):
        return _registry.Shape(_registry.FIXED, "%s builds %s for sink models (vLLM PR #52148 is in)"
                               % (FACTORY, SINK_WRAPPER))
    if missing:
        return _registry.Shape(_registry.UNKNOWN, "not found: %s" % ", ".join(missing))
    if not _admits_sm12x(found[SUPPORTS_SINK]):
        return _registry.Shape(_registry.ABSENT, "%s does not admit SM12x: FlashInfer serves no sink model "
                                                 "there, so its prefill never sees sinks" % SUPPORTS_SINK)
    try:
        _find_sink_run(found[FORWARD])
    except ShapeError as exc:
        return _registry.Shape(_registry.UNKNOWN, "SM12x sinks admitted, factory without a sink branch, but %s" % exc)
    return _registry.Shape(_registry.BUGGY, "SM12x sinks admitted, but prefill runs the generic FlashInfer wrapper, "
                                            "which ignores sinks on fa2/fa3")


# --- part A: the prefill wrapper factory --------------------------------------------------------


def prefill_factory(original, module):
    """``_get_prefill_wrapper`` with the SM12x sink branch, delegating everything else to ``original``.

    The sink wrapper class, the layout function and the platform are looked up in ``module``
    at call time (a test may replace them)."""

    @functools.wraps(original)
    def _get_prefill_wrapper(self, causal=True):
        if self.has_sinks and not self.use_dcp:
            slot = "_prefill_wrapper" if causal else "_noncausal_prefill_wrapper"
            # capability last: asked only while the wrapper is not built yet, as upstream does
            if getattr(self, slot) is None and module.current_platform.is_device_capability_family(120):
                if self.is_kvcache_nvfp4:
                    if not causal:
                        return original(self, causal)  # its own NotImplementedError for NVFP4 non-causal
                    raise NotImplementedError(
                        "FlashInfer cannot prefill with attention sinks on SM12x from an NVFP4 KV cache "
                        "(flashfix %s); use a bf16 or FP8 KV cache or another attention backend" % PATCH_ID)
                wrapper = module.BatchAttentionWithAttentionSinkWrapper(
                    self._get_workspace_buffer(),
                    module.get_kv_cache_layout(),
                    backend="auto",
                    q_data_type=self.q_data_type_prefill,
                    kv_data_type=self.kv_cache_dtype,
                    head_dim_qk=self.head_dim,
                    head_dim_vo=self.head_dim,
                    window_left=self.window_left,
                )
                setattr(self, slot, wrapper)
                _registry.note_ran(PATCH_ID)
                return wrapper
        return original(self, causal)

    return _get_prefill_wrapper


def _check_factory(original, tree):
    params = list(inspect.signature(original).parameters.values())
    if [p.name for p in params] != ["self", "causal"] or params[1].default is not True:
        raise ShapeError("%s%s is not (self, causal=True)" % (FACTORY, inspect.signature(original)))
    factory = _source.find_def(tree, FACTORY)
    builds = _source.name_calls(factory, GENERIC_WRAPPER)
    if not builds:
        raise ShapeError("%s does not build %s" % (FACTORY, GENERIC_WRAPPER))
    for call in builds:  # the sink wrapper is built with the same workspace and layout expressions
        if (len(call.args) < 2 or not isinstance(call.args[1], ast.Call)
                or not isinstance(call.args[1].func, ast.Name) or call.args[1].func.id != "get_kv_cache_layout"):
            raise ShapeError("%s passes its KV layout other than as get_kv_cache_layout()" % FACTORY)
        if _source.source_of(call.args[0]) != "self._get_workspace_buffer()":
            raise ShapeError("%s passes its workspace other than as self._get_workspace_buffer()" % FACTORY)
    assigned = set()
    for node in ast.walk(_source.find_def(tree, BUILDER)):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                assigned.add(target.attr)
    lacking = [a for a in _BUILDER_ATTRS if a not in assigned]
    if lacking:
        raise ShapeError("%s never sets %s" % (BUILDER, ", ".join(lacking)))


# --- part B: the prefill call in forward --------------------------------------------------------


def _located(node, where):
    for n in ast.walk(node):
        if "lineno" in n._attributes:
            ast.copy_location(n, where)
    return node


def edit_forward(def_node, mark):
    """Turn forward's generic ``prefill_wrapper.run(q, kv, ..., sinks=S)`` statement into a
    dispatch: the sink wrapper gets ``run(q, kv, S, scale * q_scale * k_scale, v_scale=, out=)``
    (after ``mark``), any other wrapper the original call without ``sinks=``."""
    block, index, call = _find_sink_run(def_node)
    stmt = block[index]
    if not def_node.args.args:
        raise ShapeError("forward has no self argument")
    self_name = def_node.args.args[0].arg
    kw = _source.keywords(call)
    sinks = kw["sinks"]
    softmax_scale = ast.BinOp(
        ast.BinOp(ast.Attribute(ast.Name(self_name, ast.Load()), "scale", ast.Load()), ast.Mult(),
                  copy.deepcopy(kw["q_scale"])),
        ast.Mult(), copy.deepcopy(kw["k_scale"]))
    sink_run = ast.Call(
        func=copy.deepcopy(call.func),
        args=[copy.deepcopy(a) for a in call.args] + [copy.deepcopy(sinks), softmax_scale],
        keywords=[ast.keyword("v_scale", copy.deepcopy(kw["v_scale"])), ast.keyword("out", copy.deepcopy(kw["out"]))],
    )
    generic_run = copy.deepcopy(call)
    generic_run.keywords = [k for k in generic_run.keywords if k.arg != "sinks"]
    dispatch = ast.If(
        test=ast.Call(ast.Name("isinstance", ast.Load()),
                      [ast.Name("prefill_wrapper", ast.Load()), ast.Name(SINK_WRAPPER, ast.Load())], []),
        body=[
            mark,
            ast.Assert(ast.Compare(copy.deepcopy(sinks), [ast.IsNot()], [ast.Constant(None)]), None),
            ast.Expr(sink_run),
        ],
        orelse=[ast.Expr(generic_run)],
    )
    _located(dispatch, stmt)
    _located(mark, call)
    block[index] = dispatch
    return def_node


# --- the patch -----------------------------------------------------------------------------------


def prepare(modules):
    module = modules[TARGET]
    tree = _source.module_ast(TARGET, modules)
    builder = getattr(module, BUILDER, None)
    impl = getattr(module, "FlashInferImpl", None)
    if builder is None or impl is None:
        raise ShapeError("%s lacks %s or FlashInferImpl" % (TARGET, BUILDER))
    for name in ("current_platform", "get_kv_cache_layout", GENERIC_WRAPPER):
        if not hasattr(module, name):
            raise ShapeError("%s has no global %s" % (TARGET, name))
    if not hasattr(module.current_platform, "is_device_capability_family"):
        raise ShapeError("current_platform has no is_device_capability_family()")
    import flashinfer

    sink_wrapper = getattr(flashinfer, SINK_WRAPPER, None)
    if sink_wrapper is None:
        raise ShapeError("the installed flashinfer %s has no %s" % (getattr(flashinfer, "__version__", "?"), SINK_WRAPPER))
    if not issubclass(sink_wrapper, getattr(module, GENERIC_WRAPPER)):
        raise ShapeError("flashinfer's %s is not a %s (forward's checks would refuse it)" % (SINK_WRAPPER, GENERIC_WRAPPER))
    original = builder.__dict__.get("_get_prefill_wrapper")
    if not inspect.isfunction(original):
        raise ShapeError("%s is not a plain function" % FACTORY)
    _check_factory(original, tree)
    call_change = _registry.rewrite(impl.forward, edit_forward, PATCH_ID)  # part B
    return [
        _registry.SetAttr(module, SINK_WRAPPER, sink_wrapper),  # part C
        _registry.SetAttr(builder, "_get_prefill_wrapper", prefill_factory(original, module)),  # part A
        call_change,
    ]


PATCHES = (
    _registry.Patch(
        id=PATCH_ID,
        engine="vllm",
        targets=(TARGET,),
        versions=">=0.27.0.dev0",
        upstream="https://github.com/vllm-project/vllm/pull/52148",
        fixed_in="0.28.0",
        delete_when="the oldest supported vLLM is 0.28.0, or no main-branch build from before 2026-08-13 is in use",
        summary="SM12x prefill with attention sinks uses FlashInfer's sink wrapper instead of silently dropping sinks",
        probe=probe,
        prepare=prepare,
    ),
)
