"""What a fix costs in GPU memory (issue 35 item 9): a patch that raises memory over the release's sizing states
the formula and an example in its declaration (``memory=``); the doctor shows it under the row, and
``FLASHFIX_DISABLE=memory`` keeps the release's sizing (those patches disabled, in the doctor and the engine
alike, every other fix still applied). Real SGLang 0.5.11 (the EAGLE draft-graph fixes are in range there)."""

import json
import os
import subprocess

import engine_env
from conftest import REPO

DRAFT, MLA_DRAFT, FP8 = "sglang-eagle-draft-graph-kv-indices", "sglang-eagle-mla-draft-graph-kv-indices", "sglang-fp8-kv-scales"
MEMORY_IDS = {DRAFT, MLA_DRAFT, "vllm-prefill-workspace-size", "vllm-mla-prefill-backend-per-builder",
              "sglang-triton-per-layer-heads-buffers"}

RUNTIME = r'''
import json, flashfix
import sglang.srt.layers.attention.flashinfer_backend as fb
import sglang.srt.layers.attention.flashinfer_mla_backend as mla
states = {r["id"]: [r["state"], r["reason"]] for r in flashfix.status()}
print("RESULT=" + json.dumps(states))
'''


def _run(python, args, disable=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    if disable is not None:
        env["FLASHFIX_DISABLE"] = disable
    proc = subprocess.run([str(python)] + args, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_memory_costs_are_stated_and_memory_keeps_the_release_sizing():
    python = engine_env.env_python("sglang==0.5.11")
    rows = {r["id"]: r for r in json.loads(_run(python, ["-m", "flashfix", "doctor", "--json"]))}
    assert {i for i, r in rows.items() if r.get("memory")} == MEMORY_IDS, rows
    assert rows[DRAFT]["verdict"] == "patch" and "topk" in rows[DRAFT]["memory"], rows[DRAFT]
    text = _run(python, ["-m", "flashfix", "doctor"]).splitlines()
    row = next(i for i, line in enumerate(text) if line.startswith(DRAFT + " "))
    below = "\n".join(text[row + 1:row + 5])
    assert "GPU memory: cuda_graph_kv_indices grows topk-fold" in below and "FLASHFIX_DISABLE=memory" in below, below
    assert all(len(line) <= 120 for line in text if "GPU memory" in line or line.startswith("      ")), text

    kept = {r["id"]: r for r in json.loads(_run(python, ["-m", "flashfix", "doctor", "--json"], disable="memory"))}
    for pid in (DRAFT, MLA_DRAFT):
        assert kept[pid]["verdict"] == "disabled" and "FLASHFIX_DISABLE=memory" in kept[pid]["reason"], kept[pid]
    assert kept[FP8]["verdict"] == "patch", kept[FP8]

    out = _run(python, ["-c", RUNTIME], disable="memory")
    states = json.loads([l for l in out.splitlines() if l.startswith("RESULT=")][0][7:])
    for pid in (DRAFT, MLA_DRAFT):
        assert states[pid][0] == "disabled" and "memory" in states[pid][1], states[pid]
    assert states[FP8][0] not in ("disabled",), states[FP8]
    out = _run(python, ["-c", RUNTIME])
    states = json.loads([l for l in out.splitlines() if l.startswith("RESULT=")][0][7:])
    assert states[DRAFT][0] == "applied" and states[MLA_DRAFT][0] == "applied", states
