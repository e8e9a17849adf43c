"""The text of an edited engine function: what ``flashfix diff`` shows and what the runtime compiles.

A patch edits a function as an AST. ``render`` turns that edit back into source text: the
installed function's own lines, with only the statements the edit changed replaced by
``ast.unparse`` of their edited form (indented as the statements they replace), and
statements the edit inserted put in as new lines. Unchanged lines keep their text, comments
included. ``_source.rewrite`` compiles the new code from this text (``Rendered.tree``), and
``flashfix diff`` prints this text, so the diff is the code that runs, not a description of it.

Each rendered text is parsed back and compared with the edited AST before it is used: if the
line-level splice cannot express the edit (a statement sharing its line with another, an
``elif`` chain rewritten, a string that indentation would change), the whole function is
rendered with ``ast.unparse`` instead, and if even that does not give the edited AST the
rewrite is refused (``ShapeError``).

Line numbers: in the compiled code, an unchanged line keeps its line number in the installed
file, so tracebacks through the patched function show the installed file's lines; the k-th
line written for a replaced statement reports as the k-th line of the statement it replaces
(the last one when there are more), and an inserted statement as the line of the statement
it precedes. ``render`` breaks long statements at the same places as the engines' own
formatting mostly does, so most lines report as the installed line that reads the same.
"""

import ast
import copy
import difflib
import re
from collections import namedtuple

BLOCKS = ("body", "orelse", "finalbody")

MARKED, PLAIN = "marked", "plain"


class RenderError(Exception):
    """The edit cannot be written as source text (``_source`` turns it into a ShapeError)."""


def _lines(text):
    """The lines of ``text`` with their endings, split on ``\\n`` only, as ``ast`` counts them."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def _first_line(stmt):
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", ())])


def _header(stmt):
    """``stmt`` without its blocks: equal headers mean only the blocks can differ."""
    shallow = copy.copy(stmt)
    for field in BLOCKS + ("handlers", "cases"):
        if hasattr(shallow, field):
            setattr(shallow, field, [])
    return ast.dump(shallow)


def _strip_markers(node):
    for parent in ast.walk(node):
        for field in BLOCKS:
            block = getattr(parent, field, None)
            if isinstance(block, list):
                block[:] = [s for s in block if not getattr(s, "flashfix_marker", False)]
    return node


# One change of the text: lines ``first``..``last`` (1-based, inclusive; ``last == first - 1``
# for an insertion before ``first``) become ``new`` lines, each reported at ``at`` (a line of
# the installed file).
_Splice = namedtuple("_Splice", "first last new at")


class _Unsplicable(Exception):
    pass


class _Splicer:
    def __init__(self, lines):
        self.lines = lines
        self.splices = []

    def _line(self, number):
        return self.lines[number - 1]

    def _starts_line(self, stmt):
        """Indentation of ``stmt``'s first line, if ``stmt`` is the first thing on it."""
        first = _first_line(stmt)
        line = self._line(first)
        if first != stmt.lineno:  # a decorated def: the decorator opens the line
            indent = line[: len(line) - len(line.lstrip())]
            if not line.lstrip().startswith("@"):
                raise _Unsplicable()
            return indent
        prefix = line.encode("utf-8")[: stmt.col_offset].decode("utf-8", "replace")
        if prefix.strip():
            raise _Unsplicable()
        return prefix

    def _ends_line(self, stmt):
        line = self._line(stmt.end_lineno).rstrip("\r\n").encode("utf-8")
        rest = line[stmt.end_col_offset:].decode("utf-8", "replace").strip()
        if rest and not rest.startswith("#"):
            raise _Unsplicable()

    def _text(self, stmts, indent, old_first=None):
        out = []
        for index, stmt in enumerate(stmts):
            elif_ = (index == 0 and old_first is not None and isinstance(stmt, ast.If)
                     and self._line(old_first.lineno).lstrip().startswith("elif"))
            # a statement that the source spreads over lines is spread again, like it was
            spread = old_first is not None and type(stmt) is type(old_first) and old_first.end_lineno > old_first.lineno
            out.extend(line + "\n" for line in _format(stmt, indent, "el" if elif_ else "", spread))
        return out

    def replace(self, old, new):
        """Lines of the statements ``old`` (consecutive) become ``new``."""
        indent = self._starts_line(old[0])
        self._ends_line(old[-1])
        first = _first_line(old[0])
        self.splices.append(_Splice(first, old[-1].end_lineno, self._text(new, indent, old[0]), first))

    def insert(self, new, before=None, after=None):
        if before is not None:
            indent = self._starts_line(before)
            first = _first_line(before)
            self.splices.append(_Splice(first, first - 1, self._text(new, indent), first))
        else:
            indent = self._starts_line(after)
            self._ends_line(after)
            line = after.end_lineno + 1
            self.splices.append(_Splice(line, line - 1, self._text(new, indent), after.end_lineno))

    def block(self, old, new):
        a, b = [ast.dump(s) for s in old], [ast.dump(s) for s in new]
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                continue
            if tag == "replace" and i2 - i1 == j2 - j1:
                for o, n in zip(old[i1:i2], new[j1:j2]):
                    self.statement(o, n)
            elif i1 == i2:
                if i1 < len(old):
                    self.insert(new[j1:j2], before=old[i1])
                else:
                    self.insert(new[j1:j2], after=old[-1])
            elif j1 == j2:  # a deletion: the statements' whole lines go
                self._starts_line(old[i1])
                self._ends_line(old[i2 - 1])
                first = _first_line(old[i1])
                self.splices.append(_Splice(first, old[i2 - 1].end_lineno, [], first))
            else:
                unmarked = [s for s in new[j1:j2] if not getattr(s, "flashfix_marker", False)]
                if len(unmarked) == i2 - i1 and all(type(o) is type(n) for o, n in zip(old[i1:i2], unmarked)):
                    # markers put before statements that changed otherwise: insert each marker,
                    # then splice inside the statement that follows it
                    pending, index = [], i1
                    for stmt in new[j1:j2]:
                        if getattr(stmt, "flashfix_marker", False):
                            pending.append(stmt)
                            continue
                        if pending:
                            self.insert(pending, before=old[index])
                            pending = []
                        self.statement(old[index], stmt)
                        index += 1
                    if pending:
                        self.insert(pending, after=old[i2 - 1])
                else:
                    self.replace(old[i1:i2], new[j1:j2])

    def statement(self, old, new):
        """``old`` became ``new``: splice inside it where only its blocks changed."""
        if type(old) is not type(new) or _header(old) != _header(new) or not all(
                len(getattr(old, f, None) or ()) == len(getattr(new, f, None) or ())
                and all(_header(o) == _header(n) for o, n in zip(getattr(old, f, None) or (), getattr(new, f, None) or ()))
                for f in ("handlers", "cases")):
            self.replace([old], [new])
            return
        for field in BLOCKS:
            if isinstance(getattr(old, field, None), list):
                self.block(getattr(old, field), getattr(new, field))
        for field in ("handlers", "cases"):
            for o, n in zip(getattr(old, field, None) or (), getattr(new, field, None) or ()):
                self.block(o.body, n.body)


WIDTH = 100  # a statement longer than this is broken over lines (call arguments, and/or operands)


def _operand(node):
    text = ast.unparse(node)
    if isinstance(node, (ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)):
        return "(" + text + ")"
    return text


def _targets(assign):
    """``a, b = `` rather than ``ast.unparse``'s ``(a, b) = ``."""
    parts = []
    for target in assign.targets:
        if isinstance(target, ast.Tuple) and len(target.elts) > 1:
            parts.append(", ".join(ast.unparse(e) for e in target.elts))
        else:
            parts.append(ast.unparse(target))
    return " = ".join(parts) + " = "


def _broken(prefix, value, indent):
    """``prefix + value`` over several lines, or None when ``value`` is not a call or and/or."""
    inner = indent + "    "
    if isinstance(value, ast.Call):
        items = [ast.unparse(a) for a in value.args]
        items += [("%s=" % k.arg if k.arg else "**") + ast.unparse(k.value) for k in value.keywords]
        return ([indent + prefix + ast.unparse(value.func) + "("] + [inner + item + "," for item in items]
                + [indent + ")"])
    if isinstance(value, ast.BoolOp):
        word = "and" if isinstance(value.op, ast.And) else "or"
        operands = [_operand(v) for v in value.values]
        return ([indent + prefix + "("] + [inner + operands[0]] + [inner + word + " " + o for o in operands[1:]]
                + [indent + ")"])
    return None


def _format(stmt, indent, keyword_prefix="", spread=False):
    """Source lines of ``stmt`` at ``indent``: ``ast.unparse``, with a statement longer than
    ``WIDTH`` (or any, with ``spread``) broken at its call arguments or and/or operands, and
    ``if`` blocks laid out statement by statement so that their statements are broken too. Whatever this writes
    is parsed back and compared with the edit before use (``render``)."""
    lines = ast.unparse(stmt).split("\n")
    if isinstance(stmt, ast.Assign) and len(lines) == 1:
        lines = [_targets(stmt) + ast.unparse(stmt.value)]
    if len(lines) == 1 and not spread and len(indent) + len(keyword_prefix) + len(lines[0]) <= WIDTH:
        return [indent + keyword_prefix + lines[0]]
    if isinstance(stmt, ast.If):
        out = [indent + keyword_prefix + "if " + ast.unparse(stmt.test) + ":"]
        for child in stmt.body:
            out.extend(_format(child, indent + "    "))
        if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If):
            out.extend(_format(stmt.orelse[0], indent, "el"))
        elif stmt.orelse:
            out.append(indent + "else:")
            for child in stmt.orelse:
                out.extend(_format(child, indent + "    "))
        return out
    if len(lines) == 1 and not keyword_prefix:
        broken = None
        if isinstance(stmt, ast.Expr):
            broken = _broken("", stmt.value, indent)
        elif isinstance(stmt, ast.Assign):
            broken = _broken(_targets(stmt), stmt.value, indent)
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            broken = _broken("return ", stmt.value, indent)
        if broken is not None:
            return broken
    return [indent + keyword_prefix + line for line in lines]


class Rendered:
    """The installed function's text (``before``) and its text once edited, with and without
    the one-time marker statement (``text(MARKED)`` / ``text(PLAIN)``); ``start`` is the
    installed file's line of the first line (decorators included), ``origin`` its file."""

    MARKED, PLAIN = MARKED, PLAIN

    def __init__(self, origin, start, before, texts, line_maps, whole):
        self.origin, self.start, self.before = origin, start, before
        self._texts, self._maps = texts, line_maps
        self.whole = whole  # which versions had to be rendered whole (ast.unparse of the function)

    def text(self, version=PLAIN):
        return self._texts[version]

    def line_map(self, version=PLAIN):
        """For each line of ``text(version)``: the installed file's line it reports as."""
        return list(self._maps[version])

    def tree(self, version=PLAIN):
        """The def node parsed from ``text(version)``, line numbers those of ``line_map``.
        This is what the runtime compiles."""
        return _parse_function(self._texts[version], self._maps[version])


def _indent(line):
    """The indentation of ``line`` as Python reads it: a form feed in it resets the column."""
    return re.match(r"[ \t\f]*", line).group(0).rpartition("\f")[2]


def _parse_function(text, line_map):
    first = _lines(text)[0] if text else ""
    indented = bool(_indent(first))
    source = ("if 1:\n" + text) if indented else text
    tree = ast.parse(source)
    holder = tree.body[0].body if indented else tree.body
    if len(holder) != 1 or not isinstance(holder[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise RenderError("the rendered text is not one function definition")
    node = holder[0]
    shift = 1 if indented else 0

    def at(line):
        index = line - 1 - shift
        return line_map[min(max(index, 0), len(line_map) - 1)]

    for n in ast.walk(node):
        if getattr(n, "lineno", None) is not None:
            n.lineno = at(n.lineno)
            if getattr(n, "end_lineno", None) is not None:
                n.end_lineno = max(at(n.end_lineno), n.lineno)
                if n.end_lineno == n.lineno and (n.end_col_offset or 0) < (n.col_offset or 0):
                    n.end_col_offset = n.col_offset  # lines that report as one installed line
    return node


def _same(text, line_map, expected):
    try:
        parsed = _parse_function(text, line_map)
    except (SyntaxError, RenderError, IndexError):
        return False
    return ast.dump(parsed) == ast.dump(expected)


def _splice(lines, start, end, original, edited):
    splicer = _Splicer(lines)
    if _header(original) != _header(edited):
        raise _Unsplicable()
    splicer.block(original.body, edited.body)
    out, line_map = [], []
    number = start
    for splice in sorted(splicer.splices, key=lambda s: (s.first, s.last)):
        if splice.first < number:
            raise _Unsplicable()  # overlapping changes
        out.extend(lines[number - 1:splice.first - 1])  # the unchanged lines before it
        line_map.extend(range(number, splice.first))
        out.extend(splice.new)
        if splice.last >= splice.first:  # a replacement: line k reports as installed line first + k, at most last
            line_map.extend(min(splice.first + k, splice.last) for k in range(len(splice.new)))
        else:  # an insertion: as the line it is put before (or after)
            line_map.extend([splice.at] * len(splice.new))
        number = splice.last + 1
    out.extend(lines[number - 1:end])
    line_map.extend(range(number, end + 1))
    return out, line_map


def render(text, original, edited, origin=None):
    """``Rendered`` for the def node ``original`` (parsed from the module source ``text``)
    edited into ``edited`` (a copy of it, changed in place by a patch's edit; statements made
    by ``_source.marker`` are the one-time marker)."""
    lines = _lines(text)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    start, end = _first_line(original), original.end_lineno
    before = "".join(lines[start - 1:end])
    indent = _indent(lines[start - 1])
    texts, maps, whole = {}, {}, []
    for version in (MARKED, PLAIN):
        expected = edited if version == MARKED else _strip_markers(copy.deepcopy(edited))
        try:
            out, line_map = _splice(lines, start, end, original, expected)
            candidate = "".join(out)
            if not _same(candidate, line_map, expected):
                raise _Unsplicable()
        except _Unsplicable:
            whole.append(version)
            unparsed = ast.unparse(expected).split("\n")
            line_map = [min(start + i, end) for i in range(len(unparsed))]
            for prefix in (indent, ""):
                candidate = "".join(prefix + line + "\n" for line in unparsed)
                if _same(candidate, line_map, expected):
                    break
            else:
                raise RenderError("the edited %s cannot be written back as source" % getattr(original, "name", "function"))
        texts[version], maps[version] = candidate, line_map
    return Rendered(origin, start, before, texts, maps, tuple(whole))
