"""Fixes flashfix knows of and does not carry (``KNOWN`` in the engine patch modules): the doctor names
them (``known-unfixed``, with the upstream link) where the engine read is affected, judged on real
releases (an installed SGLang 0.5.23 and vLLM 0.33.0, vLLM 0.26.0 / 0.27.0 read from PyPI as the
sweep reads them); strict mode does not fail on them and ``status()`` does not list them."""

import json
import os
import subprocess
import sys

import pytest

import engine_env
from conftest import REPO

MLA = "sglang-mla-chunked-prefix-lse-base"
CAP = "sglang-flashinfer-logit-softcap-plan"  # known-unfixed until flashfix carried it (tests/test_softcap_plan.py)
WINDOW = "sglang-swa-paged-plan-window-left"  # sglang#31501: a known row until it was carried (fixed in 0.5.16)
SWA_OLD = "sglang-swa-ragged-prefix-slots-0.5.10"  # sglang#26513 before 0.5.11: a known row until carried
COUNTER = "vllm-trtllm-multi-cta-kv-counter"
MLA_FILE = "sglang/srt/layers/attention/flashinfer_mla_backend.py"


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _site(requirement):
    return next((engine_env.env_python(requirement).parent.parent / "lib").glob("python*/site-packages"))


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "flashfix", "doctor"] + list(args), env=_env(), capture_output=True,
                          text=True, timeout=300)


def test_sglang_0_5_23_carries_the_mla_lse_fix_and_the_soft_cap_as_flashfix_own():
    """The MLA chunked-prefix LSE fix (sglang#40903) and the logit soft cap (sglang#33915), which no release has, were
    known-unfixed rows; flashfix now carries both: ``patch``, by the code (the line of the runner's return, of the
    updater), each reason saying it is flashfix's own fix; strict passes."""
    site = _site("sglang==0.5.23")
    proc = doctor("--strict", "--json", "--path", str(site))
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in json.loads(proc.stdout)}
    row = rows[MLA]
    assert row["verdict"] == "patch" and row["engine_version"] == "0.5.23", row
    assert row["upstream"].startswith("https://github.com/sgl-project/sglang/issues/40903")
    assert row["affected_versions"] == ">=0.5.1" and row["fixed_in"].startswith("none")
    assert "forward (line 209) returns FlashInfer's base-2 LSE" in row["reason"], row["reason"]
    assert "flashfix's own fix: no SGLang release has one" in row["reason"], row["reason"]
    assert [s["file"] for s in row["sources"]][-1].endswith(MLA_FILE)
    cap = rows[CAP]
    assert cap["verdict"] == "patch" and cap["fixed_in"].startswith("none") and "sglang#34093" in cap["upstream"], cap
    assert "flashfix's own fix: no SGLang release has one" in cap["reason"], cap["reason"]
    assert rows[WINDOW]["verdict"] == "fixed-upstream", rows[WINDOW]  # carried now; fixed in 0.5.16
    assert rows[SWA_OLD]["verdict"] == "fixed-upstream", rows[SWA_OLD]  # carried now (0.5.1-0.5.10); fixed in 0.5.13
    text = doctor("--strict", "--path", str(site))
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    (at,) = [i for i, x in enumerate(lines) if x.startswith(CAP)]
    assert "patch" in lines[at], lines[at]


@pytest.mark.parametrize("fix", ['lse_base="ln", ', "return_lse_base_on_e=True, ", "math.log(2)", None])
def test_the_mla_row_follows_the_code_not_the_version(tmp_path, fix):
    """0.5.23's own file, copied with its METADATA: with upstream's candidate fixes written into it (FlashInfer's
    natural-log options in its forward_return_lse call, or sglang#35045's conversion by ln 2), the doctor reads
    fixed-upstream and flashfix steps aside; unedited, it patches."""
    site = _site("sglang==0.5.23")
    text = (site / MLA_FILE).read_text()
    call = "            o = wrapper.forward_return_lse(\n"
    assert text.count(call) == 1
    if fix == "math.log(2)":
        end = text.index("        return o\n", text.index(call))
        text = text[:end] + "        if isinstance(o, tuple):\n            o = (o[0], o[1] * math.log(2))\n" + text[end:]
    elif fix is not None:
        start = text.index("causal=False,\n", text.index(call))
        text = text[:start] + fix + text[start:]
    compile(text, MLA_FILE, "exec")
    (tmp_path / MLA_FILE).parent.mkdir(parents=True)
    (tmp_path / MLA_FILE).write_text(text)
    (tmp_path / "sglang-0.5.23.dist-info").mkdir()
    (tmp_path / "sglang-0.5.23.dist-info" / "METADATA").write_text(
        (site / "sglang-0.5.23.dist-info" / "METADATA").read_text())
    proc = doctor("--json", "--path", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (row,) = [r for r in json.loads(proc.stdout) if r["id"] == MLA]
    assert row["verdict"] == ("patch" if fix is None else "fixed-upstream"), row


def test_no_vllm_release_reports_the_dropped_counter_row():
    """``vllm-trtllm-multi-cta-kv-counter`` was no correctness bug (FlashInfer allocates the counter when the caller
    passes none, flashinfer#3582) and named a wrong range: it is gone, from the installed 0.33.0 and from 0.26.0's
    wheel as the sweep reads it."""
    site = _site("vllm==0.33.0")
    proc = doctor("--strict", "--json", "--path", str(site))
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in json.loads(proc.stdout) if r["id"] == COUNTER] == []
    code = '''
import json, sys
sys.path.insert(0, "scripts")
import sweep_releases
from flashfix.tools import doctor
print(json.dumps(doctor.known(sweep_releases.wheel_reader("vllm", "0.26.0"))))
'''
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_status_does_not_list_known_fixes():
    code = "import json, flashfix; print(json.dumps([r['id'] for r in flashfix.status()]))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)
    assert "sglang-fp8-kv-scales" in ids and MLA in ids and CAP in ids and WINDOW in ids and SWA_OLD in ids and COUNTER not in ids
