"""sglang#38590 (sglang-mla-indptr-padded-batch) against SGLang's own code.

The server's layout in every case: DP attention with attention-TP 2 (the runners' padded-batch rule
pads the request count to a multiple of 2), a request pool of 3: the runners make batches of up to 4.
Stand-ins only for what a CPU process lacks or what is not under test: that parallel layout (read by
the release's own padding rule), the server-wide flags, the workspace buffer; the ragged prefill
wrapper's constructor stops ``__init__`` once the indptr buffers are allocated (nothing after is read).

* SGLang 0.5.14 (rule ``_cuda_graph_capture_max_bs(server_args, n)``) and 0.5.17
  (``get_cuda_graph_max_batch_size(server_args, n)``), patched releases, each in one process: with the
  patch applied, FlashInferMLAAttnBackend's kv_indptr/qo_indptr/q_indptr_decode and the multi-step draft
  backend's kv_indptr rows hold the padded batch (5 entries); after ``flashfix.revert()``, the release's
  own code sizes them for the pool (4 entries: the start-up shape error of #38590).
* SGLang 0.5.23 (fixed; rule ``get_cuda_graph_max_batch_size(n)``, 0.5.19's spelling): the released
  sizes; both ``__init__`` bodies swapped to the pre-fix shape derived from 0.5.23 (upstream's call turned
  back into the pool size): 4; that shape with the declaration's edits: as released.
* Without an engine process: the derived shape reads ``patch``, 0.5.23 ``fixed-upstream``.
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

PATCH = sglang_patch.MLA_INDPTR_PADDED_BATCH
FIXED_CALL = "get_cuda_graph_max_batch_size(model_runner.req_to_token_pool.size)"


def derive(text):
    """0.5.23's module with #38590 turned back (both sizings from the request pool), as text."""
    assert text.count(FIXED_CALL) == 2
    return text.replace(FIXED_CALL, "model_runner.req_to_token_pool.size")


def defs_of(tree):
    return {cls: _source.find_def(tree, cls + ".__init__")
            for cls in ("FlashInferMLAAttnBackend", "FlashInferMLAMultiStepDraftBackend")}


def test_derived_shape_is_patched_and_the_fixed_release_is_not():
    fixed = engine_env.installed_path("sglang==0.5.23", "sglang/srt/layers/attention/flashinfer_mla_backend.py").read_text()
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.5.23")[0] == "fixed-upstream"
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(derive(fixed))}, "0.5.19")
    assert verdict[0] == "patch" and "not the padded batch" in verdict[1], verdict


SCRIPT = r"""
import ast, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import sglang_patch
from test_mla_indptr_padded_batch import defs_of, derive
import sglang.srt.layers.attention.flashinfer_backend as fb
import sglang.srt.layers.attention.flashinfer_mla_backend as m

class Built(Exception):
    pass

def ragged(*a, **k):
    raise Built()  # __init__ stops here: the indptr buffers are allocated before it

FLAGS = SimpleNamespace(disaggregation_mode="null", disable_chunked_prefix_cache=True, flashinfer_mla_disable_ragged=True,
                        enable_two_batch_overlap=False, kernel=SimpleNamespace(flashinfer_mla_disable_ragged=True),
                        overlap=SimpleNamespace(enable_two_batch_overlap=False), page_size=1)
PARALLEL = SimpleNamespace(attn_tp_size=2, attn_cp_size=1, enable_dp_attention=True, attn_dp_enabled=True)
stand_ins = dict(BatchPrefillWithRaggedKVCacheWrapper=ragged, get_disagg=lambda: FLAGS, get_schedule=lambda: FLAGS,
                 get_exec=lambda: FLAGS, get_global_server_args=lambda: FLAGS, is_sm100_supported=lambda: False,
                 get_platform=lambda: SimpleNamespace(is_sm100=False), get_buffer=lambda name, make: torch.empty(0),
                 require_gathered_buffer=lambda *a: True, get_parallel=lambda: PARALLEL, is_hip=lambda: False)
rule = getattr(fb, "_cuda_graph_capture_max_bs", None) or fb.get_cuda_graph_max_batch_size
for module in (m, fb, sys.modules[rule.__module__]):  # the backend's and its padding rule's own globals
    for name, value in stand_ins.items():
        if hasattr(module, name):
            setattr(module, name, value)
m.BatchPrefillWithRaggedKVCacheWrapper = ragged  # absent where FlashInfer cannot load (this CPU)

RUNNER = SimpleNamespace(model_config=SimpleNamespace(context_len=128, num_attention_heads=16), device="cpu", page_size=1,
                         req_to_token_pool=SimpleNamespace(size=3, req_to_token=torch.zeros(3, 128)),
                         token_to_kv_pool=None, kv_index_translator=None, server_args=FLAGS)

def built(cls, *args):
    obj = cls.__new__(cls)
    try:
        cls.__init__(obj, RUNNER, *args)
    except Built:
        pass
    return obj

def sizes():
    b = built(m.FlashInferMLAAttnBackend)
    d = built(m.FlashInferMLAMultiStepDraftBackend, 1, 3)
    return {"kv_indptr": b.kv_indptr.numel(), "qo_indptr": b.qo_indptr.numel(),
            "q_indptr_decode": b.q_indptr_decode.numel(), "draft_kv_indptr_row": d.kv_indptr.shape[1]}

PATCH = sglang_patch.MLA_INDPTR_PADDED_BATCH
row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
out = {"state": row["state"], "rule": rule.__name__, "released": sizes()}
if row["state"] == "fixed-upstream":
    derived = defs_of(ast.parse(derive(open(m.__file__).read())))
    m.padded_max_batch_size = sglang_patch.padded_max_batch_size  # the global the declaration's needs adds
    for (cls, func), hunk in zip(derived.items(), PATCH.rule.hunks):
        out["derived " + cls], out["derived_patched " + cls] = derived_swap.pre_fix_and_patched(
            getattr(m, cls).__dict__["__init__"], func, hunk, sizes)
else:
    flashfix.revert()
    out["reverted"] = sizes()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("sglang==" + release, SCRIPT)
    return r


PADDED = {"kv_indptr": 5, "qo_indptr": 5, "q_indptr_decode": 5, "draft_kv_indptr_row": 5}
POOL = dict.fromkeys(PADDED, 4)


def test_patched_releases_size_the_indptr_buffers_for_the_padded_batch():
    for release, rule in (("0.5.14", "_cuda_graph_capture_max_bs"), ("0.5.17", "get_cuda_graph_max_batch_size")):
        r = report(release)
        assert (r["state"], r["rule"]) == ("applied", rule), r
        assert r["released"] == PADDED, (release, r)
        assert r["reverted"] == POOL, (release, r)  # the release's own code: one entry short of the padded batch


def test_derived_pre_fix_shape_is_restored_to_the_fixed_release():
    r = report("0.5.23")
    assert (r["state"], r["rule"]) == ("fixed-upstream", "get_cuda_graph_max_batch_size"), r
    assert r["released"] == PADDED, r
    # each function swapped alone: its own buffers sized for the pool, the other function's as released
    for cls, keys in (("FlashInferMLAAttnBackend", ("kv_indptr", "qo_indptr", "q_indptr_decode")),
                      ("FlashInferMLAMultiStepDraftBackend", ("draft_kv_indptr_row",))):
        assert r["derived " + cls] == dict(PADDED, **{k: 4 for k in keys}), r
        assert r["derived_patched " + cls] == PADDED, r
