"""The modules an engine process loads only to decide its patches, and lets go of afterwards.

Judging a declaration and compiling its change needs the matcher, the source reader and the
renderer (``HEAVY``, about 60 % of flashfix's code). What an engine process keeps after that is the
registry, the packs' declarations and their helpers. So the light modules reach the heavy ones only
through ``Module`` proxies (an attribute read imports the module, then reads it there), and every
runtime entry point that may use them runs inside ``using()``: when the last one ends, the heavy
modules that flashfix loaded itself are taken out of ``sys.modules`` and their memory goes back to
the allocator, for the engine's own imports to reuse; the next decision imports them again. Where
anything else holds one of them or one of their functions (``flashfix doctor``, a test, a pack that
imports flashfix's internals), none is let go of: a second copy would not be the one it holds.
"""

import _thread
import gc
import importlib
import sys

HEAVY = ("flashfix.core.matcher", "flashfix.core.source", "flashfix.core.render", "flashfix.core.locate",
         "flashfix.tools.remote_probe")

_lock = _thread.RLock()
_users = [0]  # entry points running now (any thread)
_frozen = []  # the freeze count the outermost entry point set (see using), while it runs


class Module:
    """Stands for the module ``name``: reading an attribute imports it (when flashfix let go of it, again)."""

    __slots__ = ("_name",)

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)  # outside an entry point: let go of by the next

    def __repr__(self):
        return "<flashfix.core.lazy.Module %s>" % self._name


class using:  # noqa: N801  (used as ``with lazy.using():``)
    """An entry point that may use the heavy modules; the last one to end lets go of them.

    Their functions and classes are cyclic garbage (a function holds its module's globals), which only the
    garbage collector frees, and its full collections are rare and, in an engine process, slow (0.3 s). So the
    outermost entry point freezes what the process held before it (``gc.freeze``, unless the application has
    frozen objects itself) and, once the heavy modules are let go of, collects what is left, which is only what
    was made since, and unfreezes: the memory is free before the engine's next import, and the collection
    takes milliseconds."""

    def __enter__(self):
        with _lock:
            if not _users[0] and not gc.get_freeze_count():
                gc.freeze()
                _frozen.append(gc.get_freeze_count())
            _users[0] += 1
        return self

    def __exit__(self, *exc):
        with _lock:
            _users[0] -= 1
            if _users[0]:
                return False
            released = release()
            if _frozen and gc.get_freeze_count() <= _frozen.pop():  # nobody froze more meanwhile (frozen objects die too)
                if released:
                    gc.collect()
                gc.unfreeze()
        return False


def entry(func):
    """``func`` run inside ``using()``."""
    import functools

    @functools.wraps(func)
    def run(*args, **kwargs):
        with using():
            return func(*args, **kwargs)

    return run


def forget():
    """Drop the source reader's caches, if it is loaded (an engine process keeps none of its trees)."""
    source = sys.modules.get("flashfix.core.source")
    if source is not None:
        source.forget()


def release():
    """Take the heavy modules out of ``sys.modules`` (and off their packages), unless an entry point is using
    them or anything else holds them. Nothing else needs doing: the light modules hold none of their objects,
    so the garbage collector frees them. Returns whether they were let go of."""
    with _lock:
        if _users[0]:
            return False
        modules = [sys.modules[name] for name in HEAVY if name in sys.modules]
        if not modules or _held(modules):  # someone else uses them: a second copy would not be theirs
            return False
        for module in modules:
            del sys.modules[module.__name__]
            package, _, child = module.__name__.rpartition(".")
            if getattr(sys.modules.get(package), child, None) is module:
                delattr(sys.modules[package], child)
        return True


def _held(modules):
    """Whether anything but ``modules`` themselves (and ``sys.modules``, their packages) holds one of them or
    one of their functions: a pack or tool that imported ``flashfix.core.source`` itself, say."""
    inside = {}  # id -> how many references the modules' own namespaces hold (in tables of them too)

    def count(values, depth):
        for value in values:
            inside[id(value)] = inside.get(id(value), 0) + 1
            if depth and type(value) in (tuple, list, dict):
                count(value.values() if type(value) is dict else value, depth - 1)

    for module in modules:
        count(vars(module).values(), 2)
    function = type(_held)
    for module in modules:
        package = sys.modules.get(module.__name__.rpartition(".")[0])
        known = 1 + (getattr(package, module.__name__.rpartition(".")[2], None) is module) + inside.get(id(module), 0)
        if sys.getrefcount(module) - 3 > known:  # - the argument, this loop's name and the list holding it
            return True
        for value in vars(module).values():
            if type(value) is function and value.__module__ == module.__name__ and sys.getrefcount(value) - 2 > inside[id(value)]:
                return True
    return False
