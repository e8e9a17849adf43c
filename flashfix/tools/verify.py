"""``flashfix verify``: are the fixes in force and numerically right on this GPU and FlashInfer? Meant for an
image pipeline, on the target GPU, before traffic reaches it: (1) the doctor's verdict per patch (no engine
imported); (2) the runtime state per patch after importing the engines' target modules in a child process, as
``import flashfix`` in a server would leave them; (3) for every patch that changes numbers and applies (to the
installed engine, or to a wheel or tree given with ``--path``), a check of ``CHECKS`` in its own child process,
side by side (FlashInfer JIT-compiles about a minute per kernel variant): ``flashfix.tools.gpu_checks``.

Exit status: 0 everything that applies passed (a check that cannot run on this GPU is listed as not run, with
why); 1 a check failed or a patch that should apply is not in force; 2 a ``--path`` that cannot be read or holds
no engine, or an unknown ``--only`` id (one line on stderr, as the doctor says it); 3 no usable GPU; 4 no engine
to check.

Every child is this interpreter started without the current directory (or a script's) on ``sys.path``, so a
``json.py`` in the folder verify is run from is never imported in place of the standard library's (``_isolated``).
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import flashfix
from flashfix.core import locate as _locate, paths as _paths
from flashfix.tools import doctor as _doctor

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU, EXIT_NO_ENGINE = 0, 1, 2, 3, 4

TRTLLM = ("needs TRT-LLM's ragged DeepSeek prefill kernels, which run on SM100 only: no GPU check exists for it (the "
          "project's GPU is an SM90 H200, where vLLM never selects this backend); its CPU tests drive the engine's code")

# (name, patch id, threshold, expression run in a child with ``g`` = gpu_checks, ``patch`` = the patch id and ``path``
# = the engine's wheel or tree, None: installed). The vLLM sink patch acts on SM12x only, where FlashInfer runs fa2:
# the check forces fa2 on any GPU (on SM90 ``auto`` picks fa3, whose sliding-window kernels JIT-compile 8+ min).
CHECKS = (
    ("sink-prefill fa2", "vllm-sink-prefill", 0.005, "g.vllm_forward(patch, path, cases=('no prefix',))"),
    ("sink-prefill fa2 window", "vllm-sink-prefill", 0.005, "g.vllm_forward(patch, path, cases=('sliding window 128',))"),
    ("fp8-kv-sharing", "vllm-fp8-kv-sharing-view", 0.01, "g.vllm_forward(patch, path)"),
    ("layer-heads-plan", "vllm-layer-heads-plan", 0.01, "g.vllm_forward(patch, path)"),
    ("fp8-paged", "sglang-fp8-kv-scales", 0.01, "g.sglang_fp8(path)"),
    ("swa-layer-ragged-prefix", "sglang-swa-ragged-prefix-extend-slots", 0.01, "g.sglang_plan(patch, path)"),
    ("swa-layer-ragged-prefix-0.5.10", "sglang-swa-ragged-prefix-slots-0.5.10", 0.01, "g.sglang_plan(patch, path)"),
    ("swa-full-attn-ragged", "sglang-swa-full-attn-ragged-prefix", 0.01, "g.sglang_plan(patch, path)"),
    ("swa-paged-plan-window", "sglang-swa-paged-plan-window-left", 0.01, "g.sglang_plan(patch, path)"),
    ("per-layer-heads-plan", "sglang-per-layer-heads-plan", 0.01, "g.sglang_plan(patch, path)"),
    ("cross-attn-decode-plan", "sglang-cross-attn-decode-plan-lens", 0.01, "g.sglang_plan(patch, path)"),
    ("merge-state-launch-limit", "sglang-merge-state-launch-limit", 0.01, "g.sglang_merge(patch, path)"),
    ("merge-state-fallback-lse", "sglang-merge-state-fallback-lse-base", 0.01, "g.sglang_merge(patch, path)"),
    ("mla-chunked-prefix-lse", "sglang-mla-chunked-prefix-lse-base", 0.01, "g.sglang_mla_chunk(patch, path)"),
    ("softcap-plan", "sglang-flashinfer-logit-softcap-plan", 0.01, "g.sglang_softcap(patch, path)"),
    ("sink-jit-name", "flashinfer-sink-jit-name", 0.005, "g.sink_sequence([('bf16', 64), ('fp8', 64)])['rows']"),
    ("mla-prefill-lse", "vllm-mla-flashinfer-lse", 0.01, "g.vllm_lse(patch, path)"),
    ("dcp-prefill-lse", "vllm-dcp-prefill-lse", 0.01, "g.vllm_lse(patch, path)"),
    ("mla-trtllm-ragged-lse", "vllm-mla-trtllm-ragged-lse", 0.01, "[{'case': 'not run', 'not_run': %r}]" % TRTLLM),
)
THRESHOLDS = {patch: threshold for _, patch, threshold, _ in CHECKS}


def _jit_dir(name):
    """A FlashInfer JIT workspace per check, kept between runs (a second verify reuses the kernels): checks
    run side by side, and two processes must never build the same kernel name in one folder at once."""
    base = os.environ.get("FLASHFIX_VERIFY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flashfix", "verify")
    return os.path.join(base, name.replace(" ", "-"))


_GPU_PROBE = """
import json
try:
    import torch
except Exception as exc:
    print(json.dumps({"ok": False, "why": "torch cannot be imported (%r)" % (exc,)})); raise SystemExit
if not torch.cuda.is_available():
    print(json.dumps({"ok": False, "why": "torch %s sees no CUDA device" % torch.__version__})); raise SystemExit
try:
    import flashinfer
    fi = flashinfer.__version__
except Exception as exc:
    fi = None
print(json.dumps({"ok": True, "name": torch.cuda.get_device_name(),
                  "capability": list(torch.cuda.get_device_capability()), "torch": torch.__version__, "flashinfer": fi}))
"""

_RUNTIME = """
import contextlib, importlib, json
import flashfix
from flashfix.core import registry as _registry
for patch in [p for p in _registry.load_all() if _registry.engine_version(p.engine) is not None]:
    for target in _registry.targets_of(patch):
        with contextlib.suppress(Exception):
            importlib.import_module(target)
print("FLASHFIX_RESULT=" + json.dumps(flashfix.status()))
"""


def _same_dir(a, b):
    return bool(a) and os.path.realpath(a) == os.path.realpath(b)


def _isolated(code, env=None, version=sys.version_info):
    """``(argv, env)`` that run ``code`` in this interpreter with this process's ``sys.path`` less its first
    entry (the current directory under ``-c``/``-m``, a script's folder), which ``-c`` would put first: on
    Python 3.11+ through ``-P`` (``PYTHONPATH`` and site as here), before through ``-I`` and the path list set
    explicitly (``-I`` ignores ``PYTHONPATH``). The folder flashfix is imported from is kept where only that
    first entry gave it (``python -m flashfix`` run in a checkout)."""
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashfix.__file__)))
    rest = sys.path[0 if getattr(sys.flags, "safe_path", False) else 1:]
    extra = [] if any(_same_dir(p, root) for p in rest) else [root]
    if tuple(version) >= (3, 11):
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return [sys.executable, "-P", "-c", code], env
    return [sys.executable, "-I", "-c", "import sys; sys.path[:] = %r\n%s" % (extra + rest, code)], env


def _child(code):
    argv, env = _isolated(code)
    return subprocess.run(argv, capture_output=True, text=True, env=env)


def _last_json(text, prefix=""):
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            with contextlib.suppress(ValueError):
                return json.loads(line[len(prefix):])
    return None


def _say(message, as_json):
    print(message, file=sys.stderr if as_json else sys.stdout, flush=True)


def _stop(code, message, as_json, **report):
    """Say why verify cannot check (the JSON report on stdout too) and return ``code``."""
    _say("flashfix verify: %s." % message, as_json)
    if as_json:
        print(json.dumps(dict({"exit": code}, **report)))
    return code


def _run_checks(wanted, as_json, start):
    """Run the numeric checks of the patches in ``wanted`` (``{(patch id, path)}``, path: the engine's wheel
    or tree, None for the installed engine) side by side in child processes, with progress lines."""
    procs = {}
    for (name, patch_id, _, expr), path in [(c, p) for c in CHECKS for i, p in sorted(wanted, key=str) if i == c[1]]:
        name += " (%s)" % os.path.basename(path.rstrip("/")) if path else ""
        code = ("import json; from flashfix.tools import gpu_checks as g; path, patch = %r, %r\n"
                "print('FLASHFIX_RESULT=' + json.dumps(%s, default=repr))" % (path, patch_id, expr))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        argv, env = _isolated(code, dict(os.environ, FLASHINFER_WORKSPACE_BASE=_jit_dir(name)))
        procs[name] = (patch_id, subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env), out, err)
    if procs:
        _say("[%5.0fs] running %d GPU checks: %s (FlashInfer JIT-compiles about a minute per kernel variant on "
             "first use)" % (time.time() - start, len(procs), ", ".join(procs)), as_json)
    results, tick = [], time.time()
    while procs:
        time.sleep(0.5)
        for name, (patch_id, proc, out, err) in list(procs.items()):
            if proc.poll() is not None:
                del procs[name]
                results.append(_result(name, patch_id, proc, *[f.seek(0) or f.read() for f in (out, err)]))
                _say("[%5.0fs] %s: %s" % (time.time() - start, name, _summary(results[-1])), as_json)
        if procs and time.time() - tick >= 15:
            tick = time.time()
            _say("[%5.0fs] still running: %s" % (time.time() - start, ", ".join(procs)), as_json)
    return results


def _result(name, patch_id, proc, out, err):
    """A check passes when every measured row is within the threshold, every control is bitwise
    equal, and no row failed; a row whose failure the unpatched engine shares is a mismatch."""
    rows = _last_json(out, "FLASHFIX_RESULT=")
    threshold = THRESHOLDS[patch_id]
    if proc.returncode != 0 or rows is None:
        return {"check": name, "patch": patch_id, "passed": False, "threshold": threshold,
                "error": "check crashed (exit %s): %s" % (proc.returncode, err.strip()[-1500:])}
    if rows and all(r.get("not_run") for r in rows):  # neither a pass nor a failure: said as such
        return {"check": name, "patch": patch_id, "passed": None, "threshold": threshold, "not_run": rows[0]["not_run"]}
    problems = []
    for r in [r for r in rows if not r.get("mismatch")]:
        e = r.get("err_flashfix", r.get("err"))
        # a measured row's failure as released is the released code's outcome (said), not flashfix failing
        if error := r.get("error") or r.get("error_flashfix") or r.get("control") and r.get("error_pre_fix"):
            problems.append("%s: %s" % (r.get("case"), error))
        elif r.get("control") and not r.get("bitwise_equal"):
            problems.append("%s: not bitwise equal" % r["case"])
        elif not r.get("control") and (e is None or e > threshold):
            problems.append("%s: error %s" % (r.get("case", r.get("step")), e))
    errs = [r.get("err_flashfix", r.get("err")) for r in rows if not r.get("control")]
    return {"check": name, "patch": patch_id, "threshold": threshold, "passed": not problems, "problems": problems,
            "mismatches": [r["mismatch"] for r in rows if r.get("mismatch")],
            "max_err_flashfix": max([e for e in errs if e is not None], default=None),
            "max_err_pre_fix": max([r["err_pre_fix"] for r in rows if r.get("err_pre_fix") is not None], default=None),
            "rows": rows}


def _summary(result):
    if "not_run" in result:
        return "NOT RUN (not a pass): " + result["not_run"]
    if "error" in result:
        return "FAIL, " + result["error"].splitlines()[-1] if result["error"] else "FAIL"
    text = "%s, max relative error with flashfix %s (threshold %g)" % (
        "pass" if result["passed"] else "FAIL", "%.4g" % result["max_err_flashfix"] if result["max_err_flashfix"]
        is not None else "-", result["threshold"])
    if result.get("max_err_pre_fix") is not None:
        text += ", without the fix %.4g" % result["max_err_pre_fix"]
    text += "".join(", without the fix: " + e for e in dict.fromkeys(
        r["error_pre_fix"] for r in result["rows"] if r.get("error_pre_fix") and not r.get("control")))
    return text + "".join("; " + p for p in dict.fromkeys(result["problems"] + result["mismatches"]))  # each once


def run(as_json=False, paths=(), only=()):
    """``paths``: engines' wheels or trees to check, loaded with stand-ins for their other modules;
    ``only``: run the numeric checks of these patch ids alone."""
    start = time.time()
    trees = []
    for path in paths:  # unreadable, or no engine there: one line, as ``doctor --path`` says it
        trees.append(_paths.open_path(path))
        _doctor.check_holds_an_engine(trees[-1], path)
    rows, _ = _doctor.diagnose()
    unknown = [i for i in dict.fromkeys(only) if i and i not in {r["id"] for r in rows}]
    if unknown:
        sys.stderr.write("flashfix verify: --only: unknown patch id%s: %s (`flashfix doctor` lists the ids)\n" % (
            "s" if len(unknown) > 1 else "", ", ".join(unknown)))
        return EXIT_USAGE
    wanted = {(r["id"], None) for r in rows if r["verdict"] == "patch"}
    for path, tree in zip(paths, trees):  # judged as the check loads it: the tree, then this interpreter's FlashInfer
        found = [r for r in _doctor.diagnose(_paths.Composite([tree, _locate.reader()]))[0] if tree.version(r["engine"])]
        wanted |= {(r["id"], path) for r in found if r["verdict"] == "patch"}
        for r in found:
            _say("[%5.0fs] %s: %-26s %s %s, doctor: %s" % (time.time() - start, path, r["id"], r["engine"],
                                                           r["engine_version"], r["verdict"]), as_json)
    if not paths and all(r["verdict"] == "not-installed" for r in rows):
        return _stop(EXIT_NO_ENGINE, "no engine to check: none of vLLM, SGLang or FlashInfer is installed in this "
                     "environment (%s)" % sys.executable, as_json, reason="no engine")
    probe = _child(_GPU_PROBE)
    gpu = _last_json(probe.stdout) or {"ok": False, "why": "GPU probe failed: %s" % probe.stderr.strip()[-500:]}
    if not gpu["ok"]:
        return _stop(EXIT_NO_GPU, "no GPU to check on: %s" % gpu["why"], as_json, reason="no GPU", detail=gpu["why"])
    _say("[%5.0fs] GPU: %s (SM%d%d), torch %s, FlashInfer %s" % (
        time.time() - start, gpu["name"], gpu["capability"][0], gpu["capability"][1], gpu["torch"], gpu["flashinfer"]),
        as_json)
    if gpu["capability"][0] != 12:
        _say("[%5.0fs] note: this GPU is not SM12x; the vLLM sink-prefill check fakes device capability family 120 "
             "for flashfix's factory, so it runs the sink wrapper as on SM12x" % (time.time() - start), as_json)
    runtime = {r["id"]: r for r in (_last_json(_child(_RUNTIME).stdout, "FLASHFIX_RESULT=") or [])}
    failures, report = [], []
    for row in rows:
        state = runtime.get(row["id"], {}).get("state", "unknown (runtime child failed)")
        expected = "applied" if row["verdict"] == "patch" else row["verdict"]
        in_force = state == expected or (row["verdict"] == "not-installed")
        if not in_force:
            failures.append("%s: doctor said %s but runtime state is %s" % (row["id"], row["verdict"], state))
        report.append({"id": row["id"], "engine": row["engine"], "engine_version": row["engine_version"],
                       "verdict": row["verdict"], "runtime_state": state, "consistent": in_force})
        _say("[%5.0fs] %-26s %-18s %-14s doctor: %-15s runtime: %s" % (
            time.time() - start, row["id"], row["engine"], row["engine_version"] or "-", row["verdict"], state), as_json)
    checks = []
    if gpu["flashinfer"] is None:
        failures.append("FlashInfer cannot be imported: no numeric check can run")
    else:
        checks = _run_checks({w for w in wanted if w[0] in THRESHOLDS and (not only or w[0] in only)}, as_json, start)
        failures += ["%s: %s" % (c["check"], _summary(c)) for c in checks if c["passed"] is False]
    skipped = ["%s: %s" % (c["check"], _summary(c)) for c in checks if c["passed"] is None] + [
        "%s: NOT RUN: no GPU check exists for it (CPU-tested)" % p for p in sorted({w[0] for w in wanted} - set(THRESHOLDS))]
    code = EXIT_FAILED if failures else EXIT_OK
    _say("flashfix verify: %s in %.0f s%s" % ("FAILED" if failures else "all checks that ran passed" if skipped else
                                              "all checks passed", time.time() - start,
                                              "".join("\n  - " + f for f in failures + skipped)), as_json)
    if as_json:
        print(json.dumps({"exit": code, "gpu": gpu, "patches": report, "checks": checks, "failures": failures,
                          "seconds": round(time.time() - start, 1)}, indent=1, default=repr))
    return code
