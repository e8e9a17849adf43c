"""flashfix: backports of upstream FlashInfer-backend fixes into vLLM and SGLang, applied at import.

This module runs at every interpreter start (through ``flashfix.pth`` / ``flashfix.start``),
so it only installs one import hook and returns: no engine, torch, FlashInfer or wrapt is
imported here. When an engine's top-level package is imported, the flashfix module that
declares that engine's patches is loaded, and each patch is applied once its own target
modules are imported. Everything else (``status``, ``revert``, ``doctor``) loads on use.
"""

__version__ = "0.1.0"

# Top-level package whose import loads a patch module -> that module. The only place where
# the package names its patch modules; the mechanism itself (_hooks, _registry) is generic.
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


def _load_patch_module(module):
    from flashfix import _registry

    _registry.load_patch_module(PATCH_MODULES[module.__name__])


def activate():
    """Install the import hooks (idempotent). Every activation path ends here."""
    import os

    if os.environ.get("FLASHFIX_DISABLE", "").strip().lower() == "all":
        return
    from flashfix import _hooks

    for top in PATCH_MODULES:
        if not _activated.get(top):
            _activated[top] = True
            _hooks.when_imported(top, _load_patch_module)


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
    import sys as _sys

    _sys.stderr.write("flashfix: activation failed, no patch will apply: %r\n" % (_exc,))
