"""FlashInfer's logit soft cap is chosen at plan(), not at forward(): a self-contained repro (FlashInfer + torch).

SGLang's FlashInfer backend plans its wrappers without ``logits_soft_cap`` and passes the cap only to forward().
Since FlashInfer 0.2 the kernel module (capped or not) is picked by plan(), so such a forward runs uncapped.
For a ragged prefill, a paged prefill and a paged decode (without and with tensor cores): plan without the cap, forward with logits_soft_cap=CAP (as SGLang does),
then plan with the cap; each output's relative L2 error against float64 capped attention.

    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 docs/repro/softcap_plan.py [ragged] [paged] [decode] [decode-tc]
"""
import math
import sys

import torch
import flashinfer

HQ, HKV, D, CAPS, Q_SCALE = 16, 2, 128, (50.0, 30.0), 8.0
SM_SCALE = D ** -0.5


def reference(q, k, v, cap, causal):
    """float64 attention of one request, q [n, HQ, D], k/v [m, HKV, D], logits cap * tanh(x / cap)."""
    n, m = len(q), len(k)
    k, v = (x.double().repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) * SM_SCALE
    s = cap * torch.tanh(s / cap)
    if causal:
        pos = torch.arange(n, device=q.device)[:, None] + (m - n)
        s = s.masked_fill(torch.arange(m, device=q.device)[None, :] > pos, -math.inf)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, dim=-1), v)


def err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def ragged(cap, gen):
    lens = [37, 128, 300]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = (torch.randn(sum(lens), HQ, D, generator=gen, device="cuda") * Q_SCALE).bfloat16()
    k, v = (torch.randn(sum(lens), HKV, D, generator=gen, device="cuda").bfloat16() for _ in "kv")
    ref = torch.cat([reference(q[a:b], k[a:b], v[a:b], cap, True) for a, b in zip(indptr.tolist(), indptr[1:].tolist())])
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                        backend="fa2")
    errors = []
    for plan_cap in (None, cap):  # as SGLang plans, then with the cap
        w.plan(indptr, indptr, HQ, HKV, D, causal=True, q_data_type=torch.bfloat16, logits_soft_cap=plan_cap)
        out = w.forward(q, k, v, causal=True, sm_scale=SM_SCALE, logits_soft_cap=cap)
        errors.append(err(out, ref))
    return errors


def paged_kv(kv_lens, gen, page=16):
    """A paged cache (NHD, pages shuffled) of requests of ``kv_lens`` tokens, and each request's K/V read back."""
    pages = [-(-n // page) for n in kv_lens]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kv_indices = torch.randperm(sum(pages), generator=gen, device="cuda").int()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, pages)], dtype=torch.int32, device="cuda")
    k_cache, v_cache = (torch.randn(sum(pages), page, HKV, D, generator=gen, device="cuda").bfloat16() for _ in "kv")
    kv = []
    for i, n in enumerate(kv_lens):
        rows = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        kv.append((k_cache[rows].reshape(-1, HKV, D)[:n], v_cache[rows].reshape(-1, HKV, D)[:n]))
    return kv_indptr, kv_indices, last, (k_cache, v_cache), kv, page


def paged(cap, gen):
    """A paged prefill (new tokens over a cached prefix, all in the cache), as SGLang's paged-only extend."""
    qo_lens, kv_lens = [37, 128, 300], [137, 628, 364]
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kv_indptr, kv_indices, last, cache, kv, page = paged_kv(kv_lens, gen)
    q = (torch.randn(sum(qo_lens), HQ, D, generator=gen, device="cuda") * Q_SCALE).bfloat16()
    ref = torch.cat([reference(q[a:b], k, v, cap, True) for (a, b), (k, v) in zip(zip(qo_indptr.tolist(), qo_indptr[1:].tolist()), kv)])
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                       backend="fa2")
    errors = []
    for plan_cap in (None, cap):
        w.plan(qo_indptr, kv_indptr, kv_indices, last, HQ, HKV, D, page, causal=True, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16, logits_soft_cap=plan_cap)
        out = w.forward(q, cache, causal=True, sm_scale=SM_SCALE, logits_soft_cap=cap)
        errors.append(err(out, ref))
    return errors


def decode(cap, gen, tensor_cores=False):
    kv_lens, page = [1000, 37, 500, 300], 16
    pages = [-(-n // page) for n in kv_lens]
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kv_indices = torch.randperm(sum(pages), generator=gen, device="cuda").int()
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, pages)], dtype=torch.int32, device="cuda")
    k_cache, v_cache = (torch.randn(sum(pages), page, HKV, D, generator=gen, device="cuda").bfloat16() for _ in "kv")
    q = (torch.randn(len(kv_lens), HQ, D, generator=gen, device="cuda") * Q_SCALE).bfloat16()
    ref = []
    for i, n in enumerate(kv_lens):
        rows = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        ref.append(reference(q[i:i + 1], k_cache[rows].reshape(-1, HKV, D)[:n], v_cache[rows].reshape(-1, HKV, D)[:n],
                             cap, False))
    ref = torch.cat(ref)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                      use_tensor_cores=tensor_cores)
    errors = []
    for plan_cap in (None, cap):
        w.plan(kv_indptr, kv_indices, last, HQ, HKV, D, page, data_type=torch.bfloat16, q_data_type=torch.bfloat16,
               logits_soft_cap=plan_cap)
        out = w.forward(q, (k_cache, v_cache), sm_scale=SM_SCALE, logits_soft_cap=cap)
        errors.append(err(out, ref))
    return errors


if __name__ == "__main__":
    print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    cases = {"ragged": ragged, "paged": paged, "decode": decode, "decode-tc": lambda cap, gen: decode(cap, gen, True)}
    for case in sys.argv[1:] or list(cases):
        for cap in CAPS:
            planned_without, planned_with = cases[case](cap, torch.Generator("cuda").manual_seed(0))
            print("%-9s cap %g: plan without logits_soft_cap (SGLang's call) %.4f, plan with it %.4f" % (
                case, cap, planned_without, planned_with))
