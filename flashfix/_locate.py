"""Where a module's source comes from, without importing it.

A *reader* answers two questions for the shape probes and the doctor: the source text of a
module (``find(name)``) and the version of a distribution (``version(dist)``). The current
reader is a context variable, so the same probe code reads the running interpreter's
modules, a wheel, a directory tree or another environment (``flashfix doctor --path`` /
``--python``) without knowing which.

``ImportSystem`` (the default) locates a module the way ``import`` does: the finders on
``sys.meta_path`` are asked in order, top-level package first, each submodule with its
parent's ``__path__``. A parent already imported contributes its real ``__path__``; one not
imported contributes its spec's ``submodule_search_locations``, so nothing is imported. This
is what makes setuptools' PEP 660 editable finders, ``.pth`` path entries, zipped packages
and sourceless installs read the same way at doctor time as at runtime. The text comes from
the loader (``get_source``), which is how a zipped module is read; a loader that has no
source (``.pyc`` only) gives ``Found(text=None)``, which the registry reports as
``unknown-shape``, never as "not affected".
"""

import contextvars
import os
import sys
from collections import namedtuple

Found = namedtuple("Found", "name origin text")  # text None: the module exists but has no source


def _read(path):
    import tokenize

    with tokenize.open(path) as handle:  # honours a PEP 263 coding line, as get_source does
        return handle.read()


def _loader_source(loader, name, origin):
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
        return _read(origin)
    return None


class ImportSystem:
    """Modules as the running interpreter would import them."""

    label = "this interpreter"

    def find(self, name):
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None) if module is not None else None
        if spec is None:
            spec = self._spec(name)
            if spec is None:
                return None
        origin = spec.origin if spec.has_location else getattr(module, "__file__", None) or spec.origin
        if spec.loader is None and spec.submodule_search_locations is not None:
            return Found(name, origin, None)  # a namespace package: no code at all
        return Found(name, origin, _loader_source(spec.loader, name, origin))

    def _spec(self, name):
        parts = name.split(".")
        path = None
        spec = None
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            module = sys.modules.get(prefix)
            if module is not None and depth < len(parts):
                path = getattr(module, "__path__", None)
                if path is None:
                    return None
                continue
            spec = _meta_path_spec(prefix, path)
            if spec is None:
                return None
            if depth < len(parts):
                path = spec.submodule_search_locations
                if path is None:
                    return None
        return spec

    def version(self, dist):
        from importlib import metadata

        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def describe(self):
        return self.label


def _meta_path_spec(name, path):
    for finder in list(sys.meta_path):
        if getattr(finder, "flashfix_finder", False):
            continue  # ours only delegates to the finders behind it
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except Exception:  # a third-party finder that trips: the import system would raise, we say absent
            continue
        if spec is not None:
            return spec
    return None


_current = contextvars.ContextVar("flashfix_reader", default=None)
_default = ImportSystem()


def reader():
    return _current.get() or _default


class reading:
    """``with reading(r): ...`` makes ``r`` the reader for the probes run inside."""

    def __init__(self, r):
        self.reader, self._token = r, None

    def __enter__(self):
        self._token = _current.set(self.reader)
        return self.reader

    def __exit__(self, *exc):
        _current.reset(self._token)


def find(name):
    return reader().find(name)


def version(dist):
    return reader().version(dist)
