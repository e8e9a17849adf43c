"""scripts/sweep_releases.py on real releases from PyPI (the index must be reachable, as in CI).

The sweep runs as a user runs it, on a pinned handful of releases, and its verdicts must be
exactly these (read off the wheels; see flashfix/sglang_patch.py and the README's table);
they must also be what the committed benchmarks/results/sweep.json and the README say. The
SGLang probes' cases for 0.5.1 to 0.5.5.post3 are checked on those wheels' own source, read
through the sweep's reader (tests/sweep_probe_check.py).
"""

import functools
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from packaging.version import Version

from conftest import REPO, RESULT

SCRIPT = REPO / "scripts" / "sweep_releases.py"
COMMITTED = REPO / "benchmarks" / "results" / "sweep.json"

FP8, AUTOTUNE, VISION = "sglang-fp8-kv-scales", "sglang-sm120-fp8-autotune", "sglang-vision-config"
DRAFT, HEADS = "sglang-eagle-draft-graph-kv-indices", "sglang-per-layer-heads-plan"
MLA_DRAFT = "sglang-eagle-mla-draft-graph-kv-indices"
SWA_FULL, SWA_PREFIX = "sglang-swa-full-attn-ragged-prefix", "sglang-swa-ragged-prefix-extend-slots"
SINK, JIT = "vllm-sink-prefill", "flashinfer-sink-jit-name"


def _sglang(fp8, autotune, vision, draft, heads="patch", swa_full="not-affected", swa_prefix=None):
    return {FP8: fp8, AUTOTUNE: autotune, VISION: vision, DRAFT: draft, MLA_DRAFT: draft, HEADS: heads,
            SWA_FULL: swa_full, SWA_PREFIX: swa_prefix or ("fixed-upstream" if draft == "fixed-upstream" else "not-affected")}


LSE = ("vllm-mla-flashinfer-lse", "vllm-mla-trtllm-ragged-lse", "vllm-dcp-prefill-lse")  # vLLM #52796, fixed in 0.29.0
PAGES, RELOAD = "vllm-dcp-page-counts", "vllm-sinks-weight-reload"  # fixed in 0.30.0 and 0.26.0
SHARING = ("vllm-fp8-kv-sharing-view", "vllm-dcp-ragged-layout")  # both fixed in 0.22.0


def _vllm(sink, lse, pages, sharing, reload):
    return dict({SINK: sink, PAGES: pages, RELOAD: reload}, **{i: lse for i in LSE}, **{i: sharing for i in SHARING})


EXPECTED = {
    ("sglang", "0.5.1"): _sglang("patch", "not-affected", "not-affected", "patch", swa_full="patch"),
    ("sglang", "0.5.1.post3"): _sglang("patch", "not-affected", "not-affected", "patch", swa_full="patch"),
    ("sglang", "0.5.5"): _sglang("patch", "not-affected", "not-affected", "patch", swa_full="patch"),
    ("sglang", "0.5.5.post1"): _sglang("patch", "not-affected", "patch", "patch", swa_full="patch"),
    ("sglang", "0.5.10.post1"): _sglang("patch", "not-affected", "patch", "patch", swa_full="patch"),  # #26513: -0.5.10
    ("sglang", "0.5.11"): _sglang("patch", "not-affected", "patch", "patch", swa_full="patch", swa_prefix="patch"),
    ("sglang", "0.5.12.post1"): _sglang("patch", "not-affected", "patch", "patch", swa_full="patch", swa_prefix="patch"),
    ("sglang", "0.5.13"): _sglang("patch", "not-affected", "patch", "fixed-upstream", swa_full="patch"),
    ("sglang", "0.5.14"): _sglang("patch", "patch", "patch", "fixed-upstream", swa_full="patch"),
    ("sglang", "0.5.16"): _sglang("patch", "patch", "patch", "fixed-upstream", swa_full="patch"),
    ("sglang", "0.5.17"): _sglang("patch", "patch", "patch", "fixed-upstream", "fixed-upstream", "patch"),
    ("sglang", "0.5.18"): _sglang("fixed-upstream", "fixed-upstream", "fixed-upstream", "fixed-upstream",
                                  "fixed-upstream", "patch"),
    ("sglang", "0.5.19"): _sglang(*["fixed-upstream"] * 5, "patch"),
    ("sglang", "0.5.20"): _sglang(*["fixed-upstream"] * 5, "patch"),
    ("sglang", "0.5.21"): _sglang(*["fixed-upstream"] * 6),
    ("vllm", "0.20.0"): _vllm("not-affected", "patch", "patch", "patch", "patch"),  # MLA prefill in mla_attention.py
    ("vllm", "0.21.0"): _vllm("not-affected", "patch", "patch", "patch", "patch"),  # MLA prefill backends from here
    ("vllm", "0.22.0"): _vllm("not-affected", "patch", "patch", "fixed-upstream", "patch"),
    ("vllm", "0.23.0"): _vllm("not-affected", "patch", "patch", "fixed-upstream", "patch"),  # lost #42650 again
    # supports_sink ends in supports_trtllm_attention()
    ("vllm", "0.24.0"): _vllm("not-affected", "patch", "patch", "fixed-upstream", "patch"),
    ("vllm", "0.27.1"): _vllm("not-affected", "patch", "patch", "fixed-upstream", "fixed-upstream"),
    ("vllm", "0.28.0"): _vllm("fixed-upstream", "patch", "patch", "fixed-upstream", "fixed-upstream"),
    ("vllm", "0.29.0"): _vllm("fixed-upstream", "fixed-upstream", "patch", "fixed-upstream", "fixed-upstream"),
    ("vllm", "0.30.0"): _vllm("fixed-upstream", "fixed-upstream", "fixed-upstream", "fixed-upstream", "fixed-upstream"),
    ("flashinfer-python", "0.6.17"): {JIT: "patch"},
    ("flashinfer-python", "0.7.4"): {JIT: "fixed-upstream"},
}
SWA_OLD = "sglang-swa-ragged-prefix-slots-0.5.10"  # sglang#26513 on 0.5.1-0.5.10.post1 (call_begin_forward takes no custom mask there)
for (_dist, _version), _verdicts in EXPECTED.items():
    if _dist == "sglang":
        _verdicts[SWA_OLD] = ("patch" if _verdicts[SWA_PREFIX] == "not-affected" else "covered"
                              if _verdicts[SWA_PREFIX] == "patch" else "fixed-upstream")
CLAMP, GATE = "sglang-trtllm-fp8-moe-swiglu-limit", "vllm-trtllm-fp8-moe-swiglu-gate"
for (_dist, _version), _verdicts in EXPECTED.items():  # the MoE fixes (SGLang 0.5.18 pins FlashInfer 0.6.17)
    if _dist == "sglang":
        _verdicts[CLAMP] = {"0.5.18": "known-unfixed", "0.5.19": "patch"}.get(_version, "not-affected" if Version(
            _version) < Version("0.5.18") else "fixed-upstream")
    if _dist == "vllm":
        _verdicts[GATE] = "not-affected" if Version(_version) < Version("0.28") else "patch" if Version(
            _version) < Version("0.29") else "fixed-upstream"
XQA = "vllm-xqa-head-dim"  # vLLM #53111: XQA decode from 0.25.0, fixed in 0.29.0
WORKSPACE = "vllm-prefill-workspace-size"  # fixed in vLLM 0.26.0
XATTN = "sglang-cross-attn-decode-plan-lens"  # fixed in SGLang 0.5.10
LAYER_HEADS = "vllm-layer-heads-plan"
MLA_CLONE = "vllm-mla-prefill-backend-per-builder"  # vLLM #46993: prefill backend objects from 0.21.0, fixed in 0.25.0
CUTLASS_DIMS = "sglang-sm100-cutlass-head-dims"  # fixed in SGLang 0.5.21
MLA_PADDED = "sglang-mla-indptr-padded-batch"  # sglang#38590: carried from 0.5.14 (the padding rule), fixed in 0.5.20
# sglang#23993 (0.5.13), and its Triton fallback's LSE base (every release from 0.5.13: flashfix's own)
MERGE_LIMIT, MERGE_BASE = "sglang-merge-state-launch-limit", "sglang-merge-state-fallback-lse-base"
MLA_LSE = "sglang-mla-chunked-prefix-lse-base"  # sglang#40903: every release (flashfix's own, no release has it)
PCG = "sglang-piecewise-graph-paged-prefill"  # sglang#20061: carried from 0.5.5.post1 (the in-graph flag), fixed in 0.5.10
for (_dist, _version), _verdicts in EXPECTED.items():
    if _dist == "sglang":
        _verdicts[MERGE_LIMIT] = "patch" if Version(_version) < Version("0.5.13") else "fixed-upstream"
        _verdicts[MERGE_BASE] = "not-affected" if Version(_version) < Version("0.5.13") else "patch"
        _verdicts[MLA_LSE] = "patch"
        _verdicts["sglang-flashinfer-logit-softcap-plan"] = "patch"  # sglang#33915: flashfix's own, every release
        _verdicts["sglang-triton-per-layer-heads-buffers"] = (  # sglang#32625's Triton half, fixed in 0.5.17
            "patch" if Version(_version) < Version("0.5.17") else "fixed-upstream")
        _verdicts[PCG] = ("not-affected" if Version(_version) < Version("0.5.5.post1") else
                          "patch" if Version(_version) < Version("0.5.10") else "fixed-upstream")
        _verdicts[XATTN] = "patch" if Version(_version) < Version("0.5.10") else "fixed-upstream"
        for _pid in ("sglang-encoder-only-paged-causal", "sglang-encoder-only-ragged-causal"):  # fixed in 0.5.11
            _verdicts[_pid] = "patch" if Version(_version) < Version("0.5.11") else "fixed-upstream"
        _verdicts[CUTLASS_DIMS] = "patch" if Version(_version) < Version("0.5.21") else "fixed-upstream"
        _verdicts["sglang-swa-paged-plan-window-left"] = (  # sglang#31501, fixed in 0.5.16
            "patch" if Version(_version) < Version("0.5.16") else "fixed-upstream")
        _verdicts[MLA_PADDED] = ("not-affected" if Version(_version) < Version("0.5.14") else
                                 "patch" if Version(_version) < Version("0.5.20") else "fixed-upstream")
    if _dist == "vllm":
        _verdicts[XQA] = ("not-affected" if Version(_version) < Version("0.25") else
                          "patch" if Version(_version) < Version("0.29") else "fixed-upstream")
        _verdicts[WORKSPACE] = "patch" if Version(_version) < Version("0.26") else "fixed-upstream"
        _verdicts[MLA_CLONE] = ("not-affected" if Version(_version) < Version("0.21") else
                                "patch" if Version(_version) < Version("0.25") else "fixed-upstream")
        # vLLM #48251 (W_UV/W_UK_T, fixed in 0.26.0) and its DCP twin (W_UK_T_dcp_qrep: 0.27.0 to 0.31.0)
        _verdicts["vllm-mla-weights-reload"] = "patch" if Version(_version) < Version("0.26") else "fixed-upstream"
        _verdicts["vllm-mla-dcp-qrep-weights-reload"] = ("not-affected" if Version(_version) < Version("0.27") else
                                                         "patch" if Version(_version) < Version("0.32") else "fixed-upstream")
        # vLLM #42650: in 0.22.0, dropped again in 0.23.0 (#43241), restored in 0.25.0 (#47039)
        _verdicts[LAYER_HEADS] = ("fixed-upstream" if Version("0.22") <= Version(_version) < Version("0.23")
                                  or Version(_version) >= Version("0.25") else "patch")
ONLY = ",".join("%s==%s" % key for key in EXPECTED)


def env():
    full = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    full["PYTHONPATH"] = str(REPO)
    return full


def run_sweep(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), "--quiet"] + list(args), env=env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(the --json result, the process) of one sweep of the pinned releases."""
    path = tmp_path_factory.mktemp("sweep") / "pinned.json"
    proc = run_sweep("--only", ONLY, "--jobs", "4", "--json", str(path))
    assert proc.returncode == 0, "exit %d\n%s\n%s" % (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(path.read_text()), proc


def test_pinned_releases_get_exactly_the_expected_verdicts(sweep):
    result, proc = sweep
    got = {(r["dist"], r["version"]): {pid: v["verdict"] for pid, v in r["verdicts"].items()}
           for r in result["releases"]}
    assert got == EXPECTED
    for (dist, version), verdicts in EXPECTED.items():  # the printed table says the same
        for pid, verdict in verdicts.items():
            assert "%-18s %-14s %-28s %-15s " % (dist, version, pid, verdict) in proc.stdout


def test_reasons_name_what_decided(sweep):
    rows = {(r["dist"], r["version"]): r["verdicts"] for r in sweep[0]["releases"]}
    assert "(layer.k_scale, layer.v_scale)" in rows["sglang", "0.5.1"][FP8]["reason"]
    assert "(layer.k_scale_float, layer.v_scale_float)" in rows["sglang", "0.5.5.post1"][FP8]["reason"]
    assert rows["sglang", "0.5.1"][AUTOTUNE]["reason"].startswith(
        "nothing in sglang.srt.model_executor.model_runner defines _should_run_flashinfer_autotune or "
        "should_run_flashinfer_autotune or mentions 'autotun'")
    assert "never assigns or mentions it" in rows["sglang", "0.5.5"][VISION]["reason"]
    assert "hasattr" in rows["sglang", "0.5.5.post1"][VISION]["reason"]
    assert "BaseRunner" not in rows["sglang", "0.5.1"][AUTOTUNE]["reason"]
    assert "supports_sink" in rows["vllm", "0.27.1"][SINK]["reason"]
    assert "max_bs * max_context_len, without topk" in rows["sglang", "0.5.12.post1"][DRAFT]["reason"]
    assert "draft_kv_indices_buffer_width" in rows["sglang", "0.5.13"][DRAFT]["reason"]
    assert "plans every layer for model_runner.model_config.num_attention_heads" in rows["sglang", "0.5.16"][HEADS]["reason"]
    assert "get_max_num_attention_heads" in rows["sglang", "0.5.17"][HEADS]["reason"]
    assert "on the code %s leave(s)" % SWA_OLD in rows["sglang", "0.5.10.post1"][SWA_FULL]["reason"]
    assert "takes no custom mask before 0.5.11" in rows["sglang", "0.5.10.post1"][SWA_PREFIX]["reason"]
    assert "%s earlier in the series" % SWA_PREFIX in rows["sglang", "0.5.12.post1"][SWA_OLD]["reason"]
    assert "on the code %s leave(s)" % SWA_PREFIX in rows["sglang", "0.5.12.post1"][SWA_FULL]["reason"]
    assert "on the code %s leave(s)" % FP8 in rows["sglang", "0.5.12.post1"][SWA_PREFIX]["reason"]
    assert "extend slots not yet written" in rows["sglang", "0.5.20"][SWA_FULL]["reason"]


def test_each_wheel_is_read_in_part_with_its_own_version_and_hashes(sweep):
    for r in sweep[0]["releases"]:
        assert r["metadata_version"] == r["version"], r["wheel"]  # from the wheel's METADATA
        assert r["url"].startswith("http") and r["url"].endswith(r["wheel"])
        assert re.search(r"-(py3-none-any|cp311-cp311-manylinux\w*_x86_64|cp3\d+-abi3-manylinux\w*_x86_64)\.whl$",
                         r["wheel"]), r["wheel"]
        assert len(r["wheel_sha256"]) == 64
        metadata = [m for m in r["files_read"] if m.endswith(".dist-info/METADATA")]
        assert len(metadata) == 1
        assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in r["files_read"].values())
        assert r["bytes_fetched"] < 4_000_000, (r["wheel"], r["bytes_fetched"])  # not the whole wheel
    vllm = [r for r in sweep[0]["releases"] if r["dist"] == "vllm"]
    assert all(r["wheel_size"] > 100 * r["bytes_fetched"] for r in vllm)  # a vLLM wheel is hundreds of MB
    sglang = [r for r in sweep[0]["releases"] if r["version"] == "0.5.1"][0]
    assert set(sglang["files_read"]) >= {"sglang/srt/layers/attention/flashinfer_backend.py",
                                         "sglang/srt/model_executor/model_runner.py",
                                         "sglang/srt/configs/model_config.py"}


def test_committed_table_agrees_with_the_live_sweep(sweep):
    """benchmarks/results/sweep.json (behind the tables of docs/compatibility.md and the README)
    says what the sweep says now, and both blocks are the ones rendered from that file."""
    committed = json.loads(COMMITTED.read_text())
    rows = {(r["dist"], r["version"]): r for r in committed["releases"]}
    for r in sweep[0]["releases"]:
        old = rows[r["dist"], r["version"]]
        assert old["verdicts"] == r["verdicts"], (r["dist"], r["version"])
        assert old["files_read"] == r["files_read"]
    assert len(committed["releases"]) >= 104
    assert not [r for r in committed["releases"] for v in r.get("verdicts", {}).values() if v["verdict"] == "unknown-shape"]
    code = ("import importlib.util, json, sys\n"
            "spec = importlib.util.spec_from_file_location('s', %r)\n"
            "s = importlib.util.module_from_spec(spec); spec.loader.exec_module(s)\n"
            "data = json.load(open(%r))\n"
            "print(json.dumps([s.readme_block(data['releases'], data['meta']),\n"
            "                  s.summary_block(data['releases'], data['meta'])]))\n" % (str(SCRIPT), str(COMMITTED)))
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    full, summary = json.loads(proc.stdout)
    for path, text, (begin, end) in ((REPO / "docs" / "compatibility.md", full, ("sweep:begin", "sweep:end")),
                                     (REPO / "README.md", summary, ("sweep-summary:begin", "sweep-summary:end"))):
        doc = path.read_text()
        begin, end = "<!-- %s -->" % begin, "<!-- %s -->" % end
        assert doc.count(begin) == doc.count(end) == 1, path
        assert doc[doc.index(begin):doc.index(end) + len(end)] == text, path


def test_unreachable_index_is_a_clear_failure(tmp_path):
    out = tmp_path / "never.json"
    proc = run_sweep("--only", "sglang==0.5.1", "--index", "http://127.0.0.1:9/{name}/json", "--retries", "0",
                     "--json", str(out), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "network failure" in proc.stderr and "http://127.0.0.1:9/sglang/json" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


class _Index(BaseHTTPRequestHandler):
    """An index page whose one wheel lives at a port nothing listens on."""

    def do_GET(self):  # noqa: N802
        page = {"releases": {"0.5.1": [{"filename": "sglang-0.5.1-py3-none-any.whl", "yanked": False,
                                        "url": "http://127.0.0.1:9/sglang-0.5.1-py3-none-any.whl",
                                        "digests": {"sha256": "0" * 64}, "size": 1}]}}
        body = json.dumps(page).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_unreadable_wheel_is_a_clear_failure(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        index = "http://127.0.0.1:%d/{name}/json" % server.server_address[1]
        proc = run_sweep("--only", "sglang==0.5.1", "--index", index, "--retries", "0", timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 3, proc.stderr
    assert "cannot read the wheel http://127.0.0.1:9/sglang-0.5.1-py3-none-any.whl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_arguments_are_refused_before_any_network():
    proc = run_sweep("--only", "sglang==0.5.1", "--write-readme", "--index", "http://127.0.0.1:9/{name}")
    assert proc.returncode == 2 and "full sweep" in proc.stderr
    proc = run_sweep("--only", "torch==2.0", "--index", "http://127.0.0.1:9/{name}")
    assert proc.returncode == 2 and "expected DIST==VERSION" in proc.stderr
    proc = run_sweep("--jobs", "32", "--index", "http://127.0.0.1:9/{name}")
    assert proc.returncode == 2 and "--jobs" in proc.stderr


# --- the SGLang probes' cases on real wheel source -------------------------------------------


@functools.lru_cache(maxsize=None)
def probes():
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "sweep_probe_check.py")], env=env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "exit %d\n%s\n%s" % (proc.returncode, proc.stdout, proc.stderr)
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith(RESULT)][-1][len(RESULT):])


RUNNER = "sglang.srt.model_executor.model_runner"
RUNNERS = ("sglang.srt.model_executor.runner.base_runner", "sglang.srt.model_executor.runner.flashinfer_autotune")


@pytest.mark.parametrize("version", ["0.5.1", "0.5.1.post3", "0.5.5", "0.5.5.post1", "0.5.5.post3"])
def test_no_autotune_decision_at_all_is_not_affected(version):
    r = probes()[version]
    assert r["wheel_version"] == version
    assert r["present"][RUNNER] and not any(r["present"][m] for m in RUNNERS)
    assert (r["autotune"]["kind"], r["autotune"]["module"], r["autotune"]["node"]) == ("absent", None, False)


def test_autotune_code_without_a_known_decision_stays_unknown():
    # 0.5.6 has the decision (a method without an FP8 condition); with that method renamed, the
    # call to it, the autotuner import and the server flag remain: about autotuning, not absent.
    assert probes()["0.5.6"]["autotune"]["qualname"] == "ModelRunner._should_run_flashinfer_autotune"
    control = probes()["control_autotune"]
    assert control["kind"] == "unknown", control
    assert "but sglang.srt.model_executor.model_runner mentions '_flashinfer_autotune' (line" in control["reason"]


@pytest.mark.parametrize("version,kind", [("0.5.1", "absent"), ("0.5.1.post3", "absent"), ("0.5.5", "absent"),
                                          ("0.5.5.post1", "buggy"), ("0.5.6", "buggy")])
def test_vision_attribute_absent_before_0_5_5_post1(version, kind):
    assert probes()[version]["vision"]["kind"] == kind


def test_vision_attribute_mentioned_but_not_computed_stays_unknown():
    assert probes()["control_vision"] == {  # the nearest candidate: the assignment, without the test
        "kind": "unknown", "reason": 'no `hasattr($X, "vision_config")` in ModelConfig.__init__ inside '
                                     "`self.is_image_understandable_model = $_`"}
    assert probes()["control_vision_base"]["kind"] == "unknown"
    assert "base class" in probes()["control_vision_base"]["reason"]


@pytest.mark.parametrize("version,k,v", [("0.5.1", "layer.k_scale", "layer.v_scale"),
                                         ("0.5.1.post3", "layer.k_scale", "layer.v_scale"),
                                         ("0.5.5.post1", "layer.k_scale_float", "layer.v_scale_float")])
def test_fp8_edit_copies_the_paged_forward_scales(version, k, v):
    r = probes()[version]
    assert r["fp8_probe"] == "buggy"
    edit = r["fp8_edit"]
    assert edit["added"] == ["k_scale=%s" % k, "v_scale=%s" % v]
    assert edit["added_are_copies"]  # new nodes, not the forward call's own objects
    assert edit["changed"] == ["prefill_wrapper_paged.forward_return_lse"]
    assert edit["lse_after"] == edit["lse_before"][:-1] + ", k_scale=%s, v_scale=%s)" % (k, v)
    assert "k_scale" not in edit["lse_before"]
    assert edit["ragged"] == {"self.prefill_wrapper_ragged.forward": True,
                              "self.prefill_wrapper_ragged.forward_return_lse": True}
    assert edit["rest_unchanged"]  # only those two keywords and the run marker differ
    assert edit["after_marker"] == ["o2, s2 = " + edit["lse_after"]]
