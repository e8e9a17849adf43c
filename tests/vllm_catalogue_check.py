"""Runs inside one real vLLM environment (tests/engine_env.py), in one process, and reports with
``FLASHFIX_RESULT=<json>`` lines; tests/test_vllm_catalogue.py makes the assertions.

Order: the doctor's verdicts first (nothing of the engine imported); then the engine's real modules
are imported (flashfix's hooks apply what the release lacks) and vLLM's own functions run on CPU:

* ``lse``: the MLA prefill backends' ``run_prefill_new_tokens`` / ``run_prefill_context_chunk``
  (FlashInfer and TRT-LLM ragged) and ``BatchDCPPrefillWrapper.run``, with FlashInfer replaced by a
  stand-in that computes attention on CPU and returns its LSE in base 2, as FlashInfer does. The
  two parts are merged by the LSE rule ``merge_attn_states`` implements (its CUDA/Triton kernels do
  not run on CPU) and compared with attention over the whole sequence.
* ``pages``: ``FlashInferMetadataBuilder.build`` with DCP (world 2, rank 1) on a batch of two
  prefills over cached prefixes: the page counts and lengths it hands to FlashInfer's metadata,
  what it plans the DCP prefill wrapper with, and the shared ``seq_lens_cpu`` afterwards.

``flashfix.revert()`` then puts the original code back and both run again (the "without
flashfix" column). ``$CATALOGUE_ARGV`` (JSON), if set, is ``[derived, release]``: serve
``vllm.v1.attention.backends.flashinfer`` from the file ``derived`` (a pre-fix shape), and also
load the release's own file ``release`` as a copy and run the page-count case on it.
"""

import copy
import json
import math
import os
import sys
from importlib.metadata import version
from types import SimpleNamespace

import flashfix
from flashfix.core import registry as _registry
from flashfix.core import source as _source

TARGET = "vllm.v1.attention.backends.flashinfer"
MLA = {"fi": "vllm.v1.attention.backends.mla.prefill.flashinfer",
       "trtllm": "vllm.v1.attention.backends.mla.prefill.trtllm_ragged"}
IDS = ("vllm-mla-flashinfer-lse", "vllm-mla-trtllm-ragged-lse", "vllm-dcp-prefill-lse", "vllm-dcp-page-counts",
       "vllm-fp8-kv-sharing-view", "vllm-sinks-weight-reload")


def report(key, value):
    print("FLASHFIX_RESULT=" + json.dumps({key: value}), flush=True)


VERSION = version("vllm")
patches = {p.id: p for p in _registry.load_all() if p.id in IDS}
report("doctor", {
    "verdicts": {i: _registry.judge(p, {t: _source.module_ast(t) for t in _registry.targets_of(p)}, VERSION)[0]
                 for i, p in patches.items()},
    "heavy": sorted(m for m in ("vllm", "torch", "flashinfer") if m in sys.modules),
})

ARGV = json.loads(os.environ.get("CATALOGUE_ARGV", "[]"))
if ARGV:  # serve the backend module from a derived pre-fix file, after flashfix's finder
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import vllm_prefix_shape

    sys.meta_path.insert(next(i + 1 for i, f in enumerate(sys.meta_path) if getattr(f, "flashfix_finder", False)),
                         vllm_prefix_shape.PrefixFinder(ARGV[0]))

import importlib  # noqa: E402

import flashinfer.prefill  # noqa: E402
import torch  # noqa: E402

fi = importlib.import_module(TARGET)
mla = {k: importlib.import_module(m) for k, m in MLA.items()}
import vllm.v1.utils as v1_utils  # noqa: E402

report("state", {r["id"]: r["state"] for r in flashfix.status() if r["id"] in IDS})

# --- the LSE of a prefill over a cached context ------------------------------------------------

H, LC, LN, D = 4, 7, 5, 16
torch.manual_seed(0)
Q, KC, VC, KN, VN = (torch.randn(n, H, D, dtype=torch.float64) for n in (LN, LC, LC, LN, LN))
SCALE = D ** -0.5


def attend(q, k, v, causal):
    """(out [q, H, D], LSE in base 2 [q, H]): what FlashInfer's wrappers return."""
    s = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if causal:  # the new tokens see themselves and the ones before (bottom-right aligned)
        s = s.masked_fill(torch.ones(len(q), len(k), dtype=torch.bool).triu(1 + len(k) - len(q)), -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v), (torch.logsumexp(s, -1) / math.log(2)).T


def merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, *rest, **kw):
    """What merge_attn_states computes, LSEs [H, q] in natural log."""
    m = torch.maximum(prefix_lse, suffix_lse)
    a, b = (torch.exp(prefix_lse - m).T[..., None], torch.exp(suffix_lse - m).T[..., None])
    output.copy_((a * prefix_output + b * suffix_output) / (a + b))


REFERENCE = attend(Q, torch.cat([KC, KN]), torch.cat([VC, VN]), causal=True)[0]


class Wrapper:  # a FlashInfer prefill wrapper on CPU
    def __init__(self, k, v, causal):
        self.kv, self.causal = (k, v), causal

    def run(self, *args, q=None, k=None, v=None, out=None, return_lse=False, **kw):
        o, lse = attend(q if q is not None else args[0], *self.kv, self.causal)
        return (o, lse) if return_lse else o


def ragged(query, key, value, is_causal, return_lse, out, **kw):  # flashinfer.prefill.trtllm_ragged_attention_deepseek
    o, lse = attend(query, key, value, is_causal)
    return (o, lse) if return_lse else o


flashinfer.prefill.trtllm_ragged_attention_deepseek = ragged


def error(out):
    return float((out - REFERENCE).norm() / REFERENCE.norm())


def mla_case(cls):
    backend = object.__new__(cls)
    backend._prefill_main, backend._prefill_chunks = Wrapper(KN, VN, True), [Wrapper(KC, VC, False)]
    start = torch.tensor([0, LN], dtype=torch.int32)
    backend._prefill_metadata = SimpleNamespace(output_dtype=torch.float64, max_query_len=LN, query_start_loc=start)
    backend._workspace_buffer, backend._query_seq_lens, backend.scale = None, torch.tensor([LN]), SCALE
    backend._query_seq_lens_cpu, backend._has_active_rows = torch.tensor([LN]), True
    chunk = SimpleNamespace(index=0, seq_lens=torch.tensor([LC]), max_query_len=LN, max_seq_len=LC, num_requests=1,
                            query_start_loc=start, cu_seq_lens=torch.tensor([0, LC]), request_slice=slice(0, 1),
                            all_rows_active=True)
    new_out, new_lse = backend.run_prefill_new_tokens(Q, KN, VN, True)
    ctx_out, ctx_lse = backend.run_prefill_context_chunk(chunk, Q, KC, VC)
    out = torch.empty_like(new_out)
    merge(out, ctx_out, ctx_lse, new_out, new_lse)
    return {"lse": [round(x, 9) for x in torch.cat([ctx_lse, new_lse]).flatten().tolist()], "error": error(out)}


def dcp_case():
    wrapper = object.__new__(fi.BatchDCPPrefillWrapper)
    wrapper._context, wrapper._new_tokens = Wrapper(KC, VC, False), Wrapper(KN, VN, True)
    seen = []
    wrapper._dcp_combine = lambda o, lse, group, return_lse: (o, lse)
    fi.get_dcp_group = lambda: SimpleNamespace(all_gather=lambda x, dim: x)
    fi.merge_attn_states = lambda *a, **kw: (seen.append(torch.cat([a[2], a[4]]).flatten().tolist()), merge(*a))
    out = torch.empty(LN, H, D, dtype=torch.float64)
    wrapper.run(SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0), Q, (None, None), KN, VN, out)
    return {"lse": [round(x, 9) for x in seen[0]], "error": error(out)}


def lse_cases():
    return {"fi": mla_case(mla["fi"].FlashInferPrefillBackend),
            "trtllm": mla_case(mla["trtllm"].TrtllmRaggedPrefillBackend), "dcp": dcp_case()}


# --- DCP page counts ---------------------------------------------------------------------------

v1_utils.PIN_MEMORY = False  # a CPU host


class PageKernel:  # the Triton page-index copy, on CPU
    def __getitem__(self, grid):
        def run(out, table, stride, indptr, BLOCK_SIZE):
            for r in range(grid[0]):
                out[int(indptr[r]):int(indptr[r + 1])] = table[r, :int(indptr[r + 1]) - int(indptr[r])]
        return run



def pages_case(module):
    """FlashInferMetadataBuilder.build of ``module`` with DCP: two prefills (30 and 20 new tokens
    over 100 and 70 tokens), page size 16, this rank 1 of 2."""
    from vllm.v1.utils import CpuGpuBuffer

    log = {}
    module.PIN_MEMORY, module._copy_page_indices_kernel = False, PageKernel()
    module.use_trtllm_attention = lambda *a, **kw: False  # no GPU to ask

    class Recorder(module.BatchDCPPrefillWrapper):
        def __init__(self):
            pass

        def plan(self, *args, **kw):
            log["plan"] = {k: kw[k].tolist() for k in ("qo_indptr_cpu", "paged_kv_indptr_cpu", "paged_kv_indices",
                                                       "paged_kv_last_page_len_cpu")}

    b = object.__new__(module.FlashInferMetadataBuilder)
    params = SimpleNamespace(has_same_window_lefts=True, has_same_all_params=True, window_left=-1,
                             logits_soft_cap=None, sm_scale=0.125)
    vars(b).update(
        use_dcp=True, dcp_world_size=2, dcp_rank=1, dcp_kv_cache_interleave_size=1, page_size=16,
        reorder_batch_threshold=1, use_dedicated_xqa=False, use_xqa=False, use_trtllm_decode_attention=False,
        use_trtllm_gen_varlen_decode=False, has_sinks=False, flashinfer_trtllm_api_decode_kernel=None,
        is_kvcache_nvfp4=False, num_qo_heads=4, num_kv_heads=1, head_dim=64, sm_scale=0.125, window_left=-1,
        logits_soft_cap=None, q_data_type_prefill=torch.bfloat16, q_data_type_decode=torch.bfloat16,
        kv_cache_dtype=torch.bfloat16, cache_dtype="auto", disable_split_kv=False, enable_cuda_graph=False,
        prefill_fixed_split_size=-1, decode_fixed_split_size=-1, _decode_cudagraph_max_bs=0,
        attention_config=SimpleNamespace(use_trtllm_attention=None, disable_flashinfer_prefill=False),
        model_config=SimpleNamespace(dtype=torch.bfloat16), global_hyperparameters=params,
        paged_kv_indptr=CpuGpuBuffer(3, dtype=torch.int32, device="cpu", pin_memory=False, with_numpy=True),
        paged_kv_last_page_len=CpuGpuBuffer(2, dtype=torch.int32, device="cpu", pin_memory=False, with_numpy=True),
        paged_kv_indices=torch.zeros(64, dtype=torch.int32), _get_prefill_wrapper=lambda *a, **kw: Recorder())
    if hasattr(module.FlashInferMetadataBuilder, "_make_buffer"):  # up to 0.28: CPU/GPU buffer pairs
        b.paged_kv_indices = CpuGpuBuffer(64, dtype=torch.int32, device="cpu", pin_memory=False, with_numpy=True)
        b.paged_kv_indptr_cpu_buffer, b.pin_memory = torch.zeros(3, dtype=torch.int32), False
    real = b._compute_flashinfer_kv_metadata

    def kv_metadata(num_blocks_np, seq_lens_np, *rest):
        log["pages"], log["lengths"] = num_blocks_np.tolist(), seq_lens_np.tolist()
        return real(num_blocks_np, seq_lens_np, *rest)

    b._compute_flashinfer_kv_metadata = kv_metadata
    seq, start = torch.tensor([100, 70], dtype=torch.int32), torch.tensor([0, 30, 50], dtype=torch.int32)
    b.build(0, SimpleNamespace(
        num_reqs=2, num_actual_tokens=50, causal=True, query_start_loc=start, query_start_loc_cpu=start, seq_lens=seq,
        seq_lens_cpu=seq, block_table_tensor=torch.arange(16, dtype=torch.int32).view(2, 8),
        slot_mapping=torch.zeros(50, dtype=torch.int64), max_seq_len=100, max_query_len=30, dcp_local_seq_lens=None,
        num_computed_tokens_cpu=seq - (start[1:] - start[:-1])))
    log["seq_lens_after"] = seq.tolist()
    return log


# --- the FP8 view of a KV-sharing layer's cache ------------------------------------------------

PRE_SHARING = """
def view(self, kv_cache):
    if self.kv_sharing_target_layer_name is None and is_quantized_kv_cache(self.kv_cache_dtype):
        torch_dtype = FlashInferBackend.get_dtype_for_flashinfer(self.kv_cache_dtype)
        kv_cache = kv_cache.view(torch_dtype)
    return kv_cache
"""  # the view of releases up to 0.21.0, with the helper name 0.21.0 has


def sharing_case():
    """The dtype FlashInfer gets for a uint8-stored cache of a KV-sharing layer: the release's own
    statement (0.22.0 on), the pre-0.22 statement, and that statement edited by the declaration."""
    import ast

    from flashfix import vllm_patch

    rule = vllm_patch.FP8_KV_SHARING.rule.hunks[0]
    forward = _source.find_def(_source.module_ast(TARGET), "FlashInferImpl.forward")
    (own,) = [n for n in forward.body if isinstance(n, ast.If) and "kv_cache.dtype == torch.uint8" in ast.unparse(n.test)]
    pre = ast.parse(PRE_SHARING).body[0]
    edited = ast.parse(PRE_SHARING).body[0]
    shape = rule.site(edited)[1]
    rule.edit(edited, ast.Pass())
    release = ast.parse(PRE_SHARING).body[0]
    release.body[0] = own
    out = {"shape": shape.kind}
    for name, func in (("release", release), ("pre", pre), ("edited", edited)):
        space = dict(vars(fi))
        exec(compile(ast.fix_missing_locations(ast.Module([func], [])), "<%s>" % name, "exec"), space)
        for dtype in ("fp8", "fp8_e5m2", "auto"):
            impl = SimpleNamespace(kv_sharing_target_layer_name="model.layers.0.self_attn.attn", kv_cache_dtype=dtype,
                                   is_kvcache_nvfp4=False)
            cache = torch.zeros(2, 4, dtype=torch.uint8 if dtype != "auto" else torch.bfloat16)
            out["%s/%s" % (name, dtype)] = str(space["view"](impl, cache).dtype)
    return out


report("sharing", sharing_case())

PRE_RELOAD = """
def process_weights_after_loading(self, act_dtype):
    if self.sinks is not None and self.sinks.dtype != torch.float32:
        self.sinks = self.sinks.to(torch.float32)
"""  # releases up to 0.25.1


def reload_case():
    """The release's ``FlashInferImpl`` with the 0.26.0 sinks refresh taken out (``__init__`` no longer
    keeps the parameter, ``process_weights_after_loading`` as up to 0.25.1), edited by the declaration:
    the same ``__init__`` as the release's, and the sinks after a second weight load as the release's."""
    import ast

    from flashfix import vllm_patch

    patch = vllm_patch.SINKS_RELOAD
    release = _source.module_ast(TARGET)
    derived = copy.deepcopy(release)
    init = _source.find_def(derived, "FlashInferImpl.__init__")
    init.body = [n for n in init.body if ast.unparse(n) != "self._sinks_source = sinks"]
    load = _source.find_def(derived, "FlashInferImpl.process_weights_after_loading")
    load.body = ast.parse(PRE_RELOAD).body[0].body
    out = {"verdict": _registry.judge(patch, {TARGET: derived}, VERSION)[0]}
    pre = copy.deepcopy(load)
    shape, located, given = patch.rule.shape(lambda m: derived)
    for rule, _, qualname, _ in located:
        func = _source.find_def(derived, qualname)
        rule.edit(func, ast.Pass(), given=given)
        func.body = [n for n in func.body if not isinstance(n, ast.Pass)]
    out["init_as_release"] = ast.dump(init) == ast.dump(_source.find_def(release, "FlashInferImpl.__init__"))
    for name, func in (("release", _source.find_def(release, "FlashInferImpl.process_weights_after_loading")),
                       ("pre", pre), ("edited", load)):
        space = dict(vars(fi))
        exec(compile(ast.fix_missing_locations(ast.Module([copy.deepcopy(func)], [])), "<%s>" % name, "exec"), space)
        param = torch.nn.Parameter(torch.full((4,), 0.5, dtype=torch.bfloat16), requires_grad=False)
        impl = SimpleNamespace(sinks=param, _sinks_source=None if name == "pre" else param)
        space["process_weights_after_loading"](impl, torch.bfloat16)
        first = impl.sinks
        param.data.fill_(2.0)  # a second checkpoint loaded into the same parameter
        space["process_weights_after_loading"](impl, torch.bfloat16)
        out[name] = {"dtype": str(impl.sinks.dtype), "values": impl.sinks.tolist(), "same_tensor": impl.sinks is first}
    return out


report("reload", reload_case())
report("with", {"lse": lse_cases(), "pages": pages_case(fi),
                "ran": {r["id"]: r["ran"] for r in flashfix.status() if r["id"] in IDS}})
flashfix.revert(*[i for i in IDS if i != "vllm-fp8-kv-sharing-view"])
report("without", {"lse": lse_cases(), "pages": pages_case(fi)})
if ARGV:  # the release's own module, loaded again from its file: what the derived shape must match
    import vllm_prefix_shape

    report("release", {"pages": pages_case(vllm_prefix_shape.load_copy(ARGV[1], "flashfix_release_copy"))})
