"""`flashfix verify`'s engine checks, on the CPU: the engines' own functions (loaded from their
wheels with stand-in imports, or installed) are driven with a FlashInfer stand-in that records every
wrapper call and its arguments (tests/fake_flashinfer.py), so a release whose function reads
something verify does not build fails here, not on a GPU."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine_env
import vet_helpers
from conftest import REPO

WHEELS = vet_helpers.wheel_cache()

CODE = '''
import json, os, sys
sys.path.insert(0, %(tests)r)
import fake_flashinfer
fi = fake_flashinfer.install(into_sys_modules=%(path)r is not None)
from flashfix.tools import gpu_checks as g
if %(path)r is None:  # the installed engine on a CPU (no FlashInfer import there): the merge is the fake's
    import importlib
    m = importlib.import_module(%(target)r)
    m.merge_state = m._safe_merge_state = fi.cascade.merge_state
rows = g.%(check)s(path=%(path)r, fi=fi, **%(kwargs)r)
print("FLASHFIX_RESULT=" + json.dumps({"rows": rows, "log": fake_flashinfer.LOG}, default=repr))
'''


def wheel(spec):
    """The released wheel of ``spec`` (``name==version``), fetched once without pip (the test venv has none)."""
    return str(vet_helpers.wheel(spec))


def row_problems(rows):
    """The errors a check's rows report, and each control that is not bitwise equal."""
    errors = [r.get("error") or r.get("error_pre_fix") or r.get("error_flashfix") for r in rows]
    return [e for e in errors if e] + ["%s not bitwise equal" % r["case"] for r in rows
                                       if r.get("control") and not r["bitwise_equal"]]


def drive(requirement, check, path, target=None, **kwargs):
    code = CODE % {"tests": str(REPO / "tests"), "check": check, "path": path, "target": target, "kwargs": kwargs}
    ((result,),) = [engine_env.run(requirement, code,
                                   env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    return result["rows"], result["log"]


@pytest.mark.parametrize("release", ["sglang==0.5.1", "sglang==0.5.16", None])
def test_sglang_forward_extend_is_driven_and_the_fix_passes_the_scales(release):
    path = wheel(release) if release else None  # None: the installed 0.5.17
    if release == "sglang==0.5.1":
        path = os.path.relpath(path)  # as an operator may give it (the module's __file__ is absolute)
    rows, log = drive("sglang==0.5.17", "sglang_fp8", path, "sglang.srt.layers.attention.flashinfer_backend")
    main = [r for r in rows if r["case"] == "ragged+paged, FP8 e4m3"]
    assert len(main) == 2 and all(r["error_pre_fix"] is None and r["error_flashfix"] is None for r in main), [
        (r["error_pre_fix"], r["error_flashfix"]) for r in main]
    for r in main:  # the branch ran: one ragged and one paged forward_return_lse from the engine's file
        assert [c.split(" line")[0] for c in r["calls_flashfix"]] == ["ragged.forward_return_lse", "paged.forward_return_lse"]
    paged = [entry for entry in log if entry[1] == "forward_return_lse" and "causal" in entry[3] and not entry[3]["causal"]]
    scales = [(e[3].get("k_scale"), e[3].get("v_scale")) for e in paged]
    assert scales[0] == (None, None)  # as released: the scales are dropped
    expected = ("tensor[] float32", "tensor[] float32") if release == "sglang==0.5.1" else (0.05, 0.07)
    assert scales[1] == expected  # patched: 0.5.1's layer.k_scale, later layer.k_scale_float
    controls = [r for r in rows if r.get("control")]
    assert controls and all(r["bitwise_equal"] and not r.get("error_flashfix") for r in controls), controls


def test_vllm_factory_and_forward_are_driven_on_the_derived_pre_fix_shape(tmp_path):
    site = Path(engine_env.env_python("vllm==0.28.0")).parents[1]
    fixed = next(site.glob("lib/python*/site-packages/vllm/v1/attention/backends/flashinfer.py"))
    meta = next(site.glob("lib/python*/site-packages/vllm-0.28.0.dist-info/METADATA"))
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_prefix_shape

    target = tmp_path / "vllm" / "v1" / "attention" / "backends"
    target.mkdir(parents=True)
    (target / "flashinfer.py").write_text(vllm_prefix_shape.derive_prefix_source(fixed.read_text()))
    (tmp_path / "vllm-0.28.0.dist-info").mkdir()
    (tmp_path / "vllm-0.28.0.dist-info" / "METADATA").write_text(meta.read_text())
    rows, log = drive("vllm==0.28.0", "vllm_forward", str(tmp_path), patch_id="vllm-sink-prefill")
    sinks = [r for r in rows if r["case"].startswith("sink prefill")]
    assert len(sinks) == 2 and all(r["calls_pre_fix"][0] == "built BatchPrefillWithPagedKVCacheWrapper"
                                   and r["calls_flashfix"][0] == "built BatchAttentionWithAttentionSinkWrapper"
                                   and not r["error_flashfix"] and len(r["calls_flashfix"]) == 2 for r in sinks), sinks
    runs = [e for e in log if e[1] == "run"]
    sink_runs = [e for e in runs if e[0] == "BatchAttentionWithAttentionSinkWrapper"]
    assert sink_runs and all(e[2][1] == "tensor[16] float32" and "sinks" not in e[3] for e in sink_runs)
    assert all(r["bitwise_equal"] for r in rows if r.get("control"))
    # verify picks the check as the check loads the code: the tree, then this interpreter, whose FlashInfer
    # has the sink wrapper the new code reads (before: the tree alone, unknown-shape, the check never ran)
    fi = tmp_path.parent / "fi" / "flashinfer"
    fi.mkdir(parents=True)
    (fi / "__init__.py").write_text("class BatchAttentionWithAttentionSinkWrapper:\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "flashfix", "verify", "--path", str(tmp_path)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(fi.parent)])))
    picked = [line for line in proc.stdout.splitlines() if "vllm-sink-prefill" in line and str(tmp_path) in line]
    assert proc.returncode == 3 and len(picked) == 1 and picked[0].endswith("doctor: patch"), (proc.stdout, proc.stderr)


SWEEP = '''
import json, os, sys
sys.path.insert(0, %(tests)r)
import fake_flashinfer
fi = fake_flashinfer.install()
from flashfix.tools import gpu_checks as g
from flashfix.core import registry as _registry
out = {}
for version, tree in %(trees)r:
    for name in [m for m in sys.modules if m.split(".")[0] == %(top)r]:
        del sys.modules[name]  # the last release's modules: this one is imported afresh
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, g.EngineModuleFinder)]
    for record in _registry._records.values():  # every patch judged afresh, series members before it too
        record.update(state="waiting", changes=[], decided=None, engine_version=None)
    _registry._series.clear()  # (the last release's series: who rewrites each function)
    _registry._ahead.clear()
    del fake_flashinfer.LOG[:]
    rows = g.%(check)s(path=tree, fi=fi, **%(kwargs)r)
    out[version] = {"rows": rows, "log": list(fake_flashinfer.LOG)}
print("FLASHFIX_RESULT=" + json.dumps(out, default=repr))
'''


def sweep_check(trees, patch, check, top="sglang"):
    """``{version: {"rows", "log"}}``: ``gpu_checks.<check>(patch_id=patch)`` on each release tree, in one
    process of the SGLang 0.5.17 environment with the FlashInfer stand-in (``SWEEP``)."""
    code = SWEEP % {"tests": str(REPO / "tests"), "trees": trees, "top": top, "patch": patch, "check": check,
                    "kwargs": {"patch_id": patch}}
    ((out,),) = [engine_env.run("sglang==0.5.17", code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    return out


def release_trees(dist, targets, since, below):
    """``[(version, tree)]`` of every final release of ``dist`` from ``since`` below ``below``: a
    small tree holding those of the release's ``targets`` modules (a name or a tuple) it has, and
    its METADATA, read from its wheel on PyPI with range requests (scripts/sweep_releases.py) and
    cached."""
    from packaging.version import Version

    sys.path.insert(0, str(REPO / "scripts"))
    import sweep_releases as sweep
    from flashfix.core import paths

    url, data = sweep.index_json(dist)
    trees = []
    for version, found, _ in sweep.releases(dist, data, url, since=since):
        if Version(version) >= Version(below) or found is None:
            continue
        tree, reader = WHEELS / "trees" / ("%s-%s" % (dist, version)), None
        for target in (targets,) if isinstance(targets, str) else targets:
            module = tree / (target.replace(".", "/") + ".py")
            if module.exists() or module.with_suffix(".absent").exists():
                continue
            if reader is None:
                archive, _ = sweep.open_wheel(found["url"])
                reader = paths.ZipReader(archive, found["filename"])
                member = reader._metadata_member(dist)[0]
                (tree / member).parent.mkdir(parents=True, exist_ok=True)
                (tree / member).write_bytes(reader._read_member(member))
            module.parent.mkdir(parents=True, exist_ok=True)
            source = reader.find(target)
            if source is None:
                module.with_suffix(".absent").write_text("")
            else:
                module.write_text(source.text)
        trees.append((version, str(tree)))
    return trees


def test_sglang_every_release_in_range_in_one_process():
    """Every final release from 0.5.1 to 0.5.17 (the patch's range below its fix): forward_extend
    is driven to the ragged + paged branch, the unpatched paged call drops the scales and the
    patched one passes the release's own scale expressions; the controls are bitwise equal."""
    from flashfix import sglang_patch

    trees = release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", sglang_patch.FIXED_IN)
    assert len(trees) >= 30, trees
    code = SWEEP % {"tests": str(REPO / "tests"), "trees": trees, "top": "sglang", "patch": "sglang-fp8-kv-scales",
                    "check": "sglang_fp8", "kwargs": {"head_dims": (64,)}}
    ((out,),) = [engine_env.run("sglang==0.5.17", code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        main = [r for r in rows if r["case"] == "ragged+paged, FP8 e4m3"]
        paged = [e[3] for e in log if e[1] == "forward_return_lse" and e[3].get("causal") is False]
        problems = row_problems(rows)
        if not main or r"paged.forward_return_lse" not in " ".join(main[0]["calls_flashfix"]):
            problems.append("the ragged + paged branch did not run: %s" % (main and main[0]["calls_flashfix"]))
        elif paged[0].get("k_scale") is not None or paged[1].get("k_scale") is None:
            problems.append("scales: as released %s, patched %s" % (paged[0].get("k_scale"), paged[1].get("k_scale")))
        if problems:
            bad[version] = problems
    assert not bad, bad


def derived_vllm_trees(tmp_path):
    """``[(version, tree)]``: the pre-fix shape of each installed fixed vLLM release in the engine
    environments (tests/vllm_prefix_shape.py derives it), with the release's METADATA."""
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_prefix_shape

    trees = []
    for requirement in [r for r in engine_env.RELEASES if r.startswith("vllm==") and r >= "vllm==0.28.0"]:
        version = requirement.split("==")[1]
        site = next(Path(engine_env.env_python(requirement)).parents[1].glob("lib/python*/site-packages"))
        tree = tmp_path / ("vllm-" + version)
        module = tree / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py"
        module.parent.mkdir(parents=True)
        module.write_text(vllm_prefix_shape.derive_prefix_source(
            (site / "vllm" / "v1" / "attention" / "backends" / "flashinfer.py").read_text()))
        (tree / ("vllm-%s.dist-info" % version)).mkdir()
        (tree / ("vllm-%s.dist-info" % version) / "METADATA").write_text(
            (site / ("vllm-%s.dist-info" % version) / "METADATA").read_text())
        trees.append((version, str(tree)))
    return trees


def test_vllm_every_derived_pre_fix_shape_in_one_process(tmp_path):
    trees = derived_vllm_trees(tmp_path)
    assert len(trees) >= 4, trees
    code = SWEEP % {"tests": str(REPO / "tests"), "trees": trees, "top": "vllm", "patch": "vllm-sink-prefill",
                    "check": "vllm_forward", "kwargs": {"patch_id": "vllm-sink-prefill"}}
    ((out,),) = [engine_env.run("vllm==0.28.0", code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        sinks = [r for r in rows if r["case"].startswith("sink prefill")]
        if [r["calls_flashfix"][0] for r in sinks] != ["built " + SINK_CLASS] * 2 or any(
                [c.split(" line")[0] for c in r["calls_flashfix"][1:]] != ["prefill.run"] for r in sinks):
            problems.append("the sink branch did not run: %s" % [r["calls_flashfix"] for r in sinks])
        sink_runs = [e for e in log if e[0] == SINK_CLASS and e[1] == "run"]
        if not sink_runs or any(e[2][1] != "tensor[16] float32" or "sinks" in e[3] for e in sink_runs):
            problems.append("the sink wrapper's run did not get the sinks positionally: %s" % sink_runs)
        if problems:
            bad[version] = problems
    assert not bad, bad


SINK_CLASS = "BatchAttentionWithAttentionSinkWrapper"


VLLM_LSE_TARGETS = ("vllm.model_executor.layers.attention.mla_attention", "vllm.v1.attention.backends.mla.prefill.flashinfer",
                    "vllm.v1.attention.backends.mla.prefill.trtllm_ragged", "vllm.v1.attention.backends.flashinfer")


@pytest.mark.parametrize("patch,calls", [("vllm-mla-flashinfer-lse", ["new tokens.run", "context chunk.run"]),
                                         ("vllm-dcp-prefill-lse", ["context.run", "new tokens.run"])])
def test_vllm_lse_every_release_in_range_in_one_process(patch, calls):
    """#52796 on every final release from 0.20.0 to 0.28.0 (the code moved in 0.21.0 and changed
    its arguments in 0.28.0): the engine's own functions run both FlashInfer passes, the merged
    output changes with the fix (the LSEs are read in another base) and the controls do not."""
    trees = release_trees("vllm", VLLM_LSE_TARGETS, "0.20.0", "0.29.0")
    assert len(trees) >= 14, trees
    out, moved = {}, Path(VLLM_LSE_TARGETS[1].replace(".", "/") + ".py")
    for layout in {(Path(tree) / moved).exists() for _, tree in trees}:  # a process per target module (hooked once)
        code = SWEEP % {"tests": str(REPO / "tests"), "trees": [t for t in trees if (Path(t[1]) / moved).exists() == layout],
                        "top": "vllm", "patch": patch, "check": "vllm_lse", "kwargs": {"patch_id": patch}}
        out.update(*engine_env.run("vllm==0.28.0", code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"}))
    bad = {}
    for version, _ in trees:
        rows = out[version]["rows"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("cached prefix")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]] != calls or main[0]["bitwise_equal"]:
            problems.append("the branch did not run, or the fix did not change the merge: %s" % main)
        if problems:
            bad[version] = problems
    assert not bad, bad


def test_sglang_swa_every_release_in_range_in_one_process():
    """sglang-swa-full-attn-ragged-prefix on every final release from 0.5.1 to 0.5.20 (to 0.5.12.post1 judged and
    applied on the code #26513's backport leaves, its series): the engine's update_sliding_window plans both
    wrappers, forward_extend runs the ragged + paged branch of the full-attention layer; as released the full
    wrapper's paged range covers whole sequences (kv_indices sized sum(seq) + 256), patched the cached prefix
    only."""
    from flashfix.sglang_patch import SWA_FULL_ATTN_RAGGED_PREFIX as patch
    from flashfix.tools.gpu_checks import SWA_REQUESTS

    trees = release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", patch.fixed_in)
    assert len(trees) >= 39 and trees[0][0] == "0.5.1" and trees[-1][0] == "0.5.20", trees
    out = sweep_check(trees, patch.id, "sglang_plan")
    seq_sum, prefix_sum = sum(p + n for p, n in SWA_REQUESTS), sum(p for p, _ in SWA_REQUESTS)
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("ragged extend")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]][-2:] != [
                "ragged.forward_return_lse", "paged full.forward_return_lse"]:
            problems.append("the ragged + paged branch did not run: %s" % main)
        # the paged plans of the main case, released then patched: [swa, full] each
        sizes = [e[2][2] for e in log if e[0] == "BatchPrefillWithPagedKVCacheWrapper" and e[1] == "begin_forward"][:4]
        if sizes[1::2] != ["tensor[%d] int32" % (seq_sum + 256), "tensor[%d] int32" % (prefix_sum + 256)]:
            problems.append("full-attention wrapper's kv_indices (released, patched): %s" % sizes[1::2])
        if problems:
            bad[version] = problems
    assert not bad, bad



def test_sglang_per_layer_heads_every_release_in_range_in_one_process():
    """sglang-per-layer-heads-plan on every final release from 0.5.1 to 0.5.16: the updater's own
    __init__ reads the model's head counts, its update_single_wrapper plans, forward_extend runs
    the 32-head layer; as released both wrappers are planned for 16 query heads, patched for 32."""
    from flashfix.sglang_patch import PER_LAYER_HEADS_PLAN as patch

    trees = release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", patch.fixed_in)
    assert len(trees) >= 35, trees
    out = sweep_check(trees, patch.id, "sglang_plan")
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("ragged extend")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]] != [
                "ragged.begin_forward", "paged .begin_forward", "ragged.forward_return_lse", "paged .forward_return_lse"]:
            problems.append("the planning and the ragged + paged branch did not run: %s" % main)
        planned = [e[2][4 if "Paged" in e[0] else 2] for e in log if e[1] == "begin_forward"][:8]  # num_qo_heads
        if planned != [16, 16, 32, 32] + [16, 16] * 2:  # ragged, paged: main case released, patched; the control
            problems.append("planned query heads: %s" % planned[:8])
        if problems:
            bad[version] = problems
    assert not bad, bad


def sweep(dist, patch, check, since, env):
    """``(trees, {version: {"rows", "log"}})``: ``check`` of ``patch`` driven on every final release of
    ``dist`` from ``since`` below the patch's fix (its target module read from the wheel), in one process."""
    from flashfix.core import registry as _registry

    patch = next(p for p in _registry.load_all() if p.id == patch)
    trees = release_trees(dist, _registry.targets_of(patch)[0], since, patch.fixed_in)
    code = SWEEP % {"tests": str(REPO / "tests"), "trees": trees, "top": dist, "patch": patch.id, "check": check,
                    "kwargs": {"patch_id": patch.id}}
    ((out,),) = [engine_env.run(env, code, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})]
    return trees, out


def test_sglang_cross_attn_every_release_in_range_in_one_process():
    """sglang-cross-attn-decode-plan-lens on every final release from 0.5.1 to 0.5.9 (posts included): two
    decode wrappers built as a CUDA graph's, planned by the updater's own update_cross_attention at capture
    (FlashInfer's plan) and at replay (fast_decode_plan: SGLang's own to 0.5.2, then FlashInfer's), then
    forward_decode of the cross-attention layer; the replay plans the encoder wrapper from the decoder's CPU
    lengths as released, from the encoder's patched; the controls are bitwise equal."""
    from flashfix.tools.gpu_checks import XATTN_REQUESTS

    trees, out = sweep("sglang", "sglang-cross-attn-decode-plan-lens", "sglang_plan", "0.5.1", "sglang==0.5.17")
    assert len(trees) >= 24 and trees[-1][0] == "0.5.9", trees
    decoder, encoder = ([0, *itertools.accumulate(r[i] for r in XATTN_REQUESTS)] for i in (1, 0))
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("cross-attention decode")]
        calls = main and [c.split(" line")[0] for c in main[0]["calls_flashfix"]]
        if calls != ["decoder.begin_forward", "encoder.begin_forward"] + ["replay.fast_decode_plan"] * 2 + ["encoder.forward"]:
            problems.append("capture, replay and the cross-attention forward did not run: %s" % calls)
        planned = [e[2] for e in log if e[1] == "plan"][:4]  # the replay's (decoder, encoder) plans: released, patched
        if planned != [decoder, decoder, decoder, encoder]:
            problems.append("the replay planned from CPU lengths %s" % planned)
        if problems:
            bad[version] = problems
    assert not bad, bad


def test_vllm_fp8_kv_sharing_every_release_in_range_in_one_process():
    """vllm-fp8-kv-sharing-view on every final release from 0.20.0 to 0.21.0: FlashInferImpl.forward of a
    prefill on a layer that shares another layer's FP8 e4m3 cache (vLLM's uint8 storage) hands FlashInfer the
    uint8 cache as released (which FlashInfer's run rejects: the recording one too), an FP8 view patched, with the
    layer's scales; the controls are bitwise equal, and revert() gives the released error again."""
    trees, out = sweep("vllm", "vllm-fp8-kv-sharing-view", "vllm_forward", "0.20.0", "vllm==0.28.0")
    assert [v for v, _ in trees] == ["0.20.0", "0.20.1", "0.20.2", "0.21.0"], trees
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        main = [r for r in rows if "KV-sharing layer" in r["case"]]
        problems = row_problems([r for r in rows if r not in main])
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]] != [
                "built BatchPrefillWithPagedKVCacheWrapper", "prefill.run"] or main[0]["error_flashfix"] or \
                "dtype of k torch.uint8" not in (main[0]["error_pre_fix"] or ""):
            problems.append("the prefill did not run, or not as expected: %s" % main)
        runs = [(e[2][0].split()[-1], e[3]["k_scale"], e[3]["v_scale"]) for e in log if e[1] == "run"][:2]
        if runs != [("uint8", 0.05, 0.07), ("float8_e4m3fn", 0.05, 0.07)]:
            problems.append("the cache FlashInfer got (released, patched): %s" % runs)
        if problems:
            bad[version] = problems
    assert not bad, bad


def test_vllm_layer_heads_plan_every_release_in_range_in_one_process():
    """vllm-layer-heads-plan on every final release from 0.20.0 to 0.24.0: the builder's own __init__ (the
    patched function) and build plan a KV-cache group of 32-head layers in a 16-head model, and
    FlashInferImpl.forward runs the prefill on that plan; as released the plan is for the model-wide 16 query
    heads, patched for the group's 32; 0.22.x had the fix (fixed-upstream: not driven); the control (layers
    with the model's 16 heads) plans 16 either way, and revert() plans 16 again."""
    trees, out = sweep("vllm", "vllm-layer-heads-plan", "vllm_forward", "0.20.0", "vllm==0.28.0")
    assert [v for v, _ in trees] == ["0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0"], trees
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        if version.startswith("0.22."):
            if [r["case"] for r in rows] != ["not applied"] or "fixed-upstream" not in rows[0]["error"]:
                bad[version] = rows
            continue
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("group of 32-head layers")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]] != [
                "built BatchPrefillWithPagedKVCacheWrapper", "prefill.plan", "prefill.run"]:
            problems.append("the builder's plan and the prefill did not run: %s" % main)
        planned = [e[3].get("num_qo_heads") for e in log if e[1] == "plan"]
        if planned != [16, 32, 16, 16, 16]:  # the main case released, patched; the control both; after revert()
            problems.append("planned query heads: %s" % planned)
        if problems:
            bad[version] = problems
    assert not bad, bad


MERGE_TARGETS = ("sglang.srt.layers.attention.flashinfer_backend",) + (
    "sglang.srt.layers.attention.triton_ops.merge_state", "sglang.kernels.ops.attention.merge_state")


@pytest.mark.parametrize("patch,since,below", [("sglang-merge-state-launch-limit", "0.5.1", "0.5.13"),
                                               ("sglang-merge-state-fallback-lse-base", "0.5.13", "99")])
def test_sglang_merge_every_release_in_range_in_one_process(patch, since, below):
    """The two merge-state patches on every final release of their range (0.5.1-0.5.12.post1: the module's
    merge_state as flashfix rebinds it; from 0.5.13: _safe_merge_state as flashfix rewrites it), loaded from
    the wheel with the FlashInfer stand-in, whose merge_state merges past any limit (o1 + o2), and the Triton
    merge's math in torch: past the launch limit the patched merge differs from the released one (the
    fallback, given natural-log LSEs), below it the two are bitwise equal, and revert() restores it."""
    trees = release_trees("sglang", MERGE_TARGETS, since, below)
    assert len(trees) >= (29 if since == "0.5.1" else 13), trees
    out = sweep_check(trees, patch, "sglang_merge")
    bad = {}
    for version, _ in trees:
        rows = out[version]["rows"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("ragged+paged")]
        if not main or main[0]["bitwise_equal"] or main[0]["error_pre_fix"] or main[0]["error_flashfix"]:
            problems.append("past the limit the fix did not change the merge: %s" % main)
        if [r["case"] for r in rows if r.get("control")] != ["control: 64 query heads (within the limit)",
                                                              "revert() restores the original output"]:
            problems.append("controls: %s" % [r["case"] for r in rows])
        if problems:
            bad[version] = problems
    assert not bad, bad


MLA_CHUNK_TARGETS = ("sglang.srt.layers.attention.flashinfer_mla_backend",) + MERGE_TARGETS[1:]


def test_sglang_mla_chunk_every_release_in_one_process():
    """sglang-mla-chunked-prefix-lse-base on every final release from 0.5.1 (no release has the fix), loaded from
    the wheel with the FlashInfer stand-in (a causal and a non-causal pass give different outputs and LSEs) and the
    Triton merge's math in torch: FlashInferMhaChunkKVRunner.forward as patched gives merges that differ from the
    released one's, for one and for four prefix chunks; without an LSE (no merge) both are bitwise equal, and
    revert() restores the released output."""
    trees = release_trees("sglang", MLA_CHUNK_TARGETS, "0.5.1", "99")
    assert len(trees) >= 42, trees
    patch = "sglang-mla-chunked-prefix-lse-base"
    out = sweep_check(trees, patch, "sglang_mla_chunk")
    bad = {}
    for version, _ in trees:
        rows = out[version]["rows"]
        problems = row_problems(rows)
        merged = [r for r in rows if r["case"].startswith("cached prefix in")]
        if [r["case"] for r in merged] != ["cached prefix in 1 chunk(s) + new tokens, merged",
                                           "cached prefix in 4 chunk(s) + new tokens, merged"]:
            problems.append("cases: %s" % [r["case"] for r in rows])
        if any(r["bitwise_equal"] or r["error_pre_fix"] or r["error_flashfix"] for r in merged):
            problems.append("the fix did not change the merge: %s" % merged)
        if [r["case"] for r in rows if r.get("control")] != ["control: new tokens without LSE",
                                                              "revert() restores the original output"]:
            problems.append("controls: %s" % [r["case"] for r in rows])
        if problems:
            bad[version] = problems
    assert not bad, bad


def test_sglang_swa_layer_every_release_in_range_in_one_process():
    """sglang#26513 on every final release 0.5.1 to 0.5.12.post1: sglang-swa-ragged-prefix-extend-slots on 0.5.11
    on, its -0.5.10 form (with the custom-mask parameter it adds to call_begin_forward) before. The engine's
    update_sliding_window plans the sliding-window wrapper through call_begin_forward (the patch's or the release's)
    and forward_extend (patched: its series with the FP8-scale fix) runs the ragged + paged branch of a
    sliding-window layer. As released that wrapper's paged range is the window before each request's end, extend
    slots included, unmasked; patched, the prefix's last window with a custom mask (one row per new token, one
    column per cached key read)."""
    from packaging.version import Version

    from flashfix.sglang_patch import SWA_RAGGED_PREFIX_SLOTS as patch, SWA_RAGGED_PREFIX_SLOTS_OLD as old
    from flashfix.tools.gpu_checks import SWA_LAYER_REQUESTS, SWA_WINDOW

    trees = release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", patch.fixed_in)
    older = [(v, t) for v, t in trees if Version(v) < Version("0.5.11")]
    assert len(older) >= 20 and [v for v, _ in trees[len(older):]] == ["0.5.11", "0.5.12", "0.5.12.post1"], trees
    out = dict(sweep_check(older, old.id, "sglang_plan"), **sweep_check(trees[len(older):], patch.id, "sglang_plan"))
    released = sum(min(p + n, SWA_WINDOW + n) for p, n in SWA_LAYER_REQUESTS) + 256
    patched = sum(min(p, SWA_WINDOW) for p, _ in SWA_LAYER_REQUESTS) + 256
    mask = sum(min(p, SWA_WINDOW) * n for p, n in SWA_LAYER_REQUESTS)
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("ragged extend")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]][-2:] != [
                "ragged.forward_return_lse", "paged swa.forward_return_lse"]:
            problems.append("the ragged + paged branch of the sliding-window layer did not run: %s" % main)
        # the paged plans of the main case, released then patched: [swa, full] each; the sliding-window ones
        plans = [e for e in log if e[0] == "BatchPrefillWithPagedKVCacheWrapper" and e[1] == "begin_forward"][:4:2]
        sizes, masks = [e[2][2] for e in plans], [e[3].get("custom_mask") for e in plans]
        if sizes != ["tensor[%d] int32" % released, "tensor[%d] int32" % patched]:
            problems.append("sliding-window wrapper's kv_indices (released, patched): %s" % sizes)
        if masks != [None, "tensor[%d] bool" % mask]:
            problems.append("sliding-window wrapper's custom mask (released, patched): %s" % masks)
        if problems:
            bad[version] = problems
    assert not bad, bad


def test_sglang_swa_paged_window_every_release_in_range_in_one_process():
    """sglang-swa-paged-plan-window-left (sglang#31501) on every final release from 0.5.1 to 0.5.15.post1: the engine's
    update_sliding_window plans both wrappers through its call_begin_forward (the patch's, with the parameter it adds,
    or the release's) and forward_extend runs a sliding-window layer's paged-only extend. As released the
    sliding-window wrapper is planned without window_left; patched with the window, and the full-attention
    wrapper's plan and every plan of the ragged extend stay the release's calls."""
    from flashfix.sglang_patch import SWA_PAGED_PLAN_WINDOW as patch
    from flashfix.tools.gpu_checks import SWA_WINDOW

    trees = release_trees("sglang", "sglang.srt.layers.attention.flashinfer_backend", "0.5.1", patch.fixed_in)
    assert len(trees) >= 30 and trees[-1][0] == "0.5.15.post1", trees
    out = sweep_check(trees, patch.id, "sglang_plan")
    bad = {}
    for version, _ in trees:
        rows, log = out[version]["rows"], out[version]["log"]
        problems = row_problems(rows)
        main = [r for r in rows if r["case"].startswith("paged-only extend")]
        if not main or [c.split(" line")[0] for c in main[0]["calls_flashfix"]][-1:] != ["paged swa.forward"]:
            problems.append("the paged-only extend of the sliding-window layer did not run: %s" % main)
        # the paged plans of the main case, released then patched: [swa, full] each
        plans = [e[3].get("window_left") for e in log if e[0] == "BatchPrefillWithPagedKVCacheWrapper"
                 and e[1] == "begin_forward"][:4]
        if plans != [None, None, SWA_WINDOW, None]:
            problems.append("window_left planned (released swa, full; patched swa, full): %s" % plans)
        if problems:
            bad[version] = problems
    assert not bad, bad
