"""The program ``flashfix doctor --python EXE`` runs in the other interpreter, by path (the protocol:
``flashfix.tools.remote``). Standard library only, on any Python the engines support: it imports
neither flashfix nor any engine. ``flashfix.core.locate`` imports its finder walk and metadata-file
lookup, so both interpreters locate modules and metadata files with the same code.
"""
import json
import os
import sys

# Run by path, this file's folder (flashfix/) is sys.path[0]: put back what ``python -c`` gives
# (the current directory), so the environment is read as the engine's own processes see it.
if __name__ == "__main__" and sys.path and "__file__" in globals() and os.path.realpath(
        sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
    sys.path[0] = ""

PREFIX = "\x1eflashfix-remote "


def _path_spec(name, path):
    """What ``PathFinder.find_spec(name, path)`` finds, without its namespace-package object,
    which looks the parent package up in ``sys.modules`` (it is not imported here)."""
    from importlib.machinery import PathFinder

    portions = []
    for entry in path:
        if not isinstance(entry, str):
            continue
        find = getattr(PathFinder._path_importer_cache(entry), "find_spec", None)  # the finder the import system uses
        spec = find(name) if find is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec
        portions.extend(spec.submodule_search_locations or ())
    return _package(name, portions) if portions else None


def _package(name, locations):
    """A spec of a package without code (a namespace package) whose submodules are in ``locations``."""
    from importlib.machinery import ModuleSpec

    spec = ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = list(locations)
    return spec


def _meta_path_spec(name, path):
    from importlib.machinery import PathFinder

    for finder in list(sys.meta_path):
        if getattr(finder, "flashfix_finder", False):
            continue  # ours only delegates to the finders behind it
        if finder is PathFinder:
            spec = _path_spec(name, sys.path if path is None else path)
        else:
            try:
                spec = finder.find_spec(name, path)
            except Exception:  # none, or a third-party one that trips: the import system would raise, we say absent
                spec = None
        if spec is not None:
            return spec
    return None


def _spec(name):
    parts = name.split(".")
    path = spec = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = sys.modules.get(prefix)
        if module is not None and depth < len(parts):
            path = getattr(module, "__path__", None)
            if path is None:
                return None
            continue
        spec = _meta_path_spec(prefix, path)
        if spec is None or depth < len(parts) and spec.submodule_search_locations is None:
            return None
        path = list(spec.submodule_search_locations or ())  # where the next part is looked for
    return spec


def find(name):
    from importlib.machinery import SourceFileLoader
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None) or _spec(name)
    if spec is None:
        return {"found": False}
    origin = spec.origin if spec.has_location else getattr(module, "__file__", None) or spec.origin
    if spec.loader is None and spec.submodule_search_locations is not None:
        return {"found": True, "origin": origin, "kind": "namespace"}
    loader = spec.loader
    if (isinstance(loader, SourceFileLoader) and origin and os.path.isfile(origin)
            and getattr(loader, "path", origin) == origin):
        return {"found": True, "origin": origin, "kind": "file"}
    get_source = getattr(loader, "get_source", None)
    try:
        text = get_source(name) if get_source is not None else None
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
    return {"version": found.version, "file": _metadata_path(found)}


def _metadata_path(distribution):
    """The METADATA (or PKG-INFO) file that ``distribution``'s version is read from, or None."""
    base = getattr(distribution, "_path", None)  # PathDistribution: its .dist-info / .egg-info folder
    files = [os.path.join(str(base), name) for name in ("METADATA", "PKG-INFO")] if base is not None else []
    return next((f for f in files if os.path.isfile(f)), None)


def entry_points(group):
    from importlib import metadata
    found = metadata.entry_points()
    found = found.select(group=group) if hasattr(found, "select") else found.get(group, [])  # Python 3.9
    return {"entry_points": [[ep.name, ep.value, ep.dist.name if getattr(ep, "dist", None) else None]
                             for ep in found]}


# request "op" -> (the function that answers it, the request's key for its argument)
OPS = {"find": (find, "name"), "version": (version, "dist"), "entry_points": (entry_points, "group")}


def answer(value):
    print(PREFIX + json.dumps(value), flush=True)


def main():
    answer({"hello": True, "executable": sys.executable, "prefix": sys.prefix, "cwd": os.getcwd(),
            "python": list(sys.version_info[:3]), "path": sys.path})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            op = OPS.get(request.get("op"))
            answer(op[0](request[op[1]]) if op else {"error": "unknown request"})
        except Exception as exc:
            answer({"error": repr(exc)})


if __name__ == "__main__":
    main()
