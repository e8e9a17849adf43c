"""`flashfix verify`'s engine checks, on the CPU: the engines' own functions (loaded from their
wheels with stand-in imports, or installed) are driven with a FlashInfer stand-in that records every
wrapper call and its arguments (tests/fake_flashinfer.py), so a release whose function reads
something verify does not build fails here, not on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine_env
from conftest import REPO

WHEELS = Path(os.environ.get("FLASHFIX_WHEEL_CACHE", Path.home() / ".cache" / "flashfix-wheels"))

CODE = '''
import json, os, sys
sys.path.insert(0, %(tests)r)
import fake_flashinfer
fi = fake_flashinfer.install(into_sys_modules=%(path)r is not None)
from flashfix.tools import gpu_checks as g
if %(path)r is None:  # the installed engine on a CPU (no FlashInfer import there): the merge is the fake's
    import importlib
    m = importlib.import_module(%(target)r)
    m.merge_state = m._safe_merge_state = fi.cascade.merge_state
rows = g.%(check)s(path=%(path)r, fi=fi)
print("FLASHFIX_RESULT=" + json.dumps({"rows": rows, "log": fake_flashinfer.LOG}, default=repr))
'''


def wheel(spec):
    WHEELS.mkdir(parents=True, exist_ok=True)
    name, version = spec.split("==")
    found = sorted(WHEELS.glob("%s-%s-*.whl" % (name, version)))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(WHEELS)], check=True)
        found = sorted(WHEELS.glob("%s-%s-*.whl" % (name, version)))
    return str(found[0])


def drive(requirement, check, path, target=None):
    code = CODE % {"tests": str(REPO / "tests"), "check": check, "path": path, "target": target}
    ((result,),) = [engine_env.run(requirement, code,
                                   env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    return result["rows"], result["log"]


@pytest.mark.parametrize("release", ["sglang==0.5.1", "sglang==0.5.16", None])
def test_sglang_forward_extend_is_driven_and_the_fix_passes_the_scales(release):
    path = wheel(release) if release else None  # None: the installed 0.5.17
    rows, log = drive("sglang==0.5.17", "sglang_fp8", path, "sglang.srt.layers.attention.flashinfer_backend")
    main = [r for r in rows if r["case"] == "ragged+paged, FP8 e4m3"]
    assert len(main) == 2 and all(r["error_pre_fix"] is None and r["error_flashfix"] is None for r in main), [
        (r["error_pre_fix"], r["error_flashfix"]) for r in main]
    for r in main:  # the branch ran: one ragged and one paged forward_return_lse from the engine's file
        assert [c.split(" line")[0] for c in r["calls_flashfix"]] == ["ragged.forward_return_lse", "paged.forward_return_lse"]
    paged = [entry for entry in log if entry[1] == "forward_return_lse" and "causal" in entry[3] and not entry[3]["causal"]]
    scales = [(e[3].get("k_scale"), e[3].get("v_scale")) for e in paged]
    assert scales[0] == (None, None)  # as released: the scales are dropped
    expected = ("tensor[] float32", "tensor[] float32") if release == "sglang==0.5.1" else (0.05, 0.07)
    assert scales[1] == expected  # patched: 0.5.1's layer.k_scale, later layer.k_scale_float
    controls = [r for r in rows if r.get("control")]
    assert controls and all(r["bitwise_equal"] and not r.get("error_flashfix") for r in controls), controls


def test_vllm_factory_and_forward_are_driven_on_the_derived_pre_fix_shape(tmp_path):
    site = Path(engine_env.env_python("vllm==0.28.0")).parents[1]
    fixed = next(site.glob("lib/python*/site-packages/vllm/v1/attention/backends/flashinfer.py"))
    meta = next(site.glob("lib/python*/site-packages/vllm-0.28.0.dist-info/METADATA"))
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_prefix_shape

    target = tmp_path / "vllm" / "v1" / "attention" / "backends"
    target.mkdir(parents=True)
    (target / "flashinfer.py").write_text(vllm_prefix_shape.derive_prefix_source(fixed.read_text()))
    (tmp_path / "vllm-0.28.0.dist-info").mkdir()
    (tmp_path / "vllm-0.28.0.dist-info" / "METADATA").write_text(meta.read_text())
    rows, log = drive("vllm==0.28.0", "vllm_sink", str(tmp_path))
    sinks = [r for r in rows if r["case"].startswith("sink prefill")]
    assert len(sinks) == 2 and all(r["wrapper_pre_fix"] == "BatchPrefillWithPagedKVCacheWrapper"
                                   and r["wrapper_flashfix"] == "BatchAttentionWithAttentionSinkWrapper"
                                   and not r["error_flashfix"] and len(r["calls_flashfix"]) == 1 for r in sinks), sinks
    runs = [e for e in log if e[1] == "run"]
    sink_runs = [e for e in runs if e[0] == "BatchAttentionWithAttentionSinkWrapper"]
    assert sink_runs and all(e[2][1] == "tensor[16] float32" and "sinks" not in e[3] for e in sink_runs)
    assert all(r["bitwise_equal"] for r in rows if r.get("control"))
