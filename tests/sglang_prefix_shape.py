"""Pre-fix shapes of SGLang releases that carry PR #34217, derived at test time (tests/test_sglang_derived.py).

The derivations come from flashfix's own declarations: every SGLang patch declared as a
semantic backport (``flashfix.semantic.Backport``: today the FP8 scales of the paged
``forward_return_lse`` in ``FlashInferAttnBackend.forward_extend`` and the vision-tower test of
``ModelConfig.__init__``) is applied backwards, after -> before, to the installed fixed release's
module (``semantic.derive_prefix``): only the statement holding the one after-form changes, the
rest of the file keeps its text. It raises unless the fixed file has exactly that one form.
The derived text is written to a temporary file that ``install`` serves under the real module name.

The autotune part of #34217 is not derived: from 0.5.18 the modelopt-FP8 autotune decision is
``flashinfer_per_tensor_fp8_supported()`` (SM90, SM100 or SM120, a helper that also decides at
import whether FlashInfer's FP8 bmm kernel is registered), not the ``... and
is_sm100_supported()`` operand that #34217 widened; no edit of the release takes out "SM120 for
autotune" alone, so there is no pre-fix shape of it to restore (see ``autotune_fp8_condition``).
"""

import ast
import functools
import importlib.util
import os
import sys

import this_checkout

this_checkout.flashfix()
from flashfix import semantic, sglang_patch  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

FLASHINFER_BACKEND = "sglang.srt.layers.attention.flashinfer_backend"
MODEL_CONFIG = "sglang.srt.configs.model_config"
AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"
# PR #34217's derivable declarations (the MoE clamp fix has its own derived check, tests/test_moe_fixes.py)
DECLARED = [p for p in sglang_patch.PATCHES if p.id in (sglang_patch.FP8_ID, sglang_patch.VISION_ID)]
DERIVE = {p.targets[0]: functools.partial(semantic.derive_prefix, p) for p in DECLARED}


def autotune_fp8_condition(fixed_source):
    """How the release decides the modelopt-FP8 autotune: the value assigned to
    ``fp8_gemm_needs_autotune`` under the modelopt test, and whether the decision calls
    ``is_sm100_supported`` (the operand #34217 widened) at all."""
    func = _source.find_def(ast.parse(fixed_source), "should_run_flashinfer_autotune")
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
