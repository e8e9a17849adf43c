"""sglang#26513 carried (``sglang-swa-ragged-prefix-extend-slots``) and the patch series it makes, on SGLang 0.5.11's
own code (its flashinfer_backend.py is byte for byte 0.5.12.post1's), on CPU, one process per setting
(tests/swa_prefix_check.py): the doctor's verdicts, the runtime's states, what the release's own
``update_sliding_window`` plans (a recording ``call_begin_forward``), and the keywords of the live
``forward_extend``'s FlashInfer calls.

Two series: ``forward_extend`` takes ``sglang-fp8-kv-scales`` then #26513's window_left; ``update_sliding_window``
takes #26513 then ``sglang-swa-full-attn-ragged-prefix``, which is judged on the code #26513 leaves (the release's
code predates the shape it completes). Each patch stays its own unit: disabled alone, the doctor says what the
runtime does; reverted, its function is compiled again from the rest.
"""

import functools
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402

FP8, SWA, FULL = "sglang-fp8-kv-scales", "sglang-swa-ragged-prefix-extend-slots", "sglang-swa-full-attn-ragged-prefix"
SCRIPT = (TESTS / "swa_prefix_check.py").read_text()
# window 4; prefixes 10, 3, 0 with 2, 3, 5 new tokens (tests/swa_prefix_check.py)
RELEASED = [{"lens": [6, 6, 5], "start": [6, 0, 0], "mask": None}, {"lens": [12, 6, 5], "start": [0, 0, 0], "mask": None}]
SWA_PLAN = {"lens": [4, 3, 0], "start": [6, 0, 0],  # the prefix's last 4 tokens; per query, the keys within 4 of it
            "mask": [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]}
FULL_PLAN = {"lens": [10, 3, 0], "start": None, "mask": None}  # the cached prefix only, from slot 0
BASE, SCALES, WL = ["causal", "logits_soft_cap", "sm_scale"], ["k_scale", "v_scale"], ["window_left"]


def lse(keywords, wrapper):
    """The keywords of ``wrapper``'s forward_return_lse in forward_extend."""
    (kw,) = [k for w, method, k in keywords if w == "prefill_wrapper_" + wrapper and method == "forward_return_lse"]
    return kw


@functools.lru_cache(maxsize=None)
def report(disable="", revert=""):
    env = {"FLASHFIX_DISABLE": disable} if disable else {}
    if revert:
        env["REVERT"] = revert
    (r,) = engine_env.run("sglang==0.5.11", SCRIPT, env=env)
    return r


def test_two_series_apply_whole_and_the_doctor_says_what_runs():
    r = report()
    assert r["doctor"] == {FP8: "patch", SWA: "patch", FULL: "patch"}, r["reasons"]
    assert r["state"] == {FP8: "applied", SWA: "applied", FULL: "applied"}, r["state_reason"]
    assert "on the code %s leave(s)" % FP8 in r["reasons"][SWA] and "on the code %s leave(s)" % SWA in r["reasons"][FULL]
    assert r["ragged"] == [SWA_PLAN, FULL_PLAN], r["ragged"]
    assert r["paged_only"] == RELEASED, r["paged_only"]  # the paged-only extend plans as released
    # forward_extend compiled once from its series: the paged forward_return_lse has the scales and the window
    assert lse(r["keywords"], "paged") == sorted(BASE + SCALES + WL) and lse(r["keywords"], "ragged") == BASE + WL
    assert any("series %s + %s" % (FP8, SWA) in c and "forward_extend" in c for c in r["changes"][SWA]), r["changes"]
    assert any("series %s + %s" % (SWA, FULL) in c for c in r["changes"][FULL]), r["changes"]
    # revert() newest first: each step gives back one patch's part, the release's code at the end
    steps = {s["id"]: s for s in r["after_revert"]}
    assert steps[FULL]["ragged"] == [SWA_PLAN, RELEASED[1]] and steps[FULL]["state"][SWA] == "applied"
    assert steps[SWA]["ragged"] == RELEASED and lse(steps[SWA]["keywords"], "ragged") == BASE
    assert lse(steps[SWA]["keywords"], "paged") == sorted(BASE + SCALES), steps[SWA]  # the FP8 fix of the function stays
    assert lse(steps[FP8]["keywords"], "paged") == BASE and steps[FP8]["state"] == {FP8: "disabled", SWA: "disabled", FULL: "disabled"}


def test_one_patch_of_a_series_disabled_keeps_the_others():
    no_fp8 = report(FP8)
    assert no_fp8["doctor"] == {FP8: "disabled", SWA: "patch", FULL: "patch"}, no_fp8["reasons"]
    assert no_fp8["state"] == {FP8: "disabled", SWA: "applied", FULL: "applied"}, no_fp8["state_reason"]
    assert "leave(s)" not in no_fp8["reasons"][SWA]  # first in its series now: judged on the release's code
    assert lse(no_fp8["keywords"], "paged") == BASE + WL == lse(no_fp8["keywords"], "ragged"), no_fp8["keywords"]
    assert no_fp8["ragged"] == [SWA_PLAN, FULL_PLAN]
    # without #26513 the full-attention fix has no shape to complete: not-affected in the doctor and the runtime alike
    no_swa = report(SWA)
    assert no_swa["doctor"] == {FP8: "patch", SWA: "disabled", FULL: "not-affected"}, no_swa["reasons"]
    assert no_swa["state"] == {FP8: "applied", SWA: "disabled", FULL: "not-affected"}, no_swa["state_reason"]
    assert no_swa["reasons"][FULL] == no_swa["state_reason"][FULL] and "predates sglang#26513" in no_swa["reasons"][FULL]
    assert no_swa["ragged"] == RELEASED and lse(no_swa["keywords"], "paged") == sorted(BASE + SCALES), no_swa["keywords"]


def test_reverting_the_patch_another_builds_on_takes_that_one_back_too():
    """``revert()`` of #26513 while the full-attention fix, judged on #26513's code, is in force: what remains of
    update_sliding_window's series cannot hold the later fix alone, so it is given back with it (its state says
    so, not "applied") and the release's planning runs; forward_extend keeps the FP8 fix."""
    r = report(revert=SWA)
    (step,) = r["after_revert"]
    assert step["state"][SWA] == "disabled" and step["state"][FP8] == "applied", step
    assert step["ragged"] == RELEASED, step  # nothing half-applied: no prefix-only full plan over the SWA shape
    assert lse(step["keywords"], "paged") == sorted(BASE + SCALES) and lse(step["keywords"], "ragged") == BASE, step
    assert step["state"][FULL] == "disabled", step  # given back with it, not left over code it no longer fits
