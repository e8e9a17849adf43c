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
            ("ok", "vllm-sink-prefill", 0.005, "[{'err_flashfix': 0.001, 'err_pre_fix': 0.6}]"),
            ("too far", "sglang-fp8-kv-scales", 0.01, "[{'err_flashfix': 0.5, 'err_pre_fix': 100.0}]"),
            ("crash", "flashinfer-sink-jit-name", 0.005, "1/0"),
            ("cannot run here", "vllm-mla-trtllm-ragged-lse", 0.01, "[{'case': 'not run', 'not_run': 'needs SM100'}]"),
        )
        results = _verify._run_checks({("vllm-sink-prefill", None), ("sglang-fp8-kv-scales", None), ("flashinfer-sink-jit-name", None),
                                       ("vllm-mla-trtllm-ragged-lse", None)}, False, time.time())
        report(results={x["check"]: x["passed"] for x in results})
    ''')
    assert r["results"] == {"ok": True, "too far": False, "crash": False, "cannot run here": None}  # None: not a pass
    assert "cannot run here: NOT RUN (not a pass): needs SM100" in proc.stdout
    assert "ok: pass, max relative error with flashfix 0.001 (threshold 0.005), without the fix 0.6" in proc.stdout
    assert "too far: FAIL" in proc.stdout and "ZeroDivisionError" in proc.stdout


def test_result_counts_a_mismatch_present_without_flashfix_apart_and_fails_anything_else():
    # rows as flashfix.tools.gpu_checks reports them (benchmarks/results/verify_h200.json has real ones)
    (r,), _ = run_py('''
        from flashfix.tools import verify as _verify
        import json
        ok = type("P", (), {"returncode": 0})()
        mismatch = "engine/FlashInfer mismatch present without flashfix: ..."
        rows = [{"case": "ragged+paged", "err_pre_fix": 118.0, "err_flashfix": None, "error_flashfix": "TypeError: x",
                 "mismatch": mismatch},
                {"case": "as floats", "err_pre_fix": 118.0, "err_flashfix": 0.003},
                {"case": "control: scales 1.0", "control": True, "bitwise_equal": False, "error_flashfix": "TypeError: x",
                 "mismatch": mismatch},
                {"case": "control: no prefix", "control": True, "bitwise_equal": True}]
        judged = lambda rows: _verify._result("c", "sglang-fp8-kv-scales", ok, "FLASHFIX_RESULT=" + json.dumps(rows), "")
        with_mismatch = judged(rows)
        rows[3]["bitwise_equal"] = False
        control_differs = judged(rows)
        rows[3]["bitwise_equal"] = True
        rows.append({"case": "not applied", "error": "the patch is unknown-shape: ..."})
        not_applied = judged(rows)
        report(results=[with_mismatch["passed"], len(with_mismatch["mismatches"]), control_differs["passed"],
                        not_applied["passed"], not_applied["problems"]])
    ''')
    assert r["results"] == [True, 2, False, False, ["not applied: the patch is unknown-shape: ..."]]


def test_a_measured_row_whose_released_code_fails_is_said_and_judged_on_the_fix_alone():
    # vllm-fp8-kv-sharing-view: FlashInfer rejects the uint8 cache the released forward hands it; before, any
    # pre-fix error failed the check. A control's pre-fix error still fails it (nothing to compare bitwise)
    (r,), _ = run_py('''
        from flashfix.tools import verify as _verify
        import json
        ok = type("P", (), {"returncode": 0})()
        uint8 = "ValueError: The dtype of k torch.uint8 does not match the kv_data_type"
        rows = [{"case": "prefill, KV-sharing", "err_pre_fix": None, "err_flashfix": 0.003, "error_pre_fix": uint8},
                {"case": "control: owner", "control": True, "bitwise_equal": True}]
        judged = lambda rows: _verify._result("c", "vllm-fp8-kv-sharing-view", ok, "FLASHFIX_RESULT=" + json.dumps(rows), "")
        released_fails = judged(rows)
        rows[1].update(bitwise_equal=False, error_pre_fix=uint8)
        control_fails = judged(rows)
        report(results=[released_fails["passed"], _verify._summary(released_fails), control_fails["problems"]])
    ''')
    assert r["results"] == [True, "pass, max relative error with flashfix 0.003 (threshold 0.01), without the fix: "
                            "ValueError: The dtype of k torch.uint8 does not match the kv_data_type",
                            ["control: owner: ValueError: The dtype of k torch.uint8 does not match the kv_data_type"]]


def test_an_applied_patch_without_a_gpu_check_is_named_not_passed():
    # before: verify said "all checks passed" and never named a patch it has no GPU check for
    _, proc = run_py('''
        from flashfix.tools import verify as _verify
        rows = [{"id": i, "engine": "sglang", "engine_version": "0.5.9", "verdict": "patch"}
                for i in ("sglang-fp8-kv-scales", "sglang-vision-config")]
        _verify._doctor.diagnose = lambda reader=None: (rows, None)
        gpu = '{"ok": true, "name": "H200", "capability": [9, 0], "torch": "2.11", "flashinfer": "0.6.17"}'
        runtime = 'FLASHFIX_RESULT=[{"id": "sglang-fp8-kv-scales", "state": "applied"}, ' \\
                  '{"id": "sglang-vision-config", "state": "applied"}]'
        _verify._child = lambda code: type("P", (), {"stdout": gpu if "get_device_capability" in code else runtime,
                                                     "stderr": ""})()
        _verify._run_checks = lambda wanted, as_json, start: [
            {"check": "fp8-paged", "passed": True} for w in wanted if w[0] == "sglang-fp8-kv-scales"]
        report(code=_verify.run())
    ''')
    assert "all checks that ran passed" in proc.stdout, proc.stdout
    assert "sglang-vision-config: NOT RUN: no GPU check exists for it" in proc.stdout
    assert "sglang-fp8-kv-scales: NOT RUN" not in proc.stdout
