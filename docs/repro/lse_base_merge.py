"""Repro for SGLang maintainers: FlashInfer's base-2 LSE merged by a natural-log merge.

Needs one CUDA GPU, torch and flashinfer-python (nothing of SGLang or flashfix). Two cases, both of the same
mismatch: FlashInfer's ``forward_return_lse`` / ``run(return_lse=True)`` returns log2-sum-exp2, while SGLang's
merges (sgl_kernel ``merge_state_v2``, ``merge_state_triton``) weigh the parts with ``exp(lse)``.

  mla      -- sglang#40903: DeepSeek MLA chunked-prefix attention on the FlashInfer MLA backend
              (FlashInferMhaChunkKVRunner.forward -> _chunked_prefix_attn_mha -> merge_state): MHA,
              16 heads, qk 192, vo 128; the cached prefix attended in chunks.
  fallback -- sglang#23993's Triton fallback in FlashInferAttnBackend._safe_merge_state (0.5.13 on): models with
              more query heads per rank than FlashInfer's merge_state kernel launches (96 at head_dim 128).

    python lse_base_merge.py mla
    python lse_base_merge.py fallback

Prints the relative L2 error of the merged output against float64 attention, with the LSE as FlashInfer
returns it (what the released SGLang does) and multiplied by ln 2 (the fix).
"""
import math
import sys

import torch
import flashinfer

CASES = {  # heads (q, kv), head dims (qk, vo), (cached prefix, new tokens) per request, prefix chunks
    "mla": ((16, 16), (192, 128), ((300, 64), (1000, 17), (4000, 128)), 4),
    "fallback": ((96, 8), (128, 128), ((100, 37), (500, 128), (64, 300)), 1),
}


def merge_ln(o_a, s_a, o_b, s_b):
    """The merge SGLang uses (merge_state_v2 and merge_state_triton compute this): natural-log LSEs."""
    top = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - top), torch.exp(s_b - top)
    out = (o_a.float() * w_a[..., None] + o_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return out.to(o_a.dtype), torch.log(w_a + w_b) + top


def reference(q, k, v, prefix_len, scale):
    """float64 attention of the new tokens over the cached prefix (all visible) and themselves (causal)."""
    n, hq, _ = q.shape
    k, v = (x.double().repeat_interleave(hq // x.shape[1], dim=1) for x in (k, v))
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    pos = torch.arange(n, device=q.device)[:, None] + prefix_len
    s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > pos, -math.inf)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v)


def main(case):
    (hq, hkv), (dk, dv), requests, chunks = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda n, h, d: torch.randn(n, h, d, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    ws = lambda: torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # noqa: E731
    qo = torch.tensor([0] + [sum(n for _, n in requests[:i + 1]) for i in range(len(requests))], dtype=torch.int32,
                      device="cuda")
    q, k, v = rand(int(qo[-1]), hq, dk), rand(int(qo[-1]), hkv, dk), rand(int(qo[-1]), hkv, dv)
    prefix = [(rand(p, hkv, dk), rand(p, hkv, dv)) for p, _ in requests]
    scale = dk ** -0.5
    new = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws(), "NHD", backend="fa2")
    new.plan(qo, qo, hq, hkv, dk, head_dim_vo=dv, causal=True, sm_scale=scale, q_data_type=torch.bfloat16)
    o_new, s_new = new.run(q, k, v, return_lse=True)
    parts = []
    for j in range(chunks):
        ck = [pk[len(pk) * j // chunks:len(pk) * (j + 1) // chunks] for pk, _ in prefix]
        cv = [pv[len(pv) * j // chunks:len(pv) * (j + 1) // chunks] for _, pv in prefix]
        kv = torch.tensor([0] + [sum(len(x) for x in ck[:i + 1]) for i in range(len(ck))], dtype=torch.int32,
                          device="cuda")
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws(), "NHD", backend="fa2")
        w.plan(qo, kv, hq, hkv, dk, head_dim_vo=dv, causal=False, sm_scale=scale, q_data_type=torch.bfloat16)
        parts.append(w.run(q, torch.cat(ck), torch.cat(cv), return_lse=True))
    ref = torch.cat([reference(q[a:b], torch.cat([pk, k[a:b]]), torch.cat([pv, v[a:b]]), len(pk), scale)
                     for (a, b), (pk, pv) in zip(zip(qo.tolist(), qo[1:].tolist()), prefix)])
    for label, factor in (("FlashInfer's LSE as is (released SGLang)", 1.0), ("LSE * ln 2 (the fix)", math.log(2))):
        acc, acc_lse = o_new, s_new * factor
        for o, s in parts:  # chunk first, as _chunked_prefix_attn_mha calls merge_state
            acc, acc_lse = merge_ln(o, s * factor, acc, acc_lse)
        err = float((acc.double() - ref).norm() / ref.norm())
        print("%-8s %-42s relative L2 vs float64: %.4f" % (case, label, err))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mla")
