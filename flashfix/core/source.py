"""Reading engine source without importing it, and recompiling one function with an edit.

Shape probes read a module's source through the current reader (``_locate``: by default
the import system's own finders, which import nothing) and ``ast``: a module is parsed whole,
by Python's own parser, so what a probe reads as code is what Python runs (never the inside of
a string or comment). The same reading serves ``flashfix doctor`` (engine not imported) and the
runtime gate (engine imported), so both decide from the same facts. A definition is the one
Python binds (``find_def``: the last one of its scope). Parsed trees live only while patches
are being decided (``forget()``), so no engine process keeps them.

``rewrite()`` is how a patch changes a line inside an engine function: the function's own
source is parsed, recompiled unedited and compared with the loaded code object tree (if
the source is not what was loaded, nothing is done), edited as an AST, written back as
source text (the installed lines with only the changed statements replaced: ``_render``,
the text ``flashfix diff`` prints) and compiled from that text to a new code object with
the same name, line numbers, ``__future__`` flags, free variables, global bindings and
name mangling. The caller swaps that code
into the *existing* function object, so every reference to it, including ``from x import
f`` copies in other modules, runs the fix, and the per-call cost is that of the fixed code.
"""

import ast
import contextlib
import copy
import itertools
import re
import weakref

from flashfix.core import locate as _locate


class ShapeError(Exception):
    """The code is not what a patch expects; the message says what differs."""


def module_file(modname, modules=None):
    """Where ``modname``'s code comes from (a path, or a path inside a zip), located as the
    import system would, without importing it; None if there is no such module."""
    found = _locate.find(modname)
    return found.origin if found is not None else None


SOURCELESS = "sourceless"  # module_ast's answer for a module that exists but has no source

_parsed = {}  # (origin, text) -> tree; dropped by forget() once a module's patches are decided
KEEP_RUNS = False  # True: a tree keeps its parsed runs until forget() (the doctor; an engine process keeps none)


# A line that may start a top-level statement: at column 0, not blank, a comment, a closing
# bracket or a clause that continues a statement above (else, elif, except, finally).
_CUT = re.compile(r"^(?![\s#)\]}]|(?:else|elif|except|finally)\b)", re.M)
_CLASS = re.compile(r"class\b|@")  # a statement that may be a class (the parser decides: _split_class)
CHUNK_LINES = 200  # a run of top-level statements parsed at once holds at least this many lines


class Module(ast.Module):
    """``ast.Module`` of ``text``, read by Python's own parser, run by run (``runs()``).

    A run of top-level statements is parsed alone, starting where the run before it ended.
    That is sound: the run before parsed completely, so its end is not inside a string,
    brackets or a backslash continuation, and the next line, at column 0 and no ``else``-like
    clause, starts a new statement, exactly as in the whole file (where a run does not parse,
    it is extended to the next cut, and finally to the end). So a probe keeps only the
    statements it needs (memory grows with a run, not the file), and ``find_def`` stops once
    the rest of the text never spells the name looked up. ``body`` is every run."""

    def __init__(self, text, origin=None):
        super().__init__(type_ignores=[])
        self.flashfix_text, self.flashfix_origin, self._body, self._kept = text, origin, None, None
        self.flashfix_defs = weakref.WeakValueDictionary()  # (name, first line) -> a def find_def read (_def_node)

    @property
    def body(self):
        if self._body is None:
            self._body = [statement for _, run in self.runs() for statement in run]
        return self._body

    @body.setter
    def body(self, value):
        self._body = value

    def __reduce__(self):  # copy, deepcopy, pickle: a plain ast.Module
        return ast.Module, (), {"body": self.body, "type_ignores": self.type_ignores}

    def runs(self, keep=None):
        """``(end, statements)`` for each run of top-level statements, in order; ``end`` is
        the offset in the text where the run ends. SyntaxError if the text does not parse.

        A top-level class longer than ``CHUNK_LINES`` is parsed in runs of its own body
        (``_split_class``), so the parser never holds a whole long class at once. With
        ``keep(class_node, statement)``, such a class keeps only the body statements that
        ``keep`` accepts (its other attributes, line and column included, are the whole
        file's): a probe that looks up one method keeps that method, not the class."""
        if self._body is not None:
            yield len(self.flashfix_text), self._body
            return
        if not KEEP_RUNS:
            return (yield from self._runs(keep))
        if self._kept is None:  # the doctor: each run parsed once, whole, for every patch that reads it
            self._kept, self._more = [], self._runs(None)
        for i in itertools.count():
            if i == len(self._kept):
                try:
                    self._kept.append(next(self._more, None))
                except (SyntaxError, ValueError) as exc:  # raised to every reader, not only the first
                    self._kept.append(exc)
            if isinstance(self._kept[i], Exception):
                raise self._kept[i]
            if self._kept[i] is None:
                return
            yield self._kept[i]

    def _runs(self, keep):
        text, origin = self.flashfix_text, self.flashfix_origin or "<unknown>"
        cuts, line, at = [], 1, 0
        for match in _CUT.finditer(text):
            line += text.count("\n", at, match.start())
            at = match.start()
            cuts.append((at, line))
        lines = line + text.count("\n", at)

        def long_class(at, line, k):  # may the statement at ``at`` be a class longer than CHUNK_LINES?
            if not _CLASS.match(text, at):
                return False
            if text.startswith("@", at):  # its decorators, then its own line
                while k < len(cuts) and text.startswith("@", cuts[k][0]):
                    k += 1
                k += 1
            return (cuts[k][1] if k < len(cuts) else lines) - line > CHUNK_LINES

        start, line, k = 0, 1, 0
        while start < len(text):
            while k < len(cuts) and cuts[k][1] <= line:
                k += 1
            if long_class(start, line, k):
                split = _split_class(text, origin, start, line, cuts[k:], keep)
                if split is not None:  # one long class, read in runs of its body
                    node, start, line = split
                    yield start, [node]
                    continue
            while k < len(cuts) and cuts[k][1] < line + CHUNK_LINES and not long_class(*cuts[k], k + 1):
                k += 1  # a run ends before a long class, which is read in runs of its own
            for attempt in range(4):
                end, next_line = cuts[k] if k < len(cuts) and attempt < 3 else (len(text), None)
                try:
                    run = ast.parse("\n" * (line - 1) + text[start:end], filename=origin).body
                    break
                except (SyntaxError, ValueError):
                    if end == len(text):
                        raise
                    k += 1
            yield end, run
            start, line = end, next_line


CLASS_CHUNK_LINES = 100  # a run of a long class's body statements parsed at once holds at least this many lines


def _split_class(text, origin, start, line, ends, keep):
    """``(class_node, end, next_line)``: the class whose statement starts at offset ``start``
    (line ``line``), read in runs of its body statements, and where it ends (one of ``ends``,
    the ``(offset, line)`` of later lines at column 0 that may start a top-level statement);
    None where the statement is not a class read that way (the caller parses it whole).

    Sound for the same reason as a module's runs: each run parsed completely, so it does
    not end inside a string, brackets or a backslash continuation, and the next line, at
    the body's own indentation (checked against the first body statement, as the parser
    read it) and no ``else``-like clause, starts a statement of the class body, exactly as
    in the whole file; a run that ends before one of ``ends`` ends the class there. A body
    run is parsed under an ``if 1:`` line placed just above it, so every line and column is
    the file's; it must give that one ``if`` and nothing else (a statement at column 0
    would end the class, an ``else:`` would join the ``if``)."""
    first = text.find("\n", start) + 1
    indent = re.compile(r"^([ \t\f]+)(?=[^\s#)\]}])", re.M).search(text, first) if first else None
    if indent is None:
        return None
    prefix = indent.group(1)
    cut = re.compile(r"^%s(?![\s#)\]}]|(?:else|elif|except|finally)\b)" % re.escape(prefix), re.M)
    cuts, at, n = [], start, line
    for match in cut.finditer(text, first):
        n += text.count("\n", at, match.start())
        at = match.start()
        cuts.append((at, n, False))
    cuts = sorted(cuts + [(at, n, True) for at, n in ends]) + [(len(text), None, True)]
    node, last, at, n, j = None, None, start, line, 0
    while True:
        while j < len(cuts) - 1 and cuts[j][1] < n + CLASS_CHUNK_LINES and not cuts[j][2]:
            j += 1
        try:
            if node is None:  # the header run: one class, its body at ``prefix``
                run = ast.parse("\n" * (line - 1) + text[start:cuts[j][0]], filename=origin).body
            else:
                wrapped = ast.parse("\n" * (n - 2) + "if 1:\n" + text[at:cuts[j][0]], filename=origin).body
                if len(wrapped) != 1 or not isinstance(wrapped[0], ast.If) or wrapped[0].orelse:
                    return None
                run = wrapped[0].body
        except (SyntaxError, ValueError):
            if j == len(cuts) - 1:
                return None  # parsed whole by the caller
            grow = cuts[j][1] + max(CLASS_CHUNK_LINES, cuts[j][1] - n)  # twice as long a run, or more
            j += 1
            while j < len(cuts) - 1 and cuts[j][1] < grow and not cuts[j][2]:
                j += 1
            continue
        if node is None:
            if len(run) != 1 or not isinstance(run[0], ast.ClassDef):
                return None
            node, run = run[0], run[0].body
            body_line = text[_line_start(text, start, line, run[0].lineno):]
            if not body_line.startswith(prefix) or run[0].col_offset != len(prefix):
                return None  # ``prefix`` is not the indentation of the class body
            node.body = []
        last = run[-1]
        node.body.extend(s for s in run if keep is None or keep(node, s))
        at, n, top = cuts[j]
        if top:  # a run that parsed ends before a line at column 0: the class ends there
            node.end_lineno, node.end_col_offset = last.end_lineno, last.end_col_offset
            return node, at, n
        j += 1


def _line_start(text, at, line, target):
    """The offset of line ``target`` in ``text``, counting from offset ``at`` of line ``line``."""
    while line < target:
        at = text.index("\n", at) + 1
        line += 1
    return at


def parse_text(text, origin):
    """The module tree of ``text`` (a ``Module``: parsed when first read)."""
    key = (origin, text)
    tree = _parsed.get(key)
    if tree is None:
        tree = _parsed[key] = Module(text, origin)
    return tree


def parse_file(path):
    """The AST of the file at ``path``."""
    return parse_text(_locate._read(path), path)


def forget():
    """Drop every parsed tree (they are only needed while patches are being decided)."""
    _parsed.clear()


@contextlib.contextmanager
def kept():
    """Within: every tree keeps the runs it parsed, then all are forgotten (the doctor: many patches read
    the same few modules; an engine process parses run by run and keeps nothing)."""
    global KEEP_RUNS
    outer, KEEP_RUNS = KEEP_RUNS, True
    try:
        yield
    finally:
        KEEP_RUNS = outer
        outer or forget()


def module_ast(modname, modules=None):
    """``modname``'s AST from the current reader; None if the module does not exist,
    ``SOURCELESS`` if it exists without source."""
    found = _locate.find(modname)
    if found is None:
        return None
    if found.text is None:
        return SOURCELESS
    return parse_text(found.text, found.origin)


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_SCOPES = _DEFS + (ast.Lambda,)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def find_def(tree, qualname):
    """The ``FunctionDef``/``ClassDef`` that Python binds to ``qualname`` (``"Class.method"``)
    in ``tree``, or None if nothing there binds that name. Where a name is defined more than
    once in one scope, Python binds the last definition, and so does this. ShapeError where
    what is bound cannot be read from the source: the last statement that binds the name is
    not a plain definition (a definition inside ``if``/``try``/``with``/a loop, an assignment,
    an import, ``del``...)."""
    parts, defs = qualname.split("."), getattr(tree, "flashfix_defs", None)
    if isinstance(tree, Module):
        text = tree.flashfix_text
        if any(part not in text for part in parts):  # no definition can bind a name never spelled
            return None
        statements = []
        if len(parts) > 1:  # of a long class, only the statements that bind the member are kept
            keep = lambda cls, statement: cls.name == parts[0] and _binds(statement, parts[1])  # noqa: E731
        else:
            keep = lambda cls, statement: cls.name == parts[0]  # noqa: E731
        for end, run in tree.runs(keep):  # the statements that bind the name, up to its last spelling
            statements.extend(s for s in run if _binds(s, parts[0]))
            if text.find(parts[0], end) < 0:
                break
        tree = ast.Module(body=statements, type_ignores=[])
    node = tree
    for part in parts:
        node = _bound_def(node, part, qualname)
        if node is None:
            return None
    if defs is not None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        defs[node.name, _first_line(node)] = node  # while a probe holds it, rewrite() reads no second copy
    return node


def _binds(statement, name):
    return isinstance(statement, _DEFS) and statement.name == name or bool(_bindings(statement, name))


def _bound_def(scope, name, qualname):
    bindings = []
    for statement in getattr(scope, "body", ()):
        if isinstance(statement, _DEFS) and statement.name == name:
            bindings.append((statement, True))
        else:
            bindings.extend((node, False) for node in _bindings(statement, name))
    if not any(isinstance(node, _DEFS) for node, _ in bindings):
        return None  # imported or assigned here, not defined: no definition to read
    last, plain = bindings[-1]
    if plain:
        return last
    raise ShapeError("%s is bound at lines %s and the last of them is not a plain definition of its scope (it is "
                     "inside if/try/with/a loop, or an assignment, import or del), so which definition Python "
                     "binds cannot be read from the source"
                     % (qualname, ", ".join(str(getattr(node, "lineno", "?")) for node, _ in bindings)))


def _bindings(statement, name):
    """The nodes of ``statement`` that bind ``name`` in the scope that holds it (not inside a
    nested function, class, lambda or comprehension, whose names are their own)."""
    found, stack = [], [statement]
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            if getattr(node, "name", None) == name:
                found.append(node)
            continue
        if isinstance(node, ast.AnnAssign) and node.value is None:  # ``x: T`` alone binds nothing
            continue
        if isinstance(node, _COMPREHENSIONS):  # only := binds outside a comprehension
            found.extend(n for n in ast.walk(node) if isinstance(n, ast.NamedExpr) and n.target.id == name)
            continue
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            found.append(node)
        elif isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            found.append(node)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == name:
            found.append(node)
        elif isinstance(node, ast.MatchMapping) and node.rest == name:
            found.append(node)
        elif isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))


def binds(modname, name, depth=0, tree=None):
    """Does module ``modname`` (its source, or ``tree``) bind the global ``name`` at its top level (not under
    ``if TYPE_CHECKING:``), or through ``from x import *``? ``hasattr(module, name)`` once it is imported."""
    tree = module_ast(modname) if tree is None else tree
    text = getattr(tree, "flashfix_text", "import *" + name)  # a plain ast.Module: no text to look at first
    if not isinstance(tree, ast.Module) or depth > 5 or name not in text and "import *" not in text:
        return False
    stars, star = [], "import *" in text and not name.startswith("_")  # a star import binds no private name
    runs = tree.runs(lambda cls, statement: False) if isinstance(tree, Module) else [(None, tree.body)]
    for statement in (statement for _, run in runs for statement in run):
        if isinstance(statement, ast.If) and ast.unparse(statement.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            statement = ast.Module(statement.orelse, [])  # names imported for type checkers only
        if _bindings(statement, name):
            return True
        if star and not isinstance(statement, _DEFS):  # no def or class body holds a star import
            stars += [n for n in ast.walk(statement) if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
    package = modname.split(".")[:None if (module_file(modname) or "").endswith("__init__.py") else -1]
    return any(binds(".".join((package[:len(package) + 1 - star.level] if star.level else []) + [star.module] * bool(
        star.module)), name, depth + 1) for star in stars)


def method_calls(node, attr):
    """Every call ``<expr>.attr(...)`` inside ``node``."""
    return [n for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def name_calls(node, name):
    """Every call ``name(...)`` inside ``node``."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def keywords(call):
    return {kw.arg: kw.value for kw in call.keywords if kw.arg is not None}


# --- recompiling one function -------------------------------------------------------------

MARK_NAME = "__flashfix_mark__"  # the module global through which marked code reports its first run


def marker(site):
    """A statement that reports the rewritten code's first run: a call of a plain function that
    the patched module holds as a global (``torch.compile`` traces it; see _registry.mark_ran)."""
    call = ast.Expr(ast.Call(ast.Name(MARK_NAME, ast.Load()), [ast.Constant(site)], []))
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


def function_source(func):
    """``(text, origin)``: the source of the module that ``func``'s code was compiled from, read
    now (through the module's loader, so a zipped module reads too). ShapeError if none."""
    import sys

    code = func.__code__
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    text = None
    if module is not None and getattr(module, "__file__", None) == code.co_filename:
        spec = getattr(module, "__spec__", None)
        loader = getattr(spec, "loader", None) or getattr(module, "__loader__", None)
        text = _locate._loader_source(loader, module.__name__, code.co_filename)
    elif code.co_filename.endswith(".py"):
        try:
            text = _locate._read(code.co_filename)
        except OSError:
            text = None
    if text is None:
        raise ShapeError("the source of %s is not available (%s)" % (func.__qualname__, code.co_filename))
    return text, code.co_filename


def _def_node(func, tree=None):
    code = func.__code__
    if tree is None:
        tree = parse_text(*function_source(func))
    line = code.co_firstlineno
    if (found := getattr(tree, "flashfix_defs", {}).get((code.co_name, line))) is not None:
        return found  # the def a probe read from this very text
    runs = tree.runs(lambda cls, s: _first_line(s) <= line <= s.end_lineno) if isinstance(tree, Module) \
        else [(None, tree.body)]
    for _, run in runs:  # only the statements that hold the function's first line are walked
        for statement in run:
            if _first_line(statement) <= code.co_firstlineno <= statement.end_lineno:  # a decorated def too
                for node in ast.walk(statement):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
                        if _first_line(node) == code.co_firstlineno or node.lineno == code.co_firstlineno:
                            return node
    raise ShapeError("cannot find the source of %s in %s" % (func.__qualname__, code.co_filename))


def _first_line(statement):
    return min([statement.lineno] + [d.lineno for d in getattr(statement, "decorator_list", ())])


_IMPORTS = {}  # (origin, length, hash) of a module's text -> its top-level imports: read once for all its rewrites


def _top_level_imports(tree):
    """Names bound by import statements of the module scope (inside if/try/with, not def/class)."""
    if not isinstance(tree, Module):
        return _imports_of(tree)
    key = (tree.flashfix_origin, len(tree.flashfix_text), hash(tree.flashfix_text))
    return _IMPORTS[key] if key in _IMPORTS else _IMPORTS.setdefault(key, frozenset(_imports_of(tree)))


def _imports_of(tree):
    runs = tree.runs(lambda cls, statement: False) if isinstance(tree, Module) else [(None, tree.body)]
    names, stack = set(), [s for _, run in runs for s in run if not isinstance(s, _DEFS)]  # no def bodies kept
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*")
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                stack.extend(getattr(node, field, None) or ())
    return names


def _imported_at_top(tree):
    """``if False: import a, b`` for the names the original module imports at top level. The
    compiler treats attribute calls on such names differently (since 3.11.x: ``LOAD_ATTR``, not
    ``LOAD_METHOD``), so the recompiled code must see the same import bindings to match."""
    names = sorted(_top_level_imports(tree))
    if not names:
        return []
    return [ast.If(test=ast.Constant(False), body=[ast.Import([ast.alias(n) for n in names])], orelse=[])]


def _future_mask():
    import __future__

    mask = 0
    for feature in __future__.all_feature_names:
        mask |= getattr(__future__, feature).compiler_flag
    return mask & ~CO_NESTED  # nested_scopes' flag is CO_NESTED: always on, and not a future import


CO_NESTED = 0x10
FUTURE_FLAGS = _future_mask()


def _compile(func, def_node, tree):
    """Compile ``def_node`` as ``func``'s code: same file, lines, ``__future__`` flags, free
    variables, global/local bindings and private-name mangling."""
    code = func.__code__
    node = copy.copy(def_node)  # shallow: the body is compiled as it is, never changed (a deep copy of a
    node.decorator_list, node.returns, args = [], None, copy.copy(def_node.args)  # long function costs megabytes)
    node.args = args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    bare = lambda a: a and ast.arg(a.arg, None, **{k: getattr(a, k, None) for k in a._attributes})  # noqa: E731
    args.posonlyargs, args.args, args.kwonlyargs = ([bare(a) for a in v] for v in (args.posonlyargs, args.args, args.kwonlyargs))
    args.vararg, args.kwarg = bare(args.vararg), bare(args.kwarg)
    parts = func.__qualname__.split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-2] != "<locals>" else None
    if owner is not None:  # keep private-name mangling and the __class__ cell of zero-arg super()
        body = [ast.ClassDef(name=owner, bases=[], keywords=[], body=[node], decorator_list=[], type_params=[])]
        fetch = "%s.__dict__[%r]" % (owner, node.name)
    else:
        body = [node]
        fetch = node.name
    bound = owner or node.name  # the name the scaffold binds: a global in the original unless free there
    outer_args = [v for v in code.co_freevars if v != "__class__"]
    if outer_args:  # the free variables must be free in the new code too: one enclosing function
        prologue = [] if bound in outer_args else [ast.Global([bound])]
        prologue.append(ast.parse("(%s,)" % ", ".join(outer_args)).body[0])
        outer = ast.FunctionDef(
            name="__flashfix_outer__",
            args=ast.arguments(posonlyargs=[], args=[ast.arg(a) for a in outer_args], vararg=None, kwonlyargs=[],
                               kw_defaults=[], kwarg=None, defaults=[]),
            body=prologue + body + [ast.Return(ast.parse(fetch, mode="eval").body)],
            decorator_list=[], returns=None, type_params=[],
        )
        body = [outer]
    module = ast.Module(body=_imported_at_top(tree) + body, type_ignores=[])
    for n in ast.walk(module):
        if not hasattr(n, "lineno") or n.lineno is None:
            ast.copy_location(n, def_node)
    ast.fix_missing_locations(module)
    namespace = {}
    exec(compile(module, code.co_filename, "exec", flags=code.co_flags & FUTURE_FLAGS, dont_inherit=True), namespace)
    if outer_args:
        built = namespace["__flashfix_outer__"](*([None] * len(outer_args)))
    else:
        built = eval(fetch, namespace)
    new = getattr(built, "__func__", built).__code__
    if new.co_freevars != code.co_freevars:
        raise ShapeError("free variables differ after recompiling %s: %s, loaded %s"
                         % (func.__qualname__, new.co_freevars, code.co_freevars))
    changes = {"co_name": code.co_name, "co_flags": (new.co_flags & ~CO_NESTED) | (code.co_flags & CO_NESTED)}
    if hasattr(code, "co_qualname"):  # Python 3.11+
        changes["co_qualname"] = code.co_qualname
    return new.replace(**changes)


_CODE_FIELDS = ("co_code", "co_names", "co_varnames", "co_freevars", "co_cellvars", "co_flags", "co_argcount",
                "co_posonlyargcount", "co_kwonlyargcount", "co_name")


def code_difference(a, b, where=""):
    """None if code objects ``a`` and ``b`` are the same program (bytecode, names, constants,
    nested code objects, flags), else a short description of the first difference."""
    where = where or a.co_name
    for field in _CODE_FIELDS:
        if getattr(a, field) != getattr(b, field):
            return "%s differs in %s" % (where, field)
    if len(a.co_consts) != len(b.co_consts):
        return "%s differs in its constants" % where
    return next(filter(None, (_const_difference(x, y, where) for x, y in zip(a.co_consts, b.co_consts))), None)


def _const_difference(x, y, where):
    if type(x) is not type(y):
        return "%s differs in a constant" % where
    if isinstance(x, type(_const_difference.__code__)):
        return code_difference(x, y, "%s.%s" % (where, x.co_name))
    if isinstance(x, (tuple, frozenset)):
        xs, ys = (list(x), list(y)) if isinstance(x, tuple) else (sorted(x, key=repr), sorted(y, key=repr))
        if len(xs) != len(ys):
            return "%s differs in a constant" % where
        return next(filter(None, (_const_difference(x, y, where) for x, y in zip(xs, ys))), None)
    if isinstance(x, float) and x != x and y != y:  # NaN
        return None
    if x != y or repr(x) != repr(y):  # repr tells -0.0 from 0.0
        return "%s differs in a constant" % where
    return None


def rewrite(func, edit):
    """New code objects for ``func`` after ``edit(def_node)`` (which edits in place and may
    insert ``marker(site)`` statements). Returns ``(code_with_marker, code_without)``.

    The function's source is read now and recompiled unedited first: unless that gives the
    very code object tree that is loaded (bytecode, constants, names, nested code, flags),
    nothing is done (ShapeError): the file was edited after import, or someone else already
    changed the function. ShapeError also when ``edit`` refuses.
    """
    tree = parse_text(*function_source(func))
    text, origin = tree.flashfix_text, tree.flashfix_origin  # the text already read, not a second copy
    original = _def_node(func, tree)
    problem = code_difference(_compile(func, original, tree), func.__code__)
    if problem:
        raise ShapeError(
            "the source of %s on disk differs from the loaded code (edited after import, or already patched): %s"
            % (func.__qualname__, problem)
        )
    node = copy.deepcopy(original)
    edit(node)
    rendered = render_edit(text, original, node, origin)  # compiled from the text ``flashfix diff`` shows
    del original, node, text  # a long function's trees are megabytes: free them before compiling again
    with_marker = _compile(func, rendered.tree(rendered.MARKED), tree)
    without = _compile(func, rendered.tree(rendered.PLAIN), tree)
    return with_marker, without


def render_edit(text, original, edited, origin=None):
    """The function ``original`` (a def node of the module source ``text``) once edited into
    ``edited``, as source text (``_render.render``: ``rewrite`` compiles it, ``flashfix diff`` prints it)."""
    from flashfix.core import render as _render

    return _render.render(text, original, edited, origin)
