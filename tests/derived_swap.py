"""A release's own function run as a derived pre-fix shape, and that shape patched, in one engine
process: flashfix's rewrite machinery swaps the derived body into the loaded function (with or
without the patch's edit), ``cases()`` runs, and the swap is undone."""

import copy

from flashfix.core import registry as _registry


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
