"""Reading engine source without importing it, and recompiling one function with an edit.

Shape probes read a module's source through its file (located with ``PathFinder``, which
imports nothing, not even the parent package) and ``ast``. The same reading serves
``flashfix doctor`` (engine not imported) and the runtime gate (engine imported), so both
decide from the same facts.

``rewrite()`` is how a patch changes a line inside an engine function: the function's own
source is parsed, checked against the loaded code (if the file on disk is not what was
loaded, nothing is done), edited as an AST, and compiled to a new code object with the
same name, line numbers, free variables and name mangling. The caller swaps that code
into the *existing* function object, so every reference to it, including ``from x import
f`` copies in other modules, runs the fix, and the per-call cost is that of the fixed code.
"""

import ast
import copy
import os
from importlib.machinery import PathFinder


class ShapeError(Exception):
    """The code is not what a patch expects; the message says what differs."""


def module_file(modname, modules=None):
    """Path of ``modname``'s source, without importing it or its parents; None if absent."""
    import sys

    module = (modules or sys.modules).get(modname)
    if module is not None and getattr(module, "__file__", None):
        return module.__file__
    parts = modname.split(".")
    spec = PathFinder.find_spec(parts[0])
    if spec is None:
        return None
    if len(parts) == 1:
        return spec.origin
    for location in spec.submodule_search_locations or ():
        base = os.path.join(location, *parts[1:])
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


_parsed = {}


def parse_file(path):
    """The module's AST (cached per path and modification time)."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    tree = _parsed.get(key)
    if tree is None:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), filename=path)
        _parsed[key] = tree
    return tree


def module_ast(modname, modules=None):
    path = module_file(modname, modules)
    if path is None or not path.endswith(".py"):
        return None
    return parse_file(path)


def find_def(tree, qualname):
    """The ``FunctionDef``/``ClassDef`` at ``qualname`` (``"Class.method"``) in ``tree``, or None."""
    node = tree
    for part in qualname.split("."):
        for child in getattr(node, "body", ()):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                node = child
                break
        else:
            return None
    return node


def method_calls(node, attr):
    """Every call ``<expr>.attr(...)`` inside ``node``."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
    ]


def name_calls(node, name):
    """Every call ``name(...)`` inside ``node``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def keywords(call):
    return {kw.arg: kw.value for kw in call.keywords if kw.arg is not None}


def source_of(node):
    return ast.unparse(node)


# --- recompiling one function -------------------------------------------------------------

MARKER = "__flashfix_marker__"


def marker(site):
    """A statement that reports its first run to the registry (removed again after that run)."""
    call = ast.parse("__import__('flashfix._registry', fromlist=['_']).mark_ran(%r)" % (site,)).body[0]
    call.flashfix_marker = True
    return call


def statement_of(func_def, inner):
    """``(block, index)``: the innermost statement of ``func_def`` that contains node ``inner``."""
    for parent in ast.walk(func_def):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if not isinstance(block, list):
                continue
            for index, child in enumerate(block):
                if child is inner or any(n is inner for n in ast.walk(child)):
                    if isinstance(child, ast.stmt) and not _contains_block(child, inner):
                        return block, index
    raise ShapeError("no statement of %s contains the node" % getattr(func_def, "name", "the function"))


def insert_before(func_def, inner, stmt):
    """Insert ``stmt`` before the statement of ``func_def`` that contains node ``inner``."""
    block, index = statement_of(func_def, inner)
    block.insert(index, ast.copy_location(stmt, block[index]))
    ast.fix_missing_locations(func_def)


def replace_node(root, old, new):
    """Put ``new`` where ``old`` is inside ``root`` (one place, by identity)."""
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, ast.copy_location(new, old))
                return
            if isinstance(value, list):
                for index, item in enumerate(value):
                    if item is old:
                        value[index] = ast.copy_location(new, old)
                        return
    raise ShapeError("node to replace not found")


def _contains_block(stmt, inner):
    for field in ("body", "orelse", "finalbody", "handlers"):
        for child in getattr(stmt, field, None) or ():
            if child is inner or any(n is inner for n in ast.walk(child)):
                return True
    return False


def _strip_markers(node):
    for parent in ast.walk(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list):
                block[:] = [s for s in block if not getattr(s, "flashfix_marker", False)]
    return node


def _def_node(func):
    code = func.__code__
    tree = parse_file(code.co_filename)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if first == code.co_firstlineno or node.lineno == code.co_firstlineno:
                return node
    raise ShapeError("cannot find the source of %s in %s" % (func.__qualname__, code.co_filename))


def _top_level_imports(tree):
    """Names bound by import statements of the module scope (inside if/try/with, not def/class)."""
    names, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*")
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                stack.extend(getattr(node, field, None) or ())
    return names


def _imported_at_top(filename):
    """``if False: import a, b`` for the names the original module imports at top level. The
    compiler treats attribute calls on such names differently (since 3.11.x: ``LOAD_ATTR``, not
    ``LOAD_METHOD``), so the recompiled code must see the same import bindings to match."""
    names = sorted(_top_level_imports(parse_file(filename))) if os.path.isfile(filename) else []
    if not names:
        return []
    return [ast.If(test=ast.Constant(False), body=[ast.Import([ast.alias(n) for n in names])], orelse=[])]


def _compile(func, def_node):
    """Compile ``def_node`` as ``func``'s code: same file, lines, free variables and mangling."""
    code = func.__code__
    node = copy.deepcopy(def_node)
    node.decorator_list = []
    args = node.args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    node.returns = None
    parts = func.__qualname__.split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-2] != "<locals>" else None
    body = [node]
    if owner is not None:  # keep private-name mangling and the __class__ cell of zero-arg super()
        body = [ast.ClassDef(name=owner, bases=[], keywords=[], body=[node], decorator_list=[], type_params=[])]
        fetch = "%s.__dict__[%r]" % (owner, node.name)
    else:
        fetch = node.name
    outer_args = [v for v in code.co_freevars if v != "__class__"]
    outer = ast.FunctionDef(
        name="__flashfix_outer__",
        args=ast.arguments(
            posonlyargs=[], args=[ast.arg(a) for a in outer_args], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
        ),
        body=body + [ast.Return(ast.parse(fetch, mode="eval").body)],
        decorator_list=[],
        returns=None,
        type_params=[],
    )
    if outer_args:  # make the names free variables of the inner function, as in the original
        outer.body.insert(0, ast.parse("(%s,)" % ", ".join(outer_args)).body[0])
    module = ast.Module(body=_imported_at_top(code.co_filename) + [outer], type_ignores=[])
    for n in ast.walk(module):
        if not hasattr(n, "lineno") or n.lineno is None:
            ast.copy_location(n, def_node)
    ast.fix_missing_locations(module)
    namespace = {}
    exec(compile(module, code.co_filename, "exec", dont_inherit=True), namespace)
    built = namespace["__flashfix_outer__"](*([None] * len(outer_args)))
    built = getattr(built, "__func__", built)
    new = built.__code__
    if new.co_freevars != code.co_freevars:
        raise ShapeError("free variables differ after recompiling %s" % func.__qualname__)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        return new.replace(co_name=code.co_name, co_qualname=code.co_qualname)
    return new.replace(co_name=code.co_name)


def rewrite(func, edit, site=None):
    """New code objects for ``func`` after ``edit(def_node)`` (which edits in place and may
    insert ``marker(site)`` statements). Returns ``(code_with_marker, code_without)``.

    Raises ShapeError when the source on disk is not what is loaded or ``edit`` refuses.
    """
    original = _def_node(func)
    same = _compile(func, original)
    if same.co_code != func.__code__.co_code or same.co_names != func.__code__.co_names:
        raise ShapeError(
            "the source of %s on disk differs from the loaded code (edited after import, or already patched)"
            % func.__qualname__
        )
    node = copy.deepcopy(original)
    edit(node)
    with_marker = _compile(func, node)
    without = _compile(func, _strip_markers(copy.deepcopy(node)))
    return with_marker, without
