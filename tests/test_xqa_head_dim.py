"""vLLM #53111 (vllm-xqa-head-dim) against vLLM's own code.

* vLLM 0.28.0 (affected) and 0.29.0 (fixed), one process each: the release's own
  ``FlashInferMetadataBuilder.__init__`` runs on CPU with stand-ins only for what a CPU lacks (the GPU
  is an SM90, where the builder picks XQA decode; TRT-LLM attention usable; no attention layers
  registered, so the per-layer hyperparameters are given), for KV-cache groups of several head
  dims. 0.28.0 patched must pick the decode kernel as 0.29.0 does; reverted, it keeps XQA for head
  dims XQA cannot serve (512: Gemma 4's global layers; 72, 8). In 0.29.0's process ``__init__`` also
  runs with its body swapped to the pre-fix shape derived from 0.29.0 (#53111's fallback removed),
  and to that shape with the declaration's edit.
* Without an engine process: that derived shape and 0.28.0's own file are judged ``patch``, 0.29.0's
  ``fixed-upstream``, and the edit puts 0.29.0's test and assignments in 0.29.0's place.
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
from flashfix import vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

XQA = vllm_patch.XQA_HEAD_DIM
QUALNAME = XQA.rule.hunks[0].function
RELATIVE = "vllm/v1/attention/backends/flashinfer.py"


def installed(requirement):
    return engine_env.installed_path(requirement, RELATIVE).read_text()


def _def(text, qualname):
    return _source.find_def(ast.parse(text), qualname)


def drop_head_dim_fallback(text):
    """0.29.0's builder ``__init__`` without the fallback #53111 added: the pre-fix shape."""
    (node,) = [n for n in _def(text, QUALNAME).body if isinstance(n, ast.If) and "16 <= self.head_dim <= 256" in
               ast.unparse(n.test)]
    lines = text.splitlines(True)
    return "".join(lines[:node.lineno - 1] + lines[node.end_lineno:])


def test_derived_and_released_shapes_are_patched_to_the_fixed_form():
    fixed = installed("vllm==0.29.0")
    assert _registry.judge(XQA, {XQA.targets[0]: ast.parse(fixed)}, "0.29.0")[0] == "fixed-upstream"
    for text in (drop_head_dim_fallback(fixed), installed("vllm==0.28.0")):
        verdict = _registry.judge(XQA, {XQA.targets[0]: ast.parse(text)}, "0.28.0")
        assert verdict[0] == "patch", verdict
        func = _def(text, QUALNAME)
        XQA.rule.hunks[0].edit(func, ast.Pass())
        ours = ast.parse(ast.unparse(func)).body[0]  # re-parsed: the edit's nodes as source gives them
        (mine,) = [n for n in ours.body if isinstance(n, ast.If) and "16 <= self.head_dim" in ast.unparse(n.test)]
        (theirs,) = [n for n in _def(fixed, QUALNAME).body if isinstance(n, ast.If)
                     and "16 <= self.head_dim" in ast.unparse(n.test)]
        assert ast.dump(mine.test) == ast.dump(theirs.test)
        assert [ast.dump(s) for s in mine.body[1:]] == [ast.dump(s) for s in theirs.body[1:]]  # after the warning
        before = ours.body[ours.body.index(mine) - 1]  # right after the kernel is chosen, as upstream
        assert ast.unparse(before).startswith("self.flashinfer_trtllm_api_decode_kernel"), ast.unparse(before)


SCRIPT = r"""
import ast, copy, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import vllm_patch
from flashfix.core import registry as _registry
from test_xqa_head_dim import _def, drop_head_dim_fallback
import vllm.v1.attention.backends.flashinfer as m

# stand-ins for what a CPU lacks: an SM90 GPU, TRT-LLM attention usable, no registered layers
m.current_platform = SimpleNamespace(is_device_capability=lambda c: c == 90, is_device_capability_family=lambda f: False,
                                     get_device_capability=lambda: SimpleNamespace(major=9, minor=0))
m.can_use_trtllm_attention = lambda *a, **k: True
m.force_use_trtllm_attention = lambda: None  # no --attention-config forcing either way (reads the global config)
m.PIN_MEMORY = False  # pinned host buffers need a driver
m.get_num_attention_heads_from_layers = lambda *a: 8
m.get_per_layer_parameters = lambda *a: {}
m.infer_global_hyperparameters = lambda p: SimpleNamespace(sm_scale=1.0, window_left=-1, logits_soft_cap=None,
                                                           has_sinks=False)
CONFIG = SimpleNamespace(
    cache_config=SimpleNamespace(cache_dtype="auto"),
    model_config=SimpleNamespace(max_model_len=256, dtype=torch.bfloat16, get_num_attention_heads=lambda p: 8),
    attention_config=SimpleNamespace(disable_flashinfer_q_quantization=False),
    compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(decode_mode=lambda: None),
                                       max_cudagraph_capture_size=None),
    scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=4), speculative_config=None,
    parallel_config=SimpleNamespace(dcp_kv_cache_interleave_size=1, dcp_comm_backend="ag_rs",
                                    decode_context_parallel_size=1),
    use_v2_model_runner=False)

def kernels():
    out = {}
    for head_dim in (8, 64, 72, 128, 256, 512):
        spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=head_dim, dtype=torch.bfloat16,
                               kv_quant_mode=m.KVQuantMode.NONE)
        b = m.FlashInferMetadataBuilder(spec, [], CONFIG, torch.device("cpu"))
        kernel = b.flashinfer_trtllm_api_decode_kernel
        out[str(head_dim)] = [b.use_trtllm_decode_attention, kernel.name if kernel is not None else None]
    return out

row = next(r for r in flashfix.status() if r["id"] == vllm_patch.XQA_HEAD_DIM.id)
out = {"state": row["state"], "reason": row["reason"], "kernels": kernels()}
out["ran"] = next(r for r in flashfix.status() if r["id"] == row["id"])["ran"]
flashfix.revert(row["id"])
out["reverted"] = kernels()
if row["state"] == "fixed-upstream":  # the pre-fix shape derived from this release, in the release's own __init__
    qualname = vllm_patch.XQA_HEAD_DIM.rule.hunks[0].function
    init = m.FlashInferMetadataBuilder.__dict__["__init__"]
    derived = _def(drop_head_dim_fallback(open(m.__file__).read()), qualname)
    out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(init, derived, vllm_patch.XQA_HEAD_DIM.rule.hunks[0], kernels)
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("vllm==" + release, SCRIPT)
    return r


def test_0_28_0_patched_chooses_the_decode_kernel_as_0_29_0():
    fixed, old = report("0.29.0"), report("0.28.0")
    assert fixed["state"] == "fixed-upstream" and old["state"] == "applied", (fixed, old)
    assert old["ran"] is True
    expected = fixed["kernels"]
    # 0.29.0: XQA for head dims 16-256 in steps of 16, native FlashInfer decode for the others
    assert expected == {"8": [False, None], "64": [True, "XQA"], "72": [False, None], "128": [True, "XQA"],
                        "256": [True, "XQA"], "512": [False, None]}, expected
    assert old["kernels"] == expected
    # as released, 0.28.0 gives XQA a head_dim of 512 (engine start fails: "Invalid head_dim")
    assert old["reverted"] == dict(expected, **{h: [True, "XQA"] for h in ("8", "72", "512")}), old["reverted"]
    # the pre-fix shape derived from 0.29.0 behaves as 0.28.0 released, and patched as 0.29.0
    assert fixed["derived"] == old["reverted"]
    assert fixed["derived_patched"] == expected
    assert fixed["reverted"] == expected  # nothing of the patch was applied on the fixed release
