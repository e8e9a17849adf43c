"""A pack's two-hunk backport whose hunks sit in two SGLang modules, the later hunk's module imported first
(issue 34, "a multi-hunk patch whose later hunk's module is imported first, with doctor = runtime").

The pack is built and installed as a distribution (its entry point in ``flashfix.patches``) beside SGLang
0.5.17's real environment. Hunk 1 edits ``FlashInferAttnBackend.get_cuda_graph_seq_len_fill_value`` in the
FlashInfer backend (the patch's target), hunk 2 ``is_kimi_k3`` in ``sglang.srt.configs.model_config``. In one
process ``model_config`` is imported alone first, the backend later; in the other only the backend is
imported. Both times the doctor says ``patch`` before any import, the runtime applies both hunks or neither,
the two functions run the new code, and ``revert`` gives both back.
"""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
from test_packs import install, make_project  # noqa: E402

PACK = '''
from flashfix.semantic import Backport, Rule

PATCHES = (Backport(
    id="ffx-two-modules", engine="sglang", versions=">=0.5.17", fixed_in="99.0", upstream="https://example.invalid/1",
    summary="two hunks in two modules", doc="Why: a test. How: two hunks. Delete when: never.",
    hunks=(Rule("sglang.srt.layers.attention.flashinfer_backend",
                "FlashInferAttnBackend.get_cuda_graph_seq_len_fill_value", before="return 1", after="return 2"),
           Rule("sglang.srt.configs.model_config", "is_kimi_k3", before='_hf_arch($C) == "KimiK3ForConditionalGeneration"',
                after='_hf_arch($C) in ("KimiK3ForConditionalGeneration", "KimiK3Test")'))),)
'''

SCRIPT = '''
import json, os, sys
from types import SimpleNamespace
import flashfix
from flashfix.tools import doctor
doctor_row = {r["id"]: r for r in doctor.diagnose()[0]}["ffx-two-modules"]
first = os.environ["FIRST"]
import importlib
importlib.import_module(first)
after_first = {r["id"]: r for r in flashfix.status()}["ffx-two-modules"]["state"]
import sglang.srt.layers.attention.flashinfer_backend as fb
import sglang.srt.configs.model_config as mc
row = {r["id"]: r for r in flashfix.status()}["ffx-two-modules"]
def behaviour():
    return [fb.FlashInferAttnBackend.get_cuda_graph_seq_len_fill_value(None),
            mc.is_kimi_k3(SimpleNamespace(architectures=["KimiK3Test"]))]
out = {"doctor": doctor_row["verdict"], "after_first": after_first, "state": row["state"], "reason": row["reason"],
       "patched": behaviour()}
flashfix.revert("ffx-two-modules")
out["reverted"] = behaviour()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
'''


def test_two_modules_later_hunks_module_imported_first(tmp_path):
    packs = install(tmp_path / "packs", make_project(tmp_path, "ffx-two", "ffx_two", PACK, entry="sglang"),
                    python=engine_env.env_python("sglang==0.5.17"))
    path = os.pathsep.join([str(engine_env.REPO), str(packs)])
    results = {}
    for first in ("sglang.srt.configs.model_config", "sglang.srt.layers.attention.flashinfer_backend"):
        (r,) = engine_env.run("sglang==0.5.17", SCRIPT, env={"FIRST": first}, pythonpath=path)
        results[first] = r
    later_first, target_first = results.values()
    assert later_first["after_first"] == "waiting", later_first  # its target is not imported yet: nothing done
    for r in results.values():
        assert r["doctor"] == "patch" and r["state"] == "applied", r
        assert r["patched"] == [2, True] and r["reverted"] == [1, False], r
