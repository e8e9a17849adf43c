"""``flashfix doctor --python EXE``: read another environment through its interpreter.

The other interpreter runs ``flashfix/tools/remote_probe.py`` (standard library only), started as
that environment's Python always starts (``site``, ``.pth`` entries, editable finders), which
answers questions on its stdin, one JSON line each: where a module is (walking ``sys.meta_path``
as ``flashfix.core.locate.ImportSystem`` does, nothing imported; the text ``get_source`` gives for
a loader whose source is not a plain file), a distribution's version and metadata file, the entry
points of a group (the patch packs installed there). The source files are read and parsed here,
so the verdicts are this flashfix's, as ``flashfix doctor`` run inside that environment decides.
"""

import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import threading

from flashfix.core import locate as _locate

PREFIX = "\x1eflashfix-remote "


def probe_command(executable):
    """The command that runs ``remote_probe`` in ``executable``: its file by path, or from a zipped install
    its source through ``-c``, or from a sourceless one its ``.pyc`` (which only the same Python version
    runs: another fails to start, and says why). SourceError where there is none of these."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_probe.py")
    if os.path.isfile(here):
        return [executable, here]
    try:
        spec = importlib.util.find_spec("flashfix.tools.remote_probe")
        text = _locate._loader_source(spec.loader, spec.name, spec.origin) if spec is not None else None
    except (ImportError, OSError, UnicodeDecodeError):
        spec = text = None
    if text is not None:
        return [executable, "-c", text]
    origin = getattr(spec, "origin", None)
    if origin and origin.endswith(".pyc") and os.path.isfile(origin):
        return [executable, origin]
    raise _locate.SourceError("--python needs flashfix/tools/remote_probe.py, which this install of flashfix lacks")


def _optional_str(value):
    return value is None or isinstance(value, str)


def _well_formed(op, value):
    """Whether ``value`` has the form ``_remote_probe`` gives to request ``op``."""
    if op == "version":
        return _optional_str(value.get("version")) and _optional_str(value.get("file"))
    if op == "find":
        kind = value.get("kind")
        return value.get("found") is False or (value.get("found") is True and _optional_str(value.get("origin"))
                and kind in ("file", "namespace", "sourceless", "text")
                and (kind != "text" or isinstance(value.get("text"), str))
                and (kind != "file" or isinstance(value.get("origin"), str)))
    if op == "entry_points":
        found = value.get("entry_points")
        return isinstance(found, list) and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
            and _optional_str(e[2]) for e in found)
    return True


class PythonReader:
    """An environment read through another interpreter (a context manager, or call ``close()``);
    SourceError when the interpreter does not run or does not answer."""

    def __init__(self, executable, timeout=60.0):
        self.executable, self.timeout, self.errors, self._stderr = str(executable), timeout, [], []
        self._lines, self._cache = queue.Queue(), {}
        if os.path.isdir(self.executable):
            raise _locate.SourceError("--python %s is a directory, not an interpreter" % self.executable)
        try:
            self._process = subprocess.Popen(
                probe_command(self.executable), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
        except OSError as exc:
            why = (": no such file" if isinstance(exc, FileNotFoundError) else " cannot be run (not executable?)"
                   if isinstance(exc, PermissionError) else " cannot be run: %s" % exc)
            raise _locate.SourceError("--python %s%s" % (self.executable, why)) from None
        threading.Thread(target=self._pump, args=(self._process.stdout, self._lines), daemon=True).start()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        hello = self._receive(what="start")
        python = hello.get("python")  # a list of at least two ints (JSON: never a bool)
        if not (hello.get("hello") is True and isinstance(python, list) and len(python) >= 2
                and all(type(v) is int for v in python) and isinstance(hello.get("prefix"), str)):
            raise self._closed("--python %s did not answer as a Python interpreter" % self.executable)
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

    def _closed(self, problem):
        """Close the interpreter; the SourceError(problem) to raise."""
        self.close()
        return _locate.SourceError(problem)

    def _no_answer(self, what):
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            self._drainer.join(timeout=5)  # all it wrote to stderr, for the message
        tail = " | ".join("".join(self._stderr).strip().splitlines()[-3:])
        detail = ": " + tail if tail else ""
        if code is None:
            return "--python %s did not answer (%s) within %.0f s%s" % (self.executable, what, self.timeout, detail)
        return "--python %s did not answer as a Python interpreter (exit status %s)%s" % (self.executable, code, detail)

    def _receive(self, what):
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            line = None
        if line is None:  # it ended, or did not answer in time
            raise self._closed(self._no_answer(what))
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if not isinstance(value, dict):  # well framed, but not an answer of _remote_probe
            raise self._closed("--python %s answered something unreadable" % self.executable)
        return value

    def _ask(self, request):
        key = json.dumps(request, sort_keys=True)
        if key in self._cache:
            return self._cache[key]
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except (OSError, ValueError):
            raise self._closed(self._no_answer(request.get("op"))) from None
        value = self._receive(request.get("op"))
        if "error" not in value and not _well_formed(request["op"], value):
            value = {"error": "an answer of unexpected form: %.200s" % json.dumps(value)}
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
        if kind != "file":  # a namespace package, a sourceless module, or the text its loader gave there
            return _locate.Found(name, origin, value.get("text") if kind == "text" else None)
        try:
            if os.path.getsize(origin) > _locate.MAX_READ:
                raise _locate.SourceError("%s is over %d MiB, more than any engine file: refused" % (
                    origin, _locate.MAX_READ >> 20))
            return _locate.Found(name, origin, _locate._read(origin))  # read here, as the loader there would
        except (OSError, SyntaxError, UnicodeDecodeError):
            return _locate.Found(name, origin, None)

    def version(self, dist):
        return self._ask({"op": "version", "dist": dist}).get("version")

    def version_source(self, dist):
        path = self._ask({"op": "version", "dist": dist}).get("file")
        return (path, _locate._sha256_file(path)) if path and os.path.isfile(path) else None

    def entry_points(self, group):
        """``[(name, value, distribution)]`` of ``group`` there (patch packs; imported here from
        the folder that holds their module, see ``flashfix.core.packs``)."""
        return [tuple(e) for e in self._ask({"op": "entry_points", "group": group})["entry_points"]]

    def describe(self):
        return self.label

    def close(self):
        process = getattr(self, "_process", None)
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin:
                process.stdin.close()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
