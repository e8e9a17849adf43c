"""_source.rewrite on functions that call methods of imported names.

Since CPython 3.11.x the compiler emits ``LOAD_ATTR`` instead of ``LOAD_METHOD`` for
``name.attr(...)`` when ``name`` is bound by an import at module level. The recompiled code
must see the same bindings, or every such function (vLLM's ``FlashInferImpl.forward`` calls
``current_platform.is_device_capability_family(...)``) looks "edited after import".
"""

import importlib.util
import sys

from flashfix.core import source as _source

SOURCE = '''
from os import path as imported_path
import os.path
try:
    from json import dumps
except ImportError:
    dumps = None

class Owner:
    def method(self, x):
        return imported_path.join(x, "a"), os.path.basename(x), dumps.__name__

def plain(x):
    return imported_path.join(x, "b")
'''


def test_rewrite_accepts_calls_on_imported_names(tmp_path):
    path = tmp_path / "ff_imported_names.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("ff_imported_names", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        for func in (module.Owner.method, module.plain):
            marked, plain = _source.rewrite(func, lambda node: None)  # no ShapeError
            assert plain.co_code == func.__code__.co_code
        assert _source._top_level_imports(_source.parse_file(str(path))) == {"imported_path", "os", "dumps"}
    finally:
        sys.modules.pop(spec.name, None)
