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
        if spec.submodule_search_locations is not None and (spec.loader is None or origin in (None, "namespace")):
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
                try:  # a namespace package's path is recomputed from its parent, which a failed
                    path = list(module.__path__)  # import may have left out of sys.modules
                    continue
                except AttributeError:
                    return None
                except Exception:
                    pass  # located below as if it were not imported
            spec = _meta_path_spec(prefix, path)
            if spec is None:
                return None
            if depth < len(parts):
                if spec.submodule_search_locations is None:
                    return None
                # a plain list: a namespace package's _NamespacePath would look its parent up in sys.modules
                path = list(spec.submodule_search_locations)
        return spec

    def version(self, dist):
        from importlib import metadata

        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    def describe(self):
        return self.label


def _path_spec(name, path):
    """What ``PathFinder.find_spec(name, path)`` finds, without its namespace-package object,
    which looks the parent package up in ``sys.modules`` (it is not imported here)."""
    from importlib.machinery import ModuleSpec, PathFinder

    portions = []
    for entry in path:
        if not isinstance(entry, str):
            continue
        finder = PathFinder._path_importer_cache(entry)  # the finder the import system would use
        find = getattr(finder, "find_spec", None)
        spec = find(name) if find is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions.extend(spec.submodule_search_locations or ())
    if portions:
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = portions
        return spec
    return None


def _meta_path_spec(name, path):
    from importlib.machinery import PathFinder

    for finder in list(sys.meta_path):
        if getattr(finder, "flashfix_finder", False):
            continue  # ours only delegates to the finders behind it
        if finder is PathFinder:
            spec = _path_spec(name, sys.path if path is None else path)
            if spec is not None:
                return spec
            continue
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


def _normal(dist):
    import re

    return re.sub(r"[-_.]+", "-", dist).lower()


def _metadata_version(text):
    from email.parser import HeaderParser

    headers = HeaderParser().parsestr(text)
    return headers.get("Name"), headers.get("Version")


class ZipReader:
    """Modules inside a zip archive (a wheel), read without unpacking or installing it.
    ``archive`` is a ``zipfile.ZipFile`` (over a local file or any seekable file object)."""

    def __init__(self, archive, label, root=""):
        self.archive, self.label, self.root = archive, label, root
        self.names = set(archive.namelist())

    def _member(self, name):
        base = self.root + name.replace(".", "/")
        for candidate in (base + ".py", base + "/__init__.py"):
            if candidate in self.names:
                return candidate, True
        for candidate in (base + ".pyc", base + "/__init__.pyc"):
            if candidate in self.names:
                return candidate, False
        if any(n.startswith(base + "/") for n in self.names):
            return base + "/", False  # a directory without __init__: a namespace package
        return None, False

    def find(self, name):
        member, has_source = self._member(name)
        if member is None:
            return None
        origin = "%s!/%s" % (self.label, member)
        if not has_source:
            return Found(name, origin, None)
        import io

        raw = self.archive.read(member)
        import tokenize

        text = tokenize.decode_source(raw) if hasattr(tokenize, "decode_source") else io.TextIOWrapper(
            io.BytesIO(raw), encoding=tokenize.detect_encoding(io.BytesIO(raw).readline)[0]).read()
        return Found(name, origin, text)

    def version(self, dist):
        wanted = _normal(dist)
        for member in sorted(self.names):
            if member.endswith(".dist-info/METADATA") and member.count("/") == 1:
                # "<name>-<version>.dist-info": the name is what precedes the last "-" before ".dist-info"
                if _normal(member.split("/")[0][:-len(".dist-info")].rsplit("-", 1)[0]) != wanted:
                    continue
                name, version = _metadata_version(self.archive.read(member).decode("utf-8", "replace"))
                if name and _normal(name) == wanted:
                    return version
        return None

    def describe(self):
        return self.label


class PathReader(ImportSystem):
    """Modules found on the path entries ``paths`` only (a site-packages directory, a source
    tree), through the standard path finder and path hooks; versions from the
    distributions installed there."""

    def __init__(self, paths, label=None):
        self.paths = [str(p) for p in paths]
        self.label = label or os.pathsep.join(self.paths)

    def find(self, name):
        spec = self._spec(name)
        if spec is None:
            return None
        origin = spec.origin
        if spec.submodule_search_locations is not None and (spec.loader is None or origin in (None, "namespace")):
            return Found(name, origin, None)
        return Found(name, origin, _loader_source(spec.loader, name, origin))

    def _spec(self, name):
        parts = name.split(".")
        path, spec = self.paths, None
        for depth in range(1, len(parts) + 1):
            spec = _path_spec(".".join(parts[:depth]), path)
            if spec is None:
                return None
            if depth < len(parts):
                if spec.submodule_search_locations is None:
                    return None
                path = list(spec.submodule_search_locations)
        return spec

    def version(self, dist):
        from importlib import metadata

        wanted = _normal(dist)
        for found in metadata.distributions(path=self.paths):
            if _normal(found.metadata.get("Name") or "") == wanted:
                return found.version
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
