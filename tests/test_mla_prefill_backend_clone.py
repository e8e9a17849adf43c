"""vLLM #46993 (vllm-mla-prefill-backend-per-builder) against vLLM's own code.

* Without an engine process: the pre-fix shape derived from vLLM 0.27.1's installed
  ``MLACommonMetadataBuilder.__init__`` (``.prefill_backend.clone()`` turned back into 0.24.0's
  ``.prefill_backend``) is judged ``patch``, 0.27.1's own ``fixed-upstream``.
* vLLM 0.27.1 (fixed) in one process: two metadata builders (DBO builds one per micro-batch) are
  made by 0.27.1's own ``MLACommonMetadataBuilder.__init__`` on CPU, for a layer whose prefill
  backend is 0.27.1's own FlashInfer (and TRT-LLM ragged) MLA prefill backend. Stand-ins only for
  what is not under test or a CPU lacks: the layer registry's entry, the model dims, the workspace
  manager, the reorder threshold. Released, each builder has its own backend of the layer's class and
  configuration; with ``__init__``'s body swapped to the derived pre-fix shape, both builders hold
  the layer's one backend (the prepared metadata of one micro-batch is the other's); and to that
  shape with the declaration's edit: each its own again. flashfix's clone equals 0.27.1's
  ``MLAPrefillBackend.clone()`` attribute for attribute.
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
import derived_swap  # noqa: E402
from flashfix import vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

PATCH = vllm_patch.MLA_PREFILL_BACKEND_PER_BUILDER
RELATIVE = "vllm/model_executor/layers/attention/mla_attention.py"


def init_of(tree):
    return _source.find_def(tree, "MLACommonMetadataBuilder.__init__")


def derive(text):
    """The module with #46993 turned back in the builder's ``__init__`` (0.24.0's shared backend)."""
    return derived_swap.replaced_in_def(text, "MLACommonMetadataBuilder.__init__", ".prefill_backend.clone()",
                                        ".prefill_backend")


def test_derived_shape_is_patched_and_the_fixed_release_is_not():
    fixed = engine_env.installed_path("vllm==0.27.1", RELATIVE).read_text()
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.27.1")[0] == "fixed-upstream"
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(derive(fixed))}, "0.24.0")
    assert verdict[0] == "patch" and "shares the layer's MLA prefill backend" in verdict[1], verdict


SCRIPT = r"""
import ast, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import vllm_patch
from test_mla_prefill_backend_clone import derive, init_of
import vllm.model_executor.layers.attention.mla_attention as m
import vllm.v1.attention.backends.mla.prefill.flashinfer as fi
import vllm.v1.attention.backends.mla.prefill.trtllm_ragged as tr

workspace = SimpleNamespace(get_simultaneous=lambda *specs: [torch.empty(0, dtype=s[1]) for s in specs])
fi.current_workspace_manager = tr.current_workspace_manager = lambda: workspace
m.get_num_attention_heads_from_layers = lambda *a: 16
m.get_mla_dims = lambda model_config: None
B = m.MLACommonMetadataBuilder
B.determine_chunked_prefill_workspace_size = staticmethod(lambda vllm_config: 64)
B._init_reorder_batch_threshold = lambda self, *a: None

CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: 576, get_num_attention_heads=lambda p: 16),
    parallel_config=SimpleNamespace(prefill_context_parallel_size=1, cp_kv_cache_interleave_size=1),
    cache_config=SimpleNamespace(cache_dtype="auto"),
    attention_config=SimpleNamespace(use_prefill_query_quantization=False),
    compilation_config=SimpleNamespace(static_forward_context={}))
DIMS = dict(num_heads=16, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
SPEC = SimpleNamespace(block_size=64)

def builders():
    out = {}
    for cls in (fi.FlashInferPrefillBackend, tr.TrtllmRaggedPrefillBackend):
        layer_backend = cls(vllm_config=CONFIG, **DIMS)
        CONFIG.compilation_config.static_forward_context["model.layers.0.self_attn.attn"] = SimpleNamespace(
            prefill_backend=layer_backend)
        ubatches = [B(SPEC, ["model.layers.0.self_attn.attn"], CONFIG, torch.device("cpu")) for _ in range(2)]
        got = [u._prefill_backend for u in ubatches]
        out[cls.__name__] = {
            "own_per_builder": got[0] is not got[1] and all(g is not layer_backend for g in got),
            "class": sorted({type(g).__name__ for g in got}),
            "config": all(getattr(g, k) == v for g in got for k, v in DIMS.items()) and all(g.vllm_config is CONFIG for g in got)}
    return out

def same_as_vllm_clone():
    out = {}
    for cls in (fi.FlashInferPrefillBackend, tr.TrtllmRaggedPrefillBackend):
        backend = cls(vllm_config=CONFIG, **DIMS)
        ours, theirs = vllm_patch.clone_mla_prefill_backend(backend), backend.clone()
        out[cls.__name__] = [type(ours) is type(theirs), sorted(vars(ours)) == sorted(vars(theirs)),
                             all(not torch.is_tensor(v) and v == vars(theirs)[k] or torch.is_tensor(v)
                                 for k, v in vars(ours).items())]
    return out

PATCH = vllm_patch.MLA_PREFILL_BACKEND_PER_BUILDER
row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
out = {"state": row["state"], "released": builders(), "clone": same_as_vllm_clone()}
derived = init_of(ast.parse(derive(open(m.__file__).read())))
m.clone_mla_prefill_backend = vllm_patch.clone_mla_prefill_backend  # the global the declaration's needs adds
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(B.__dict__["__init__"], derived,
                                                                          PATCH.rule.hunks[0], builders)
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("vllm==" + release, SCRIPT)
    return r


def test_each_builder_gets_its_own_prefill_backend():
    r = report("0.27.1")
    assert r["state"] == "fixed-upstream", r
    own = {"own_per_builder": True, "config": True}
    names = {"FlashInferPrefillBackend": "FlashInferPrefillBackend", "TrtllmRaggedPrefillBackend": "TrtllmRaggedPrefillBackend"}
    assert r["released"] == {k: dict(own, **{"class": [v]}) for k, v in names.items()}, r["released"]
    assert r["clone"] == {k: [True, True, True] for k in names}, r["clone"]
    # the pre-fix shape: both micro-batches' builders hold the layer's one backend
    assert r["derived"] == {k: dict(own, own_per_builder=False, **{"class": [v]}) for k, v in names.items()}, r["derived"]
    assert r["derived_patched"] == r["released"], r["derived_patched"]
