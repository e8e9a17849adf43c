"""scripts/release_hunks.py on real releases from PyPI (the index must be reachable, as in CI):
one pair per engine, read from the wheels as the sweep reads them, with hunks asserted by content."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "release_hunks.py"
PAIRS = "sglang==0.5.17,sglang==0.5.18,vllm==0.28.0,vllm==0.29.0"


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the --json file, the text output) of one run over both pairs."""
    path = tmp_path_factory.mktemp("hunks") / "hunks.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", PAIRS, "--json", str(path)], env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "exit %d\n%s\n%s" % (proc.returncode, proc.stdout[-3000:], proc.stderr)
    return path, proc.stdout


@pytest.fixture(scope="module")
def listed(run):
    """(the --json result by (dist, old, new), the text output) of one run over both pairs."""
    path, out = run
    result = json.loads(path.read_text())
    return {(p["dist"], p["old"], p["new"]): p["hunks"] for p in result["pairs"]}, out


def _one(hunks, path, line):
    found = [h for h in hunks if h["file"] == path and line in h["lines"]]
    assert len(found) == 1, (path, line, [(h["file"], h["functions"]) for h in hunks if h["file"] == path])
    return found[0]


def test_pairs_are_the_consecutive_releases_named(listed):
    hunks, out = listed
    assert set(hunks) == {("sglang", "0.5.17", "0.5.18"), ("vllm", "0.28.0", "0.29.0")}
    assert out.startswith("vllm 0.28.0 -> 0.29.0: ") and "\nsglang 0.5.17 -> 0.5.18: " in out


def test_the_fp8_scale_fix_is_covered_by_its_declaration(listed):
    hunks, out = listed
    backend = "sglang/srt/layers/attention/flashinfer_backend.py"
    fix = _one(hunks["sglang", "0.5.17", "0.5.18"], backend, "+                    k_scale=layer.k_scale_float,")
    assert fix["functions"] == ["FlashInferAttnBackend.forward_extend"]
    assert fix["covered_by"] == ["sglang-fp8-kv-scales"]
    assert "+                    v_scale=layer.v_scale_float," in fix["lines"]
    assert "  %s @@ -%d,%d +%d,%d @@ FlashInferAttnBackend.forward_extend  [covered by sglang-fp8-kv-scales]\n" % (
        backend, fix["old"][0], fix["old"][1], fix["new"][0], fix["new"][1]) in out
    # the same pair's other hunks of forward_extend's file are not the fix: a refactor stays uncovered
    moved = _one(hunks["sglang", "0.5.17", "0.5.18"], backend, "-from sglang.kernel_api_logging import debug_kernel_api")
    assert moved["functions"] == ["<module>"] and moved["covered_by"] == []
    assert "  %s @@ -%d,%d +%d,%d @@ <module>  [uncovered]\n" % (
        backend, moved["old"][0], moved["old"][1], moved["new"][0], moved["new"][1]) in out


def test_each_sglang_fix_of_0_5_18_is_covered_once_and_only_in_its_function(listed):
    hunks, _ = listed
    covered = [(h["file"], tuple(h["functions"]), tuple(h["covered_by"]))
               for h in hunks["sglang", "0.5.17", "0.5.18"] if h["covered_by"]]
    assert sorted(covered) == [
        ("sglang/srt/configs/model_config.py", ("ModelConfig.__init__",), ("sglang-vision-config",)),
        ("sglang/srt/layers/attention/flashinfer_backend.py", ("FlashInferAttnBackend.forward_extend",),
         ("sglang-fp8-kv-scales",)),
        ("sglang/srt/model_executor/runner/flashinfer_autotune.py", ("should_run_flashinfer_autotune",),
         ("sglang-sm120-fp8-autotune",)),
    ]
    # ModelConfig.__init__ changed in six places; only the one the declaration matches is covered
    assert len([h for h in hunks["sglang", "0.5.17", "0.5.18"] if h["functions"] == ["ModelConfig.__init__"]]) > 1


def test_vllm_pair_lists_the_backend_and_helper_files_uncovered(listed):
    hunks, out = listed
    pair = hunks["vllm", "0.28.0", "0.29.0"]
    new = _one(pair, "vllm/utils/flashinfer.py", "+def flashinfer_bf16_mm(")
    assert new["covered_by"] == [] and "flashinfer_bf16_mm" in new["functions"]
    files = {h["file"] for h in pair}
    assert {"vllm/v1/attention/backends/flashinfer.py", "vllm/v1/attention/backends/mla/flashinfer_mla.py",
            "vllm/v1/attention/backends/mla/prefill/flashinfer.py", "vllm/v1/sample/ops/topk_topp_sampler.py"} <= files
    # vllm-sink-prefill is fixed upstream on both sides: it covers nothing here
    assert not [h for h in pair if "vllm-sink-prefill" in h["covered_by"]]
    assert "vllm 0.28.0 -> 0.29.0: %d hunks, " % len(pair) in out


def _line(path, h):
    return "  %s @@ -%d,%d +%d,%d @@ %s" % (path, h["old"][0], h["old"][1], h["new"][0], h["new"][1], ", ".join(h["functions"]))


def test_hunks_are_ranked_fix_shaped_first_refactors_features_and_comments_last(listed):
    hunks, out = listed
    for key, pair in hunks.items():
        assert [h["rank"] for h in pair] == list(range(1, len(pair) + 1)), key
        assert [h["tier"] for h in pair] == sorted(h["tier"] for h in pair), key
        assert all(h["reason"].startswith(h["kind"]) for h in pair), key
        assert {h["kind"] for h in pair} >= {"fix-shaped", "code", "refactor", "feature"}, key
    sglang = hunks["sglang", "0.5.17", "0.5.18"]
    backend = "sglang/srt/layers/attention/flashinfer_backend.py"
    mla = "sglang/srt/layers/attention/flashinfer_mla_backend.py"
    # the fp8 scales passed to prefill_wrapper_paged.forward_return_lse: a FlashInfer call's arguments
    fix = _one(sglang, backend, "+                    k_scale=layer.k_scale_float,")
    assert fix["kind"] == "fix-shaped" and "FlashInfer call" in fix["reason"] and "k_scale" in fix["reason"]
    # one more entry of the args list that the next line hands to plan(*args)
    plan = _one(sglang, backend, "+        0,  # uniform_q_len")
    assert plan["kind"] == "fix-shaped" and "plan argument" in plan["reason"]
    # an import path that moved, a typo renamed, a new function: after every fix-shaped hunk
    moved = _one(sglang, backend, "-from sglang.kernel_api_logging import debug_kernel_api")
    assert moved["kind"] == "refactor" and "imports only" in moved["reason"]
    renamed = [h for h in sglang if h["file"] == mla and "renames only" in h["reason"]]
    assert renamed and all(h["kind"] == "refactor" for h in renamed)
    new = _one(sglang, mla, "+def fast_mla_prefill_plan(")
    assert new["kind"] == "feature" and "fast_mla_prefill_plan" in new["reason"]
    last_fix = max(h["rank"] for h in sglang if h["kind"] == "fix-shaped")
    assert fix["rank"] <= last_fix < min(moved["rank"], new["rank"], *(h["rank"] for h in renamed))
    # the text lists them in that order, each with its reason on the next line
    assert out.index(_line(backend, fix)) < out.index(_line(backend, plan)) < out.index(_line(backend, moved))
    assert "[covered by sglang-fp8-kv-scales]\n      why: #%d %s\n" % (fix["rank"], fix["reason"]) in out
    vllm = hunks["vllm", "0.28.0", "0.29.0"]
    # FlashInfer MLA's LSE base (lead (c)): an LSE line, ranked above the new bf16 GEMM helper
    base = _one(vllm, "vllm/v1/attention/backends/mla/flashinfer_mla.py", "-    lse_base_on_e: bool = False")
    assert base["kind"] == "fix-shaped" and "LSE" in base["reason"]
    helper = _one(vllm, "vllm/utils/flashinfer.py", "+def flashinfer_bf16_mm(")
    assert helper["kind"] == "feature" and base["rank"] < helper["rank"]


def test_limit_prints_the_first_hunks_of_each_pair(run, listed):
    path, _ = run
    hunks, _ = listed
    code = ("import json, sys; sys.path.insert(0, %r); import release_hunks as r; "
            "r.print_text(json.load(open(%r))['pairs'], limit=3)" % (str(SCRIPT.parent), str(path)))
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for (dist, old, new), pair in hunks.items():
        lines = proc.stdout.split("%s %s -> %s: %d hunks, " % (dist, old, new, len(pair)))[1].splitlines()[1:]
        block = lines[:next((i for i, line in enumerate(lines) if not line.startswith(" ")), len(lines))]
        shown = [line for line in block if line.startswith("      why: #")]
        assert shown == ["      why: #%d %s" % (h["rank"], h["reason"]) for h in pair[:3]]
        assert len([line for line in block if line.startswith("  ") and " @@ -" in line]) == 3
        assert block[-1] == "  ... %d more hunks, ranked lower (--limit 0 prints them all)" % (len(pair) - 3)


def test_drift_workflow_uploads_the_list():
    text = (REPO / ".github" / "workflows" / "drift.yml").read_text()
    assert "scripts/release_hunks.py" in text and "drift/hunks.json" in text
