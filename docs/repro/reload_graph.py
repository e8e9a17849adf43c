"""What a weight reload does to a CUDA graph captured before it (vllm-mla-weights-reload,
vllm-mla-dcp-qrep-weights-reload): torch only, one GPU.

An MLA layer's absorbed weight (``W_UV``) is derived from ``kv_b_proj`` at every weight load, from a new
tensor where the checkpoint is quantised. A graph captured at start-up multiplies by the tensor bound then.
On a reload the release binds the attribute to the new tensor (``layer.W_UV = new``): the graph keeps
reading the first one. flashfix's ``keep_storage`` copies the new values into the bound tensor instead.
Prints the replayed output's error against the new weights, for both, and against the old weights.

    python docs/repro/reload_graph.py
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flashfix.vllm_patch import keep_storage  # noqa: E402


def run(reload):
    torch.manual_seed(0)
    layer = SimpleNamespace()
    first, second = (torch.randn(16, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layer.W_UV = first.clone()  # the first load: a tensor derived from the checkpoint
    x = torch.randn(16, 8, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, 8, 128, device="cuda", dtype=torch.bfloat16)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.bmm(x, layer.W_UV, out=out)  # warm-up, as a capture needs
        with torch.cuda.graph(graph, stream=stream):
            torch.bmm(x, layer.W_UV, out=out)
    torch.cuda.synchronize()
    reload(layer, second.clone())  # the reload: a new tensor derived from the new checkpoint
    graph.replay()
    torch.cuda.synchronize()
    want_new, want_old = (torch.bmm(x.float(), w.float()) for w in (second, first))
    err = lambda want: ((out.float() - want).norm() / want.norm()).item()  # noqa: E731
    return err(want_new), err(want_old)


def rebind(layer, value):
    layer.W_UV = value  # what the release does


if __name__ == "__main__":
    for name, how in (("released (rebinds W_UV)", rebind),
                      ("keep_storage (copies into it)", lambda layer, value: keep_storage(layer, "W_UV", value))):
        new, old = run(how)
        print("%-32s replay vs the new weights: %.4f   vs the old weights: %.4f" % (name, new, old))
