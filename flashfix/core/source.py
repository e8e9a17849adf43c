"""Reading engine source without importing it, and recompiling one function with an edit.

Shape probes read a module's source through the current reader (``_locate``: by default the
import system's own finders, which import nothing) and ``ast``: Python's own parser parses the
pieces a probe needs (``Module``), so what a probe reads as code is what Python runs (never the
inside of a string or comment). The same reading serves ``flashfix doctor`` (engine not
imported) and the runtime gate (engine imported), so both decide from the same facts. A
definition is the one Python binds (``find_def``: the last one of its scope). Parsed trees live
only while patches are being decided (``forget()``), so no engine process keeps them.

``rewrite()`` is how a patch changes a line inside an engine function: the function's own
source is parsed, recompiled unedited and compared with the loaded code object tree (if
the source is not what was loaded, nothing is done), edited as an AST, written back as
source text (the installed lines with only the changed statements replaced: ``_render``,
the text ``flashfix diff`` prints) and compiled from that text to a new code object with
the same name, line numbers, ``__future__`` flags, free variables, global bindings and
name mangling. The caller swaps that code
into the *existing* function object, so every reference to it, including ``from x import
f`` copies in other modules, runs the fix, and the per-call cost is that of the fixed code.
``rewrite_ahead()`` does the same from the module's source before the module runs; the caller
compares its unedited code with the loaded code afterwards.
"""

import ast
import contextlib
import copy
import operator
import re
import unicodedata
import weakref
from collections import namedtuple

from flashfix.core import locate as _locate
from flashfix.core.registry import MARK_NAME, NotBound, ShapeError, code_difference, first_line as _first_line, mangled  # noqa: F401  (defined in the
# registry, which every process imports; this module only when something is decided: flashfix.core.lazy)


def module_file(modname, modules=None):
    """Where ``modname``'s code comes from (a path, or a path inside a zip), located as the
    import system would, without importing it; None if there is no such module."""
    found = _locate.find(modname)
    return found.origin if found is not None else None


SOURCELESS = "sourceless"  # module_ast's answer for a module that exists but has no source

_parsed = {}  # (origin, text) -> tree; dropped by forget() once a module's patches are decided
KEEP_RUNS = False  # True: a tree keeps the pieces it parsed until forget() (the doctor; an engine process keeps none)


# Comments and strings as Python's tokenizer reads them (a quote that opens no string: one character).
_LEX = re.compile(r"#[^\r\n]*|'''[^'\\]*(?:(?:\\[\s\S]|'(?!''))[^'\\]*)*'''|\"\"\"[^\"\\]*(?:(?:\\[\s\S]|\"(?!\"\"))[^\"\\]*)*\"\"\""
                  r"|'[^'\\\r\n]*(?:\\(?:\r\n|[\s\S])[^'\\\r\n]*)*'|\"[^\"\\\r\n]*(?:\\(?:\r\n|[\s\S])[^\"\\\r\n]*)*\"|['\"]")
_HEAD = re.compile(r"(?:async[ \t]+)?(def|class)[ \t]+(\w+)")  # a statement that binds this one name
_BODY = re.compile(r"^(?:[ \t]*\f)*([ \t]+)\S", re.M)  # a line's indentation (a form feed resets it)
_OPEN_CLOSE = str.maketrans("[]{}", "()()")
_BRACKET = re.compile(r"[():]")  # in masked text (brackets written as parentheses)


class _Whole(Exception):
    """A piece did not parse alone: the file is read whole (whose SyntaxError is Python's own)."""


def _mask(text):
    """``text`` with each string blanked to NULs, each comment to spaces and every bracket written
    ``(`` or ``)`` (same length, no newline left in a string); None where the tokens cannot be told
    from the text: a quote that opens no string, or an f-string whose braces, strings in it aside, do
    not balance (PEP 701: Python 3.12 reads ``f"{x["k"]}"`` as one string, where this reads ``f"{x["``)."""
    def blank(m):
        token, s = m.group(), m.start()
        if token[0] == "#":
            return " " * len(token)
        bare = re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "", token[1:-1]) if "f" in text[max(s - 2, 0):s].lower() else ""
        if len(token) == 1 or bare.count("{") != bare.count("}"):
            raise _Whole()
        return "\0" * len(token)
    with contextlib.suppress(_Whole):  # else None
        return _LEX.sub(blank, text).translate(_OPEN_CLOSE)


def _pieces(text, masked, start, end, indent, line):
    """``[[start, end, line, head]]``: each statement at ``indent`` in ``text[start:end]`` (whose
    first line, ``line``, starts at ``start``), decorators with it (``head``: where its keyword is);
    None where the brackets do not balance. As Python's tokenizer has it, a statement starts on a line
    at ``indent`` outside strings and brackets, not after a backslash, and not an ``else``-like clause."""
    cut = re.compile(r"\n(?:[ \t]*\f)*%s(?![\s)]|(?:else|elif|except|finally)\b)" % re.escape(indent))
    found, depth, at = [], 0, start
    for m in cut.finditer("\n" + masked, start, end + 1):  # one newline first: offsets in it are one more
        p, head = m.start(), m.end() - 1
        depth, line, at = depth + masked.count("(", at, p) - masked.count(")", at, p), line + text.count("\n", at, p), p
        if depth or masked.endswith(("\\\n", "\\\r\n"), start, at):
            continue
        if found and masked[found[-1][3]] == "@":  # after a decorator: the same statement
            found[-1][3] = head
        else:
            found.append([at, end, line, head])
    for piece, after in zip(found, found[1:]):
        piece[1] = after[0]
    return found if depth + masked.count("(", at, end) - masked.count(")", at, end) == 0 else None


class Module(ast.Module):
    """``ast.Module`` of ``text``, read by Python's own parser piece by piece (``statements()``).

    The text is cut where Python starts a top-level statement, a class also where a statement of its body
    starts (``_pieces``: strings, comments and brackets found as Python's tokenizer finds them), and a lookup
    parses alone, with the file's lines and columns, only the pieces that can bind its name (a ``def`` or
    ``class`` binds its own name only; any other piece must spell it). Where the text leaves a doubt (a quote
    that opens no string, an f-string that may nest its quotes, unbalanced brackets, a bare CR, names not in
    NFKC form) or a piece does not parse alone, the file is parsed whole. ``body`` is every statement."""

    def __init__(self, text, origin=None):
        super().__init__(type_ignores=[])
        self.flashfix_text, self.flashfix_origin, self._body, self._top, self._kept = text, origin, None, None, {}
        self._file = origin or "<unknown>"
        self.flashfix_defs = weakref.WeakValueDictionary()  # (name, first line) -> a def find_def read (_def_node)

    @property
    def body(self):
        if self._body is None:
            self._body = self.statements() if self._pieces() else ast.parse(self.flashfix_text, self._file).body
        return self._body

    @body.setter
    def body(self, value):
        self._body = value

    def __reduce__(self):  # copy, deepcopy, pickle: a plain ast.Module
        return ast.Module, (), {"body": self.body, "type_ignores": self.type_ignores}

    def _pieces(self):
        if self._top is None:
            text = self.flashfix_text
            masked = self._masked = _mask(text) if text.count("\r") == text.count("\r\n") else None
            plain = masked is not None and unicodedata.is_normalized("NFKC", masked)  # names spelled as Python reads them
            self._top = plain and _pieces(text, masked, 0, len(text), "", 1) or False
        return self._top

    def unspelled(self, word):
        """True where no name or string here can spell ``word`` (an ASCII identifier, any case): names are
        in NFKC form (as Python reads them), no string escape writes a letter or joins lines, and the
        word is neither in the text nor in its strings' text run together (``"ab" "c"`` is ``"abc"``)."""
        text, word = self.flashfix_text, word.lower()
        if not (word.isascii() and word.isidentifier()) or word in text.lower() or not self._pieces():
            return False
        strings = "".join(text[m.start():m.end()] for m in re.finditer("\0+", self._masked))
        return not re.search(r"\\[xuUN0-7\r\n]", strings) and word not in re.sub("['\"]", "", strings).lower()

    def statements(self, words=None, member=None, line=None):
        """The top-level statements of the pieces that spell one of ``words`` (None: every piece) and
        hold line ``line`` (None: any); of a class, only its body statements that spell ``member`` (and
        hold ``line``; None: all of them; False: none, an empty body)."""
        if self._body is not None or not self._pieces():
            return self.body
        try:
            return [s for piece in self._select(self._top, words, line) for s in self._read(piece, member, line)]
        except _Whole:
            self._top = False
            return self.body

    def _select(self, pieces, words, line):
        for i, (start, end, first, head) in enumerate(pieces):
            if line is not None and not first <= line < (pieces[i + 1][2] if i + 1 < len(pieces) else line + 1):
                continue
            defines = _HEAD.match(self.flashfix_text, head)
            if words is None or any(self.flashfix_text.find(w, start, end) >= 0 for w in words) and (
                    defines is None or defines.group(2) in words):
                yield pieces[i]

    def _read(self, piece, member, line):
        members = self._keep((piece[0], None), self._members, piece) if member is not None or line is not None else None
        if members is None:
            return self._keep((piece[0], False), self._parse, piece, False)
        node = copy.copy(members[0])
        node.body = [] if member is False else [s for p in self._select(members[1], member and (member,), line)
                                                for s in self._keep((p[0], True), self._parse, p, True)]
        return [node]

    def _keep(self, key, compute, *args):
        if key in self._kept or not KEEP_RUNS:
            return self._kept[key] if key in self._kept else compute(*args)
        return self._kept.setdefault(key, compute(*args))

    def _parse(self, piece, inner):
        """The statements of ``piece`` (``inner``: of a class body, parsed under an ``if 1:`` line
        placed just above it, so every line and column is the file's)."""
        text = self.flashfix_text[piece[0]:piece[1]]
        try:
            statements = ast.parse("\n" * (piece[2] - 1 - inner) + "if 1:\n" * inner + text, self._file).body
        except (SyntaxError, ValueError):
            raise _Whole() from None
        if inner:
            if len(statements) != 1 or not isinstance(statements[0], ast.If) or statements[0].orelse:
                raise _Whole()
            statements = statements[0].body
        for statement in statements:
            statement.flashfix_piece = text  # its text: semantic.find walks no scope that lacks a pattern's names
        return statements

    def _members(self, piece):
        """``(class node, [pieces of its body])`` for a class read in pieces of its body, else None."""
        text, masked, (start, end, line, head) = self.flashfix_text, self._masked, piece
        defines, depth = _HEAD.match(text, head), 0
        for m in _BRACKET.finditer(masked, defines.end(), end) if defines and defines.group(1) == "class" else ():
            if m.group() == ":" and not depth:  # the colon that ends the header
                newline = masked.find("\n", m.end(), end)
                body = _BODY.search(masked, newline + 1, end) if newline > 0 and not masked[m.end():newline].strip() else None
                members = body and _pieces(text, masked, newline + 1, end, body.group(1),
                                           line + text.count("\n", start, newline + 1))
                if not members:  # a body on the header's line, or none that can be cut
                    return None
                try:
                    (node,) = ast.parse("\n" * (line - 1) + text[start:members[0][0]] + body.group(1) + "pass\n",
                                        self._file).body
                except (SyntaxError, ValueError):
                    return None
                return (node, members) if isinstance(node, ast.ClassDef) else None
            depth += 1 if m.group() == "(" else -1
        return None


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
    """Within: every tree keeps the pieces it parsed and the reader its answers (``_locate._memo``), then
    all are forgotten (the doctor: many patches read the same few modules and distributions; an engine
    process parses piece by piece and keeps nothing)."""
    global KEEP_RUNS
    outer, KEEP_RUNS = KEEP_RUNS, True
    token = _locate._memo.set(_locate._memo.get() if outer else {})  # an outer kept() set one
    try:
        yield
    finally:
        _locate._memo.reset(token)
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


def walk(node):
    """``ast.walk``: every node under ``node``, breadth first, in the same order, without two generators per node."""
    todo = [node]
    for node in todo:
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, ast.AST):
                todo.append(value)
            elif isinstance(value, list):
                todo.extend([item for item in value if isinstance(item, ast.AST)])
        yield node


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_SCOPES = _DEFS + (ast.Lambda,)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def find_def(tree, qualname):
    """The ``FunctionDef``/``ClassDef`` that Python binds to ``qualname`` (``"Class.method"``) in ``tree``, or
    None if nothing there binds that name. Where a name is defined more than once in one scope, Python binds
    the last definition, and so does this; a name whose only binding is a definition inside
    ``if``/``try``/``with``/a loop is that definition, where it is bound at all (the loaded code is compared before
    anything is changed). ShapeError where what is bound cannot be read from the source: the last of several
    statements that bind the name is not a plain definition (one inside ``if``/``try``/..., an assignment, an
    import, ``del``...)."""
    parts, defs = qualname.split("."), getattr(tree, "flashfix_defs", None)
    if isinstance(tree, Module):
        if any(part not in tree.flashfix_text for part in parts) and unicodedata.is_normalized("NFKC", tree.flashfix_text):
            return None  # no definition can bind a name never spelled (in the NFKC form Python reads names)
        statements = tree.statements((parts[0],), parts[1] if len(parts) > 1 else None)  # a class: the member's pieces
        tree = ast.Module(body=[s for s in statements if _binds(s, parts[0])], type_ignores=[])
    node = tree
    for part in parts:
        node = _bound_def(node, part, qualname)
        if node is None:
            return None
    if defs is not None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        defs[node.name, _first_line(node)] = node  # while a probe holds it, rewrite() reads no second copy
    return node


def condition_of(tree, qualname):
    """``(line, condition)`` for the definition Python binds to ``qualname`` in ``tree`` (``find_def``'s): the line
    of its def, and that of the compound statement (``if``, ``try``, ``with``, a loop, ``match``) that holds the
    first definition on its path bound only under it (``C`` of ``C.m`` too), None where every one is a plain
    statement of its scope, bound whenever the module runs; None where nothing there defines ``qualname``."""
    if not isinstance(tree, ast.Module):
        return None
    parts = qualname.split(".")
    if isinstance(tree, Module):
        statements = tree.statements((parts[0],), parts[1] if len(parts) > 1 else None)
        tree = ast.Module(body=[s for s in statements if _binds(s, parts[0])], type_ignores=[])
    node, condition = tree, None
    for part in parts:
        found = _bound_def(node, part, qualname, held=True)
        if found is None:
            return None
        node, holder = found
        condition = condition if condition is not None or holder is None else holder.lineno
    return node.lineno, condition


def _binds(statement, name):
    return isinstance(statement, _DEFS) and statement.name == name or bool(_bindings(statement, name))


def _bound_def(scope, name, qualname, held=False):
    """The def of ``scope`` that binds ``name`` (``held``: ``(def, the statement of the scope that holds it, or
    None where it is one itself)``), None where none does."""
    bindings = []
    for statement in getattr(scope, "body", ()):
        if isinstance(statement, _DEFS) and statement.name == name:
            bindings.append((statement, None))
        else:
            bindings.extend((node, statement) for node in _bindings(statement, name))
    if not any(isinstance(node, _DEFS) for node, _ in bindings):
        return None  # imported or assigned here, not defined: no definition to read
    last, holder = bindings[-1]
    if holder is None or len(bindings) == 1:  # the only binding, a def under if/try/with/a loop: that def, if any is bound
        return (last, holder) if held else last
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
            found.extend(n for n in walk(node) if isinstance(n, ast.NamedExpr) and n.target.id == name)
            continue
        if (isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load)
                or isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name
                or isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == name
                or isinstance(node, ast.MatchMapping) and node.rest == name
                or isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names):
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
    words = (name, "import") if star else (name,)  # the pieces that can bind it, or import *
    for statement in tree.statements(words, False) if isinstance(tree, Module) else tree.body:
        if isinstance(statement, ast.If) and ast.unparse(statement.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            statement = ast.Module(statement.orelse, [])  # names imported for type checkers only
        if _bindings(statement, name):
            return True
        if star and not isinstance(statement, _DEFS):  # no def or class body holds a star import
            stars += [n for n in walk(statement) if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
    package = modname.split(".")[:None if (module_file(modname) or "").endswith("__init__.py") else -1]
    return any(binds(".".join((package[:len(package) + 1 - star.level] if star.level else []) + [star.module] * bool(
        star.module)), name, depth + 1) for star in stars)


def method_calls(node, attr):
    """Every call ``<expr>.attr(...)`` inside ``node``."""
    return [n for n in walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def name_calls(node, name):
    """Every call ``name(...)`` inside ``node``."""
    return [n for n in walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def keywords(call):
    return {kw.arg: kw.value for kw in call.keywords if kw.arg is not None}


# --- recompiling one function -------------------------------------------------------------

def marker(site):
    """A statement that reports the rewritten code's first run: a call of a plain function that
    the patched module holds as a global (``torch.compile`` traces it; see _registry.mark_ran)."""
    call = ast.Expr(ast.Call(ast.Name(MARK_NAME, ast.Load()), [ast.Constant(site)], []))
    call.flashfix_marker = True
    return call


def statement_of(func_def, inner):
    """``(block, index)``: the innermost statement of ``func_def`` that contains node ``inner``."""
    for parent in walk(func_def):
        for block in (getattr(parent, field, None) for field in ("body", "orelse", "finalbody")):
            for index, child in enumerate(block if isinstance(block, list) else ()):
                if isinstance(child, ast.stmt) and any(n is inner for n in walk(child)) and not _contains_block(child, inner):
                    return block, index
    raise ShapeError("no statement of %s contains the node" % getattr(func_def, "name", "the function"))


def insert_before(func_def, inner, stmt):
    """Insert ``stmt`` before the statement of ``func_def`` that contains node ``inner``."""
    block, index = statement_of(func_def, inner)
    block.insert(index, ast.copy_location(stmt, block[index]))
    ast.fix_missing_locations(func_def)


def replace_node(root, old, new):
    """Put ``new`` where ``old`` is inside ``root`` (one place, by identity)."""
    for parent in walk(root):
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
    return any(n is inner for field in ("body", "orelse", "finalbody", "handlers")
               for child in getattr(stmt, field, None) or () for n in walk(child))


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
    code, line = func.__code__, func.__code__.co_firstlineno
    if tree is None:
        tree = parse_text(*function_source(func))
    if (found := getattr(tree, "flashfix_defs", {}).get((code.co_name, line))) is not None:
        return found  # the def a probe read from this very text
    for statement in tree.statements(line=line) if isinstance(tree, Module) else tree.body:  # the piece with its line
        for node in walk(statement):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
                if _first_line(node) == line or node.lineno == line:  # a decorated def too
                    return node
    raise ShapeError("cannot find the source of %s in %s" % (func.__qualname__, code.co_filename))


def _top_level_imports(tree):
    """Names bound by import statements of the module scope (inside if/try/with, not def/class); a
    ``Module`` keeps them (rewrite() compiles three times: the module is read once)."""
    if getattr(tree, "flashfix_imports", None) is not None:
        return tree.flashfix_imports
    statements = tree.statements(("import",), False) if isinstance(tree, Module) else tree.body  # no def is read
    names, stack = set(), [s for s in statements if not isinstance(s, _DEFS)]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*")
        elif not isinstance(node, _DEFS):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                stack.extend(getattr(node, field, None) or ())
    if isinstance(tree, Module):
        tree.flashfix_imports = names
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


def _compile(like, def_node, tree):
    """Compile ``def_node`` as the function ``like`` describes (``_like``): same file, lines, ``__future__``
    flags, free variables, global/local bindings and private-name mangling."""
    node = copy.copy(def_node)  # shallow: the body is compiled as it is, never changed (a deep copy of a
    node.decorator_list, node.returns, args = [], None, copy.copy(def_node.args)  # long function costs megabytes)
    node.args = args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    bare = lambda a: a and ast.arg(a.arg, None, **{k: getattr(a, k, None) for k in a._attributes})  # noqa: E731
    args.posonlyargs, args.args, args.kwonlyargs = ([bare(a) for a in v] for v in (args.posonlyargs, args.args, args.kwonlyargs))
    args.vararg, args.kwarg = bare(args.vararg), bare(args.kwarg)
    parts = like.qualname.split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-2] != "<locals>" else None
    if owner is not None:  # keep private-name mangling and the __class__ cell of zero-arg super()
        body = [ast.ClassDef(name=owner, bases=[], keywords=[], body=[node], decorator_list=[], type_params=[])]
        fetch = "%s.__dict__[%r]" % (owner, mangled(owner, node.name))  # a private ``def __m`` binds ``_Owner__m``
    else:
        body = [node]
        fetch = node.name
    bound = owner or node.name  # the name the scaffold binds: a global in the original unless free there
    outer_args = [v for v in like.freevars or () if v != "__class__"]
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
    for n in walk(module):
        if not hasattr(n, "lineno") or n.lineno is None:
            ast.copy_location(n, def_node)
    ast.fix_missing_locations(module)
    namespace = {}
    exec(compile(module, like.filename, "exec", flags=like.flags & FUTURE_FLAGS, dont_inherit=True), namespace)
    if outer_args:
        built = namespace["__flashfix_outer__"](*([None] * len(outer_args)))
    else:
        built = eval(fetch, namespace)
    new = getattr(built, "__func__", built).__code__
    if like.freevars is not None and new.co_freevars != like.freevars:
        raise ShapeError("free variables differ after recompiling %s: %s, loaded %s"
                         % (like.qualname, new.co_freevars, like.freevars))
    changes = {"co_name": def_node.name, "co_flags": (new.co_flags & ~CO_NESTED) | (like.flags & CO_NESTED)}
    if hasattr(new, "co_qualname"):  # Python 3.11+
        changes["co_qualname"] = like.co_qualname
    return new.replace(**changes)


# What a recompiled function keeps of the loaded one: its ``__qualname__`` (the scaffold's class), its code's
# qualified name, file and flags (``__future__`` features, CO_NESTED), and free variables (None: as compiled).
Like = namedtuple("Like", "qualname co_qualname filename flags freevars")


def _like(func):
    code = func.__code__
    return Like(func.__qualname__, getattr(code, "co_qualname", func.__qualname__), code.co_filename, code.co_flags,
                code.co_freevars)


def _future_flags(tree):
    """The ``__future__`` compiler flags a module's ``from __future__ import`` statements turn on."""
    import __future__

    flags = 0
    for statement in tree.statements(("__future__",), False) if isinstance(tree, Module) else tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
            for alias in statement.names:
                flags |= getattr(getattr(__future__, alias.name, None), "compiler_flag", 0)
    return flags & FUTURE_FLAGS


def rewrite(func, edit, touches=None):
    """New code objects for ``func`` after ``edit(def_node)`` (which edits in place and may insert
    ``marker(site)`` statements). Returns ``(code_with_marker, code_without)``.

    The function's source is read now and recompiled unedited first: unless that gives the very code object
    tree that is loaded (bytecode, constants, names, nested code, flags), nothing is done (ShapeError): the
    file was edited after import, or someone else already changed the function. ShapeError also when ``edit``
    refuses. ``touches(def_node)``: the nodes ``edit`` replaces, so that only they are copied (``copy_paths``)."""
    tree = parse_text(*function_source(func))
    return _rewrite(_like(func), _def_node(func, tree), tree, edit, touches, func.__code__)[1:]


def rewrite_ahead(tree, qualname, def_node, edit, touches=None):
    """``rewrite()`` from a module's source alone, before the module runs: ``(unedited, marked, plain)`` for the
    function ``qualname`` (a module's function or a class's method: no free variables but ``__class__``),
    whose def is ``def_node`` in ``tree``. The caller compares ``unedited`` with the code loaded later
    (``code_difference``) before it uses the other two, as ``rewrite`` does at once."""
    if "<locals>" in qualname:
        raise ShapeError("%s is defined inside a function: it is rewritten once loaded" % qualname)
    like = Like(qualname, qualname, tree.flashfix_origin, _future_flags(tree), None)
    return _rewrite(like, def_node, tree, edit, touches, None)


def rewrite_edited(func, tree, edited, original):
    """``rewrite()``'s ``(marked, plain)`` for ``func`` from ``edited``, its def node once edited (a series of
    patches: ``_registry.compose``), where ``tree`` is its module's source, which must compile to ``original``
    (the release's code: the function may run another patch's code now)."""
    return _rewrite(_like(func), _def_node(func, tree), tree, None, None, original, edited)[1:]


def _rewrite(like, original, tree, edit, touches, loaded, edited=None):
    unedited = _compile(like, original, tree)
    problem = loaded is not None and code_difference(unedited, loaded)
    if problem:
        raise ShapeError(
            "the source of %s on disk differs from the loaded code (edited after import, or already patched): %s"
            % (like.qualname, problem)
        )
    text, origin = tree.flashfix_text, tree.flashfix_origin  # the text already read, not a second copy
    if edited is not None:
        node = edited
    else:
        node = copy.deepcopy(original) if touches is None else copy_paths(original, touches(original))
        edit(node)
    rendered = render_edit(text, original, node, origin)  # compiled from the text ``flashfix diff`` shows
    del original, node, text  # a long function's trees are megabytes: free them before compiling again
    return unedited, _compile(like, rendered.tree(rendered.MARKED), tree), _compile(like, rendered.tree(rendered.PLAIN), tree)


def copy_paths(root, nodes):
    """``root`` for an edit that replaces ``nodes``: they, what holds them and its lists are copied, the rest shared."""
    def visit(node):
        new = {f: [visit(v) if isinstance(v, ast.AST) else v for v in value] if isinstance(value, list) else visit(value)
               for f, value in ast.iter_fields(node) if isinstance(value, (list, ast.AST))}
        if id(node) in wanted or not all(all(map(operator.is_, v, getattr(node, f))) if isinstance(v, list)
                                         else v is getattr(node, f) for f, v in new.items()):
            (node := copy.copy(node)).__dict__.update(new)
        return node
    wanted = {id(n) for n in nodes}
    return visit(root)


def render_edit(text, original, edited, origin=None):
    """The function ``original`` (a def node of the module source ``text``) once edited into
    ``edited``, as source text (``_render.render``: ``rewrite`` compiles it, ``flashfix diff`` prints it)."""
    from flashfix.core import render as _render

    return _render.render(text, original, edited, origin)
