"""A release's own function run as a derived pre-fix shape, and that shape patched, in one engine
process: flashfix's rewrite machinery swaps the derived body into the loaded function (with or
without the patch's edit), ``cases()`` runs, and the swap is undone. Also how a pre-fix shape is
derived from a fixed release's module by turning one spelling back inside one def (``replaced_in_def``)."""

import ast
import copy

from flashfix.core import registry as _registry
from flashfix.core import source as _source


def replaced_in_def(text, qualname, old, new):
    """``text`` with the one ``old`` inside the def at ``qualname`` spelled ``new`` (an upstream fix turned back)."""
    func = _source.find_def(ast.parse(text), qualname)
    lines = text.splitlines(True)
    body = "".join(lines[func.lineno - 1:func.end_lineno])
    assert body.count(old) == 1, body
    return "".join(lines[:func.lineno - 1]) + body.replace(old, new) + "".join(lines[func.end_lineno:])


def turned_back(text, qualname, spellings):
    """``replaced_in_def`` for each ``(fixed, pre-fix)`` pair of ``spellings``, in order."""
    for old, new in spellings:
        text = replaced_in_def(text, qualname, old, new)
    return text


def pre_fix_and_patched(func, derived, rule, cases):
    """``(cases() on ``derived``'s body, cases() on it once ``rule`` edited it)``, ``func`` restored after each."""
    def run(edit_too):
        def edit(node, mark):
            node.body = copy.deepcopy(derived.body)
            if edit_too:
                rule.edit(node, mark)
        change = _registry.rewrite(func, edit, "test-derived")
        change.apply()
        try:
            return cases()
        finally:
            change.undo()
    return run(False), run(True)
