"""FlashInfer fa2 paged prefill planned for more (or fewer) query heads than q has, against float64.

vllm-layer-heads-plan plans a KV-cache group for its largest layer; this shows over-planning is
harmless and under-planning (the released bug) is not. Run on a GPU with FlashInfer importable:

    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 benchmarks/gpu_overplan.py
"""
import torch, flashinfer, math
torch.manual_seed(0)
dev = "cuda"; H_KV, D, P = 2, 64, 16
reqs = [(100, 37), (500, 128), (64, 300)]
pages = [math.ceil((a + b) / P) for a, b in reqs]
npages = sum(pages)
cache = torch.randn(npages, 2, P, H_KV, D, dtype=torch.bfloat16, device=dev)
kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32, device=dev)
kv_indices = torch.arange(npages, dtype=torch.int32, device=dev)
last = torch.tensor([(a + b - 1) % P + 1 for a, b in reqs], dtype=torch.int32, device=dev)
qo_indptr = torch.tensor([0] + list(torch.tensor([b for _, b in reqs]).cumsum(0).tolist()), dtype=torch.int32, device=dev)
def ref(q, hq):
    outs = []
    for i, (a, b) in enumerate(reqs):
        pg = list(range(kv_indptr[i].item(), kv_indptr[i + 1].item()))
        k = cache[pg, 0].reshape(-1, H_KV, D)[: a + b].double(); v = cache[pg, 1].reshape(-1, H_KV, D)[: a + b].double()
        qq = q[qo_indptr[i]:qo_indptr[i + 1]].double()
        g = hq // H_KV
        k = k.repeat_interleave(g, 1); v = v.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qq, k) / math.sqrt(D)
        mask = torch.arange(a + b, device=dev)[None, :] > (a + torch.arange(b, device=dev))[:, None]
        s.masked_fill_(mask[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)
ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
for planned, actual in [(16, 16), (32, 32), (32, 16), (16, 32), (48, 16)]:
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    w.plan(qo_indptr, kv_indptr, kv_indices, last, planned, H_KV, D, P, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(int(qo_indptr[-1]), actual, D, dtype=torch.bfloat16, device=dev)
    try:
        o = w.run(q, cache)
        r = ref(q, actual)
        print("planned", planned, "q heads", actual, "rel L2", ((o.double() - r).norm() / r.norm()).item())
    except Exception as e:
        print("planned", planned, "q heads", actual, "error", type(e).__name__, str(e)[:200])
