"""The patch registry: declarations, the two gates, atomic apply, revert and status.

A patch pack (``flashfix/<engine>_patch.py``, or another distribution's, see ``_packs``) declares
``Patch`` objects in ``PATCHES``; ``_declare`` registers them. Nothing here knows any engine. For
each patch, once all its target modules are imported:

1. disabled by FLASHFIX_DISABLE? -> ``disabled``
2. the shape probe reads the targets' source (ast; a target without source is ``unknown-shape``):
   fix already there -> ``fixed-upstream``; bug unreachable in this code -> ``not-affected``;
   unrecognised -> ``unknown-shape``; pre-fix shape -> 3.
3. version gate: the installed version must be inside ``versions`` (pre-releases and dev
   builds included), else ``unknown-shape``; ``requires`` unmet: ``known-unfixed``.
4. ``prepare(modules)`` builds every change without touching anything (a ``ShapeError``
   here is ``unknown-shape``); the changes are then committed in order and, if one fails,
   the ones already made are undone: ``applied`` or ``failed``, never half.

Strict mode (FLASHFIX_STRICT=1) turns ``failed``, and ``unknown-shape`` on a version inside
``versions`` (and any malformed ``FLASHFIX_*`` value), into a ``PatchError`` raised from the
target module's own import, also when flashfix was activated inside that import, and never
from another module's import. The targets are then taken out of sys.modules, as Python does
for a failed import, so every later import of them runs them again, is judged again and fails
again; that also covers a target whose import was over before flashfix was activated.

Threads: the lock guards bookkeeping only; it is never held while a probe, a ``prepare()`` or an
apply runs (they may import), so an import in another thread never waits on flashfix. A patch
being decided in one thread is skipped by another (``busy``), and decided again if its targets
ran again meanwhile. A reload of a target runs the decision again for the new functions.
"""
# A declaration (``rule``) is judged and its new code compiled just before its last target's code runs
# (``_read_ahead``), so that the parse trees are freed before that module's own imports; after it runs,
# steps 2 and 4 reuse that work where the targets' source is unchanged and the loaded functions run the
# code it was compiled from, and otherwise read again.

import logging
import os
import sys
import threading
from collections import namedtuple

import flashfix
from flashfix.core import config as _config
from flashfix.core import lazy as _lazy
from flashfix.core import packs as _packs

_locate, _source = _lazy.Module("flashfix.core.locate"), _lazy.Module("flashfix.core.source")  # see lazy: imported on first
# use, when something is decided
log = logging.getLogger("flashfix")
_lock = threading.RLock()


class ShapeError(Exception):
    """The code is not what a patch expects; the message says what differs."""


class NotBound(ShapeError):
    """What the source defines under a condition was not bound when the module ran (sglang defines its FlashInfer
    helpers only where FlashInfer is available): none of it runs in this process, which is not affected."""


def first_line(statement):
    """A statement's first line: a decorated def's starts at its first decorator."""
    return min([statement.lineno] + [d.lineno for d in getattr(statement, "decorator_list", ())])


MARK_NAME = "__flashfix_mark__"  # the module global through which marked code reports its first run

# Shape-probe results.
FIXED, ABSENT, BUGGY, UNKNOWN = "fixed", "absent", "buggy", "unknown"


class PatchError(flashfix.HookAbort):
    """Strict mode: an affected engine could not be patched. Raised from the engine's import."""


# Plain named tuples, not dataclasses: ``dataclasses`` imports ``inspect``, a sixth of what
# ``flashfix doctor`` spends on imports.
Shape = namedtuple("Shape", "kind reason functions", defaults=((),))  # functions: (module, qualname)s BUGGY rewrites

Patch = namedtuple("Patch", [
    "id",
    "engine",  # distribution name
    "targets",  # modules that must be imported before the patch can apply: a tuple, or a callable
    # returning one, read from the source when the engine's top package is imported (the module
    # that defines the code to change, in this engine's layout)
    "versions",  # PEP 440 specifiers: where the pre-fix shape may be patched
    "upstream",  # the upstream PR
    "fixed_in",  # first release that carries the fix
    "delete_when",
    "summary",
    "probe",  # (trees: {module: ast.Module or None}) -> Shape
    "prepare",  # (modules: {module: module object}) -> [change, ...]
    "plan",  # (planner: _diff.Planner) -> None: the same changes made from source, for ``flashfix diff``
    "doc",  # why / how / when to delete (a declarative backport's; optional)
    "rule",  # the declaration (``semantic.Declaration``: its hunks, sites, hooks), or None for a hand-written patch
    "requires",  # {distribution: PEP 440 specifiers} the fixed code needs, read where the engine is; unmet: known-unfixed
    "memory",  # str: the GPU memory the fix adds over the release's sizing (formula, example); None: none.
    # FLASHFIX_DISABLE=memory keeps the release's sizing (every such patch disabled)
], defaults=(None, None, None, None, None))


# --- changes: each knows how to make itself and undo itself, by identity ------------------

_MISSING = object()


class SetAttr:
    """``setattr(owner, name, value)``; undone only if the attribute still holds ``value``. With
    ``ran``, a patch id: applying it is that patch's run (a class body's or module's new statements)."""

    def __init__(self, owner, name, value, ran=None):
        self.owner, self.name, self.value, self.ran = owner, name, value, ran
        self.old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

    def apply(self):
        setattr(self.owner, self.name, self.value)
        note_ran(self.ran)

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
    """Give an existing function new code, so every reference to it (``from x import f`` copies included) runs
    the fix. ``marked`` reports its first run, then swaps itself for ``plain`` and is let go; undone only if the function
    still runs one of the two. The marker reaches ``mark_ran`` through one global of the function's module
    (``MARK_NAME``), added with the first swap into that module and removed when the last is undone.

    Several patches of one function form its series (``_Stack``): ``ids``, the patches whose edits ``marked`` and
    ``plain`` hold, in series order (``compose``). Undoing one recompiles the function from the others (or gives
    back the release's code when none is left), so each patch of a series is reverted alone."""

    def __init__(self, func, marked, plain, site, ahead=False, ids=None):
        self.func, self.marked, self.plain, self.site = func, marked, plain, site
        self.old, self.ahead = func.__code__, ahead  # ahead: compiled before the module ran (_read_ahead)
        self.id = site.split(":", 1)[0]
        self.ids = tuple(ids or (self.id,))
        self.sites = [site_of(i, site.split(":", 1)[1]) for i in self.ids]
        self.pending = set(self.sites)  # the markers not yet run: the plain code is swapped in once none is left

    def apply(self):
        stack = _stacks.get(id(self.func))
        held = tuple(stack.ids) if stack is not None else ()
        if held != tuple(i for i in self.ids if i != self.id):
            raise ShapeError("%s was compiled over the series %s, but the function runs %s now" % (
                self.func.__qualname__, ", ".join(self.ids[:-1]) or "(none)", ", ".join(held) or "(none)"))
        base = stack.kwdefaults if stack is not None else self.func.__kwdefaults__
        kwdefaults = _kwdefaults(self.marked, stack.original if stack is not None else self.old, self.ids, base)
        _hold_mark(self.func.__globals__)
        try:  # a new parameter's default first: the release's code ignores it, the new code needs it
            self.func.__kwdefaults__ = kwdefaults
            self.func.__code__ = self.marked
        except Exception:
            self.func.__kwdefaults__ = base
            _release_mark(self.func.__globals__)
            raise
        if stack is None:
            stack = _stacks[id(self.func)] = _Stack(self.func, self.old, base)
        stack.take(self)

    def undo(self):
        stack = _stacks.get(id(self.func))
        if stack is None or self.id not in stack.ids:
            return
        current = stack.current
        left = [i for i in stack.ids if i != self.id]
        stack.drop()
        if self.func.__code__ not in (current.marked, current.plain):
            log.warning("not restoring %s: its code was replaced by someone else since", self.func.__qualname__)
            del _stacks[id(self.func)]
        elif not left:
            stack.restore()
        else:  # the others stay: the function compiled from them alone
            try:
                marked, plain = compose(self.func, left, stack.original)
                kwdefaults = _kwdefaults(marked, stack.original, left, stack.kwdefaults)
            except Exception as exc:  # what they were judged on is gone: the release's code, and say so
                log.error("%s: %s no longer applies without %s (%r): the release's code runs", self.func.__qualname__,
                          ", ".join(left), self.id, exc)
                stack.restore()
                _stranded.extend((i, self.id) for i in left)  # revert() gives them back whole
            else:
                rest = SwapCode(self.func, marked, plain, site_of(left[-1], self.site.split(":", 1)[1]), ids=left)
                self.func.__code__ = marked
                self.func.__kwdefaults__ = kwdefaults  # (after: the defaults of a parameter dropped go last)
                stack.take(rest)
        _release_mark(self.func.__globals__)

    def __repr__(self):
        return "%s.%s (code%s)" % (self.func.__module__, self.func.__qualname__,
                                   ", series %s" % " + ".join(self.ids) if len(self.ids) > 1 else "")


class _Stack:
    """One function's series as applied: its release code, the patches in it and the code it runs."""

    def __init__(self, func, original, kwdefaults):
        self.func, self.original, self.ids, self.current = func, original, [], None
        self.kwdefaults = kwdefaults  # the release's ``__kwdefaults__`` (a patch may add a keyword parameter)

    def restore(self):
        """The release's code and defaults back; the function leaves the series."""
        self.func.__code__ = self.original
        self.func.__kwdefaults__ = self.kwdefaults
        del _stacks[id(self.func)]

    def take(self, change):
        self.drop()
        self.ids, self.current = list(change.ids), change
        for site in change.sites:
            _sites[site] = change

    def drop(self):
        for site in self.current.sites if self.current is not None else ():
            if _sites.get(site) is self.current:
                del _sites[site]
        self.ids, self.current = [], None


def _kwdefaults(code, original, ids, base):
    """The ``__kwdefaults__`` a function needs to run ``code``: ``base`` (the release's), with each keyword-only
    parameter that ``code`` takes and the release's ``original`` does not given its default, from the
    declarations of the patches ``ids`` (a ``Rule``'s ``parameters``); ShapeError where none declares one."""
    def kwonly(c):
        return c.co_varnames[c.co_argcount:c.co_argcount + c.co_kwonlyargcount]

    added = [n for n in kwonly(code) if n not in kwonly(original)]
    if not added:
        return base
    values = {}
    for pid in ids:
        values.update(getattr(getattr(_patches.get(pid), "rule", None), "parameters", None) or {})
    missing = [n for n in added if n not in values]
    if missing:
        raise ShapeError("the new code of %s takes a parameter %s that no patch of its series (%s) declares"
                         % (code.co_name, missing[0], ", ".join(ids)))
    return dict(base or {}, **{n: values[n] for n in added})


_stacks = {}  # id(function) -> its _Stack, while a patch's code runs there
_stranded = []  # (id, the reverted id it was judged on): a series member whose function lost its code


def compose(func, ids, original, joining=None):
    """``(marked, plain)`` code for ``func`` with the edits of the patches ``ids`` made in series order, each on
    what the ones before it leave, compiled once. ``joining``: ``(id, edit)``, the patch being prepared, whose
    edit is its own ``prepare``'s (so that it collects the names the new code reads); the others' edits are
    their declarations'. ``original``: the release's code, which the source read now must compile to."""
    qualname, modname = func.__qualname__, func.__module__
    import copy

    tree = _source.parse_text(*_source.function_source(func))
    copies = {modname: copy.deepcopy(tree)}
    for pid in ids:
        if joining is not None and pid == joining[0]:
            joining[1](_source.find_def(copies[modname], qualname), _source.marker(site_of(pid, qualname)))
        else:
            series_trees([_patches[pid]], {modname: tree}, marks=True, copies=copies)
    return _source.rewrite_edited(func, tree, _source.find_def(copies[modname], qualname), original)


_mark_users = {}  # id(module globals) -> how many applied SwapCodes need the marker global there


def _hold_mark(namespace):
    current = namespace.get(MARK_NAME, _MISSING)
    if current is not _MISSING and current is not mark_ran:
        raise ShapeError("the module already has a global %s that is not flashfix's" % MARK_NAME)
    namespace[MARK_NAME] = mark_ran
    _mark_users[id(namespace)] = _mark_users.get(id(namespace), 0) + 1


def _release_mark(namespace):
    left = _mark_users.get(id(namespace), 0) - 1
    if left > 0:
        _mark_users[id(namespace)] = left
        return
    _mark_users.pop(id(namespace), None)
    if namespace.get(MARK_NAME) is mark_ran:
        del namespace[MARK_NAME]


def _name(owner):
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


def site_of(patch_id, qualname):
    """The marker site of ``patch_id``'s rewrite of the function ``qualname`` (``mark_ran`` looks it up)."""
    return "%s:%s" % (patch_id, qualname)


def rewrite(func, edit, patch_id, touches=None):
    """A ``SwapCode`` change for ``func`` edited by ``edit`` (see ``_source.rewrite``, also for ``touches``); where
    other patches' code runs there, the function compiled from the whole series with this patch in its place."""
    site = site_of(patch_id, func.__qualname__)
    stack = _stacks.get(id(func))
    if stack is not None and stack.ids:
        ids = sorted(set(stack.ids) | {patch_id}, key=_rank)  # SwapCode.apply checks the function still runs the rest
        marked, plain = compose(func, ids, stack.original, (patch_id, edit))
        return SwapCode(func, marked, plain, site, ids=ids)
    marked, plain = _source.rewrite(func, lambda node: edit(node, _source.marker(site)), touches)
    return SwapCode(func, marked, plain, site)


def _rank(pid):
    """A patch's place in the series order: the order patches are registered (flashfix's own first)."""
    pid = getattr(pid, "id", pid)
    return list(_patches).index(pid) if pid in _patches else len(_patches)


def mangled(owner, name):
    """The attribute name ``name``, written in the body of class ``owner`` (its name as the class statement
    spells it), is bound as: Python's private-name mangling makes ``__x`` (two leading underscores, not two
    trailing) ``_Owner__x``, the class name's leading underscores stripped (a name of underscores alone: none)."""
    if owner is None or not name.startswith("__") or name.endswith("__") or "." in name:
        return name
    stripped = owner.lstrip("_")
    return "_%s%s" % (stripped, name) if stripped else name


def function_at(module, qualname):
    """The plain function at ``qualname`` (``"Class.method"`` or ``"function"``, the names as the source spells
    them, as ``__qualname__`` does: a private ``__name`` is looked up mangled) defined in ``module``'s file,
    looking through ``functools.wraps`` wrappers; a ShapeError if there is none (``NotBound`` where the name is
    not bound at all and the source defines it under a condition, which did not hold; ``not_bound``)."""
    owner, cls = module, None
    *outer, name = qualname.split(".")
    for index, part in enumerate(outer):
        inner = getattr(owner, mangled(cls, part), None)
        if inner is None and mangled(cls, part) not in vars(owner):
            not_bound(module, ".".join(outer[:index + 1]), owner, mangled(cls, part))
        if not isinstance(inner, type):
            raise ShapeError("%s has no class %s" % (module.__name__, part))
        owner, cls = inner, part
    key = mangled(cls, name)
    obj = owner.__dict__.get(key) if isinstance(owner, type) else getattr(owner, key, None)
    if obj is None and key not in vars(owner):
        not_bound(module, qualname, owner, key)
    for _ in range(10):
        code = getattr(obj, "__code__", None)
        if code is not None and code.co_name == name and code.co_filename == getattr(module, "__file__", None):
            return obj
        obj = getattr(obj, "__wrapped__", None)
    raise ShapeError("%s.%s is not a plain function of %s" % (getattr(owner, "__name__", owner), key, module.__name__))


def not_bound(module, qualname, owner, key, tree=None):
    """Raise for ``qualname`` of ``module``, which ``owner`` does not bind (as ``key``): ``NotBound`` (not-affected)
    only where its source (``tree``: read now if None) defines it under a condition (an ``if``, ``try``, ``with``,
    a loop), which then did not hold; else a ShapeError (unknown-shape): the source defines it where it runs
    whenever the module does, so what is bound is not what the source says (a name looked up wrong, a
    class body that removed it, a metaclass...), and nothing can say the bug does not run."""
    where = "%s.%s" % (getattr(owner, "__name__", owner), key)
    try:
        tree = _source.module_ast(module.__name__) if tree is None else tree
        found = _source.condition_of(tree, qualname)
    except ShapeError:
        found = None
    if found is not None and found[1] is not None:
        raise NotBound("%s is not bound in this process (%s is defined at line %d under a condition, line %d, that did "
                       "not hold when %s ran)" % (where, qualname, found[0], found[1], module.__name__))
    raise ShapeError("%s is not found bound where the source defines it: %s%s, but %s has no %s after %s ran" % (
        where, qualname, " is defined at line %d outside any condition" % found[0] if found is not None else
        " is not found in the source read now", getattr(owner, "__name__", owner), key, module.__name__))


_CODE_FIELDS = ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_flags", "co_argcount",
                "co_posonlyargcount", "co_kwonlyargcount", "co_name")


def code_difference(a, b, where=""):
    """None if code objects ``a`` and ``b`` are the same program (bytecode, names, constants,
    nested code objects, flags), else a short description of the first difference."""
    where = where or a.co_name
    for field in _CODE_FIELDS:
        if getattr(a, field) != getattr(b, field):
            return "%s differs in %s" % (where, field)
    if len(a.co_consts) != len(b.co_consts):
        return "%s differs in its constants" % where
    return next(filter(None, (_const_difference(x, y, where) for x, y in zip(a.co_consts, b.co_consts))), None)


def _const_difference(x, y, where):
    if type(x) is not type(y):
        return "%s differs in a constant" % where
    if isinstance(x, type(_const_difference.__code__)):
        return code_difference(x, y, "%s.%s" % (where, x.co_name))
    if isinstance(x, (tuple, frozenset)):
        xs, ys = (list(x), list(y)) if isinstance(x, tuple) else (sorted(x, key=repr), sorted(y, key=repr))
        if len(xs) != len(ys):
            return "%s differs in a constant" % where
        return next(filter(None, (_const_difference(x, y, where) for x, y in zip(xs, ys))), None)
    if isinstance(x, float) and x != x and y != y:  # NaN
        return None
    if x != y or repr(x) != repr(y):  # repr tells -0.0 from 0.0
        return "%s differs in a constant" % where
    return None


# --- state ----------------------------------------------------------------------------------

_patches = {}  # id -> Patch, in registration order
_records = {}  # id -> dict(state, reason, engine_version, ran, changes, targets, decided, busy, again)
_sites = {}  # marker site -> SwapCode
_declared = {}  # pack key (see _declare) -> its PATCHES, () when it was skipped
_problems = {}  # engine package -> problem lines of its packs
_hooked = set()  # ids of the patches hooked to their targets (once, whichever engine's import declared them)
_hooked_to = {}  # target module -> the patches hooked to it, in order (see _hook_target)
_series = {}  # (module, qualname) -> the patches judged to rewrite it in this process, in series order (see judge)
_ahead = {}  # id -> (what the targets' source was, Shape, what prepare needs or None): see _read_ahead
_origins = {}  # id -> the file its pack module was loaded from (what a stored decision is keyed by, with its source)
_config_cache = []
_logging_ready = []


def config():
    if not _config_cache:
        if _config.names_patches():  # FLASHFIX_DISABLE names ids: it is checked against every patch id
            load_all()
        _config_cache.append(_config.parse(set(_patches)))
    return _config_cache[0]


class _Fallback(logging.StreamHandler):
    """flashfix's records on stderr, but only while the application has configured no logging of its own (the
    root logger has no handler); from then on they reach its handlers by propagation, like any library's."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("flashfix %(levelname)s [pid %(process)d] %(message)s"))

    def emit(self, record):
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr
        super().emit(record)


def setup_logging():
    """Configure the ``flashfix`` logger once (level from FLASHFIX_LOG_LEVEL; see _Fallback)."""
    _setup_logging(config())


def _setup_logging(cfg):
    with _lock:
        if _logging_ready:
            return
        _logging_ready.append(True)
    log.setLevel(cfg.log_level)
    if not any(isinstance(h, _Fallback) for h in log.handlers):
        log.addHandler(_Fallback())
    for problem in list(cfg.problems) + problems():
        log.error("%s", problem)


def _hook_error(name, exc):
    log.error("post-import hook for %s failed (engine left as it was): %r", name, exc)


flashfix.on_error = _hook_error


def register(patch):
    with _lock:
        if patch.id in _patches:
            return
        _patches[patch.id] = patch
        targets = patch.targets if isinstance(patch.targets, tuple) else ()
        _records[patch.id] = {"state": "waiting", "reason": "waiting for its target modules to be imported",
                              "engine_version": None, "ran": False, "changes": [], "targets": targets,
                              "decided": None, "busy": False, "again": False}


def _declare(entry):
    """Load one pack (``_packs.Entry``: flashfix's own patch modules are packs too) and register
    its ``PATCHES``, all or none; a pack that cannot be loaded is a problem line (see
    ``_packs``). Returns its patches (empty when it was skipped)."""
    key = (entry.top, entry.dist, entry.name, entry.value, entry.root)
    if key in _declared:
        return _declared[key]
    try:
        patches = _packs.load(entry, Patch)  # never under _lock: an import may wait on another thread
    except _packs.Problem as exc:
        return _skip(key, entry, str(exc))
    with _lock:
        if key in _declared:
            return _declared[key]
        taken = [p.id for p in patches if p.id in _patches and _patches[p.id] is not p]
        if not taken:
            origin = getattr(sys.modules.get(entry.value.partition(":")[0].strip()), "__file__", None) if entry.root is None else None
            for patch in patches:
                register(patch)
                _origins.setdefault(patch.id, origin)
            _declared[key] = patches
            return patches
    return _skip(key, entry, "the id %s is already taken by another pack or by flashfix" % ", ".join(taken))


def _skip(key, entry, problem):
    text = _packs.skipped(entry, problem)
    with _lock:
        if key in _declared:
            return _declared[key]
        _declared[key] = ()
        _problems.setdefault(entry.top, []).append(text)
    if _logging_ready:
        log.error("%s", text)
    return ()


def problems(top=None):
    """The pack problems found so far (of the engine package ``top``, or all)."""
    with _lock:
        if top is not None:
            return list(_problems.get(top, ()))
        return [p for texts in _problems.values() for p in texts]


def _entries(top=None):
    return [e for e in _packs.installed() if top is None or e.top == top]


def load_all():
    """Every patch of the environment being read, declared (no engine is imported): flashfix's
    own and the installed packs'. Under ``_locate.reading`` another environment's packs (see
    ``_packs.foreign``): those are not registered in this process's registry."""
    r = _locate.reader()
    if r is not _locate._default:
        return _foreign(r)[0]
    tops = set(flashfix.PATCH_MODULES)
    for entry in _entries():
        if entry.top in tops:
            _declare(entry)
        else:
            _skip((entry.top, entry.dist, entry.name, entry.value, entry.root), entry._replace(top=""),
                  "its entry point name %r is not an engine package flashfix watches (%s)"
                  % (entry.name, ", ".join(sorted(tops))))
    return list(_patches.values())


def _foreign(r):
    """``(patches, problems)`` of the environment ``r`` reads; computed once per reader."""
    cached = getattr(r, "_flashfix_packs", None)
    if cached is not None:
        return cached
    entries, failed = _packs.foreign(r)
    with _locate.reading(_locate._default):  # this copy's own patches; this interpreter's packs are not there
        own = {p.id: p for e in _entries() if _packs._normal(e.dist or "") == _packs.OWN for p in _declare(e)}
    patches, seen = [], set()
    found = [_packs.skipped(entry, problem) for entry, problem in failed]
    for entry in entries:
        try:
            if entry.top not in flashfix.PATCH_MODULES:
                raise _packs.Problem("its entry point name %r is not an engine package flashfix watches" % entry.name)
            if not getattr(r, "run_packs", False):  # reading a build never executes it
                raise _packs.Problem("not run: reading an environment never executes its code (--run-packs imports "
                                     "the pack here, executing it, to judge its patches)")
            loaded = _packs.load(entry, Patch)
            taken = [p.id for p in loaded if p.id in own or p.id in seen]
            if taken:
                raise _packs.Problem("the id %s is already taken by another pack or by flashfix" % ", ".join(taken))
        except _packs.Problem as exc:
            found.append(_packs.skipped(entry, exc))
            continue
        seen.update(patch.id for patch in loaded)
        patches.extend(loaded)
    result = (list(own.values()) + patches, found)
    try:
        r._flashfix_packs = result
    except AttributeError:
        pass
    return result


def reader_problems():
    """The pack problems of the environment being read (this interpreter's by default)."""
    r = _locate.reader()
    if r is not _locate._default:
        return list(_foreign(r)[1])
    load_all()
    return problems()


def targets_of(patch):
    """The patch's target modules, as read from the current reader's source."""
    return tuple(patch.targets() if callable(patch.targets) else patch.targets)


def load_engine(top):
    """Called when the engine package ``top`` is imported: load its packs (flashfix's own
    first) and hook their patches to their target modules."""
    cfg = config()  # the other engines' packs load here only if FLASHFIX_DISABLE names ids
    _setup_logging(cfg)
    if any(_packs._normal(e.dist or "") != _packs.OWN for e in _entries()):
        load_all()  # ids are claimed in one order (flashfix's own first) whichever engine is imported first
    declared = [p for entry in _entries(top) for p in _declare(entry)]
    bad = list(cfg.problems) + problems(top) + problems("")  # "": entry points that name no engine
    with _lock:
        fresh = [p for p in declared if p.id not in _hooked]
        _hooked.update(p.id for p in fresh)
    _each(fresh, lambda patch: _hook_patch(patch, cfg))
    _lazy.forget()  # the patterns and trees read to declare and hook: the engine's own import reuses their memory
    if bad and cfg.strict:  # at every import of the engine, not only the first (and of each target)
        raise PatchError("flashfix strict mode: %s" % "; ".join(bad))


def _each(items, call):
    """``call(item)`` for every item (a patch to hook, a target to watch); a strict failure of one
    (a target already imported) is raised once all are done, so that none is left unwatched."""
    failures = []
    for item in items:
        try:
            call(item)
        except flashfix.HookAbort as exc:
            failures.append(exc)
    if failures:
        raise failures[0]


def _hook_patch(patch, cfg):
    record = _records[patch.id]
    record["engine_version"] = engine_version(patch.engine)
    if cfg.is_disabled(patch.id, patch.memory):
        _set(patch, "disabled", cfg.disabled_reason(patch.id, patch.memory))
        return
    try:
        targets = _stored_targets(patch, record["engine_version"])
    except Exception as exc:
        _set(patch, "unknown-shape", "cannot tell which modules to patch: %r" % (exc,))
        log.warning("%s: left untouched: %s", patch.id, record["reason"])
        _strict(patch, record["reason"], in_range(patch, record["engine_version"]))
        return
    record["targets"] = targets
    record["reason"] = "waiting for %s" % ", ".join(targets)
    _each(targets, lambda target: _hook_target(target, patch))


def _hook_target(target, patch):
    """Hook ``patch`` to ``target``: one callback per target module decides every patch hooked to it, so that the
    heavy modules are imported once per import of a target, not once per patch (``flashfix.core.lazy``)."""
    with _lock:
        first = target not in _hooked_to
        _hooked_to.setdefault(target, []).append(patch)
    if first:
        flashfix.before_run(target, lambda module: _before_target(target))
        flashfix.when_imported(target, lambda module: _target_imported(target))
    elif flashfix._complete(target):  # its callback ran before this patch was hooked (a pack loaded later)
        _activate(patch)


def _before_target(target):
    for patch in _patches_on(target):
        if callable(getattr(patch.rule, "ahead", None)):
            _read_ahead(patch, target)


def _target_imported(target):
    _each(_patches_on(target), _activate)


def _patches_on(target):
    with _lock:
        return list(_hooked_to.get(target, ()))


def engine_version(dist):
    if "flashfix.core.locate" in sys.modules:  # the doctor may read another environment (``_locate.reading``)
        return _locate.version(dist)
    return installed_version(dist)  # an engine process: its own environment, read without the source reader


def distribution(dist):
    from importlib import metadata

    try:
        return metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return None


def metadata_version(text):
    """``(name, version)`` from a METADATA text's headers."""
    import textwrap
    from email.parser import HeaderParser

    headers = HeaderParser().parsestr(text.replace("\r\n", "\n").partition("\n\n")[0])  # the body is no header
    redent = lambda v: v if not v or "\n" not in v else textwrap.dedent(" " * 8 + v)  # noqa: E731  (as importlib.metadata)
    return redent(headers.get("Name")), redent(headers.get("Version"))


def installed_version(dist, find=distribution):  # ``Distribution.version`` parses the whole METADATA (vLLM's: 9 ms)
    """``dist``'s version from its METADATA headers; ``find(dist)``: its ``importlib.metadata`` distribution."""
    found = find(dist)
    return found and metadata_version(found.read_text("METADATA") or found.read_text("PKG-INFO") or "")[1]


def in_range(patch, version, specifiers=None):
    """Whether ``version`` is in the patch's declared range (or in ``specifiers``; pre-releases
    admitted); a version that is not PEP 440 is outside every range (packaging decides both)."""
    if version is None:
        return specifiers is None  # a source checkout without metadata: the shape gate decides alone
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(patch.versions if specifiers is None else specifiers, prereleases=True).contains(
            Version(version), prereleases=True)
    except InvalidVersion:
        return False


def read_trees(targets):
    """``{module: AST, None (no such module) or _source.SOURCELESS}`` from the current reader."""
    return {name: _source.module_ast(name) for name in targets}


def judge(patch, trees, version, series=None, shape=None, rank=None, on_series=None):
    """The doctor verdict and reason for ``patch`` given its targets' ASTs (or their ``shape``, read before,
    see ``_read_ahead``) and the version. ``series``: ``{(module, qualname): [Patch, ...]}``, the patches judged
    to rewrite each function so far (the runtime's, or one doctor run's): where one comes before ``patch``
    (``rank``: its place in the series order; default: every one listed does), ``patch`` is judged on the code
    they leave (``series_trees``; ``on_series``: its shape there, read before), and joins the series where it
    would apply."""
    shape = shape_of(patch, trees, version) if shape is None else shape
    if shape.kind == FIXED:
        return "fixed-upstream", shape.reason
    earlier = _earlier(patch, series, rank)
    if shape.kind == ABSENT and not earlier:
        return "not-affected", shape.reason
    if earlier:  # judged on what the patches before it in the series leave (a fix of theirs may be what it completes)
        names = ", ".join(p.id for p in earlier)
        try:
            shape = on_series or shape_of(patch, dict(trees or {}, **series_trees(earlier, trees)), version)
        except ShapeError as exc:
            shape = Shape(UNKNOWN, str(exc))
        if shape.kind == FIXED:
            return "covered", "%s earlier in the series of %s makes this fix: %s" % (names, _functions(earlier), shape.reason)
        if shape.kind == ABSENT:
            return "not-affected", "%s (on the code %s leave(s))" % (shape.reason, names)
        if shape.kind != BUGGY:
            return "unknown-shape", "on the code %s leave(s) (series of %s): %s" % (names, _functions(earlier), shape.reason)
        shape = shape._replace(reason="%s (on the code %s leave(s))" % (shape.reason, names))
    if shape.kind == BUGGY:
        if in_range(patch, version):  # then what the fix requires: read only where it would apply
            unmet, depends = [], []
            for d, s in sorted((patch.requires or {}).items()):
                reader, v = _locate.reader(), engine_version(d)
                declared = getattr(reader, "requirement", lambda d: None)(d) if v is None else None
                if declared:  # a release read, not installed: the installer picks within its declared range
                    depends.append((d, "%s%s needed, the release allows %s%s" % (d, s, d, declared)))
                elif not in_range(patch, v, s):
                    unmet.append("%s%s (%s)" % (d, s, ("%s %s is installed" if getattr(reader, "version_source", bool)(d)
                                                         else "the release pins %s==%s") % (d, v) if v else "not installed"))
            if unmet:  # the fix needs a newer dependency than the environment (or the wheel's own pin) has
                return "known-unfixed", "pre-fix shape, not carried here: the fix needs %s: %s" % ("; ".join(unmet), shape.reason)
            if depends:  # patched where the installed one qualifies, known-unfixed where not: say which
                shape = shape._replace(reason="depends on which %s is installed (%s; an older one: known-unfixed): %s" % (
                    ", ".join(d for d, _ in depends), "; ".join(text for _, text in depends), shape.reason))
            if series is not None:
                for function in shape.functions:  # it joins the series of each function it rewrites
                    members = series.setdefault(function, [])
                    if patch not in members:
                        members.append(patch)
                    if rank:
                        members.sort(key=rank)
            return "patch", shape.reason
        return "unknown-shape", "pre-fix shape, but %s %s is outside %s: %s" % (
            patch.engine, version, patch.versions, shape.reason)
    return "unknown-shape", shape.reason


def _declared_functions(patch):
    """The ``(module, qualname)``s a declaration's hunks name, in every layout (() for a hand-written patch)."""
    rule = getattr(patch, "rule", None)
    return {site for layout in getattr(rule, "layouts", None) or () for site in layout} if rule else set()


def _earlier(patch, series, rank=None):
    """The patches of ``series`` before ``patch`` on a function it declares, in series order."""
    if not series:
        return []
    mine = _declared_functions(patch)
    found = []
    for function, members in series.items():
        if function in mine:
            for member in members:
                if member.id != patch.id and member not in found and (rank is None or rank(member) < rank(patch)):
                    found.append(member)
    return sorted(found, key=rank) if rank else found


def _functions(members):
    return ", ".join(sorted({"%s.%s" % f for m in members for f in _declared_functions(m)}))


def series_trees(members, trees=None, marks=False, copies=None):
    """``{module: copy of its AST}`` with the edits of ``members`` (declarations whose verdict is ``patch``) made in
    order, each matched on what the ones before it leave; read from ``trees`` where given, else from source. With
    ``marks``, each edit puts in its marker statement, as the runtime's. A ShapeError where one no longer applies,
    or changes a class body or a module's top level (a series is of functions)."""
    import ast
    import copy

    copies = {} if copies is None else copies

    def tree_of(modname):
        if modname not in copies:
            tree = trees[modname] if trees and modname in trees else _source.module_ast(modname)
            copies[modname] = copy.deepcopy(tree) if isinstance(tree, ast.AST) else tree
        return copies[modname]

    for member in members:
        rule = getattr(member, "rule", None)
        if rule is None:
            raise ShapeError("%s is no declaration: nothing can be judged on the code it leaves" % member.id)
        made, located, given = rule.shape(tree_of)
        if made.kind != BUGGY:
            raise ShapeError("%s does not apply after the patches before it: %s" % (member.id, made.reason))
        for hunk, modname, qualname, func in located:
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                raise ShapeError("%s changes %s of %s: a class body or a module's top level takes one patch" % (
                    member.id, qualname or "the top level", modname))
            hunk.edit(func, _source.marker(site_of(member.id, qualname)) if marks else None, given=given)
    return copies


def shape_of(patch, trees, version):
    """The probe's ``Shape`` of ``patch`` given its targets' ASTs (None: no such module; ``SOURCELESS``)."""
    sourceless = [name for name, tree in trees.items() if tree is _source.SOURCELESS]
    if sourceless:
        return Shape(UNKNOWN, "source not available for %s (a sourceless install, a link that does not resolve, "
                              "or a finder --path cannot follow?): its shape cannot be read" % ", ".join(sourceless))
    if any(tree is None for tree in trees.values()):
        missing = [name for name, tree in trees.items() if tree is None]
        return Shape(ABSENT, "module %s does not exist in %s %s" % (", ".join(missing), patch.engine, version))
    try:
        return patch.probe(trees)
    except ShapeError as exc:  # e.g. a target bound in a way the source cannot tell (_source.find_def)
        return Shape(UNKNOWN, str(exc))
    except Exception as exc:  # a probe that trips over unexpected code is an unknown shape
        return Shape(UNKNOWN, "shape probe failed: %r" % (exc,))


def _loaded_key(targets):
    """What the targets are right now: None while one is missing or mid-import."""
    key = []
    for name in targets:
        if not flashfix._complete(name):
            return None
        key.append((id(sys.modules[name]), flashfix.generation(name)))
    return tuple(key)


def _activate(patch):
    """Decide (and apply) ``patch`` once all its targets are imported; again after a target ran
    again (reload, re-import after a failed import). Never under the lock."""
    record = _records[patch.id]
    with _lock:
        if record["state"] == "disabled":
            return
        if record["busy"]:
            record["again"] = True  # the deciding thread decides again when it is done
            return
        key = _loaded_key(record["targets"])
        if key is None or key == record["decided"]:
            return
        record["busy"] = True
    try:
        while True:
            record["decided"] = key
            _decide(patch, record)
            with _lock:
                key = _loaded_key(record["targets"])
                again, record["again"] = record["again"], False
                if not again or key is None or key == record["decided"]:
                    break
    finally:
        with _lock:
            record["busy"] = False
        _lazy.forget()


def _read_ahead(patch, running):
    """Just before the target ``running`` runs (its other targets imported): judge ``patch`` from the source and
    build the code its changes will swap in (``rule.ahead()``), so that the parse trees are freed before the
    target's own imports, which reuse that memory (an engine process keeps less). ``_decide`` uses all this
    only if the targets' source is still what was read, and ``rule.prepare_ahead`` only where the loaded functions
    run the code compiled from it; else it reads again. Never raises: whatever fails here is decided after the import."""
    record = _records[patch.id]
    with _lock:
        targets = record["targets"]
        if record["state"] == "disabled" or record["busy"] or not all(
                flashfix._complete(name) for name in targets if name != running):
            return
    try:
        version, read = record["engine_version"], _read(targets)
        shape, made = _stored(patch, version, read, made=True)
        with _lock:
            _ahead[patch.id] = (read, shape, made)
    except Exception as exc:
        _ahead.pop(patch.id, None)
        log.debug("%s: nothing read ahead of %s, decided once it is imported: %r", patch.id, running, exc)
    finally:
        _lazy.forget()


def _stored(patch, version, read, made, earlier=()):
    """``(shape, made)`` for ``patch`` on the source ``read``: a stored decision where one was made on that very
    source (``flashfix.core.decisions``), else judged now (and ``made`` by ``rule.ahead()`` where asked and it
    applies), then stored. ``earlier``: the patches before it in a series: its shape on the code they leave."""
    from flashfix.core import decisions as _decisions

    before = tuple(("series " + p.id, str(_origins.get(p.id)), str(_decisions._stat(_origins.get(p.id)))) for p in earlier)
    name = _decisions.key(patch, _origins.get(patch.id), version, read + before)
    found = _decisions.load(name)
    if found is not None:
        log.debug("%s: decided from the decision stored for this source (%s)", patch.id, name)
        return Shape(*found[0]), found[1]
    with _locate.reads() as seen:
        trees = read_trees(t for t, _, _ in read)
        if earlier:
            try:
                shape, made = shape_of(patch, dict(trees, **series_trees(earlier, trees)), version), None
            except ShapeError as exc:
                shape, made = Shape(UNKNOWN, str(exc)), None
        else:
            shape = shape_of(patch, trees, version)
            ahead = made and callable(getattr(patch.rule, "ahead", None))
            made = patch.rule.ahead() if ahead and judge(patch, None, version, shape=shape)[0] == "patch" else None
        del trees
    if _decisions.writing():  # ``flashfix prepare``: an engine process only reads stored decisions
        deps = [(m, f) for m, f in seen if m not in {t for t, _, _ in read}]
        _decisions.store(name, deps, shape, made)
    return shape, made


def _stored_targets(patch, version):
    """``targets_of(patch)`` in an engine process: where a declaration tells its targets by reading the source
    (its ``sites``), what ``flashfix prepare`` stored for these files, else read now."""
    if not callable(patch.targets):
        return tuple(patch.targets)
    from flashfix.core import decisions as _decisions

    name = _decisions.key(patch, _origins.get(patch.id), version, (("targets", "", ""),))
    found = _decisions.load(name)
    if found is not None:
        return tuple(found[0])
    with _locate.reads() as seen:
        targets = targets_of(patch)
    if _decisions.writing():
        _decisions.store(name, seen, targets, None)
    return targets


def _decision_name(patch, version):
    """``(read, name)``: what an engine process reads of ``patch``'s targets here, and its stored decision's name
    (None where a target or its source is missing)."""
    from flashfix.core import decisions as _decisions

    targets = _stored_targets(patch, version)
    found = [_locate.find(name) for name in targets]
    read = tuple((n, f.origin, _digest(f.text)) for n, f in zip(targets, found) if f is not None and f.text)
    return read, _decisions.key(patch, _origins.get(patch.id), version, read) if len(read) == len(targets) else None


def decisions_stored(patches):
    """``(stored, of)``: how many of ``[(patch, engine version)]`` have a decision stored for the source installed
    here (``flashfix prepare``'s), or None where stored decisions are off (``FLASHFIX_CACHE_DIR=off``)."""
    from flashfix.core import decisions as _decisions

    if _decisions.directory() is None:
        return None
    stored = 0
    for patch, version in patches:
        try:
            stored += _decisions.load(_decision_name(patch, version)[1]) is not None
        except Exception:  # what cannot be read is not stored
            pass
    return stored, len(patches)


def prepare_decisions():
    """``flashfix prepare``: store the decision of every patch of the engines installed here, read from source as an
    engine process would read it just before its targets run. ``[(id, what happened)]``."""
    from flashfix.core import decisions as _decisions

    done, series = [], {}
    _decisions._forced.append(True)
    try:
        for patch in load_all():  # in series order, each judged on what the patches before it leave, as at run time
            version = engine_version(patch.engine)
            if version is None:
                continue  # an engine not installed here
            try:
                read, name = _decision_name(patch, version)
                if name is None:
                    done.append((patch.id, "not stored: a target module or its source is missing"))
                    continue
                had = _decisions.load(name) is not None
                shape = _stored(patch, version, read, made=True)[0]
                earlier = _earlier(patch, series, _rank)
                on_series = _stored(patch, version, read, False, earlier)[0] if earlier else None
                verdict = judge(patch, None, version, series, shape, _rank, on_series)[0]
                if _decisions.load(name) is None:
                    done.append((patch.id, "not stored: %s cannot be written (%s)" % (_decisions.directory(), verdict)))
                    continue
                done.append((patch.id, "%s (%s)" % ("already stored" if had else "stored", verdict)))
            except Exception as exc:
                done.append((patch.id, "not stored: %r" % (exc,)))
            finally:
                _lazy.forget()
    finally:
        _decisions._forced.pop()
    return done


def read_source(path):
    import tokenize

    with tokenize.open(path) as handle:  # honours a PEP 263 coding line, as get_source does
        return handle.read()


def loader_source(loader, name, origin):
    """Source text through ``loader``; None when the loader has none (sourceless)."""
    get_source = getattr(loader, "get_source", None)
    if get_source is not None:
        try:
            text = get_source(name)
        except (ImportError, OSError, UnicodeDecodeError):
            text = None
        if text is not None:
            return text
    if origin and origin.endswith(".py") and os.path.isfile(origin):
        return read_source(origin)
    return None


def _digest(text):
    from flashfix.core.decisions import digest

    return digest(text)


def _read(targets):
    """What each target's own loader reads now (``loader_source``, as the swap's check reads it): its file
    and a hash of its source text. Asked of the module's spec, not of the reader, which deciding after the import
    would otherwise import again with all it needs."""
    read = []
    for name in targets:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        origin = getattr(spec, "origin", None)
        text = loader_source(getattr(spec, "loader", None), name, origin)
        read.append((name, origin, None if text is None else _digest(text)))
    return tuple(read)


def swap(func, patch_id, qualname, unedited, marked, plain):
    """``rewrite``'s change from code made before ``func``'s module ran (``_source.rewrite_ahead``), or None
    where ``func`` does not run the code ``unedited`` was compiled from (then ``prepare`` reads it again)."""
    code = func.__code__
    if (func.__qualname__ != qualname or code.co_filename != marked.co_filename
            or getattr(code, "co_qualname", None) != getattr(marked, "co_qualname", None)
            or code_difference(unedited, code) is not None):
        return None
    return SwapCode(func, marked, plain, site_of(patch_id, qualname), ahead=True)


def _decide(patch, record):
    cfg = config()
    if cfg.strict and cfg.problems:
        _strict(patch, "; ".join(cfg.problems), True)
    targets = record["targets"]
    modules = {name: sys.modules[name] for name in targets}
    version = record["engine_version"]
    with _lock:
        ahead = _ahead.pop(patch.id, None)
    if ahead is not None and ahead[0] != _read(targets):
        ahead = None  # a file changed since: read it again
    record["ahead"] = ahead is not None
    if ahead is not None:
        log.debug("%s: judged from the source read just before %s ran", patch.id, ", ".join(targets))
    with _lock:
        series = {f: list(members) for f, members in _series.items()}
    earlier = _earlier(patch, series, _rank)
    if ahead is None:  # not read ahead (imported before flashfix ran): stored, or judged now
        read = _read(targets)
        ahead = (read,) + _stored(patch, version, read, made=False)
    on_series = None
    if earlier:  # judged and compiled on the code the patches before it leave, not on what was made ahead
        ahead, record["ahead"] = ahead[:2] + (None,), False
        on_series = _stored(patch, version, ahead[0], False, earlier)[0]
    verdict, reason = judge(patch, None, version, series, ahead[1], _rank, on_series)
    if verdict == "patch":
        _join_series(patch, series)
    else:
        _set(patch, verdict, reason)
        if verdict == "unknown-shape":
            log.warning("%s: %s %s left untouched: %s", patch.id, patch.engine, version, reason)
            _strict(patch, reason, in_range(patch, version))
        else:
            log.debug("%s: %s", patch.id, reason)
        return
    try:
        changes = patch.rule.prepare_ahead(modules, *ahead[2]) if ahead is not None and ahead[2] is not None else None
        if changes is None and earlier:  # its hunks matched on the code the patches before it leave
            copies = series_trees(earlier)
            changes = patch.rule.prepare(modules, lambda m: copies[m] if m in copies else _source.module_ast(m, modules))
        elif changes is None:  # nothing made ahead, or a loaded function does not run the code it was made from
            changes = patch.prepare(modules)
    except NotBound as exc:
        _leave_series(patch)
        _set(patch, "not-affected", str(exc))
        log.debug("%s: %s", patch.id, exc)
        return
    except ShapeError as exc:
        _leave_series(patch)
        _set(patch, "unknown-shape", str(exc))
        log.warning("%s: %s %s left untouched: %s", patch.id, patch.engine, version, exc)
        _strict(patch, str(exc), True)
        return
    except Exception as exc:
        _leave_series(patch)
        _fail(patch, "preparing the patch failed: %r" % (exc,))
        return
    done = []
    try:
        for change in changes:
            change.apply()
            done.append(change)
    except Exception as exc:
        for undone in reversed(done):
            try:
                undone.undo()
            except Exception as undo_exc:  # pragma: no cover - reported, nothing else to do
                log.error("%s: undoing %r failed: %r", patch.id, undone, undo_exc)
        _leave_series(patch)
        _fail(patch, "applying %r failed, earlier parts undone: %r" % (change, exc))
        return
    again = record["state"] == "applied"
    with _lock:
        record["changes"].extend(changes)  # after a reload the old functions keep theirs, revert undoes all
    _set(patch, "applied", "%s (%s %s)" % (patch.summary, patch.engine, version))
    log.info("%s %s to %s %s in pid %d: %s; upstream %s", "re-applied" if again else "applied", patch.id,
             patch.engine, version, os.getpid(), ", ".join(map(repr, changes)), patch.upstream)


def _join_series(patch, judged):
    """Record ``patch`` in the series of the functions its judgement (``judged``: the series it was given) put it in."""
    with _lock:
        for function, members in judged.items():
            if patch in members:
                mine = _series.setdefault(function, [])
                if patch not in mine:
                    mine.append(patch)
                    mine.sort(key=_rank)


def _leave_series(patch):
    with _lock:
        for function, members in list(_series.items()):
            if patch in members:
                members.remove(patch)
                if not members:
                    del _series[function]


def _fail(patch, reason):
    _set(patch, "failed", reason)
    log.error("%s: %s; %s left as it was", patch.id, reason, patch.engine)
    _strict(patch, reason, True)


def _strict(patch, reason, affected):
    if affected and config().strict:
        # The targets' code has run: take them out of sys.modules, as Python does for a failed
        # import, so that every later import of them runs them again and fails again (the one
        # whose import is in progress fails now, with this error).
        for name in _records[patch.id]["targets"]:
            if flashfix._complete(name):  # imported, its code run
                del sys.modules[name]
        raise PatchError("flashfix strict mode: %s could not be applied to %s %s: %s" % (
            patch.id, patch.engine, _records[patch.id]["engine_version"], reason))


def _set(patch, state, reason):
    _records[patch.id].update(state=state, reason=reason)


def mark_ran(site):
    """Called by the marker statement inside rewritten code (as ``__flashfix_mark__(site)``): record that the
    patch ran, then give the function its marker-free code. Written so that ``torch.compile`` traces it (dict
    lookups and one store, replayed by the compiled code); while tracing, the code is left alone."""
    record = _records.get(site.split(":", 1)[0])
    if record is not None:
        record["ran"] = True
    torch = sys.modules.get("torch")
    if torch is not None and _compiling(torch):
        return
    change = _sites.get(site)
    if change is not None and change.func.__code__ is change.marked:
        change.pending.discard(site)
        if not change.pending:  # every patch of the series has run its marker
            change.func.__code__, change.marked = change.plain, None  # never needed again (vLLM 0.28.0 build: 8.5 KiB)


def _compiling(torch):
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_compiling", None)
    return bool(check is not None and check())


def note_ran(patch_id):
    """For patch code written in Python (not rewritten engine code): it ran."""
    record = _records.get(patch_id)
    if record is not None:
        record["ran"] = True


# --- public API -----------------------------------------------------------------------------


def status():
    """Per patch: id, engine, state, reason, engine_version, ran, upstream, fixed_in."""
    load_all()
    flashfix.flush()  # a target whose import finished since, without another import after it
    rows = []
    for patch in _patches.values():
        record = _records[patch.id]
        state, reason, version = record["state"], record["reason"], record["engine_version"]
        if state == "waiting":
            version = version or engine_version(patch.engine)
            try:
                targets = record["targets"] or targets_of(patch)
            except Exception as exc:
                targets, state, reason = (), "unknown-shape", "cannot tell which modules to patch: %r" % (exc,)
            missing = [t for t in targets if _source.module_file(t) is None]
            if not targets:
                pass
            elif version is None and len(missing) == len(targets):
                state, reason = "not-installed", "%s is not installed" % patch.engine
            elif config().is_disabled(patch.id, patch.memory):
                state, reason = "disabled", config().disabled_reason(patch.id, patch.memory)
            elif missing:  # as the doctor judges it: the code the bug lives in does not exist here
                state, reason = "not-affected", "module %s does not exist in %s %s" % (", ".join(missing), patch.engine, version)
        rows.append({"id": patch.id, "engine": patch.engine, "state": state, "reason": reason, "engine_version": version,
                     "ran": record["ran"], "upstream": patch.upstream, "fixed_in": patch.fixed_in})
    _lazy.forget()
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
            _take_back(patch, "reverted by flashfix.revert()")
            while _stranded:  # a later member of a series, judged on the code this one left: not left half-applied
                pid, under = _stranded.pop()
                if _records[pid]["state"] == "applied":
                    _take_back(_patches[pid], "reverted with %s, on whose code it was judged" % under)


def _take_back(patch, reason):
    record = _records[patch.id]
    for change in reversed(record["changes"]):
        change.undo()
    _leave_series(patch)
    record["changes"], record["ran"] = [], False
    _set(patch, "disabled", reason)
    log.info("%s: %s, in pid %d", patch.id, reason, os.getpid())
