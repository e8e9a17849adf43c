"""sglang-merge-state-launch-limit (sglang#23993, fixed in 0.5.13) and sglang-merge-state-fallback-lse-base
(flashfix's own: every release from 0.5.13) against SGLang's own code.

FlashInfer's ``merge_state`` cannot launch past 1,024 threads per block (head_dim / vec_size x heads); 0.5.13
falls back to SGLang's Triton merge there, which reads natural-log LSEs while FlashInfer's are base 2
(measured on an H200: benchmarks/results/gpu_merge_state_heads.jsonl). On the CPU the two kernels are
stand-ins with their documented math (FlashInfer: base-2 LSEs in and out; the Triton kernel: ``tl.exp`` /
``tl.log``), installed where the engine imports them from, so what is under test is the engine's own
dispatch and what flashfix feeds the fallback:

* 0.5.11 (released, pre-#23993): the module's ``merge_state``, which forward_extend calls, as flashfix rebinds
  it: FlashInfer's kernel exactly where 0.5.23's own ``_merge_state_max_safe_num_heads`` allows it, else the
  fallback with converted LSEs, equal to the base-2 merge in float64; ``revert()`` restores FlashInfer's.
* 0.5.23 (latest): its own ``_safe_merge_state`` as released (the fallback about 5 % off here) and as
  flashfix rewrites it (equal to the base-2 merge); the same dispatch.
Without an engine process: 0.5.13 with #23993 turned back reads ``patch`` for the launch limit and
``not-affected`` for the fallback; 0.5.13 as released the reverse (the sweep reads every release).
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
from flashfix import sglang_patch  # noqa: E402
from flashfix.core import locate as _locate  # noqa: E402
from flashfix.core import paths as _paths  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

LIMIT, FALLBACK = sglang_patch.MERGE_STATE_LAUNCH_LIMIT, sglang_patch.MERGE_FALLBACK_LSE_BASE
BACKEND = "sglang/srt/layers/attention/flashinfer_backend.py"


def without_23993(text):
    """0.5.13's module with sglang#23993 turned back: no Triton import, limit or ``_safe_merge_state`` in the
    FlashInfer block, and forward_extend calling FlashInfer's ``merge_state`` again."""
    tree = ast.parse(text)
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "is_flashinfer_available()")
    first = next(s for s in block.body if "merge_state_triton" in ast.unparse(s) or "MAX_THREADS" in ast.unparse(s))
    lines = text.splitlines(True)
    kept = lines[:first.lineno - 1] + lines[block.end_lineno:]
    out = "".join(kept)
    assert out.count("_safe_merge_state(o1, s1, o2, s2)") == 1
    return out.replace("_safe_merge_state(o1, s1, o2, s2)", "merge_state(o1, s1, o2, s2)")


def test_the_fix_turned_back_is_patched_and_the_released_fix_is_not():
    path = engine_env.installed_path("sglang==0.5.13", BACKEND)
    fixed, target = path.read_text(), LIMIT.targets[0]
    with _locate.reading(_paths.PathReader([engine_env.site_packages(engine_env.env_python("sglang==0.5.13"))])):
        assert _registry.judge(LIMIT, {target: _source.Module(fixed, BACKEND)}, "0.5.13")[0] == "fixed-upstream"
        assert _registry.judge(FALLBACK, {target: _source.Module(fixed, BACKEND)}, "0.5.13")[0] == "patch"
        derived = _source.Module(without_23993(fixed), BACKEND)
        verdict = _registry.judge(LIMIT, {target: derived}, "0.5.12")  # the Triton merge read from that release
        assert verdict[0] == "patch" and "any head count" in verdict[1], verdict
        assert _registry.judge(FALLBACK, {target: derived}, "0.5.13")[0] == "not-affected"


SCRIPT = r"""
import json, math, sys
import torch
import flashinfer.cascade
import sglang.srt.utils

CALLS = []

def merge(base, name):  # v [tokens, heads, dim], s [tokens, heads] in log-``base`` units
    def run(v_a, s_a, v_b, s_b, *rest):
        CALLS.append(name)
        top = torch.maximum(s_a, s_b).double()
        w_a, w_b = torch.pow(base, s_a.double() - top), torch.pow(base, s_b.double() - top)
        v = (v_a.double() * w_a[..., None] + v_b.double() * w_b[..., None]) / (w_a + w_b)[..., None]
        return v.to(v_a.dtype), (top + torch.log(w_a + w_b) / math.log(base)).float()
    return run

flashinfer.cascade.merge_state = merge(2.0, "flashinfer")  # the kernel's math: base-2 LSEs (no GPU here)
TRITON = %(triton)r
__import__(TRITON)
sys.modules[TRITON].merge_state_triton = merge(math.e, "triton")  # the Triton kernel's math: tl.exp / tl.log
sglang.srt.utils.is_flashinfer_available = lambda: True  # the FlashInfer block of the module runs
import flashfix
import sglang.srt.layers.attention.flashinfer_backend as m
from flashfix.core import registry

def reference(v_a, s_a, v_b, s_b):
    return merge(2.0, "reference")(v_a, s_a, v_b, s_b)[0]

def cases(func):
    out = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (64, 128, 256):
            for heads in (16, 32, 33, 64, 65, 96, 128):
                v_a, v_b = (torch.randn(5, heads, head_dim, generator=gen).to(dtype) for _ in "ab")
                s_a, s_b = (torch.randn(5, heads, generator=gen) * 8 for _ in "ab")  # base-2, as FlashInfer's
                del CALLS[:]
                v = func(v_a, s_a, v_b, s_b)[0]
                ref = reference(v_a, s_a, v_b, s_b)
                err = float((v.double() - ref.double()).norm() / ref.double().norm())
                out["%%s %%d x %%d" %% (str(dtype)[6:], heads, head_dim)] = [CALLS[0], round(err, 4)]
    return out

out = {"states": {r["id"]: r["state"] for r in flashfix.status() if "merge-state" in r["id"]}}
if hasattr(m, "_merge_state_max_safe_num_heads"):
    out["fixed_rule"] = {"%%s %%d" %% (str(d)[6:], hd): m._merge_state_max_safe_num_heads(hd, d.itemsize)
                         for d in (torch.bfloat16, torch.float16, torch.float32) for hd in (64, 128, 256)}
if hasattr(m, "_safe_merge_state"):
    out["patched"] = cases(m._safe_merge_state)
    registry.revert(%(fallback)r)
    out["released"] = cases(m._safe_merge_state)
else:
    out["patched"] = cases(m.merge_state)
    registry.revert(%(limit)r)
    out["released_is_flashinfer"] = m.merge_state is flashinfer.cascade.merge_state
    out["left"] = [n for n in ("merge_state_any_heads", "merge_state_triton") if hasattr(m, n)]
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
"""


@functools.lru_cache(maxsize=None)
def report(release, triton):
    (r,) = engine_env.run("sglang==" + release, SCRIPT % {"triton": triton, "limit": LIMIT.id, "fallback": FALLBACK.id})
    return r


def latest():
    return report("0.5.23", "sglang.kernels.ops.attention.merge_state")


def launches(name, rule):
    """Does the fixed release's own rule let FlashInfer's kernel run this case (``bfloat16 96 x 128``)?"""
    dtype, heads, _, head_dim = name.split()
    return int(heads) <= rule["%s %s" % (dtype, head_dim)]


def test_the_latest_release_feeds_its_triton_fallback_base_2_lses_and_flashfix_converts_them():
    r = latest()
    assert r["states"] == {LIMIT.id: "fixed-upstream", FALLBACK.id: "applied"}, r["states"]
    rule = r["fixed_rule"]
    assert rule == {"bfloat16 64": 128, "bfloat16 128": 64, "bfloat16 256": 32, "float16 64": 128, "float16 128": 64,
                    "float16 256": 32, "float32 64": 64, "float32 128": 32, "float32 256": 32}, rule
    for name, (kernel, err) in r["released"].items():
        assert kernel == ("flashinfer" if launches(name, rule) else "triton"), name
        if kernel == "triton":
            assert err > 0.02, (name, err)  # base-2 LSEs read as natural log: the parts mis-weighted
    for name, (kernel, err) in r["patched"].items():
        assert kernel == r["released"][name][0], name  # the same dispatch
        assert err < 0.01, (name, err)  # the dtype's rounding only


def test_the_launch_limit_backport_dispatches_as_the_fixed_release_and_merges_right():
    r = report("0.5.11", "sglang.srt.layers.attention.triton_ops.merge_state")
    assert r["states"] == {LIMIT.id: "applied", FALLBACK.id: "not-affected"}, r["states"]
    rule = latest()["fixed_rule"]
    for name, (kernel, err) in r["patched"].items():
        assert kernel == ("flashinfer" if launches(name, rule) else "triton"), name  # 0.5.23's own rule
        assert err < 0.01, (name, err)
    assert r["released_is_flashinfer"] and r["left"] == [], r  # revert(): FlashInfer's merge_state, nothing added


def test_the_diff_of_the_module_level_change_is_the_one_added_line():
    """``flashfix diff`` prints the rebinding inside ``if is_flashinfer_available():`` as one added line; the
    statements around it keep the file's own spelling (the runtime compiles that same text)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(TESTS.parent)
    proc = subprocess.run([str(engine_env.env_python("sglang==0.5.11")), "-m", "flashfix", "diff", LIMIT.id],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    module = proc.stdout.split(".<module>:", 1)[1]
    changed = [line for line in module.splitlines()[3:] if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["+    merge_state = merge_state_any_heads(merge_state, merge_state_triton)"], module
