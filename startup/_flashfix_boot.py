# flashfix's start-up hook, run by flashfix.pth in every interpreter: one small finder that loads
# flashfix the first time vLLM, SGLang or FlashInfer is imported, and nothing before that.
import sys


class _Boot:
    flashfix_finder = flashfix_boot = True

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in ("vllm", "sglang", "flashinfer") or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        try:
            import flashfix
        except Exception as exc:  # never break the engine's import
            sys.stderr.write("flashfix: auto-activation skipped: %r\n" % (exc,))
            return None
        return flashfix._Finder().find_spec(name, path, target)


import os  # noqa: E402  (already imported by site)

if "all" not in [item.strip().lower() for item in os.environ.get("FLASHFIX_DISABLE", "").split(",")]:
    sys.meta_path.insert(0, _Boot())
