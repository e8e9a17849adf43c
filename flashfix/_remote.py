"""``flashfix doctor --python EXE``: read another environment through its interpreter.

The other interpreter runs a small self-contained script (``SCRIPT``, standard library only;
it imports neither flashfix nor any engine). It starts as that environment's Python always
starts, with ``site`` (so site-packages, ``.pth`` path entries and setuptools' editable
finders are in place), then answers questions on its stdin, one JSON line each:

* where a module is: it walks ``sys.meta_path`` as ``flashfix._locate.ImportSystem`` does
  (top-level package first, each submodule with its parent's search locations; nothing is
  imported), and answers the spec's origin and whether it is a source file, a namespace
  package or sourceless; for a loader whose source is not a plain file (a zip import, a
  custom loader) it sends the text that the loader's ``get_source`` gives;
* a distribution's version and the metadata file it comes from (``importlib.metadata``);
* the entry points of a group (``flashfix.patches``: the patch packs installed there).

The source files themselves are read here, from the paths it names, and parsed here, so the
verdicts are decided by this flashfix's probes, as ``flashfix doctor`` run inside that
environment would decide them.
"""

import json
import os
import queue
import subprocess
import threading

from flashfix import _locate

PREFIX = "\x1eflashfix-remote "

SCRIPT = r'''
import json, os, sys

PREFIX = "\x1eflashfix-remote "


def _path_finder(entry):
    from importlib.machinery import PathFinder
    cached = getattr(PathFinder, "_path_importer_cache", None)
    if cached is not None:
        return cached(entry)
    if entry in sys.path_importer_cache:
        return sys.path_importer_cache[entry]
    for hook in sys.path_hooks:
        try:
            finder = hook(entry)
        except ImportError:
            continue
        sys.path_importer_cache[entry] = finder
        return finder
    return None


def _path_spec(name, path):
    from importlib.machinery import ModuleSpec
    portions = []
    for entry in path:
        if not isinstance(entry, str):
            continue
        finder = _path_finder(entry if entry else os.getcwd())
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
            continue
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
        except Exception:
            continue
        if spec is not None:
            return spec
    return None


def _spec(name):
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
            if spec.submodule_search_locations is None:
                return None
            path = list(spec.submodule_search_locations)
    return spec


def find(name):
    from importlib.machinery import SourceFileLoader
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        spec = _spec(name)
        if spec is None:
            return {"found": False}
    origin = spec.origin if spec.has_location else getattr(module, "__file__", None) or spec.origin
    if spec.loader is None and spec.submodule_search_locations is not None:
        return {"found": True, "origin": origin, "kind": "namespace"}
    loader = spec.loader
    if (isinstance(loader, SourceFileLoader) and origin and os.path.isfile(origin)
            and getattr(loader, "path", origin) == origin):
        return {"found": True, "origin": origin, "kind": "file"}
    text = None
    get_source = getattr(loader, "get_source", None)
    if get_source is not None:
        try:
            text = get_source(name)
        except (ImportError, OSError, UnicodeDecodeError):
            text = None
    if text is not None:
        return {"found": True, "origin": origin, "kind": "text", "text": text}
    if origin and origin.endswith(".py") and os.path.isfile(origin):
        return {"found": True, "origin": origin, "kind": "file"}
    return {"found": True, "origin": origin, "kind": "sourceless"}


def version(dist):
    from importlib import metadata
    try:
        found = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return {"version": None}
    base = getattr(found, "_path", None)
    file = None
    if base is not None:
        for name in ("METADATA", "PKG-INFO"):
            if os.path.isfile(os.path.join(str(base), name)):
                file = os.path.join(str(base), name)
                break
    return {"version": found.version, "file": file}


def entry_points(group):
    from importlib import metadata
    found = metadata.entry_points()
    found = found.select(group=group) if hasattr(found, "select") else found.get(group, [])  # Python 3.9
    return {"entry_points": [[ep.name, ep.value, ep.dist.name if getattr(ep, "dist", None) else None]
                             for ep in found]}


def answer(value):
    sys.stdout.write(PREFIX + json.dumps(value) + "\n")
    sys.stdout.flush()


answer({"hello": True, "executable": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd(),
        "python": list(sys.version_info[:3]), "path": sys.path})
for line in sys.stdin:
    try:
        request = json.loads(line)
        if request.get("op") == "find":
            answer(find(request["name"]))
        elif request.get("op") == "version":
            answer(version(request["dist"]))
        elif request.get("op") == "entry_points":
            answer(entry_points(request["group"]))
        else:
            answer({"error": "unknown request"})
    except Exception as exc:
        answer({"error": repr(exc)})
'''


class PythonReader:
    """An environment read through another interpreter (see the module docstring). Use as a
    context manager, or call ``close()``; SourceError when the interpreter does not run or
    does not answer."""

    def __init__(self, executable, timeout=60.0):
        self.executable = str(executable)
        self.timeout = timeout
        self.errors = []
        self._stderr = []
        self._lines = queue.Queue()
        self._cache = {}
        if os.path.isdir(self.executable):
            raise _locate.SourceError("--python %s is a directory, not an interpreter" % self.executable)
        try:
            self._process = subprocess.Popen(
                [self.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise _locate.SourceError("--python %s: no such file" % self.executable) from None
        except PermissionError:
            raise _locate.SourceError("--python %s cannot be run (not executable?)" % self.executable) from None
        except OSError as exc:
            raise _locate.SourceError("--python %s cannot be run: %s" % (self.executable, exc)) from None
        threading.Thread(target=self._pump, args=(self._process.stdout, self._lines), daemon=True).start()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        hello = self._receive(what="start")
        if not hello.get("hello"):
            self.close()
            raise _locate.SourceError("--python %s did not answer as a Python interpreter" % self.executable)
        self.info = hello
        self.label = "%s (Python %s, %s)" % (self.executable, ".".join(map(str, hello["python"])), hello["prefix"])

    def _pump(self, stream, lines):
        for line in stream:
            if line.startswith(PREFIX):
                lines.put(line[len(PREFIX):])
        lines.put(None)

    def _drain(self):
        for line in self._process.stderr:
            self._stderr.append(line)
            del self._stderr[:-40]

    def _failure(self, what):
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            self._drainer.join(timeout=5)  # all it wrote to stderr, for the message
        tail = "".join(self._stderr).strip().splitlines()[-3:]
        detail = (": " + " | ".join(tail)) if tail else ""
        if code is None:
            return "--python %s did not answer (%s) within %.0f s%s" % (self.executable, what, self.timeout, detail)
        return "--python %s did not answer as a Python interpreter (exit status %s)%s" % (self.executable, code, detail)

    def _receive(self, what):
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            problem = self._failure(what)
            self.close()
            raise _locate.SourceError(problem) from None
        if line is None:
            problem = self._failure(what)
            self.close()
            raise _locate.SourceError(problem)
        try:
            return json.loads(line)
        except ValueError:
            raise _locate.SourceError("--python %s answered something unreadable" % self.executable) from None

    def _ask(self, request):
        key = json.dumps(request, sort_keys=True)
        if key in self._cache:
            return self._cache[key]
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except (OSError, ValueError):
            problem = self._failure(request.get("op"))
            self.close()
            raise _locate.SourceError(problem) from None
        value = self._receive(request.get("op"))
        if "error" in value:
            problem = "--python %s: %s failed there: %s" % (self.executable, key, value["error"])
            self.errors.append(problem)
            raise _locate.SourceError(problem)
        self._cache[key] = value
        return value

    def find(self, name):
        value = self._ask({"op": "find", "name": name})
        if not value.get("found"):
            return None
        origin, kind = value.get("origin"), value.get("kind")
        if kind == "namespace" or kind == "sourceless":
            return _locate.Found(name, origin, None)
        if kind == "text":
            return _locate.Found(name, origin, value.get("text"))
        try:
            return _locate.Found(name, origin, _locate._read(origin))  # read here, as the loader there would
        except (OSError, SyntaxError, UnicodeDecodeError):
            return _locate.Found(name, origin, None)

    def version(self, dist):
        return self._ask({"op": "version", "dist": dist}).get("version")

    def version_source(self, dist):
        value = self._ask({"op": "version", "dist": dist})
        path = value.get("file")
        if not path or not os.path.isfile(path):
            return None
        return path, _locate._sha256_file(path)

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` there (patch packs; imported here from
        the folder that holds their module, see ``flashfix._packs``)."""
        return [tuple(e) for e in self._ask({"op": "entry_points", "group": group})["entry_points"]]

    def describe(self):
        return self.label

    def close(self):
        process = getattr(self, "_process", None)
        if process is None:
            return
        try:
            if process.stdin:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
