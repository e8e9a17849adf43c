# flashfix's start-up hook, run by flashfix.pth (flashfix.start on Python 3.15+) in every
# interpreter. It imports nothing. Its finder hands vllm, sglang and flashinfer a loader that
# imports flashfix when the engine's code starts to run: not in find_spec, where Python holds
# its global import lock, so no other thread's import can deadlock against it. flashfix then
# puts its own finder in this one's place.
import sys


class _Boot:
    flashfix_finder = flashfix_boot = True
    retired = False

    def find_spec(self, name, path=None, target=None):
        if path is not None or self.retired or name not in ("vllm", "sglang", "flashinfer"):
            return None
        for finder in sys.meta_path:
            find = None if getattr(finder, "flashfix_finder", False) else getattr(finder, "find_spec", None)
            spec = find and find(name, path, target)
            if spec:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _Start(spec.loader, name)
                return spec


class _Start:
    def __init__(self, loader, name):
        self.loader, self.name = loader, name

    def __getattr__(self, attr):
        return getattr(self.loader, attr)

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create and create(spec)

    def exec_module(self, module):
        loader = self.loader
        module.__loader__ = module.__spec__.loader = loader  # as if we had never been here
        try:
            import flashfix  # activates; flashfix's loader then runs this module's callbacks

            loader = flashfix._Loader(loader, self.name)
        except Exception as exc:  # never break the engine's import
            sys.stderr.write("flashfix: auto-activation skipped: %r\n" % (exc,))
        loader.exec_module(module)


def activate():
    import os  # already imported by site

    if "all" not in [item.strip().lower() for item in os.environ.get("FLASHFIX_DISABLE", "").split(",")]:
        if not any(getattr(finder, "flashfix_finder", False) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Boot())


activate()
