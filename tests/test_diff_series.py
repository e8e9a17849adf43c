"""``flashfix diff --series`` on a real release's own code (SGLang 0.5.14, whose FlashInfer backend carries four
functions that several patches rewrite): for each function, the printed "after" side, compiled, is the code the
runtime swaps in for the whole series once the engine's module is imported with flashfix active (code object
tree against code object tree), and the members it names are the runtime's, in its order. One process."""

import engine_env
from conftest import REPO

CODE = '''
import ast, importlib, io, json, sys
sys.path.insert(0, %(tests)r)
import vet_helpers
from flashfix.tools import diff as _diff
from flashfix.core import registry as _registry, source as _source

diffs = _diff.plan()
found = _diff.series(diffs)
buffer = io.StringIO()
for s in found:
    s.write(buffer)
text = buffer.getvalue()
sections = [h for old, new, h in vet_helpers.file_diffs(text) if new.endswith(" (as flashfix runs it)")]
import flashfix  # noqa: F401  (active: the import below applies the patches)
checks = []
for s, hunks in zip(found, sections):
    module = importlib.import_module(s.module)
    owner, name = s.qualname.rsplit(".", 1)
    func = getattr(getattr(module, owner), name)
    stack = _registry._stacks.get(id(func))
    module_text, origin = _source.function_source(func)
    tree = _source.parse_text(module_text, origin)
    after = vet_helpers.apply_unified_diff(s.text, hunks)
    compiled = _source._compile(_source._like(func), _source.find_def(ast.parse(after), s.qualname), tree)
    checks.append(dict(function=s.qualname, members=s.members, runtime=stack.ids if stack else None,
                       difference=_source.code_difference(compiled, stack.current.plain) if stack else "no series",
                       text_is_file=module_text == s.text))
print("FLASHFIX_RESULT=" + json.dumps(dict(sections=len(sections), checks=checks,
                                           states={r["id"]: r["state"] for r in flashfix.status()}), default=repr))
'''


def test_series_diff_is_the_code_the_runtime_runs():
    ((out,),) = [engine_env.run("sglang==0.5.14", CODE % {"tests": str(REPO / "tests")})]
    checks = {c["function"]: c for c in out["checks"]}
    assert out["sections"] == len(out["checks"]) and set(checks) == {
        "FlashInferIndicesUpdaterDecode.__init__", "FlashInferIndicesUpdaterPrefill.__init__",
        "FlashInferIndicesUpdaterPrefill.update_sliding_window", "FlashInferIndicesUpdaterPrefill.call_begin_forward"}, out
    assert checks["FlashInferIndicesUpdaterPrefill.call_begin_forward"]["members"] == [
        "sglang-flashinfer-logit-softcap-plan", "sglang-swa-paged-plan-window-left"], checks
    for function, check in checks.items():
        assert check["members"] == check["runtime"], check  # the runtime's series, in its order
        assert check["difference"] is None and check["text_is_file"], check
        assert all(out["states"][pid] == "applied" for pid in check["members"]), out["states"]
