"""Run inside an SGLang environment (tests/test_swa_prefix_series.py): the doctor's verdicts, then SGLang's
FlashInfer backend imported with flashfix active, its own ``update_sliding_window`` driven with a recording
``call_begin_forward`` (CPU tensors), and the FlashInfer calls of its own ``forward_extend`` read from the
compiled code. Prints ``FLASHFIX_RESULT=<json>``."""
import json
import os
from types import SimpleNamespace

import torch

import flashfix
from flashfix.core import registry as _registry
from flashfix.tools import doctor

IDS = ("sglang-fp8-kv-scales", "sglang-swa-ragged-prefix-extend-slots", "sglang-swa-full-attn-ragged-prefix")
rows = {r["id"]: r for r in doctor.diagnose()[0]}
import sglang.srt.layers.attention.flashinfer_backend as m  # noqa: E402

WINDOW = 4
PREFIX, NEW = [10, 3, 0], [2, 3, 5]  # a prefix longer than the window, one shorter, none


def plans(use_ragged=True):
    """What update_sliding_window plans per wrapper: the lengths and start read, and the custom mask."""
    calls = []
    u = object.__new__(m.FlashInferIndicesUpdaterPrefill)
    u.__dict__.update(sliding_window_size=WINDOW, token_to_kv_pool_allocator=None, prefill_wrapper_ragged=None,
                      kv_indptr=[None, None], qo_indptr=[None, None])

    def call_begin_forward(*args, **kwargs):
        lens, start, mask = args[3], args[7], kwargs.get("cross_attention_custom_mask")
        calls.append({"lens": lens.tolist(), "start": None if start is None else start.tolist(),
                      "mask": None if mask is None else mask.int().tolist()})

    u.call_begin_forward = call_begin_forward
    prefix, seq = torch.tensor(PREFIX), torch.tensor(PREFIX) + torch.tensor(NEW)
    u.update_sliding_window(torch.arange(3), seq, seq, int(seq.sum()), prefix, [None, None], use_ragged, None, None)
    return calls


def lse_calls():
    """``[wrapper, method, sorted keywords]`` of each FlashInfer call of the live ``forward_extend``, read from its
    bytecode (the wrapper: the name or attribute loaded before the method; the keywords: the call's name tuple)."""
    import dis
    calls, pending, previous = [], [], None
    code = m.FlashInferAttnBackend.forward_extend.__code__
    for ins in dis.get_instructions(code):
        names = code.co_consts[ins.arg] if ins.opname == "KW_NAMES" else ins.argval  # 3.11's dis leaves it unread
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in ("forward", "forward_return_lse"):
            pending.append([str(previous), ins.argval])
        elif isinstance(names, tuple) and "causal" in names and pending:  # KW_NAMES (3.11, 3.12), LOAD_CONST (3.13)
            calls.append(pending.pop() + [sorted(names)])
        previous = ins.argval
    return sorted(calls)


st = {r["id"]: r for r in flashfix.status()}
out = {"doctor": {i: rows[i]["verdict"] for i in IDS}, "reasons": {i: rows[i]["reason"] for i in IDS},
       "state": {i: st[i]["state"] for i in IDS}, "state_reason": {i: st[i]["reason"] for i in IDS},
       "ragged": plans(), "paged_only": plans(use_ragged=False), "keywords": lse_calls(),
       "changes": {i: [repr(c) for c in _registry._records[i]["changes"]] for i in IDS}}
for i in os.environ.get("REVERT", ",".join(reversed(IDS))).split(","):  # in this order, each as it is then
    flashfix.revert(i)
    now = {r["id"]: r["state"] for r in flashfix.status()}
    out.setdefault("after_revert", []).append({"id": i, "state": {k: now[k] for k in IDS}, "ragged": plans(),
                                               "keywords": lse_calls()})
print("FLASHFIX_RESULT=" + json.dumps(out, default=str), flush=True)
