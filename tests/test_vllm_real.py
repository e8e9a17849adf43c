"""vllm-sink-prefill against real vLLM releases from PyPI (no GPU needed, nothing skipped).

Every engine import runs in a fresh process of that release's environment (tests/engine_env.py);
``import vllm.v1.attention.backends.flashinfer`` takes about 25 s on CPU, so each process checks
as much as it can and reports through ``FLASHFIX_RESULT=`` lines.

* 0.27.1 (not affected), 0.28.0, 0.29.0, 0.30.0 and 0.33.0 (fixed upstream): doctor verdict with
  vLLM not imported, runtime state after the import, engine functions untouched.
* The pre-fix shape (a main-branch build between PRs #49718 and #52148, or a fork of a later
  release without #52148) is derived at test time from each of 0.28.0, 0.29.0, 0.30.0 and 0.33.0
  by removing what #52148 added (tests/vllm_prefix_shape.py), written to a temporary file and
  imported under the real module name, one process per release. flashfix patches it; with
  FlashInfer's wrapper classes replaced by recorders and the GPU capability faked, its prefill
  factory and forward call are compared argument by argument with the unmodified release across
  GPUs (SM90, SM100, SM120, SM121), sinks, causality, KV dtypes, scales and two layers.
* Without an engine process: the edits against each release's own code, and the shapes refused.
* Atomicity: when forward cannot be rewritten, nothing of the patch is applied.
"""

import ast
import copy
import json
import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

import engine_env  # noqa: E402
import this_checkout  # noqa: E402
import vllm_prefix_shape  # noqa: E402

this_checkout.flashfix()
from flashfix import vllm_patch
from flashfix.core import locate as _locate, paths as _paths
from flashfix.core import registry as _registry
from flashfix.core import source as _source  # noqa: E402

PATCH = vllm_patch.PATCHES[0]
# The sink patch's checks see that patch alone: the engine's other vLLM patches (the catalogue's, tested
# in tests/test_vllm_catalogue.py) would change the same module's functions and globals.
ALONE = {"FLASHFIX_DISABLE": ",".join(p.id for p in vllm_patch.PATCHES[1:])}
TARGET = vllm_patch.TARGET
FORWARD = "FlashInferImpl.forward"


def edit_all(tree, mark):
    """The declaration's own edits, in place, of every hunk's function in ``tree`` (a pre-fix
    shape); returns {qualname: edited def}."""
    shape, located, given = PATCH.rule.shape(lambda module: tree)
    assert shape.kind == _registry.BUGGY, shape
    edited = {}
    for rule, _, qualname, _ in located:
        edited[qualname] = _source.find_def(tree, qualname)
        rule.edit(edited[qualname], mark, given=given)
    return edited


def sink_runs(forward):
    return [c for c in ast.walk(forward) if isinstance(c, ast.Call) and ast.unparse(c.func) == "prefill_wrapper.run"
            and "sinks" in _source.keywords(c)]
# Releases that carry vLLM PR #52148, each with the GPUs (capability as an int) on which it builds the
# sink wrapper for prefill; the pre-fix shape is derived from each and patched.
SINK_GPUS = {"0.28.0": (120, 121), "0.29.0": (120, 121), "0.30.0": (90, 120, 121), "0.33.0": (90, 120, 121)}

HEADER = r"""
import importlib, json, os, sys, tempfile
sys.path.insert(0, %r)
def report(value):
    print("FLASHFIX_RESULT=" + json.dumps(value, default=str), flush=True)
""" % str(TESTS)


def installed_file(requirement):
    return str(engine_env.installed_path(requirement, "vllm/v1/attention/backends/flashinfer.py"))


def release_env(requirement):
    """The release's environment, read as ``doctor --path`` reads it: the probe finds there the
    FlashInfer class that the new code takes from ``flashinfer`` (``needs``)."""
    return _locate.reading(_paths.PathReader([Path(installed_file(requirement)).parents[4]]))


# --- releases: doctor and runtime -------------------------------------------------------------

RELEASE_SCRIPT = HEADER + r"""
import flashfix
from flashfix import vllm_patch, when_imported
from flashfix.core import registry as _registry
from flashfix.core import source as _source
patch = vllm_patch.PATCHES[0]
TARGET = vllm_patch.TARGET
version = _registry.engine_version("vllm")
verdict = _registry.judge(patch, {t: _source.module_ast(t) for t in _registry.targets_of(patch)}, version)
imported = sorted(m for m in ("vllm", "torch", "flashinfer") if m in sys.modules)

originals = {}
def capture(module):  # runs before flashfix's own hook for this module
    originals["factory"] = module.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"]
    originals["forward"] = module.FlashInferImpl.__dict__["forward"]
    originals["code"] = originals["forward"].__code__
    originals["globals"] = set(vars(module))
when_imported(TARGET, capture)

mod = importlib.import_module(TARGET)
row = next(r for r in flashfix.status() if r["id"] == patch.id)
factory = mod.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"]
forward = mod.FlashInferImpl.__dict__["forward"]
report({
    "version": version, "verdict": verdict, "imported_before": imported,
    "state": row["state"], "reason": row["reason"], "ran": row["ran"],
    "factory_same": factory is originals["factory"],
    "forward_same": forward is originals["forward"],
    "code_same": forward.__code__ is originals["code"],
    "code_from_disk": _source.code_difference(_source.rewrite(forward, lambda node: None)[1], forward.__code__) is None,
    "globals_same": set(vars(mod)) == originals["globals"],
    "changes": len(_registry._records[patch.id]["changes"]),
})
"""


@pytest.mark.parametrize("requirement, verdict", [
    ("vllm==0.27.1", "not-affected"),
    ("vllm==0.28.0", "fixed-upstream"),
    ("vllm==0.29.0", "fixed-upstream"),
    ("vllm==0.30.0", "fixed-upstream"),
    ("vllm==0.33.0", "fixed-upstream"),
])
def test_release_doctor_and_runtime(requirement, verdict):
    (result,) = engine_env.run(requirement, RELEASE_SCRIPT, env=ALONE)
    assert result["version"] == requirement.split("==")[1]
    assert result["verdict"][0] == verdict, result
    assert result["imported_before"] == [], "the doctor judgement imported %s" % result["imported_before"]
    assert result["state"] == verdict, result
    assert result["ran"] is False
    for key in ("factory_same", "forward_same", "code_same", "code_from_disk", "globals_same"):
        assert result[key] is True, (key, result)
    assert result["changes"] == 0


# --- the pre-fix shapes, derived from each fixed release (AST only, no engine process) -------


def _sink_dispatch(forward):
    (node,) = [n for n in ast.walk(forward) if isinstance(n, ast.If)
               and ast.unparse(n.test) == "isinstance(prefill_wrapper, %s)" % vllm_patch.SINK_WRAPPER]
    return node


def _factory_branches(factory):
    """(sink-branch conditions, sink constructions, generic constructions) of a factory, as text."""
    conditions, sinks, generics = [], [], []
    for node in ast.walk(factory):
        if isinstance(node, ast.If) and _source.name_calls(node.body[-1], vllm_patch.SINK_WRAPPER):
            conditions.append(ast.unparse(node.test))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            if node.value.func.id == vllm_patch.SINK_WRAPPER:
                sinks.append(ast.unparse(node))
            elif node.value.func.id == vllm_patch.GENERIC_WRAPPER:
                generics.append(ast.unparse(node))
    return conditions, sinks, generics


@pytest.mark.parametrize("release", list(SINK_GPUS))
def test_prefix_derivation_and_edits_match_release(release):
    fixed_source = Path(installed_file("vllm==" + release)).read_text()
    prefix_source = vllm_prefix_shape.derive_prefix_source(fixed_source)
    prefix, fixed = ast.parse(prefix_source), ast.parse(fixed_source)
    with release_env("vllm==" + release):
        _judged_and_edited_as_the_release(release, prefix, fixed, fixed_source)


def _judged_and_edited_as_the_release(release, prefix, fixed, fixed_source):
    # the doctor: the release fixed, the derived shape patchable (also as a dev build), old versions refused
    assert _registry.judge(PATCH, {TARGET: fixed}, release)[0] == "fixed-upstream"
    for version in (release, "0.27.2.dev41+g0123abc", release + ".dev7", None):
        assert _registry.judge(PATCH, {TARGET: prefix}, version)[0] == "patch", version
    assert _registry.judge(PATCH, {TARGET: prefix}, "0.26.1")[0] == "unknown-shape"

    # the pre-fix factory never names the sink wrapper; forward passes sinks= to the generic run
    factory = _source.find_def(prefix, vllm_patch.FACTORY)
    assert vllm_patch.SINK_WRAPPER not in ast.unparse(factory)
    (call,) = sink_runs(_source.find_def(prefix, FORWARD))
    assert ast.unparse(_source.keywords(call)["sinks"]) == "self.sinks"

    # the GPUs flashfix reads off the release's supports_sink are those of the release's own sink branches
    gpus = vllm_patch.sink_gpu_test(_source.find_def(prefix, vllm_patch.SUPPORTS_SINK))
    upstream_tests = vllm_prefix_shape.sink_branch_gpu_tests(fixed_source)
    assert upstream_tests == [ast.unparse(gpus)] * 2, (upstream_tests, ast.unparse(gpus))

    # the edited factory: the release's sink branches (same conditions, same constructions with the
    # release's own workspace and layout expressions, same slots), the generic constructions kept
    mark = ast.Expr(ast.Constant("flashfix-mark"))
    edited = edit_all(prefix, mark)
    factory, forward = edited[vllm_patch.FACTORY], edited[FORWARD]
    ours, theirs = _factory_branches(factory), _factory_branches(_source.find_def(fixed, vllm_patch.FACTORY))
    assert ours == theirs and len(ours[1]) == 2 and len(ours[2]) == 2, (ours, theirs)

    # the edited forward is, statement for statement, the release's forward (marker aside), except
    # that the sink run folds the generic call's q_scale expression into the softmax scale: the same
    # expression up to 0.30.0; on 0.33.0 `1.0 if self.nvfp4_fa2 else layer._q_scale_float`, whose
    # value is the release's `layer._q_scale_float` whenever the sink wrapper exists (never with NVFP4)
    _sink_dispatch(forward).body[:] = [s for s in _sink_dispatch(forward).body if ast.unparse(s) != ast.unparse(mark)]
    release_forward = _source.find_def(fixed, FORWARD)
    dispatch = _sink_dispatch(release_forward)
    sink_scale = dispatch.body[-1].value.args[3]
    assert ast.unparse(sink_scale.left.right) == "layer._q_scale_float"
    sink_scale.left.right = copy.deepcopy(_source.keywords(dispatch.orelse[0].value)["q_scale"])
    assert ast.unparse(forward) == ast.unparse(release_forward)


def test_shapes_refused_with_a_reason():
    """Code that flashfix cannot read with certainty is refused, saying why (AST only)."""
    with release_env("vllm==0.30.0"):
        _refused_with_a_reason()


def _refused_with_a_reason():
    base = Path(installed_file("vllm==0.30.0")).read_text()
    prefix = vllm_prefix_shape.derive_prefix_source(base)

    def judge(old, new):
        assert old in prefix, old
        return _registry.judge(PATCH, {TARGET: ast.parse(prefix.replace(old, new, 1))}, "0.30.0")

    def judge_supports_sink(edit):
        tree = ast.parse(prefix)
        body = _source.find_def(tree, vllm_patch.SUPPORTS_SINK).body
        gate = next(i for i, stmt in enumerate(body) if isinstance(stmt, ast.If)
                    and ast.unparse(stmt.body[0]) == "return supports_trtllm_attention(is_prefill=False)")
        edit(body, gate)
        return _registry.judge(PATCH, {TARGET: tree}, "0.30.0")

    def expr(text):
        return ast.parse(text, mode="eval").body

    def gate_test(text):
        return lambda body, gate: setattr(body[gate], "test", expr(text))

    def decode_only_return(body, gate):  # no SM100 gate: the final return admits every other GPU
        body[-2:] = ast.parse("return supports_trtllm_attention(is_prefill=False)").body

    for edit, reason in [
        (gate_test("envs.VLLM_USE_SINKS"), "not a device-capability test"),
        (gate_test("current_platform.is_device_capability_family(arch)"), "not a device-capability test"),
        (lambda body, gate: body.insert(gate, ast.parse("from vllm.platforms import current_platform").body[0]),
         "not a device-capability test"),
        (lambda body, gate: body.insert(gate, ast.parse("for _ in ():\n    pass").body[0]),
         "statement flashfix does not read"),
        (decode_only_return, "no capability test names"),
    ]:
        verdict, why = judge_supports_sink(edit)
        assert verdict == "unknown-shape" and reason in why, (verdict, why)
    # supports_sink without the decode-only gate (0.27.1's shape): sinks never reach the generic prefill
    verdict, why = judge_supports_sink(lambda body, gate: body.pop(gate))
    assert verdict == "not-affected" and "only where prefill runs trtllm-gen" in why, why
    # two decode-only gates: either admits
    verdict, why = judge_supports_sink(lambda body, gate: body.insert(gate, ast.parse(
        "if current_platform.is_device_capability(89):\n    return supports_trtllm_attention(is_prefill=False)").body[0]))
    assert verdict == "patch" and ("`current_platform.is_device_capability(89) or (current_platform.is_device_capability(90)"
                                   " or current_platform.is_device_capability_family(120))`") in why, why

    # every construction of the generic wrapper must be the pre-fix one (no slot left half-fixed);
    # workspace and layout passed by keyword are not upstream's shape either
    generic = "self._noncausal_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper("
    for new in ["wrapper = BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(), ",
                "self._other_wrapper = BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(), ",
                generic + "self._get_workspace_buffer(), use_cuda_graph=True, kv_layout=",
                generic + "float_workspace_buffer=self._get_workspace_buffer(), kv_layout="]:
        verdict, why = judge(generic + "self._get_workspace_buffer(), ", new)
        assert verdict == "unknown-shape" and "is not of the form `$SELF.$SLOT = BatchPrefill" in why, (new, verdict, why)

    # forward shapes the edit must refuse
    for bad in ("prefill_wrapper.run(q, kv, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s, extra=1)",
                "prefill_wrapper.run(q, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s)",
                "prefill_wrapper.run(q, kv, *more, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s)",
                "x = prefill_wrapper.run(q, kv, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s)",
                "prefill_wrapper.run(q, kv, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s)\n"
                "    prefill_wrapper.run(q, kv, q_scale=a, k_scale=b, v_scale=c, out=o, sinks=s)"):
        node = ast.parse("def forward(self):\n    %s\n" % bad).body[0]
        with pytest.raises(_source.ShapeError):
            PATCH.rule.hunks[1].edit(node, ast.Pass(), given={})


# --- the pre-fix shapes, imported and patched: differential against each fixed release -------

PREFIX_SCRIPT = HEADER + r"""
import flashfix
from flashfix import vllm_patch, when_imported
from flashfix.core import registry as _registry
from flashfix.core import source as _source
import vllm_prefix_shape as h

patch = vllm_patch.PATCHES[0]
TARGET, SINK = vllm_patch.TARGET, vllm_patch.SINK_WRAPPER
FACTORY_SITE, FORWARD_SITE = patch.id + ":" + vllm_patch.FACTORY, patch.id + ":FlashInferImpl.forward"
fixed_path = _source.module_file(TARGET)
prefix_path = h.install_prefix_module(tempfile.mkdtemp(), fixed_path)
version = _registry.engine_version("vllm")
res = {"version": version, "flashfix": flashfix.__file__,
       "doctor": _registry.judge(patch, {TARGET: _source.parse_file(prefix_path)}, version),
       "doctor_release": _registry.judge(patch, {TARGET: _source.parse_file(fixed_path)}, version)}
res["imported_before"] = sorted(m for m in ("vllm", "torch", "flashinfer") if m in sys.modules)

originals = {}
def capture(module):  # runs before flashfix's own hook for this module
    originals["factory"] = module.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"]
    originals["factory_code"] = originals["factory"].__code__
    originals["forward"] = module.FlashInferImpl.__dict__["forward"]
    originals["code"] = originals["forward"].__code__
    originals["sink_global"] = hasattr(module, SINK)
when_imported(TARGET, capture)

mod = importlib.import_module(TARGET)
res["loaded_prefix"] = mod.__file__ == prefix_path and not originals["sink_global"]
row = next(r for r in flashfix.status() if r["id"] == patch.id)
res["state"], res["reason"], res["ran_at_import"] = row["state"], row["reason"], row["ran"]
sites = {FACTORY_SITE: mod.FlashInferMetadataBuilder, FORWARD_SITE: mod.FlashInferImpl}
def marked():
    return {site: _registry._sites[site].func.__code__ is _registry._sites[site].marked for site in sites
            if site in _registry._sites}
res["same_objects"] = [mod.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"] is originals["factory"],
                       mod.FlashInferImpl.__dict__["forward"] is originals["forward"]]
res["marked_at_import"] = marked()
res["changes"] = [repr(c) for c in _registry._records[patch.id]["changes"]]

import torch
layout = h.nhd_layout(mod)
upstream = h.load_copy(fixed_path, "_flashfix_test_upstream_flashinfer")
platform = mod.current_platform
assert upstream.current_platform is platform
platform_cls = type(platform)
had_cap = "get_device_capability" in platform_cls.__dict__
saved = {m: {n: getattr(m, n) for n in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDCPPrefillWrapper", SINK)
             if hasattr(m, n)} for m in (mod, upstream)}

T, H, KVH, D = 5, 8, 2, 64
torch.manual_seed(0)
workspace = torch.zeros(64, dtype=torch.uint8)
query = torch.randn(T, H, D, dtype=torch.bfloat16)
key = torch.randn(T, KVH, D, dtype=torch.bfloat16)
value = torch.randn(T, KVH, D, dtype=torch.bfloat16)
output = torch.zeros(T, H, D, dtype=torch.bfloat16)
def cache(dtype):
    return h.stand_in_cache(mod, layout, num_blocks=4, block_size=16, num_kv_heads=KVH, head_size=D, dtype=dtype)
caches = {"bf16": (cache(torch.bfloat16), "auto", torch.bfloat16),
          "fp8": (cache(torch.uint8), "fp8", torch.float8_e4m3fn)}
layers = [(h.stand_in_layer(0.5, 0.25, 0.125), torch.randn(H, dtype=torch.float32)),
          (h.stand_in_layer(2.0, 0.75, 1.5), torch.randn(H, dtype=torch.float32))]

def scenario(module, cap, has_sinks, causal, kv, install_sink=True):
    log = []
    generic, sink, dcp = h.make_recorders(log)
    module.BatchPrefillWithPagedKVCacheWrapper = generic
    module.BatchDCPPrefillWrapper = dcp
    if install_sink:
        module.BatchAttentionWithAttentionSinkWrapper = sink
    h.fake_capability(platform, cap)
    kv_cache, impl_dtype, builder_dtype = caches[kv]
    window = 127 if kv == "fp8" else -1  # a sliding window on the FP8 cases
    builder = h.stand_in_builder(module.FlashInferMetadataBuilder, has_sinks=has_sinks, kv_dtype=builder_dtype,
                                 q_dtype=torch.bfloat16, workspace=workspace, window_left=window, layout=layout)
    wrapper = builder._get_prefill_wrapper(causal=causal)
    log.append(["cached", builder._get_prefill_wrapper(causal) is wrapper])
    for layer, sinks in layers:  # two layers, one builder, one shared wrapper
        impl = h.stand_in_impl(module.FlashInferImpl, sinks=sinks if has_sinks else None, kv_cache_dtype=impl_dtype,
                               num_heads=H, num_kv_heads=KVH, head_size=D, window_left=window, layout=layout)
        wrapper._sm_scale, wrapper._causal, wrapper._window_left = impl.scale, causal, impl.window_left
        meta = h.stand_in_metadata(module, wrapper, num_tokens=T, causal=causal, q_dtype=torch.bfloat16,
                                   layout=layout)
        module.FlashInferImpl.forward(impl, layer, query, key, value, kv_cache, meta, output)
    return log

cases = [(cap, s, c, kv) for cap in (100, 90, 120, 121) for s in (True, False) for c in (True, False)
         for kv in ("bf16", "fp8")]
res["cases"], res["mismatch"], res["ran_order"], res["marked_order"] = len(cases), [], [], []
sink_calls = []
for case in cases:
    ours, theirs = scenario(mod, *case), scenario(upstream, *case)
    if ours != theirs:
        res["mismatch"].append({"case": case, "flashfix": ours, "upstream": theirs})
    kinds = sorted({entry[1] for entry in ours if entry[0] == "ctor"})
    res["ran_order"].append([case, kinds, next(r for r in flashfix.status() if r["id"] == patch.id)["ran"]])
    res["marked_order"].append([case, marked()])
    if kinds == ["sink"]:
        sink_calls.append([e for e in ours if e[0] == "run"])
        res.setdefault("sink_examples", {})[repr(case)] = ours
    elif case == (100, True, True, "fp8"):
        res["generic_example"] = ours
res["sinks_per_layer"] = [[call[2][1][2][-1] for call in calls] for calls in sink_calls]
res["sinks_ptrs"] = [sinks.data_ptr() for _, sinks in layers]
res["sink_scale_args"] = [[call[2][1][3] for call in calls] for calls in sink_calls][:1]

# NVFP4 KV cache with sinks on a sink-branch GPU: refused clearly (causal), the release's own error (non-causal)
h.fake_capability(platform, 121)
res["nvfp4"] = []
for causal in (True, False):
    for module in (mod, upstream):
        builder = h.stand_in_builder(module.FlashInferMetadataBuilder, has_sinks=True, kv_dtype=torch.uint8,
                                     q_dtype=torch.bfloat16, workspace=workspace, layout=layout)
        builder.is_kvcache_nvfp4 = True
        try:
            builder._get_prefill_wrapper(causal)
            res["nvfp4"].append([causal, module is mod, "built", ""])
        except (NotImplementedError, AssertionError) as exc:
            res["nvfp4"].append([causal, module is mod, type(exc).__name__, str(exc)])

# put the real classes back, then revert
for m, names in saved.items():
    for n, v in names.items():
        setattr(m, n, v)
flashfix.revert()
res["after_revert"] = {
    "factory": mod.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"] is originals["factory"],
    "factory_code": originals["factory"].__code__ is originals["factory_code"],
    "forward": mod.FlashInferImpl.__dict__["forward"] is originals["forward"],
    "code": mod.FlashInferImpl.forward.__code__ is originals["code"],
    "sink_global_gone": not hasattr(mod, SINK),
    "sites_gone": sorted(s for s in _registry._sites if s.startswith(patch.id)) == [],
    "state": next(r for r in flashfix.status() if r["id"] == patch.id)["state"],
}
# the unpatched pre-fix module: generic wrapper always, sinks handed to its run (the bug)
bug = []
for case in cases:
    log = scenario(mod, *case, install_sink=False)
    runs = [e for e in log if e[0] == "run"]
    bug.append([case, sorted({e[1] for e in log if e[0] == "ctor"}), [e[3].get("sinks", "absent") for e in runs]])
res["prefix_unpatched"] = bug
for m, names in saved.items():
    for n, v in names.items():
        setattr(m, n, v)
if not had_cap:
    del platform_cls.get_device_capability
report(res)
"""

@pytest.mark.parametrize("release", list(SINK_GPUS))
def test_prefix_shape_patched_matches_release(release):
    (res,) = engine_env.run("vllm==" + release, PREFIX_SCRIPT, env=ALONE)
    assert res["version"] == release
    assert Path(res["flashfix"]).resolve().parents[1] == TESTS.parent, res["flashfix"]
    # doctor (vLLM not imported): the release fixed upstream, the derived pre-fix module patchable
    assert res["doctor_release"][0] == "fixed-upstream", res["doctor_release"]
    assert res["doctor"][0] == "patch", res["doctor"]
    assert res["imported_before"] == []
    # runtime: the derived module under the real name, patched in place (same function objects)
    assert res["loaded_prefix"] is True
    assert res["state"] == "applied" and res["ran_at_import"] is False, (res["state"], res["reason"])
    assert res["same_objects"] == [True, True]
    assert res["marked_at_import"] == {vllm_patch.PATCH_ID + ":" + vllm_patch.FACTORY: True,
                                       vllm_patch.PATCH_ID + ":" + FORWARD: True}
    assert len(res["changes"]) == 3

    # differential: every case gives the same constructors and the same run calls as the release
    assert res["cases"] == 32
    assert res["mismatch"] == [], json.dumps(res["mismatch"][:2], indent=1)[:6000]
    for case, kinds, _ in res["ran_order"]:
        cap, sinks = case[0], case[1]
        assert kinds == (["sink"] if sinks and cap in SINK_GPUS[release] else ["generic"]), (case, kinds)
    # each layer's own sinks reach its call, with its own q*k scale folded into the softmax scale
    assert len(res["sinks_per_layer"]) == 4 * len(SINK_GPUS[release])
    for ptrs in res["sinks_per_layer"]:
        assert ptrs == res["sinks_ptrs"]
    scale = 64 ** -0.5
    assert res["sink_scale_args"][0] == pytest.approx([scale * 0.5 * 0.25, scale * 2.0 * 0.75])
    example = res["sink_examples"]["(121, True, False, 'fp8')"]
    assert example[0][:2] == ["ctor", "sink"] and example[0][2][1][1] == "NHD"
    assert example[0][3] == {"backend": "auto", "head_dim_qk": 64, "head_dim_vo": 64,
                             "kv_data_type": ["dtype", "torch.float8_e4m3fn"],
                             "q_data_type": ["dtype", "torch.bfloat16"], "window_left": 127}
    assert [sorted(e[3]) for e in example[2:]] == [["out", "v_scale"]] * 2  # no q/k scale, no sinks keyword
    assert [e[3]["v_scale"] for e in example[2:]] == [0.125, 1.5]
    generic = res["generic_example"]  # SM100 with sinks: the generic wrapper, run without the sinks keyword
    assert generic[0][:2] == ["ctor", "generic"] and "sinks" not in generic[2][3]

    # `ran` and the markers: false/marked until the first sink-branch case, then true/plain
    first = next(i for i, (case, kinds, _) in enumerate(res["ran_order"]) if kinds == ["sink"])
    assert first > 0
    assert [ran for _, _, ran in res["ran_order"]] == [False] * first + [True] * (len(res["ran_order"]) - first)
    for site in res["marked_at_import"]:
        assert [m[site] for _, m in res["marked_order"]] == [True] * first + [False] * (len(res["marked_order"]) - first)

    # NVFP4 + sinks: the release asserts (causal); flashfix says why; non-causal both refuse alike
    nvfp4 = {(causal, ours): (kind, text) for causal, ours, kind, text in res["nvfp4"]}
    assert nvfp4[(True, False)][0] == "AssertionError"
    assert nvfp4[(True, True)][0] == "NotImplementedError" and "NVFP4" in nvfp4[(True, True)][1]
    assert nvfp4[(False, True)] == nvfp4[(False, False)] and nvfp4[(False, True)][0] == "NotImplementedError"

    # revert restores the very objects and code
    assert res["after_revert"] == {"factory": True, "factory_code": True, "forward": True, "code": True,
                                   "sink_global_gone": True, "sites_gone": True, "state": "disabled"}

    # the derived pre-fix module is the bug: never the sink wrapper, sinks passed to the generic run
    for case, kinds, sinks_kw in res["prefix_unpatched"]:
        assert kinds == ["generic"], case
        assert len(sinks_kw) == 2
        if case[1]:
            assert [s[-1] for s in sinks_kw] == res["sinks_ptrs"], case
        else:
            assert sinks_kw == [None, None], case


# --- atomicity ------------------------------------------------------------------------------

ATOMIC_SCRIPT = HEADER + r"""
import flashfix
from flashfix import vllm_patch, when_imported
from flashfix.core import registry as _registry
from flashfix.core import source as _source
import vllm_prefix_shape as h
patch = vllm_patch.PATCHES[0]
TARGET, SINK = vllm_patch.TARGET, vllm_patch.SINK_WRAPPER
prefix_path = h.install_prefix_module(tempfile.mkdtemp(), _source.module_file(TARGET),
                                      alter_loaded=h.forward_with_extra_statement)
originals = {}
def capture(module):
    originals["factory"] = module.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"]
    originals["code"] = module.FlashInferImpl.forward.__code__
when_imported(TARGET, capture)
mod = importlib.import_module(TARGET)
row = next(r for r in flashfix.status() if r["id"] == patch.id)
report({
    "doctor": _registry.judge(patch, {TARGET: _source.parse_file(prefix_path)}, _registry.engine_version("vllm")),
    "state": row["state"], "reason": row["reason"],
    "factory_same": mod.FlashInferMetadataBuilder.__dict__["_get_prefill_wrapper"] is originals["factory"],
    "code_same": mod.FlashInferImpl.forward.__code__ is originals["code"],
    "sink_global": hasattr(mod, SINK),
    "sites": sorted(_registry._sites), "changes": len(_registry._records[patch.id]["changes"]),
})
"""


def test_atomic_when_forward_cannot_be_rewritten():
    (res,) = engine_env.run("vllm==0.28.0", ATOMIC_SCRIPT, env=ALONE)
    assert res["doctor"][0] == "patch"  # the file on disk is the pre-fix shape ...
    assert res["state"] == "unknown-shape", res  # ... but the loaded forward is not that file
    assert "differs from the loaded code" in res["reason"]
    assert res["factory_same"] and res["code_same"]
    assert res["sink_global"] is False
    assert res["sites"] == [] and res["changes"] == 0
