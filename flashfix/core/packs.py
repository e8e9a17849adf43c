"""Patch packs: backports that any distribution contributes through the entry-point group
``flashfix.patches``.

An entry point's *name* is the engine's top-level package whose import loads it (a key of
``flashfix.PATCH_MODULES``); its *value* is a module, or a ``module:attribute`` object, with
``PATCHES``: the ``Patch`` objects it declares (a ``flashfix.semantic.Backport`` is one). A pack
that patches two engines declares two entry points. flashfix's own patch modules are entries of
this group too, loaded by the same ``load``; a copy without installed metadata (a source
checkout), or whose metadata is another copy's, adds those the metadata does not list
(``builtin``).

The entry points are read when an engine's top-level package is first imported (never at
interpreter start), and by ``status``, ``doctor``, ``diff`` and the sweep. If only flashfix's own
are installed, that engine's are imported; else every pack is, flashfix's own first, so ids are
claimed in one order whichever engine comes first.

A pack is loaded whole or not at all: if its import fails, it has no ``PATCHES``, a declaration
is not a well-formed ``Patch``, or an id is taken or repeated, none of its patches is registered
and one problem line names the distribution and the entry point (the registry logs it; under
``FLASHFIX_STRICT=1`` the engine's import fails with ``PatchError``).

Another environment's packs (``doctor --path``/``--python``) are listed from its metadata and named,
not run, or with ``--run-packs`` imported *here* from the folder or wheel that holds their module
(a temporary ``sys.path`` entry), so this flashfix judges them; flashfix's own entries there are
skipped.
"""

import importlib
import os
import sys
from collections import namedtuple

import flashfix


def _normal(dist):
    """A distribution name as PEP 503 normalises it."""
    import re

    return re.sub(r"[-_.]+", "-", dist).lower()


GROUP = "flashfix.patches"
OWN = "flashfix"

# top: the engine package whose import loads it; name, value: the entry point; dist: the
# distribution that declares it; root: the sys.path entry to import it from (None: this
# interpreter's sys.path); builtin: one of flashfix's own modules not listed in the metadata.
Entry = namedtuple("Entry", "top name value dist root builtin", defaults=(None, False))


def skipped(entry, problem):
    """The problem line of a pack that is skipped: its distribution, its entry point and why."""
    return "pack %s (entry point %s = %s%s) skipped, none of its patches is loaded: %s" % (
        entry.dist or "?", entry.name, entry.value, ", built in" if entry.builtin else "", problem)


def _merge(listed):
    """flashfix's own entries first (listed or built in: its ids win over a pack's), in ``PATCH_MODULES``
    order (so the doctor's rows are the same from an installed flashfix and from a source checkout),
    then the other packs in the metadata's order."""
    own = [e for e in listed if e.dist is not None and _normal(e.dist) == OWN]
    values = {e.value for e in own}
    order = {module: i for i, module in enumerate(flashfix.PATCH_MODULES.values())}
    builtin = [Entry(top, top, module, OWN, None, True) for top, module in flashfix.PATCH_MODULES.items()]
    ours = sorted(own + [e for e in builtin if e.value not in values],
                  key=lambda e: order.get(e.value.split(":", 1)[0].strip(), len(order)))
    return ours + [e for e in listed if e not in own]


_installed_cache = []


def installed():
    """This interpreter's entries (read once per process; a pack installed later is seen by
    the next process), flashfix's own included."""
    if not _installed_cache:
        from importlib import metadata

        _installed_cache.append(_merge([Entry(ep.name, ep.name, ep.value, getattr(getattr(ep, "dist", None), "name", None))
                                        for ep in metadata.entry_points(group=GROUP)]))
    return _installed_cache[0]


def foreign(reader):
    """``(entries, [(entry, problem)])``: the packs listed in the environment ``reader`` reads, each with
    the folder to import it from, flashfix's own left out (this copy's patches are judged)."""
    lister = getattr(reader, "entry_points", None)
    found, problems = [], []
    for name, value, dist in (lister(GROUP) if lister is not None else ()):
        if dist is not None and _normal(dist) == OWN:
            continue
        entry = Entry(name, name, value, dist, None)
        try:
            found.append(entry._replace(root=_root(reader, value)))
        except LookupError as exc:
            problems.append((entry, "cannot be found in the environment read: %s" % exc))
    return found, problems


def _root(reader, value):
    """The sys.path entry (folder or wheel) that holds the module of ``value``, in the
    environment ``reader`` reads."""
    module = value.split(":", 1)[0].strip()
    found = reader.find(module)
    if found is None or not found.origin:
        raise LookupError("no module %s there" % module)
    archive, _, member = found.origin.partition("!/")  # a wheel's member, or a file
    parts = (member or found.origin).replace(os.sep, "/").split("/")
    depth = len(module.split(".")) + (parts[-1] == "__init__.py")
    base = "/".join(parts[:-depth]) if len(parts) > depth else ""
    if member:
        return archive + ("/" + base if base else "")
    return base.replace("/", os.sep) or os.sep


def load(entry, kind):
    """``entry``'s ``PATCHES``, checked to be ``kind`` objects (the registry's ``Patch``; ``Problem`` with the
    reason when the pack must be skipped). Imports the pack: never call it holding a lock."""
    module, _, attrs = entry.value.partition(":")
    try:
        target = _import(module.strip(), entry.root)
        for attr in attrs.split("[")[0].strip().split(".") if attrs.strip() else ():
            target = getattr(target, attr)
    except Exception as exc:
        raise Problem("cannot be imported: %r" % (exc,)) from exc
    declared = getattr(target, "PATCHES", None)
    if declared is None:
        raise Problem("%s has no PATCHES" % entry.value)
    try:
        patches = tuple(declared)
    except TypeError:
        raise Problem("its PATCHES is not an iterable of Patch objects") from None
    return check(patches, kind)


class Problem(Exception):
    """A pack that cannot be loaded; the message says why."""


def check(patches, kind):
    """``patches`` if every one is a well-formed ``kind`` (``Patch``) with its own id, else ``Problem``."""
    seen = set()
    for i, patch in enumerate(patches):
        if not isinstance(patch, kind):
            raise Problem("PATCHES[%d] is a %s, not a flashfix Patch" % (i, type(patch).__name__))
        text = [f for f in ("id", "engine", "versions", "upstream", "fixed_in", "summary")
                if not isinstance(getattr(patch, f), str) or not getattr(patch, f).strip()]
        calls = [f for f in ("probe", "prepare") if not callable(getattr(patch, f))]
        targets = patch.targets
        if not callable(targets) and not (isinstance(targets, tuple) and targets
                                          and all(isinstance(t, str) and t for t in targets)):
            calls.append("targets")
        if text or calls:
            raise Problem("PATCHES[%d] (%r) is malformed: %s" % (
                i, getattr(patch, "id", None), ", ".join(["%s missing or not a string" % f for f in text]
                                                          + ["%s missing or of the wrong type" % f for f in calls])))
        if patch.id in seen:
            raise Problem("declares the id %s twice" % patch.id)
        seen.add(patch.id)
    return patches


def _import(module, root):
    if root is None:
        return importlib.import_module(module)
    top = module.split(".")[0]
    if top == "flashfix":
        raise ImportError("a pack of another environment cannot be imported as flashfix itself")
    family = lambda name: name == top or name.startswith(top + ".")  # noqa: E731
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if family(name)}
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module)
    finally:
        if root in sys.path:
            sys.path.remove(root)
        for name in [n for n in list(sys.modules) if family(n)]:
            del sys.modules[name]  # the pack's objects live on; its modules leave this process's namespace
        sys.modules.update(saved)
