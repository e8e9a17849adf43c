"""sglang-flashinfer-logit-softcap-plan (sglang#33915, flashfix's own) and the patch series, on SGLang's own code.

One process per release and setting, on CPU: the doctor's verdicts, then SGLang's FlashInfer backend imported
with flashfix active, and its own ``FlashInferIndicesUpdaterDecode``/``Prefill`` constructors and
``call_begin_forward`` run with recording wrappers, for a model whose attention layers all cap at 50 and have
8 and 16 query heads (``num_attention_heads_per_layer``), one without a cap, and one whose layers disagree.

On 0.5.11 and 0.5.14 both updaters' ``__init__`` is a series: ``sglang-per-layer-heads-plan`` (sglang#32625)
and the soft cap edit the same function, and both apply, compiled once (16 heads planned, with the cap). Each
stays its own unit: ``revert()`` of the soft cap leaves the head count fix in force, and FLASHFIX_DISABLE of
either keeps the other, the doctor saying what the runtime does. On 0.5.17 (#32625 released) the soft cap
applies alone; on 0.5.23 it is judged and applied (its updaters plan through ``KVLocPlan``, not driven here).
"""

import functools
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402

ID, HEADS = "sglang-flashinfer-logit-softcap-plan", "sglang-per-layer-heads-plan"
SCRIPT = 'import json, sys, functools, os\nDRIVE = os.environ.get("DRIVE") == "1"  # 0.5.23 plans through KVLocPlan: judged and applied, not driven here\nfrom types import SimpleNamespace\nimport torch\nimport flashfix\nfrom flashfix.tools import doctor\nrows = {r["id"]: r for r in doctor.diagnose()[0]}\nimport sglang.srt.layers.attention.flashinfer_backend as m\nst = {r["id"]: r for r in flashfix.status()}\nID, HEADS = "sglang-flashinfer-logit-softcap-plan", "sglang-per-layer-heads-plan"\nout = {"doctor": {i: rows[i]["verdict"] for i in (ID, HEADS)}, "doctor_reason": rows[ID]["reason"],\n       "state": {i: st[i]["state"] for i in (ID, HEADS)}, "reason": st[ID]["reason"]}\n\nclass Layer(torch.nn.Module):\n    def __init__(self, i, cap):\n        super().__init__(); self.layer_id, self.logit_cap = i, cap\n\nclass Model(torch.nn.Module):\n    def __init__(self, caps):\n        super().__init__(); self.layers = torch.nn.ModuleList(Layer(i, c) for i, c in enumerate(caps))\n\nclass Rec:\n    def __init__(self): self.calls = []\n    def begin_forward(self, *a, **k): self.calls.append(sorted(k))\n    is_cuda_graph_enabled = False\n\nm.get_parallel = lambda: SimpleNamespace(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0)\nm.get_attention_tp_size = lambda: 1\nm.create_flashinfer_kv_indices_triton = {(2,): lambda *a: None}\n\ndef runner(caps, heads=8, per_layer=None):\n    mc = SimpleNamespace(num_attention_heads=heads, head_dim=64, get_num_kv_heads=lambda *a: 2,\n                         hf_text_config=SimpleNamespace(**({"num_attention_heads_per_layer": per_layer} if per_layer else {})),\n                         get_max_num_attention_heads=lambda: max(per_layer or [heads]))\n    return SimpleNamespace(model_config=mc, kv_cache_dtype=torch.bfloat16, dtype=torch.bfloat16, sliding_window_size=None,\n                           req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int32)),\n                           model=Model(caps), token_to_kv_pool_allocator=None)\n\ndef backend():\n    return SimpleNamespace(kv_indptr=[torch.zeros(3, dtype=torch.int32)], qo_indptr=[torch.zeros(3, dtype=torch.int32)],\n                           kv_last_page_len=torch.ones(2, dtype=torch.int32), dispatch_reason=None, num_wrappers=1,\n                           _swa_kv_pool=None, prefill_wrapper_ragged=Rec(), page_size=1, kv_index_translator=None,\n                           dq_paged_kernel_lens=None, flashinfer_kv_cache_dtype=torch.bfloat16, enable_mis=False)\n\ndef plans(caps, per_layer=None):\n    res = {}\n    for cls in (m.FlashInferIndicesUpdaterDecode, m.FlashInferIndicesUpdaterPrefill):\n        u = object.__new__(cls)\n        try:\n            cls.__init__(u, runner(caps, per_layer=per_layer), backend())\n        except ValueError as exc:\n            res[cls.__name__] = "refused: " + str(exc)[:200]\n            continue\n        w = Rec()\n        if cls is m.FlashInferIndicesUpdaterDecode:\n            spec = SimpleNamespace(kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), kv_indices=torch.arange(4, dtype=torch.int32))\n            u.call_begin_forward(w, torch.arange(2), torch.tensor([2, 2]), 4, u.kv_indptr, None, spec, None)\n            res[cls.__name__] = [w.calls, u.num_qo_heads]\n        else:\n            kw = dict(wrapper_ragged=u.attn_backend.prefill_wrapper_ragged if hasattr(u, "attn_backend") else w, wrapper_paged=w,\n                      req_pool_indices=torch.arange(2), paged_kernel_lens=torch.tensor([2, 2]), paged_kernel_lens_sum=4,\n                      seq_lens=torch.tensor([3, 3]), prefix_lens=torch.tensor([2, 2]), kv_start_idx=None,\n                      kv_indptr=torch.zeros(3, dtype=torch.int32), qo_indptr=torch.zeros(3, dtype=torch.int32), use_ragged=True, spec_info=None)\n            code = cls.call_begin_forward.__code__\n            kw = {k: v for k, v in kw.items() if k in code.co_varnames[:code.co_argcount]}\n            u.call_begin_forward(**kw)\n            ragged = kw["wrapper_ragged"]\n            res[cls.__name__] = [ragged.calls, w.calls, u.num_qo_heads]\n    return res\n\nout["capped"] = DRIVE and plans([50.0, 50.0], per_layer=[8, 16])\nout["uncapped"] = DRIVE and plans([0.0, 0.0])\nout["disagree"] = DRIVE and plans([50.0, 0.0])\nout["fast_prefill"] = None\nfrom flashfix import sglang_patch as sp\nif hasattr(m, "fast_prefill_plan"):\n    out["fast_prefill"] = sp.soft_cap_plan_kwargs(functools.partial(m.fast_prefill_plan, None), 50.0)\nout["fast_decode"] = sp.soft_cap_plan_kwargs(functools.partial(m.fast_decode_plan, None), 50.0) if hasattr(m, "fast_decode_plan") else "n/a"\nfrom flashfix.core import registry as _registry\nout["changes"] = {i: [repr(c) for c in _registry._records[i]["changes"]] for i in (ID, HEADS)}\nflashfix.revert(ID) if st[ID]["state"] == "applied" else None\nout["after_revert_soft"] = DRIVE and plans([50.0, 50.0], per_layer=[8, 16])\nflashfix.revert(HEADS) if st[HEADS]["state"] == "applied" else None\nout["after_revert_both"] = DRIVE and plans([50.0, 50.0], per_layer=[8, 16])\nprint("FLASHFIX_RESULT=" + json.dumps(out, default=str), flush=True)\n'


@functools.lru_cache(maxsize=None)
def report(release, disable="", drive=True):
    env = {"DRIVE": "1" if drive else "0"}
    if disable:
        env["FLASHFIX_DISABLE"] = disable
    (r,) = engine_env.run("sglang==" + release, SCRIPT, env=env)
    return r


CAP = ["logits_soft_cap"]


def capped(plans):
    """Per updater: whether every plan call got the cap, and the query heads planned."""
    decode, prefill = plans["FlashInferIndicesUpdaterDecode"], plans["FlashInferIndicesUpdaterPrefill"]
    calls = decode[0] + prefill[0] + prefill[1]
    return all("logits_soft_cap" in c for c in calls), any("logits_soft_cap" in c for c in calls), decode[-1], prefill[-1]


def test_series_of_two_fixes_on_one_function_applies_both_and_reverts_one():
    for release in ("0.5.11", "0.5.14"):
        r = report(release)
        assert r["doctor"] == {ID: "patch", HEADS: "patch"} == {i: "patch" for i in r["doctor"]}, r
        assert r["state"] == {ID: "applied", HEADS: "applied"}, r
        assert "on the code %s leave(s)" % HEADS in r["doctor_reason"], r
        series = [c for c in r["changes"][ID] if "__init__" in c]
        assert len(series) == 2 and all("series %s + %s" % (HEADS, ID) in c for c in series), r
        assert capped(r["capped"]) == (True, True, 16, 16), r  # both fixes in force: the cap, the widest layer's heads
        assert capped(r["uncapped"]) == (False, False, 8, 8), r  # no cap: planned as released
        assert all(v.startswith("refused: flashfix %s: the attention layers of this model cap their logits "
                                "differently (0 from layer 1, 50 from layer 0)" % ID) for v in r["disagree"].values()), r
        assert capped(r["after_revert_soft"]) == (False, False, 16, 16), r  # the other patch of the series stays
        assert capped(r["after_revert_both"]) == (False, False, 8, 8), r  # the release as shipped


def test_each_patch_of_a_series_is_disabled_alone_and_the_doctor_says_so():
    no_heads, no_cap = report("0.5.14", HEADS), report("0.5.14", ID)
    assert no_heads["doctor"] == {ID: "patch", HEADS: "disabled"} and no_heads["state"][ID] == "applied", no_heads
    assert "leave(s)" not in no_heads["doctor_reason"], no_heads  # judged on the release's code
    assert capped(no_heads["capped"]) == (True, True, 8, 8), no_heads
    assert no_cap["doctor"] == {ID: "disabled", HEADS: "patch"} and no_cap["state"][HEADS] == "applied", no_cap
    assert capped(no_cap["capped"]) == (False, False, 16, 16), no_cap


def test_the_soft_cap_alone_where_the_head_fix_is_released():
    r = report("0.5.17")
    assert r["doctor"] == {ID: "patch", HEADS: "fixed-upstream"} and r["state"][ID] == "applied", r
    assert capped(r["capped"]) == (True, True, 16, 16) and capped(r["uncapped"]) == (False, False, 8, 8), r
    assert r["fast_prefill"] == {}, r  # SGLang's fast_prefill_plan takes no cap: it reuses the captured module
    newest = report("0.5.23", drive=False)
    assert newest["doctor"][ID] == "patch" and newest["state"][ID] == "applied", newest
    assert newest["fast_prefill"] == {}, newest
