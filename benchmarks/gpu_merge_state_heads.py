"""FlashInfer's ``merge_state`` past its launch limit, and SGLang's Triton fallback on FlashInfer's LSEs.

SGLang's FlashInfer backend merges a ragged (new tokens) and a paged (cached prefix) prefill with
FlashInfer's ``merge_state``, whose block holds head_dim / vec_size x num_heads threads: with more
than 64 query heads per rank at head_dim 128 in bf16 it cannot launch. sglang#23993 (0.5.13) falls
back to SGLang's Triton ``merge_state_triton`` there, which takes natural-log LSEs, while
FlashInfer's are base 2. This runs, against float64, for 32/64/96/128 query heads: FlashInfer's
merge, the Triton merge as 0.5.13+ calls it, and flashfix's ``merge_state_any_heads`` /
``merge_base2``. Run on a GPU with FlashInfer importable, given the engine's own Triton merge file:

    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 benchmarks/gpu_merge_state_heads.py SGLANG_MERGE_STATE_PY [...]
"""
import importlib.util
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
import flashinfer  # noqa: E402
from flashinfer.cascade import merge_state  # noqa: E402

from flashfix import sglang_patch  # noqa: E402

dev, HKV, D, P = "cuda", 8, 128, 1
REQS = [(100, 37), (500, 128), (1000, 16), (64, 300)]  # (cached prefix, new tokens)


def load(path):
    spec = importlib.util.spec_from_file_location("engine_merge_state_%d" % abs(hash(path)), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.merge_state_triton


def reference(q, ks, vs, qo, heads):
    out = []
    for i, (p, n) in enumerate(REQS):
        k, v = (x[i].double().repeat_interleave(heads // HKV, 1) for x in (ks, vs))
        qq = q[qo[i]:qo[i + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qq, k) / math.sqrt(D)
        mask = torch.arange(p + n, device=dev)[None, :] > (p + torch.arange(n, device=dev))[:, None]
        out.append(torch.einsum("hqk,khd->qhd", s.masked_fill(mask[None], -math.inf).softmax(-1), v))
    return torch.cat(out)


def main(paths):
    torch.manual_seed(0)
    tritons = {p: load(p) for p in paths}
    qo = [0]
    for _, n in REQS:
        qo.append(qo[-1] + n)
    ks = [torch.randn(p + n, HKV, D, device=dev).bfloat16() for p, n in REQS]
    vs = [torch.randn(p + n, HKV, D, device=dev).bfloat16() for p, n in REQS]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(ks, REQS)])
    v_new = torch.cat([v[p:] for v, (p, _) in zip(vs, REQS)])
    pages = sum(p for p, _ in REQS)
    cache = torch.cat([torch.stack([k[:p], v[:p]], 1) for k, v, (p, _) in zip(ks, vs, REQS)]).unsqueeze(2)  # [pages, 2, 1, H, D]
    kv_indptr = torch.tensor([0] + list(torch.tensor([p for p, _ in REQS]).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    qo_t = torch.tensor(qo, dtype=torch.int32, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for heads in (32, 64, 96, 128):  # stops after the first FlashInfer launch failure
        q = torch.randn(qo[-1], heads, D, device=dev).bfloat16()
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        ragged.plan(qo_t, qo_t, heads, HKV, D, causal=True, q_data_type=torch.bfloat16)
        o1, s1 = ragged.run(q, k_new, v_new, return_lse=True)
        paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        paged.plan(qo_t, kv_indptr, torch.arange(pages, dtype=torch.int32, device=dev),
                   torch.ones(len(REQS), dtype=torch.int32, device=dev), heads, HKV, D, P, causal=False,
                   q_data_type=torch.bfloat16)
        o2, s2 = paged.run(q, cache, return_lse=True)
        ref = reference(q, ks, vs, qo, heads)
        err = lambda o: float((o.double() - ref).norm() / ref.norm())  # noqa: E731
        row = {"heads": heads, "head_dim": D, "dtype": "bf16", "launches": sglang_patch.merge_state_launches(o1)}

        def measure(key, run):  # each variant's own error, raised where it happens (CUDA_LAUNCH_BLOCKING=1)
            try:
                out = run()
                torch.cuda.synchronize()
                (torch.ones(1, device=dev) * 2).item()  # a launch error FlashInfer left pending is raised here
                row[key] = err(out[0])
                return out
            except Exception as exc:
                row[key] = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:160])

        for path, triton_merge in tritons.items():
            tag = path.rsplit("/", 1)[-1]
            measure("triton_as_sglang_calls_it[%s]" % tag, lambda: triton_merge(o1, s1, o2, s2))
            mine = measure("flashfix_merge_base2[%s]" % tag, lambda: sglang_patch.merge_base2(triton_merge, o1, s1, o2, s2))
            measure("flashfix_merge_state_any_heads[%s]" % tag,
                    lambda: sglang_patch.merge_state_any_heads(merge_state, triton_merge)(o1, s1, o2, s2))
            if mine is not None and sglang_patch.merge_state_launches(o1):
                row["merge_base2_lse_vs_flashinfer_maxdiff[%s]" % tag] = float((mine[1] - merge_state(o1, s1, o2, s2)[1]).abs().max())
        lse_ref = torch.cat([torch.logsumexp(torch.einsum("qhd,khd->hqk", q[qo[i]:qo[i + 1]].double(),
                            ks[i][p:].double().repeat_interleave(heads // HKV, 1)) / math.sqrt(D)
                            + torch.where(torch.arange(n, device=dev)[None, :] > torch.arange(n, device=dev)[:, None],
                                          -math.inf, 0.0)[None], -1).T for i, (p, n) in enumerate(REQS)])
        row["ragged_lse_vs_log2_maxdiff"] = float((s1.double() - lse_ref / math.log(2)).abs().max())
        row["ragged_lse_vs_ln_maxdiff"] = float((s1.double() - lse_ref).abs().max())
        measure("flashinfer_merge_state", lambda: merge_state(o1, s1, o2, s2))  # last: past the limit it fails
        rows.append(row)
        print(json.dumps(row), flush=True)
        if isinstance(row["flashinfer_merge_state"], str):  # its failed launch stays pending: later launches fail too
            break
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
