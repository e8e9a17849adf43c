"""Patches for FlashInfer itself (distribution ``flashinfer-python``).

flashinfer-sink-jit-name
========================

Why
    ``BatchAttentionWithAttentionSinkWrapper.__init__`` names the JIT module it builds
    ``batch_prefill_attention_sink_<q dtype>_swa_<bool>_<backend>``. The module it asks for
    is also specialised on the KV dtype, the output dtype, both head dims, the positional
    encoding mode and fp16 QK reduction, none of which is in the name. FlashInfer loads a
    built module by its name (the shared library's path), so inside one process a second
    sink wrapper whose name matches an earlier one but whose KV dtype or head dims differ is
    handed the earlier wrapper's kernel and runs it on its own data: with bf16 KV first and
    FP8 KV second the FP8 wrapper's output had a relative error of about 9000 on an H200,
    and the reverse order about 290 (see shared notes, "sink-wrapper kernels collide").
    Nothing fails, nothing is logged. Each configuration alone, or a later process, is
    correct, because the build step itself rewrites the sources and recompiles.

    The ``window_left`` value is not part of the collision: only ``window_left >= 0`` is
    compiled in (and it is in the name); the window size itself is a ``plan()`` argument.

How
    The sink wrapper hands its ``jit_args`` (name first) to
    ``BatchPrefillWithPagedKVCacheWrapper.__init__`` by keyword. flashfix wraps that
    ``__init__`` (one ``SetAttr``, undone by ``flashfix.revert()``); the wrapper acts only
    for instances of the sink wrapper whose name has FlashInfer's sink prefix, and keeps a
    per-process table name -> configuration:

The rest of this module's documentation is the comment block below.
"""
#     * the first configuration to use a name keeps it, so the kernel a warm cache already
#       holds under that name is still the one used;
#     * the same configuration again gets the same name;
#     * a different configuration under a taken name gets a name of its own, the original
#       with the KV dtype, output dtype and head dims appended (and the position-encoding
#       mode / fp16-QK flag when they are not the defaults), and one WARNING is logged per
#       such configuration.
#
#     With JIT disabled (``FLASHINFER_DISABLE_JIT`` set to any non-empty value, as FlashInfer
#     reads it) a renamed kernel can only be loaded if it was built ahead of time under that
#     name. If it was not, flashfix raises ``SinkKernelUnavailableError`` naming both
#     configurations instead of FlashInfer's generic "missing from the JIT cache" error; it
#     never falls back to the colliding name, whose kernel is the wrong one.
#
# Upstream status
#     No upstream PR was found, and FlashInfer releases up to and including 0.7.2.post1 name
#     the kernel without the KV dtype or head dims. FlashInfer 0.7.4 (the next release on
#     PyPI) builds the name from the q dtype, KV dtype, both head dims, the position-encoding
#     mode, the fp16-QK flag, the sliding-window flag and the backend, which is this fix;
#     the shape probe reports that code as fixed upstream.
#
# Affected versions
#     Every ``flashinfer-python`` release that has the sink wrapper up to 0.7.2.post1
#     (0.6.8.post1, 0.6.12, 0.6.15.post1, 0.6.16.post3, 0.6.17 and 0.7.2.post1 were read).
#     Releases without the class are reported as not affected.
#
# Why not a semantic patch (``flashfix.semantic``)
#     The fix is not an edit of FlashInfer's code: a name chosen per process from the
#     configurations already built (a table, a warning, a JIT-disabled error) can only be
#     written in Python, around the installed ``__init__``.
#
# Delete when
#     Every supported vLLM and SGLang release requires flashinfer-python >= 0.7.4.

import ast
import functools
import hashlib
import logging
import os
import threading

from flashfix.core import source as _source
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, Patch, SetAttr, Shape, note_ran
from flashfix.core.source import ShapeError

log = logging.getLogger("flashfix")

PATCH_ID = "flashinfer-sink-jit-name"
SINK_CLASS = "BatchAttentionWithAttentionSinkWrapper"
PARENT_CLASS = "BatchPrefillWithPagedKVCacheWrapper"
NAME_PREFIX = "batch_prefill_attention_sink_"
# Variables whose value the pre-fix name holds; a name built from more than these is fixed.
_PRE_FIX_NAME_PARTS = {"q_data_type", "window_left", "backend"}
_FIX_NAME_PARTS = {"kv_data_type", "head_dim_qk", "head_dim_vo"}


class SinkKernelUnavailableError(RuntimeError):
    """JIT is disabled and the kernel of a sink-wrapper configuration whose FlashInfer name
    collides with another configuration's was not built ahead of time under its own name."""


# --- shape probe (source only: used by ``flashfix doctor`` without importing FlashInfer) ---


def _find_sink_class(tree, package):
    """The sink wrapper's ClassDef: in ``tree`` itself, or in the submodule the package
    re-exports it from (``from ._core import ...``). Returns (node, where) or (None, None)."""
    node = _source.find_def(tree, SINK_CLASS)
    if isinstance(node, ast.ClassDef):
        return node, package
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
            if any(alias.name == SINK_CLASS for alias in stmt.names):
                submodule = "%s.%s" % (package, stmt.module)
                sub_tree = _source.module_ast(submodule)
                if sub_tree is not None:
                    node = _source.find_def(sub_tree, SINK_CLASS)
                    if isinstance(node, ast.ClassDef):
                        return node, submodule
    return None, None


def _sink_name_fstring(class_node):
    for node in ast.walk(class_node):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith(NAME_PREFIX):
                return node
    return None


def _fstring_names(fstring):
    names = set()
    for part in fstring.values:
        if isinstance(part, ast.FormattedValue):
            names |= {n.id for n in ast.walk(part.value) if isinstance(n, ast.Name)}
    return names


def probe(trees):
    attention = trees["flashinfer.attention"]
    prefill = trees["flashinfer.prefill"]
    cls, where = _find_sink_class(attention, "flashinfer.attention")
    if cls is None:
        return Shape(ABSENT, "FlashInfer has no %s: no attention-sink kernel to misname" % SINK_CLASS)
    fstring = _sink_name_fstring(cls)
    if fstring is None:
        return Shape(UNKNOWN, "%s.%s builds no kernel name starting with %r" % (where, SINK_CLASS, NAME_PREFIX))
    names = _fstring_names(fstring) - {"filename_safe_dtype_map", "filename_safe_dtype_map_kv", "PosEncodingMode"}
    if _FIX_NAME_PARTS <= names:
        return Shape(FIXED, "the sink kernel name in %s includes the KV dtype and head dims" % where)
    if not names <= _PRE_FIX_NAME_PARTS:
        return Shape(UNKNOWN, "the sink kernel name in %s is built from %s, not the known pre-fix parts"
                     % (where, ", ".join(sorted(names))))
    init = _source.find_def(cls, "__init__")
    supers = [c for c in _source.method_calls(init, "__init__")] if init is not None else []
    if not any("jit_args" in _source.keywords(c) and "jit_kwargs" in _source.keywords(c) for c in supers):
        return Shape(UNKNOWN, "%s.__init__ does not hand jit_args/jit_kwargs to its parent by keyword" % SINK_CLASS)
    parent = _source.find_def(prefill, PARENT_CLASS + ".__init__")
    if parent is None or not {"jit_args", "jit_kwargs"} <= {a.arg for a in parent.args.args + parent.args.kwonlyargs}:
        return Shape(UNKNOWN, "flashinfer.prefill.%s.__init__ takes no jit_args/jit_kwargs" % PARENT_CLASS)
    return Shape(BUGGY, "the sink kernel name in %s holds only %s: wrappers differing in KV dtype or head dims "
                 "share one kernel in a process" % (where, ", ".join(sorted(names))))


# --- the per-process name table ------------------------------------------------------------


def _jit_disabled():
    return bool(os.environ.get("FLASHINFER_DISABLE_JIT"))  # FlashInfer's own test: any non-empty value


def _dtype(dtype):
    return str(dtype).rsplit(".", 1)[-1]


class Config:
    """The compile-time configuration a sink wrapper's ``jit_args``/``jit_kwargs`` ask for."""

    def __init__(self, jit_args, jit_kwargs):
        args = list(jit_args)
        self.name = args[0]
        self.q, self.kv, self.o, self.idtype = (_dtype(d) for d in args[1:5])
        self.head_dim_qk, self.head_dim_vo = args[5], args[6]
        self.kwargs = dict(jit_kwargs or {})
        rest = tuple(repr(a) for a in args[7:-1]) + (hashlib.sha1(str(args[-1]).encode()).hexdigest(),)
        self.key = (self.q, self.kv, self.o, self.idtype, self.head_dim_qk, self.head_dim_vo, rest,
                    tuple(sorted((k, repr(v)) for k, v in self.kwargs.items())))

    def suffix(self):
        parts = ["kv", self.kv, "o", self.o, "hd", str(self.head_dim_qk), str(self.head_dim_vo)]
        if self.idtype != "int32":
            parts += ["idx", self.idtype]
        if self.kwargs.get("pos_encoding_mode", 0) not in (0, None):
            parts += ["posenc", str(self.kwargs["pos_encoding_mode"])]
        if self.kwargs.get("use_fp16_qk_reduction"):
            parts += ["f16qk"]
        return "_" + "_".join(parts)

    def digest(self):
        return hashlib.sha1(repr(self.key).encode()).hexdigest()[:10]

    def describe(self):
        extra = ", ".join("%s=%s" % (k, v) for k, v in sorted(self.kwargs.items()))
        return "q %s, KV %s, out %s, head dims %s/%s%s" % (
            self.q, self.kv, self.o, self.head_dim_qk, self.head_dim_vo, ", " + extra if extra else "")


class NameTable:
    """Name -> configuration for every sink kernel this process asked FlashInfer for."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = {}  # name -> Config that owns it
        self._given = {}  # (FlashInfer's name, config key) -> name given

    def assign(self, config):
        """The name ``config`` should be built under, and the Config that owns FlashInfer's
        name when that is another configuration (else None)."""
        with self._lock:
            base = config.name
            owner = self._owner.get(base)
            if owner is None:
                self._owner[base] = config
                self._given[(base, config.key)] = base
                return base, None
            if owner.key == config.key:
                return base, None
            given = self._given.get((base, config.key))
            if given is not None:
                return given, owner
            name = base + config.suffix()
            if name in self._owner and self._owner[name].key != config.key:
                name = "%s_%s" % (name, config.digest())
            self._owner[name] = config
            self._given[(base, config.key)] = name
        log.warning(
            "%s: FlashInfer names the attention-sink kernel for (%s) %r, a name this process already used for "
            "(%s); it would run that kernel. Building it as %r instead.",
            PATCH_ID, config.describe(), base, owner.describe(), name)
        return name, owner


_table = NameTable()


def _is_missing_kernel(exc):
    return any(c.__name__ == "MissingJITCacheError" for c in type(exc).__mro__) or "FLASHINFER_DISABLE_JIT" in str(exc)


def _wrap_init(original, sink_cls, table=_table):
    ran = []

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        jit_args = kwargs.get("jit_args")
        if (jit_args is None or not isinstance(self, sink_cls) or not jit_args
                or not isinstance(jit_args[0], str) or not jit_args[0].startswith(NAME_PREFIX)):
            return original(self, *args, **kwargs)
        if not ran:
            ran.append(True)
            note_ran(PATCH_ID)
        config = Config(jit_args, kwargs.get("jit_kwargs"))
        name, owner = table.assign(config)
        if owner is None:
            return original(self, *args, **kwargs)
        kwargs["jit_args"] = [name] + list(jit_args[1:])
        if not _jit_disabled():
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            if not _is_missing_kernel(exc):
                raise
            raise SinkKernelUnavailableError(
                "FlashInfer JIT is disabled (FLASHINFER_DISABLE_JIT=%r) and no kernel was built ahead of time for the "
                "attention-sink wrapper with %s. FlashInfer would name it %r, the name this process already used for "
                "the wrapper with %s, and loading that would run the other configuration's kernel (wrong results), "
                "so flashfix asked for %r, which is not prebuilt. Enable JIT, prebuild that kernel, or keep one "
                "sink-wrapper configuration per process." % (
                    os.environ.get("FLASHINFER_DISABLE_JIT"), config.describe(), config.name, owner.describe(), name)
            ) from exc

    __init__.flashfix_patch = PATCH_ID
    return __init__


def prepare(modules):
    sink = getattr(modules["flashinfer.attention"], SINK_CLASS, None)
    parent = getattr(modules["flashinfer.prefill"], PARENT_CLASS, None)
    if sink is None or parent is None:
        raise ShapeError("flashinfer has no %s or %s" % (SINK_CLASS, PARENT_CLASS))
    if not issubclass(sink, parent):
        raise ShapeError("%s does not derive from flashinfer.prefill.%s" % (SINK_CLASS, PARENT_CLASS))
    original = parent.__dict__.get("__init__")
    if original is None or getattr(original, "flashfix_patch", None) == PATCH_ID:
        raise ShapeError("%s.__init__ is missing or already wrapped" % PARENT_CLASS)
    return [SetAttr(parent, "__init__", _wrap_init(original, sink))]


def plan(planner):
    """``flashfix diff``: the one replaced ``__init__``, shown from flashfix's source."""
    from flashfix.tools import diff as _diff

    if not _diff.binds("flashinfer.attention", SINK_CLASS):
        raise ShapeError("flashinfer.attention has no %s" % SINK_CLASS)
    planner.replace("flashinfer.prefill", PARENT_CLASS, "__init__", _wrap_init,
                    "_wrap_init(<the installed %s.__init__>, %s)" % (PARENT_CLASS, SINK_CLASS),
                    delegate="%s.__init__" % PARENT_CLASS)


PATCHES = (
    Patch(
        id=PATCH_ID,
        engine="flashinfer-python",
        targets=("flashinfer.attention", "flashinfer.prefill"),
        versions=">=0.2.9,<0.7.4",
        upstream="none (no upstream PR found; FlashInfer 0.7.4 changed the name)",
        fixed_in="0.7.4",
        delete_when="every supported vLLM and SGLang release requires flashinfer-python >= 0.7.4",
        summary="attention-sink wrappers that differ in KV dtype, output dtype or head dims get distinct JIT kernel names",
        probe=probe,
        prepare=prepare,
        plan=plan,
    ),
)
