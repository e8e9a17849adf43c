"""SGLang patches: backports of sgl-project/sglang PR #34217 (merged 2026-08-10, first in 0.5.18).

That PR fixes three unrelated small things; each is its own ``Patch`` here so that each can
be judged, disabled (``FLASHFIX_DISABLE=<id>``) and deleted on its own. Importing this
module only declares the patches: no SGLang, torch or FlashInfer module is imported, so
``flashfix doctor`` can load it. Every probe decides from the source text (``ast``) alone.

The FP8-scale and vision fixes are declared as semantic patches (``flashfix.semantic``: the
upstream change as before -> after code); the autotune fix is written by hand (see its doc).
Measured with the engine imported on the PyPI releases 0.5.11, 0.5.13, 0.5.14, 0.5.17, 0.5.18
and 0.5.23 (tests/test_sglang_real.py); every final release from 0.5.1 on is judged from its
wheel's source by scripts/sweep_releases.py (tests/test_sweep.py).
"""

import ast
import importlib
import sys

from flashfix import semantic
from flashfix.core import locate as _locate
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, Patch, Shape
from flashfix.core.source import ShapeError
from flashfix.semantic import Backport, _own_function, function_at as _function_at, words as _words  # noqa: F401

UPSTREAM = "https://github.com/sgl-project/sglang/pull/34217"
FIXED_IN = "0.5.18"
# Every PyPI release from 0.5.1 to 0.5.17 carries the pre-fix shape, and 0.5.18 and later carry
# the fix, which the probes recognise whatever the version says. The range is open above on
# purpose: a post-release branch or a vendor build numbered 0.5.18 or later without #34217 is
# the same code and gets the same fix (tested on 0.5.18's and 0.5.23's own source with #34217
# reverted, tests/test_sglang_derived.py); the probes answer "patch" only on the pre-fix shape.
VERSIONS = ">=0.5.1"
DELETE_WHEN = "flashfix no longer supports SGLang older than 0.5.18"
FLASHINFER_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"
MODEL_CONFIG = "sglang.srt.configs.model_config"
FP8_ID, AUTOTUNE_ID, VISION_ID = "sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune", "sglang-vision-config"


def _loaded(modname):
    """An engine module the patch needs; already imported in every case measured (the
    target's own import pulls it in), imported here otherwise."""
    module = sys.modules.get(modname)
    return module if module is not None else importlib.import_module(modname)


FP8_KV_SCALES = Backport(
    id=FP8_ID, engine="sglang", versions=VERSIONS, upstream=UPSTREAM, fixed_in=FIXED_IN,
    module=FLASHINFER_BACKEND, function="FlashInferAttnBackend.forward_extend",
    before="prefill_wrapper_paged.forward_return_lse($Q, $KV, **$$$KW)",
    after="prefill_wrapper_paged.forward_return_lse($Q, $KV, **$$$KW, k_scale=$K, v_scale=$V)",
    where="prefill_wrapper_paged.forward($$$_, k_scale=$K, v_scale=$V, **$$$_)",
    fixed="the paged forward_return_lse in forward_extend passes k_scale/v_scale",
    buggy="the paged forward_return_lse in forward_extend (line {line}) omits k_scale/v_scale that the paged "
          "forward call passes ({K}, {V})",
    summary="FlashInferAttnBackend.forward_extend: the paged forward_return_lse of the ragged+paged "
            "prefill now gets k_scale/v_scale, so an FP8 KV cache prefix is read scaled",
    doc="""Why: of forward_extend's paged FlashInfer calls, forward (and forward_decode) pass the FP8
    KV-cache scales; forward_return_lse of the ragged+paged split (an extend over a cached prefix)
    does not, so an FP8 prefix is read unscaled (relative error 187 on an H200, 0.0033 scaled).
    How: the call gets the very scale expressions the sibling paged forward passes ($K, $V bind
    0.5.1's layer.k_scale and 0.5.2+'s layer.k_scale_float alike). Without scales both are None.
    Affected: every final release from 0.5.1 to 0.5.17.

    Delete when: flashfix no longer supports SGLang older than 0.5.18.""")


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
# Written by hand, not as a Backport: the decision moves between three modules and two
#   names (found from the source, procedurally), the fix is recognised by a call that is not
#   the after-form (0.5.18 rewrote the decision), "not affected" needs two separate facts, and
#   the edit also adds ``is_sm120_supported`` to an import or the module's globals. The one
#   expression edit itself is the pattern pair below (``flashfix.semantic``).
# Delete when: flashfix no longer supports SGLang older than 0.5.18.

MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
AUTOTUNE_SITES = (  # (module, qualified name), oldest layout first
    (MODEL_RUNNER, "ModelRunner._should_run_flashinfer_autotune"),
    ("sglang.srt.model_executor.runner.base_runner", "BaseRunner._should_run_flashinfer_autotune"),
    ("sglang.srt.model_executor.runner.flashinfer_autotune", "should_run_flashinfer_autotune"),
)
FP8_AUTOTUNE_FIXED_MARKS = ("is_sm120_supported", "flashinfer_per_tensor_fp8_supported")
_SM100_ONLY = semantic.pattern("$$$A and is_sm100_supported()")
_SM100_OR_SM120 = semantic.pattern("$$$A and (is_sm100_supported() or is_sm120_supported())")


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
    found = semantic.find(_SM100_ONLY, [func_def])
    if len(found) != 1:
        return None, Shape(UNKNOWN, "is_sm100_supported() in %s is not the last operand of an 'and'" % func_def.name)
    return found[0], Shape(BUGGY, "%s (line %d) autotunes the modelopt FP8 GEMM on SM100 only"
                                  % (func_def.name, sm100[0].lineno))


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
    node, bindings = found
    either = semantic.build(_SM100_OR_SM120, bindings)
    _source.replace_node(func_def, node, either)
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


def _autotune_plan(plan):
    """``flashfix diff``: ``_autotune_changes`` with its questions about the imported modules
    (``hasattr``, the function's globals) asked of the source instead."""
    from flashfix.tools import diff as _diff

    modname, qualname, _, shape = _autotune_locate(_source.module_ast)
    if shape.kind != BUGGY:
        raise ShapeError(shape.reason)
    if not _diff.binds("sglang.srt.utils", "is_sm120_supported"):
        raise ShapeError("sglang.srt.utils has no is_sm120_supported")
    added = []

    def edit(func_def, mark):
        added.extend(_autotune_edit(func_def, mark, _diff.binds, lambda name: _diff.binds(modname, name)))

    swap = plan.rewrite(modname, qualname, edit)
    if added:  # the runtime's order: the global first, then the code swap
        plan.changes.remove(swap)
        plan.add_name(modname, "is_sm120_supported", "sglang.srt.utils", "is_sm120_supported")
        plan.changes.append(swap)


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
    plan=_autotune_plan,
)


VISION_CONFIG = Backport(
    id=VISION_ID, engine="sglang", versions=VERSIONS, upstream=UPSTREAM, fixed_in=FIXED_IN,
    module=MODEL_CONFIG, function="ModelConfig.__init__", absent_unless_mentioned="is_image_understandable_model",
    inside="self.is_image_understandable_model = $_",
    before='hasattr($X, "vision_config")', after='getattr($X, "vision_config", None) is not None',
    fixed="is_image_understandable_model tests getattr(..., 'vision_config', None) is not None",
    buggy="is_image_understandable_model (line {line}) tests hasattr(..., 'vision_config')",
    summary="ModelConfig.is_image_understandable_model: true only if hf_config.vision_config is not None",
    doc="""Why: several config classes (deepseek_ocr, deepseekvl2, janus_pro, ...) and any config.json
    with "vision_config": null carry the attribute set to None; such a text-only model is then
    reported image-capable (/model_info) and warmed up with an image request.
    Affected: 0.5.5.post1 (where the attribute first appears) to 0.5.17; 0.5.1 to 0.5.5 never
    mention it (not affected), unless ModelConfig has a base class that might set it.

    Delete when: flashfix no longer supports SGLang older than 0.5.18.""")


PATCHES = (FP8_KV_SCALES, SM120_FP8_AUTOTUNE, VISION_CONFIG)
