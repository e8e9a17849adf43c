"""vllm-prefill-workspace-size (fixed in vLLM 0.26.0) against vLLM's own code.

vLLM 0.27.1 (the oldest vLLM engine environment; fixed) in one process: its own
``FlashInferMetadataBuilder._get_workspace_buffer`` runs on CPU with the allocation recorded (a
2 GiB workspace is not allocated), for a wide-head model (64 query heads x 256) and a narrow one
(8 x 128) at an 8192-token prefill chunk. Then with its body swapped to the pre-fix shape derived
from 0.27.1 (the ``else`` branch 0.26.0 added removed): the fixed default size whatever the heads
(the bug); and to that shape with the declaration's edit: 0.27.1's sizes again. Without an engine
process: the derived shape reads ``patch`` and 0.27.1 ``fixed-upstream`` (the sweep reads 0.20.0 to
0.25.1 ``patch``, tests/test_sweep.py).
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
from flashfix import vllm_patch  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

PATCH = vllm_patch.WORKSPACE_SIZE
QUALNAME = PATCH.rule.hunks[0].function


def derived_def(tree):
    """``_get_workspace_buffer`` of the module ``tree`` without 0.26.0's ``else`` branch (the pre-fix
    shape), edited in place."""
    func = _source.find_def(tree, QUALNAME)
    (test,) = [n for n in ast.walk(func) if isinstance(n, ast.If) and ast.unparse(n.test) == "envs.VLLM_BATCH_INVARIANT"]
    assert test.orelse, ast.unparse(func)
    test.orelse = []
    return func


def test_derived_shape_is_patched_and_the_fixed_release_is_not():
    fixed = engine_env.installed_path("vllm==0.27.1", "vllm/v1/attention/backends/flashinfer.py").read_text()
    assert _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(fixed)}, "0.27.1")[0] == "fixed-upstream"
    tree = ast.parse(fixed)
    derived_def(tree)
    verdict = _registry.judge(PATCH, {PATCH.targets[0]: ast.parse(ast.unparse(tree))}, "0.25.1")
    assert verdict[0] == "patch" and "fixed default workspace" in verdict[1], verdict


SCRIPT = r"""
import ast, copy, json, sys
from types import SimpleNamespace
sys.path.insert(0, %r)
import derived_swap
import flashfix
from flashfix import vllm_patch
from flashfix.core import registry as _registry
from test_workspace_size import derived_def, QUALNAME
import vllm.v1.attention.backends.flashinfer as m

PATCH = vllm_patch.WORKSPACE_SIZE
real_torch = m.torch
m.torch = SimpleNamespace(uint8=real_torch.uint8, zeros=lambda size, dtype, device: ("zeros", size))  # recorded only

def sizes():
    out = {}
    for heads, head_dim in ((64, 256), (8, 128)):
        b = object.__new__(m.FlashInferMetadataBuilder)
        b._workspace_buffer, b.device, b.num_qo_heads, b.head_dim = None, "cpu", heads, head_dim
        b.max_num_batched_tokens = 8192  # 0.26.0 and later read it from the builder
        b.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))
        out["%%dx%%d" %% (heads, head_dim)] = b._get_workspace_buffer()[1]
    return out

row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
out = {"state": row["state"], "released": sizes(), "default": m.envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE}
derived = derived_def(ast.parse(open(m.__file__).read()))
out["derived"], out["derived_patched"] = derived_swap.pre_fix_and_patched(m.FlashInferMetadataBuilder.__dict__[QUALNAME.split(".")[1]], derived, PATCH.rule.hunks[0], sizes)
m.torch = real_torch
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
""" % str(TESTS)


@functools.lru_cache(maxsize=None)
def report(release):
    (r,) = engine_env.run("vllm==" + release, SCRIPT)
    return r


def test_wide_heads_get_a_workspace_for_the_prefill_chunk():
    r = report("0.27.1")
    assert r["state"] == "fixed-upstream", r
    default, wide = r["default"], 8192 * 64 * 256 * 16
    assert wide > default > 8192 * 8 * 128 * 16, r  # the wide model outgrows the default, the narrow one does not
    assert r["released"] == {"64x256": wide, "8x128": default}, r
    assert r["derived"] == {"64x256": default, "8x128": default}, r  # the bug: the default whatever the heads
    assert r["derived_patched"] == r["released"], r
