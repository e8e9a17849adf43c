"""sglang-piecewise-graph-paged-prefill (sglang#20061, fixed in SGLang 0.5.10) against SGLang's own code.

* The doctor on the real release wheels (read from PyPI with range requests, as scripts/sweep_releases.py
  reads them, every patch judged in one pass as the doctor does): 0.5.3 has no piecewise CUDA graph
  runner, 0.5.4 to 0.5.5 plan a piecewise-graph batch before the runner, with no flag to read
  (not-affected for the backport, known-unfixed sglang-piecewise-graph-ragged-prefix-unflagged);
  0.5.5.post1 to 0.5.9 read ``patch`` (the flag in the runner's module in 0.5.5.post1/.post2, in
  piecewise_context_manager from 0.5.5.post3); 0.5.10 on read ``fixed-upstream``.
* The released functions run (SGLang 0.5.11's environment, the oldest there is, in one process): the
  real ``FlashInferAttnBackend.init_forward_metadata`` of 0.5.9 and of 0.5.10, taken from their
  wheels, swapped in turn into the loaded function (flashfix's rewrite machinery), driven on CPU with
  an extend over a cached prefix, outside and inside SGLang's own ``enable_piecewise_cuda_graph()``,
  with a stand-in for the indices updater that records how the batch is planned. 0.5.9 as released
  plans the in-graph batch ragged (the bug); 0.5.9 with the declaration's edit plans every case as
  0.5.10 (and 0.5.11) do. The flag the edit reads (``sglang_patch.is_in_piecewise_cuda_graph``) is the
  release's own.
"""

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402

this_checkout.flashfix()
from flashfix import sglang_patch  # noqa: E402
from flashfix.core import locate as _locate  # noqa: E402
from flashfix.core import source as _source  # noqa: E402
from flashfix.tools import doctor  # noqa: E402

PATCH = sglang_patch.PIECEWISE_GRAPH_PAGED_PREFILL
KNOWN_ID = "sglang-piecewise-graph-ragged-prefix-unflagged"
BACKEND = PATCH.targets[0]
QUALNAME = PATCH.rule.hunks[0].function
RUNNER, CONTEXT = sglang_patch._PCG_RUNNER, "sglang.srt.compilation.piecewise_context_manager"


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep_releases", TESTS.parent / "scripts" / "sweep_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SWEEP = _sweep()


@functools.lru_cache(maxsize=None)
def release(version):
    """The doctor's verdicts (every SGLang patch, judged in one pass), its known-unfixed ids, where the
    flag is defined, and the backend's source, for the real wheel of ``sglang==version``."""
    (_, _, wheel, _), = SWEEP.plan([("sglang", version)])
    archive, _ = SWEEP.open_wheel(wheel["url"])
    try:
        read, verdicts = SWEEP.judge_archive(archive, wheel["filename"], "sglang")
        reader = SWEEP._paths.ZipReader(archive, wheel["filename"])
        known = [row["id"] for row in doctor.known(reader)]
        with _locate.reading(reader):
            runner = _source.module_ast(RUNNER)
            flag_module = sglang_patch._graph_flag_module(runner) if runner is not None else None
            text = reader.find(BACKEND).text
    finally:
        _source.forget()
        archive.close()
    return {"version": read, "verdicts": verdicts, "known": known, "flag_module": flag_module, "backend": text}


CASES = [  # version, verdict, words of the reason, where the flag the fix reads lives
    ("0.5.3", "not-affected", "no piecewise CUDA graph runner", None),
    ("0.5.4", "not-affected", "plans no batch inside `with enable_piecewise_cuda_graph()`", None),
    ("0.5.5", "not-affected", "known-unfixed " + KNOWN_ID, None),
    ("0.5.5.post1", "patch", "init_forward_metadata (line 469) plans a piecewise-CUDA-graph extend", RUNNER),
    ("0.5.5.post3", "patch", "init_forward_metadata (line 469)", CONTEXT),
    ("0.5.6", "patch", "init_forward_metadata (line 475)", CONTEXT),
    ("0.5.9", "patch", "init_forward_metadata (line 482) plans a piecewise-CUDA-graph extend on the ragged + paged split",
     CONTEXT),
    ("0.5.10", "fixed-upstream", "(`is_in_piecewise_cuda_graph()`)", CONTEXT),
    ("0.5.14", "fixed-upstream", "(`is_in_tc_piecewise_cuda_graph()`)", None),
]


@pytest.mark.parametrize("version,verdict,words,flag_module", CASES)
def test_doctor_on_the_release_wheels(version, verdict, words, flag_module):
    r = release(version)
    assert r["version"] == version
    got, reason = r["verdicts"][PATCH.id]
    assert (got, words in reason) == (verdict, True), (got, reason)
    assert not [pid for pid, (v, _) in r["verdicts"].items() if v == "unknown-shape"], r["verdicts"]
    # the uncarried releases (no flag to read) are named by the known-unfixed row, the others not
    assert (KNOWN_ID in r["known"]) == (version in ("0.5.4", "0.5.5")), r["known"]
    if verdict == "patch":
        assert r["flag_module"] == flag_module


# --- the released functions, run ---------------------------------------------------------------

SCRIPT = r"""
import ast, copy, json, sys
from types import SimpleNamespace
sys.path.insert(0, %(tests)r)
import torch
import flashfix
from flashfix import sglang_patch
from flashfix.core import registry as _registry
from flashfix.core import source as _source
import sglang.srt.layers.attention.flashinfer_backend as fb
from sglang.srt.compilation.piecewise_context_manager import enable_piecewise_cuda_graph
from sglang.srt.model_executor.forward_batch_info import ForwardMode

PATCH = sglang_patch.PIECEWISE_GRAPH_PAGED_PREFILL
RULE = PATCH.rule.hunks[0]
FUNC = fb.FlashInferAttnBackend.__dict__["init_forward_metadata"]
texts = json.load(open(%(texts)r))
defs = {v: _source.find_def(ast.parse(t), %(qualname)r) for v, t in texts.items()}

def plan(deterministic=False, prefix=(6, 0), in_graph=False):
    backend = object.__new__(fb.FlashInferAttnBackend)
    planned = []
    backend.__dict__.update(
        enable_deterministic=deterministic, is_multimodal=False, multi_item_scoring_delimiter=None, enable_mis=False,
        use_paged=False, prefill_wrappers_paged=["paged"], prefill_split_tile_size=None,
        indices_updater_prefill=SimpleNamespace(update=lambda *a, **k: planned.append(k["use_ragged"])))
    seq_lens = torch.tensor([9, 5])
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.arange(2), seq_lens=seq_lens,
                            seq_lens_cpu=seq_lens.clone(), seq_lens_sum=14, extend_prefix_lens=torch.tensor(prefix),
                            extend_prefix_lens_cpu=list(prefix), encoder_lens=None, spec_info=None,
                            cross_attention_custom_mask=None)
    if in_graph:
        with enable_piecewise_cuda_graph():
            backend.init_forward_metadata(batch)
    else:
        backend.init_forward_metadata(batch)
    m = backend.forward_metadata
    return {"planned_ragged": planned, "use_ragged": m.use_ragged, "extend_no_prefix": m.extend_no_prefix}

def cases():
    return {"eager, cached prefix": plan(), "piecewise graph, cached prefix": plan(in_graph=True),
            "piecewise graph, no prefix": plan(prefix=(0, 0), in_graph=True),
            "eager, deterministic": plan(deterministic=True),
            "flag after the graph": sglang_patch.is_in_piecewise_cuda_graph()}

def with_body(version, edit_too):
    def edit(node, mark):
        node.body = copy.deepcopy(defs[version].body)
        if edit_too:
            RULE.edit(node, mark)
    change = _registry.rewrite(FUNC, edit, "test-piecewise-prefix")
    change.apply()
    try:
        return cases()
    finally:
        change.undo()

def patched_0_5_9():
    released = fb.is_in_piecewise_cuda_graph
    fb.is_in_piecewise_cuda_graph = sglang_patch.is_in_piecewise_cuda_graph  # the global the declaration's needs sets
    try:                                                                      # where the module lacks it (0.5.9)
        return with_body("0.5.9", True)
    finally:
        fb.is_in_piecewise_cuda_graph = released

row = next(r for r in flashfix.status() if r["id"] == PATCH.id)
with enable_piecewise_cuda_graph():
    flag_inside = sglang_patch.is_in_piecewise_cuda_graph()
out = {"state": row["state"], "flag": [flag_inside, sglang_patch.is_in_piecewise_cuda_graph()],
       "flag_is_the_release's": sglang_patch._PCG_FLAG[0].__module__,
       "0.5.11": cases(), "0.5.9": with_body("0.5.9", False), "0.5.9 patched": patched_0_5_9(),
       "0.5.10": with_body("0.5.10", False)}
out["after_undo"] = cases()
print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    texts = tmp_path_factory.mktemp("pcg") / "backends.json"
    texts.write_text(json.dumps({v: release(v)["backend"] for v in ("0.5.9", "0.5.10")}))
    (r,) = engine_env.run("sglang==0.5.11", SCRIPT % {"tests": str(TESTS), "texts": str(texts), "qualname": QUALNAME})
    return r


RAGGED = {"planned_ragged": [True], "use_ragged": True, "extend_no_prefix": False}
PAGED = {"planned_ragged": [False], "use_ragged": False, "extend_no_prefix": False}
FIXED = {"eager, cached prefix": RAGGED, "piecewise graph, cached prefix": PAGED,
         "piecewise graph, no prefix": dict(PAGED, extend_no_prefix=True), "eager, deterministic": PAGED,
         "flag after the graph": False}


def test_the_flag_is_the_releases_own(run):
    assert run["state"] == "fixed-upstream", run
    assert run["flag"] == [True, False]
    assert run["flag_is_the_release's"] == "sglang.srt.compilation.piecewise_context_manager"


def test_released_0_5_9_plans_the_in_graph_batch_ragged(run):
    assert run["0.5.10"] == FIXED == run["0.5.11"], run
    # the bug: inside the piecewise graph the extend over a cached prefix takes the ragged + paged split
    assert run["0.5.9"] == dict(FIXED, **{"piecewise graph, cached prefix": RAGGED, "piecewise graph, no prefix": dict(
        RAGGED, extend_no_prefix=True)}), run["0.5.9"]


def test_patched_0_5_9_plans_as_0_5_10(run):
    assert run["0.5.9 patched"] == run["0.5.10"], run["0.5.9 patched"]
    assert run["after_undo"] == run["0.5.11"]
