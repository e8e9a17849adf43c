"""The core's layering: ``packs`` and ``render`` do not import back the module that imports them, by any
route (at the top, inside a function, or through ``flashfix.core.lazy``). Issue 34 named these two circles."""

import ast

from conftest import REPO


def _imports(path):
    """The flashfix modules ``path`` imports, however it imports them."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashfix"):
            found.add(node.module)
            found.update("%s.%s" % (node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flashfix"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Module" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("flashfix"):
            found.add(node.args[0].value)  # _lazy.Module("flashfix.core.x")
    return found


def test_packs_and_render_import_nothing_that_imports_them():
    core = REPO / "flashfix" / "core"
    graph = {"flashfix.core.%s" % p.stem: _imports(p) for p in core.glob("*.py")}
    for low, high in (("packs", "registry"), ("render", "source")):
        low, high = "flashfix.core." + low, "flashfix.core." + high
        assert low in graph[high], (high, sorted(graph[high]))  # the edge that stays
        assert high not in graph[low], (low, sorted(graph[low]))  # and not back
    # packs is a leaf of the core: it reads entry points and imports packs, nothing of the registry's
    assert not [m for m in graph["flashfix.core.packs"] if m.startswith("flashfix.core")], graph["flashfix.core.packs"]
