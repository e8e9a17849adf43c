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
_MAX_INDENT = 8  # definitions are indexed up to this indentation (a deeper class body: whole parse)


class _LinePattern:
    """A pattern matched at the starts of lines (its group 1 begins the line), searched for
    as newline + pattern, which the regular expression engine finds far faster than ``^``."""

    def __init__(self, body):
        self.first, self.rest = re.compile(body), re.compile("\n" + body)

    def finditer(self, text, pos=0):
        """Matches on the lines that start at ``pos`` (a line start) or later."""
        if pos == 0:
            first = self.first.match(text)
            if first is not None:
                yield first
        yield from self.rest.finditer(text, max(pos - 1, 0))


_STARTS = _LinePattern(r"([ ]{0,%d})(@|async\b|def\b|class\b)" % _MAX_INDENT)
_NAMED = re.compile(r"(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_][A-Za-z0-9_]*)(?!\w)")
_TAB_INDENT = _LinePattern(r"([ ]*)\t")
_CLASS_HEADER = re.compile(r"class[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*(\([^#'\"\\\n]*\))?[ \t]*:[ \t]*(?:#[^\n]*)?$", re.M)
_FIRST_STATEMENT = re.compile(r"(?:[ ]*(?:#[^\n]*)?\n)*([ ]*)[^ \n]")
_COLUMN_ZERO = _LinePattern(r"([^ \n#])")


def _scan(text):
    """``(starts, ends, literals)``: where every string literal and comment starts and ends
    (sorted), and the ``(start, end)`` of the literals that span lines; raises _Doubt when
    the text cannot be scanned for sure. Comments and literals are skipped left to right, as
    the tokenizer does, so a quote or ``#`` is only ever seen where a literal or comment starts."""
    starts, ends, literals = [], [], []
    search, find, end = _QUOTE_OR_HASH.search, text.find, len(text)
    pos = 0
    while True:
        found = search(text, pos)
        if found is None:
            return starts, ends, literals
        start = found.start()
        char = text[start]
        if char == "#":
            pos = find("\n", start)
            if pos < 0:
                pos = end
            starts.append(start)
            ends.append(pos)
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
        starts.append(start)
        ends.append(pos)
        if find("\n", start, pos) >= 0:
            literals.append((start, pos))


def _is_fstring(text, quote_at):
    begin = quote_at
    while begin > 0 and text[begin - 1] in _PREFIX and quote_at - begin < 3:
        begin -= 1
    return any(c in "fFtT" for c in text[begin:quote_at])


def _brackets(text, begin, end):
    return (text.count("(", begin, end) + text.count("[", begin, end) + text.count("{", begin, end)
            - text.count(")", begin, end) - text.count("]", begin, end) - text.count("}", begin, end))


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
        self.span_starts, self.span_ends, self.literals = _scan(text)
        self.literal_starts = [start for start, _ in self.literals]
        if "\t" in text:
            for tab in _TAB_INDENT.finditer(text):
                if not self.in_literal(tab.start(1)):
                    raise _Doubt("a tab in indentation")
        self.starts = []
        line, counted = 1, 0
        for match in _STARTS.finditer(text):
            offset = match.start(1)
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
                elif named and word == "async":
                    kind = "async"
            self.starts.append(_Start(offset, line, len(match.group(1)), kind, name))
        self.top = [s for s in self.starts if s.indent == 0]
        self._statements = None

    def in_literal(self, offset):
        i = bisect.bisect_right(self.literal_starts, offset) - 1
        return i >= 0 and offset < self.literals[i][1]

    def in_span(self, offset):
        i = bisect.bisect_right(self.span_starts, offset) - 1
        return i >= 0 and offset < self.span_ends[i]

    def line_end(self, offset):
        end = self.text.find("\n", offset)
        return len(self.text) if end < 0 else end

    def line_of(self, offset):
        return self.text.count("\n", 0, offset) + 1

    def _statements_from(self, pos, search):
        """The offsets, in order, of the lines from ``search`` on that start a statement at
        column 0: outside literals, brackets and backslash continuations (no bracket is open
        at ``pos``)."""
        text, starts, ends = self.text, self.span_starts, self.span_ends
        depth, k = 0, bisect.bisect_left(starts, pos)
        for match in _COLUMN_ZERO.finditer(text, search):
            offset = match.start(1)
            if self.in_literal(offset):
                continue
            while k < len(starts) and starts[k] < offset:  # the code up to here, less literals and comments
                depth += _brackets(text, pos, starts[k])
                pos = max(pos, ends[k])
                k += 1
            depth += _brackets(text, pos, offset)
            pos = offset
            if depth < 0 or text[offset] == "\\":
                raise _Doubt("unbalanced brackets")
            if depth == 0 and not (offset >= 2 and text[offset - 2] == "\\" and not self.in_span(offset - 2)):
                yield offset

    def statements(self):
        """Sorted offsets of every line that starts a statement at column 0."""
        if self._statements is None:
            self._statements = list(self._statements_from(0, 0))
        return self._statements

    def next_statement(self, offset):
        """The first column-0 statement after the line of the statement at ``offset`` (where a
        top-level definition started there ends), or the end of the text."""
        if self._statements is not None:
            i = bisect.bisect_right(self._statements, self.line_end(offset))
            return self._statements[i] if i < len(self._statements) else len(self.text)
        return next(self._statements_from(offset, self.line_end(offset) + 1), len(self.text))


def _lookup(starts, name):
    """Index in ``starts`` of the first definition called ``name``; None if none is."""
    for i, start in enumerate(starts):
        if start.kind == "?":
            raise _Doubt("a definition whose name the scan cannot read")
        if start.name == name and start.kind != "@":
            return i
    return None


def _first(starts, i):
    """The index of the first decorator of ``starts[i]`` (``i`` itself if it has none)."""
    while i > 0 and starts[i - 1].kind == "@":
        i -= 1
    return i


def _parse(index, origin, begin, line, stop, wrap):
    """The statements of ``text[begin:stop]``, parsed at their own lines and columns; for an
    indented block (``wrap``), as the body of an ``if`` on the line above."""
    if wrap:
        if line < 2:
            raise _Doubt("an indented block on the first line")
        source = "\n" * (line - 2) + "if 1:\n" + index.text[begin:stop]
    else:
        source = "\n" * (line - 1) + index.text[begin:stop]
    try:
        body = ast.parse(source, filename=origin or "<unknown>").body
    except (SyntaxError, ValueError) as exc:
        raise _Doubt("a block does not parse alone: %s" % (exc,)) from None
    if wrap:
        if len(body) != 1 or not isinstance(body[0], ast.If):
            raise _Doubt("an indented block is more than one block")
        body = body[0].body
    return body


def _parse_def(index, origin, starts, i, end, wrap):
    """The def/class node of ``starts[i]``, parsed alone (with its decorators, up to the next
    start at its level or ``end``)."""
    first = starts[_first(starts, i)]
    stop = starts[i + 1].offset if i + 1 < len(starts) else end
    want = starts[i]
    body = _parse(index, origin, first.offset, first.line, stop, wrap)
    node = body[0] if body else None
    if not (isinstance(node, _DEF_KINDS) and node.name == want.name and node.lineno == want.line
            and node.col_offset == want.indent):
        raise _Doubt("the block of %s is not that definition alone" % want.name)
    return node


def _class_scope(index, start):
    """``(indentation, starts, end)`` of the top-level class at ``start``: the definitions
    directly in its body, and where the class ends. _Doubt unless they are certain."""
    text = index.text
    header_end = index.line_end(start.offset)
    header = _CLASS_HEADER.match(text, start.offset, header_end)
    if header is None:
        raise _Doubt("a class header on more than one line, or with a body on the same line")
    bases = header.group(1) or ""
    if any(bases.count(a) != bases.count(b) for a, b in ("()", "[]", "{}")):
        raise _Doubt("a class header with unbalanced brackets")
    end = index.next_statement(start.offset)
    first = _FIRST_STATEMENT.match(text, header_end + 1, end)
    if first is None or not first.group(1):
        raise _Doubt("no indented class body")
    indent = len(first.group(1))
    if indent > _MAX_INDENT:
        raise _Doubt("a class body indented deeper than the index")
    inner = [s for s in index.starts if start.offset < s.offset < end and s.indent == indent]
    return indent, inner, end


# --- definitions parsed when first read -----------------------------------------------------------


_KNOWN = frozenset(("name", "lineno", "col_offset"))  # what the scan sets on a deferred node


class _Deferred:  # its methods go into each deferred node type (an ast type takes no mixin)
    """A def/class node whose location the scan knows for sure (its name, kind, line and
    column are set) and whose other fields are parsed when first read: a probe that only
    asks whether a definition exists, or reads one definition of several it looked up,
    parses nothing more. Copies (``copy``, ``deepcopy``, ``pickle``) are plain nodes."""

    def __getattribute__(self, attr):
        if attr in _FIELDS and attr not in _KNOWN:
            return _parsed_fields(self)[attr]
        return object.__getattribute__(self, attr)

    def __setattr__(self, attr, value):
        if attr in _FIELDS and attr not in _KNOWN:
            _parsed_fields(self)[attr] = value
        else:
            object.__setattr__(self, attr, value)

    def __reduce__(self):
        state = dict(_parsed_fields(self))
        state.update((name, object.__getattribute__(self, name)) for name in _KNOWN)
        return type(self).__bases__[0], (), state


def _parsed_fields(node):
    """The fields of deferred ``node``, parsing its block the first time."""
    state = object.__getattribute__(node, "__dict__")
    fields = state.get("_flashfix_parsed")
    if fields is None:
        load, module, parts = state["_flashfix_load"]
        try:
            real = load()
        except _Doubt:  # the block does not parse alone: take it from the whole text
            real = walk_defs(module, parts)
        base = type(node).__bases__[0]
        if not (type(real) is base and real.name == state["name"] and real.lineno == state["lineno"]
                and real.col_offset == state["col_offset"]):
            raise RuntimeError("flashfix: the scan of %s located %s wrongly" % (module.flashfix_origin, state["name"]))
        fields = state["_flashfix_parsed"] = {k: v for k, v in vars(real).items() if k not in _KNOWN}
        del state["_flashfix_load"]
    return fields


def _deferred_type(base):
    namespace = {name: getattr(_Deferred, name) for name in ("__getattribute__", "__setattr__", "__reduce__", "__doc__")}
    namespace["__module__"] = __name__
    return type(base.__name__, (base,), namespace)


_FIELDS = frozenset(f for base in _DEF_KINDS for f in base._fields + base._attributes)
_DEFERRED = {"def": _deferred_type(ast.FunctionDef), "async": _deferred_type(ast.AsyncFunctionDef),
             "class": _deferred_type(ast.ClassDef)}


def _deferred(start, load, module, parts):
    """A deferred def/class node for ``start``; ``load()`` parses it (_Doubt: ``module``'s
    whole tree is walked through ``parts`` instead)."""
    node = _DEFERRED[start.kind].__new__(_DEFERRED[start.kind])
    state = object.__getattribute__(node, "__dict__")
    state.update(name=start.name, lineno=start.line, col_offset=start.indent, _flashfix_load=(load, module, parts))
    return node


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
                return self._find(parts)
            except _Doubt:
                pass
        return walk_defs(self, parts)

    def around(self, line):
        """An ``ast.Module`` of the statements of the smallest block of text that holds
        ``line`` (one method of a class; else a top-level definition with the module code
        that follows it), parsed alone; None where that is not certain."""
        if self._body is not None:
            return None
        try:
            return ast.Module(body=self._around(line), type_ignores=[])
        except _Doubt:
            return None

    def module_statements(self):
        """The module's top-level statements other than its definitions (what
        ``_source._top_level_imports`` reads), parsed without the definitions; the whole body
        where that is not certain."""
        if self._body is None:
            try:
                return self._module_statements()
            except _Doubt:
                pass
        return self.body

    def _index_(self):
        if self._index is None:
            self._index = _Index(self.flashfix_text)
        return self._index

    def _find(self, parts):
        index, origin = self._index_(), self.flashfix_origin
        top = index.top
        i = _lookup(top, parts[0])
        if i is None:
            return None
        if len(parts) == 1:
            return _deferred(top[i], lambda: _parse_def(index, origin, top, i, len(index.text), wrap=False), self, parts)
        if top[i].kind == "class":
            try:
                indent, inner, end = _class_scope(index, top[i])
                j = _lookup(inner, parts[1])
                if j is None:
                    return None
                if len(parts) == 2:
                    return _deferred(inner[j], lambda: _parse_def(index, origin, inner, j, end, wrap=True), self, parts)
                return walk_defs(_parse_def(index, origin, inner, j, end, wrap=True), parts[2:])
            except _Doubt:
                pass
        return walk_defs(_parse_def(index, origin, top, i, len(index.text), wrap=False), parts[1:])

    def _runs(self, starts, end):
        """``[(first, definition, stop)]``: each definition of ``starts`` (indices) with its
        decorators, and where its block stops."""
        runs, first = [], None
        for i, start in enumerate(starts):
            if start.kind == "?":
                raise _Doubt("a definition whose name the scan cannot read")
            if first is None:
                first = i
            if start.kind != "@":
                runs.append((first, i, starts[i + 1].offset if i + 1 < len(starts) else end))
                first = None
        if first is not None:
            raise _Doubt("decorators without a definition")
        return runs

    def _real_top(self, index):
        statements = set(index.statements())
        return [start for start in index.top if start.offset in statements]  # not an @ continuing a line

    def _around(self, line):
        index, origin = self._index_(), self.flashfix_origin
        top = self._real_top(index)
        runs = self._runs(top, len(index.text))
        held = [run for run in runs if top[run[0]].line <= line]
        if not held:
            stop = top[0].offset if top else len(index.text)
            return _parse(index, origin, 0, 1, stop, wrap=False)
        first, i, stop = held[-1]
        if top[i].kind == "class" and line > top[i].line:
            try:
                indent, inner, end = _class_scope(index, top[i])
                inner_runs = self._runs(inner, end)
                mine = [run for run in inner_runs if inner[run[0]].line <= line]
                if mine and line < index.line_of(end):
                    j_first, j, j_stop = mine[-1]
                    body = _parse(index, origin, inner[j_first].offset, inner[j_first].line, j_stop, wrap=True)
                    if body and isinstance(body[0], _DEF_KINDS) and body[0].lineno == inner[j].line:
                        return body
            except _Doubt:
                pass
        body = _parse(index, origin, top[first].offset, top[first].line, stop, wrap=False)
        if not (body and isinstance(body[0], _DEF_KINDS) and body[0].lineno == top[i].line):
            raise _Doubt("a block is not its definition")
        return body

    def _module_statements(self):
        index, origin, text = self._index_(), self.flashfix_origin, self.flashfix_text
        top = self._real_top(index)
        runs = self._runs(top, len(text))
        found = _parse(index, origin, 0, 1, top[0].offset if top else len(text), wrap=False)
        for first, i, stop in runs:
            after = index.next_statement(top[i].offset)  # where the definition ends
            if after < stop:
                found += _parse(index, origin, after, 1, stop, wrap=False)
        return found


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
