"""flashfix: backports of upstream FlashInfer-backend fixes into vLLM and SGLang, applied at import.

At interpreter start ``flashfix.pth`` (``flashfix.start`` on Python 3.15+, PEP 829) imports only
``_flashfix_boot``, a small top-level module whose finder imports this package when the code of
``vllm``, ``sglang`` or ``flashinfer`` first starts to run (from that package's loader: a finder
runs under Python's global import lock), so a process that never imports an engine (pip, a health
check) pays for that module alone. ``import flashfix`` and the engines' plugin entry points
activate directly. No engine, torch, FlashInfer or wrapt is imported here. An engine's first
import loads the patch packs named after it (``flashfix.core.packs``); each patch applies once its
own target modules are imported. Everything else (``status``, ``revert``, ``doctor``) loads on use.

Post-import hooks (standard library only): one finder sits at the front of
``sys.meta_path`` (and moves back there whenever it is asked, if a finder was put ahead of it
since); for a watched module it asks the other finders for the real spec and wraps the loader
so that, once the module's code has run, the module's callbacks run. The wrapper looks like the
real loader to everything but ``type()`` (``isinstance``, equality, ``__dict__``; a copy or
pickle of it is the real loader) and puts the real loader back on the module and its spec.
A module already imported gets its callbacks at once, a reload runs them again, and one still
being imported (flashfix activated from inside its import, by a plugin loader, or in another
thread) gets them when its import ends (``_watch``). Nothing is ever decided, probed or imported
from a finder. A callback that raises is contained (reported through ``on_error``) unless it
raises ``HookAbort``: under strict mode any failure of a callback fails the import. The wrapper
also runs ``before_run`` callbacks just before the module's code, which never fail the import.
"""

import _imp
import _thread  # not threading: threading pulls functools and collections into every start
import sys

__version__ = "0.2.0"

# Engine top-level package, whose first import loads patches (flashfix's and the packs' named after
# it, see _packs) -> flashfix's own patch module for it (also an entry point in pyproject.toml).
# The mechanism itself (below, _registry and _packs) is generic.
PATCH_MODULES = {"vllm": "flashfix.vllm_patch", "sglang": "flashfix.sglang_patch",
                 "flashinfer": "flashfix.flashinfer_patch"}

_API = {"status": "flashfix.core.registry", "revert": "flashfix.core.registry", "PatchError": "flashfix.core.registry",
        "ConfigError": "flashfix.core.config"}


# --- post-import hooks ------------------------------------------------------------------------

_lock = _thread.RLock()  # held only for bookkeeping, never across an import or a callback
_callbacks = {}  # module name -> callables taking the module; kept, so a reload or re-import runs them again
_generation = {}  # module name -> how many times its code has run under our loader (a reload counts)
_pending = {}  # module name -> [spec, module or None, callbacks or _ALL]: an import in progress whose end we watch
_deferred = {}  # module name -> callbacks (or _ALL): an import whose end cannot be watched (legacy loader)
_resolving = set()  # (thread id, module name) whose spec we are asking the other finders for
_before = {}  # module name -> callables run just before its code runs under our loader (before_run)
_ALL = None


class HookAbort(Exception):
    """Raised by a callback to make the import of its module fail (strict mode)."""


def _report(name, exc):
    # The registry replaces this with a logging-based reporter once loaded.
    sys.stderr.write("flashfix: post-import hook for %s failed: %r\n" % (name, exc))


on_error = _report


def _strict():
    import os

    return os.environ.get("FLASHFIX_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _call(name, callback, module):
    try:
        callback(module)
    except HookAbort:
        raise
    except Exception as exc:  # never break the engine's import, unless strict mode asks for it
        if _strict():
            raise HookAbort("flashfix strict mode: the post-import hook for %s failed: %r" % (name, exc)) from exc
        on_error(name, exc)


def _take(name):
    """Under ``_lock``: every callback of ``name``, about to run them all (a watch on its import's end is dropped)."""
    _deferred.pop(name, None)
    _unwatch(name)
    return list(_callbacks.get(name, ()))


def _run(name, module, callbacks):
    try:
        for callback in callbacks:
            _call(name, callback, module)
    except HookAbort:
        if sys.modules.get(name) is module:
            del sys.modules[name]  # as for any failed import: the next import runs it, and is judged, again
        raise


_executed = set()  # names whose code has run and whose callbacks are running (still "initializing")


def _complete(name):
    """``name`` is imported and its code has run (true inside its own post-import callbacks)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and (name in _executed or not getattr(spec, "_initializing", False))


# Watching the end of an import already in progress: in ``_load_unlocked`` the import system sets
# ``spec._initializing`` back to False in a ``finally``, once the module's code has run and it sits
# in sys.modules, under that module's own lock, never the global import lock. To hear that step the
# spec object alone is given, for the rest of its import, a subclass of its own class (same name,
# no new state) whose ``__setattr__`` calls back; its class is put back at once. An exception raised
# there is raised by that import, so strict mode fails the target's own import (``_run`` first takes
# the module out of sys.modules, so the next import of it runs again).

_spec_classes = {}


def _spec_class(base):
    cls = _spec_classes.get(base)
    if cls is None:
        def __setattr__(self, attr, value):
            base.__setattr__(self, attr, value)
            if attr == "_initializing" and not value:
                _import_finished(self)

        def __reduce_ex__(self, protocol):  # a copy or pickle is a plain spec
            import copyreg

            return copyreg._reconstructor, (base, object, None), dict(self.__dict__)

        _spec_classes[base] = cls = type(base.__name__, (base,), {
            "__slots__": (), "__setattr__": __setattr__, "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__reduce_ex__": __reduce_ex__})
    return cls


def _watch(name, spec, module, callbacks):
    """Under ``_lock``: run ``callbacks`` when the import of ``name`` in progress ends. False when
    that cannot be watched (no such import now, or a spec whose class cannot be changed)."""
    entry = _pending.get(name)
    if entry is not None and entry[0] is spec:
        if entry[2] is not _ALL:
            entry[2] = _ALL if callbacks is _ALL else entry[2] + list(callbacks)
        return True
    if spec is None or not getattr(spec, "_initializing", True):
        return False
    base = type(spec)
    try:
        spec.__class__ = _spec_class(base)
    except Exception:  # a spec of a built-in type, or one that refuses: the caller falls back
        return False
    if module is not None and not getattr(spec, "_initializing", False):  # ended meanwhile (another thread)
        spec.__class__ = base
        return False
    _pending[name] = [spec, module, _ALL if callbacks is _ALL else list(callbacks)]
    return True


def _unwatch(name):
    entry = _pending.pop(name, None)
    if entry is not None:
        try:
            entry[0].__class__ = type(entry[0]).__mro__[1]
        except Exception:  # pragma: no cover - it was assignable a moment ago
            pass
    return entry


def _import_finished(spec):
    with _lock:
        name = next((n for n, entry in _pending.items() if entry[0] is spec), None)
        if name is None:
            return
        _, module, callbacks = _unwatch(name)
        current = sys.modules.get(name)
        if current is None:
            return  # the import failed: the callbacks stay registered for the next one
        if callbacks is _ALL:
            callbacks = list(_callbacks.get(name, ()))
    _run(name, current, callbacks)


def flush():
    """Run the callbacks waiting for an import whose end could not be watched (a legacy loader), from
    ``status()``. A strict failure is reported and the module leaves sys.modules (its next import fails)."""
    if not _deferred:
        return
    with _lock:
        ready = [(name, _deferred.pop(name)) for name in list(_deferred) if _complete(name)]
        for name in [n for n, c in _deferred.items() if c is not _ALL and n not in sys.modules]:
            del _deferred[name]  # its import failed; its callbacks stay registered for the next one
        ready = [(name, list(_callbacks.get(name, ())) if c is _ALL else c) for name, c in ready]
    for name, callbacks in ready:
        try:
            _run(name, sys.modules.get(name), callbacks)
        except HookAbort as exc:
            on_error(name, exc)


def _to_front(finder):
    """Put ``finder`` back at the front of sys.meta_path, from its ``find_spec`` while the import system walks
    that list: taken from index i and put at 0, every later index is as it was (the walk goes on the same)."""
    meta = sys.meta_path
    try:
        for i, other in enumerate(meta):
            if other is finder:
                del meta[i]
                meta.insert(0, finder)
                return
    except Exception:  # a sys.meta_path that is not a list: leave it as it is
        pass


class _Loader:
    """Delegates to the real loader, then runs the module's post-import callbacks; looks like the
    real loader to everything but ``type()`` (the module docstring)."""

    __slots__ = ("_loader", "_name")

    def __init__(self, loader, name):
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr in _Loader.__slots__:  # not set (an object made without __init__)
            raise AttributeError(attr)
        return getattr(self._loader, attr)

    def __setattr__(self, attr, value):
        setattr(self._loader, attr, value)

    def __delattr__(self, attr):
        delattr(self._loader, attr)

    @property
    def __class__(self):
        return type(self._loader)

    @property
    def __dict__(self):
        return self._loader.__dict__

    def __reduce_ex__(self, protocol):
        return self._loader.__reduce_ex__(protocol)

    def __eq__(self, other):
        return self._loader == (other._loader if type(other) is _Loader else other)

    def __hash__(self):
        return hash(self._loader)

    def __repr__(self):
        return repr(self._loader)

    def __dir__(self):
        return dir(self._loader)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # Put the real loader back first, so the module looks as if we were never here.
        try:
            module.__loader__ = self._loader
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
        except Exception:  # an object that refuses attributes: the import system copes, so do we
            pass
        with _lock:
            before = list(_before.get(self._name, ()))
        for callback in before:
            try:
                callback(module)
            except Exception as exc:  # HookAbort too: nothing decided here may fail the import
                on_error(self._name + " (before it ran)", exc)
        self._loader.exec_module(module)
        with _lock:
            _generation[self._name] = _generation.get(self._name, 0) + 1
            _executed.add(self._name)
            callbacks = _take(self._name)
        try:
            _run(self._name, sys.modules.get(self._name, module), callbacks)
        finally:
            _executed.discard(self._name)


class _Finder:
    """The one meta-path finder; only watched names are looked at. It never decides, probes or
    imports anything: Python calls it under its global import lock."""

    flashfix_finder = True  # lets activate() recognise an instance from another copy of this module

    def find_spec(self, fullname, path=None, target=None):
        if sys.meta_path[0] is not self:  # a finder put ahead of us since: take the front back
            _to_front(self)
        if fullname not in _callbacks:
            return None
        key = (_thread.get_ident(), fullname)
        if key in _resolving:
            return None
        _resolving.add(key)
        try:
            for finder in sys.meta_path:
                if finder is self or getattr(finder, "flashfix_finder", False):
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            _resolving.discard(key)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            # no loader to wrap (a namespace package, a legacy loader): the callbacks run when
            # the import ends (watched through the spec), or else at status()
            with _lock:
                if target is not None or not _watch(fullname, spec, None, _ALL):
                    _deferred[fullname] = _ALL
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec

    def invalidate_caches(self):
        pass


def _install():
    """Put the finder on sys.meta_path, once per process: in the start-up finder's slot if there
    is one (replaced in place, so a walk over sys.meta_path in another thread skips nothing), else
    at the front; under Python's global import lock, as every change flashfix makes to that list."""
    _imp.acquire_lock()
    try:
        meta = sys.meta_path
        boots = [finder for finder in meta if getattr(finder, "flashfix_boot", False)]
        for boot in boots:
            boot.retired = True  # the start-up finder's only job was to get here
        if any(getattr(f, "flashfix_finder", False) and not getattr(f, "flashfix_boot", False) for f in meta):
            return
        if boots:
            meta[[i for i, f in enumerate(meta) if f is boots[0]][0]] = _Finder()
        else:
            meta.insert(0, _Finder())
    finally:
        _imp.release_lock()


def when_imported(name, callback):
    """Call ``callback(module)`` after ``name``'s code has run: at once if it has, when its import ends if it
    is being imported now (in any thread), and again after a reload or re-import. Never from a finder."""
    with _lock:  # the finder looks at a name from now on, so no import of it slips between the two
        _callbacks.setdefault(name, [])
    _install()
    with _lock:
        _callbacks[name].append(callback)
        module = sys.modules.get(name)
        if module is None:
            return  # the finder calls back once the module's code has run
        if not _complete(name):  # mid-import (we were activated from inside it): when it ends
            if _watch(name, getattr(module, "__spec__", None), module, [callback]):
                return
            if not _complete(name):  # cannot watch it: at status()
                waiting = _deferred.get(name, [])
                if waiting is not _ALL:
                    _deferred[name] = waiting + [callback]
                return
    _call(name, callback, module)


def before_run(name, callback):
    """Also call ``callback(module)`` just before ``name``'s code runs, each time it runs under flashfix's
    loader (``when_imported`` must watch ``name``), with its module object still empty. Work done there is
    freed before the module's own imports, which reuse that memory. Never for a module imported before or one
    whose loader cannot be wrapped; an exception is reported, never raised into the import."""
    with _lock:
        _before.setdefault(name, []).append(callback)


def watched():
    with _lock:
        return sorted(_callbacks)


def generation(name):
    """How many times ``name``'s code has run under flashfix's loader (0: before flashfix)."""
    return _generation.get(name, 0)


# --- activation -------------------------------------------------------------------------------


def _load_engine(top, module):
    from flashfix.core import registry as _registry

    _registry.load_engine(top)


def activate():
    """Install the import hooks (idempotent). Every activation path ends here."""
    import os

    if "all" in [item.strip().lower() for item in os.environ.get("FLASHFIX_DISABLE", "").split(",")]:
        return
    for top in PATCH_MODULES:
        if not _activated.get(top):
            _activated[top] = True
            when_imported(top, lambda module, top=top: _load_engine(top, module))


_activated = {}


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError("module 'flashfix' has no attribute %r" % (name,))


def __dir__():
    return sorted(list(globals()) + list(_API))


_activation_error = None  # a strict-mode failure met while activating (raised again by the plugin entry point)
try:
    activate()
except HookAbort as _exc:
    # Strict mode, for an affected module that was imported before flashfix: that import is
    # over, so the module was taken out of sys.modules and every later import of it fails.
    _activation_error = _exc
    on_error("a module imported before flashfix", _exc)
except Exception as _exc:  # never break the interpreter's start or the caller's import, unless strict
    if _strict():
        raise
    sys.stderr.write("flashfix: activation failed, no patch will apply: %r\n" % (_exc,))
