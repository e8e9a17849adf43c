"""Decisions made once and reused by later processes, the way ``.pyc`` files are.

Judging a declaration and compiling its change reads and parses the targets' source; every engine process
(API server, schedulers, each TP/DP worker) would do it again on the same files. A decision is the probe's
``Shape`` and the code ``rule.ahead()`` made (``_registry._read_ahead``). It is stored under a key made of the
exact source text it was judged on (a digest of each target's text, as its loader reads it), the engine's
version, the patch id, the interpreter's bytecode tag, and the files flashfix and the patch's pack were loaded
from (their size and mtime). Any other module the probe read is listed in the entry with its file's size and
mtime, and checked before the entry is used. A stale or foreign entry is never used: its key differs or a
check fails, and the patch is judged from source as before. Everything the runtime does after that is the
same as without the cache: the verdict's version and ``requires`` gates, ``check`` hooks, and the comparison
of the loaded code with the code the change was made from (``_registry.swap``).

Where: ``$FLASHFIX_CACHE_DIR``, else ``__pycache__/decisions`` beside flashfix's own modules;
``FLASHFIX_CACHE_DIR=off`` turns the cache off. Only ``flashfix prepare`` writes entries, at image build time, as
``compileall`` writes bytecode: an engine process reads them and never writes a file. Entries are ``marshal``
data, as trusted as the bytecode beside them: keep the folder writable only by who installs the image. A write
goes to a temporary file renamed into place, so a process never reads half an entry.
"""

import hashlib
import marshal
import os
import sys

import flashfix
from flashfix.core.config import FALSE

FORMAT = 1
_found = {}  # the fingerprint of flashfix's own files, made once a process
_forced = []  # non-empty inside ``flashfix prepare``: write whatever ``sys.dont_write_bytecode`` says


def writing():
    return bool(_forced)


def directory():
    """The cache folder, or None where the cache is off."""
    chosen = os.environ.get("FLASHFIX_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in FALSE else chosen
    return os.path.join(os.path.dirname(os.path.abspath(flashfix.__file__)), "__pycache__", "decisions")


def digest(text):
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _stat(path):
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return st.st_size, st.st_mtime_ns


def _own():
    """Size and mtime of every file of flashfix's own package (the matcher, the renderer and its declarations
    decide what a decision is); a zipped copy: the archive's."""
    if "own" not in _found:
        top, stats = os.path.dirname(os.path.abspath(flashfix.__file__)), []
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            stats += [(f, _stat(os.path.join(folder, f))) for f in sorted(files) if f.endswith((".py", ".pyc"))]
        if not stats:  # not a folder: a zip, or a frozen copy
            where = top
            while where and not os.path.exists(where) and os.path.dirname(where) != where:
                where = os.path.dirname(where)
            stats = [(where, _stat(where))]
        _found["own"] = (flashfix.__version__, tuple(stats))
    return _found["own"]


def key(patch, origin, version, read):
    """The entry's name for ``patch`` (declared in the file ``origin``) judged on ``read``
    (``_registry._read``: each target's name, file and text digest); None when it cannot be told."""
    if origin is None or any(text is None for _, _, text in read):
        return None
    parts = repr((FORMAT, sys.implementation.cache_tag, _own(), origin, _stat(origin), patch.id, patch.engine,
                  version, read))
    return hashlib.blake2b(parts.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


def load(name):
    """``(shape, made)`` stored under ``name``, or None (missing, unreadable, or a module it read has changed)."""
    folder = directory()
    if folder is None or name is None:
        return None
    try:
        with open(os.path.join(folder, name + ".decision"), "rb") as handle:
            form, deps, shape, made = marshal.load(handle)
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if form != FORMAT:
        return None
    for modname, path, stat in deps:
        module = sys.modules.get(modname)
        spec = getattr(module, "__spec__", None)
        now = getattr(spec, "origin", None) if spec is not None else path
        if now != path or _stat(path) != stat:
            return None
    return shape, made


def store(name, deps, shape, made):
    """Write an entry (``deps``: ``[(module, file)]`` the probe read besides the targets); never raises."""
    folder = directory()
    if folder is None or name is None:
        return False
    try:
        data = marshal.dumps((FORMAT, [(m, p, _stat(p)) for m, p in deps], tuple(shape), made))
        os.makedirs(folder, exist_ok=True)
        temporary = os.path.join(folder, "%s.%d.tmp" % (name, os.getpid()))
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, os.path.join(folder, name + ".decision"))
        return True
    except (OSError, ValueError):
        return False
