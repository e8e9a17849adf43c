"""The patch registry: declarations, the two gates, atomic apply, revert and status.

A patch module (``flashfix/<engine>_patch.py``) declares ``Patch`` objects and calls
``register``. Nothing here knows any engine. For each patch, once all its target modules
are imported:

1. disabled by FLASHFIX_DISABLE?                      -> ``disabled``
2. the shape probe reads the targets' source (ast):
   fix already there -> ``fixed-upstream``; bug unreachable in this code -> ``not-affected``;
   unrecognised -> ``unknown-shape``; pre-fix shape -> 3.
3. version gate: the installed version must be inside ``versions`` (pre-releases and dev
   builds included), else ``unknown-shape``.
4. ``prepare(modules)`` builds every change without touching anything (a ``ShapeError``
   here is ``unknown-shape``); the changes are then committed in order and, if one fails,
   the ones already made are undone: ``applied`` or ``failed``, never half.

Strict mode (FLASHFIX_STRICT=1) turns ``failed``, and ``unknown-shape`` on a version inside
``versions``, into a ``PatchError`` raised from the target module's import.
"""

import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass

import flashfix
from flashfix import _config, _source
from flashfix._source import ShapeError

log = logging.getLogger("flashfix")
_lock = threading.RLock()

# Shape-probe results.
FIXED, ABSENT, BUGGY, UNKNOWN = "fixed", "absent", "buggy", "unknown"

# Doctor verdicts and runtime states.
VERDICTS = ("patch", "fixed-upstream", "not-affected", "not-installed", "disabled", "unknown-shape")
STATES = ("applied", "waiting", "fixed-upstream", "not-affected", "disabled", "not-installed", "unknown-shape", "failed")


class PatchError(flashfix.HookAbort):
    """Strict mode: an affected engine could not be patched. Raised from the engine's import."""


@dataclass(frozen=True)
class Shape:
    kind: str  # FIXED, ABSENT, BUGGY or UNKNOWN
    reason: str


@dataclass(frozen=True)
class Patch:
    id: str
    engine: str  # distribution name
    targets: tuple  # modules that must be imported before the patch can apply
    versions: str  # PEP 440 specifiers: where the pre-fix shape may be patched
    upstream: str  # the upstream PR
    fixed_in: str  # first release that carries the fix
    delete_when: str
    summary: str
    probe: object  # (trees: {module: ast.Module or None}) -> Shape
    prepare: object  # (modules: {module: module object}) -> [change, ...]


# --- changes: each knows how to make itself and undo itself, by identity ------------------

_MISSING = object()


class SetAttr:
    """``setattr(owner, name, value)``; undone only if the attribute still holds ``value``."""

    def __init__(self, owner, name, value):
        self.owner, self.name, self.value = owner, name, value
        self.old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

    def apply(self):
        setattr(self.owner, self.name, self.value)

    def undo(self):
        current = self.owner.__dict__.get(self.name, _MISSING)
        if current is not self.value:
            log.warning("not restoring %s.%s: something replaced flashfix's value since", _name(self.owner), self.name)
            return
        if self.old is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.old)

    def __repr__(self):
        return "%s.%s" % (_name(self.owner), self.name)


class SwapCode:
    """Give an existing function new code, so every reference to it (``from x import f``
    copies included) runs the fix. ``marked`` reports its first run, then swaps itself for
    ``plain``; undone only if the function still runs one of the two."""

    def __init__(self, func, marked, plain, site):
        self.func, self.marked, self.plain, self.site = func, marked, plain, site
        self.old = func.__code__

    def apply(self):
        self.func.__code__ = self.marked
        _sites[self.site] = self

    def undo(self):
        _sites.pop(self.site, None)
        if self.func.__code__ not in (self.marked, self.plain):
            log.warning("not restoring %s: its code was replaced by someone else since", self.func.__qualname__)
            return
        self.func.__code__ = self.old

    def __repr__(self):
        return "%s.%s (code)" % (self.func.__module__, self.func.__qualname__)


def _name(owner):
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


def rewrite(func, edit, patch_id):
    """A ``SwapCode`` change for ``func`` edited by ``edit`` (see ``_source.rewrite``)."""
    site = "%s:%s" % (patch_id, func.__qualname__)
    marked, plain = _source.rewrite(func, lambda node: edit(node, _source.marker(site)))
    return SwapCode(func, marked, plain, site)


# --- state ----------------------------------------------------------------------------------

_patches = {}  # id -> Patch, in registration order
_records = {}  # id -> dict(state, reason, engine_version, ran, changes)
_sites = {}  # marker site -> SwapCode
_declared = {}  # patch module name -> its PATCHES
_hooked = set()  # patch modules whose patches are hooked to their targets
_config_cache = []
_logging_ready = []


def config():
    if not _config_cache:
        load_all()  # FLASHFIX_DISABLE is checked against every patch id
        _config_cache.append(_config.parse(set(_patches)))
    return _config_cache[0]


def setup_logging():
    """Configure the ``flashfix`` logger once (level from FLASHFIX_LOG_LEVEL, stderr, process id)."""
    _setup_logging(config())


def _setup_logging(cfg):
    if _logging_ready:
        return
    _logging_ready.append(True)
    log.setLevel(cfg.log_level)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("flashfix %(levelname)s [pid %(process)d] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    for problem in cfg.problems:
        log.error("%s", problem)
    if cfg.problems and cfg.strict:
        raise PatchError("; ".join(cfg.problems))


def _hook_error(name, exc):
    log.error("post-import hook for %s failed (engine left as it was): %r", name, exc)


flashfix.on_error = _hook_error


def register(patch):
    with _lock:
        if patch.id in _patches:
            return
        _patches[patch.id] = patch
        _records[patch.id] = {"state": "waiting", "reason": "waiting for %s" % ", ".join(patch.targets),
                              "engine_version": None, "ran": False, "changes": []}


def _declare(name):
    """Import a patch module (declarations only) and register its ``PATCHES``."""
    with _lock:
        if name not in _declared:
            module = importlib.import_module(name)
            for patch in module.PATCHES:
                register(patch)
            _declared[name] = tuple(module.PATCHES)
        return _declared[name]


def load_all():
    """Every patch flashfix has, declared (no engine is imported)."""
    from flashfix import PATCH_MODULES

    for name in PATCH_MODULES.values():
        _declare(name)
    return list(_patches.values())


def load_patch_module(name):
    """Called when an engine's top-level package is imported: hook its patches to their targets."""
    with _lock:
        if name in _hooked:
            return
        _hooked.add(name)
    load_all()  # every id must be known before FLASHFIX_DISABLE is checked
    cfg = config()
    _setup_logging(cfg)
    for patch in _declared[name]:
        record = _records[patch.id]
        record["engine_version"] = engine_version(patch.engine)
        if cfg.is_disabled(patch.id):
            _set(patch, "disabled", "disabled by FLASHFIX_DISABLE")
            continue
        pending = list(patch.targets)
        for target in patch.targets:
            flashfix.when_imported(target, _arrival(patch, pending))


def _arrival(patch, pending):
    def arrived(module):
        with _lock:
            if module.__name__ in pending:
                pending.remove(module.__name__)
            if pending:
                return
        _activate(patch)

    return arrived


def engine_version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def in_range(patch, version):
    if version is None:
        return True  # a source checkout without metadata: the shape gate decides alone
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(patch.versions, prereleases=True).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def judge(patch, trees, version):
    """The doctor verdict and reason for ``patch`` given its targets' ASTs and the version."""
    if any(tree is None for tree in trees.values()):
        missing = [name for name, tree in trees.items() if tree is None]
        return "not-affected", "module %s does not exist in %s %s" % (", ".join(missing), patch.engine, version)
    try:
        shape = patch.probe(trees)
    except Exception as exc:  # a probe that trips over unexpected code is an unknown shape
        shape = Shape(UNKNOWN, "shape probe failed: %r" % (exc,))
    if shape.kind == FIXED:
        return "fixed-upstream", shape.reason
    if shape.kind == ABSENT:
        return "not-affected", shape.reason
    if shape.kind == BUGGY:
        if in_range(patch, version):
            return "patch", shape.reason
        return "unknown-shape", "pre-fix shape, but %s %s is outside %s: %s" % (
            patch.engine, version, patch.versions, shape.reason)
    return "unknown-shape", shape.reason


def _activate(patch):
    with _lock:
        record = _records[patch.id]
        if record["state"] not in ("waiting",):
            return  # exactly once, whichever activation path gets here first
        modules = {name: sys.modules[name] for name in patch.targets}
        version = record["engine_version"]
        trees = {name: _source.module_ast(name, modules) for name in patch.targets}
        verdict, reason = judge(patch, trees, version)
        if verdict != "patch":
            _set(patch, verdict, reason)
            if verdict == "unknown-shape":
                log.warning("%s: %s %s left untouched: %s", patch.id, patch.engine, version, reason)
                _strict(patch, reason, in_range(patch, version))
            else:
                log.debug("%s: %s", patch.id, reason)
            return
        try:
            changes = patch.prepare(modules)
        except ShapeError as exc:
            _set(patch, "unknown-shape", str(exc))
            log.warning("%s: %s %s left untouched: %s", patch.id, patch.engine, version, exc)
            _strict(patch, str(exc), True)
            return
        except Exception as exc:
            _fail(patch, "preparing the patch failed: %r" % (exc,))
            return
        done = []
        try:
            for change in changes:
                change.apply()
                done.append(change)
        except Exception as exc:
            for change in reversed(done):
                try:
                    change.undo()
                except Exception as undo_exc:  # pragma: no cover - reported, nothing else to do
                    log.error("%s: undoing %r failed: %r", patch.id, change, undo_exc)
            _fail(patch, "applying %r failed, earlier parts undone: %r" % (change, exc))
            return
        record["changes"] = changes
        _set(patch, "applied", "%s (%s %s)" % (patch.summary, patch.engine, version))
        log.info("applied %s to %s %s in pid %d: %s; upstream %s", patch.id, patch.engine, version, os.getpid(),
                 ", ".join(map(repr, changes)), patch.upstream)


def _fail(patch, reason):
    _set(patch, "failed", reason)
    log.error("%s: %s; %s left as it was", patch.id, reason, patch.engine)
    _strict(patch, reason, True)


def _strict(patch, reason, affected):
    if affected and config().strict:
        raise PatchError("flashfix strict mode: %s could not be applied to %s %s: %s" % (
            patch.id, patch.engine, _records[patch.id]["engine_version"], reason))


def _set(patch, state, reason):
    _records[patch.id]["state"] = state
    _records[patch.id]["reason"] = reason


def mark_ran(site):
    """Called once by a marker statement inside patched code: record it, drop the marker."""
    change = _sites.get(site)
    patch_id = site.split(":", 1)[0]
    if patch_id in _records:
        _records[patch_id]["ran"] = True
    if change is not None and change.func.__code__ is change.marked:
        change.func.__code__ = change.plain


def note_ran(patch_id):
    """For patch code written in Python (not rewritten engine code): it ran."""
    record = _records.get(patch_id)
    if record is not None:
        record["ran"] = True


# --- public API -----------------------------------------------------------------------------


def status():
    """Per patch: id, engine, state, reason, engine_version, ran, upstream, fixed_in."""
    load_all()
    rows = []
    for patch in _patches.values():
        record = _records[patch.id]
        state, version = record["state"], record["engine_version"]
        reason = record["reason"]
        if record["state"] == "waiting":
            version = version or engine_version(patch.engine)
            missing = [t for t in patch.targets if _source.module_file(t) is None]
            if version is None and len(missing) == len(patch.targets):
                state, reason = "not-installed", "%s is not installed" % patch.engine
            elif config().is_disabled(patch.id):
                state, reason = "disabled", "disabled by FLASHFIX_DISABLE"
            elif missing:  # as the doctor judges it: the code the bug lives in does not exist here
                state, reason = "not-affected", "module %s does not exist in %s %s" % (", ".join(missing), patch.engine, version)
        rows.append({
            "id": patch.id,
            "engine": patch.engine,
            "state": state,
            "reason": reason,
            "engine_version": version,
            "ran": record["ran"],
            "upstream": patch.upstream,
            "fixed_in": patch.fixed_in,
        })
    return rows


def revert(*patch_ids):
    """Undo the applied patches named (all when none is named), newest first, restoring the
    original objects. An unknown id is a ValueError listing the valid ones."""
    load_all()
    unknown = [i for i in patch_ids if i not in _patches]
    if unknown:
        raise ValueError("unknown patch id(s) %s; valid: %s" % (", ".join(map(repr, unknown)), ", ".join(_patches)))
    with _lock:
        for patch in reversed(list(_patches.values())):
            record = _records[patch.id]
            if record["state"] != "applied" or (patch_ids and patch.id not in patch_ids):
                continue
            for change in reversed(record["changes"]):
                change.undo()
            record["changes"] = []
            _set(patch, "disabled", "reverted by flashfix.revert()")
            log.info("reverted %s in pid %d", patch.id, os.getpid())
