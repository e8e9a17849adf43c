"""Where a module's source comes from, without importing it.

A *reader* answers two questions for the shape probes and the doctor: a module's source text
(``find(name)``) and a distribution's version (``version(dist)``). The current reader is a context
variable, so the same probe code reads the running interpreter, a wheel, a tree or another
environment without knowing which: ``flashfix.core.paths`` holds the readers of ``--path``,
``flashfix.tools.remote.PythonReader`` is ``--python`` (an engine process loads neither).

``ImportSystem`` (the default) locates a module the way ``import`` does: the finders on
``sys.meta_path`` are asked in order, top-level package first, each submodule with its parent's
``__path__`` (the real one if imported, else its spec's ``submodule_search_locations``: nothing is
imported). So PEP 660 editable finders, ``.pth`` path entries, zipped packages and sourceless
installs read the same at doctor time as at runtime. The text comes from the loader
(``get_source``); a loader without source (``.pyc`` only) gives ``Found(text=None)``, which the
registry reports as ``unknown-shape``, never as "not affected".

Provenance: inside ``with recording() as files:`` every module and distribution metadata
read through ``find``/``version`` is listed in ``files`` with the sha256 of the bytes read
(for a wheel, the member's bytes and the wheel's own sha256, ``archive_of``), so an image
pipeline can name exactly what a verdict was decided from.
"""

import contextlib
import contextvars
import hashlib
import os
import sys
from collections import namedtuple

from flashfix.core.registry import distribution as _distribution, installed_version as _installed_version  # noqa: F401
from flashfix.core.registry import loader_source as _loader_source, metadata_version as _metadata_version  # noqa: F401
from flashfix.core.registry import read_source as _read  # noqa: F401  (these are defined in the registry, which every
# process imports, flashfix.core.lazy: an engine process reads its engines' versions without this module)

# text None: the module exists but has no source; sha256 of the bytes read (None: not computed)
Found = namedtuple("Found", "name origin text sha256", defaults=(None,))


# The most bytes ``doctor --path`` reads of one file (a module, a METADATA, a .pth): no engine
# source file is near 10 MB, and a wheel member that inflates past this is refused unread.
MAX_READ = 16 << 20
_UNFOLLOWED = object()  # a reader's ``_component``: not found, but it may be there unread


class SourceError(Exception):
    """A path or interpreter given to read an environment from cannot be read; the message
    says which and why (``flashfix doctor --path/--python`` prints it and exits 2)."""


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_of(found):
    """The sha256 of what ``found`` was read from: its file's bytes, else its text."""
    if found.sha256 is not None:
        return found.sha256
    if found.origin and os.path.isfile(found.origin):
        try:
            return _sha256_file(found.origin)
        except OSError:
            pass
    if found.text is not None:
        return hashlib.sha256(found.text.encode("utf-8")).hexdigest()
    return None


class ImportSystem:
    """Modules as the running interpreter would import them."""

    label = "this interpreter"

    def find(self, name):
        module = self._module(name)
        spec = getattr(module, "__spec__", None)
        if spec is None:
            spec = self._spec(name)
            if spec is None:
                return None
            if spec is _UNFOLLOWED:
                return Found(name, None, None)  # somewhere a finder of an import line would look
        origin = spec.origin if spec.has_location else getattr(module, "__file__", None) or spec.origin
        if spec.submodule_search_locations is not None and (spec.loader is None or origin in (None, "namespace")):
            return Found(name, origin, None)  # a namespace package: no code at all
        return Found(name, origin, self._source(spec.loader, name, origin))

    def _module(self, name):
        return sys.modules.get(name)

    def _source(self, loader, name, origin):
        return _loader_source(loader, name, origin)

    def _spec(self, name):
        """``name``'s spec, found as ``import`` does: top-level package first, each submodule on
        its parent's search locations (``_component`` finds one); ``_UNFOLLOWED``: maybe, unread."""
        parts = name.split(".")
        path = spec = None
        for depth in range(1, len(parts) + 1):
            spec = self._component(".".join(parts[:depth]), path, depth == len(parts))
            if spec is None or spec is _UNFOLLOWED:
                return spec
            if depth < len(parts):
                if spec.submodule_search_locations is None:
                    return None
                # a plain list: a namespace package's _NamespacePath would look its parent up in sys.modules
                path = list(spec.submodule_search_locations)
        return spec

    def _component(self, name, path, last):
        """The spec of one component ``name`` on ``path`` (None: the top level)."""
        from flashfix.tools.remote_probe import _meta_path_spec, _package  # the walk ``doctor --python`` runs too
        module = sys.modules.get(name)
        if module is not None and not last:
            try:  # a namespace package's path is recomputed from its parent, which a failed
                return _package(name, module.__path__)  # import may have left out of sys.modules
            except AttributeError:
                return None
            except Exception:
                pass  # located below as if it were not imported
        return _meta_path_spec(name, path)

    def _distribution(self, dist):  # a reader of other folders finds them there (``paths.PathReader``)
        return _distribution(dist)

    def version(self, dist):
        return _installed_version(dist, self._distribution)

    def version_source(self, dist):
        """``(file, sha256)`` of the metadata ``version(dist)`` reads, or None."""
        from flashfix.tools.remote_probe import _metadata_path
        found = self._distribution(dist)
        path = _metadata_path(found) if found is not None else None
        return (path, _sha256_file(path)) if path else None

    def describe(self):
        return self.label


def provenance_of(r, found):
    """Extra facts about where ``found`` came from (a wheel's own path and sha256)."""
    extra = getattr(r, "provenance", None)
    return extra(found) if extra is not None else {}


_current = contextvars.ContextVar("flashfix_reader", default=None)
_default = ImportSystem()


def reader():
    return _current.get() or _default


@contextlib.contextmanager
def reading(r):
    """``with reading(r): ...`` makes ``r`` the reader for the probes run inside."""
    token = _current.set(r)
    try:
        yield r
    finally:
        _current.reset(token)


_recording = contextvars.ContextVar("flashfix_recording", default=None)


@contextlib.contextmanager
def _collecting(var):
    items = []
    token = var.set(items)
    try:
        yield items
    finally:
        var.reset(token)


def recording():
    """``with recording() as files:`` lists in ``files`` every module source and distribution
    metadata read through ``find``/``version`` inside, with their sha256 (provenance)."""
    return _collecting(_recording)


def _note(entry):
    files = _recording.get()
    if files is not None and entry not in files:
        files.append(entry)


_memo = contextvars.ContextVar("flashfix_memo", default=None)  # within source.kept(): the readers' answers


def _asked(r, question, name, ask):
    memo, key = _memo.get(), (id(r), question, name)  # the reader lives as long as the memo (the doctor's run)
    if memo is not None and key not in memo:
        memo[key] = ask(name)
    return ask(name) if memo is None else memo[key]


_reads = contextvars.ContextVar("flashfix_reads", default=None)  # within reads(): the modules found


def reads():
    """``with reads() as seen:`` lists in ``seen`` the ``(module, file)`` of every ``find`` inside (no digest:
    what a stored decision read, ``flashfix.core.decisions``)."""
    return _collecting(_reads)


def find(name):
    r = reader()
    found = _asked(r, "find", name, r.find)
    seen = _reads.get()
    if seen is not None and (name, found and found.origin) not in seen:
        seen.append((name, found and found.origin))
    if found is not None and _recording.get() is not None:
        sha = _asked(r, "sha256", name, lambda _: _sha256_of(found))
        if sha is not None:
            entry = {"module": name, "file": found.origin, "sha256": sha}
            entry.update(provenance_of(r, found))
            _note(entry)
    return found


def version(dist):
    r = reader()
    value = _asked(r, "version", dist, r.version)
    if value is not None and _recording.get() is not None:
        source = getattr(r, "version_source", None)
        where = _asked(r, "version_source", dist, source) if source is not None else None
        if where is not None:
            entry = {"distribution": dist, "version": value, "file": where[0], "sha256": where[1]}
            entry.update(getattr(r, "archive_of", lambda origin: {})(where[0]))  # a wheel read (paths.ZipReader)
            _note(entry)
    return value
