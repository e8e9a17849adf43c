"""`flashfix verify` on a machine without a GPU: the documented exit codes and sentences."""

import json
import subprocess
import sys

import engine_env
from conftest import REPO, run_py


def test_no_engine_exit_code_and_sentence():
    # this interpreter has no vLLM, SGLang or FlashInfer
    _, proc = run_py("from flashfix.tools.cli import main; raise SystemExit(main(['verify']))", check=False)
    assert proc.returncode == 4, proc.stderr
    assert "flashfix verify: no engine to check: none of vLLM, SGLang or FlashInfer is installed" in proc.stdout


def test_no_gpu_exit_code_and_sentence_in_a_real_engine_environment():
    code = '''
import json, subprocess, sys
plain = subprocess.run([sys.executable, "-m", "flashfix", "verify"], capture_output=True, text=True)
as_json = subprocess.run([sys.executable, "-m", "flashfix", "verify", "--json"], capture_output=True, text=True)
print("FLASHFIX_RESULT=" + json.dumps([plain.returncode, plain.stdout, as_json.returncode, as_json.stdout, as_json.stderr]))
'''
    ((rc, out, rc_json, out_json, err_json),) = engine_env.run("vllm==0.28.0", code)
    assert rc == 3, out
    assert "flashfix verify: no GPU to check on: torch" in out and "sees no CUDA device" in out
    assert rc_json == 3
    assert json.loads(out_json)["reason"] == "no GPU"
    assert "no GPU to check on" in err_json


def test_check_runner_reports_pass_fail_and_crash_per_check():
    # the runner's own logic, with stand-in check expressions (the real checks need a GPU)
    (r,), proc = run_py('''
        import time
        from flashfix.tools import verify as _verify
        _verify.CHECKS = (
            ("ok", "vllm-sink-prefill", "[{'err_flashfix': 0.001, 'err_pre_fix': 0.6}]"),
            ("too far", "sglang-fp8-kv-scales", "[{'err_flashfix': 0.5, 'err_pre_fix': 100.0}]"),
            ("crash", "flashinfer-sink-jit-name", "1/0"),
        )
        results = _verify._run_checks({"vllm-sink-prefill", "sglang-fp8-kv-scales", "flashinfer-sink-jit-name"},
                                      False, time.time())
        report(results={x["check"]: x["passed"] for x in results})
    ''')
    assert r["results"] == {"ok": True, "too far": False, "crash": False}
    assert "ok: pass, max relative error with flashfix 0.001 (threshold 0.005), without the fix 0.6" in proc.stdout
    assert "too far: FAIL" in proc.stdout and "ZeroDivisionError" in proc.stdout


def test_vllm_check_builds_through_the_runtime_factory_edit():
    # The GPU check's factory is the runtime's own edit (the declaration's factory hunk) applied to a
    # stand-in of vLLM's pre-fix factory; here its constructions are recorded, on the CPU.
    code = '''
import json, sys, types
from flashfix.tools import gpu_checks as _gpu_checks
from flashfix.core import registry as _registry

class Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
class Sink(Recorder): pass
class Generic(Recorder): pass

def describe(w):
    return [type(w).__name__, list(w.args), {k: str(v) for k, v in sorted(w.kwargs.items())}]

out = {}
for backend in ("auto", "fa2"):
    original, fixed, builder = _gpu_checks._vllm_stand_ins(backend, 128, lambda: "workspace", Sink, Generic)
    b = builder()
    out[backend] = {"fixed": describe(fixed(b)), "cached": fixed(b) is b._prefill_wrapper,
                    "noncausal": describe(fixed(b, causal=False)), "original": describe(original(builder()))}
b = builder(); b.has_sinks = False
out["no sinks"] = describe(fixed(b))
_gpu_checks.current_platform.is_device_capability_family = lambda family: False
out["not SM12x"] = describe(fixed(builder()))
b = builder(); b.is_kvcache_nvfp4 = True
try:
    _gpu_checks.current_platform.is_device_capability_family = lambda family: family == 120
    fixed(b)
except NotImplementedError as exc:
    out["nvfp4"] = "NotImplementedError"
class Run(Recorder):
    def run(self, *args, **kwargs):
        self.ran = [list(map(str, args)), {k: str(v) for k, v in sorted(kwargs.items())}]
forward = _gpu_checks._fixed_vllm_forward()
impl = _gpu_checks._VllmImplStandIn(0.5, "S")
layer = types.SimpleNamespace(_q_scale_float=2.0, _k_scale_float=3.0, _v_scale_float=4.0)
for label, cls in (("forward sink", type("SinkRun", (Run, Sink), {})), ("forward generic", Run)):
    _gpu_checks.BatchAttentionWithAttentionSinkWrapper = Sink
    wrapper = cls()
    forward(impl, layer, wrapper, "q", "kv", "out", None)
    out[label] = wrapper.ran
out["same function"] = _gpu_checks._fixed_vllm_factory() is fixed
out["code differs"] = fixed.__code__.co_code != original.__code__.co_code
print("FLASHFIX_RESULT=" + json.dumps(out))
'''
    (r,) = engine_env.run("vllm==0.28.0", code)
    sink = {"backend": "auto", "head_dim_qk": "64", "head_dim_vo": "64", "kv_data_type": "torch.bfloat16",
            "q_data_type": "torch.bfloat16", "window_left": "128"}
    assert r["auto"]["fixed"] == ["Sink", ["workspace", "NHD"], sink]
    assert r["auto"]["noncausal"] == ["Sink", ["workspace", "NHD"], sink]
    assert r["auto"]["cached"] is True
    assert r["auto"]["original"] == ["Generic", ["workspace", "NHD"], {"backend": "auto"}]
    # on SM12x FlashInfer's "auto" picks fa2: the check forces it through a subclass
    assert r["fa2"]["fixed"] == ["sink_for_module", ["workspace", "NHD"], dict(sink, backend="fa2")]
    assert r["fa2"]["original"] == ["Generic", ["workspace", "NHD"], {"backend": "fa2"}]
    assert r["no sinks"] == r["not SM12x"] == ["Generic", ["workspace", "NHD"], {"backend": "fa2"}]
    assert r["nvfp4"] == "NotImplementedError"
    assert r["same function"] is True and r["code differs"] is True
    # forward: the sink wrapper gets the sinks and the merged scale sm_scale * q_scale * k_scale
    assert r["forward sink"] == [["q", "kv", "S", "3.0"], {"out": "out", "v_scale": "4.0"}]
    assert r["forward generic"] == [["q", "kv"], {"k_scale": "3.0", "kv_cache_sf": "None", "out": "out",
                                                  "q_scale": "2.0", "v_scale": "4.0"}]


def test_sglang_check_runs_the_fp8_declarations_own_edit():
    # verify's fp8-paged check (GPU) runs this twin; on the CPU, record what its paged calls get.
    # The test interpreter has no SGLang, as on a GPU box where verify checks FlashInfer alone: the
    # twin must come from the stand-in's own source, never from an installed engine's.
    code = '''
import json, sys, types
from flashfix.tools import gpu_checks

calls = []
class Recorder:
    def __init__(self, tag):
        self.tag = tag
    def forward_return_lse(self, *args, **kwargs):
        calls.append([self.tag, len(args), kwargs])
        return self.tag + "-o", self.tag + "-s"
gpu_checks.merge_state = lambda o1, s1, o2, s2: ([o1, o2], None)
cls = gpu_checks._fixed_sglang_forward_extend()
layer = types.SimpleNamespace(scaling=0.5, k_scale_float=2.0, v_scale_float=3.0)
out = cls(Recorder("ragged"), Recorder("paged")).forward_extend("q", "k", "v", layer, "kv", True)
report(calls=calls, out=out, sglang="sglang" in sys.modules)
'''
    (r,), _ = run_py(code)
    assert r["sglang"] is False
    assert r["out"] == ["ragged-o", "paged-o"]
    assert r["calls"] == [["ragged", 3, {"causal": True, "sm_scale": 0.5}],
                          ["paged", 2, {"causal": False, "sm_scale": 0.5, "k_scale": 2.0, "v_scale": 3.0}]]
