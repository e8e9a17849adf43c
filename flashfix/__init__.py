"""flashfix: backports of upstream FlashInfer-backend fixes into vLLM and SGLang, applied at import.

This module runs at every interpreter start (through ``flashfix.pth`` / ``flashfix.start``),
so it only installs one import hook and returns: no engine, torch, FlashInfer or wrapt is
imported here. When an engine's top-level package is imported, the flashfix module that
declares that engine's patches is loaded, and each patch is applied once its own target
modules are imported. Everything else (``status``, ``revert``, ``doctor``) loads on use.

The post-import hook mechanism lives in this file rather than a module of its own on
purpose: every module loaded at start-up costs about 0.3 ms of import-system work on top of
its code, in every Python process of the environment (see benchmarks/bench_startup.py).

Post-import hooks (standard library only): one finder sits at the front of
``sys.meta_path``; for a watched module it asks the finders behind it for the real spec and
wraps the loader so that, once the module's code has run, the module's callbacks run. A
module already imported gets its callbacks at once. A callback that raises is contained
(reported through ``on_error``) unless it raises ``HookAbort``, which is how strict mode
makes an import fail loudly.
"""

import _thread  # not threading: threading pulls functools and collections into every start
import sys

__version__ = "0.1.0"

# Top-level package whose import loads a patch module -> that module. The only place where
# the package names its patch modules; the mechanism itself (below, and _registry) is generic.
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

_lock = _thread.RLock()
_callbacks = {}  # module name -> list of callables taking the module
_in_progress = set()  # names whose spec we are resolving (guards re-entry)


class HookAbort(Exception):
    """Raised by a callback to make the import of its module fail (strict mode)."""


def _report(name, exc):
    # The registry replaces this with a logging-based reporter once loaded.
    sys.stderr.write("flashfix: post-import hook for %s failed: %r\n" % (name, exc))


on_error = _report


def _run(module):
    name = module.__name__
    with _lock:
        callbacks = _callbacks.pop(name, ())
    for callback in callbacks:
        try:
            callback(module)
        except HookAbort:
            raise
        except Exception as exc:  # never break the engine's import
            on_error(name, exc)


class _Loader:
    """Delegates to the real loader, then runs the module's post-import callbacks."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, attr):
        return getattr(self._loader, attr)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # Put the real loader back first, so the module looks as if we were never here.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._loader.exec_module(module)
        _run(sys.modules.get(module.__name__, module))


class _Finder:
    """The one meta-path finder; only watched names are looked at."""

    flashfix_finder = True  # lets activate() recognise an instance from another copy of this module

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _callbacks or fullname in _in_progress:
            return None
        _in_progress.add(fullname)
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
            _in_progress.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # namespace package or legacy loader: leave it alone
        spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def _install():
    """Put the finder at the front of sys.meta_path, once per process."""
    with _lock:
        for finder in sys.meta_path:
            if getattr(finder, "flashfix_finder", False):
                return
        sys.meta_path.insert(0, _Finder())


def when_imported(name, callback):
    """Call ``callback(module)`` after ``name`` is imported; at once if it already is."""
    _install()
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            return  # the finder calls back once the module's code has run
    _run(module)


def watched():
    with _lock:
        return sorted(_callbacks)


# --- activation -------------------------------------------------------------------------------


def _load_patch_module(module):
    from flashfix import _registry

    _registry.load_patch_module(PATCH_MODULES[module.__name__])


def activate():
    """Install the import hooks (idempotent). Every activation path ends here."""
    import os

    if os.environ.get("FLASHFIX_DISABLE", "").strip().lower() == "all":
        return
    for top in PATCH_MODULES:
        if not _activated.get(top):
            _activated[top] = True
            when_imported(top, _load_patch_module)


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
