"""flashinfer-sink-jit-name against the real FlashInfer code from PyPI (the one vLLM 0.28.0
installs, 0.6.16.post3), on a CPU machine.

FlashInfer's JIT module builder (``flashinfer.prefill.get_customize_batch_prefill_module``)
is replaced by a recorder, so the names FlashInfer asks for can be read without a GPU or a
compiler. Everything between the sink wrapper's constructor and that builder is FlashInfer's
own code, with flashfix's patch applied at import as in production. The recorder stops the
constructor right after the name is chosen (the rest needs CUDA).
"""

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_env  # noqa: E402

ENV = "vllm==0.28.0"

PRELUDE = r'''
import json, logging, os
def report(**kw):
    print("FLASHFIX_RESULT=" + json.dumps(kw, default=repr), flush=True)

import flashfix
import torch
import flashinfer
import flashinfer.prefill as prefill
from flashinfer.attention import BatchAttentionWithAttentionSinkWrapper as Sink
from flashfix.core import registry as _registry

warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("flashfix").addHandler(Catch())

class Stop(Exception):
    pass

asked = []          # every name FlashInfer's builder was asked for, in order
prebuilt = set()    # with JIT disabled: names treated as built ahead of time

def recorder(backend, uri, *rest, **kwargs):
    asked.append(uri)
    if os.environ.get("FLASHINFER_DISABLE_JIT") and uri not in prebuilt:
        # FlashInfer's own cache lookup for a module that was never built
        from flashinfer.jit.core import JitSpecNvcc
        JitSpecNvcc(name=uri, sources=[], extra_cflags=None, extra_cuda_cflags=None, extra_ldflags=None,
                    extra_include_dirs=None).build_and_load()
    raise Stop(uri)

prefill.get_customize_batch_prefill_module = recorder
workspace = torch.empty(1 << 16, dtype=torch.uint8)

def build(kv=torch.bfloat16, head_dim=64, window_left=-1, q=torch.bfloat16, backend="fa2"):
    """Construct a sink wrapper; returns the kernel name it asked for."""
    before = len(asked)
    try:
        Sink(workspace, "NHD", backend=backend, q_data_type=q, kv_data_type=kv, head_dim_qk=head_dim,
             head_dim_vo=head_dim, window_left=window_left)
    except Stop:
        pass
    assert len(asked) == before + 1, asked
    return asked[-1]

def state():
    return {r["id"]: r for r in flashfix.status()}["flashinfer-sink-jit-name"]
'''

PATCHED = PRELUDE + r'''
st = state()
parent_init = prefill.BatchPrefillWithPagedKVCacheWrapper.__dict__["__init__"]
seq = [
    ("bf16 kv, d64", build()),
    ("bf16 kv, d64 again", build()),
    ("fp8 kv, d64", build(kv=torch.float8_e4m3fn)),
    ("fp8 kv, d64 again", build(kv=torch.float8_e4m3fn)),
    ("bf16 kv, d128", build(head_dim=128)),
    ("fp8 e5m2 kv, d64", build(kv=torch.float8_e5m2)),
    ("bf16 kv, d64 third", build()),
    ("bf16 kv, d64, window 128", build(window_left=128)),
    ("bf16 kv, d64, window 4096", build(window_left=4096)),
    ("fp16 q+kv, d64", build(q=torch.float16, kv=torch.float16)),
]
warned = list(warnings)
report(kind="sequence", state=st["state"], reason=st["reason"], ran=state()["ran"], seq=seq, warnings=warned,
       wrapped=getattr(parent_init, "flashfix_patch", None))

# JIT disabled: a renamed configuration whose kernel was not built ahead of time
os.environ["FLASHINFER_DISABLE_JIT"] = "1"
os.environ["FLASHINFER_WORKSPACE_BASE"] = os.environ["TEST_TMP"]
first = None
prebuilt.add("batch_prefill_attention_sink_bf16_swa_True_fa3")
n_before = len(asked)
try:
    Sink(workspace, "NHD", backend="fa3", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
         head_dim_qk=64, head_dim_vo=64, window_left=0)
except Stop as stop:
    first = str(stop)
error = None
try:
    Sink(workspace, "NHD", backend="fa3", q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn,
         head_dim_qk=64, head_dim_vo=64, window_left=0)
except Exception as exc:
    error = (type(exc).__name__, str(exc), type(exc.__cause__).__name__)
report(kind="disabled", first=first, error=error, asked=asked[n_before:])
del os.environ["FLASHINFER_DISABLE_JIT"]

# revert: the original __init__ object is back and FlashInfer's own naming returns
flashfix.revert()
restored = prefill.BatchPrefillWithPagedKVCacheWrapper.__dict__["__init__"]
report(kind="revert", state=state()["state"], restored_is_patched=getattr(restored, "flashfix_patch", None),
       fp8_after_revert=build(kv=torch.float8_e4m3fn, head_dim=256), bf16_after_revert=build(head_dim=256))
'''

UNPATCHED = PRELUDE + r'''
report(state=state()["state"], seq=[build(), build(kv=torch.float8_e4m3fn), build(head_dim=128)])
'''

BASE = "batch_prefill_attention_sink_bf16_swa_False_fa2"


def test_sink_wrapper_names_with_and_without_patch(tmp_path):
    seq_r, disabled, revert = engine_env.run(ENV, PATCHED, env={"TEST_TMP": str(tmp_path)})
    assert seq_r["state"] == "applied", seq_r["reason"]
    assert seq_r["ran"] is True
    assert seq_r["wrapped"] == "flashinfer-sink-jit-name"
    names = dict(seq_r["seq"])
    # the first configuration keeps FlashInfer's own name; the same configuration gets it again
    assert names["bf16 kv, d64"] == BASE
    assert names["bf16 kv, d64 again"] == BASE
    assert names["bf16 kv, d64 third"] == BASE
    # another KV dtype or head dim under the same FlashInfer name: a name of its own, stable
    assert names["fp8 kv, d64"] == BASE + "_kv_float8_e4m3fn_o_bfloat16_hd_64_64"
    assert names["fp8 kv, d64 again"] == names["fp8 kv, d64"]
    assert names["bf16 kv, d128"] == BASE + "_kv_bfloat16_o_bfloat16_hd_128_128"
    assert names["fp8 e5m2 kv, d64"] == BASE + "_kv_float8_e5m2_o_bfloat16_hd_64_64"
    # window sizes: only window_left >= 0 is compiled in, and it is in the name; no rename
    assert names["bf16 kv, d64, window 128"] == names["bf16 kv, d64, window 4096"] == \
        "batch_prefill_attention_sink_bf16_swa_True_fa2"
    assert names["fp16 q+kv, d64"] == "batch_prefill_attention_sink_f16_swa_False_fa2"
    distinct = {names[k] for k in ("bf16 kv, d64", "fp8 kv, d64", "bf16 kv, d128", "fp8 e5m2 kv, d64")}
    assert len(distinct) == 4
    # one warning per renamed configuration, naming both configurations
    assert len(seq_r["warnings"]) == 3, seq_r["warnings"]
    assert "KV float8_e4m3fn" in seq_r["warnings"][0] and "KV bfloat16" in seq_r["warnings"][0]

    # JIT disabled and the renamed kernel not prebuilt: a clear error, and the colliding name never asked for
    assert disabled["first"] == "batch_prefill_attention_sink_bf16_swa_True_fa3"
    kind, message, cause = disabled["error"]
    assert kind == "SinkKernelUnavailableError"
    assert cause == "MissingJITCacheError"
    assert "FLASHINFER_DISABLE_JIT" in message
    assert "KV float8_e4m3fn" in message and "KV bfloat16" in message
    assert "batch_prefill_attention_sink_bf16_swa_True_fa3_kv_float8_e4m3fn_o_bfloat16_hd_64_64" in message
    assert disabled["asked"] == [
        "batch_prefill_attention_sink_bf16_swa_True_fa3",
        "batch_prefill_attention_sink_bf16_swa_True_fa3_kv_float8_e4m3fn_o_bfloat16_hd_64_64",
    ]

    # revert: FlashInfer's own __init__ and naming are back (the collision returns)
    assert revert["state"] == "disabled"
    assert revert["restored_is_patched"] is None
    assert revert["fp8_after_revert"] == BASE and revert["bf16_after_revert"] == BASE


def test_without_the_patch_every_configuration_shares_one_name():
    (r,) = engine_env.run(ENV, UNPATCHED, env={"FLASHFIX_DISABLE": "flashinfer-sink-jit-name"})
    assert r["state"] == "disabled"
    assert r["seq"] == [BASE, BASE, BASE]  # the bug: bf16-KV, FP8-KV and head_dim 128 would share a kernel


PROBE = r'''
import ast, json, flashfix
from flashfix import flashinfer_patch as fp
from flashfix.core import source as _source
trees = {m: _source.module_ast(m) for m in fp.PATCHES[0].targets}
real = fp.probe(trees)
core_file = _source.module_file("flashinfer.attention._core")
src = open(core_file).read()
old = "batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_swa_"
assert old in src
fixed_src = src.replace(old, "batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_"
                        "{filename_safe_dtype_map[kv_data_type]}_{head_dim_qk}_{head_dim_vo}_swa_")
fixed = fp._find_sink_class(ast.parse(fixed_src), "x")[0]
absent_src = src.replace("class BatchAttentionWithAttentionSinkWrapper", "class SomethingElse")
odd_src = src.replace(old, "batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_{variant}_swa_")
def probe_with(core_src):
    import unittest.mock as m
    tree = ast.parse(core_src)
    with m.patch.object(_source, "module_ast", lambda name, modules=None: tree):
        return fp.probe({"flashinfer.attention": trees["flashinfer.attention"], "flashinfer.prefill": trees["flashinfer.prefill"]})
verdict = fp.PATCHES[0]
from flashfix.core import registry as _registry
print("FLASHFIX_RESULT=" + json.dumps({
    "real": real.kind, "fixed": probe_with(fixed_src).kind, "absent": probe_with(absent_src).kind,
    "odd": probe_with(odd_src).kind, "fixed_class": fixed is not None,
    "judge": _registry.judge(verdict, trees, "0.6.16.post3")[0],
    "judge_new": _registry.judge(verdict, trees, "0.7.5")[0],
    "imported": [m for m in ("torch", "flashinfer") if m in __import__("sys").modules],
}))
'''


def test_probe_reads_source_without_importing():
    (r,) = engine_env.run(ENV, PROBE)
    assert r["imported"] == []  # doctor's path: no engine import
    assert r["real"] == "buggy"
    assert r["judge"] == "patch"
    assert r["judge_new"] == "unknown-shape"  # pre-fix shape on a release past the range: left alone
    assert r["fixed"] == "fixed"  # name with the KV dtype and head dims, as FlashInfer 0.7.4 builds it
    assert r["absent"] == "absent"
    assert r["odd"] == "unknown"


def test_declaration():
    from flashfix import flashinfer_patch

    (patch,) = flashinfer_patch.PATCHES
    assert patch.id == "flashinfer-sink-jit-name" and patch.engine == "flashinfer-python"
    tree = ast.parse(Path(flashinfer_patch.__file__).read_text())
    top_imports = {a.name.split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names} | {n.module.split(".")[0] for n in tree.body
                                        if isinstance(n, ast.ImportFrom) and n.module}
    assert not top_imports & {"torch", "flashinfer", "wrapt"}


def test_doctor_on_real_flashinfer_wheels(tmp_path):
    """The probe against FlashInfer's own released source: 0.7.2.post1 has the bug, 0.7.4 names
    the kernel by KV dtype and head dims (fixed upstream). Each release is unpacked into a folder
    on PYTHONPATH, its dist-info giving the version to the doctor."""
    import subprocess

    from conftest import run_py

    verdicts = {}
    for version in ("0.7.2.post1", "0.7.4"):
        dest = tmp_path / version
        # pure-Python wheel: unpacked into a plain folder (no dependencies), dist-info included
        subprocess.run(["uv", "pip", "install", "-q", "--no-deps", "--target", str(dest / "site"),
                        "flashinfer-python==%s" % version], check=True)
        (rows,), _ = run_py('''
            from flashfix.tools import doctor as _doctor
            rows, _ = _doctor.diagnose()
            report(rows=[r for r in rows if r["engine"] == "flashinfer-python"],
                   heavy=[m for m in ("torch", "flashinfer") if m in sys.modules])
        ''', dest / "site")
        assert rows["heavy"] == []
        (row,) = rows["rows"]
        assert row["engine_version"] == version
        verdicts[version] = row["verdict"]
    assert verdicts == {"0.7.2.post1": "patch", "0.7.4": "fixed-upstream"}


FIXED_NAME = ("batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_swa_",
              "batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_"
              "{filename_safe_dtype_map[kv_data_type]}_{head_dim_qk}_{head_dim_vo}_swa_")


def _flashinfer_copy(dest, init_edit):
    """The probe's files of FlashInfer 0.6.16.post3 (vLLM 0.28.0's), copied from its wheel's install into
    ``dest``, with ``attention/_fixed.py``: ``_core.py`` naming the kernel as FlashInfer 0.7.4 does.
    ``init_edit(text)`` gives the new ``attention/__init__.py``."""
    site = next((engine_env.env_python(ENV).parent.parent / "lib").glob("python*/site-packages"))
    for relative in ("flashinfer/__init__.py", "flashinfer/prefill.py", "flashinfer/attention/__init__.py",
                     "flashinfer/attention/_core.py"):
        (dest / relative).parent.mkdir(parents=True, exist_ok=True)
        (dest / relative).write_text((site / relative).read_text())
    core = (dest / "flashinfer/attention/_core.py").read_text()
    assert FIXED_NAME[0] in core
    (dest / "flashinfer/attention/_fixed.py").write_text(core.replace(*FIXED_NAME))
    init = dest / "flashinfer/attention/__init__.py"
    init.write_text(init_edit(init.read_text()))


def test_probe_reads_the_binding_python_uses(tmp_path):
    """``flashinfer.attention`` binds the sink wrapper by its LAST top-level binding: the probe
    follows that import, not the first one in the file."""
    from flashfix import flashinfer_patch as fp
    from flashfix.core import locate as _locate, paths as _paths, registry as _registry

    line = "from ._fixed import BatchAttentionWithAttentionSinkWrapper\n"
    edits = {
        "earlier import": lambda text: line + text,  # Python binds _core's (buggy) class
        "later rebinding": lambda text: text + line,  # Python binds _fixed's class
        "last binding in a try": lambda text: text + "try:\n    " + line + "except ImportError:\n    pass\n",
    }
    shapes = {}
    for case, edit in edits.items():
        dest = tmp_path / case.replace(" ", "_")
        _flashinfer_copy(dest, edit)
        with _locate.reading(_paths.PathReader([dest])):
            trees = _registry.read_trees(fp.PATCHES[0].targets)
            shapes[case] = _registry.judge(fp.PATCHES[0], trees, "0.6.16.post3")
    assert shapes["earlier import"] == ("patch", "the sink kernel name in flashinfer.attention._core holds only "
                                        "backend, q_data_type, window_left: wrappers differing in KV dtype or head "
                                        "dims share one kernel in a process")
    assert shapes["later rebinding"] == (
        "fixed-upstream", "the sink kernel name in flashinfer.attention._fixed includes the KV dtype and head dims")
    verdict, reason = shapes["last binding in a try"]  # which import wins depends on run time: not read as either
    assert verdict == "unknown-shape" and "is last bound at line" in reason, reason


def test_name_table_two_configurations_with_one_suffix(caplog):
    """Two configurations that differ only past the dtypes and head dims (here the last JIT argument)
    get the same suffix: the second one also gets a digest, and each keeps its name."""
    from flashfix import flashinfer_patch as fp

    base = "batch_prefill_attention_sink_bf16_swa_False_fa2"

    def config(kv, source):
        return fp._config([base, "torch.bfloat16", kv, "torch.bfloat16", "torch.int32", 64, 64, source], None)

    table = fp.NameTable()
    names = [table.assign(config(kv, source))[0] for kv, source in [
        ("torch.bfloat16", "a"), ("torch.float8_e4m3fn", "a"), ("torch.float8_e4m3fn", "b"),
        ("torch.float8_e4m3fn", "a"), ("torch.float8_e4m3fn", "b"), ("torch.bfloat16", "a")]]
    suffixed = base + "_kv_float8_e4m3fn_o_bfloat16_hd_64_64"
    assert names[:2] == [base, suffixed] and names[2].startswith(suffixed + "_") and len(names[2]) == len(suffixed) + 11
    assert names[3:] == names[1:3] + [base]
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2
