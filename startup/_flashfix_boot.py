# flashfix's start-up hook, run by flashfix.pth (flashfix.start on Python 3.15+) in every
# interpreter. It imports nothing. Its finder hands the modules of vllm, sglang and flashinfer
# a loader that imports flashfix when the module's code starts to run: not in find_spec, where
# Python holds its global import lock, so no other thread's import can deadlock against it.
# flashfix then puts its own finder in this one's place.
# A finder put ahead of this one later (a .pth sorting after flashfix.pth, sitecustomize, an
# editable redirector) is overtaken: whenever the import system asks this finder anything, it
# moves back to the front; any engine module, not only the top package, activates flashfix;
# and an engine imported past it activates flashfix at the next module imported after it.
# Under FLASHFIX_STRICT=1 an engine module whose import cannot load flashfix fails, naming why.
import sys

ENGINES = ("vllm", "sglang", "flashinfer")


def _strict():
    import os  # already imported by site

    return os.environ.get("FLASHFIX_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


class _Boot:
    flashfix_finder = flashfix_boot = True
    retired = False
    caught_up = False  # the one catch-up for an engine imported past this finder was done

    def find_spec(self, name, path=None, target=None):
        meta = sys.meta_path
        if self.retired:
            # flashfix took our place, yet we are asked: by a walk over sys.meta_path that read
            # us just before the swap (Python holds its import lock around each finder's call,
            # not around the walk), or because a saved copy of sys.meta_path was put back (then
            # flashfix's finder gets its place back). Either way, answer as flashfix's finder.
            finder = None
            for other in meta:
                if getattr(other, "flashfix_finder", False) and not getattr(other, "flashfix_boot", False):
                    finder = other
                    break
            if finder is None:
                finder = getattr(sys.modules.get("flashfix"), "_Finder", None)
                if finder is None:
                    return None
                finder = finder()
                for i, other in enumerate(meta):
                    if other is self:
                        meta[i] = finder
            return finder.find_spec(name, path, target)
        if meta[0] is not self:  # a finder put ahead of us since: take the front back (see flashfix._to_front)
            for i, finder in enumerate(meta):
                if finder is self:
                    del meta[i]
                    meta.insert(0, self)
                    break
        top = name.partition(".")[0]
        if top not in ENGINES:
            # An engine already imported past us (a finder that was ahead answered it): flashfix
            # comes in with the next module that is imported, once.
            modules = sys.modules
            if "vllm" not in modules and "sglang" not in modules and "flashinfer" not in modules:
                return None  # the common case, kept cheap: this runs for every import before activation
            if self.caught_up or top == "flashfix" or "flashfix" in modules:
                return None
            if not any(_imported(e) for e in ENGINES):
                return None
        for finder in meta:
            find = None if getattr(finder, "flashfix_finder", False) else getattr(finder, "find_spec", None)
            spec = find and find(name, path, target)
            if spec:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Start(spec.loader, name)
                    if top not in ENGINES:
                        self.caught_up = True
                return spec


def _imported(name):
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _real(loader):
    return loader._loader if type(loader) is _Start else loader


class _Start:
    # Looks like the real loader to everything but type(): __class__ and isinstance, __dict__
    # and so equality, hash, repr, attributes set on it; a copy or pickle of it is a copy of
    # the real loader.
    __slots__ = ("_loader", "_name")

    def __init__(self, loader, name):
        object.__setattr__(self, "_loader", loader)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr in _Start.__slots__:  # not set (an object made without __init__)
            raise AttributeError(attr)
        return getattr(self._loader, attr)

    def __setattr__(self, attr, value):
        setattr(self._loader, attr, value)

    def __delattr__(self, attr):
        delattr(self._loader, attr)

    @property
    def __class__(self):
        return type(self._loader)

    @property
    def __dict__(self):
        return self._loader.__dict__

    def __reduce_ex__(self, protocol):
        return self._loader.__reduce_ex__(protocol)

    def __eq__(self, other):
        return self._loader == _real(other)

    def __hash__(self):
        return hash(self._loader)

    def __repr__(self):
        return repr(self._loader)

    def __dir__(self):
        return dir(self._loader)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create and create(spec)

    def exec_module(self, module):
        loader = self._loader
        module.__loader__ = module.__spec__.loader = loader  # as if we had never been here
        try:
            import flashfix  # activates; flashfix's loader then runs this module's callbacks

            loader = flashfix._Loader(loader, self._name)
        except Exception as exc:
            if _strict():  # an engine left unpatched must not import under strict mode
                if self._name.partition(".")[0] in ENGINES:
                    raise ImportError("flashfix strict mode (FLASHFIX_STRICT=1): %s cannot be patched, importing "
                                      "flashfix failed: %r" % (self._name, exc), name=self._name) from exc
            else:  # never break the engine's import; say it once
                for finder in sys.meta_path:
                    if getattr(finder, "flashfix_boot", False):
                        finder.retired = True
            sys.stderr.write("flashfix: auto-activation skipped: %r\n" % (exc,))
        loader.exec_module(module)


def activate():
    import os  # already imported by site

    if "all" not in [item.strip().lower() for item in os.environ.get("FLASHFIX_DISABLE", "").split(",")]:
        if not any(getattr(finder, "flashfix_finder", False) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Boot())


activate()
