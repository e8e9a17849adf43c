"""The SGLang probes' newer cases on real wheel source, read through the sweep's reader.

Run by tests/test_sweep.py in its own interpreter (PYTHONPATH = this checkout); prints one
``FLASHFIX_RESULT=`` JSON line. Every tree here is a module of a released SGLang wheel, read
over HTTP range requests; the two "control" cases change one real tree in one place, to show
that "not affected" needs the feature to be truly absent, not merely unmatched.
"""

import ast
import copy
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sweep_releases", REPO / "scripts" / "sweep_releases.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)

from flashfix import sglang_patch
from flashfix.core import locate as _locate
from flashfix.core import source as _source  # noqa: E402
from flashfix.core.registry import ABSENT  # noqa: E402

MODEL_RUNNER = sglang_patch.AUTOTUNE_SITES[0][0]
MODEL_CONFIG = sglang_patch.VISION_CONFIG.targets[0]
BACKEND = sglang_patch.FP8_KV_SCALES.targets[0]
AUTOTUNE = sglang_patch.SM120_FP8_AUTOTUNE.rule


def trees_of(version, modules):
    reader = sweep.wheel_reader("sglang", version)
    with _locate.reading(reader):
        return reader.version("sglang"), {m: _source.module_ast(m) for m in modules}


def autotune(trees):
    defs = AUTOTUNE.locate(trees.get)
    module, qualname, node = defs[0] if len(defs) == 1 else (None, None, None)
    shape = AUTOTUNE.shape(trees.get)[0]
    return {"module": module, "qualname": qualname, "node": node is not None, "kind": shape.kind,
            "reason": shape.reason}


def vision(tree):
    shape = sglang_patch.VISION_CONFIG.probe({MODEL_CONFIG: tree})
    return {"kind": shape.kind, "reason": shape.reason}


def calls_of(func_def):
    """Every FlashInfer wrapper call in ``forward_extend``: (wrapper expression, method) -> source."""
    found = {}
    for call in ast.walk(func_def):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                and call.func.attr in ("forward", "forward_return_lse"):
            found["%s.%s" % (ast.unparse(call.func.value), call.func.attr)] = ast.unparse(call)
    return found


def is_marker(stmt):
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == _source.MARK_NAME)


def fp8_edit(tree):
    """Run the patch's own edit on the release's ``forward_extend`` and say what changed."""
    original = _source.find_def(tree, "FlashInferAttnBackend.forward_extend")
    edited = copy.deepcopy(original)
    mark = _source.marker("sglang-fp8-kv-scales:test")
    sglang_patch.FP8_KV_SCALES.rule.hunks[0].edit(edited, mark)  # the declaration's own edit
    before, after = calls_of(original), calls_of(edited)
    lse = [c for c in ast.walk(edited) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
           and c.func.attr == "forward_return_lse" and ast.unparse(c.func.value) == "prefill_wrapper_paged"][0]
    forward = [c for c in ast.walk(edited) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
               and c.func.attr == "forward" and ast.unparse(c.func.value) == "prefill_wrapper_paged"][0]
    model = {kw.arg: kw.value for kw in forward.keywords}
    added = lse.keywords[-2:]
    # Undo exactly what the edit is meant to have done; what remains must be the released function.
    undone = copy.deepcopy(edited)
    for node in ast.walk(undone):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                block[:] = [s for s in block if not is_marker(s)]
    undone_lse = [c for c in ast.walk(undone) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                  and c.func.attr == "forward_return_lse" and ast.unparse(c.func.value) == "prefill_wrapper_paged"][0]
    del undone_lse.keywords[-2:]
    compile(ast.fix_missing_locations(ast.Module([copy.deepcopy(edited)], [])), "<edited>", "exec")
    after_marker = []
    for node in ast.walk(edited):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                after_marker += [ast.unparse(block[i + 1]) for i, s in enumerate(block[:-1]) if is_marker(s)]
    return {
        "changed": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
        "lse_before": before.get("prefill_wrapper_paged.forward_return_lse"),
        "lse_after": after.get("prefill_wrapper_paged.forward_return_lse"),
        "added": ["%s=%s" % (kw.arg, ast.unparse(kw.value)) for kw in added],
        "added_are_copies": all(kw.value is not model[kw.arg] for kw in added),
        "ragged": {k: before[k] == after.get(k) for k in before if k.startswith("self.prefill_wrapper_ragged")},
        "rest_unchanged": ast.dump(undone) == ast.dump(original),
        "after_marker": after_marker,
    }


def main():
    out = {}
    sites = [m for m, _ in sglang_patch.AUTOTUNE_SITES]
    for version in ("0.5.1", "0.5.1.post3", "0.5.5", "0.5.5.post1", "0.5.5.post3", "0.5.6"):
        wheel_version, trees = trees_of(version, sites + [MODEL_CONFIG, BACKEND])
        out[version] = {
            "wheel_version": wheel_version,
            "present": {m: isinstance(t, ast.Module) for m, t in trees.items()},
            "autotune": autotune({m: trees[m] for m in sites}),
            "vision": vision(trees[MODEL_CONFIG]),
            "fp8_probe": sglang_patch.FP8_KV_SCALES.probe({BACKEND: trees[BACKEND]}).kind,
            "fp8_edit": fp8_edit(trees[BACKEND]) if version in ("0.5.1", "0.5.1.post3", "0.5.5.post1") else None,
        }
        if version == "0.5.6":
            # Control: 0.5.6's decision method renamed away; its call, the autotuner import and the
            # server flag remain, so the code is about autotuning but has no decision we know.
            runner = copy.deepcopy(trees[MODEL_RUNNER])
            _source.find_def(runner, "ModelRunner._should_run_flashinfer_autotune").name = "_renamed"
            out["control_autotune"] = autotune(dict({m: trees[m] for m in sites}, **{MODEL_RUNNER: runner}))
        if version == "0.5.5":
            # Control: 0.5.5's ModelConfig.__init__ given a constant is_image_understandable_model.
            config = copy.deepcopy(trees[MODEL_CONFIG])
            init = _source.find_def(config, "ModelConfig.__init__")
            init.body.append(ast.parse("self.is_image_understandable_model = False").body[0])
            out["control_vision"] = vision(config)
            # Control: the absent case still needs ModelConfig itself to be the class we read.
            based = copy.deepcopy(trees[MODEL_CONFIG])
            _source.find_def(based, "ModelConfig").bases.append(ast.Name("SomeMixin", ast.Load()))
            out["control_vision_base"] = vision(based)
    out["absent_kind"] = ABSENT
    print("FLASHFIX_RESULT=" + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
