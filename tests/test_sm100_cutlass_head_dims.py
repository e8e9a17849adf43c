"""sglang-sm100-cutlass-head-dims (fixed in SGLang 0.5.21) against SGLang's own code.

SGLang 0.5.23 (fixed) in one process: its own ``FlashInferAttnBackend.__init__`` runs on CPU up to
the construction of the ragged prefill wrapper, whose ``backend=`` is recorded (the stand-in wrapper
then stops ``__init__``: nothing after it is read). Stand-ins only for what a CPU process lacks or
what is not under test: the GPU (SM100 or not), the server-wide runtime context, the workspace
buffer. For head dims 256/256 (Gemma, Qwen3.5), 128/128, 64/64, and a config without
``v_head_dim``: released, FA2 for 256 and CUTLASS for the shapes FlashInfer's SM100 CUTLASS FMHA
instantiates. Then with ``__init__``'s body swapped to the pre-fix shape derived from 0.5.23 (0.5.20's
branch: CUTLASS for every shape, which FlashInfer rejects with "Unsupported head dimensions"), and to
that shape with the declaration's edit: as 0.5.23. Off SM100 every shape stays ``auto``. Without an
engine process: the derived shape reads ``patch``, 0.5.23 ``fixed-upstream`` (the sweep reads
0.5.1 to 0.5.20 ``patch``, tests/test_sweep.py).
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
from flashfix import sglang_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

PATCH = sglang_patch.SM100_CUTLASS_HEAD_DIMS


def init_of(tree):
    return _source.find_def(tree, "FlashInferAttnBackend.__init__")


def derive(text):
    """The module with 0.5.21's head-dim gate turned back into 0.5.20's SM100 branch (CUTLASS unless
    piecewise CUDA graphs prefill), as a tree."""
    tree = ast.parse(text)
    (branch,) = [n for n in ast.walk(init_of(tree)) if isinstance(n, ast.If)
                 and ast.unparse(n.test) == "get_platform().is_sm100"]
    gate = branch.body[-1]
    assert isinstance(gate, ast.If) and ast.unparse(gate.test.values[0]) == "head_dims in cutlass_supported_head_dims"
    gate.test = gate.test.values[1]
    branch.body = [gate]
    return tree


def test_derived_shape_is_patched_and_the_fixed_release_is_not():
    fixed = engine_env.installed_path("sglang==0.5.23", "sglang/srt/layers/attention/flashinfer_backend.py").read_text()
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.5.23")[0] == "fixed-upstream"
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: derive(fixed)}, "0.5.20")
    assert verdict[0] == "patch" and "CUTLASS whatever" in verdict[1], verdict


SCRIPT = r"""
import json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import sglang_patch
from test_sm100_cutlass_head_dims import derive, init_of
import sglang.srt.layers.attention.flashinfer_backend as m

class Built(Exception):
    pass

def ragged(workspace, layout, backend=None, **kw):
    raise Built(backend)  # the ragged prefill wrapper's backend is all this reads: __init__ stops here

SM100 = [True]
m.BatchPrefillWithRaggedKVCacheWrapper = ragged
m.get_platform = lambda: SimpleNamespace(is_sm100=SM100[0])
m.check_cuda_graph_backend = lambda *a: False  # no piecewise CUDA-graph prefill
m.get_buffer = lambda name, make: torch.empty(0, dtype=torch.uint8)
m.get_exec = lambda: SimpleNamespace(features=SimpleNamespace(enable_mis=False),
                                     deterministic=SimpleNamespace(enable_deterministic_inference=False))
m.get_parallel = lambda: SimpleNamespace(attn_tp_size=1, attn_dcp_size=1)
m.get_cuda_graph_max_batch_size = lambda n: n
m.DllmConfig = SimpleNamespace(from_server_args=lambda a: None)

def runner(dims):
    quant = SimpleNamespace(resolve_attention_access=lambda *a: None)
    mc = SimpleNamespace(num_attention_heads=8, get_num_kv_heads=lambda *a: 2, context_len=128, is_multimodal=False,
                         is_encoder_decoder=False, hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                         head_dim=dims[0])
    if dims[1] is not None:
        mc.v_head_dim = dims[1]
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(size=4), device="cpu", page_size=1,
                           token_to_kv_pool=SimpleNamespace(get_kv_cache_quant_method=lambda: quant),
                           token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None), is_draft_worker=False,
                           kv_index_translator=None, server_args=SimpleNamespace(dllm_algorithm=None),
                           prefill_attention_backend_str="triton", decode_attention_backend_str="triton",
                           kv_cache_dtype=torch.bfloat16, model_config=mc, sliding_window_size=None)

DIMS = {"256/256": (256, 256), "128/128": (128, 128), "64/64": (64, 64), "256, no v_head_dim": (256, None)}

def backends():
    out = {}
    for sm100 in (True, False):
        SM100[0] = sm100
        for name, dims in DIMS.items():
            try:
                m.FlashInferAttnBackend(runner(dims))
                out[("sm100 " if sm100 else "sm90 ") + name] = "not built"
            except Built as e:
                out[("sm100 " if sm100 else "sm90 ") + name] = e.args[0]
            except AttributeError:  # 0.5.23 reads model_config.v_head_dim, which its ModelConfig always sets
                out[("sm100 " if sm100 else "sm90 ") + name] = "AttributeError"
    return out

row = next(r for r in flashfix.status() if r["id"] == sglang_patch.SM100_CUTLASS_HEAD_DIMS.id)
out = {"state": row["state"], "released": backends()}
derived = init_of(derive(open(m.__file__).read()))
rule = sglang_patch.SM100_CUTLASS_HEAD_DIMS.rule.hunks[0]
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(
    m.FlashInferAttnBackend.__dict__["__init__"], derived, rule, backends)
out["after_undo"] = backends()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("sglang==" + release, SCRIPT)
    return r


def test_sm100_ragged_prefill_uses_cutlass_only_for_the_shapes_flashinfer_instantiates():
    r = report("0.5.23")
    assert r["state"] == "fixed-upstream", r
    sm90 = {"sm90 256/256": "auto", "sm90 128/128": "auto", "sm90 64/64": "auto", "sm90 256, no v_head_dim": "auto"}
    assert r["released"] == dict(sm90, **{"sm100 256/256": "fa2", "sm100 128/128": "cutlass", "sm100 64/64": "cutlass",
                                         "sm100 256, no v_head_dim": "AttributeError"}), r["released"]
    # the pre-fix shape gives CUTLASS head dims 256/256, which FlashInfer's SM100 CUTLASS FMHA rejects
    assert r["derived"] == dict(sm90, **{"sm100 256/256": "cutlass", "sm100 128/128": "cutlass", "sm100 64/64": "cutlass",
                                        "sm100 256, no v_head_dim": "cutlass"}), r["derived"]
    # edited: as 0.5.23, and FA2 for an older ModelConfig that sets no v_head_dim (v_head_dim = head_dim)
    assert r["derived_patched"] == dict(r["released"], **{"sm100 256, no v_head_dim": "fa2"}), r["derived_patched"]
    assert r["after_undo"] == r["released"]
