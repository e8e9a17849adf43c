"""``flashfix diff`` names where an added global is defined (``diff.definition``), following
``from x import name`` and ``from x import *`` re-exports, read from source as Python binds them.

The case that failed before: of two star imports that both bind a name, Python binds the later
one's; the reader took the first (its walk collected the star imports last-first and then read
them in reverse)."""

from flashfix.core import locate as _locate, paths as _paths
from flashfix.tools import diff as _diff

PACKAGE = {
    "pkg/__init__.py": "from pkg.a import *\nfrom .b import *\nfrom pkg.c import g as h\nimport os\nx = 1\n"
                       "if True:\n    from pkg.a import y\n",
    "pkg/a.py": "def f(): pass\ndef y(): pass\ndef shared(): pass\n",
    "pkg/b.py": "def shared(): pass\ndef only_b(): pass\nclass K: pass\n",
    "pkg/c.py": "def g(): pass\n",
    "pkg/sub/__init__.py": "from .. import *\nfrom ..c import g\ndef own(): pass\n",
}


def _definitions(tmp_path, module, names):
    for path, text in PACKAGE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    with _locate.reading(_paths.open_path(str(tmp_path))):
        found = {name: _diff.definition(module, name) for name in names}
    return {name: d and (d.module, d.qualname, d.first) for name, d in found.items()}


def test_the_last_star_import_that_binds_a_name_wins(tmp_path):
    assert _definitions(tmp_path, "pkg", ["shared"]) == {"shared": ("pkg.b", "shared", 1)}
    assert _definitions(tmp_path, "pkg.sub", ["shared"]) == {"shared": ("pkg.b", "shared", 1)}  # through two stars


def test_re_exports_are_followed_and_other_bindings_are_not_definitions(tmp_path):
    assert _definitions(tmp_path, "pkg", ["f", "y", "only_b", "K", "h", "g", "os", "x", "missing"]) == {
        "f": ("pkg.a", "f", 1), "y": ("pkg.a", "y", 2), "only_b": ("pkg.b", "only_b", 2), "K": ("pkg.b", "K", 3),
        "h": ("pkg.c", "g", 1), "g": None, "os": None, "x": None, "missing": None}
    assert _definitions(tmp_path, "pkg.sub", ["own", "g", "f"]) == {
        "own": ("pkg.sub", "own", 3), "g": ("pkg.c", "g", 1), "f": ("pkg.a", "f", 1)}
