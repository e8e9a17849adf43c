"""The one component-by-component walk of ``flashfix.core.locate``, through its two lookups:
``ImportSystem`` (this interpreter: sys.modules, then the meta path) and ``PathReader`` (path
entries only, ``doctor --path``). Small packages made here, on disk: what is tested is how the
import system's own finders are asked, not any engine."""

import sys
import types

import pytest

from flashfix.core import locate as _locate, paths as _paths


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """``walkpkg`` (a regular package with ``sub``) on sys.path, and a second folder ``extra``
    holding ``walkpkg/added.py``, which only an extended ``walkpkg.__path__`` reaches."""
    (tmp_path / "main" / "walkpkg").mkdir(parents=True)
    (tmp_path / "main" / "walkpkg" / "__init__.py").write_text("")
    (tmp_path / "main" / "walkpkg" / "sub.py").write_text("VALUE = 1\n")
    (tmp_path / "extra" / "walkpkg").mkdir(parents=True)
    (tmp_path / "extra" / "walkpkg" / "added.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "main"))
    for name in [n for n in sys.modules if n == "walkpkg" or n.startswith("walkpkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_an_imported_parent_contributes_its_real_path(tree, monkeypatch):
    # a package that extends its __path__ (pkgutil.extend_path style): its submodules are found
    # where import would look, which the finders alone would not say
    parent = types.ModuleType("walkpkg")
    parent.__path__ = [str(tree / "main" / "walkpkg"), str(tree / "extra" / "walkpkg")]
    monkeypatch.setitem(sys.modules, "walkpkg", parent)
    found = _locate.ImportSystem().find("walkpkg.added")
    assert found is not None and found.origin == str(tree / "extra" / "walkpkg" / "added.py")
    assert found.text == "VALUE = 2\n"
    assert _paths.PathReader([tree / "main"]).find("walkpkg.added") is None  # not this interpreter's modules


def test_a_parent_whose_path_raises_is_located_as_if_not_imported(tree, monkeypatch):
    class Broken(types.ModuleType):
        @property
        def __path__(self):
            raise RuntimeError("a path that cannot be recomputed")

    monkeypatch.setitem(sys.modules, "walkpkg", Broken("walkpkg"))
    found = _locate.ImportSystem().find("walkpkg.sub")
    assert found is not None and found.origin == str(tree / "main" / "walkpkg" / "sub.py")
    assert found.text == "VALUE = 1\n"


def test_a_parent_that_is_no_package_has_no_submodules(tree, monkeypatch):
    monkeypatch.setitem(sys.modules, "walkpkg", types.ModuleType("walkpkg"))  # no __path__ at all
    assert _locate.ImportSystem().find("walkpkg.sub") is None


def test_namespace_packages_read_alike_through_both_lookups(tree):
    # ``extra`` alone: walkpkg there has no __init__.py, a namespace package of one portion
    reader = _paths.PathReader([tree / "extra"])
    namespace = reader.find("walkpkg")
    assert namespace is not None and namespace.text is None
    assert reader.find("walkpkg.added").text == "VALUE = 2\n"
    assert reader.find("walkpkg.missing") is None
    assert reader.find("walkpkg.added.deeper") is None  # a module is no package


def test_path_reader_refuses_a_file_over_max_read(tmp_path):
    with open(tmp_path / "huge.py", "wb") as handle:
        handle.truncate(_locate.MAX_READ + 1)  # sparse: no disk is written
    with pytest.raises(_locate.SourceError, match="over 16 MiB"):
        _paths.PathReader([tmp_path]).find("huge")
