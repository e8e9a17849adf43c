"""sglang-cross-attn-decode-plan-lens (fixed in SGLang 0.5.10) against SGLang's own code.

SGLang 0.5.11 (the oldest engine environment; fixed) in one process: its own
``FlashInferIndicesUpdaterDecode.update_cross_attention`` runs on CPU tensors with ``call_begin_forward``
recorded (what each decode wrapper is planned with), for a batch whose encoder lengths differ from
its decoder lengths. Then with its body swapped to the pre-fix shape derived from 0.5.11 (upstream's
``seq_lens_cpu=kv_lens_cpu`` turned back into 0.5.9's ``seq_lens_cpu=seq_lens_cpu``): the encoder
wrapper is planned with the decoder's lengths (the bug); and to that shape with the declaration's
edit: planned as 0.5.11 plans it. Without an engine process: the derived shape reads ``patch`` and
0.5.11 ``fixed-upstream`` (the sweep reads 0.5.1 to 0.5.9 ``patch``, tests/test_sweep.py).
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
from flashfix import sglang_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402

PATCH = sglang_patch.CROSS_ATTN_DECODE_PLAN
QUALNAME = PATCH.rule.hunks[0].function


def derive(text):
    """``text`` with 0.5.10's fix turned back in ``update_cross_attention`` (0.5.9's call)."""
    return derived_swap.replaced_in_def(text, QUALNAME, "seq_lens_cpu=kv_lens_cpu", "seq_lens_cpu=seq_lens_cpu")


def test_derived_shape_is_patched_and_the_fixed_release_is_not():
    fixed = engine_env.installed_path("sglang==0.5.11", "sglang/srt/layers/attention/flashinfer_backend.py").read_text()
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.5.11")[0] == "fixed-upstream"
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(derive(fixed))}, "0.5.9")
    assert verdict[0] == "patch" and "cross-attention wrapper" in verdict[1], verdict


SCRIPT = r"""
import ast, copy, json, sys
sys.path.insert(0, %r)
import derived_swap
import torch
import flashfix
from flashfix import sglang_patch
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from test_cross_attn_plan import derive, QUALNAME
import sglang.srt.layers.attention.flashinfer_backend as fb

PATCH = sglang_patch.CROSS_ATTN_DECODE_PLAN
UPDATER = fb.FlashInferIndicesUpdaterDecode

def plans():
    updater = object.__new__(UPDATER)
    updater.kv_indptr = [torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)]
    calls = []
    def record(wrapper, req_pool_indices, lens, lens_sum, kv_indptr, kv_start_idx, spec_info, seq_lens_cpu=None, **kw):
        calls.append({"wrapper": wrapper, "lens": lens.tolist(), "lens_sum": int(lens_sum),
                      "seq_lens_cpu": None if seq_lens_cpu is None else seq_lens_cpu.tolist()})
    updater.call_begin_forward = record
    seq_lens, encoder_lens = torch.tensor([5, 7, 3]), torch.tensor([1601, 1601, 40])
    updater.update_cross_attention(torch.arange(3), seq_lens, seq_lens.clone(), int(seq_lens.sum()), ["decoder", "encoder"],
                                   encoder_lens, None)
    return calls

row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
out = {"state": row["state"], "released": plans()}
derived = _source.find_def(ast.parse(derive(open(fb.__file__).read())), QUALNAME)
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(UPDATER.__dict__[derived.name], derived, PATCH.rule.hunks[0], plans)
out["after_undo"] = plans()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("sglang==" + release, SCRIPT)
    return r


def test_encoder_wrapper_is_planned_with_the_encoder_lengths():
    r = report("0.5.11")
    assert r["state"] == "fixed-upstream", r
    decoder = {"wrapper": "decoder", "lens": [5, 7, 3], "lens_sum": 15, "seq_lens_cpu": [5, 7, 3]}
    encoder = {"wrapper": "encoder", "lens": [1601, 1601, 40], "lens_sum": 3242, "seq_lens_cpu": [1601, 1601, 40]}
    assert r["released"] == [decoder, encoder], r["released"]
    # the pre-fix shape: the encoder wrapper's KV is [1601, 1601, 40] but it is planned for [5, 7, 3]
    assert r["derived"] == [decoder, dict(encoder, seq_lens_cpu=[5, 7, 3])], r["derived"]
    assert r["derived_patched"] == r["released"], r["derived_patched"]
    assert r["after_undo"] == r["released"]
