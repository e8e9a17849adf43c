"""vllm-mla-weights-reload (vLLM #48251, fixed in 0.26.0) and vllm-mla-dcp-qrep-weights-reload (fixed in
0.32.0) against vLLM's own ``MLAAttention.process_weights_after_loading``.

* Without an engine process: the pre-fix shape of #48251 derived from an installed release (its
  ``replace_parameter(self, "W_UV"/"W_UK_T", ..., prefer_copy=True)`` turned back into 0.25.1's
  ``self.W_UV = ...`` / ``self.W_UK_T = ...``) is judged ``patch``; the release itself ``fixed-upstream``.
* vLLM 0.27.1 and 0.30.0, one process each, on CPU: the release's own function loads the weights of an
  MLA layer twice (a weight reload), with stand-ins only for what a CPU lacks or is not under test: the
  dequantisation (a fresh tensor per load, as FP8 checkpoints get), the DCP group's all_gather. The
  tensors bound after the first load are what CUDA graphs captured at start-up read; after the reload
  they must hold the new weights. Patched (flashfix active), all three do; after ``revert()`` of the
  DCP fix (the release as shipped) W_UK_T_dcp_qrep keeps the first weights; the derived pre-fix shape
  of #48251 keeps them in W_UV and W_UK_T, and that shape with the declaration's edit refreshes them.
"""

import ast
import functools
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402

this_checkout.flashfix()
import derived_swap  # noqa: E402
from flashfix import vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402

WEIGHTS, QREP = vllm_patch.MLA_WEIGHTS_RELOAD, vllm_patch.MLA_QREP_WEIGHTS_RELOAD
RELATIVE = "vllm/model_executor/layers/attention/mla_attention.py"
RELEASES = ("0.27.1", "0.30.0")


QUALNAME = WEIGHTS.rule.hunks[0].function
# #48251 turned back (0.25.1's plain re-binding): (fixed spelling, pre-fix spelling)
SPELLINGS = [('replace_parameter(self, "%s", %s, prefer_copy=True)' % (name, value), "self.%s = %s" % (name, value))
             for name, value in (("W_UV", "W_UV.transpose(0, 1)"), ("W_UK_T", "W_UK.permute(1, 2, 0)"))]


def derive(text):
    return derived_swap.turned_back(text, QUALNAME, SPELLINGS)


@pytest.mark.parametrize("release", RELEASES)
def test_derived_shape_is_patched_and_the_release_is_not(release):
    fixed = engine_env.installed_path("vllm==" + release, RELATIVE).read_text()
    trees = {WEIGHTS.targets[0]: ast.parse(fixed)}
    assert _registry.judge(WEIGHTS, trees, release)[0] == "fixed-upstream"
    assert _registry.judge(QREP, trees, release)[0] == "patch"
    verdict = _registry.judge(WEIGHTS, {WEIGHTS.targets[0]: ast.parse(derive(fixed))}, "0.25.1")
    assert verdict[0] == "patch" and "binds W_UV and W_UK_T to new tensors" in verdict[1], verdict


SCRIPT = r"""
import ast, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import vllm_patch
from flashfix.core import source as _source
import vllm.model_executor.layers.attention.mla_attention as m

L, N, P, V = 16, 4, 8, 8  # kv_lora_rank, heads, qk_nope_head_dim, v_head_dim
m.get_and_maybe_dequant_weights = lambda proj, out_dtype=None: proj.weight.clone()  # a new tensor per load
m.get_dcp_group = lambda: SimpleNamespace(all_gather=lambda t, dim: torch.cat([t, t], dim=dim))
FUNC = m.MLAAttention.__dict__["process_weights_after_loading"]
NAMES = ("W_UV", "W_UK_T", "W_UK_T_dcp_qrep")

def reload():
    "{name: the tensor bound after the first load holds the reloaded weights}"
    layer = torch.nn.Module()
    for k, v in dict(kv_lora_rank=L, num_heads=N, qk_nope_head_dim=P, v_head_dim=V, dcp_q_replicate=True,
                     q_pad_num_heads=None, is_aiter_triton_fp4_bmm_enabled=False,
                     is_aiter_triton_fp8_bmm_enabled=False, is_amx_bmm_enabled=False, quant_config=None, layer_name="model.layers.0.attn",
                     impl=SimpleNamespace(process_weights_after_loading=lambda dtype: None),  # 0.30: the impl's own
                     kv_b_proj=SimpleNamespace(weight=torch.randn(N * (P + V), L))).items():
        setattr(layer, k, v)
    m.set_default_quant_scales(layer, register_buffer=True)  # as MLAAttention.__init__ does
    FUNC(layer, torch.float32)
    first = {n: getattr(layer, n) for n in NAMES}
    layer.kv_b_proj.weight = torch.randn(N * (P + V), L)  # the reload
    FUNC(layer, torch.float32)
    return {n: torch.equal(first[n], getattr(layer, n)) for n in NAMES}

rows = {r["id"]: r["state"] for r in flashfix.status()}
out = {"state": {i: rows[i] for i in (vllm_patch.MLA_WEIGHTS_RELOAD.id, vllm_patch.MLA_QREP_WEIGHTS_RELOAD.id)},
       "patched": reload()}
flashfix.revert(vllm_patch.MLA_QREP_WEIGHTS_RELOAD.id)
out["released"] = reload()
out["reverted_state"] = next(r["state"] for r in flashfix.status() if r["id"] == vllm_patch.MLA_QREP_WEIGHTS_RELOAD.id)
derived = _source.find_def(ast.parse(derived_swap.turned_back(open(m.__file__).read(), %r, %r)), %r)
m.keep_storage = vllm_patch.keep_storage  # the global the declaration's needs adds
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(
    FUNC, derived, vllm_patch.MLA_WEIGHTS_RELOAD.rule.hunks[0], reload)
layer, first = SimpleNamespace(), torch.zeros(2, 3)  # keep_storage alone: binds first, copies after
vllm_patch.keep_storage(layer, "w", first)
bound_first = layer.w is first
vllm_patch.keep_storage(layer, "w", torch.ones(2, 3))
copied = layer.w is first and bool((first == 1).all())
other = torch.ones(3, 2)  # another shape: bound as the release binds it
vllm_patch.keep_storage(layer, "w", other)
out["keep_storage"] = [bound_first, copied, layer.w is other]
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % (str(TESTS), QUALNAME, SPELLINGS, QUALNAME)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("vllm==" + release, SCRIPT)
    return r


@pytest.mark.parametrize("release", RELEASES)
def test_a_reload_reaches_the_tensors_captured_before_it(release):
    r = report(release)
    assert r["state"] == {WEIGHTS.id: "fixed-upstream", QREP.id: "applied"}, r
    assert r["patched"] == {"W_UV": True, "W_UK_T": True, "W_UK_T_dcp_qrep": True}, r
    assert r["released"] == {"W_UV": True, "W_UK_T": True, "W_UK_T_dcp_qrep": False}, r  # the bug, as shipped
    assert r["reverted_state"] == "disabled", r
    # #48251's pre-fix shape (the DCP line as released in both): W_UV and W_UK_T keep the first weights
    assert r["derived"] == {"W_UV": False, "W_UK_T": False, "W_UK_T_dcp_qrep": False}, r
    assert r["derived_patched"] == {"W_UV": True, "W_UK_T": True, "W_UK_T_dcp_qrep": False}, r
    assert r["keep_storage"] == [True, True, True], r

