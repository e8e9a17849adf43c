"""sglang-encoder-only-paged-causal and sglang-encoder-only-ragged-causal (fixed in 0.5.11): SGLang's own
``forward_extend`` of every final release from 0.5.1 to 0.5.10.post1 (read from its wheel, loaded with stand-in
engine imports in SGLang 0.5.17's environment, FlashInfer a recording stand-in: tests/fake_flashinfer.py),
driven for an encoder-only layer and a decoder layer, paged-only and ragged + paged over a cached prefix, as
released and as patched (both fixes and the FP8-scale fix: one series on forward_extend): the ``causal`` each
FlashInfer call gets. Released, an encoder-only layer runs causal on both paths (0.5.1 to 0.5.5 pass
``causal=True`` to the ragged pass, 0.5.6 to 0.5.10 reset it to True first); patched, non-causal; a decoder
layer is the same either way."""

import json

import test_verify_engine_code as vec
import engine_env
from conftest import REPO

PAGED, RAGGED = "sglang-encoder-only-paged-causal", "sglang-encoder-only-ragged-causal"
CODE = '''
import json, sys, types
sys.path.insert(0, %(tests)r)
import torch
import fake_flashinfer
fi = fake_flashinfer.install()
from flashfix.tools import gpu_checks as g
from flashfix.core import registry as _registry
out = {}
for version, tree in %(trees)r:
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, g.EngineModuleFinder)]
    for pid in (%(paged)r, %(ragged)r):
        _registry._records[pid].update(state="waiting", changes=[], decided=None, engine_version=None)
    module, rows, head, pairs, _, _ = g._engine(%(ragged)r, tree, ["forward_extend"], fi)
    states = {pid: _registry._records[pid]["state"] for pid in (%(paged)r, %(ragged)r)}
    (live, _), = pairs  # the code kept for revert() is the series before the ragged fix: the release's is the stack's
    original = types.FunctionType(_registry._stacks[id(live)].original, live.__globals__, live.__name__,
                                  live.__defaults__, live.__closure__)
    cache = g.PagedBatch([(3, 5), (2, 4)], page_size=1, device="cpu")
    q = torch.zeros(5, g.NUM_QO_HEADS, g.HEAD_DIM, dtype=torch.bfloat16)
    k = v = torch.zeros(5, g.NUM_KV_HEADS, g.HEAD_DIM, dtype=torch.bfloat16)
    got = {}
    for label, func in (("released", original), ("patched", live)):
        for kind in ("ENCODER_ONLY", "DECODER"):
            for ragged in (False, True):
                del fake_flashinfer.LOG[:]
                wrappers = [fi.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")]
                _, _, error = g._extend(module, func, g.Calls(live.__code__.co_filename), wrappers,
                                        fi.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD"), cache, q, k, v, ragged,
                                        attn_type=kind)
                got["%%s %%s %%s" %% (label, kind, "ragged" if ragged else "paged")] = error or [
                    [e[0][len("BatchPrefillWith"):].split("KV")[0], e[1], e[3].get("causal")]
                    for e in fake_flashinfer.LOG if e[1] in ("forward", "forward_return_lse")]
    out[version] = {"states": states, "calls": got}
print("FLASHFIX_RESULT=" + json.dumps(out, default=repr))
'''


def test_encoder_only_layers_run_non_causal_on_every_release_in_range():
    trees = vec.release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", "0.5.11")
    assert len(trees) >= 25, trees
    code = CODE % {"tests": str(REPO / "tests"), "trees": trees, "paged": PAGED, "ragged": RAGGED}
    ((out,),) = [engine_env.run("sglang==0.5.17", code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    bad = {}
    for version, _ in trees:
        r = out[version]
        calls, states, problems = r["calls"], r["states"], []
        if states != {PAGED: "applied", RAGGED: "applied"}:  # the ragged fix is judged on the paged one's code
            problems.append("states %s" % states)
        want = {
            "released ENCODER_ONLY paged": [["Paged", "forward", True]],  # the bug
            "patched ENCODER_ONLY paged": [["Paged", "forward", False]],
            "released ENCODER_ONLY ragged": [["Ragged", "forward_return_lse", True], ["Paged", "forward_return_lse", False]],
            "patched ENCODER_ONLY ragged": [["Ragged", "forward_return_lse", False], ["Paged", "forward_return_lse", False]],
        }
        for label in ("released", "patched"):  # a decoder layer: causal as released, either way
            want["%s DECODER paged" % label] = [["Paged", "forward", True]]
            want["%s DECODER ragged" % label] = [["Ragged", "forward_return_lse", True], ["Paged", "forward_return_lse", False]]
        for key, calls_wanted in want.items():
            if calls[key] != calls_wanted:
                problems.append("%s: %s, wanted %s" % (key, calls[key], calls_wanted))
        if problems:
            bad[version] = problems
    assert not bad, json.dumps(bad, indent=1)[:6000]
