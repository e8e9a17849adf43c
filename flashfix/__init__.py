"""flashfix: backports of upstream FlashInfer-backend fixes into vLLM and SGLang, applied at import.

At interpreter start ``flashfix.pth`` (``flashfix.start`` on Python 3.15+, PEP 829) imports
only ``_flashfix_boot``, a top-level module of a few lines whose finder imports this package
when the code of ``vllm``, ``sglang`` or ``flashinfer`` first starts to run (from that
package's loader, not from a finder, where Python holds its global import lock); so a Python
process that never imports an engine (pip, a health check) pays for that small module alone.
``import flashfix`` itself and the engines' plugin entry points activate directly. No engine,
torch, FlashInfer or wrapt is imported here. When an engine's top-level package is imported,
the patch packs named after it are loaded (flashfix's own patch module for that engine and any
other distribution's, entry-point group ``flashfix.patches``), and each patch is applied once
its own target modules are imported. Everything else (``status``, ``revert``, ``doctor``)
loads on use.

Post-import hooks (standard library only): one finder sits at the front of
``sys.meta_path``; for a watched module it asks the finders behind it for the real spec and
wraps the loader so that, once the module's code has run, the module's callbacks run. A
module already imported gets its callbacks at once; one still being imported gets them when
its import finishes (``flush``); a reload runs them again. A callback that raises is
contained (reported through ``on_error``) unless it raises ``HookAbort``, which is how strict
mode makes an import fail loudly; under strict mode any failure of a callback does.
"""

import _thread  # not threading: threading pulls functools and collections into every start
import sys

__version__ = "0.2.0"

# Engine top-level package -> flashfix's own patch module for it. Its keys are the packages
# whose first import loads patches (flashfix's and the packs' of the entry-point group
# ``flashfix.patches`` named after them, see _packs); its values are also declared in that group
# in pyproject.toml, and are added from here when no installed metadata lists them (a source
# checkout). The mechanism itself (below, _registry and _packs) is generic.
PATCH_MODULES = {
    "vllm": "flashfix.vllm_patch",
    "sglang": "flashfix.sglang_patch",
    "flashinfer": "flashfix.flashinfer_patch",
}

_API = {
    "status": "flashfix._registry",
    "revert": "flashfix._registry",
    "PatchError": "flashfix._registry",
    "ConfigError": "flashfix._config",
}


# --- post-import hooks ------------------------------------------------------------------------

_lock = _thread.RLock()  # held only for bookkeeping, never across an import or a callback
_callbacks = {}  # module name -> callables taking the module; kept, so a reload or re-import runs them again
_generation = {}  # module name -> how many times its code has run under our loader (a reload counts)
_deferred = {}  # module name -> callbacks (or _ALL) waiting for that module's import to finish
_resolving = set()  # (thread id, module name) whose spec we are asking the other finders for
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


def _run(name, module):
    """Run every callback of ``name``: its code has just run (import, re-import or reload)."""
    with _lock:
        _deferred.pop(name, None)
        callbacks = list(_callbacks.get(name, ()))
    for callback in callbacks:
        _call(name, callback, module)


_executed = set()  # names whose code has run and whose callbacks are running (still "initializing")


def _complete(name):
    """``name`` is imported and its code has run (true inside its own post-import callbacks)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return name in _executed or not getattr(getattr(module, "__spec__", None), "_initializing", False)


def flush():
    """Run the callbacks that waited for a module's import to finish (see ``when_imported``)."""
    if not _deferred:
        return
    with _lock:
        ready = [(name, _deferred.pop(name)) for name in list(_deferred) if _complete(name)]
        for name in [n for n, c in _deferred.items() if c is not _ALL and n not in sys.modules]:
            del _deferred[name]  # its import failed; its callbacks stay registered for the next one
    for name, callbacks in ready:
        module = sys.modules.get(name)
        if callbacks is _ALL:
            _run(name, module)
        else:
            for callback in callbacks:
                _call(name, callback, module)


class _Loader:
    """Delegates to the real loader, then runs the module's post-import callbacks."""

    def __init__(self, loader, name):
        self._loader, self._name = loader, name

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

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
        self._loader.exec_module(module)
        with _lock:
            _generation[self._name] = _generation.get(self._name, 0) + 1
            _executed.add(self._name)
        try:
            _run(self._name, sys.modules.get(self._name, module))
        finally:
            _executed.discard(self._name)


class _Finder:
    """The one meta-path finder; only watched names are looked at."""

    flashfix_finder = True  # lets activate() recognise an instance from another copy of this module

    def find_spec(self, fullname, path=None, target=None):
        if _deferred:
            flush()
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
            # no loader to wrap (a namespace package, a legacy loader): the callbacks run once
            # the import has finished, at the next import or status()
            with _lock:
                _deferred[fullname] = _ALL
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec

    def invalidate_caches(self):
        pass


def _install():
    """Put the finder on sys.meta_path, once per process: in the start-up finder's slot if there
    is one (replaced in place, so a walk over sys.meta_path in another thread skips nothing),
    else at the front."""
    with _lock:
        boots = [i for i, finder in enumerate(sys.meta_path) if getattr(finder, "flashfix_boot", False)]
        for i in boots:
            sys.meta_path[i].retired = True  # the start-up finder's only job was to get here
        if any(getattr(f, "flashfix_finder", False) and not getattr(f, "flashfix_boot", False) for f in sys.meta_path):
            return
        if boots:
            sys.meta_path[boots[0]] = _Finder()
        else:
            sys.meta_path.insert(0, _Finder())


def when_imported(name, callback):
    """Call ``callback(module)`` after ``name``'s code has run: at once if it already has, once
    its import finishes if it is being imported right now, and again after a reload."""
    _install()
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if name not in sys.modules:
            return  # the finder calls back once the module's code has run
        if not _complete(name):  # mid-import (we were activated from inside it): after it
            waiting = _deferred.get(name, [])
            if waiting is not _ALL:
                _deferred[name] = waiting + [callback]
            return
    _call(name, callback, sys.modules[name])


def watched():
    with _lock:
        return sorted(_callbacks)


def generation(name):
    """How many times ``name``'s code has run under flashfix's loader (0: before flashfix)."""
    return _generation.get(name, 0)


# --- activation -------------------------------------------------------------------------------


def _patch_module_loader(top):
    def load(module):
        from flashfix import _registry

        _registry.load_engine(top)

    return load


def activate():
    """Install the import hooks (idempotent). Every activation path ends here."""
    import os

    if "all" in [item.strip().lower() for item in os.environ.get("FLASHFIX_DISABLE", "").split(",")]:
        return
    for top in PATCH_MODULES:
        if not _activated.get(top):
            _activated[top] = True
            when_imported(top, _patch_module_loader(top))


_activated = {}


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError("module 'flashfix' has no attribute %r" % (name,))


def __dir__():
    return sorted(list(globals()) + list(_API))


try:
    activate()
except Exception as _exc:  # never break the interpreter's start or the caller's import
    sys.stderr.write("flashfix: activation failed, no patch will apply: %r\n" % (_exc,))
