"""sglang-triton-per-layer-heads-buffers (sglang#32625's Triton half, fixed in 0.5.17) against SGLang's own code.

SGLang 0.5.14 (patched) and 0.5.17 (fixed upstream), one process each, on CPU: the release's own
``TritonAttnBackend.__init__`` and ``TritonMultiStepDraftBackend.__init__`` run for a model whose layers
have 8, 12 and 8 query heads (``num_attention_heads_per_layer``; model-wide 8) at attention TP 2, and for
one without per-layer counts. What sizes the split-KV decode buffers is ``num_head``, set early in each
constructor; the stand-ins (a permissive model runner, the TP group, the per-step backends the draft
backend builds) stop the constructor later, past that line. Patched, 0.5.14 sizes for 12 // 2 = 6 heads
as 0.5.17 does; after ``revert()`` (the release as shipped) for 8 // 2 = 4, fewer than the wide layer
writes; without per-layer counts 4 either way.
"""

import functools
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402

PATCH_ID = "sglang-triton-per-layer-heads-buffers"

SCRIPT = r"""
import json
from types import SimpleNamespace
from unittest import mock
import flashfix
import sglang.srt.layers.attention.triton_backend as tb

tb.get_parallel = lambda: SimpleNamespace(attn_tp_size=2, attn_dcp_size=1, attn_dcp_rank=0)  # TP 2, no DCP
tb.get_spec = lambda: SimpleNamespace(speculative_num_draft_tokens=None, speculative_num_steps=None,
                                      speculative_eagle_topk=0)  # 0.5.17 reads the speculative settings here

def runner(per_layer):
    mr = mock.MagicMock()
    mr.model_config.num_attention_heads = 8
    mr.model_config.get_max_num_attention_heads = lambda: max(per_layer or [8])  # 0.5.17's own
    mr.model_config.hf_text_config = SimpleNamespace(**({"num_attention_heads_per_layer": per_layer} if per_layer else {}))
    mr.server_args.speculative_eagle_topk = 0
    mr.req_to_token_pool.size = 4
    mr.device = "cpu"
    return mr

def num_head(cls, per_layer, *args):
    obj = object.__new__(cls)
    backend = tb.TritonAttnBackend
    if cls is tb.TritonMultiStepDraftBackend:  # its per-step backends: only their context length is read
        tb.TritonAttnBackend = lambda *a, **k: SimpleNamespace(max_context_len=4096)
    try:
        cls.__init__(obj, runner(per_layer), *args)
    except Exception:  # a stand-in stops it after num_head is set
        pass
    finally:
        tb.TritonAttnBackend = backend
    return getattr(obj, "num_head", None)

def sizes():
    return {name: [num_head(getattr(tb, name), per_layer, *args) for per_layer in ([8, 12, 8], None)]
            for name, args in (("TritonAttnBackend", ()), ("TritonMultiStepDraftBackend", (1, 2)))}

out = {"state": next(r["state"] for r in flashfix.status() if r["id"] == %r), "patched": sizes()}
flashfix.revert(%r)
out["reverted"] = sizes()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % (PATCH_ID, PATCH_ID)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("sglang==" + release, SCRIPT)
    return r


def test_the_decode_buffers_are_sized_for_the_widest_layer():
    patched, fixed = report("0.5.14"), report("0.5.17")
    assert patched["state"] == "applied" and fixed["state"] == "fixed-upstream", (patched, fixed)
    wide = {"TritonAttnBackend": [6, 4], "TritonMultiStepDraftBackend": [6, 4]}
    assert patched["patched"] == wide == fixed["patched"], (patched, fixed)
    assert patched["reverted"] == {k: [4, 4] for k in wide}, patched  # the bug: sized for 8 // 2 heads
    assert fixed["reverted"] == wide, fixed  # nothing was applied there to revert
