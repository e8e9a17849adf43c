"""The modules only deciding a patch needs, imported on first use.

Judging a declaration and compiling its change needs the matcher, the source reader and the renderer
(``HEAVY``, about 60 % of flashfix's code). The registry, the packs' declarations and their helpers reach them
only through ``Module`` proxies, so a process that decides nothing (no engine imported, every patch disabled)
never imports them. Once imported they stay, as any module does: flashfix never takes a module out of
``sys.modules`` and never calls the garbage collector (``gc.freeze``, ``unfreeze``, ``collect``) on the
application's behalf; those belong to the application (docs/guarantees.md). What the decisions cost is kept
small by reading no more source than they need and by dropping the reader's caches (``forget``).
"""

import importlib
import sys

HEAVY = ("flashfix.core.matcher", "flashfix.core.source", "flashfix.core.render", "flashfix.core.locate",
         "flashfix.tools.remote_probe")


class Module:
    """Stands for the module ``name``: reading an attribute imports it (once), then reads it there."""

    __slots__ = ("_name",)

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self):
        return "<flashfix.core.lazy.Module %s>" % self._name


def forget():
    """Drop the source reader's caches, if it is loaded (an engine process keeps none of its trees)."""
    source = sys.modules.get("flashfix.core.source")
    if source is not None:
        source.forget()
