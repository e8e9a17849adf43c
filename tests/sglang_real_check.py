"""Runs inside one real SGLang environment (tests/engine_env.py), in one process, and reports
with ``FLASHFIX_RESULT=<json>`` lines; tests/test_sglang_real.py makes the assertions.

Order: the doctor's judgement first (nothing of the engine imported), then the engine's real
modules are imported (flashfix's hooks apply the patches), SGLang's own functions are
exercised with the patches in place, ``flashfix.revert()`` puts the original code back, and
the same exercises run again: the "without flashfix" column.
"""

import copy
import json
import os
import sys
import tempfile
from importlib.metadata import version
from types import SimpleNamespace

import flashfix
from flashfix.core import matcher as _matcher
from flashfix.core import registry as _registry
from flashfix.core import source as _source


def report(key, value):
    print("FLASHFIX_RESULT=" + json.dumps({key: value}), flush=True)


VERSION = version("sglang")
patches = [p for p in _registry.load_all() if p.engine == "sglang"]
_series = {}  # in registration order, each judged on the code of the patches before it in a series (as the doctor)
report("doctor", {
    "verdicts": {p.id: list(_registry.judge(p, {t: _source.module_ast(t) for t in _registry.targets_of(p)}, VERSION,
                                            series=_series)) for p in patches},
    "heavy": sorted(m for m in ("sglang", "torch", "flashinfer", "transformers") if m in sys.modules),
})

import torch  # noqa: E402

import sglang.srt.configs.model_config as model_config  # noqa: E402
import sglang.srt.layers.attention.flashinfer_backend as flashinfer_backend  # noqa: E402
import sglang.srt.layers.attention.flashinfer_mla_backend as flashinfer_mla_backend  # noqa: E402
import sglang.srt.layers.attention.triton_backend  # noqa: E402,F401  (sglang-triton-per-layer-heads-buffers)
import sglang.srt.model_executor.model_runner  # noqa: E402,F401
try:  # the MoE clamp fix's target (sglang-trtllm-fp8-moe-swiglu-limit): decided here like the others
    import sglang.srt.layers.quantization.fp8 as quant_fp8  # noqa: E402
except ImportError:
    quant_fp8 = None
from flashfix import semantic, sglang_patch  # noqa: E402

status = {row["id"]: row for row in flashfix.status() if row["engine"] == "sglang"}
report("status", {k: {"state": v["state"], "reason": v["reason"], "ran": v["ran"]} for k, v in status.items()})


def untouched(func):
    """The function runs exactly the code of its source file (recompiling it gives the same code)."""
    try:
        _source.rewrite(func, lambda node: None)
        return True
    except _source.ShapeError:
        return False


def plain(owner, name, module):
    return semantic.function_at(module, name if owner is module else "%s.%s" % (owner.__qualname__, name))


# --- the functions the patches are about ---------------------------------------------------
functions = {
    sglang_patch.FP8_ID: plain(flashinfer_backend.FlashInferAttnBackend, "forward_extend", flashinfer_backend),
    sglang_patch.VISION_ID: plain(model_config.ModelConfig, "__init__", model_config),
    sglang_patch.DRAFT_GRAPH_ID: plain(flashinfer_backend.FlashInferMultiStepDraftBackend, "init_cuda_graph_state",
                                       flashinfer_backend),
    sglang_patch.MLA_DRAFT_GRAPH_ID: plain(flashinfer_mla_backend.FlashInferMLAMultiStepDraftBackend,
                                           "init_cuda_graph_state", flashinfer_mla_backend),
    sglang_patch.PLAN_HEADS_ID: plain(flashinfer_backend.FlashInferIndicesUpdaterPrefill, "__init__",
                                      flashinfer_backend),
    sglang_patch.SWA_FULL_RAGGED_ID: plain(flashinfer_backend.FlashInferIndicesUpdaterPrefill, "update_sliding_window",
                                           flashinfer_backend),
}
defs = sglang_patch.SM120_FP8_AUTOTUNE.rule.locate(_source.module_ast)
site_module, site_name, _ = defs[0] if len(defs) == 1 else (None, None, None)
if site_module is not None:
    owner = sys.modules[site_module]
    *outer, last = site_name.split(".")
    for part in outer:
        owner = getattr(owner, part)
    functions[sglang_patch.AUTOTUNE_ID] = plain(owner, last, sys.modules[site_module])
codes = {k: f.__code__ for k, f in functions.items()}
report("functions", {
    "autotune_site": [site_module, site_name],
    "untouched": {k: untouched(f) for k, f in functions.items()},
    "runner_modules_loaded": sorted(m for m in sys.modules if m.startswith("sglang.srt.model_executor.runner.")),
})
copies = {}
if site_name == "should_run_flashinfer_autotune":
    import sglang.srt.model_executor.runner.base_runner as base_runner

    copies["base_runner"] = base_runner.should_run_flashinfer_autotune is functions[sglang_patch.AUTOTUNE_ID]
report("copies", copies)


# --- exercise 1: ModelConfig from local config.json files, offline -------------------------
TEXT = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}
CONFIGS = {
    "llama_vision_null": dict(TEXT, vision_config=None),
    "llama_plain": dict(TEXT),
    "llava": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "bfloat16",
        "image_token_index": 999, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": dict(TEXT, architectures=None),
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14,
                          "projection_dim": 32},
    },
}
config_dirs = {}
for name, content in CONFIGS.items():
    config_dirs[name] = tempfile.mkdtemp(prefix="ffx-%s-" % name)
    with open(os.path.join(config_dirs[name], "config.json"), "w") as handle:
        json.dump(content, handle)


def vision_exercise():
    out = {}
    for name, path in config_dirs.items():
        try:
            config = model_config.ModelConfig(path)
        except Exception as exc:  # reported; the test decides
            out[name] = {"error": repr(exc)[:400]}
            continue
        out[name] = {
            "image": bool(config.is_image_understandable_model),
            "has_attr": hasattr(config.hf_config, "vision_config"),
            "tower": getattr(config.hf_config, "vision_config", None) is not None,
        }
    return out


# --- exercise 2: the autotune decision table --------------------------------------------------
from sglang.srt.utils import common as sglang_common  # noqa: E402

real_cuda = (torch.cuda.is_available, torch.cuda.get_device_capability, torch.version.cuda)


def clear_helper_caches():
    for name in dir(sglang_common):
        helper = getattr(sglang_common, name)
        if name.startswith("is_") and hasattr(helper, "cache_clear"):
            helper.cache_clear()


def fake_capability(capability):
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: capability
    if not torch.version.cuda:
        torch.version.cuda = "12.9"
    clear_helper_caches()


def real_capability():
    torch.cuda.is_available, torch.cuda.get_device_capability, torch.version.cuda = real_cuda
    clear_helper_caches()


AUTOTUNE_PATCHED = status[sglang_patch.AUTOTUNE_ID]["state"] == "applied"
CAPS = [(12, 0), (10, 0), (9, 0), (8, 9)]
QUANTS = ["modelopt_fp8", "modelopt", None, "fp8"]
SPEC = {  # mode -> (is_speculative, is_draft_worker, for_speculative_draft)
    "none": (False, False, False),
    "target": (True, False, False),
    "draft": (True, True, True),
    "draft-asked-as-target": (True, True, False),
}


def autotune_exercise():
    if not AUTOTUNE_PATCHED:  # the table is about releases with the pre-fix decision
        return None
    func = functions[sglang_patch.AUTOTUNE_ID]
    method = site_name != "should_run_flashinfer_autotune"
    rows = []
    try:
        for cap in CAPS:
            fake_capability(cap)
            for quant in QUANTS:
                for disabled in (False, True):
                    for mode, (spec, draft_worker, for_draft) in SPEC.items():
                        if method and for_draft:
                            continue  # 0.5.14's method has no draft-side question
                        server_args = SimpleNamespace(
                            disable_flashinfer_autotune=disabled, moe_runner_backend="auto", moe_a2a_backend="none",
                            speculative_moe_runner_backend=None, speculative_moe_a2a_backend=None,
                            flashinfer_autotune_skip_ops=None)
                        runner = SimpleNamespace(
                            device="cuda", server_args=server_args, model_config=SimpleNamespace(quantization=quant),
                            spec_algorithm=SimpleNamespace(is_speculative=lambda spec=spec: spec),
                            is_draft_worker=draft_worker)
                        if method:
                            decision = func(SimpleNamespace(model_runner=runner))
                        else:
                            decision = func(runner, for_speculative_draft=for_draft)
                        rows.append({"cap": list(cap), "quant": quant, "disabled": disabled, "mode": mode,
                                     "decision": bool(decision)})
    finally:
        real_capability()
    return rows


# --- exercise 3: forward_extend with recording FlashInfer wrappers ---------------------------
class Recorder:
    """Stands in for a FlashInfer prefill wrapper: records each call's keyword arguments."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def _record(self, method, q, kwargs):
        self.log.append({"wrapper": self.name, "method": method, "keywords": sorted(kwargs),
                         "k_scale": kwargs.get("k_scale", "absent"), "v_scale": kwargs.get("v_scale", "absent")})
        return torch.zeros(q.shape)

    def forward(self, q, *args, **kwargs):
        return self._record("forward", q, kwargs)

    def forward_return_lse(self, q, *args, **kwargs):
        return self._record("forward_return_lse", q, kwargs), torch.zeros(q.shape[:2])


HEADS, KV_HEADS, DIM, TOKENS = 2, 1, 8, 3


def make_backend(log, use_ragged, extend_no_prefix):
    backend = object.__new__(flashinfer_backend.FlashInferAttnBackend)
    cache = (torch.zeros(16, KV_HEADS, DIM), torch.zeros(16, KV_HEADS, DIM))
    pool = SimpleNamespace(get_kv_buffer=lambda layer_id: cache, set_kv_buffer=lambda *a, **k: None)
    backend.__dict__.update(
        forward_metadata=SimpleNamespace(
            prefill_wrappers=[Recorder("paged", log)], use_ragged=use_ragged, extend_no_prefix=extend_no_prefix,
            multi_item_params=None, swa_out_cache_loc=None),
        num_wrappers=1, prefill_wrapper_ragged=Recorder("ragged", log), prefill_uses_dequant_workspace=False,
        token_to_kv_pool=pool, is_dllm_model=False)
    batch = SimpleNamespace(out_cache_loc=None, encoder_out_cache_loc=None, token_to_kv_pool=pool)
    return backend, batch


def make_layer(k_scale, v_scale):
    return SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS, head_dim=DIM,
        scaling=DIM ** -0.5, logit_cap=0.0, sliding_window_size=-1, is_cross_attention=False,
        attn_type=flashinfer_backend.AttentionType.DECODER, k_scale=None, v_scale=None,
        k_scale_float=k_scale, v_scale_float=v_scale)


CASES = {  # name -> (use_ragged, extend_no_prefix, k_scale, v_scale)
    "ragged_with_prefix": (True, False, 0.05, 0.07),
    "paged": (False, False, 0.05, 0.07),
    "ragged_no_prefix": (True, True, 0.05, 0.07),
    "ragged_with_prefix_no_scales": (True, False, None, None),
}
MERGE_NAMES = [n for n in ("_safe_merge_state", "merge_state")
               if n in functions[sglang_patch.FP8_ID].__code__.co_names]


def forward_extend_exercise():
    saved = {n: flashinfer_backend.__dict__.get(n) for n in MERGE_NAMES}
    for name in MERGE_NAMES:  # FlashInfer's CUDA merge kernel is not importable on a CPU machine
        setattr(flashinfer_backend, name, lambda o1, s1, o2, s2: (o1 + o2, s1))
    out = {}
    try:
        for case, (use_ragged, no_prefix, k_scale, v_scale) in CASES.items():
            log = []
            backend, batch = make_backend(log, use_ragged, no_prefix)
            q = torch.randn(TOKENS, HEADS * DIM)
            k = torch.randn(TOKENS, KV_HEADS * DIM)
            v = torch.randn(TOKENS, KV_HEADS * DIM)
            try:
                o = backend.forward_extend(q, k, v, make_layer(k_scale, v_scale), batch, save_kv_cache=False)
                out[case] = {"calls": log, "shape": list(o.shape)}
            except Exception as exc:
                out[case] = {"error": repr(exc)[:400], "calls": log}
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(flashinfer_backend, name)
            else:
                setattr(flashinfer_backend, name, value)
    return out


# --- exercise 4: the EAGLE multi-step draft CUDA-graph kv_indices buffer ----------------------
class TorchOnCpu:
    """The backend module's ``torch``, allocating its ``device="cuda"`` buffers on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


class StepBackend:
    """Stands in for one draft step's FlashInferAttnBackend: records the row it is handed."""

    def __init__(self, log):
        self.log = log

    def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None):
        self.log.append(list(kv_indices_buf.shape))


DRAFT_CASES = {"topk4": (4, 3, 8, 64), "topk1": (1, 3, 8, 64)}  # name -> (topk, steps, max_bs, max_context_len)


def draft_graph_exercise(mla=False):
    """SGLang's own init_cuda_graph_state on a bare multi-step draft backend (FlashInfer or -MLA)."""
    module = flashinfer_mla_backend if mla else flashinfer_backend
    out, saved = {}, module.torch
    module.torch = TorchOnCpu()
    try:
        for case, (topk, steps, max_bs, context) in DRAFT_CASES.items():
            log = []
            backend = object.__new__(getattr(module, "FlashInfer%sMultiStepDraftBackend" % ("MLA" if mla else "")))
            backend.__dict__.update(topk=topk, speculative_num_steps=steps, max_context_len=context,
                                    attn_backends=[StepBackend(log) for _ in range(steps)])
            backend.init_cuda_graph_state(max_bs, max_bs * topk)
            out[case] = {"buffer": list(backend.cuda_graph_kv_indices.shape), "rows": log}
    finally:
        module.torch = saved
    return out


# --- exercise 5: the query-head count the indices updaters plan with -------------------------
class Anything:
    """Whatever the updaters' __init__ reads and this exercise does not care about."""

    def __getattr__(self, name):
        return Anything()

    def __call__(self, *args, **kwargs):
        return Anything()

    def __getitem__(self, key):
        return Anything()


def plan_heads_exercise():
    """SGLang's own FlashInferIndicesUpdater{Decode,Prefill}.__init__ with per-layer head counts
    (largest 24, model-wide 16) and without; tensor-parallel size 2."""
    saved = {n: flashinfer_backend.__dict__[n] for n in ("get_attention_tp_size", "get_parallel")
             if n in flashinfer_backend.__dict__}
    flashinfer_backend.get_attention_tp_size = lambda: 2
    flashinfer_backend.get_parallel = lambda: SimpleNamespace(attn_tp_size=2, attn_dcp_size=1)
    out = {}
    try:
        for case, per_layer in {"per_layer": [16, 24, 16], "uniform": None}.items():
            text = SimpleNamespace(num_attention_heads_per_layer=per_layer) if per_layer else SimpleNamespace()
            config = SimpleNamespace(num_attention_heads=16, hf_text_config=text, head_dim=64,
                                     get_num_kv_heads=lambda *tp: 4,
                                     get_max_num_attention_heads=lambda: max(per_layer or [16]))
            runner, backend = Anything(), Anything()
            runner.__dict__.update(model_config=config, sliding_window_size=None)
            backend.__dict__.update(dispatch_reason=None, num_wrappers=1)
            for kind in ("Decode", "Prefill"):
                updater = getattr(flashinfer_backend, "FlashInferIndicesUpdater" + kind)
                try:
                    out["%s/%s" % (case, kind)] = updater(runner, backend).num_qo_heads
                except Exception as exc:
                    out["%s/%s" % (case, kind)] = repr(exc)[:300]
    finally:
        for name in ("get_attention_tp_size", "get_parallel"):
            flashinfer_backend.__dict__.pop(name, None)
        flashinfer_backend.__dict__.update(saved)
    return out


# --- exercise 6: what update_sliding_window plans each wrapper over (ragged extend, cached prefix) ---
def swa_plan_exercise():
    """SGLang's own FlashInferIndicesUpdaterPrefill.update_sliding_window, window 4, two requests with
    (prefix, extend) = (6, 3) and (2, 5), with ``call_begin_forward`` recorded instead of run (the
    paged wrappers' plan() inputs: lengths, their sum, start slots)."""
    out = {}
    for ragged in (True, False):
        log = []

        def record(*args, **kwargs):
            lens, total, start = args[3], args[4], args[7]
            log.append({"lens": lens.tolist(), "sum": int(total),
                        "start": None if start is None else start.tolist(),
                        "mask": kwargs.get("cross_attention_custom_mask") is not None})

        updater = object.__new__(flashinfer_backend.FlashInferIndicesUpdaterPrefill)
        updater.__dict__.update(sliding_window_size=4, _swa_kv_pool=None, token_to_kv_pool_allocator=None,
                                prefill_wrapper_ragged="ragged", kv_indptr=[None, None], qo_indptr=[None, None],
                                call_begin_forward=record)
        seq_lens, prefix_lens = torch.tensor([9, 7]), torch.tensor([6, 2])
        extra = {"plan": None} if "plan" in updater.update_sliding_window.__code__.co_varnames else {}  # 0.5.23
        try:
            updater.update_sliding_window(**extra,
                req_pool_indices=torch.tensor([0, 1]), seq_lens=seq_lens, seq_lens_cpu=seq_lens, seq_lens_sum=16,
                prefix_lens=prefix_lens, prefill_wrappers=["swa", "full"], use_ragged=ragged, encoder_lens=None,
                spec_info=None)
            out["ragged" if ragged else "paged"] = log
        except Exception as exc:
            out["ragged" if ragged else "paged"] = repr(exc)[:300]
    return out


def exercises():
    return {"vision": vision_exercise(), "autotune": autotune_exercise(), "forward_extend": forward_extend_exercise(),
            "draft_graph": draft_graph_exercise(), "mla_draft_graph": draft_graph_exercise(mla=True), "plan_heads": plan_heads_exercise(), "swa_plan": swa_plan_exercise()}


with_fix = exercises()
report("with", with_fix)
after = {row["id"]: row for row in flashfix.status() if row["engine"] == "sglang"}
markers = {}
for patch_id, record in _registry._records.items():
    if patch_id in status:
        markers[patch_id] = [c.func.__code__ is getattr(_registry._stacks.get(id(c.func)), "current", c).plain  # a series:
                             for c in record["changes"] if hasattr(c, "plain")]  # the code compiled from all of it
report("after_run", {
    "ran": {k: v["ran"] for k, v in after.items()},
    "markers_dropped": markers,
    "changes": {k: [repr(c) for c in _registry._records[k]["changes"]] for k in status},
})

def global_helper_variant():
    """The released decision rewritten so that ``is_sm100_supported`` is a module global (as
    SGLang's other modules import it), loaded from a temp file: the patch must then add
    ``is_sm120_supported`` to that module as a second change, and take it away on undo."""
    import importlib.util

    if site_name != "should_run_flashinfer_autotune" or not AUTOTUNE_PATCHED:
        return None
    lines = open(sys.modules[site_module].__file__).read().splitlines(True)
    local = "    from sglang.srt.utils import is_sm100_supported\n"
    if local not in lines:
        return {"error": "local import not found"}
    lines[lines.index(local)] = "\n"  # keep line numbers
    lines.append("from sglang.srt.utils import is_sm100_supported\n")
    path = os.path.join(tempfile.mkdtemp(prefix="ffx-variant-"), "ffx_autotune_variant.py")
    with open(path, "w") as handle:
        handle.writelines(lines)
    spec = importlib.util.spec_from_file_location("ffx_autotune_variant", path)
    variant = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = variant
    spec.loader.exec_module(variant)
    func = variant.should_run_flashinfer_autotune
    runner = SimpleNamespace(
        device="cuda", model_config=SimpleNamespace(quantization="modelopt_fp8"), is_draft_worker=False,
        spec_algorithm=SimpleNamespace(is_speculative=lambda: False),
        server_args=SimpleNamespace(disable_flashinfer_autotune=False, moe_runner_backend="auto",
                                    moe_a2a_backend="none", flashinfer_autotune_skip_ops=None))
    out = {"had_global": "is_sm120_supported" in variant.__dict__}
    declaration = copy.copy(_matcher.declaration_of(sglang_patch.SM120_FP8_AUTOTUNE.rule))  # anchored to the variant
    declaration.layouts = [((spec.name, "should_run_flashinfer_autotune"),)]
    changes = declaration.prepare({spec.name: variant})
    out["changes"] = [type(c).__name__ for c in changes]
    try:
        fake_capability((12, 0))
        out["released"] = func(runner)
        for change in changes:
            change.apply()
        out["added_is_utils_helper"] = variant.__dict__.get("is_sm120_supported") is sglang_common.is_sm120_supported
        out["patched"] = func(runner)
        for change in reversed(changes):
            change.undo()
        out["after_undo"] = func(runner)
        out["global_removed"] = "is_sm120_supported" not in variant.__dict__
    finally:
        real_capability()
    return out


report("global_variant", global_helper_variant())


def derived(patch, reverts, exercise, where="flashinfer_backend"):
    """Where the release has ``patch``'s fix upstream, upstream's change reverted in a copy of the
    module that this script holds as the global ``where`` (each of ``reverts``, ``(function, before,
    after)`` in upstream's own form, turned back by derive_prefix), loaded under another name: the
    shipped declaration judges the copy, patches it, and ``exercise`` then gives the release's
    answers; undone, the bug's."""
    import importlib.util

    if status.get(patch.id, {}).get("state") != "fixed-upstream":
        return None
    released = globals()[where]
    text = open(released.__file__).read()
    for function, before, after in reverts:
        upstream = semantic.Backport(
            id="test-upstream", engine="sglang", versions=">=0", upstream="", fixed_in="", summary="",
            doc="Delete when: never", module=released.__name__, function=function, before=before, after=after,
            context=lambda tree, func: {})  # only turned back: its `after` may bind what `before` drops ($$$B)
        text = semantic.derive_prefix(upstream, text)
    name = "ffx_derived_" + patch.id.replace("-", "_")
    path = os.path.join(tempfile.mkdtemp(prefix="ffx-derived-"), name + ".py")
    with open(path, "w") as handle:
        handle.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    copy_module = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy_module
    spec.loader.exec_module(copy_module)
    out = {"verdict": list(_registry.judge(patch, {released.__name__: _source.parse_file(path)}, VERSION))}
    declaration = copy.copy(_matcher.declaration_of(patch.rule))  # the same declaration, anchored to the copy
    declaration.hunks = [copy.copy(rule) for rule in declaration.hunks]
    for rule in declaration.hunks:
        rule.module = name
    declaration.layouts = [tuple((name, rule.function) for rule in declaration.hunks)]
    changes = declaration.prepare({name: copy_module})
    globals()[where] = copy_module
    try:
        out["derived"] = exercise()
        for change in changes:
            change.apply()
        out["patched"] = exercise()
        for change in reversed(changes):
            change.undo()
        out["undone"] = exercise()
    finally:
        globals()[where] = released
    out["release"] = exercise()
    return out


DRAFT_REVERT = (  # upstream's #27338 / #27460, after -> before
    "self.cuda_graph_kv_indices = torch.zeros((self.speculative_num_steps, $BS * self.max_context_len), **$$$K)",
    "kv_indices_width = draft_kv_indices_buffer_width($BS, self.topk, self.max_context_len)\n"
    "self.cuda_graph_kv_indices = torch.zeros((self.speculative_num_steps, kv_indices_width), **$$$K)")
report("derived", {
    sglang_patch.DRAFT_GRAPH_ID: derived(sglang_patch.EAGLE_DRAFT_GRAPH_KV_INDICES, [
        ("FlashInferMultiStepDraftBackend.init_cuda_graph_state",) + DRAFT_REVERT], draft_graph_exercise),
    sglang_patch.MLA_DRAFT_GRAPH_ID: derived(sglang_patch.EAGLE_MLA_DRAFT_GRAPH_KV_INDICES, [
        ("FlashInferMLAMultiStepDraftBackend.init_cuda_graph_state",) + DRAFT_REVERT],
        lambda: draft_graph_exercise(mla=True), where="flashinfer_mla_backend"),
    sglang_patch.PLAN_HEADS_ID: derived(sglang_patch.PER_LAYER_HEADS_PLAN, [
        ("FlashInferIndicesUpdater%s.__init__" % kind, "model_runner.model_config.num_attention_heads // $TP",
         "model_runner.model_config.get_max_num_attention_heads() // $TP") for kind in ("Decode", "Prefill")],
        plan_heads_exercise),
    sglang_patch.SWA_FULL_RAGGED_ID: derived(sglang_patch.SWA_FULL_ATTN_RAGGED_PREFIX, [(
        "FlashInferIndicesUpdaterPrefill.update_sliding_window",
        "if wrapper_id == 0:\n    $$$A\nelse:\n    $$$C",
        "if wrapper_id == 0:\n    $$$A\nelif use_ragged:\n    $$$B\nelse:\n    $$$C")], swa_plan_exercise),
})

applied_codes = {k: f.__code__ for k, f in functions.items()}
flashfix.revert()
report("reverted", {
    "same_objects": {k: plain(*where) is functions[k] for k, where in {
        sglang_patch.FP8_ID: (flashinfer_backend.FlashInferAttnBackend, "forward_extend", flashinfer_backend),
        sglang_patch.VISION_ID: (model_config.ModelConfig, "__init__", model_config),
        sglang_patch.DRAFT_GRAPH_ID: (flashinfer_backend.FlashInferMultiStepDraftBackend, "init_cuda_graph_state",
                                      flashinfer_backend),
        sglang_patch.MLA_DRAFT_GRAPH_ID: (flashinfer_mla_backend.FlashInferMLAMultiStepDraftBackend,
                                          "init_cuda_graph_state", flashinfer_mla_backend),
        sglang_patch.PLAN_HEADS_ID: (flashinfer_backend.FlashInferIndicesUpdaterPrefill, "__init__", flashinfer_backend),
        sglang_patch.SWA_FULL_RAGGED_ID: (flashinfer_backend.FlashInferIndicesUpdaterPrefill, "update_sliding_window",
                                          flashinfer_backend),
    }.items()},
    "code_restored": {k: untouched(f) for k, f in functions.items()},
    "code_changed_by_revert": {k: f.__code__ is not applied_codes[k] for k, f in functions.items()},
    "state": {row["id"]: row["state"] for row in flashfix.status() if row["engine"] == "sglang"},
    "sm120_global_added": {k: "is_sm120_supported" in f.__globals__ for k, f in functions.items()},
})
report("without", exercises())


def clamp_exercise():
    """The release's own Fp8MoEMethod._prepare_flashinfer_trtllm_activation_params (CPU tensors): the
    per-expert clamp it builds, as released and with the declaration's runtime edit applied (the
    0.5.19 shape is 0.5.18's; 0.5.18 is outside the declared range, so the edit is applied here by hand)."""
    method = getattr(getattr(quant_fp8, "Fp8MoEMethod", None), "_prepare_flashinfer_trtllm_activation_params", None)
    if method is None:
        return None
    patch = sglang_patch.TRTLLM_FP8_SWIGLU_LIMIT

    def run():
        out = {}
        for name, (clamp, limit) in {"limit_only": (None, 10.0), "both": (3.0, 10.0), "none": (None, None)}.items():
            cfg = SimpleNamespace(gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=clamp, swiglu_limit=limit)
            layer = SimpleNamespace(num_local_experts=4, w13_weight=torch.empty(1))
            method(SimpleNamespace(moe_runner_config=cfg), layer)
            t = layer._flashinfer_trtllm_gemm1_clamp_limit
            out[name] = None if t is None else t.tolist()
        return out

    out = {"probe": patch.probe({quant_fp8.__name__: _source.module_ast(quant_fp8.__name__)}).kind, "released": run()}
    if out["probe"] == "buggy":
        changes = patch.prepare({quant_fp8.__name__: quant_fp8})
        for change in changes:
            change.apply()
        out["patched"] = run()
        for change in reversed(changes):
            change.undo()
        out["undone"] = run()
    return out


report("clamp", clamp_exercise())
