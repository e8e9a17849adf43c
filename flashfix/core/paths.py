"""The readers of ``doctor/verify --path`` and the sweep (``open_path`` picks one): a wheel's zip, a folder
or checkout through the path finder, several as one (``Composite``). An engine process never imports this."""

import hashlib
import itertools
import os

from flashfix.core.locate import (MAX_READ, _UNFOLLOWED, Found, ImportSystem, SourceError, _loader_source,
                                  _metadata_version, _sha256_file, provenance_of)
from flashfix.core.packs import _normal  # a distribution name as PEP 503 normalises it
from flashfix.tools.remote_probe import _package, _path_spec  # the path finder walk ``doctor --python`` runs too


class ZipReader:
    """Modules inside a zip archive (a wheel; ``archive``: a ``zipfile.ZipFile`` over a file or any seekable
    object), never unpacked: at ``root`` and, for a wheel, in its ``<name>.data/purelib`` and ``platlib``
    folders, where an installer would take them from."""

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
        self._versions, self._pins = {}, {}  # per distribution: its METADATA member and version; its pin

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
        found, wanted = self._metadata_member(dist)[1], _normal(dist)
        if not found and wanted not in self._pins:
            pins = [str(s.version) for r in self._requirements(wanted) for s in r.specifier
                    if s.operator == "==" and "*" not in s.version]
            self._pins[wanted] = pins[0] if len(pins) == 1 else None
        return found or self._pins[wanted]

    def requirement(self, dist):
        """What the wheel declares of ``dist`` (``Requires-Dist``, its markers evaluated here, no extra): the
        specifiers, e.g. ``<1.0.0,>=0.2.1``; None where it declares nothing (or holds ``dist`` itself)."""
        if self._metadata_member(dist)[1]:
            return None
        specs = [str(r.specifier) for r in self._requirements(_normal(dist))]
        return ",".join(s for s in specs if s) or None

    def _requirements(self, wanted):
        from email.parser import HeaderParser
        from packaging.requirements import Requirement

        texts = [self._read_member(m).decode("utf-8", "replace") for ms in self._metadata.values() for m in ms]
        return [r for t in texts for r in map(Requirement, HeaderParser().parsestr(t).get_all("Requires-Dist", []))
                if _normal(r.name) == wanted and (not r.marker or r.marker.evaluate({"extra": ""}))]

    def version_source(self, dist):
        member = self._metadata_member(dist)[0]
        return member and ("%s!/%s" % (self.label, member), hashlib.sha256(self._read_member(member)).hexdigest())

    def distributions(self):
        """``[(name, version)]`` of the wheel's own metadata."""
        members = sorted(m for ms in self._metadata.values() for m in ms)
        return [_metadata_version(self._read_member(m).decode("utf-8", "replace")) for m in members]

    def describe(self):
        return self.label

    def archive_of(self, origin):  # the wheel's own path and sha256, where ``origin`` is one of its members
        return self.provenance(None) if origin.startswith(self.label + "!/") else {}

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` in the wheel's own metadata (patch packs)."""
        path = getattr(self.archive, "filename", None)
        return _entry_points([path], group) if path and os.path.isfile(path) else []


class PathReader(ImportSystem):
    """Modules on the path entries ``paths`` only (site-packages, a source tree), through the path finder
    and hooks, then as a setuptools editable finder behind it would answer (``editable``: ``{top-level name:
    path}``); versions from the distributions there. ``opaque``: ``.pth`` import lines that may install a
    finder not followed: a top-level module found nowhere else has no readable source, never "no such module"."""

    def __init__(self, paths, label=None, editable=None, namespaces=None, opaque=()):
        self.paths, self.editable, self.namespaces = [str(p) for p in paths], dict(editable or {}), dict(namespaces or {})
        self.label, self.opaque = label or os.pathsep.join(self.paths), list(opaque)

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

        sdists = (metadata.PathDistribution(Path(e)) for e in self.paths if os.path.isfile(os.path.join(e, "PKG-INFO")))
        try:  # installed distributions, then an unpacked sdist (PKG-INFO at its root)
            return next((found for found in itertools.chain(metadata.distributions(path=self.paths), sdists)
                         if _normal(found.metadata.get("Name") or "") == _normal(dist)), None)
        except OSError as exc:  # a metadata folder that does not read (a symlink loop)
            raise SourceError("%s: cannot read the distribution metadata: %s" % (self.label, exc)) from exc

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` from the distributions installed on
        these path entries (their ``entry_points.txt``: patch packs)."""
        return _entry_points(self.paths, group)


def _entry_points(paths, group):
    from importlib import metadata

    out, seen = [], set()
    for found in metadata.distributions(path=list(paths)):
        name = found.metadata.get("Name") or ""
        if _normal(name) not in seen:  # the first on the path wins, as for an import
            seen.add(_normal(name))
            out.extend((ep.name, ep.value, name) for ep in found.entry_points if ep.group == group)
    return out


class Composite:
    """Several readers as one environment, in order: a module from the first that has it, a version from the
    first that has that distribution (an SGLang and a FlashInfer wheel read together, as installed)."""

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

    def _holder(self, dist):  # (version, source) of the reader with ``dist``'s METADATA, else of the first with a pin
        first = None
        for r in self.readers:
            value = r.version(dist)
            if value is not None and (source := getattr(r, "version_source", lambda d: None)(dist)):
                return value, source
            first = first or (value is not None and (value, None))
        return first or (None, None)

    version, version_source = (lambda self, dist: self._holder(dist)[0]), (lambda self, dist: self._holder(dist)[1])

    def requirement(self, dist):  # what the first reader that declares ``dist`` declares of it
        return next(filter(None, (getattr(r, "requirement", lambda d: None)(dist) for r in self.readers)), None)

    def archive_of(self, origin):
        return next(filter(None, (getattr(r, "archive_of", lambda o: {})(origin) for r in self.readers)), {})

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


def open_path(path):
    """The reader for one ``--path`` value: a wheel (read from the zip, never unpacked), a site-packages
    folder (its ``.pth`` path lines and setuptools editable finders' mappings; ``import`` lines never run),
    an unpacked wheel or sdist, or a project checkout (``src/``, ``python/`` layouts). SourceError, saying
    why, for anything else, a wheel with several ``.dist-info`` folders or no Name or Version included."""
    import zipfile

    path = str(path)
    if not os.path.exists(path):
        raise SourceError("%s: no such file or directory" % path)
    if os.path.isdir(path):
        entries, editable, namespaces, opaque = _path_entries(path)
        return PathReader(entries, label=path, editable=editable, namespaces=namespaces, opaque=opaque)
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):  # a FIFO or a device would block or never end
        raise SourceError(("%s is not a readable zip archive (a corrupt or truncated wheel?)" if os.path.isfile(path)
                           and path.endswith(".whl") else "%s is neither a wheel (a .whl zip archive) nor a directory") % path)
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
    """A folder read as ``site`` sets it up: ``(path entries, editable mapping, editable namespaces, opaque
    import lines)``. Its ``.pth`` files' path lines are path entries; an import line that installs a setuptools
    editable finder gives that finder's mapping, read with ``ast`` (nothing run); any other that may is opaque."""
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
