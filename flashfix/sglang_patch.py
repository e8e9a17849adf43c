"""SGLang patches: backports of sgl-project/sglang PR #34217 (merged 2026-08-10, first in 0.5.18).

That PR fixes three unrelated small things; each is its own ``Patch`` here so that each can
be judged, disabled (``FLASHFIX_DISABLE=<id>``) and deleted on its own. Importing this
module only declares the patches: no SGLang, torch or FlashInfer module is imported, so
``flashfix doctor`` can load it. Every probe decides from the source text (``ast``) alone.

Per patch, the comment block above it says why, how, which releases are affected and when
it can be deleted. Measured with the engine imported on the PyPI releases 0.5.11, 0.5.13,
0.5.14, 0.5.17, 0.5.18 and 0.5.23 (tests/test_sglang_real.py); every final release from 0.5.1
on is judged from its wheel's source by scripts/sweep_releases.py (tests/test_sweep.py).
"""

import ast
import copy
import importlib
import sys

from flashfix import _locate, _registry, _source
from flashfix._registry import ABSENT, BUGGY, FIXED, UNKNOWN, Patch, Shape
from flashfix._source import ShapeError

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34217"
FIXED_IN = "0.5.18"
# Every PyPI release from 0.5.1 to 0.5.17 carries the pre-fix shape, and 0.5.18 and later carry
# the fix, which the probes recognise whatever the version says. The range is open above on
# purpose: a post-release branch or a vendor build numbered 0.5.18 or later without #34217 is
# the same code and gets the same fix (tested on 0.5.18's and 0.5.23's own source with #34217
# reverted, tests/test_sglang_derived.py); the probes answer "patch" only on the pre-fix shape.
VERSIONS = ">=0.5.1"
DELETE_WHEN = "flashfix no longer supports SGLang older than 0.5.18"


# --- small AST helpers ------------------------------------------------------------------------


def _is_attr_of(node, owner, attr):
    """``node`` is ``<owner>.<attr>`` with ``owner`` a plain name."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == owner
    )


def _own_function(owner, name, module):
    """The plain function ``name`` defined by ``owner`` (a class or a module) in ``module``'s
    file, looking through ``functools.wraps`` wrappers (SGLang's ``debug_kernel_api`` wraps
    when kernel-API logging is on); a ShapeError if there is none."""
    obj = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    seen = 0
    while obj is not None and seen < 10:
        code = getattr(obj, "__code__", None)
        if code is not None and code.co_name == name and code.co_filename == getattr(module, "__file__", None):
            return obj
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    raise ShapeError("%s.%s is not a plain function of %s" % (getattr(owner, "__name__", owner), name, module.__name__))


def _function_at(module, qualname):
    """The plain function at ``qualname`` (``"Class.method"`` or ``"function"``) of ``module``;
    a ShapeError naming what is missing otherwise."""
    owner = module
    *outer, name = qualname.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
        if not isinstance(owner, type):
            raise ShapeError("%s has no class %s" % (module.__name__, part))
    return _own_function(owner, name, module)


def _loaded(modname):
    """An engine module the patch needs; already imported in every case measured (the
    target's own import pulls it in), imported here otherwise."""
    module = sys.modules.get(modname)
    return module if module is not None else importlib.import_module(modname)


# --- 1. FP8 KV-cache scales on the ragged+paged prefill path -----------------------------------
#
# Why: ``FlashInferAttnBackend.forward_extend`` reads the paged KV cache through three
#   FlashInfer calls. The paged ``forward`` (no ragged split) and ``forward_decode`` pass
#   ``k_scale=layer.k_scale_float, v_scale=layer.v_scale_float`` (0.5.1 to 0.5.1.post3:
#   ``layer.k_scale``, ``layer.v_scale``); the paged ``forward_return_lse`` of the
#   ragged+paged split (an extend over a cached prefix: chunked prefill, prefix-cache hits,
#   the sliding-window path) passes neither. With an FP8
#   KV cache that carries scales, the cached prefix is then read unscaled: measured on an
#   H200, relative error 187 without the scales, 0.0033 with them. The ragged calls read the
#   batch's own bf16 k/v and take no scale. Without FP8 scales both values are None and the
#   call is unchanged.
# How: ``forward_extend`` is recompiled from its own source with the two keywords added to
#   that one call, their values copied from the release's own paged ``forward`` call, and
#   the new code is swapped into the existing function object (subclasses and wrappers keep
#   running it).
# Affected: every final release from 0.5.1 to 0.5.17 (scripts/sweep_releases.py reads them
#   all); fixed in 0.5.18.
# Delete when: flashfix no longer supports SGLang older than 0.5.18.

FP8_ID = "sglang-fp8-kv-scales"
FLASHINFER_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"


def _paged_calls(func_def, method):
    return [
        call
        for call in _source.method_calls(func_def, method)
        if isinstance(call.func.value, ast.Name) and call.func.value.id == "prefill_wrapper_paged"
    ]


FP8_SCALE_SPELLINGS = (("k_scale_float", "v_scale_float"), ("k_scale", "v_scale"))  # layer.<k>, layer.<v>


def _fp8_site(func_def):
    """((the paged ``forward_return_lse`` call, the paged ``forward`` call's (k_scale, v_scale)
    expressions) or None, Shape) for ``forward_extend``."""
    if func_def is None:
        return None, Shape(UNKNOWN, "FlashInferAttnBackend.forward_extend not found")
    lse = _paged_calls(func_def, "forward_return_lse")
    if len(lse) != 1:
        return None, Shape(UNKNOWN, "expected one prefill_wrapper_paged.forward_return_lse call in "
                                    "forward_extend, found %d" % len(lse))
    call = lse[0]
    if any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
        return None, Shape(UNKNOWN, "the paged forward_return_lse call passes *args/**kwargs")
    given = _source.keywords(call)
    if "k_scale" in given and "v_scale" in given:
        return None, Shape(FIXED, "the paged forward_return_lse in forward_extend passes k_scale/v_scale")
    if "k_scale" in given or "v_scale" in given:
        return None, Shape(UNKNOWN, "the paged forward_return_lse passes only one of k_scale/v_scale")
    if len(call.args) != 2:
        return None, Shape(UNKNOWN, "the paged forward_return_lse call takes %d positional arguments, "
                                    "expected (q, kv_cache)" % len(call.args))
    if "layer" not in [a.arg for a in func_def.args.args]:
        return None, Shape(UNKNOWN, "forward_extend has no 'layer' argument")
    forward = _paged_calls(func_def, "forward")
    model = _source.keywords(forward[0]) if len(forward) == 1 else {}
    scales = (model.get("k_scale"), model.get("v_scale"))
    if not any(_is_attr_of(scales[0], "layer", k) and _is_attr_of(scales[1], "layer", v)
               for k, v in FP8_SCALE_SPELLINGS):
        return None, Shape(UNKNOWN, "the paged prefill forward call does not pass k_scale/v_scale as %s"
                           % " or ".join("layer.%s/layer.%s" % pair for pair in FP8_SCALE_SPELLINGS))
    return (call, scales), Shape(BUGGY, "the paged forward_return_lse in forward_extend (line %d) omits "
                                        "k_scale/v_scale that the paged forward call passes (%s, %s)" % (
                                            call.lineno, _source.source_of(scales[0]), _source.source_of(scales[1])))


def _fp8_probe(trees):
    return _fp8_site(_source.find_def(trees[FLASHINFER_BACKEND], "FlashInferAttnBackend.forward_extend"))[1]


def _fp8_edit(func_def, mark):
    """Give the paged ``forward_return_lse`` of ``forward_extend`` the scale arguments of the
    paged ``forward`` call (copies of that call's own expressions), ``mark`` before it."""
    found, shape = _fp8_site(func_def)
    if shape.kind != BUGGY:
        raise ShapeError(shape.reason)
    call, scales = found
    for name, value in zip(("k_scale", "v_scale"), scales):
        call.keywords.append(ast.keyword(arg=name, value=copy.deepcopy(value)))
    _source.insert_before(func_def, call, mark)


def _fp8_prepare(modules):
    func = _function_at(modules[FLASHINFER_BACKEND], "FlashInferAttnBackend.forward_extend")
    return [_registry.rewrite(func, _fp8_edit, FP8_ID)]


FP8_KV_SCALES = Patch(
    id=FP8_ID,
    engine="sglang",
    targets=(FLASHINFER_BACKEND,),
    versions=VERSIONS,
    upstream=UPSTREAM,
    fixed_in=FIXED_IN,
    delete_when=DELETE_WHEN,
    summary="FlashInferAttnBackend.forward_extend: the paged forward_return_lse of the ragged+paged "
            "prefill now gets k_scale/v_scale, so an FP8 KV cache prefix is read scaled",
    probe=_fp8_probe,
    prepare=_fp8_prepare,
)


# --- 2. FlashInfer autotune of the modelopt FP8 GEMM on SM120 ----------------------------------
#
# Why: SGLang decides once per runner whether to run FlashInfer's autotuner. For modelopt FP8
#   checkpoints the condition is ``model_uses_modelopt_fp8 and is_sm100_supported()``. SM120
#   (RTX PRO 6000 / RTX 50xx Blackwell) counts as Blackwell elsewhere and is routed to the
#   same tunable FlashInfer CUTLASS FP8 GEMM as SM100, but is never tuned there, so the
#   kernel runs its default tactic (-1) for the whole server's life: a performance loss,
#   not a wrong result.
# How: in the one ``and`` operand ``is_sm100_supported()`` becomes
#   ``(is_sm100_supported() or is_sm120_supported())``; nothing else changes, so every
#   existing "no" (not CUDA, disabled, compute capability < 9, speculative-draft rules)
#   stays no. ``is_sm120_supported`` is added to the function's own
#   ``from sglang.srt.utils import is_sm100_supported``, or, where the helper is a module
#   global, set on the module as a second (revertible) change.
# Where the decision lives (the patch waits for the module that defines it in this release,
#   found from the source text when ``sglang`` is imported, so a process that imports only
#   that module, as SGLang's own autotune tests do, is patched too):
#   - 0.5.1 to 0.5.5.post3: no FlashInfer autotune at all (no decision function anywhere in
#     those modules, no import of FlashInfer's autotuner, no mention of autotuning): not
#     affected. Anything about autotuning there without a known decision is unknown-shape;
#   - 0.5.6 to 0.5.13: ``ModelRunner._should_run_flashinfer_autotune`` in model_runner.py, MoE
#     and FP4 GEMM only, no FP8 condition: not affected;
#   - 0.5.14: method ``BaseRunner._should_run_flashinfer_autotune`` (runner/base_runner.py);
#   - 0.5.15 to 0.5.17: function ``should_run_flashinfer_autotune`` in
#     runner/flashinfer_autotune.py, imported by name into base_runner.py and the EAGLE draft
#     graph runners (the code swap reaches those copies);
#   - 0.5.18 and later: rewritten around ``flashinfer_per_tensor_fp8_supported()``: fixed.
# Delete when: flashfix no longer supports SGLang older than 0.5.18.

AUTOTUNE_ID = "sglang-sm120-fp8-autotune"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
AUTOTUNE_SITES = (  # (module, qualified name), oldest layout first
    (MODEL_RUNNER, "ModelRunner._should_run_flashinfer_autotune"),
    ("sglang.srt.model_executor.runner.base_runner", "BaseRunner._should_run_flashinfer_autotune"),
    ("sglang.srt.model_executor.runner.flashinfer_autotune", "should_run_flashinfer_autotune"),
)
FP8_AUTOTUNE_FIXED_MARKS = ("is_sm120_supported", "flashinfer_per_tensor_fp8_supported")


def _words(node):
    """The identifiers and strings that ``node`` itself spells (not its children's): a def or
    class name, an imported module or name, a name, an attribute, a keyword or argument name,
    a string constant."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        words = [node.name]
    elif isinstance(node, ast.ImportFrom):
        words = [node.module]
    elif isinstance(node, ast.alias):
        words = [node.name, node.asname]
    elif isinstance(node, ast.Name):
        words = [node.id]
    elif isinstance(node, ast.Attribute):
        words = [node.attr]
    elif isinstance(node, (ast.keyword, ast.arg)):
        words = [node.arg]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = [node.value]
    else:
        words = []
    return [w for w in words if w]


def _mentions(node, text):
    return any(isinstance(n, ast.Constant) and n.value == text for n in ast.walk(node))


def _autotune_site(func_def):
    """(the ``is_sm100_supported()`` call and its ``and`` expression, or None, Shape)."""
    for name in FP8_AUTOTUNE_FIXED_MARKS:
        if _source.name_calls(func_def, name):
            return None, Shape(FIXED, "the autotune decision calls %s()" % name)
    sm100 = _source.name_calls(func_def, "is_sm100_supported")
    modelopt_fp8 = _mentions(func_def, "modelopt_fp8")
    if not sm100 and not modelopt_fp8:
        return None, Shape(ABSENT, "the autotune decision (%s) has no FP8-GEMM condition" % func_def.name)
    if len(sm100) != 1 or not modelopt_fp8:
        return None, Shape(UNKNOWN, "expected one is_sm100_supported() call in a modelopt_fp8 condition "
                                    "of %s, found %d" % (func_def.name, len(sm100)))
    call = sm100[0]
    owners = [n for n in ast.walk(func_def)
              if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.And) and any(v is call for v in n.values)]
    if len(owners) != 1 or owners[0].values[-1] is not call or call.args or call.keywords:
        return None, Shape(UNKNOWN, "is_sm100_supported() in %s is not the last operand of an 'and'" % func_def.name)
    return (call, owners[0]), Shape(BUGGY, "%s (line %d) autotunes the modelopt FP8 GEMM on SM100 only"
                                           % (func_def.name, call.lineno))


def _autotune_traces(tree):
    """Whatever in ``tree`` is about autotuning: a def, class, import, name, attribute, keyword,
    argument or string that says "autotun" (any case), as short descriptions."""
    traces = []
    for node in ast.walk(tree):
        hits = [w for w in _words(node) if "autotun" in w.lower()]
        if hits:
            traces.append("%s %r (line %s)" % (_WORD_KINDS.get(type(node), type(node).__name__),
                                               " ".join(hits[0].split())[:50], getattr(node, "lineno", "?")))
    return traces


_WORD_KINDS = {ast.FunctionDef: "def", ast.AsyncFunctionDef: "def", ast.ClassDef: "class",
               ast.ImportFrom: "import from", ast.alias: "import", ast.Name: "name", ast.Attribute: "attribute",
               ast.keyword: "keyword", ast.arg: "argument", ast.Constant: "string"}


def _autotune_absence(trees):
    """Shape when no autotune decision was found in ``trees`` ({module: AST, None, SOURCELESS}):
    not affected only if nothing there is about autotuning at all."""
    sourceless = [m for m, t in trees.items() if t is _source.SOURCELESS]
    if sourceless:
        return Shape(UNKNOWN, "expected one flashinfer autotune decision, found nowhere; the source of %s is "
                              "not available" % ", ".join(sourceless))
    traces = {m: _autotune_traces(t) for m, t in trees.items() if t is not None}
    if any(traces.values()):
        return Shape(UNKNOWN, "expected one flashinfer autotune decision, found nowhere, but %s" % "; ".join(
            "%s has %s%s" % (m, ", ".join(found[:3]), " and %d more" % (len(found) - 3) if len(found) > 3 else "")
            for m, found in traces.items() if found))
    read = [m for m, t in trees.items() if t is not None]
    missing = [m for m, t in trees.items() if t is None]
    return Shape(ABSENT, "no FlashInfer autotune in this release: nothing in %s defines an autotune decision, "
                         "imports an autotuner or mentions autotuning%s"
                 % (", ".join(read), "; no module %s" % ", ".join(missing) if missing else ""))


def _autotune_locate(tree_of):
    """(module name, qualified name, def node, Shape) of the one autotune decision;
    ``tree_of(module name)`` gives a module's AST, None or ``SOURCELESS``. Where there is no
    decision and nothing else about autotuning either: (None, None, None, ABSENT)."""
    found = []
    trees = {}
    for modname, qualname in AUTOTUNE_SITES:
        tree = trees[modname] = tree_of(modname)
        node = _source.find_def(tree, qualname) if isinstance(tree, ast.Module) else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((modname, qualname, node))
    if not found:
        return None, None, None, _autotune_absence(trees)
    if len(found) != 1:
        where = ", ".join("%s:%s" % (m, q) for m, q, _ in found) or "nowhere"
        return None, None, None, Shape(UNKNOWN, "expected one flashinfer autotune decision, found %s" % where)
    modname, qualname, node = found[0]
    return modname, qualname, node, _autotune_site(node)[1]


def _autotune_targets():
    """The module that defines the decision in the installed layout (from its definitions, not
    its text: a comment or string that spells the name defines nothing), or model_runner where
    none or several do (the probe then says why). Runs when ``sglang`` is imported: a module
    whose text never spells the name is not parsed, and nothing parsed here is kept."""
    defining = []
    for modname, qualname in AUTOTUNE_SITES:
        found = _locate.find(modname)
        if found is None or found.text is None:
            continue
        try:
            node = _source.find_def(_source.Module(found.text, found.origin), qualname)
        except (ShapeError, SyntaxError, ValueError):  # defined, but not readably: the probe says why
            node = True
        if node is not None:
            defining.append(modname)
    return (defining[0],) if len(set(defining)) == 1 else (MODEL_RUNNER,)


def _autotune_probe(trees):
    def tree_of(modname):
        return trees[modname] if modname in trees else _source.module_ast(modname)

    return _autotune_locate(tree_of)[3]


def _local_import_of(func_def, name):
    """The ``from M import ..., name`` inside ``func_def`` that binds ``name``, or None."""
    for node in ast.walk(func_def):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return node
    return None


def _autotune_prepare(modules):
    modname, qualname, _, shape = _autotune_locate(lambda name: _source.module_ast(name, modules))
    if shape.kind != BUGGY:
        raise ShapeError(shape.reason)
    return _autotune_changes(_loaded(modname), qualname)


def _autotune_edit(func_def, mark, binds, is_global):
    """The edit of the decision (see the comment above); returns the names to add to the
    module's globals. ``binds(module, name)``: that module has that name; ``is_global(name)``:
    the decision's module has that global. The runtime answers them from the imported modules,
    ``flashfix diff`` from the source."""
    found, shape = _autotune_site(func_def)
    if shape.kind != BUGGY:
        raise ShapeError(shape.reason)
    call, _ = found
    either = ast.BoolOp(op=ast.Or(), values=[call, ast.Call(ast.Name("is_sm120_supported", ast.Load()), [], [])])
    _source.replace_node(func_def, call, either)
    added = []
    local = _local_import_of(func_def, "is_sm100_supported")
    if local is not None:
        if local.level or not local.module or not binds(local.module, "is_sm120_supported"):
            raise ShapeError("is_sm100_supported is imported from %s%s, which has no is_sm120_supported"
                             % ("." * local.level, local.module or ""))
        if _local_import_of(func_def, "is_sm120_supported") is None:
            local.names.append(ast.alias(name="is_sm120_supported"))
    elif not is_global("is_sm100_supported"):
        raise ShapeError("is_sm100_supported is neither imported in %s nor a global of its module" % func_def.name)
    elif not is_global("is_sm120_supported"):
        added.append("is_sm120_supported")
    _source.insert_before(func_def, either, mark)
    return added


def _autotune_changes(module, qualname):
    """The changes that fix the decision ``qualname`` of ``module`` (see the comment above)."""
    func = _function_at(module, qualname)
    utils = _loaded("sglang.srt.utils")
    sm120 = getattr(utils, "is_sm120_supported", None)
    if not callable(sm120):
        raise ShapeError("sglang.srt.utils has no is_sm120_supported")
    added = []

    def edit(func_def, mark):
        added.extend(_autotune_edit(func_def, mark, lambda m, name: hasattr(_loaded(m), name),
                                    lambda name: name in func.__globals__))

    swap = _registry.rewrite(func, edit, AUTOTUNE_ID)
    return [_registry.SetAttr(module, name, sm120) for name in added] + [swap]


SM120_FP8_AUTOTUNE = Patch(
    id=AUTOTUNE_ID,
    engine="sglang",
    targets=_autotune_targets,
    versions=VERSIONS,
    upstream=UPSTREAM,
    fixed_in=FIXED_IN,
    delete_when=DELETE_WHEN,
    summary="FlashInfer autotune decision: the modelopt FP8 GEMM is autotuned on SM120 as on SM100",
    probe=_autotune_probe,
    prepare=_autotune_prepare,
)


# --- 3. is_image_understandable_model keyed on the vision tower, not the attribute -------------
#
# Why: ``ModelConfig.__init__`` sets ``is_image_understandable_model`` from
#   ``hasattr(self.hf_config, "vision_config")``. Several config classes (deepseek_ocr,
#   deepseekvl2, janus_pro, ...) and any config.json with ``"vision_config": null`` have the
#   attribute set to None; such a text-only model is then reported image-capable
#   (``/model_info``) and warmed up with an image request.
# How: that one ``hasattr(X, "vision_config")`` becomes
#   ``getattr(X, "vision_config", None) is not None``, by recompiling ``__init__`` from its
#   source and swapping the code into the existing function.
# Affected: 0.5.5.post1 (where the attribute first appears) to 0.5.17; fixed in 0.5.18.
#   0.5.1 to 0.5.5 have no is_image_understandable_model: not affected. A module that mentions
#   it anywhere without the known computation in ``__init__`` is unknown-shape.
# Delete when: flashfix no longer supports SGLang older than 0.5.18.

VISION_ID = "sglang-vision-config"
MODEL_CONFIG = "sglang.srt.configs.model_config"


def _is_tower_check(node):
    """``getattr(X, "vision_config", None) is not None``."""
    return (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.IsNot)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value is None
        and isinstance(node.left, ast.Call)
        and isinstance(node.left.func, ast.Name)
        and node.left.func.id == "getattr"
        and len(node.left.args) >= 2
        and isinstance(node.left.args[1], ast.Constant)
        and node.left.args[1].value == "vision_config"
    )


def _vision_site(func_def):
    """(the ``hasattr(X, "vision_config")`` call or None, Shape) in ``ModelConfig.__init__``."""
    if func_def is None:
        return None, Shape(UNKNOWN, "ModelConfig.__init__ not found")
    computed = [
        node for node in ast.walk(func_def)
        if isinstance(node, ast.Assign)
        and any(_is_attr_of(t, "self", "is_image_understandable_model") for t in node.targets)
        and not isinstance(node.value, ast.Constant)
    ]
    if not computed:
        return None, Shape(UNKNOWN, "ModelConfig.__init__ does not compute is_image_understandable_model")
    if any(_is_tower_check(n) for a in computed for n in ast.walk(a.value)):
        return None, Shape(FIXED, "is_image_understandable_model tests getattr(..., 'vision_config', None) is not None")
    checks = [
        call for a in computed for call in _source.name_calls(a.value, "hasattr")
        if len(call.args) == 2 and not call.keywords
        and isinstance(call.args[1], ast.Constant) and call.args[1].value == "vision_config"
    ]
    if len(computed) != 1 or len(checks) != 1:
        return None, Shape(UNKNOWN, "expected one hasattr(..., 'vision_config') in the one computation of "
                                    "is_image_understandable_model, found %d in %d" % (len(checks), len(computed)))
    return checks[0], Shape(BUGGY, "is_image_understandable_model (line %d) tests hasattr(..., 'vision_config')"
                                   % checks[0].lineno)


VISION_ATTR = "is_image_understandable_model"


def _mentions_word(tree, word):
    """``word`` appears in ``tree`` as (part of) a name, attribute, def, keyword, argument,
    imported name or string."""
    return any(word in w for node in ast.walk(tree) for w in _words(node))


def _vision_probe(trees):
    tree = trees[MODEL_CONFIG]
    shape = _vision_site(_source.find_def(tree, "ModelConfig.__init__"))[1]
    if shape.kind in (BUGGY, FIXED):  # __init__ assigns the attribute: the module mentions it
        return shape  # (decided from that method alone, without walking the whole module)
    cls = _source.find_def(tree, "ModelConfig")
    if not _mentions_word(tree, VISION_ATTR) and isinstance(cls, ast.ClassDef):
        if any(not (isinstance(b, ast.Name) and b.id == "object") for b in cls.bases) or cls.keywords:
            return Shape(UNKNOWN, "%s never mentions %s, but ModelConfig has a base class that might set it"
                         % (MODEL_CONFIG, VISION_ATTR))
        return Shape(ABSENT, "ModelConfig has no %s in this release (%s never assigns or mentions it)"
                     % (VISION_ATTR, MODEL_CONFIG))
    return shape


def _vision_edit(func_def, mark):
    """The edit: ``hasattr(X, "vision_config")`` becomes ``getattr(X, "vision_config", None) is
    not None`` (also used by ``flashfix diff``)."""
    call, shape = _vision_site(func_def)
    if shape.kind != BUGGY:
        raise ShapeError(shape.reason)
    fetch = ast.Call(ast.Name("getattr", ast.Load()), [call.args[0], ast.Constant("vision_config"),
                                                      ast.Constant(None)], [])
    _source.replace_node(func_def, call, ast.Compare(fetch, [ast.IsNot()], [ast.Constant(None)]))
    _source.insert_before(func_def, fetch, mark)


def _vision_prepare(modules):
    func = _function_at(modules[MODEL_CONFIG], "ModelConfig.__init__")
    return [_registry.rewrite(func, _vision_edit, VISION_ID)]


VISION_CONFIG = Patch(
    id=VISION_ID,
    engine="sglang",
    targets=(MODEL_CONFIG,),
    versions=VERSIONS,
    upstream=UPSTREAM,
    fixed_in=FIXED_IN,
    delete_when=DELETE_WHEN,
    summary="ModelConfig.is_image_understandable_model: true only if hf_config.vision_config is not None",
    probe=_vision_probe,
    prepare=_vision_prepare,
)


PATCHES = (FP8_KV_SCALES, SM120_FP8_AUTOTUNE, VISION_CONFIG)
