"""The text of an edited engine function: what ``flashfix diff`` shows and what the runtime compiles.

``render`` walks the installed and the edited def together and rewrites only the text that
differs (an expression, a statement, an item of a list or block, an ``elif`` branch), each changed
node by its ``flashfix_text`` (``flashfix.semantic``: the pattern's own text, each metavariable the
engine's text of its binding, with the pattern's comments: those on lines just above a statement, and
one after the node, put at the end of the line it ends), by its source when copied from the engine, else
by ``ast.unparse``; comments, quotes and line breaks elsewhere stay (an ``elif`` put before ``else:``
leaves the ``else`` block's text as it is). Where the pattern's comments cannot be placed so that the
text parses back, it is written again without them. The text must parse back to the edited AST, else
the whole function is written by ``ast.unparse``. Line numbers: an unchanged line keeps its own; the
k-th line written for a change reports as the k-th it replaces (at most the last), an inserted one
as the line it is put before.
"""

import ast
import bisect
import copy
import difflib
import itertools
import re

from flashfix.core.registry import ShapeError, first_line as _first_line  # (not from source, which imports this)

BLOCKS = ("body", "orelse", "finalbody")

MARKED, PLAIN = "marked", "plain"


class RenderError(ShapeError):
    """The edit cannot be written as source text."""


class _Up(Exception):
    """This node's change cannot be written alone: its parent is rewritten instead."""


def _lines(text, closed=False):
    """The lines of ``text`` with their endings, split on ``\\n`` only, as ``ast`` counts them (``closed``:
    the last one too ends in ``\\n``)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text + "\n" if closed and text and not text.endswith("\n") else text)


def _strip_markers(node):
    for parent in ast.walk(node):
        for field in BLOCKS:
            block = getattr(parent, field, None)
            if isinstance(block, list):
                block[:] = [s for s in block if not getattr(s, "flashfix_marker", False)]
    return node


def reindent(text, indent, strip=""):
    """``text`` with ``strip`` taken from (where there) and ``indent`` put before each non-blank line but the first."""
    first, *rest = text.split("\n")
    return "\n".join([first] + [indent + (line[len(strip):] if line.startswith(strip) else line) if line.strip()
                                else line for line in rest])


def parses_as(text, node):
    """Is ``text`` (later lines indented relative to the first) the source of ``node``?"""
    try:
        got = ast.parse(text).body if isinstance(node, ast.stmt) else ast.parse("f(%s\n)" % text).body[0].value.keywords \
            if isinstance(node, ast.keyword) else [ast.parse("(%s\n)" % text, mode="eval").body]
    except SyntaxError:
        return False
    return len(got) == 1 and equal(got[0], node)


def equal(a, b):
    """``ast.dump(a) == ast.dump(b)``, without writing the two dumps (a long function's are megabytes)."""
    pairs = [(a, b)]
    while pairs:
        x, y = pairs.pop()
        if x is y:  # a subtree the edit shares with the original (``_source.copy_paths``)
            continue
        x, y = (None if v == [] else v for v in (x, y))  # an empty list prints as nothing, like None
        if type(x) is not type(y) or isinstance(x, list) and len(x) != len(y):
            return False
        if isinstance(x, ast.AST):
            pairs.extend((getattr(x, f, None), getattr(y, f, None)) for f in x._fields)
        elif isinstance(x, list):
            pairs.extend(zip(x, y))
        elif repr(x) != repr(y):
            return False
    return True


_SLOTS = (ast.Call, ast.keyword, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Assign, ast.AnnAssign, ast.AugAssign,
          ast.Return, ast.Expr, ast.If, ast.While, ast.Assert)  # where any expression stands without brackets


def bracketed(text, node, parent, old):
    """``text`` of ``node`` put where ``old`` is in ``parent``: in brackets where ``ast.unparse`` puts them."""
    if not isinstance(node, ast.expr) or not isinstance(old, ast.expr) or isinstance(parent, _SLOTS) and not (
            isinstance(parent, ast.Call) and parent.func is old):
        return text
    probe = copy.copy(parent)
    for field, value in ast.iter_fields(parent):
        setattr(probe, field, [node if v is old else v for v in value] if isinstance(value, list)
                else node if value is old else value)
    return "(%s)" % text if "(%s)" % ast.unparse(node) in ast.unparse(probe) else text


def _elif(node):
    return len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)


_NOTE = re.compile("\x00([^\x00]*)\x00")  # a comment to put at the end of the line it is on, once placed


def _note(comment):
    return "\x00%s\x00" % comment.replace("\x00", "")


def _template_comments(own):
    """``(lines above, trailing)``: the comment lines just above and the comment just after the template
    node that ``own`` (a ``flashfix_text`` of ``flashfix.core.matcher.build``) spells, in the pattern's text."""
    args = getattr(own, "args", ())
    if len(args) < 2 or not isinstance(args[0], str) or not hasattr(args[1], "end_lineno"):
        return [], None
    src, template = args[0], args[1]
    lines = _lines(src)
    if not (0 < template.lineno <= template.end_lineno <= len(lines)):
        return [], None
    last = lines[template.end_lineno - 1].encode("utf-8")[template.end_col_offset:].decode("utf-8", "replace")
    tail = re.match(r"[ \t]*(#[^\n]*)", last)
    above, k = [], template.lineno - 2
    while isinstance(template, ast.stmt) and k >= 0 and re.match(r"[ \t]*#", lines[k]) and not \
            lines[template.lineno - 1][:template.col_offset].strip():
        above.insert(0, lines[k].strip())
        k -= 1
    unmask = lambda t: t.replace("__ffx_n_", "$$$").replace("__ffx_1_", "$")  # matcher.MANY, matcher.ONE
    return [unmask(a) for a in above], unmask(tail.group(1).rstrip()) if tail else None


class Writer:
    """Offsets in the text of ``lines`` (``at``: of ``ast``'s line and UTF-8 column), and the
    changes ``(start, end, text)`` to it that turn an installed def into the edited one (``diff``)."""

    def __init__(self, lines, marked=True, comments=True):
        self.lines, self.src, self.starts = lines, "".join(lines), [0, *itertools.accumulate(map(len, lines))]
        self.marked, self.edits, self.floor = marked, [], len(self.src)  # floor: where the text replaced starts
        self.comments, self.noted = comments, False  # the comments written in a pattern's text go with its code

    def at(self, line, col):
        return self.starts[line - 1] + len(self.lines[line - 1].encode("utf-8")[:col].decode("utf-8", "replace"))

    def line_start(self, offset):
        return self.starts[bisect.bisect_right(self.starts, offset) - 1]

    def indent(self, offset, alone=False):
        """The indentation of ``offset``'s line (``alone``: _Up unless only it precedes ``offset``)."""
        if alone and self.src[self.line_start(offset):offset].strip():
            raise _Up()
        return _indent(self.src[self.line_start(offset):offset + 1])

    def span(self, node):
        if getattr(node, "end_lineno", None) is None:
            raise _Up()
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)

    def segment(self, start, end):
        return reindent(self.src[start:end], "", self.indent(start))

    def line_end(self, end):
        """The offset after the line that ``end`` ends (_Up if code follows it there)."""
        tail = re.match(r"[ \t]*(#[^\n]*)?\n", self.src[end:])
        if tail is None:
            raise _Up()
        return end + tail.end()

    def spell(self, node, sep=", "):
        """The text of ``node``, or of a list of nodes (joined by ``sep``), later lines indented
        relative to the first."""
        if not isinstance(node, list):
            own = getattr(node, "flashfix_text", None)
            if own is not None:
                text = own(self.spell, self.marked)
                if self.comments:  # the pattern's own comments: lines just above a statement, one after it
                    above, tail = _template_comments(own)
                    text = "".join(c + "\n" for c in above) + text + (_note(tail) if tail else "")
                    self.noted = self.noted or bool(above)
                return text
            try:
                text = self.segment(*self.span(node))
            except _Up:
                return ast.unparse(node)
            return text if parses_as(text, node) else ast.unparse(node)
        texts = [self.spell(n) for n in node]
        try:
            spans = [self.span(n) for n in node]
        except _Up:
            return sep.join(texts)
        if not spans or any(t != self.segment(*s) for t, s in zip(texts, spans)) or not all(
                re.fullmatch(r"(\s|#[^\n]*)*(,|and|or)?(\s|#[^\n]*)*", self.src[z:a]) for (_, z), (a, _) in zip(spans, spans[1:])):
            return sep.join(texts)
        start, indent = spans[0][0], self.indent(spans[0][0])
        above = self.starts.index(self.line_start(start)) - 1
        while sep == "\n" and above >= 0 and self.starts[above] >= self.floor and self.lines[above].startswith(
                indent + "#"):  # comments just above the statements, inside the text replaced, go with them
            start, above = self.starts[above] + len(indent), above - 1
        return self.segment(start, spans[-1][1])  # contiguous: the engine's own text

    def put(self, start, end, text):
        """Text ``start``..``end`` becomes ``text``; a comment noted in it (``_note``) goes at the end of its
        line: of the text's line, or of the installed line where the text ends."""
        parts = _NOTE.split(text)
        text, notes = "", []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                text += part
            else:
                notes.append((len(text), part))
                self.noted = True
        for at, comment in sorted(notes, reverse=True):
            nl = text.find("\n", at)
            if nl >= 0:
                text = text[:nl] + "  " + comment + text[nl:]
            elif re.match(r"[ \t]*(#[^\n]*)?(\n|$)", self.src[end:]):  # the text ends its line
                text = text + "  " + comment
            else:
                line_end = self.src.find("\n", end)
                self.edits.append((line_end, line_end, "  " + comment))
        self.edits.append((start, end, text))

    def replace(self, old, new, parent=None):
        start, end = self.span(old)
        self.floor = start
        text = bracketed(self.spell(new), new, parent, old)
        if isinstance(old, ast.If) and self.src.startswith("elif", start) and text.startswith("if"):
            text = "el" + text
        self.put(start, end, reindent(text, self.indent(start)))

    def diff(self, old, new, top=False, parent=None):
        if equal(old, new):
            return
        mark = len(self.edits)
        try:
            if isinstance(old, ast.arguments) and isinstance(new, ast.arguments):
                return self.parameters(old, new)
            if type(old) is not type(new) or [v for _, v in ast.iter_fields(old) if not isinstance(v, (ast.AST, list))] \
                    != [v for _, v in ast.iter_fields(new) if not isinstance(v, (ast.AST, list))]:
                raise _Up()
            fields = [("func", old.func, new.func), ("args", old.args + old.keywords, new.args + new.keywords)] \
                if isinstance(old, ast.Call) else [(f, v, getattr(new, f)) for f, v in ast.iter_fields(old)]
            for field, value, other in fields:
                if isinstance(old, ast.If) and field == "orelse" and (_elif(old) or _elif(new)):
                    self.orelse(old, new)
                elif isinstance(value, list):  # items come and go in statement blocks and in these
                    self.items(value, other, " %s " % type(old.op).__name__.lower() if isinstance(old, ast.BoolOp)
                               else ", " if isinstance(old, (ast.Call, ast.List, ast.Tuple, ast.Set)) else None, old)
                elif isinstance(value, ast.AST):
                    self.diff(value, other, parent=old)
        except _Up:
            if top:  # the def itself: written whole (render)
                raise
            del self.edits[mark:]
            self.replace(old, new, parent)
            return
        own = getattr(new, "flashfix_text", None)
        if own is not None and self.comments and len(self.edits) > mark:  # a pattern's node, changed in parts:
            above, tail = _template_comments(own)  # its comments go where its text is
            try:
                start, end = self.span(old)
                if tail:
                    self.put(end, end, _note(tail))
                if above:
                    indent = self.indent(start, True)
                    self.put(start - len(indent), start - len(indent), "".join(indent + c + "\n" for c in above))
                    self.noted = True
            except _Up:  # not on a line of its own: the comments are left out
                pass

    def parameters(self, old, new):
        """Keyword-only parameters added after a def's others (a ``Rule``'s ``parameters``), written after its last
        one on that line; any other change of a signature: _Up (the def is written whole)."""
        k, same = len(old.kwonlyargs), lambda f: equal(getattr(old, f), getattr(new, f))
        if not all(map(same, ("posonlyargs", "args", "vararg", "kwarg", "defaults"))) or old.kwarg is not None or not (
                equal(old.kwonlyargs, new.kwonlyargs[:k]) and equal(old.kw_defaults, new.kw_defaults[:k])):
            raise _Up()
        present = [n for n in old.posonlyargs + old.args + old.defaults + old.kwonlyargs + old.kw_defaults + [old.vararg]
                   if n is not None]
        if not present:
            raise _Up()
        end = max(self.span(n)[1] for n in present)
        slash = re.match(r"\s*,\s*/", self.src[end:]) if not (old.args or old.vararg or old.kwonlyargs) else None
        end += slash.end() if slash else 0
        added = ", ".join("%s=%s" % (a.arg, self.spell(d)) for a, d in zip(new.kwonlyargs[k:], new.kw_defaults[k:]))
        self.put(end, end, ", %s%s" % ("" if old.vararg or old.kwonlyargs else "*, ", added))

    def orelse(self, old, new):
        """An ``elif`` branch put before another (else the ``if`` statement is written again)."""
        value, branch = old.orelse, new.orelse[0] if _elif(new) else None
        if branch and value and not _elif(old) and old.body:  # ``else:`` becomes ``elif ...:`` then ``else:``
            start = self.span(value[0])[0]
            between = re.compile(r"^([ \t]*)else[ \t]*:", re.M).search(self.src, self.span(old.body[-1])[1], start)
            if between is None or not re.match(r"[ \t]*(#[^\n]*)?\n", self.src[between.end():]):
                raise _Up()  # ``else: x`` on one line, or no ``else`` found where it must be
            inner, at = self.indent(start, True), between.start()
            self.put(at, at, "%selif %s:\n%s" % (between.group(1), self.spell(branch.test), "".join(
                inner + reindent(self.spell(s), inner) + "\n" for s in branch.body)))
            self.items(value, branch.orelse)
            return
        if not (_elif(old) and branch):
            raise _Up()
        if list(map(ast.dump, branch.orelse)) == list(map(ast.dump, value)):
            start = self.span(value[0])[0]
            inner = self.indent(self.span(value[0].body[0])[0], True)
            self.put(start, start, "elif %s:\n%s%s" % (self.spell(branch.test), "".join(
                inner + reindent(self.spell(s), inner) + "\n" for s in branch.body), self.indent(start, True)))
        else:
            self.items(value, new.orelse)

    def items(self, old, new, sep=None, parent=None):
        stmts = isinstance((old + new or [None])[0], ast.stmt)
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, *[list(map(ast.dump, v)) for v in (old, new)], autojunk=False).get_opcodes():
            olds, news = old[i1:i2], new[j1:j2]
            plain = [n for n in news if not getattr(n, "flashfix_marker", False)]
            prev, nxt = old[i1 - 1] if i1 else None, old[i2] if i2 < len(old) else None
            if tag == "equal":
                continue
            if olds and len(plain) == len(olds):  # pairs; a one-time marker goes before its statement
                k = 0
                for n in news:
                    if n in plain:
                        self.diff(olds[k], n, parent=parent)
                        k += 1
                    else:
                        self.insert([n], *((None, olds[k]) if k < len(olds) else (olds[-1], None)), stmts, sep)
            elif not (stmts or sep):
                raise _Up()
            elif not olds:
                self.insert(news, prev, nxt, stmts, sep)
            elif not news:
                start, end = self.span(olds[0])[0], self.span(olds[-1])[1]
                if stmts:
                    self.put(start - len(self.indent(start, True)), self.line_end(end), "")
                elif prev or nxt:
                    self.put(*((start, self.span(nxt)[0]) if nxt else (self.span(prev)[1], end)), "")
                else:
                    raise _Up()
            else:
                start, end = self.span(olds[0])[0], self.span(olds[-1])[1]
                indent = self.indent(start, stmts)
                self.put(start, end, ("\n" + indent if stmts else sep).join(reindent(self.spell(n), indent) for n in news))

    def insert(self, news, prev, nxt, stmts, sep):
        if stmts:
            start = self.span(nxt or prev)[0]
            indent = self.indent(start, True)
            at = start - len(indent) if nxt else self.line_end(self.span(prev)[1])
            self.put(at, at, "".join(indent + reindent(self.spell(n), indent) + "\n" for n in news))
            return
        texts = [self.spell(n) for n in news]
        start, end = self.span(prev)  # _Up without one: the list is written again
        indent = self.indent(start)
        tail = re.match(r"[ \t]*(,?)[ \t]*(#[^\n]*)?\n", self.src[end:])
        if tail and sep == ", " and not self.src[self.line_start(start):start].strip():  # one item a line: so these
            at, texts = (end + tail.end(), [indent + reindent(t, indent) + ",\n" for t in texts]) if tail.group(1) \
                else (end, [",\n" + indent + reindent(t, indent) for t in texts])
        else:
            at, texts = end, [sep + reindent(t, indent) for t in texts]
        self.put(at, at, "".join(texts))

    def text(self, first, last):
        """Lines ``first``..``last`` with the changes made, and the installed line each reports as."""
        out, line_map, position = [], [], self.starts[first - 1]

        def emit(text, line_at):
            for k, part in enumerate(re.findall(r"[^\n]*\n|[^\n]+", text)):
                if not out or out[-1].endswith("\n"):
                    line_map.append(line_at(k))
                out.append(part)

        def line(offset):
            return bisect.bisect_right(self.starts, offset)

        for start, end, text in sorted(self.edits, key=lambda e: e[:2]):
            if start < position:
                raise RenderError("overlapping changes")
            emit(self.src[position:start], lambda k, base=line(position): base + k)
            emit(text, lambda k, a=line(start), z=line(max(start, end - 1)): min(a + k, z, last))
            position = end
        emit(self.src[position:self.starts[last]], lambda k, base=line(position): base + k)
        return "".join(out), line_map


class Rendered:
    """The installed function's text (``before``, from the file ``origin``'s line ``start``, decorators
    included) and its text once edited, with and without the one-time marker (``text(MARKED/PLAIN)``)."""

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
        """The def node parsed from ``text(version)``, line numbers those of ``line_map``: what the runtime compiles."""
        return _parse_function(self._texts[version], self._maps[version])


def _indent(line):
    """The indentation of ``line`` as Python reads it: a form feed in it resets the column."""
    return re.match(r"[ \t\f]*", line).group(0).rpartition("\f")[2]


def _parse_function(text, line_map):
    indented = bool(_indent(_lines(text)[0] if text else ""))  # then parsed inside an ``if 1:`` block
    tree = ast.parse(("if 1:\n" + text) if indented else text)
    holder = tree.body[0].body if indented else tree.body
    if len(holder) != 1 or not isinstance(holder[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise RenderError("the rendered text is not one function definition")
    node = holder[0]

    def at(line):
        return line_map[min(max(line - 1 - indented, 0), len(line_map) - 1)]

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
        return equal(_parse_function(text, line_map), expected)
    except (SyntaxError, RenderError, IndexError):
        return False


def render(text, original, edited, origin=None):
    """``Rendered`` for the def node ``original`` (parsed from the module source ``text``) edited into
    ``edited`` (a copy changed by a patch's edit; statements made by ``_source.marker``: the marker)."""
    start, end = _first_line(original), original.end_lineno
    own = re.compile(r"(?:[^\n]*\n){%d}((?:[^\n]*\n){%d}[^\n]*\n?)" % (start - 1, end - start)).match(text).group(1)
    lines = [""] * (start - 1) + _lines(own, closed=True)  # only the def's own lines are split, the others are ""
    before = "".join(lines[start - 1:end])
    indent = _indent(lines[start - 1])
    texts, maps, whole = {}, {}, []
    taken = [(b, i, s) for p in ast.walk(edited) for f in BLOCKS for b in [getattr(p, f, None)] if isinstance(b, list)
             for i, s in enumerate(b) if getattr(s, "flashfix_marker", False)]  # put back after PLAIN: no copy of a long def
    try:
        for version in (MARKED, PLAIN):
            expected = edited if version == MARKED else _strip_markers(edited)
            try:
                for comments in (True, False):  # the patterns' comments in place, else left out
                    try:
                        writer = Writer(lines, version == MARKED, comments)
                        writer.diff(original, expected, top=True)
                        candidate, line_map = writer.text(start, end)
                        if not _same(candidate, line_map, expected):
                            raise RenderError("the text does not parse back to the edit")
                        break
                    except Exception:
                        if not writer.noted:  # no comment was put: it fails without them too
                            raise
            except Exception:  # a change the installed text cannot hold (the whole function below is checked too)
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
    finally:
        for block, index, statement in taken:  # (each where PLAIN took it out)
            block[index:index] = [] if any(s is statement for s in block) else [statement]
    return Rendered(origin, start, before, texts, maps, tuple(whole))
