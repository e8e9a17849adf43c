"""A distribution's version read straight from its ``.dist-info/METADATA``, without
``importlib.metadata`` (whose import, with ``email``, costs about as much as the rest of
``flashfix doctor``).

``version(dist)`` answers only where it is sure to give what ``importlib.metadata.version``
gives in this interpreter: the standard path finder is the only distribution finder on
``sys.meta_path``, every ``sys.path`` entry is a plain directory (or missing), the first
metadata folder for the name is a ``<name>-<version>.dist-info`` whose name is already in
normalised form, and its METADATA has one plain ``Version`` header. Anywhere else it answers
``UNSURE`` and the caller asks ``importlib.metadata``.
"""

import os
import re
import sys

UNSURE = object()

def _normalize(name):  # as importlib.metadata's Prepared.normalize
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")


_listings = {}  # sys.path entry -> (its mtime, {normalised name: metadata folders in listdir order})


def _folders(entry, wanted):
    """The metadata folders of ``entry`` for normalised name ``wanted``, in listdir order;
    None if ``entry`` cannot be listed."""
    names = _listing(entry)
    return names if names is None else names.get(wanted, [])


def _listing(entry):
    """``{normalised name: metadata folders in listdir order}`` of ``entry``; None if it
    cannot be listed. A listing is kept while the folder's mtime (which any install or removal
    in it changes) stays the same: only the metadata folders' names."""
    try:
        mtime = os.stat(entry or ".").st_mtime_ns
        kept = _listings.get(entry)
        if kept is not None and kept[0] == mtime:
            return kept[1]
        children = os.listdir(entry or ".")
    except OSError:
        if os.path.exists(entry or "."):
            return None  # a file (a zip?) or unreadable: importlib.metadata may see more
        return {}
    names = {}
    for child in children:
        low = child.lower()
        if low.endswith((".dist-info", ".egg-info")):
            names.setdefault(_normalize(low.rpartition(".")[0].partition("-")[0]), []).append(child)
    _listings[entry] = (mtime, names)
    return names


def _only_path_finder():
    from importlib.machinery import PathFinder

    finders = [f for f in sys.meta_path if getattr(f, "find_distributions", None) is not None]
    return finders == [PathFinder]


def metadata(dist):
    """``(METADATA file, Version)`` of distribution ``dist`` as ``importlib.metadata`` would read
    them, None if it is not installed, or ``UNSURE``."""
    wanted = _normalize(dist)
    if not dist or not _only_path_finder():
        return UNSURE
    for entry in sys.path:
        if not isinstance(entry, str) or entry.lower().endswith(".egg"):
            return UNSURE
        found = _folders(entry, wanted)
        if found is None:
            return UNSURE
        if not found:
            continue
        folder = found[0]
        low = folder.lower()
        if not low.endswith(".dist-info") or low.rpartition(".")[0].partition("-")[0] != wanted:
            return UNSURE
        import pathlib  # the path as importlib.metadata spells it (pathlib.Path(entry, folder))

        path = str(pathlib.Path(entry, folder, "METADATA"))
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError):
            return UNSURE
        value = _version_header(text)
        return UNSURE if value is UNSURE else (path, value)
    return None


def version(dist):
    """The ``Version`` of distribution ``dist`` as importlib.metadata would read it, None if
    it is not installed, or ``UNSURE``."""
    found = metadata(dist)
    return found if found is None or found is UNSURE else found[1]


def _version_header(text):
    """The value of the first ``Version:`` header of a METADATA text, or UNSURE where the
    email parser might read it otherwise (a folded value, a line that is no header)."""
    value = UNSURE
    lines = text.split("\n")
    for number, line in enumerate(lines):
        if not line.strip():
            break
        if line[0] in " \t":
            if number and lines[number - 1].partition(":")[0].strip().lower() == "version":
                return UNSURE  # a folded Version value
            continue
        name, colon, rest = line.partition(":")
        if not colon or not name or any(c in name for c in " \t"):
            return UNSURE
        if value is UNSURE and name.lower() == "version":
            value = rest.lstrip(" \t").rstrip("\r")
            if not value:
                return UNSURE
    return value


def entry_points(group):
    """``[(name, value, distribution name)]`` of entry-point group ``group``, the first
    distribution of each name on ``sys.path`` only (as ``importlib.metadata.entry_points``), or
    ``UNSURE`` where that might differ (another distribution finder, a zip or egg on the path, a
    ``.egg-info`` or unreadable file holding the group, a line it would read otherwise). Reads
    only the ``entry_points.txt`` files; the METADATA ``Name`` only of a distribution that has
    the group."""
    if not _only_path_finder():
        return UNSURE
    out, seen, header = [], set(), "[%s]" % group
    for entry in sys.path:
        if not isinstance(entry, str) or entry.lower().endswith(".egg"):
            return UNSURE
        names = _listing(entry)
        if names is None:
            return UNSURE
        for wanted, folders in names.items():
            if wanted in seen:
                continue
            seen.add(wanted)
            folder = os.path.join(entry, folders[0])
            try:
                with open(os.path.join(folder, "entry_points.txt"), encoding="utf-8") as handle:
                    text = handle.read()
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError):
                return UNSURE
            if group not in text:
                continue
            found = _section(text, header)
            if found is UNSURE or not folders[0].lower().endswith(".dist-info"):
                return UNSURE
            if found:
                name = _name_header(folder)
                if name is UNSURE:
                    return UNSURE
                out.extend((key, value, name) for key, value in found)
    return out


def _section(text, header):
    """``[(name, value)]`` of the section ``header`` of an entry_points.txt text."""
    found, inside = [], False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            if line.endswith("]") and line.strip("[]").strip() != line[1:-1]:
                return UNSURE  # spaces inside the brackets: leave it to importlib.metadata
            inside = line == header
            continue
        if inside:
            key, equals, value = line.partition("=")
            if not equals or not key.strip() or not value.strip():
                return UNSURE
            found.append((key.strip(), value.strip()))
    return found


def _name_header(folder):
    try:
        with open(os.path.join(folder, "METADATA"), encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError):
        return UNSURE
    for line in text.split("\n"):
        if not line.strip():
            break
        key, colon, value = line.partition(":")
        if colon and key.lower() == "name" and value.strip():
            return value.strip()
    return UNSURE
