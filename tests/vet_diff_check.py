"""Runs inside one real engine environment (tests/engine_env.py), in one process; reports with
``FLASHFIX_RESULT=<json>`` lines and tests/test_vet_real.py makes the assertions.

1. ``flashfix diff`` is computed with nothing of the engine imported (the plan, and the text
   printed with and without the marker).
2. The engine's target modules are imported with flashfix active: the runtime applies its
   patches from the imported modules, as in production.
3. Each change the runtime made is set against what the diff showed: for a rewritten
   function, the "after" side of the printed unified diff (rebuilt by applying its hunks to
   the installed file) is compiled and compared with the code swapped in, code object tree
   against code object tree (``_source.code_difference``), for the marker-free code and for
   the code with the marker; the swapped code's line and column positions are compared with
   those of the rendered text, which shows that the runtime compiled that very text. That code was
   compiled from the source read just before the module ran (``_registry._read_ahead``); it is the
   very code (lines, columns, file, qualified name) that ``prepare`` makes from the imported
   function when nothing was read ahead. For a
   replaced function and an added name, the value set is compared with the flashfix
   function and the installed definitions the diff named.

``VET_MODE``: ``installed`` (the environment's engine as it is) or ``vllm-prefix`` (the vLLM
pre-fix shape derived from 0.28.0 served under the real module name, tests/vllm_prefix_shape.py).
"""

import ast
import copy
import importlib
import inspect
import io
import json
import os
import sys
import tempfile

TESTS = os.environ["VET_TESTS"]  # run with ``python -c``: no __file__
sys.path.insert(0, TESTS)

import vet_helpers  # noqa: E402
from flashfix.tools import diff as _diff
from flashfix.core import registry as _registry
from flashfix.core import render as _render
from flashfix.core import source as _source  # noqa: E402

HEAVY = ("torch", "vllm", "sglang", "flashinfer")


def report(key, value):
    print("FLASHFIX_RESULT=" + json.dumps({key: value}, default=repr), flush=True)


mode = os.environ.get("VET_MODE", "installed")
if mode == "vllm-prefix":
    import vllm_prefix_shape

    TARGET = "vllm.v1.attention.backends.flashinfer"
    prefix_path = vllm_prefix_shape.install_prefix_module(tempfile.mkdtemp(), _source.module_file(TARGET))
    report("prefix_path", prefix_path)

# --- 1. the diff, from source only ----------------------------------------------------------
plans = _diff.plan()
printed = {}
for marker in (False, True):
    buffer = io.StringIO()
    _diff.write(plans, buffer, marker=marker)
    printed[marker] = buffer.getvalue()
report("diff", {
    "heavy": sorted(m for m in HEAVY if m in sys.modules),
    "text": printed[False],
    "plans": {p.patch.id: {"verdict": p.verdict, "problem": p.problem, "kinds": [c.kind for c in p.changes]}
              for p in plans},
})

# --- 2. the runtime, from the imported engine -----------------------------------------------
import flashfix  # noqa: E402

for result in plans:
    for change in result.changes:
        importlib.import_module(change.module)
    for target in _registry.targets_of(result.patch) if result.changes else ():
        importlib.import_module(target)
states = {row["id"]: row["state"] for row in flashfix.status()}
report("states", states)


# --- 3. the diff against what the runtime swapped in -----------------------------------------
def positions(code):
    out = list(code.co_positions()) if hasattr(code, "co_positions") else list(code.co_lines())
    for const in code.co_consts:
        if isinstance(const, type(code)):
            out.append(positions(const))
    return out


def printed_rewrites(text):
    return [hunks for old, new, hunks in vet_helpers.file_diffs(text) if new.endswith(" (as flashfix runs it)")]


def made_again(patch, runtime):
    """The patch's swapped code made again from the original functions the way the runtime makes it
    when nothing was read ahead of the import (``prepare`` from the imported module), by site."""
    swaps = [c for c in runtime if isinstance(c, _registry.SwapCode)]
    current = [(c.func, c.func.__code__) for c in swaps]
    for change in swaps:
        change.func.__code__ = change.old
    try:
        again = patch.prepare({name: sys.modules[name] for name in _registry.targets_of(patch)})
    finally:
        for func, code in current:
            func.__code__ = code
        _source.forget()
    return {c.site: c for c in again if isinstance(c, _registry.SwapCode)}


def same_code(a, b):
    return (a is not None and b is not None and _source.code_difference(a, b) is None and positions(a) == positions(b)
            and (a.co_filename, a.co_firstlineno, getattr(a, "co_qualname", None))
            == (b.co_filename, b.co_firstlineno, getattr(b, "co_qualname", None)))


sections = {marker: printed_rewrites(printed[marker]) for marker in (False, True)}
section_index = -1
checks = {}
for result in plans:
    runtime = _registry._records[result.patch.id]["changes"]
    again = made_again(result.patch, runtime) if any(getattr(c, "ahead", False) for c in runtime) else {}
    rows = []
    for index, change in enumerate(result.changes):
        done = runtime[index] if index < len(runtime) else None
        row = {"kind": change.kind, "runtime": type(done).__name__}
        if change.kind == "rewrite":
            section_index += 1
            if done is None:
                rows.append(row)
                continue
            func = done.func
            module_text, origin = _source.function_source(func)
            tree = _source.parse_text(module_text, origin)
            row["qualname"] = [change.qualname, func.__qualname__]
            row["same_file_text"] = module_text == change.text and origin == change.origin
            row["site"] = [change.site, done.site]
            # compiled from the source read before the module ran: the same code as made from the imported function
            row["read_ahead"] = done.ahead
            row["ahead_equals_after"] = [same_code(done.marked, getattr(again.get(done.site), "marked", None)),
                                         same_code(done.plain, getattr(again.get(done.site), "plain", None))]
            for marker, code in ((False, done.plain), (True, done.marked)):
                after = vet_helpers.apply_unified_diff(change.text, sections[marker][section_index])
                node = _source.find_def(ast.parse(after), change.qualname)
                compiled = _source._compile(_source._like(func), node, tree)
                key = "marked" if marker else "plain"
                row["diff_equals_" + key] = _source.code_difference(compiled, code)
                version = _render.MARKED if marker else _render.PLAIN
                from_text = _source._compile(_source._like(func), change.rendered.tree(version), tree)
                row["positions_equal_" + key] = positions(from_text) == positions(code)
                row["marker_in_" + key] = _source.MARK_NAME in code.co_names
            # the edited AST compiled directly (how the code was built before _render): its
            # positions differ from the swapped code's, so the positions check above can tell
            straight = _source._compile(_source._like(func), _render._strip_markers(copy.deepcopy(change.edited)), tree)
            row["ast_positions_differ"] = positions(straight) != positions(done.plain)
        elif change.kind == "series" and done is not None:  # its own hunk, on the code the earlier members leave
            func = done.func
            tree = _source.parse_text(*_source.function_source(func))
            hunks = [h for old, new, h in vet_helpers.file_diffs(printed[False]) if new.endswith("(with %s)" % result.patch.id)]
            row["qualname"] = [change.qualname, func.__qualname__]
            row["sections"] = len(hunks)
            after = vet_helpers.apply_unified_diff(change.text, hunks[index]) if index < len(hunks) else None
            compiled = _source._compile(_source._like(func), _source.find_def(ast.parse(after), change.qualname), tree)
            stack = _registry._stacks[id(func)]  # the series through this patch, as the registry composes it
            composed = _registry.compose(func, change.earlier + [result.patch.id], stack.original)[1]
            row["diff_equals_series"] = _source.code_difference(compiled, composed)
            row["earlier_in_runtime"] = all(i in stack.ids for i in change.earlier + [result.patch.id])
        elif done is None:
            pass
        elif change.kind == "replace":
            value = done.value
            inner = [c for c in change.replacement.__code__.co_consts if isinstance(c, type(value.__code__))]
            row["owner"] = [change.owner, getattr(done.owner, "__name__", None)]
            row["name"] = [change.name, done.name]
            row["value_is_replacement"] = value.__code__ in inner and (
                value.__code__.co_filename == inspect.getsourcefile(change.replacement))
            old = done.old
            row["delegate"] = [change.delegate.origin, change.delegate.first, change.delegate.last,
                               old.__code__.co_filename, old.__code__.co_firstlineno]
        else:
            row["module"] = [change.module, getattr(done.owner, "__name__", None)]
            row["name"] = [change.name, done.name]
            source, _, attr = change.value.rpartition(".")
            row["value_named"] = done.value is getattr(importlib.import_module(source), attr)
            row["defined"] = [change.defined.origin, change.defined.first, inspect.getsourcefile(done.value),
                              inspect.getsourcelines(done.value)[1]] if change.defined is not None else None
        rows.append(row)
    checks[result.patch.id] = {"planned": len(result.changes), "runtime": len(runtime), "rows": rows}
report("checks", checks)
