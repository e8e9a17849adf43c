"""The doctor and the runtime agree (issue 22, "Doctor and runtime agree, always"): real pack
distributions, built and installed here, next to a real vLLM 0.28.0 (and 0.29.0 for the doctor).

Every pack is a one-hunk ``Backport`` on real vLLM code. Each is judged three ways: by
``flashfix doctor --json`` in the engine's environment (the engine not imported), by the runtime
in one process that imports the targets (``status()`` after the import, after a call, after
``revert()``), and by the runtime under ``FLASHFIX_STRICT=1``. A verdict the runtime reaches from
source alone must be the doctor's, with the same reason.
"""

import json
import os
import subprocess
import sys

import pytest

import engine_env
from conftest import REPO
from test_packs import install, make_project

SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"
STATE = "vllm.v1.sample.logits_processor.state"
HEAD = '''
from flashfix.semantic import Backport

def backport(**kw):
    return Backport(engine="vllm", versions=">=0.23,<0.29", upstream="https://example.invalid/pr", fixed_in="0.29.0",
                    summary="a test pack's change", doc="Why: a test.\\n\\nDelete when: never.", **kw)


def check(module):
    """the installed sampler module is the one whose source was read"""
'''
SEED = dict(module=SAMPLER, function="TopKTopPSampler.forward_cpu",
            before="len($G) != $LOGITS.shape[0] and not self.use_fp64_gumbel", after="not $G and not self.use_fp64_gumbel")


# dist -> (entry point names, PATCHES expression); the module is the dist with "_" for "-"
PACKS = {
    # item 1: the new code reads a name the module lacks
    "ffx-names": (("vllm",), 'backport(id="ffx-names", module=%r, function="TopKTopPSampler.forward_native", '
                             'before="logits.softmax(dim=-1, dtype=torch.float32)", after="_ffx_softmax(logits)")'
                  % SAMPLER),
    # item 1: the target is a @property getter
    "ffx-property": (("vllm",), 'backport(id="ffx-property", module=%r, function="BatchUpdateBuilder.removed", '
                                'before="self._ensure_removed_sorted()", after="self._ensure_removed_sorted() or None")'
                     % STATE),
    # item 1: the same fix under two ids, in two packs
    "ffx-seed-a": (("vllm",), "backport(id='ffx-seed-a', **%r)" % SEED),
    "ffx-seed-b": (("vllm",), "backport(id='ffx-seed-b', **%r)" % SEED),
    # item 1: a check hook, which only the imported engine can decide
    "ffx-check": (("vllm",), 'backport(id="ffx-check", module=%r, function="TopKTopPSampler.forward_cuda", '
                             'before="flashinfer_sample(logits.contiguous(), k, p, generators)", '
                             'after="flashinfer_sample(logits.contiguous(), k, p, generators or None)", check=check)'
                  % SAMPLER),
    # item 2: a pack for vllm reusing the id of flashfix's own FlashInfer patch
    "ffx-fi-id": (("vllm",), 'backport(id="flashinfer-sink-jit-name", module=%r, function="apply_top_k_only", '
                             'before="k.max()", after="k.amax()")' % SAMPLER),
    # item 3: an entry point whose name is no engine flashfix knows
    "ffx-unknown": (("vLLM",), 'backport(id="ffx-unknown", module=%r, function="empty_exponential_noise_like", '
                               'before="torch.empty(probs.shape, dtype=dtype, device=probs.device)", '
                               'after="torch.empty(tuple(probs.shape), dtype=dtype, device=probs.device)")' % SAMPLER),
    # item 4: one pack module listed under two engines
    "ffx-two": (("vllm", "flashinfer"), 'backport(id="ffx-two", module=%r, function="sample_with_exponential_noise", '
                                        'before="scores.argmax(dim=-1).view(-1)", after="scores.argmax(dim=-1).reshape(-1)")'
                % SAMPLER),
    # found next: a module-level function with a decorator (here @torch.compile) is rewritten at run time too
    "ffx-compiled": (("vllm",), 'backport(id="ffx-compiled", module=%r, function="compiled_random_sample", '
                                'before="torch.empty_like(probs)", after="torch.empty_like(probs, dtype=torch.float32)")'
                     % SAMPLER),
    # found next: a name the module imports only under `if TYPE_CHECKING:` is not there at run time
    "ffx-typing": (("vllm",), 'backport(id="ffx-typing", module=%r, function="LogitsProcessors.__init__", '
                              'before="logitproc.is_argmax_invariant()", '
                              'after="isinstance(logitproc, LogitsProcessor) and logitproc.is_argmax_invariant()")'
                   % STATE),
}
# item 4: a $RAN marker in `after` (judged by the doctor alone: on 0.29.0 the fix is upstream's)
RAN = "backport(id='ffx-ran', module=%r, function='TopKTopPSampler.forward_cpu', " \
      "before='if len($G) != $L.shape[0] and not self.use_fp64_gumbel:\\n    return $R', " \
      "after='if not $G and not self.use_fp64_gumbel:\\n    $RAN\\n    return $R')" % SAMPLER


def _project(root, dist, entries, patches):
    module = dist.replace("-", "_")
    project = make_project(root, dist, module, HEAD + "\nPATCHES = (%s,)\n" % patches, entry=entries[0])
    if len(entries) > 1:
        toml = project / "pyproject.toml"
        toml.write_text(toml.read_text().replace('%s = "%s"' % (entries[0], module), "\n".join(
            '%s = "%s"' % (e, module) for e in entries)))
    return project


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    main = install(root / "site", *[_project(root, d, e, p) for d, (e, p) in PACKS.items()])
    ran = install(root / "ran", _project(root, "ffx-ran", ("vllm",), RAN))
    return main, ran


def _env(*paths):
    return dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
                PYTHONPATH=os.pathsep.join([str(REPO)] + [str(p) for p in paths]), CUDA_VISIBLE_DEVICES="")


def doctor(requirement, *paths, strict=False):
    """(exit status, {id: row}, stderr) of ``flashfix doctor --json`` in the release's environment."""
    proc = subprocess.run([str(engine_env.env_python(requirement)), "-m", "flashfix", "doctor", "--json"]
                          + ["--strict"] * strict, capture_output=True, text=True, env=_env(*paths), timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, {r["id"]: r for r in json.loads(proc.stdout)}, proc.stderr


RUNTIME = '''
import json, sys
import flashfix
import torch
import %s as sampler_module
import %s
def rows():
    return {r["id"]: r for r in flashfix.status()}
imported = rows()
flashinfer_first = "flashinfer" in sys.modules
import flashinfer
after_flashinfer = rows()
sampler_module.TopKTopPSampler().forward_cpu(torch.randn(2, 50), {0: torch.Generator().manual_seed(1)}, None, None)
after_call = rows()
flashfix.revert()
print("FLASHFIX_RESULT=" + json.dumps(dict(imported=imported, flashinfer_first=flashinfer_first,
      after_flashinfer=after_flashinfer, after_call=after_call, reverted=rows())))
''' % (SAMPLER, STATE)

STRICT = '''
import json, flashfix
try:
    import vllm
except flashfix.PatchError as exc:
    print("FLASHFIX_RESULT=" + json.dumps(str(exc)))
else:
    print("FLASHFIX_RESULT=" + json.dumps(None))
'''


@pytest.fixture(scope="module")
def judged(packs):
    """What the doctor and the runtime say about the packs on vLLM 0.28.0."""
    site, _ = packs
    pythonpath = os.pathsep.join([str(REPO), str(site)])
    code, rows, stderr = doctor("vllm==0.28.0", site, strict=True)
    (runtime,) = engine_env.run("vllm==0.28.0", RUNTIME, pythonpath=pythonpath)
    runtime_stderr = engine_env.run.last_stderr
    (strict,) = engine_env.run("vllm==0.28.0", STRICT, env={"FLASHFIX_STRICT": "1"}, pythonpath=pythonpath)
    assert not runtime["flashinfer_first"], "flashinfer was imported with the sampler: item 4's order is not tested"
    return dict(code=code, doctor=rows, doctor_stderr=stderr, runtime=runtime, runtime_stderr=runtime_stderr,
                strict=strict)


def _agree(judged, patch_id):
    """The doctor's verdict and reason, which must be the runtime's after the import."""
    row, state = judged["doctor"][patch_id], judged["runtime"]["imported"][patch_id]
    verdict = {"patch": "applied"}.get(row["verdict"], row["verdict"])
    assert (state["state"], state["reason"] if verdict != "applied" else None) == (
        verdict, row["reason"] if verdict != "applied" else None), (row, state)
    return row


def test_a_name_the_module_lacks_is_refused_by_the_doctor_as_at_run_time(judged):
    row = _agree(judged, "ffx-names")
    assert row["verdict"] == "unknown-shape", row
    assert row["reason"] == "the new code reads _ffx_softmax, which %s lacks" % SAMPLER, row
    assert judged["code"] == 1


def test_a_name_imported_only_for_type_checkers_is_refused_by_both(judged):
    row = _agree(judged, "ffx-typing")
    assert row["verdict"] == "unknown-shape", row
    assert row["reason"] == "the new code reads LogitsProcessor, which %s lacks" % STATE, row


def test_a_property_getter_is_refused_by_both_with_the_same_reason(judged):
    row = _agree(judged, "ffx-property")
    assert row["verdict"] == "unknown-shape", row
    assert row["reason"] == "BatchUpdateBuilder.removed is not a plain function of %s: @property" % STATE, row


def test_the_same_fix_under_two_ids_applies_once_and_the_doctor_says_which(judged):
    rows = {i: _agree(judged, i) for i in ("ffx-seed-a", "ffx-seed-b")}
    verdicts = sorted(r["verdict"] for r in rows.values())
    assert verdicts == ["covered", "patch"], rows  # the second is judged on the code the first leaves: its fix is there
    (first,) = [i for i, r in rows.items() if r["verdict"] == "patch"]
    (second,) = [i for i, r in rows.items() if r["verdict"] != "patch"]
    assert rows[second]["reason"].startswith("%s earlier in the series of %s.TopKTopPSampler.forward_cpu makes this "
                                             "fix: " % (first, SAMPLER)), rows
    assert "edited after import" not in judged["runtime_stderr"]


def test_a_check_hook_is_named_in_the_doctors_row(judged):
    row = _agree(judged, "ffx-check")
    assert row["verdict"] == "patch", row
    assert row["reason"].endswith("; decided at import: the installed sampler module is the one whose source was read"), row


def _skipped(dist, entry, problem):
    return "pack %s (entry point %s = %s) skipped, none of its patches is loaded: %s" % (
        dist, entry, dist.replace("-", "_"), problem)


def test_flashfix_own_ids_win_whatever_engine_is_imported_first(judged):
    line = _skipped("ffx-fi-id", "vllm", "the id flashinfer-sink-jit-name is already taken by another pack or by flashfix")
    for rows in (judged["doctor"], judged["runtime"]["imported"], judged["runtime"]["after_flashinfer"]):
        own = rows["flashinfer-sink-jit-name"]
        assert own["engine"] == "flashinfer-python" and own["upstream"].startswith("none (no upstream PR"), own
    assert judged["doctor_stderr"].count(line) == 1, judged["doctor_stderr"]
    assert judged["runtime_stderr"].count(line) == 1, judged["runtime_stderr"]
    assert "pack flashfix" not in judged["runtime_stderr"] + judged["doctor_stderr"]
    assert judged["strict"] is not None and line in judged["strict"], judged["strict"]  # the pack, at vllm's import


def test_an_entry_point_naming_no_engine_gets_one_line_and_fails_strict(judged):
    line = _skipped("ffx-unknown", "vLLM", "its entry point name 'vLLM' is not an engine package flashfix watches "
                                           "(flashinfer, sglang, vllm)")
    assert judged["runtime_stderr"].count(line) == 1, judged["runtime_stderr"]
    assert "entry point vLLM = ffx_unknown" in judged["doctor_stderr"], judged["doctor_stderr"]
    assert judged["strict"] is not None and line in judged["strict"], judged["strict"]
    assert "ffx-unknown" not in judged["runtime"]["imported"]


def test_a_decorated_module_level_function_is_patched_as_the_doctor_says(judged):
    row = _agree(judged, "ffx-compiled")
    assert row["verdict"] == "patch", row


def test_a_pack_listed_under_two_engines_keeps_its_applied_reason(judged):
    runtime = judged["runtime"]
    applied = runtime["imported"]["ffx-two"]
    assert applied["state"] == "applied" and applied["reason"] == "a test pack's change (vllm 0.28.0)", applied
    assert runtime["after_flashinfer"]["ffx-two"]["reason"] == applied["reason"], runtime["after_flashinfer"]["ffx-two"]


def test_revert_clears_ran(judged):
    runtime = judged["runtime"]
    (seed,) = [i for i in ("ffx-seed-a", "ffx-seed-b") if runtime["imported"][i]["state"] == "applied"]
    assert runtime["after_call"][seed]["ran"] is True
    assert runtime["reverted"][seed]["state"] == "disabled" and runtime["reverted"][seed]["ran"] is False


def test_a_ran_marker_in_after_does_not_hide_the_fixed_release(packs):
    _, ran = packs
    _, rows, _ = doctor("vllm==0.28.0", ran)
    assert rows["ffx-ran"]["verdict"] == "patch", rows["ffx-ran"]
    _, rows, _ = doctor("vllm==0.29.0", ran)
    assert rows["ffx-ran"]["verdict"] == "fixed-upstream", rows["ffx-ran"]
    assert rows["ffx-ran"]["reason"].startswith("TopKTopPSampler.forward_cpu has the fixed form `if not $G"), rows
