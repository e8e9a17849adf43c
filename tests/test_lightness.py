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


KEPT = '''
import ast, gc, json, sys
import flashfix
from flashfix import flashinfer_patch, semantic, sglang_patch, vllm_patch  # noqa: F401  (every patch declared)
from flashfix.core import matcher, render, source  # noqa: F401  (what applying a rewrite loads; kept: imported here)
for mod in (flashinfer_patch, sglang_patch, vllm_patch):  # compiled and parsed, as judging them does
    for p in mod.PATCHES:
        for h in getattr(p.rule, "hunks", ()):
            matcher.rule_of(h).before  # noqa: B018
source.forget()
gc.collect()
readers = sorted(n for n, m in list(sys.modules.items()) if n.startswith("flashfix") and hasattr(m, "ZipReader"))
rules = [o for o in gc.get_objects() if isinstance(o, matcher.Rule)]
trees = [r for r in rules if any(isinstance(v, ast.AST) or isinstance(v, list) and any(isinstance(x, ast.AST) for x in v)
                                 for v in vars(r).values())]
print(json.dumps([readers, len(rules), len(trees)]))
'''


def test_engine_process_loads_no_path_reader_and_keeps_no_pattern_tree():
    """Issue 24's memory limit: what a process loads of flashfix (every declaration, the renderer) holds no
    ``--path`` reader code, and once decisions are done (``forget``) no compiled rule keeps a pattern tree, also
    where the heavy modules stay loaded (imported by someone else: the doctor; an engine process lets go of them,
    test_engine_start)."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KEPT], env=dict(os.environ, FLASHFIX_DISABLE="all"), capture_output=True,
                         text=True, check=True).stdout
    readers, rules, trees = json.loads(out.splitlines()[-1])
    assert readers == [] and rules > 10 and trees == 0, (readers, rules, trees)
