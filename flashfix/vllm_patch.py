"""vLLM patches.

vllm-sink-prefill
=================

Why
    PR #49718 let vLLM's FlashInfer backend serve models with attention sinks (GPT-OSS and
    others) on SM12x GPUs (RTX 50xx, RTX PRO 6000, DGX Spark / GB10): sinks are applied by
    the XQA decode kernel there, and ``FlashInferBackend.supports_sink()`` admits capability
    family 120 with a trtllm/XQA *decode* only. Prefill, however, still went through
    FlashInfer's generic ``BatchPrefillWithPagedKVCacheWrapper``. Its ``run(..., sinks=...)``
    accepts the sinks argument, but the fa2/fa3 kernels it runs never read it: every prefill
    token is attended as if the model had no sinks. The output is silently wrong (GSM8K 0.0
    for GPT-OSS-20b on a DGX Spark upstream; relative error 0.4 to 0.6 against a reference in
    our own measurement, see shared notes). The same holds on any GPU that ``supports_sink``
    admits with a decode-only gate (from 0.30.0 upstream admits SM90 that way too).

The rest of this module's documentation (how, upstream, affected versions, when to delete) is
the comment block below.
"""
# How
#     One patch, three changes, prepared together and applied together or not at all:
#
#     A. ``FlashInferMetadataBuilder._get_prefill_wrapper`` gets new code (``_registry.rewrite``:
#        the factory's own source, edited as an AST, compiled and swapped into the same function
#        object). Each ``self.<slot> = BatchPrefillWithPagedKVCacheWrapper(workspace, layout,
#        backend=...)`` statement (the causal and the non-causal slot) becomes
#        ``if self.has_sinks and <GPUs>: <build the sink wrapper into the same slot> else: <the
#        statement as it was>``. The sink wrapper gets the workspace and layout arguments as the
#        very expressions, positional or keyword, that this build passes to the generic wrapper
#        (``get_kv_cache_layout()`` in 0.28-era code, ``get_flashinfer_layout_string(
#        self.kv_cache_layout)`` from 0.29), plus what it needs at construction: the prefill
#        query dtype, the KV-cache dtype, the head dim and the sliding window. ``<GPUs>`` is the
#        build's own capability test, read from its ``supports_sink``: the tests of its gates
#        that admit sinks without requiring ``supports_trtllm_attention(is_prefill=True)``, i.e.
#        the GPUs where it serves sinks while prefill runs the generic wrapper (family 120 in
#        0.28/0.29-era code, SM90 or family 120 in 0.30-era code; SM100, whose gate requires
#        trtllm-gen prefill, applies sinks there and is left alone). The GPU is asked only while
#        the slot is empty, as before. An NVFP4 KV cache on the sink branch raises a
#        ``NotImplementedError`` saying why (the sink wrapper cannot read NVFP4).
#     B. ``FlashInferImpl.forward`` gets new code the same way: the generic
#        ``prefill_wrapper.run(..., sinks=...)`` statement becomes a dispatch on the wrapper's
#        type. The sink wrapper is run with the sinks as a positional argument and the q and k
#        scales (the call's own ``q_scale``/``k_scale`` expressions) folded into the softmax
#        scale; the generic wrapper is run as before, without the ignored ``sinks=`` keyword.
#        Cost per call: one ``isinstance`` and one global lookup.
#     C. The pre-fix module does not import ``BatchAttentionWithAttentionSinkWrapper``; the
#        name is added to the module's globals (taken from ``flashinfer``), which A and B look up.
#
#     Both rewritten functions carry a one-time marker: ``ran`` in ``flashfix.status()`` turns
#     true when a sink wrapper is first built. ``flashfix.revert()`` puts the original code back
#     into the same function objects and removes the global. The result is what upstream PR
#     #52148 does, written independently here. The sink wrapper is a subclass of the generic
#     one, so vLLM's ``plan()`` call and the assertions in ``forward`` accept it unchanged.
#
#     Refused (``unknown-shape``, engine untouched, the reason given) when ``supports_sink`` has
#     a statement other than local imports and ``if TEST: return ...`` gates, when a gate that
#     admits sinks with a generic prefill tests anything but ``P.is_device_capability(N)`` /
#     ``P.is_device_capability_family(N)`` (joined by ``or``) of a module global, when it ends
#     in a return that admits sinks with a generic prefill on GPUs no test names, when the
#     factory builds the generic wrapper other than as ``self.<slot> = ...(workspace, layout[,
#     backend=])`` once per slot, or when ``forward``'s generic run is not the one statement of
#     the known form; also when the loaded code differs from the file, or the installed
#     FlashInfer has no sink wrapper subclassing the generic one.
#
# Upstream
#     https://github.com/vllm-project/vllm/pull/52148 (merged 2026-08-13, first release
#     0.28.0; 0.30.0 widened the same branch to SM90).
#
# Affected versions
#     No PyPI release: 0.27.1 and older do not serve sinks with FlashInfer on SM12x
#     (``supports_sink`` admits SM100 only, with trtllm-gen prefill), 0.28.0 and later carry the
#     fix. Affected are builds from vLLM's main branch between #49718 and #52148: nightly
#     wheels and vendor containers, which report dev versions such as ``0.27.2.devN+g<sha>`` or
#     ``0.28.0.devN``, and forks or backport branches that carry a later release's code without
#     #52148. The range ``>=0.27.0.dev0`` has no upper bound on purpose: the shape probe only
#     answers "patch" when all pre-fix facts hold at once (``supports_sink`` admits sinks on some
#     GPU with a generic prefill, the factory has no sink branch, ``forward`` passes ``sinks=``
#     to the generic ``run``), and in that shape the change is correct whatever the version
#     string says. Tested on that shape derived from 0.28.0, 0.29.0, 0.30.0 and 0.33.0 by
#     reverting #52148 in each (tests/test_vllm_real.py). Releases with the fix are recognised
#     by shape and left alone.
#
# Why not a semantic patch (``flashfix.semantic``)
#     The GPUs to fix are read from the build's own ``supports_sink`` (a procedural reading of
#     its gates), the factory's edit is once per wrapper slot with the release's own workspace and
#     layout expressions, and ``prepare`` checks the installed FlashInfer class: more than one
#     before -> after pair can say. The shape and edits stay hand-written.
#
# Delete when
#     The oldest vLLM that flashfix supports is 0.28.0 or later, or no supported deployment
#     runs a main-branch build from before 2026-08-13 (nor a fork without #52148).

import ast
import copy

from flashfix import semantic
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.source import ShapeError

PATCH_ID = "vllm-sink-prefill"
TARGET = "vllm.v1.attention.backends.flashinfer"
SINK_WRAPPER = "BatchAttentionWithAttentionSinkWrapper"
GENERIC_WRAPPER = "BatchPrefillWithPagedKVCacheWrapper"
BUILDER = "FlashInferMetadataBuilder"
FACTORY = BUILDER + "._get_prefill_wrapper"
FORWARD = "FlashInferImpl.forward"
SUPPORTS_SINK = "FlashInferBackend.supports_sink"

# The builder's wrapper slots: the factory assigns the generic wrapper to each, the sink branch
# assigns the sink wrapper to the same one.
SLOTS = ("_prefill_wrapper", "_noncausal_prefill_wrapper")
# Builder attributes the sink branch reads; checked against the builder's source before patching.
_BUILDER_ATTRS = ("has_sinks", "is_kvcache_nvfp4", "q_data_type_prefill", "kv_cache_dtype", "head_dim",
                  "window_left")
# The generic wrapper's first two parameters, shared with the sink wrapper (FlashInfer's names).
_WORKSPACE, _LAYOUT = "float_workspace_buffer", "kv_layout"
# Keywords of the generic prefill run call in the pre-fix forward.
_RUN_NEEDED = {"q_scale", "k_scale", "v_scale", "out", "sinks"}
_RUN_ALLOWED = _RUN_NEEDED | {"kv_cache_sf"}
# Capability tests of vLLM's platform interface that supports_sink may gate sinks with.
_CAPABILITY_TESTS = ("is_device_capability", "is_device_capability_family")

NVFP4_REFUSAL = ("FlashInfer cannot prefill with attention sinks from an NVFP4 KV cache (flashfix %s: the sink "
                 "wrapper does not read NVFP4); use a bf16 or FP8 KV cache or another attention backend" % PATCH_ID)


# --- reading the source -----------------------------------------------------------------------


def _mentions(node, name):
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _is_docstring(stmt):
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _is_false(node):
    return isinstance(node, ast.Constant) and node.value is False


def _needs_trtllm_prefill(node):
    """Does this return value require ``supports_trtllm_attention(is_prefill=True)``, or the
    argument-less ``supports_trtllm_attention()`` of builds up to 0.24 (whose
    ``use_trtllm_attention(has_sinks=True)`` then routes prefill and decode of a sink model to
    trtllm-gen)? Then sinks are admitted only where prefill runs trtllm-gen, which applies them."""
    for call in ast.walk(node):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name != "supports_trtllm_attention":
            continue
        if not call.args and not call.keywords:
            return True
        if any(kw.arg == "is_prefill" and isinstance(kw.value, ast.Constant) and kw.value.value is True
               for kw in call.keywords):
            return True
    return False


def _capability_receivers(test, local_names):
    """The names ``test`` asks for the GPU (``P.is_device_capability(C)`` /
    ``P.is_device_capability_family(C)``, alone or joined by ``or``); ShapeError otherwise."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return set().union(*(_capability_receivers(value, local_names) for value in test.values))
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) and test.func.attr in _CAPABILITY_TESTS
            and isinstance(test.func.value, ast.Name) and test.func.value.id not in local_names
            and len(test.args) == 1 and not test.keywords and isinstance(test.args[0], ast.Constant)
            and type(test.args[0].value) is int):
        return {test.func.value.id}
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
        if index == 0 and _is_docstring(stmt):
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            local_names.update((alias.asname or alias.name).split(".")[0] for alias in stmt.names)
            continue
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Return):
            value = stmt.body[0].value
            if value is None or _is_false(value) or _needs_trtllm_prefill(value):
                continue
            _capability_receivers(stmt.test, local_names)
            gates.append(stmt.test)
            continue
        if isinstance(stmt, ast.Return) and index == len(body) - 1:
            if stmt.value is None or _is_false(stmt.value) or _needs_trtllm_prefill(stmt.value):
                continue
            raise ShapeError("%s ends with `return %s`: it admits sinks with a generic prefill on GPUs that no "
                             "capability test names" % (SUPPORTS_SINK, ast.unparse(stmt.value)))
        raise ShapeError("%s has a statement flashfix does not read (line %d: `%s`): cannot tell on which GPUs "
                         "it admits sinks with a generic prefill"
                         % (SUPPORTS_SINK, stmt.lineno, ast.unparse(stmt).splitlines()[0]))
    if not gates:
        return None
    if len(gates) == 1:
        return gates[0]
    return ast.BoolOp(op=ast.Or(), values=list(gates))


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


def factory_sites(def_node):
    """The factory's generic-wrapper constructions: ``[(block, index, slot, call)]``, one per
    slot, each the statement ``self.<slot> = BatchPrefillWithPagedKVCacheWrapper(workspace,
    layout[, backend=...])`` (workspace and layout positional or by FlashInfer's parameter
    names). ShapeError, saying what differs, otherwise."""
    if not def_node.args.args:
        raise ShapeError("%s has no self argument" % FACTORY)
    self_name = def_node.args.args[0].arg
    builds = _source.name_calls(def_node, GENERIC_WRAPPER)
    if not builds:
        raise ShapeError("%s does not build %s" % (FACTORY, GENERIC_WRAPPER))
    sites = []
    for call in builds:
        block, index = _source.statement_of(def_node, call)
        stmt = block[index]
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if not (target is not None and stmt.value is call and isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name) and target.value.id == self_name and target.attr in SLOTS):
            raise ShapeError("%s builds %s other than as `self.<slot> = %s(...)` (line %d)"
                             % (FACTORY, GENERIC_WRAPPER, GENERIC_WRAPPER, call.lineno))
        if any(isinstance(a, ast.Starred) for a in call.args) or any(kw.arg is None for kw in call.keywords):
            raise ShapeError("%s passes *args/**kwargs to %s (line %d)" % (FACTORY, GENERIC_WRAPPER, call.lineno))
        given = [_WORKSPACE, _LAYOUT][:len(call.args)] + [kw.arg for kw in call.keywords]
        if len(call.args) > 2 or sorted(set(given) - {"backend"}) != sorted([_WORKSPACE, _LAYOUT]) \
                or len(set(given)) != len(given):
            raise ShapeError("%s passes %s to %s (line %d); expected the workspace and the KV layout, and "
                             "optionally backend" % (FACTORY, ", ".join(given) or "nothing", GENERIC_WRAPPER,
                                                     call.lineno))
        sites.append((block, index, target.attr, call))
    slots = sorted(site[2] for site in sites)
    if slots != sorted(SLOTS):
        raise ShapeError("%s builds %s into %s; expected once into each of %s"
                         % (FACTORY, GENERIC_WRAPPER, ", ".join(slots), ", ".join(SLOTS)))
    return sites


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
    try:
        gpus = sink_gpu_test(found[SUPPORTS_SINK])
    except ShapeError as exc:
        return _registry.Shape(_registry.UNKNOWN, str(exc))
    if gpus is None:
        return _registry.Shape(_registry.ABSENT, "%s admits sinks only where prefill runs trtllm-gen (which applies "
                                                 "them): FlashInfer's generic prefill never sees sinks"
                               % SUPPORTS_SINK)
    where = ast.unparse(gpus)
    try:
        _find_sink_run(found[FORWARD])
        factory_sites(found[FACTORY])
    except ShapeError as exc:
        return _registry.Shape(_registry.UNKNOWN, "sinks admitted with a generic prefill where `%s`, factory without "
                                                  "a sink branch, but %s" % (where, exc))
    return _registry.Shape(_registry.BUGGY, "sinks admitted with a generic prefill where `%s`, but prefill runs the "
                                            "generic FlashInfer wrapper, which ignores sinks on fa2/fa3" % where)


# --- part A: the prefill wrapper factory --------------------------------------------------------


_SINK_BRANCH = semantic.pattern("""
if $SELF.has_sinks and $GPUS:
    if $SELF.is_kvcache_nvfp4:
        raise NotImplementedError($WHY)
    $SELF.$SLOT = BatchAttentionWithAttentionSinkWrapper(
        $$$ARGS, **$$$KW, backend="auto", q_data_type=$SELF.q_data_type_prefill, kv_data_type=$SELF.kv_cache_dtype,
        head_dim_qk=$SELF.head_dim, head_dim_vo=$SELF.head_dim, window_left=$SELF.window_left)
else:
    $$$BUILD
""")


def edit_factory(gpus):
    """The edit for ``_get_prefill_wrapper``: each ``self.<slot> = BatchPrefillWithPagedKVCacheWrapper(
    workspace, layout, ...)`` statement becomes ``_SINK_BRANCH`` (the one-time marker before the
    sink wrapper is built), with ``workspace`` and ``layout`` the very expressions (and positional
    or keyword form) of that construction, ``$$$BUILD`` the statement as it was, and ``gpus`` the
    capability test read from ``supports_sink``."""

    def edit(def_node, mark):
        self_name = def_node.args.args[0].arg if def_node.args.args else None
        for number, (block, index, slot, call) in enumerate(factory_sites(def_node)):
            stmt = block[index]
            branch = semantic.build(_SINK_BRANCH, {
                "SELF": ast.Name(self_name, ast.Load()), "GPUS": gpus, "WHY": ast.Constant(NVFP4_REFUSAL),
                "SLOT": slot, "ARGS": call.args, "BUILD": [],
                "KW": [kw for kw in call.keywords if kw.arg in (_WORKSPACE, _LAYOUT)]})
            branch.body.insert(1, mark if number == 0 else copy.deepcopy(mark))
            _located(branch, stmt)
            branch.orelse = [stmt]
            block[index] = branch
        return def_node

    return edit


def _check_builder(tree):
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


_DISPATCH = semantic.pattern("""
if isinstance(prefill_wrapper, BatchAttentionWithAttentionSinkWrapper):
    assert $SINKS is not None
    prefill_wrapper.run($$$QKV, $SINKS, $SELF.scale * $Q_SCALE * $K_SCALE, v_scale=$V_SCALE, out=$OUT)
else:
    prefill_wrapper.run($$$QKV, **$$$KW)
""")


def edit_forward(def_node, mark):
    """Turn forward's generic ``prefill_wrapper.run(q, kv, ..., sinks=S)`` statement into
    ``_DISPATCH``: the sink wrapper gets ``run(q, kv, S, scale * q_scale * k_scale, v_scale=,
    out=)`` (after ``mark``), any other wrapper the original call without ``sinks=``."""
    block, index, call = _find_sink_run(def_node)
    stmt = block[index]
    if not def_node.args.args:
        raise ShapeError("forward has no self argument")
    given = {kw.arg.upper(): kw.value for kw in call.keywords}
    dispatch = semantic.build(_DISPATCH, dict(given, SELF=ast.Name(def_node.args.args[0].arg, ast.Load()),
                                              QKV=call.args, KW=[k for k in call.keywords if k.arg != "sinks"]))
    dispatch.body.insert(0, mark)
    _located(dispatch, stmt)
    _located(mark, call)
    block[index] = dispatch
    return def_node


# --- the patch -----------------------------------------------------------------------------------


def _plain_function(owner, name):
    func = owner.__dict__.get(name)
    if not isinstance(func, type(_plain_function)):
        raise ShapeError("%s.%s is not a plain function" % (owner.__name__, name))
    return func


def prepare(modules):
    module = modules[TARGET]
    tree = _source.module_ast(TARGET, modules)
    builder = getattr(module, BUILDER, None)
    impl = getattr(module, "FlashInferImpl", None)
    if builder is None or impl is None:
        raise ShapeError("%s lacks %s or FlashInferImpl" % (TARGET, BUILDER))
    gpus = sink_gpu_test(_source.find_def(tree, SUPPORTS_SINK))
    if gpus is None:
        raise ShapeError("%s admits no GPU with a generic prefill" % SUPPORTS_SINK)
    for name in sorted(_capability_receivers(gpus, set())) + [GENERIC_WRAPPER]:
        if not hasattr(module, name):
            raise ShapeError("%s has no global %s" % (TARGET, name))
    _check_builder(tree)
    import flashinfer

    sink_wrapper = getattr(flashinfer, SINK_WRAPPER, None)
    if sink_wrapper is None:
        raise ShapeError("the installed flashinfer %s has no %s" % (getattr(flashinfer, "__version__", "?"), SINK_WRAPPER))
    if not issubclass(sink_wrapper, getattr(module, GENERIC_WRAPPER)):
        raise ShapeError("flashinfer's %s is not a %s (forward's checks would refuse it)" % (SINK_WRAPPER, GENERIC_WRAPPER))
    factory_change = _registry.rewrite(_plain_function(builder, "_get_prefill_wrapper"), edit_factory(gpus),
                                       PATCH_ID)  # part A
    forward_change = _registry.rewrite(_plain_function(impl, "forward"), edit_forward, PATCH_ID)  # part B
    return [_registry.SetAttr(module, SINK_WRAPPER, sink_wrapper), factory_change, forward_change]  # C, A, B


def plan(planner):
    """``flashfix diff``: the changes of ``prepare``, made from source."""
    from flashfix.tools import diff as _diff

    if not _diff.binds("flashinfer", SINK_WRAPPER):  # prepare() takes the class from the installed flashinfer
        raise ShapeError("the flashinfer read here has no %s (or is not there): the runtime would leave vLLM as it is"
                         % SINK_WRAPPER)
    gpus = sink_gpu_test(_source.find_def(_source.module_ast(TARGET), SUPPORTS_SINK))
    if gpus is None:
        raise ShapeError("%s admits no GPU with a generic prefill" % SUPPORTS_SINK)
    planner.add_name(TARGET, SINK_WRAPPER, "flashinfer", SINK_WRAPPER)  # part C
    planner.rewrite(TARGET, FACTORY, edit_factory(gpus))  # part A
    planner.rewrite(TARGET, FORWARD, edit_forward)  # part B


PATCHES = (
    _registry.Patch(
        id=PATCH_ID,
        engine="vllm",
        targets=(TARGET,),
        versions=">=0.27.0.dev0",
        upstream="https://github.com/vllm-project/vllm/pull/52148",
        fixed_in="0.28.0",
        delete_when="the oldest supported vLLM is 0.28.0, or no main-branch build from before 2026-08-13 is in use",
        summary="prefill with attention sinks uses FlashInfer's sink wrapper on the GPUs where the build serves "
                "sinks with a generic prefill, instead of silently dropping sinks",
        probe=probe,
        prepare=prepare,
        plan=plan,
    ),
)
