"""Pre-fix shapes of SGLang releases that carry PR #34217, derived at test time (tests/test_sglang_derived.py).

``derive_fp8_source`` and ``derive_vision_source`` rebuild, from an installed fixed release's own
files, the code as it would be without the two parts of #34217 that can be reverted on their own:

* ``sglang/srt/layers/attention/flashinfer_backend.py``: the paged ``forward_return_lse`` call of
  ``FlashInferAttnBackend.forward_extend`` loses its ``k_scale=layer.k_scale_float,
  v_scale=layer.v_scale_float`` keywords (the paged ``forward`` call keeps its own);
* ``sglang/srt/configs/model_config.py``: the ``getattr(X, "vision_config", None) is not None``
  test of ``is_image_understandable_model`` in ``ModelConfig.__init__`` becomes
  ``hasattr(X, "vision_config")``.

Each raises unless the fixed file has exactly the one piece to revert. Everything else stays as
the release has it. Nothing is copied from upstream: the edits are AST transformations of the
installed file, written to a temporary file that ``install`` serves under the real module name.

The autotune part of #34217 is not derived: from 0.5.18 the modelopt-FP8 autotune decision is
``flashinfer_per_tensor_fp8_supported()`` (SM90, SM100 or SM120, a helper that also decides at
import whether FlashInfer's FP8 bmm kernel is registered), not the ``... and
is_sm100_supported()`` operand that #34217 widened; no edit of the release takes out "SM120 for
autotune" alone, so there is no pre-fix shape of it to restore (see ``autotune_fp8_condition``).
"""

import ast
import importlib.util
import os
import sys

FLASHINFER_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"
MODEL_CONFIG = "sglang.srt.configs.model_config"
AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"


def _find(tree, qualname):
    node = tree
    for part in qualname.split("."):
        node = next(c for c in node.body if getattr(c, "name", None) == part)
    return node


def _paged_calls(func, method):
    return [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == method and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "prefill_wrapper_paged"]


def derive_fp8_source(fixed_source):
    """``flashinfer_backend.py`` without the FP8 scales of the paged ``forward_return_lse``."""
    tree = ast.parse(fixed_source)
    func = _find(tree, "FlashInferAttnBackend.forward_extend")
    (call,) = _paged_calls(func, "forward_return_lse")
    scales = [kw for kw in call.keywords if kw.arg in ("k_scale", "v_scale")]
    assert [(kw.arg, ast.unparse(kw.value)) for kw in scales] == [
        ("k_scale", "layer.k_scale_float"), ("v_scale", "layer.v_scale_float")], ast.unparse(call)
    call.keywords = [kw for kw in call.keywords if kw not in scales]
    (forward,) = _paged_calls(func, "forward")  # the paged forward call keeps its scales
    assert {"k_scale", "v_scale"} <= {kw.arg for kw in forward.keywords}
    return ast.unparse(tree) + "\n"


def _is_tower_check(node):
    return (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.IsNot)
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None
            and isinstance(node.left, ast.Call) and isinstance(node.left.func, ast.Name)
            and node.left.func.id == "getattr" and len(node.left.args) == 3
            and [ast.unparse(a) for a in node.left.args[1:]] == ["'vision_config'", "None"])


def derive_vision_source(fixed_source):
    """``model_config.py`` with ``hasattr(X, "vision_config")`` for the vision-tower test."""
    tree = ast.parse(fixed_source)
    func = _find(tree, "ModelConfig.__init__")
    found = []
    for parent in ast.walk(func):
        for field, value in ast.iter_fields(parent):
            if _is_tower_check(value):
                found.append((parent, field, None, value))
            elif isinstance(value, list):
                found.extend((parent, field, i, v) for i, v in enumerate(value) if _is_tower_check(v))
    assert len(found) == 1, [ast.unparse(f[3]) for f in found]
    parent, field, index, check = found[0]
    replacement = ast.Call(ast.Name("hasattr", ast.Load()), [check.left.args[0], ast.Constant("vision_config")], [])
    if index is None:
        setattr(parent, field, replacement)
    else:
        getattr(parent, field)[index] = replacement
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


DERIVE = {FLASHINFER_BACKEND: derive_fp8_source, MODEL_CONFIG: derive_vision_source}


def autotune_fp8_condition(fixed_source):
    """How the release decides the modelopt-FP8 autotune: the value assigned to
    ``fp8_gemm_needs_autotune`` under the modelopt test, and whether the decision calls
    ``is_sm100_supported`` (the operand #34217 widened) at all."""
    func = _find(ast.parse(fixed_source), "should_run_flashinfer_autotune")
    values = []
    for node in ast.walk(func):
        if isinstance(node, ast.If) and "'modelopt_fp8'" in ast.unparse(node.test):
            values += [ast.unparse(s.value) for s in node.body if isinstance(s, ast.Assign)
                       and ast.unparse(s.targets[0]) == "fp8_gemm_needs_autotune"]
    calls_sm100 = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "is_sm100_supported"
                      for n in ast.walk(func))
    return values, calls_sm100


class DerivedFinder:
    """Serves each module of ``paths`` (name -> file) from that file. Placed after flashfix's
    finder, so flashfix's post-import hook still wraps the loader, as for the real module."""

    def __init__(self, paths):
        self.paths = dict(paths)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.paths:
            return None
        return importlib.util.spec_from_file_location(fullname, self.paths[fullname])


def write_derived(tmpdir, installed):
    """Derive each module of ``installed`` (name -> installed fixed file) into ``tmpdir``;
    returns name -> derived file."""
    paths = {}
    for name, fixed_path in installed.items():
        with open(fixed_path) as handle:
            source = DERIVE[name](handle.read())
        paths[name] = os.path.join(tmpdir, name.rsplit(".", 1)[-1] + "_prefix.py")
        with open(paths[name], "w") as handle:
            handle.write(source)
    return paths


def install(paths):
    """Make ``import <name>`` load the derived file, behind flashfix's finder."""
    finders = sys.meta_path
    position = next((i + 1 for i, f in enumerate(finders) if getattr(f, "flashfix_finder", False)), 0)
    finders.insert(position, DerivedFinder(paths))
