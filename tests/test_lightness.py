"""`import flashfix`, `flashfix.status()` and the doctor, in real engine environments, import
no engine, torch, FlashInfer or wrapt."""

import pytest

import engine_env

CODE = '''
import json, sys, time
import flashfix
after_import = [m for m in ("torch", "vllm", "sglang", "flashinfer", "wrapt") if m in sys.modules]
t = time.perf_counter()
from flashfix import _doctor
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


PARTIAL = '''
import ast, json
from flashfix import _locate, _partial
MODULES = ("sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.configs.model_config",
           "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.runner.base_runner",
           "sglang.srt.model_executor.runner.flashinfer_autotune", "vllm.v1.attention.backends.flashinfer",
           "flashinfer.prefill", "flashinfer.attention", "flashinfer.attention._core")
KINDS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
dump = lambda node: None if node is None else ast.dump(node, include_attributes=True)
checked, differ, whole = 0, [], []
for name in MODULES:
    found = _locate.find(name)
    if found is None or found.text is None:
        continue
    full = ast.parse(found.text)
    lookups = ["__absent__"]
    for node in full.body:
        if isinstance(node, KINDS):
            lookups.append(node.name)
            if isinstance(node, ast.ClassDef):
                lookups += [node.name + "." + m.name for m in node.body if isinstance(m, KINDS)] + [node.name + ".__absent__"]
    lazy = _partial.Module(found.text, found.origin)
    for qualname in lookups:
        checked += 1
        if dump(lazy.find(qualname)) != dump(_partial.walk_defs(full, qualname.split("."))):
            differ.append(name + ":" + qualname)
    if lazy.parsed:
        whole.append(name)
print("FLASHFIX_RESULT=" + json.dumps(dict(checked=checked, differ=differ, whole=whole)))
'''


@pytest.mark.parametrize("requirement", ["vllm==0.28.0", "sglang==0.5.17"])
def test_partial_parse_equals_full_parse_on_the_engine_files(requirement):
    """Every definition (and every method) of the modules the probes read, looked up in a
    _partial.Module, is the node a whole-file parse gives, and none needed a whole parse."""
    (r,) = engine_env.run(requirement, PARTIAL)
    assert r["checked"] > 100 and r["differ"] == [] and r["whole"] == [], r
