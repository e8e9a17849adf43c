"""`import flashfix`, `flashfix.status()` and the doctor, in real engine environments, import
no engine, torch, FlashInfer or wrapt."""

import pytest

import engine_env

CODE = '''
import json, sys, time
import flashfix
after_import = [m for m in ("torch", "vllm", "sglang", "flashinfer", "wrapt") if m in sys.modules]
t = time.perf_counter()
from flashfix.tools import doctor as _doctor
rows, _ = _doctor.diagnose()
doctor_s = time.perf_counter() - t
flashfix.status()
after_doctor = [m for m in ("torch", "vllm", "sglang", "flashinfer", "wrapt") if m in sys.modules]
print("FLASHFIX_RESULT=" + json.dumps(dict(after_import=after_import, after_doctor=after_doctor, doctor_s=doctor_s,
      verdicts={r["id"]: r["verdict"] for r in rows})))
'''


@pytest.mark.parametrize("requirement", ["vllm==0.28.0", "sglang==0.5.17"])
def test_import_and_doctor_import_no_engine(requirement):
    (r,) = engine_env.run(requirement, CODE)
    assert r["after_import"] == []
    assert r["after_doctor"] == []
    engine = requirement.split("==")[0]
    installed = [v for k, v in r["verdicts"].items() if k.startswith(engine)]
    assert installed and "not-installed" not in installed
    print("%s: doctor took %.3f s" % (requirement, r["doctor_s"]))
