"""The MoE fixes against the engines' own code: vLLM #54160 (vllm-trtllm-fp8-moe-swiglu-gate) and
SGLang #39920 (sglang-trtllm-fp8-moe-swiglu-limit; its engine checks live in the SGLang processes of
tests/test_sglang_real.py, tests/sglang_real_check.py ``clamp_exercise``).

* vLLM 0.28.0 (affected) and 0.29.0 (fixed), one process each: ``TrtLlmFp8ExpertsBase.is_supported_config``
  of the release, with only the generic capability checks it delegates to answered "supported"
  (a CPU has no SM100), for MoE configs with and without a SwiGLU clamp/alpha/beta and with each
  FP8 scheme. 0.28.0 patched must answer as 0.29.0; reverted, it admits the clamp on every scheme.
  In 0.29.0's process the function is also run with its body swapped to the pre-fix shape derived
  from 0.29.0 (the bug), and to that shape with the declaration's edit (0.29.0's answers again).
* Without an engine process: the pre-fix shapes derived from the first fixed releases are judged
  ``patch``, and the edit turns them back into the fixed release's function.
"""

import ast
import functools
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402

this_checkout.flashfix()
from flashfix import semantic, sglang_patch, vllm_patch  # noqa: E402
from flashfix.core import locate as _locate, paths as _paths  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

GATE = vllm_patch.TRTLLM_FP8_SWIGLU_GATE
CLAMP = sglang_patch.TRTLLM_FP8_SWIGLU_LIMIT
# The gate's declaration without ``fixed_if`` (needed only for 0.30.0's relaxed form): its ``after``
# is upstream's 0.29.0 form, so derive_prefix can turn it back.
GATE_AS_0_29 = semantic.Backport(id="test-gate-0.29", engine="vllm", versions=">=0.28", fixed_in="0.29.0",
                                 upstream=GATE.upstream, summary="", doc="Delete when: never.",
                                 **vllm_patch.TRTLLM_FP8_SWIGLU)


def installed(requirement, relative):
    return engine_env.installed_path(requirement, relative).read_text()


def _def(text, qualname):
    return _source.find_def(ast.parse(text), qualname)


def _restored(patch, derived, fixed, module, qualname):
    """The verdict on the derived text, and whether the edit turns its function into the fixed one
    (the shape alone: what the fix ``requires`` is judged where the engine is, test_requires_*)."""
    verdict = _registry.judge(patch._replace(requires=None), {module: ast.parse(derived)},
                              "99.0" if patch.engine == "vllm" else "0.5.99")
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


VLLM_SCRIPT = r"""
import ast, copy, importlib, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
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

row = next(r for r in flashfix.status() if r["id"] == vllm_patch.TRTLLM_FP8_SWIGLU_GATE.id)
out = {"state": row["state"], "reason": row["reason"], "cases": cases()}
out["ran"] = next(r for r in flashfix.status() if r["id"] == row["id"])["ran"]
flashfix.revert(row["id"])
out["reverted"] = cases()
if row["state"] == "fixed-upstream":  # the pre-fix shape derived from this release, in the release's own function
    qualname = vllm_patch.TRTLLM_FP8_SWIGLU["function"]
    derived = _source.find_def(ast.parse(semantic.derive_prefix(GATE_AS_0_29, open(m.__file__).read())), qualname)
    func = base.__dict__["is_supported_config"].__func__
    out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(func, derived, vllm_patch.TRTLLM_FP8_SWIGLU_GATE.rule.hunks[0], cases)
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


def _wheel(metadata):
    """An in-memory wheel of one distribution whose METADATA is ``metadata``."""
    import io
    import zipfile

    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as z:
        z.writestr("eng/__init__.py", "")
        z.writestr("eng-1.0.dist-info/METADATA", metadata)
    return _paths.ZipReader(zipfile.ZipFile(data), "eng-1.0-py3-none-any.whl")


def test_requires_is_judged_against_a_wheels_own_pins():
    """A wheel read alone (the sweep, ``doctor --path WHEEL``) holds no dependency: what the fix
    ``requires`` is judged against the wheel's own exact pin (what installing it brings), read from its
    METADATA; a range, a pin behind an extra or two pins are no version. SGLang 0.5.18 pins
    flashinfer_python[cu13]==0.6.17, 0.5.19 0.6.18: #39920 is known-unfixed on one, patched on the other."""
    head = "Metadata-Version: 2.1\nName: eng\nVersion: 1.0\n"
    reader = _wheel(head + "Requires-Dist: flashinfer_python[cu13]==0.6.17\nRequires-Dist: torch>=2.9\n"
                    "Requires-Dist: xgrammar==0.2.1; extra == 'x'\n")
    assert reader.version("eng") == "1.0" and reader.version("flashinfer-python") == "0.6.17"
    assert reader.version("torch") is None and reader.version("xgrammar") is None
    assert _wheel(head + "Requires-Dist: a==1; python_version<'3'\nRequires-Dist: a==2\n").version("a") == "2"
    text = installed("sglang==0.5.18", "sglang/srt/layers/quantization/fp8.py")
    verdicts = {}
    for pin in ("0.6.17", "0.6.18"):
        with _locate.reading(_wheel(head.replace("eng", "sglang").replace("1.0", "0.5.18") +
                                    "Requires-Dist: flashinfer_python[cu13]==%s\n" % pin)):
            verdicts[pin] = _registry.judge(CLAMP, {CLAMP.targets[0]: ast.parse(text)}, "0.5.18")
    assert verdicts["0.6.18"][0] == "patch", verdicts
    assert verdicts["0.6.17"][0] == "known-unfixed" and "flashinfer-python>=0.6.18 (the release pins flashinfer-python==0.6.17)" in (
        verdicts["0.6.17"][1]), verdicts  # a pin is no install: the reason says which it is
