"""The MoE and crash fixes against the engines' own code: vLLM #54160 (vllm-trtllm-fp8-moe-swiglu-gate),
vLLM #53111 (vllm-xqa-head-dim) and SGLang #39920 (sglang-trtllm-fp8-moe-swiglu-limit; its engine checks live in the SGLang processes of
tests/test_sglang_real.py, tests/sglang_real_check.py ``clamp_exercise``).

* vLLM 0.28.0 (affected) and 0.29.0 (fixed), one process each: ``TrtLlmFp8ExpertsBase.is_supported_config``
  of the release, with only the generic capability checks it delegates to answered "supported"
  (a CPU has no SM100), for MoE configs with and without a SwiGLU clamp/alpha/beta and with each
  FP8 scheme. 0.28.0 patched must answer as 0.29.0; reverted, it admits the clamp on every scheme.
  In 0.29.0's process the function is also run with its body swapped to the pre-fix shape derived
  from 0.29.0 (the bug), and to that shape with the declaration's edit (0.29.0's answers again).
* Without an engine process: the pre-fix shapes derived from the first fixed releases are judged
  ``patch``, and the edit turns them back into the fixed release's function (for the XQA fallback,
  whose warning text is flashfix's own: the same test and assignments, in the same place).
"""

import ast
import copy
import functools
import glob
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402

this_checkout.flashfix()
from flashfix import semantic, sglang_patch, vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402

GATE = vllm_patch.TRTLLM_FP8_SWIGLU_GATE
CLAMP = sglang_patch.TRTLLM_FP8_SWIGLU_LIMIT
# The gate's declaration without ``fixed_if`` (needed only for 0.30.0's relaxed form): its ``after``
# is upstream's 0.29.0 form, so derive_prefix can turn it back.
GATE_AS_0_29 = semantic.Backport(id="test-gate-0.29", engine="vllm", versions=">=0.28", fixed_in="0.29.0",
                                 upstream=GATE.upstream, summary="", doc="Delete when: never.",
                                 **vllm_patch.TRTLLM_FP8_SWIGLU)


def installed(requirement, relative):
    python = engine_env.env_python(requirement)
    (found,) = glob.glob(str(python.parent.parent / "lib" / "python*" / "site-packages" / relative))
    return Path(found).read_text()


def _def(text, qualname):
    node = ast.parse(text)
    for part in qualname.split("."):
        node = next(c for c in node.body if getattr(c, "name", None) == part)
    return node


def _restored(patch, derived, fixed, module, qualname):
    """The verdict on the derived text, and whether the edit turns its function into the fixed one."""
    verdict = _registry.judge(patch, {module: ast.parse(derived)}, "99.0" if patch.engine == "vllm" else "0.5.99")
    func = _def(derived, qualname)
    patch.rule.hunks[0].edit(func, ast.Pass())
    body = [s for s in func.body if not isinstance(s, ast.Pass)]  # the one-time marker
    return verdict, [ast.dump(s) for s in body] == [ast.dump(s) for s in _def(fixed, qualname).body]


def test_derived_prefix_shapes_are_patched_back_to_the_fixed_release():
    fixed = installed("vllm==0.29.0", "vllm/model_executor/layers/fused_moe/experts/trtllm_fp8_moe.py")
    derived = semantic.derive_prefix(GATE_AS_0_29, fixed)
    verdict, same = _restored(GATE, derived, fixed, GATE.targets[0], vllm_patch.TRTLLM_FP8_SWIGLU["function"])
    assert verdict[0] == "patch" and same, verdict
    # the derived shape is 0.28.0's: the same statements (0.28.0's file, other changes aside)
    released = installed("vllm==0.28.0", "vllm/model_executor/layers/fused_moe/experts/trtllm_fp8_moe.py")
    qualname = vllm_patch.TRTLLM_FP8_SWIGLU["function"]
    assert ast.dump(_def(derived, qualname)) == ast.dump(_def(released, qualname))

    fixed = installed("sglang==0.5.23", "sglang/srt/layers/quantization/fp8.py")
    derived = semantic.derive_prefix(CLAMP, fixed)
    verdict, same = _restored(CLAMP, derived, fixed, CLAMP.targets[0], CLAMP.rule.hunks[0].function)
    assert verdict[0] == "patch" and same, verdict
    assert "swiglu_limit" not in ast.unparse(_def(derived, CLAMP.rule.hunks[0].function))


def _drop_head_dim_fallback(text):
    """0.29.0's builder __init__ without the XQA head-dim fallback #53111 added (the pre-fix shape)."""
    init = _def(text, vllm_patch.XQA_HEAD_DIM.rule.hunks[0].function)
    (node,) = [n for n in init.body if isinstance(n, ast.If) and "16 <= self.head_dim <= 256" in ast.unparse(n.test)]
    lines = text.splitlines(True)
    return "".join(lines[:node.lineno - 1] + lines[node.end_lineno:])


def test_xqa_head_dim_fallback_on_the_derived_and_released_shapes():
    qualname = vllm_patch.XQA_HEAD_DIM.rule.hunks[0].function
    fixed = installed("vllm==0.29.0", "vllm/v1/attention/backends/flashinfer.py")
    derived = _drop_head_dim_fallback(fixed)
    for text in (derived, installed("vllm==0.28.0", "vllm/v1/attention/backends/flashinfer.py")):
        verdict = _registry.judge(vllm_patch.XQA_HEAD_DIM, {vllm_patch.TARGET: ast.parse(text)}, "0.28.0")
        assert verdict[0] == "patch", verdict
        func = _def(text, qualname)
        vllm_patch.XQA_HEAD_DIM.rule.hunks[0].edit(func, ast.Pass())
        ours = ast.parse(ast.unparse(func)).body[0]  # re-parsed: the edit's nodes as the source would give them
        (mine,) = [n for n in ours.body if isinstance(n, ast.If) and "16 <= self.head_dim" in ast.unparse(n.test)]
        (theirs,) = [n for n in _def(fixed, qualname).body if isinstance(n, ast.If)
                     and "16 <= self.head_dim" in ast.unparse(n.test)]
        assert ast.dump(mine.test) == ast.dump(theirs.test)
        assert [ast.dump(s) for s in mine.body[1:]] == [ast.dump(s) for s in theirs.body[1:]]  # after the warning
        before = [ast.unparse(s)[:60] for s in ours.body[ours.body.index(mine) - 1:ours.body.index(mine)]]
        assert before[0].startswith("self.flashinfer_trtllm_api_decode_kernel"), before
    assert _registry.judge(vllm_patch.XQA_HEAD_DIM, {vllm_patch.TARGET: ast.parse(fixed)}, "0.29.0")[0] == "fixed-upstream"


VLLM_SCRIPT = r"""
import ast, copy, importlib, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import flashfix
from flashfix import semantic, vllm_patch
from flashfix.core import registry as _registry
from flashfix.core import source as _source
GATE_AS_0_29 = semantic.Backport(id="test-gate-0.29", engine="vllm", versions=">=0.28", fixed_in="0.29.0", upstream="",
                                 summary="", doc="Delete when: never.", **vllm_patch.TRTLLM_FP8_SWIGLU)

def report(value):
    print("FLASHFIX_RESULT=" + json.dumps(value, default=str), flush=True)

m = importlib.import_module(vllm_patch.TRTLLM_FP8_SWIGLU["module"])
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
mk.FusedMoEExperts.is_supported_config = staticmethod(lambda *a: (True, None))  # the generic checks: a CPU has no SM100
base = m.TrtLlmFp8ExpertsBase
SCHEMES = {"per_tensor": (m.kFp8StaticTensorSym, m.kFp8StaticTensorSym) if hasattr(m, "kFp8StaticTensorSym") else None,
           "deepseek_block": (m.kFp8Static128BlockSym, m.kFp8Dynamic128Sym), "mxfp8": (m.kMxfp8Static, m.kMxfp8Dynamic)}
if SCHEMES["per_tensor"] is None:
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym
    SCHEMES["per_tensor"] = (kFp8StaticTensorSym, kFp8StaticTensorSym)

def cases():
    out = {}
    for scheme, (w, a) in SCHEMES.items():
        for name, swiglu in {"plain": {}, "limit": {"swiglu_limit": 7.0}, "alpha": {"swiglu_alpha": 1.702},
                             "beta": {"swiglu_beta": 1.0}}.items():
            for experts in (256, 4096):
                cfg = SimpleNamespace(**dict(dict(swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None), **swiglu),
                                      num_experts=experts)
                out["%%s/%%s/%%d" %% (scheme, name, experts)] = base.is_supported_config(m.TrtLlmFp8ExpertsMonolithic, cfg, w, a, None)[0]
    return out

importlib.import_module(vllm_patch.TARGET)  # the XQA fallback's target: decided at its import
row = next(r for r in flashfix.status() if r["id"] == vllm_patch.XQA_HEAD_DIM.id)
xqa = {"state": row["state"], "reason": row["reason"]}
row = next(r for r in flashfix.status() if r["id"] == vllm_patch.TRTLLM_FP8_SWIGLU_GATE.id)
out = {"state": row["state"], "reason": row["reason"], "cases": cases(), "xqa": xqa}
out["ran"] = next(r for r in flashfix.status() if r["id"] == row["id"])["ran"]
flashfix.revert(row["id"])
out["reverted"] = cases()
if row["state"] == "fixed-upstream":  # the pre-fix shape derived from this release, in the release's own function
    qualname = vllm_patch.TRTLLM_FP8_SWIGLU["function"]
    derived = _source.find_def(ast.parse(semantic.derive_prefix(GATE_AS_0_29, open(m.__file__).read())), qualname)
    func = base.__dict__["is_supported_config"].__func__
    def swap(edit_too):
        def edit(node, mark):
            node.body = copy.deepcopy(derived.body)
            if edit_too:
                vllm_patch.TRTLLM_FP8_SWIGLU_GATE.rule.hunks[0].edit(node, mark)
        change = _registry.rewrite(func, edit, "test-derived")
        change.apply()
        try:
            return cases()
        finally:
            change.undo()
    out["derived"], out["derived_patched"] = swap(False), swap(True)
report(out)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def vllm_report(release):
    (r,) = engine_env.run("vllm==" + release, VLLM_SCRIPT)
    return r


def test_vllm_trtllm_fp8_gate_matches_the_fixed_release():
    fixed, old = vllm_report("0.29.0"), vllm_report("0.28.0")
    assert fixed["state"] == "fixed-upstream" and old["state"] == "applied", (fixed, old)
    assert old["ran"] is True
    expected = fixed["cases"]
    # 0.29.0 refuses a clamp/alpha/beta except with MXFP8 weights, and more than 2048 experts
    assert expected["mxfp8/limit/256"] and expected["per_tensor/plain/256"] and expected["deepseek_block/plain/256"]
    assert not expected["per_tensor/limit/256"] and not expected["deepseek_block/alpha/256"]
    assert not expected["mxfp8/plain/4096"]
    assert old["cases"] == expected
    # as released, 0.28.0 admits the clamp on the per-tensor kernel (which has none): the bug
    assert old["reverted"]["per_tensor/limit/256"] and old["reverted"]["deepseek_block/beta/256"]
    assert old["reverted"] != expected
    # the pre-fix shape derived from 0.29.0 behaves as 0.28.0 released, and patched as 0.29.0
    assert fixed["derived"] == old["reverted"]
    assert fixed["derived_patched"] == expected
    assert fixed["reverted"] == expected  # nothing of the patch was applied on the fixed release
    # the XQA fallback: applied to 0.28.0's builder (its rewritten __init__ compiled), fixed upstream in 0.29.0
    assert old["xqa"]["state"] == "applied" and fixed["xqa"]["state"] == "fixed-upstream", (old["xqa"], fixed["xqa"])
