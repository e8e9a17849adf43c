"""Patches for FlashInfer itself (distribution ``flashinfer-python``).

flashinfer-sink-jit-name (the long form, with measurements: docs/patches/flashinfer-sink-jit-name.md)
  Why: ``BatchAttentionWithAttentionSinkWrapper`` names its JIT kernel
    ``batch_prefill_attention_sink_<q dtype>_swa_<bool>_<backend>``, though the kernel is also
    specialised on the KV and output dtypes, both head dims, the position-encoding mode and fp16 QK
    reduction. FlashInfer loads a built kernel by name, so in one process a later sink wrapper with
    the same name but another KV dtype or head dims silently runs the earlier one's kernel.
  How: wrap ``BatchPrefillWithPagedKVCacheWrapper.__init__``, to which the sink wrapper hands its
    ``jit_args`` (name first) by keyword (one ``SetAttr``, undone by ``flashfix.revert()``). A
    per-process table keeps FlashInfer's name for the first configuration that uses it and gives any
    other configuration under it the name plus its KV dtype, output dtype and head dims (and the
    position-encoding mode / fp16-QK flag when not the defaults), with one WARNING each. With
    ``FLASHINFER_DISABLE_JIT`` set, a renamed kernel not built ahead of time raises
    ``SinkKernelUnavailableError``; the colliding name, whose kernel is the wrong one, is never used.
  Upstream: no PR found. FlashInfer 0.7.4 puts the KV dtype and head dims in the name (this fix);
    the shape probe reports that code as fixed upstream.
  Affected versions: every ``flashinfer-python`` release with the sink wrapper up to 0.7.2.post1.
  Delete when: every supported vLLM and SGLang release requires flashinfer-python >= 0.7.4.
"""

import ast
import collections
import functools
import hashlib
import importlib.util
import logging
import os
import threading

from flashfix.core import lazy as _lazy
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, Patch, SetAttr, Shape, ShapeError, note_ran

_source = _lazy.Module("flashfix.core.source")  # a pack holds no reader object (flashfix.core.lazy)

log = logging.getLogger("flashfix")

PATCH_ID = "flashinfer-sink-jit-name"
SINK_CLASS = "BatchAttentionWithAttentionSinkWrapper"
PARENT_CLASS = "BatchPrefillWithPagedKVCacheWrapper"
NAME_PREFIX = "batch_prefill_attention_sink_"
# Variables whose value the pre-fix name holds; a name built from more than these is fixed.
_PRE_FIX_NAME_PARTS = {"q_data_type", "window_left", "backend"}
_FIX_NAME_PARTS = {"kv_data_type", "head_dim_qk", "head_dim_vo"}


class SinkKernelUnavailableError(RuntimeError):
    """JIT is disabled and a renamed sink kernel (its FlashInfer name collides) was not built ahead of time."""


# --- shape probe (source only: used by ``flashfix doctor`` without importing FlashInfer) ---
def _find_sink_class(tree, package):
    """``(ClassDef, module)`` of the sink wrapper Python binds in ``package``: the last top-level
    binding of the name, a class there or a ``from .sub import`` of it (followed into ``.sub``).
    (None, None) where nothing binds it; ShapeError where the last binding is anything else."""
    bindings = [(s, node) for s in tree.body for node in _source._bindings(s, SINK_CLASS)]
    if not bindings:
        return None, None
    statement, node = bindings[-1]
    if node is statement and isinstance(node, ast.ClassDef):
        return node, package
    if not (isinstance(statement, ast.ImportFrom) and statement.module and node in statement.names):
        raise ShapeError("%s.%s is last bound at line %d by a statement that is not a class or a plain "
                         "'from ... import'" % (package, SINK_CLASS, statement.lineno))
    module = importlib.util.resolve_name("." * statement.level + statement.module, package)
    sub_tree = _source.module_ast(module)
    if sub_tree is None or sub_tree is _source.SOURCELESS:
        raise ShapeError("%s imports %s from %s, whose source cannot be read" % (package, SINK_CLASS, module))
    cls = _source.find_def(sub_tree, node.name)
    return (cls, module) if isinstance(cls, ast.ClassDef) else (None, None)


def _name_parts(class_node):
    """The variables in the f-string that builds the sink kernel's name; None if there is none."""
    for node in ast.walk(class_node):
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith(NAME_PREFIX):
                return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - {
                    "filename_safe_dtype_map", "filename_safe_dtype_map_kv", "PosEncodingMode"}
    return None


def probe(trees):
    cls, where = _find_sink_class(trees["flashinfer.attention"], "flashinfer.attention")
    if cls is None:
        return Shape(ABSENT, "FlashInfer has no %s: no attention-sink kernel to misname" % SINK_CLASS)
    names = _name_parts(cls)
    if names is None:
        return Shape(UNKNOWN, "%s.%s builds no kernel name starting with %r" % (where, SINK_CLASS, NAME_PREFIX))
    if _FIX_NAME_PARTS <= names:
        return Shape(FIXED, "the sink kernel name in %s includes the KV dtype and head dims" % where)
    if not names <= _PRE_FIX_NAME_PARTS:
        return Shape(UNKNOWN, "the sink kernel name in %s is built from %s, not the known pre-fix parts"
                     % (where, ", ".join(sorted(names))))
    init = _source.find_def(cls, "__init__")
    supers = _source.method_calls(init, "__init__") if init is not None else []
    if not any({"jit_args", "jit_kwargs"} <= _source.keywords(c).keys() for c in supers):
        return Shape(UNKNOWN, "%s.__init__ does not hand jit_args/jit_kwargs to its parent by keyword" % SINK_CLASS)
    parent = _source.find_def(trees["flashinfer.prefill"], PARENT_CLASS + ".__init__")
    if parent is None or not {"jit_args", "jit_kwargs"} <= {a.arg for a in parent.args.args + parent.args.kwonlyargs}:
        return Shape(UNKNOWN, "flashinfer.prefill.%s.__init__ takes no jit_args/jit_kwargs" % PARENT_CLASS)
    return Shape(BUGGY, "the sink kernel name in %s holds only %s: wrappers differing in KV dtype or head dims "
                 "share one kernel in a process" % (where, ", ".join(sorted(names))))


# --- the per-process name table ------------------------------------------------------------
Config = collections.namedtuple("Config", "name key suffix description")


def _config(jit_args, jit_kwargs):
    """The compile-time configuration a sink wrapper's ``jit_args``/``jit_kwargs`` ask for:
    FlashInfer's name for it, a key, the suffix a renamed kernel gets, and words for messages."""
    name, q, kv, o, idtype, head_dim_qk, head_dim_vo = jit_args[:7]
    q, kv, o, idtype = (str(d).rsplit(".", 1)[-1] for d in (q, kv, o, idtype))  # torch.bfloat16 -> bfloat16
    kwargs = dict(jit_kwargs or {})
    key = (q, kv, o, idtype, head_dim_qk, head_dim_vo, tuple(repr(a) for a in jit_args[7:-1]),
           hashlib.sha1(str(jit_args[-1]).encode()).hexdigest(), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    suffix = ["kv", kv, "o", o, "hd", str(head_dim_qk), str(head_dim_vo)] + (["idx", idtype] if idtype != "int32" else [])
    if kwargs.get("pos_encoding_mode", 0) not in (0, None):
        suffix += ["posenc", str(kwargs["pos_encoding_mode"])]
    if kwargs.get("use_fp16_qk_reduction"):
        suffix.append("f16qk")
    description = "q %s, KV %s, out %s, head dims %s/%s%s" % (
        q, kv, o, head_dim_qk, head_dim_vo, "".join(", %s=%s" % item for item in sorted(kwargs.items())))
    return Config(name, key, "_" + "_".join(suffix), description)


class NameTable:
    """Name -> the configuration it was given to, for every sink kernel this process asked FlashInfer for."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = {}

    def assign(self, config):
        """The name ``config`` should be built under, and the configuration that owns FlashInfer's
        name when that is another one (else None). The first configuration keeps FlashInfer's name."""
        base = config.name
        with self._lock:
            owner = self._owner.setdefault(base, config)
            if owner.key == config.key:
                return base, None
            name = base + config.suffix
            if self._owner.setdefault(name, config).key != config.key:  # another configuration, the same suffix
                name += "_" + hashlib.sha1(repr(config.key).encode()).hexdigest()[:10]
            if self._owner.setdefault(name, config) is not config:
                return name, owner  # given to this configuration before (and warned then)
        log.warning(
            "%s: FlashInfer names the attention-sink kernel for (%s) %r, a name this process already used for "
            "(%s); it would run that kernel. Building it as %r instead.",
            PATCH_ID, config.description, base, owner.description, name)
        return name, owner


_table = NameTable()


def _wrap_init(original, sink_cls, table=_table):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        jit_args = kwargs.get("jit_args")
        if (not isinstance(self, sink_cls) or not jit_args
                or not isinstance(jit_args[0], str) or not jit_args[0].startswith(NAME_PREFIX)):
            return original(self, *args, **kwargs)
        note_ran(PATCH_ID)
        config = _config(jit_args, kwargs.get("jit_kwargs"))
        name, owner = table.assign(config)
        if owner is None:
            return original(self, *args, **kwargs)
        kwargs["jit_args"] = [name] + list(jit_args[1:])
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            disabled = os.environ.get("FLASHINFER_DISABLE_JIT")  # FlashInfer's own test: any non-empty value
            missing = any(c.__name__ == "MissingJITCacheError" for c in type(exc).__mro__)
            if not disabled or not (missing or "FLASHINFER_DISABLE_JIT" in str(exc)):
                raise
            raise SinkKernelUnavailableError(
                "FlashInfer JIT is disabled (FLASHINFER_DISABLE_JIT=%r) and no kernel was built ahead of time for the "
                "attention-sink wrapper with %s. FlashInfer would name it %r, the name this process already used for "
                "the wrapper with %s, and loading that would run the other configuration's kernel (wrong results), "
                "so flashfix asked for %r, which is not prebuilt. Enable JIT, prebuild that kernel, or keep one "
                "sink-wrapper configuration per process." % (
                    disabled, config.description, config.name, owner.description, name)
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
