"""vLLM #42650 (vllm-layer-heads-plan) against vLLM's own code.

* Without an engine process: the pre-fix shape derived from vLLM 0.29.0's installed builder
  (``semantic.derive_prefix``: upstream's line turned back into 0.24.0's) is judged ``patch``,
  0.29.0's own ``fixed-upstream``, and the declaration's edit gives back 0.29.0's statement.
* vLLM 0.29.0 (fixed) in one process: its own ``FlashInferMetadataBuilder.__init__`` runs on CPU
  (stand-ins only for what a CPU lacks, as in test_xqa_head_dim.py) for KV-cache groups whose
  registered attention layers have 12 query heads where the model-wide count is 8 (Laguna's
  per-layer heads, or a draft with other heads than its target), 8, or none registered. Then with
  its body swapped to the derived pre-fix shape: every group is planned for 8 heads (the bug);
  and to that shape edited by the declaration: planned as 0.29.0 plans, with vLLM's helper and
  with flashfix's (the one a release without the helper gets).
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
from flashfix import semantic, vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

PATCH = vllm_patch.LAYER_HEADS_PLAN
RULE = PATCH.rule.hunks[0]
RELATIVE = "vllm/v1/attention/backends/flashinfer.py"


def installed(requirement):
    return engine_env.installed_path(requirement, RELATIVE).read_text()


def init_of(text):
    return _source.find_def(ast.parse(text), "FlashInferMetadataBuilder.__init__")


def heads_line(func):
    (line,) = [ast.unparse(n) for n in ast.walk(func) if isinstance(n, ast.Assign)
               and ast.unparse(n.targets[0]) == "self.num_qo_heads"]
    return line


def test_derived_shape_is_patched_back_to_the_fixed_statement():
    fixed = installed("vllm==0.29.0")
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.29.0")[0] == "fixed-upstream"
    derived = semantic.derive_prefix(PATCH, fixed)
    assert heads_line(init_of(derived)) == "self.num_qo_heads = self.model_config.get_num_attention_heads(" \
                                           "self.vllm_config.parallel_config)"
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(derived)}, "0.24.0")
    assert verdict[0] == "patch" and "model-wide query-head count" in verdict[1], verdict
    func = init_of(derived)
    RULE.edit(func, ast.Pass())
    assert heads_line(ast.parse(ast.unparse(func))) == heads_line(init_of(fixed))


SCRIPT = r"""
import ast, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import semantic, vllm_patch
from flashfix.core import source as _source
import vllm.v1.attention.backends.flashinfer as m
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

# stand-ins for what a CPU lacks (as in test_xqa_head_dim.py): an SM90 GPU, TRT-LLM attention usable
m.current_platform = SimpleNamespace(is_device_capability=lambda c: c == 90, is_device_capability_family=lambda f: False,
                                     get_device_capability=lambda: SimpleNamespace(major=9, minor=0))
m.can_use_trtllm_attention = lambda *a, **k: True
m.force_use_trtllm_attention = lambda: None
m.PIN_MEMORY = False
m.get_per_layer_parameters = lambda *a: {}
m.infer_global_hyperparameters = lambda p: SimpleNamespace(sm_scale=1.0, window_left=-1, logits_soft_cap=None,
                                                           has_sinks=False)

class Layer(AttentionLayerBase):  # a registered attention layer: what the builder reads of it is impl.num_heads
    def __init__(self, heads):
        self.impl = SimpleNamespace(num_heads=heads)
    def get_attn_backend(self):
        return m.FlashInferBackend
    def get_kv_cache_spec(self, vllm_config):
        return None

LAYERS = {"wide.0": Layer(12), "wide.1": Layer(12), "narrow.0": Layer(8)}
CONFIG = SimpleNamespace(
    cache_config=SimpleNamespace(cache_dtype="auto"),
    model_config=SimpleNamespace(max_model_len=256, dtype=torch.bfloat16, get_num_attention_heads=lambda p: 8),
    attention_config=SimpleNamespace(disable_flashinfer_q_quantization=False),
    compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(decode_mode=lambda: None),
                                       max_cudagraph_capture_size=None, static_forward_context=LAYERS),
    scheduler_config=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=4), speculative_config=None,
    parallel_config=SimpleNamespace(dcp_kv_cache_interleave_size=1, dcp_comm_backend="ag_rs",
                                    decode_context_parallel_size=1),
    use_v2_model_runner=False)
GROUPS = {"wide": ["wide.0", "wide.1"], "narrow": ["narrow.0"], "none registered": ["missing.0"]}

def planned():
    spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16,
                           kv_quant_mode=m.KVQuantMode.NONE)
    return {g: m.FlashInferMetadataBuilder(spec, names, CONFIG, torch.device("cpu")).num_qo_heads
            for g, names in GROUPS.items()}

PATCH = vllm_patch.LAYER_HEADS_PLAN
row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
out = {"state": row["state"], "released": planned()}
out["helpers"] = [[m.get_num_attention_heads_from_layers(CONFIG, n), vllm_patch.get_num_attention_heads_from_layers(CONFIG, n)]
                  for n in GROUPS.values()]
init = m.FlashInferMetadataBuilder.__dict__["__init__"]
derived = _source.find_def(ast.parse(semantic.derive_prefix(PATCH, open(m.__file__).read())), "FlashInferMetadataBuilder.__init__")
rule = PATCH.rule.hunks[0]
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(init, derived, rule, planned)
m.get_num_attention_heads_from_layers = vllm_patch.get_num_attention_heads_from_layers  # a release without the helper
out["derived_patched_flashfix_helper"] = derived_swap.pre_fix_and_patched(init, derived, rule, planned)[1]
out["after_undo"] = planned()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("vllm==" + release, SCRIPT)
    return r


def test_each_group_is_planned_for_its_own_layers_heads():
    r = report("0.29.0")
    assert r["state"] == "fixed-upstream", r
    assert r["released"] == {"wide": 12, "narrow": 8, "none registered": 8}, r["released"]
    # flashfix's helper answers as vLLM's own for every group (None where no layer is registered)
    assert r["helpers"] == [[12, 12], [8, 8], [None, None]], r["helpers"]
    # the pre-fix shape plans the 12-head layers for the model-wide 8 heads: FlashInfer covers 8/12 of their work
    assert r["derived"] == dict(r["released"], wide=8), r["derived"]
    assert r["derived_patched"] == r["released"], r["derived_patched"]
    assert r["derived_patched_flashfix_helper"] == r["released"], r["derived_patched_flashfix_helper"]
    assert r["after_undo"] == r["released"]
