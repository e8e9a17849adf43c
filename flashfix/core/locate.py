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

Provenance: inside ``with recording() as files:`` every module and distribution metadata
read through ``find``/``version`` is listed in ``files`` with the sha256 of the bytes read
(for a wheel, the member's bytes and the wheel's own sha256), so an image pipeline can name
exactly what a verdict was decided from. ``open_path`` and ``Composite`` build the readers of
``flashfix doctor --path``; ``flashfix.tools.remote.PythonReader`` is ``--python``.
"""

import contextlib
import contextvars
import hashlib
import os
import sys
from collections import namedtuple

# the import system's finder walk and metadata files: the same code as the program ``doctor --python`` runs
from flashfix.tools.remote_probe import _meta_path_spec, _metadata_path, _package, _path_spec

# text None: the module exists but has no source; sha256 of the bytes read (None: not computed)
Found = namedtuple("Found", "name origin text sha256", defaults=(None,))


# The most bytes ``doctor --path`` reads of one file (a module, a METADATA, a .pth): no engine
# source file is near 10 MB, and a wheel member that inflates past this is refused unread.
MAX_READ = 16 << 20


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
        module = sys.modules.get(name)
        if module is not None and not last:
            try:  # a namespace package's path is recomputed from its parent, which a failed
                return _package(name, module.__path__)  # import may have left out of sys.modules
            except AttributeError:
                return None
            except Exception:
                pass  # located below as if it were not imported
        return _meta_path_spec(name, path)

    def _distribution(self, dist):
        from importlib import metadata

        try:
            return metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            return None

    def version(self, dist):  # ``Distribution.version`` parses the whole METADATA (vLLM's: 9 ms); its headers do
        found = self._distribution(dist)
        return found and _metadata_version(found.read_text("METADATA") or found.read_text("PKG-INFO") or "")[1]

    def version_source(self, dist):
        """``(file, sha256)`` of the metadata ``version(dist)`` reads, or None."""
        found = self._distribution(dist)
        path = _metadata_path(found) if found is not None else None
        return (path, _sha256_file(path)) if path else None

    def describe(self):
        return self.label


def _normal(dist):
    import re

    return re.sub(r"[-_.]+", "-", dist).lower()


def _metadata_version(text):
    import textwrap
    from email.parser import HeaderParser

    headers = HeaderParser().parsestr(text.replace("\r\n", "\n").partition("\n\n")[0])  # the body is no header
    redent = lambda v: v if not v or "\n" not in v else textwrap.dedent(" " * 8 + v)  # noqa: E731  (as importlib.metadata)
    return redent(headers.get("Name")), redent(headers.get("Version"))


class ZipReader:
    """Modules inside a zip archive (a wheel), read without unpacking or installing it.
    ``archive`` is a ``zipfile.ZipFile`` (over a local file or any seekable file object).
    Modules are looked for at ``root`` and, for a wheel, in its ``<name>.data/purelib`` and
    ``platlib`` folders, where an installer would take them from."""

    def __init__(self, archive, label, root=""):
        self.archive, self.label, self.root = archive, label, root
        self.names = set(archive.namelist())
        self.roots = [root]
        if not root:
            data = sorted({n.split("/", 1)[0] for n in self.names if n.split("/", 1)[0].endswith(".data")})
            self.roots += ["%s/%s/" % (d, kind) for d in data for kind in ("purelib", "platlib")]
        self.errors = []  # members that could not be read (a corrupt archive)
        self._archive_sha256 = None
        self._dirs = set()  # every folder of the archive, for namespace packages
        self._metadata = {}  # normalised distribution name (from the folder) -> its METADATA members
        for member in self.names:
            parts = member.split("/")
            for depth in range(1, len(parts)):
                self._dirs.add("/".join(parts[:depth]))
            if len(parts) == 2 and parts[1] == "METADATA" and parts[0].endswith(".dist-info"):
                folder = _normal(parts[0][: -len(".dist-info")].rsplit("-", 1)[0])  # name-version
                self._metadata.setdefault(folder, []).append(member)
        self._versions = {}

    def _member(self, name):
        for root in self.roots:
            base = root + name.replace(".", "/")
            for suffix, has_source in ((".py", True), ("/__init__.py", True),
                                       (".pyc", False), ("/__init__.pyc", False)):
                if base + suffix in self.names:
                    return base + suffix, has_source
            if base in self._dirs:
                return base + "/", False  # a directory without __init__: a namespace package
        return None, False

    def _read_member(self, member):
        """The bytes of ``member``, read in a bounded way: SourceError (also kept in ``errors``)
        for a member that cannot be read or inflates past ``MAX_READ``."""
        import zlib
        import zipfile

        try:
            size = self.archive.getinfo(member).file_size
            if size > MAX_READ:
                problem = "%s: %s inflates to %.0f MiB, more than any engine file (%d MiB): refused unread" % (
                    self.label, member, size / (1 << 20), MAX_READ >> 20)
            else:  # inflated a block at a time, never past MAX_READ, whatever the headers claim
                with self.archive.open(member) as handle:
                    data = handle.read(MAX_READ + 1)
                    if len(data) <= MAX_READ:
                        return data
                problem = "%s: %s inflates past %d MiB, more than any engine file: refused" % (
                    self.label, member, MAX_READ >> 20)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError, RuntimeError,
                KeyError) as exc:
            problem = "%s: cannot read %s: %s" % (self.label, member, exc)
        if problem not in self.errors:
            self.errors.append(problem)
        raise SourceError(problem)

    def provenance(self, found):
        return {"archive": self.label, "archive_sha256": self.archive_sha256()}

    def archive_sha256(self):
        if self._archive_sha256 is None and getattr(self.archive, "filename", None) and os.path.isfile(
                self.archive.filename):
            self._archive_sha256 = _sha256_file(self.archive.filename)
        return self._archive_sha256

    def find(self, name):
        member, has_source = self._member(name)
        if member is None:
            return None
        origin = "%s!/%s" % (self.label, member)
        if member.endswith("/"):
            return Found(name, origin, None)
        raw = self._read_member(member)
        sha = hashlib.sha256(raw).hexdigest()
        if not has_source:
            return Found(name, origin, None, sha)
        import io
        import tokenize

        try:
            encoding = tokenize.detect_encoding(io.BytesIO(raw).readline)[0]
            text = io.TextIOWrapper(io.BytesIO(raw), encoding=encoding).read()
        except (SyntaxError, UnicodeDecodeError, LookupError):
            text = None  # undecodable: as a loader's get_source would fail, the shape cannot be read
        return Found(name, origin, text, sha)

    def _metadata_member(self, dist):
        wanted = _normal(dist)
        if wanted not in self._versions:
            self._versions[wanted] = (None, None)
            for member in sorted(self._metadata.get(wanted, ())):
                name, version = _metadata_version(self._read_member(member).decode("utf-8", "replace"))
                if name and _normal(name) == wanted:
                    self._versions[wanted] = (member, version)
                    break
        return self._versions[wanted]

    def version(self, dist):  # else the wheel's one exact pin of ``dist``: what installing the wheel brings
        from email.parser import HeaderParser
        from packaging.requirements import Requirement

        found = self._metadata_member(dist)[1]
        texts = [] if found else [self._read_member(m).decode("utf-8", "replace") for ms in self._metadata.values() for m in ms]
        pins = [str(s.version) for t in texts for r in map(Requirement, HeaderParser().parsestr(t).get_all("Requires-Dist", []))
                if _normal(r.name) == _normal(dist) and (not r.marker or r.marker.evaluate({"extra": ""}))
                for s in r.specifier if s.operator == "==" and "*" not in s.version]
        return found or (pins[0] if len(pins) == 1 else None)

    def version_source(self, dist):
        member = self._metadata_member(dist)[0]
        return member and ("%s!/%s" % (self.label, member), hashlib.sha256(self._read_member(member)).hexdigest())

    def distributions(self):
        """``[(name, version)]`` of the wheel's own metadata."""
        members = sorted(m for ms in self._metadata.values() for m in ms)
        return [_metadata_version(self._read_member(m).decode("utf-8", "replace")) for m in members]

    def describe(self):
        return self.label

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` in the wheel's own metadata (patch packs)."""
        path = getattr(self.archive, "filename", None)
        return _entry_points([path], group) if path and os.path.isfile(path) else []


class PathReader(ImportSystem):
    """Modules found on the path entries ``paths`` only (a site-packages directory, a source
    tree), through the standard path finder and path hooks, then through the mapping of any
    setuptools editable finder (``editable``: ``{top-level name: path}``) as that finder would
    answer, behind the path finder; versions from the distributions installed there.
    ``opaque``: ``.pth`` import lines that may install a finder this reader cannot follow: a
    top-level module found nowhere else then has no readable source, never "no such module"."""

    def __init__(self, paths, label=None, editable=None, namespaces=None, opaque=()):
        self.paths = [str(p) for p in paths]
        self.label = label or os.pathsep.join(self.paths)
        self.editable = dict(editable or {})
        self.namespaces = dict(namespaces or {})
        self.opaque = list(opaque)

    def _module(self, name):
        return None  # this interpreter's modules are not the environment read

    def _source(self, loader, name, origin):
        if origin and os.path.isfile(origin) and os.path.getsize(origin) > MAX_READ:
            raise SourceError("%s: %s is over %d MiB, more than any engine file: refused" % (
                self.label, origin, MAX_READ >> 20))
        return _loader_source(loader, name, origin)

    def _mapped_spec(self, name):
        """What a setuptools editable finder (behind the path finder) answers for ``name``."""
        if name in self.editable:  # as its _EditableFinder._find_spec does
            from importlib.machinery import all_suffixes
            from importlib.util import spec_from_file_location

            base = self.editable[name]
            for candidate in [os.path.join(base, "__init__.py")] + [
                    os.path.splitext(base)[0] + suffix for suffix in all_suffixes()]:
                if os.path.isfile(candidate):
                    return spec_from_file_location(name, candidate)
            return None
        parent = name.rpartition(".")[0]
        if parent in self.editable:
            return _path_spec(name, [self.editable[parent]])
        if name in self.namespaces:
            return _package(name, self.namespaces[name])
        return None

    def _component(self, name, path, last):
        path = self.paths if path is None else path
        spec = _path_spec(name, path) or self._mapped_spec(name)
        if spec is None and (_dangling(name.rpartition(".")[2], path) or ("." not in name and self.opaque)):
            return _UNFOLLOWED  # there, but unreadable (a symlink loop), or a finder may serve it
        return spec

    def _distribution(self, dist):
        from importlib import metadata
        from pathlib import Path

        wanted = _normal(dist)
        try:
            for found in metadata.distributions(path=self.paths):
                if _normal(found.metadata.get("Name") or "") == wanted:
                    return found
            for entry in self.paths:  # an unpacked sdist: PKG-INFO at its root
                if os.path.isfile(os.path.join(entry, "PKG-INFO")):
                    found = metadata.PathDistribution(Path(entry))
                    if _normal(found.metadata.get("Name") or "") == wanted:
                        return found
        except OSError as exc:  # a metadata folder that does not read (a symlink loop)
            raise SourceError("%s: cannot read the distribution metadata: %s" % (self.label, exc)) from exc
        return None

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` from the distributions installed on
        these path entries (their ``entry_points.txt``: patch packs)."""
        return _entry_points(self.paths, group)


def _entry_points(paths, group):
    from importlib import metadata

    out, seen = [], set()
    for found in metadata.distributions(path=list(paths)):
        name = found.metadata.get("Name") or ""
        if _normal(name) in seen:  # the first on the path wins, as for an import
            continue
        seen.add(_normal(name))
        out.extend((ep.name, ep.value, name) for ep in found.entry_points if ep.group == group)
    return out


class Composite:
    """Several readers as one environment, in order: a module comes from the first reader
    that has it, a distribution's version from the first that has that distribution (an
    SGLang wheel and a FlashInfer wheel read together, as they would be installed)."""

    def __init__(self, readers):
        self.readers = list(readers)
        self._owner = {}  # origin -> the reader it came from

    @property
    def errors(self):
        return [e for r in self.readers for e in getattr(r, "errors", ())]

    def find(self, name):
        for r in self.readers:
            found = r.find(name)
            if found is not None:
                self._owner[found.origin] = r
                return found
        return None

    def _holder(self, dist):  # the reader with ``dist``'s own METADATA, else the first that knows a version (a pin)
        known = [r for r in self.readers if r.version(dist) is not None]
        return next((r for r in known if getattr(r, "version_source", lambda d: None)(dist)), (known or [None])[0])

    def version(self, dist):
        return getattr(self._holder(dist), "version", lambda dist: None)(dist)

    def version_source(self, dist):
        return getattr(self._holder(dist), "version_source", lambda dist: None)(dist)

    def entry_points(self, group):
        out = []
        for r in self.readers:
            lister = getattr(r, "entry_points", None)
            out.extend(e for e in (lister(group) if lister is not None else ()) if e not in out)
        return out

    def provenance(self, found):
        owner = self._owner.get(found.origin)
        return provenance_of(owner, found) if owner is not None else {}

    def describe(self):
        return " + ".join(r.describe() for r in self.readers)


def provenance_of(r, found):
    """Extra facts about where ``found`` came from (a wheel's own path and sha256)."""
    extra = getattr(r, "provenance", None)
    return extra(found) if extra is not None else {}


def open_path(path):
    """The reader for one ``flashfix doctor --path`` value: a wheel (read from the zip, never
    unpacked), a site-packages folder (its ``.pth`` path lines included, and the mapping of
    setuptools editable finders; ``import`` lines are never run), an unpacked wheel or sdist,
    or a project checkout (``src/``, ``python/`` layouts). SourceError, saying why, for
    anything else: a wheel with more than one ``.dist-info`` folder, or whose METADATA lacks
    its Name or Version, included."""
    import zipfile

    path = str(path)
    if not os.path.exists(path):
        raise SourceError("%s: no such file or directory" % path)
    if not os.path.isdir(path) and not os.path.isfile(path):  # a FIFO or a device would block or never end
        raise SourceError("%s is neither a wheel (a .whl zip archive) nor a directory" % path)
    if os.path.isdir(path):
        entries, editable, namespaces, opaque = _path_entries(path)
        return PathReader(entries, label=path, editable=editable, namespaces=namespaces, opaque=opaque)
    if not zipfile.is_zipfile(path):
        if path.endswith(".whl"):
            raise SourceError("%s is not a readable zip archive (a corrupt or truncated wheel?)" % path)
        raise SourceError("%s is neither a wheel (a .whl zip archive) nor a directory" % path)
    try:
        archive = zipfile.ZipFile(path)
        r = ZipReader(archive, path)
        dists = r.distributions()
    except (zipfile.BadZipFile, OSError, EOFError, SourceError, ValueError) as exc:
        raise SourceError("%s is not a readable zip archive (a corrupt or truncated wheel?): %s" % (path, exc)) from exc
    if not dists:
        raise SourceError("%s is a zip archive but not a wheel: it has no <name>.dist-info/METADATA" % path)
    for name, version in dists:
        if not name or not version:
            raise SourceError("%s: its METADATA has no %s header (installers refuse such a wheel)" % (
                path, "Name" if not name else "Version"))
    folders = sorted({m.split("/", 1)[0] for m in r.names if m.split("/", 1)[0].endswith(".dist-info") and "/" in m})
    if len(folders) > 1:  # installers refuse these: which one would describe it is undefined
        raise SourceError("%s holds %d .dist-info folders (%s); a wheel has exactly one" % (
            path, len(folders), ", ".join(folders)))
    return r


_UNFOLLOWED = object()  # PathReader._component: not found, but it may be there unread


def _dangling(part, path):
    """Whether a path entry holds ``part`` (a package folder or a module) as a link that does not
    resolve (a symlink loop, a missing target): the module is there, its code cannot be read."""
    for entry in path:
        for name in (part, part + ".py"):
            where = os.path.join(entry, name)
            if os.path.islink(where) and not os.path.exists(where):
                return True
    return False


def _path_entries(folder):
    """A folder's reading as ``site`` sets it up: ``(path entries, editable mapping, editable
    namespaces, opaque import lines)``. Path lines of its ``.pth`` files are path entries; an
    import line that installs a setuptools editable finder contributes that finder's mapping,
    read from its module with ``ast`` (nothing is run); any other import line that may install
    a finder is opaque."""
    entries, editable, namespaces, opaque = [folder], {}, {}, []
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise SourceError("%s cannot be listed: %s" % (folder, exc)) from exc
    for name in names:  # a site-packages folder: its .pth files, in the order site reads them
        if not name.endswith(".pth") or not os.path.isfile(os.path.join(folder, name)):
            continue  # (site reads a FIFO named *.pth too, and would block there)
        try:
            with open(os.path.join(folder, name), "rb") as handle:
                lines = handle.read(MAX_READ).decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith(("import ", "import\t")):
                for module in _imported(line):
                    if module in _HARMLESS_IMPORTS:
                        continue
                    mapping = _editable_mapping(folder, module)
                    if mapping is None:
                        opaque.append("%s: %s" % (name, line.strip()))
                        break
                    for found, into in zip(mapping, (editable, namespaces)):
                        for top, where in found.items():  # the first .pth that maps a name wins
                            into.setdefault(top, where)
                continue
            entry = os.path.normpath(os.path.join(folder, line.rstrip()))
            if os.path.isdir(entry) and entry not in entries:
                entries.append(entry)
    if any(os.path.isfile(os.path.join(folder, f)) for f in ("pyproject.toml", "setup.py", "setup.cfg")):
        for sub in ("src", "python"):  # a project checkout whose packages live one level down
            if os.path.isdir(os.path.join(folder, sub)):
                entries.append(os.path.join(folder, sub))
    return entries, editable, namespaces, opaque


# Modules that .pth import lines of ordinary environments import, none of which serves an
# engine: virtualenv's and uv's shim, setuptools' distutils shim, flashfix's own start-up hook.
_HARMLESS_IMPORTS = frozenset({"os", "sys", "_virtualenv", "_distutils_hack", "_flashfix_boot"})


def _imported(line):
    """The top-level modules a ``.pth`` import line imports (``import x`` and ``__import__('x')``);
    ``["?"]`` where the line does not parse."""
    import ast

    try:
        tree = ast.parse(line)
    except (SyntaxError, ValueError):
        return ["?"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "?").split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("__import__", "import_module"):
            arg = node.args[0] if node.args else None
            found.append(arg.value.split(".")[0] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                         else "?")
    return found


def _editable_mapping(folder, module):
    """``(MAPPING, NAMESPACES)`` of the setuptools editable finder module ``module`` in
    ``folder`` (``__editable___<name>_finder.py``), read as literals; None for any other module
    or one whose mapping is not a plain literal."""
    import ast

    if not (module.startswith("__editable__") and module.endswith("_finder")):
        return None
    path = os.path.join(folder, module + ".py")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(MAX_READ))
    except (OSError, SyntaxError, ValueError):
        return None
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None) if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in ("MAPPING", "NAMESPACES") and node.value is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, TypeError):
                return None
    mapping, spaces = values.get("MAPPING"), values.get("NAMESPACES", {})
    if not isinstance(mapping, dict) or not isinstance(spaces, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        return None
    if not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) for p in v)
               for k, v in spaces.items()):
        return None
    return mapping, spaces


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
def recording():
    """``with recording() as files:`` lists in ``files`` every module source and distribution
    metadata read through ``find``/``version`` inside, with their sha256 (provenance)."""
    files = []
    token = _recording.set(files)
    try:
        yield files
    finally:
        _recording.reset(token)


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


def find(name):
    r = reader()
    found = _asked(r, "find", name, r.find)
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
            if isinstance(r, (ZipReader, Composite)):
                entry.update(_archive_of(r, where[0]))
            _note(entry)
    return value


def _archive_of(r, origin):
    for sub in getattr(r, "readers", [r]):
        if isinstance(sub, ZipReader) and origin.startswith(sub.label + "!/"):
            return {"archive": sub.label, "archive_sha256": sub.archive_sha256()}
    return {}
