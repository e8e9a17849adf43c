"""Parse only the definitions a probe looks up, not whole engine files.

A probe asks for a few functions (``Class.method``) of modules of thousands of lines, and
``ast.parse`` of a whole file is most of what the doctor and a patch decision cost, in time and
in memory. ``Module`` is an ``ast.Module`` for a module's text that parses on demand:

* ``find(qualname)`` (what ``_source.find_def`` calls) parses only the block of text that
  holds the definition: a top-level ``def``/``class`` with its decorators, and for
  ``Class.method`` only that method.
* anything else (``.body``, ``ast.walk``, ``compile``, ``ast.unparse``) parses the whole text,
  once, as ``ast.parse`` would.

The blocks come from a cheap scan of the text (no tokenizer): string literals and comments
are skipped with regular expressions, so a line that starts a definition is found only
outside them, and a definition's block runs to the next line that starts a definition at the
same indentation. A block is parsed at its own line numbers and columns, so its nodes are the
very nodes that a whole-file parse gives (``ast.dump`` with attributes is equal; tested on
every definition of the engines' files). The answer is taken only when the scan is certain;
whenever it is not (tabs or form feeds in indentation, a header or body it cannot read, a
block that does not parse to the definition expected, a non-ASCII name, ...), the whole text
is parsed and walked as before. A file that only a newer Python can parse, or that does not
parse at all, may still answer for the parts of it that parse.
"""

import ast
import bisect
import re
import sys

_DEF_KINDS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _Doubt(Exception):
    """The scan cannot answer for sure: parse the whole text."""


# --- the scan ---------------------------------------------------------------------------------

_QUOTE_OR_HASH = re.compile(r"""[#'"]""")
_LITERAL = {
    "'''": re.compile(r"'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''", re.S),
    '"""': re.compile(r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""', re.S),
    "'": re.compile(r"'[^'\\\n]*(?:\\.[^'\\\n]*)*'", re.S),
    '"': re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"', re.S),
}
_PREFIX = frozenset("rRbBuUfFtT")
_NESTED_FSTRINGS = sys.version_info >= (3, 12)  # PEP 701 (and 750): an f-string may hold its own quote
# a line that may start a definition (or a decorator), with its indentation
_STARTS = re.compile(r"^([ ]*)(@|async\b|def\b|class\b)", re.M)
_NAMED = re.compile(r"(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_][A-Za-z0-9_]*)(?!\w)")
_TAB_INDENT = re.compile(r"^[ ]*\t", re.M)
_CLASS_HEADER = re.compile(r"class[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*(\([^#'\"\\\n]*\))?[ \t]*:[ \t]*(?:#[^\n]*)?$", re.M)
_FIRST_STATEMENT = re.compile(r"(?:[ ]*(?:#[^\n]*)?\n)*([ ]*)[^ \n]")
_COLUMN_ZERO = re.compile(r"^[^ \n#]", re.M)


def _multiline_literals(text):
    """Sorted ``(start, end)`` of the string literals that span lines; raises _Doubt when the
    text cannot be scanned for sure. Comments and literals are skipped left to right, as the
    tokenizer does, so a quote or ``#`` is only ever seen where a literal or comment starts."""
    spans = []
    search, find, end = _QUOTE_OR_HASH.search, text.find, len(text)
    pos = 0
    while True:
        found = search(text, pos)
        if found is None:
            return spans
        start = found.start()
        char = text[start]
        if char == "#":
            pos = find("\n", start)
            if pos < 0:
                return spans
            continue
        quote = text[start:start + 3]
        if quote != char * 3:
            quote = char
        literal = _LITERAL[quote].match(text, start)
        if literal is None:
            raise _Doubt("an unterminated string literal")
        pos = literal.end()
        if _NESTED_FSTRINGS and "{" in text[start:pos] and _is_fstring(text, start):
            body = text[start:pos]
            if body.count("{") - 2 * body.count("{{") != body.count("}") - 2 * body.count("}}"):
                raise _Doubt("an f-string that may nest quotes")
        if find("\n", start, pos) >= 0:
            spans.append((start, pos))
        if pos >= end:
            return spans


def _is_fstring(text, quote_at):
    begin = quote_at
    while begin > 0 and text[begin - 1] in _PREFIX and quote_at - begin < 3:
        begin -= 1
    return any(c in "fFtT" for c in text[begin:quote_at])


class _Start:
    """A line that starts a definition or a decorator, outside string literals."""

    __slots__ = ("offset", "line", "indent", "kind", "name")

    def __init__(self, offset, line, indent, kind, name):
        self.offset, self.line, self.indent, self.kind, self.name = offset, line, indent, kind, name


class _Index:
    def __init__(self, text):
        if not text or "\r" in text or "\f" in text or "\0" in text or text[0] == "\ufeff" \
                or "barry_as_FLUFL" in text:
            raise _Doubt("characters the scan does not handle")
        self.text = text
        self.literals = _multiline_literals(text)
        self.literal_starts = [start for start, _ in self.literals]
        for tab in _TAB_INDENT.finditer(text):
            if not self.in_literal(tab.start()):
                raise _Doubt("a tab in indentation")
        self.starts = []
        line, counted = 1, 0
        for match in _STARTS.finditer(text):
            offset = match.start()
            if self.in_literal(offset):
                continue
            line += text.count("\n", counted, offset)
            counted = offset
            word = match.group(2)
            if word == "@":
                kind, name = "@", None
            else:
                named = _NAMED.match(text, match.end(1))
                kind, name = ("def", named.group(1)) if named else ("?", None)
                if named and text.startswith("class", match.end(1)):
                    kind = "class"
            self.starts.append(_Start(offset, line, len(match.group(1)), kind, name))
        self.top = [s for s in self.starts if s.indent == 0]

    def in_literal(self, offset):
        i = bisect.bisect_right(self.literal_starts, offset) - 1
        return i >= 0 and offset < self.literals[i][1]

    def line_end(self, offset):
        end = self.text.find("\n", offset)
        return len(self.text) if end < 0 else end


def _lookup(starts, name):
    """Index in ``starts`` of the first definition called ``name``; None if none is."""
    for i, start in enumerate(starts):
        if start.kind == "?":
            raise _Doubt("a definition whose name the scan cannot read")
        if start.name == name and start.kind != "@":
            return i
    return None


def _block(starts, i, end):
    """``(first offset, first line, end offset)`` of definition ``starts[i]`` with its decorators:
    up to the next start at its level, or ``end``."""
    first = i
    while first > 0 and starts[first - 1].kind == "@":
        first -= 1
    stop = starts[i + 1].offset if i + 1 < len(starts) else end
    return starts[first].offset, starts[first].line, stop


def _parse_block(index, origin, starts, i, end, wrap):
    """The def/class node of ``starts[i]``, parsed alone at its own lines and columns."""
    begin, line, stop = _block(starts, i, end)
    want = starts[i]
    if wrap:  # an indented block: parse it as the body of an ``if`` on the line above
        if line < 2:
            raise _Doubt("an indented definition on the first line")
        source = "\n" * (line - 2) + "if 1:\n" + index.text[begin:stop]
    else:
        source = "\n" * (line - 1) + index.text[begin:stop]
    try:
        body = ast.parse(source, filename=origin or "<unknown>").body
    except (SyntaxError, ValueError) as exc:
        raise _Doubt("the block of %s does not parse alone: %s" % (want.name, exc)) from None
    if wrap:
        body = body[0].body if body and isinstance(body[0], ast.If) else []
    node = body[0] if body else None
    if not (isinstance(node, _DEF_KINDS) and node.name == want.name and node.lineno == want.line
            and node.col_offset == want.indent):
        raise _Doubt("the block of %s is not that definition alone" % want.name)
    return node


def _class_scope(index, starts, i):
    """``(indentation, starts, end)`` of the body of the top-level class ``starts[i]``: the
    definitions directly inside it, and where its block ends. _Doubt unless its header and
    extent are certain."""
    text, start = index.text, starts[i]
    end = starts[i + 1].offset if i + 1 < len(starts) else len(text)
    header_end = index.line_end(start.offset)
    header = _CLASS_HEADER.match(text, start.offset, header_end)
    if header is None:
        raise _Doubt("a class header on more than one line, or with a body on the same line")
    bases = header.group(1) or ""
    if any(bases.count(a) != bases.count(b) for a, b in ("()", "[]", "{}")):
        raise _Doubt("a class header with unbalanced brackets")
    first = _FIRST_STATEMENT.match(text, header_end + 1, end)
    if first is None or not first.group(1):
        raise _Doubt("no indented class body")
    indent = len(first.group(1))
    # the class body runs to ``end`` only if no line in between starts at column 0 (outside
    # string literals): such a line ends the class, or continues an expression
    for line in _COLUMN_ZERO.finditer(text, header_end + 1, end):
        if not index.in_literal(line.start()):
            raise _Doubt("a line at column 0 inside the class's block")
    if i + 1 < len(starts) and starts[i + 1].kind == "@" and _continues(index, end):
        raise _Doubt("a line starting with @ may continue an expression")
    inner = [s for s in index.starts if start.offset < s.offset < end and s.indent == indent]
    return indent, inner, end


def _continues(index, offset):
    """Could the line at ``offset`` continue an expression (open brackets, a backslash)?"""
    text = index.text
    if offset >= 2 and text[offset - 2] == "\\":
        return True
    depth = 0
    for begin, end in _code_spans(text, offset):
        part = text[begin:end]
        depth += part.count("(") + part.count("[") + part.count("{")
        depth -= part.count(")") + part.count("]") + part.count("}")
    return depth != 0


def _code_spans(text, stop):
    """``(begin, end)`` of the text before ``stop`` outside string literals and comments."""
    search, find = _QUOTE_OR_HASH.search, text.find
    pos = 0
    while pos < stop:
        found = search(text, pos, stop)
        if found is None:
            yield pos, stop
            return
        start = found.start()
        yield pos, start
        if text[start] == "#":
            pos = find("\n", start)
            pos = stop if pos < 0 else pos
            continue
        quote = text[start:start + 3]
        if quote != text[start] * 3:
            quote = text[start]
        pos = _LITERAL[quote].match(text, start).end()


# --- the module ---------------------------------------------------------------------------------


class Module(ast.Module):
    """``ast.Module`` of ``text``, parsed on demand (see the module docstring)."""

    def __init__(self, text, origin=None):
        super().__init__(type_ignores=[])
        self.flashfix_text, self.flashfix_origin = text, origin
        self._index, self._body = None, None

    @property
    def body(self):
        if self._body is None:
            self._body = ast.parse(self.flashfix_text, filename=self.flashfix_origin or "<unknown>").body
        return self._body

    @body.setter
    def body(self, value):
        self._body = value

    def __reduce__(self):  # copy, deepcopy, pickle: a plain, whole ast.Module
        return ast.Module, (), {"body": self.body, "type_ignores": self.type_ignores}

    @property
    def parsed(self):
        """True once the whole text has been parsed."""
        return self._body is not None

    def find(self, qualname):
        """What ``_source.find_def(self, qualname)`` answers, parsing as little as it can."""
        parts = qualname.split(".")
        if self._body is None:
            try:
                node = self._find(parts)
            except _Doubt:
                node = False
            if node is not False:
                return node
        return walk_defs(self, parts)

    def _find(self, parts):
        if self._index is None:
            self._index = _Index(self.flashfix_text)
        index = self._index
        top = index.top
        i = _lookup(top, parts[0])
        if i is None:
            return None
        if len(parts) > 1 and top[i].kind == "class":
            try:
                indent, inner, end = _class_scope(index, top, i)
                j = _lookup(inner, parts[1])
                if j is None:
                    return None
                node = _parse_block(index, self.flashfix_origin, inner, j, end, wrap=True)
                return walk_defs(node, parts[2:])
            except _Doubt:
                pass
        node = _parse_block(index, self.flashfix_origin, top, i, len(index.text), wrap=False)
        return walk_defs(node, parts[1:])


def walk_defs(node, parts):
    """The def/class reached from ``node`` through ``parts`` (names of directly nested
    definitions, first match in body order), or None."""
    for part in parts:
        for child in getattr(node, "body", ()):
            if isinstance(child, _DEF_KINDS) and child.name == part:
                node = child
                break
        else:
            return None
    return node
