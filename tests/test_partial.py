"""_partial: looking a definition up in a Module gives exactly the node of a whole-file parse
(positions included), parses only what it must, and parses everything when it cannot be sure."""

import ast
import copy
import os
import pickle
import sys

import pytest

from flashfix import _partial, _source

TRICKY = '''"""Module docstring.
def not_a_function():
class NotAClass:
"""
import os

TEMPLATE = """
class Engine:
    def compute(self):
        return 0
"""

@decorator(
    argument,
)
@other
def decorated(a, b=(1,
2)):
    """Docstring with a line at column zero:
def fake():
    """
    return a @ b


class Engine(Base[int], metaclass=Meta):  # a comment
    """Engine."""

    X = 1

    @property
    def compute(self):
        return f"{self.x!r} {{}}" + \'\'\'
    def fake(self):
\'\'\'

    async def fetch(self):
        async with self.lock:
            return 1

    class Inner:
        def deep(self):
            return 2

    def compute(self):  # a second definition: the first one is the answer
        return 3


if TYPE_CHECKING:
    def late(): ...


class Spread(
    Base,
):
    def method(self):
        return 4


class Broken:
    X = (1
@ 2)

    def after(self):
        return 5

def tail():
    return x \\
        + 1
'''

LOOKUPS = ["decorated", "Engine", "Engine.compute", "Engine.fetch", "Engine.Inner", "Engine.Inner.deep",
           "Engine.X", "Engine.fake", "late", "Spread", "Spread.method", "Broken.after", "tail", "fake",
           "not_a_function", "NotAClass", "nothing", "Engine.nothing"]


def _dump(node):
    return None if node is None else ast.dump(node, include_attributes=True)


def _same_as_full_parse(text, lookups, fresh=True):
    full = ast.parse(text)
    lazy = _partial.Module(text, "<test>")
    for qualname in lookups:
        if fresh:
            lazy = _partial.Module(text, "<test>")
        expected = _partial.walk_defs(full, qualname.split("."))
        assert _dump(lazy.find(qualname)) == _dump(expected), qualname
        assert _dump(_source.find_def(lazy, qualname)) == _dump(expected), qualname


def test_lookups_equal_a_full_parse():
    _same_as_full_parse(TRICKY, LOOKUPS)


CLEAN = TRICKY.replace("if TYPE_CHECKING:\n    def late(): ...\n", "")


def test_only_the_block_is_parsed(monkeypatch):
    parsed = []
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda source, *a, **k: parsed.append(source.strip()) or real(source, *a, **k))
    lazy = _partial.Module(CLEAN, "<test>")
    node = lazy.find("Engine.fetch")
    assert isinstance(node, ast.AsyncFunctionDef) and node.lineno == CLEAN.splitlines().index("    async def fetch(self):") + 1
    assert parsed == []  # the definition is located; its fields are parsed when first read
    assert node.end_lineno == node.lineno + 2
    assert parsed == ["if 1:\n    async def fetch(self):\n        async with self.lock:\n            return 1"]
    assert lazy.find("nothing") is None and lazy.find("Engine.nothing") is None
    assert len(parsed) == 1 and not lazy.parsed  # nothing else was parsed
    _same_as_full_parse(CLEAN, LOOKUPS)


@pytest.mark.parametrize("text", [
    "def a():\n\tpass\n",  # a tab in indentation
    "def a():\n    pass\n\x0cdef b():\n    pass\n",  # a form feed
    "def \\\n  a():\n    pass\n",  # the name on the next line
    "x = '''\n",  # does not even parse
])
def test_doubt_parses_the_whole_text(text):
    lazy = _partial.Module(text, "<test>")
    try:
        expected = _partial.walk_defs(ast.parse(text), ["a"])
    except SyntaxError:
        with pytest.raises(SyntaxError):
            lazy.find("a")
        return
    assert _dump(lazy.find("a")) == _dump(expected)
    assert lazy.parsed


def test_a_module_used_as_a_tree_is_the_whole_tree():
    lazy = _partial.Module(TRICKY, "<test>")
    assert isinstance(lazy, ast.Module)
    assert ast.dump(lazy) == ast.dump(ast.parse(TRICKY))
    assert sum(isinstance(n, ast.FunctionDef) for n in ast.walk(lazy)) == \
        sum(isinstance(n, ast.FunctionDef) for n in ast.walk(ast.parse(TRICKY)))
    compile(_partial.Module("x = 1\n"), "<test>", "exec")
    for clone in (copy.deepcopy(lazy), copy.copy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert type(clone) is ast.Module and ast.dump(clone) == ast.dump(lazy)


def _library_files():
    import json
    import logging

    roots = [os.path.dirname(json.__file__), os.path.dirname(logging.__file__), os.path.dirname(_source.__file__)]
    files = [os.path.join(os.path.dirname(ast.__file__), name) for name in
             ("ast.py", "argparse.py", "typing.py", "inspect.py", "dataclasses.py", "enum.py", "tarfile.py")]
    for root in roots:
        files += [os.path.join(root, f) for f in sorted(os.listdir(root)) if f.endswith(".py")]
    return files


def test_every_definition_of_real_files():
    """Every top-level definition and every method, of the standard library files named and of
    flashfix itself (the engines' files are checked the same way in tests/test_lightness.py)."""
    checked = 0
    for path in _library_files():
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        full = ast.parse(text)
        lookups = ["__absent__"]
        for node in full.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lookups.append(node.name)
                if isinstance(node, ast.ClassDef):
                    lookups += ["%s.%s" % (node.name, m.name) for m in node.body
                                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
                    lookups.append(node.name + ".__absent__")
        _same_as_full_parse(text, lookups, fresh=False)
        checked += len(lookups)
    assert checked > 500


def _rewrite_reads_equal_a_full_parse(text):
    """What _source.rewrite reads from a module tree: the def node of every function (nested
    ones too, found from its first line as _def_node finds it) and the names imported at top level."""
    full = ast.parse(text)
    lazy = _partial.Module(text, "<test>")
    assert _source._top_level_imports(lazy) == _source._top_level_imports(full)
    checked = 0
    for node in ast.walk(full):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            block = lazy.around(first)
            found = [n for n in ast.walk(block or full) if isinstance(n, type(node)) and n.name == node.name
                     and n.lineno == node.lineno]
            assert len(found) == 1 and _dump(found[0]) == _dump(node), (node.name, node.lineno)
            checked += 1
    return lazy, checked


def test_rewrite_reads_equal_a_full_parse():
    lazy, checked = _rewrite_reads_equal_a_full_parse(CLEAN)
    assert checked == 8 and not lazy.parsed
    total = 0
    for path in _library_files():
        with open(path, encoding="utf-8") as handle:
            total += _rewrite_reads_equal_a_full_parse(handle.read())[1]
    assert total > 500


IMPORTABLE = '''import os


class Base:
    pass


class Spread(
    Base,
):
    def method(self):
        return os.sep


try:
    import json
except ImportError:
    json = None


class Engine(Base):
    """Engine."""

    def compute(self):
        def inner():
            return os.getcwd()

        return inner

    def other(self):
        return json.dumps(1)
'''


def test_rewrite_parses_one_method(tmp_path, monkeypatch):
    (tmp_path / "ff_partial_target.py").write_text(IMPORTABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import ff_partial_target as target

    _rewrite_reads_equal_a_full_parse(IMPORTABLE)
    parsed = []
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda source, *a, **k: parsed.append(source.strip()) or real(source, *a, **k))
    _source.forget()
    for func in (target.Engine.compute, target.Engine.compute(None), target.Engine.other, target.Spread.method):
        marked, plain = _source.rewrite(func, lambda node: None)
        assert _source.code_difference(plain, func.__code__) is None
    tree = _source._parsed[(target.__file__, IMPORTABLE)]
    assert not tree.parsed
    assert all(len(p) < 200 for p in parsed), parsed
    _source.forget()


def test_a_deferred_definition_behaves_as_a_node():
    lazy = _partial.Module(CLEAN, "<test>")
    full = _partial.walk_defs(ast.parse(CLEAN), ["Engine", "compute"])
    node = lazy.find("Engine.compute")
    assert type(node).__name__ == "FunctionDef" and isinstance(node, ast.FunctionDef)
    assert (node.name, node.lineno, node.col_offset) == (full.name, full.lineno, full.col_offset)
    assert not lazy.parsed
    for clone in (copy.deepcopy(node), copy.copy(node), pickle.loads(pickle.dumps(node))):
        assert type(clone) is ast.FunctionDef and _dump(clone) == _dump(full)
    node.lineno = 99
    node.body = []
    assert copy.copy(node).lineno == 99 and copy.copy(node).body == [] and node.end_lineno == full.end_lineno
    assert ast.unparse(lazy.find("Spread")) == ast.unparse(_partial.walk_defs(ast.parse(CLEAN), ["Spread"]))
    assert not lazy.parsed
