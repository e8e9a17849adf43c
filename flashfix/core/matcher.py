"""The matcher behind ``flashfix.semantic``: patterns, matching, and what a declaration derives from its
hunks (the probe, the runtime changes, the diff plan). A process imports it only when it decides something
(``flashfix.core.lazy``); ``flashfix.semantic`` builds a declaration's ``Declaration`` and ``Rule`` here
(``declaration_of``, ``rule_of``) when it is first used."""
# Derived from the one declaration:
# * the probe: a ``fixed_if``/``after`` form present -> fixed-upstream; the module absent, or the
#   function absent and the word ``absent_unless_mentioned`` nowhere (without it: unknown-shape, a
#   move looks the same), or ``context`` says so -> not-affected; ``before`` once in each hunk
#   (``where`` binding, ``constraints`` met), no @property-like wrapper, every name the new code
#   reads a local, a builtin or a global the module (or ``needs``) binds -> patch (``check`` named:
#   decided at import); else unknown-shape, naming where the nearest candidate differs;
# * the runtime changes and ``flashfix diff``'s plan: first the ``needs`` globals, then each hunk's
#   function recompiled from its own source with its nodes replaced (``_registry.rewrite``; the
#   text spells them as the pattern does, a one-time marker at ``$RAN`` or before the edited
#   statement), or, for a class or the module (``function`` None), the changed statements run there
#   and what they bind is set on it (``SetAttr``): inside a top-level ``if``/``try``/``with``, only
#   they, where the statements next to them are bound to what they bind (else not-affected: the
#   condition did not hold); the imported module is asked again for each name the new code reads,
#   and refuses the patch whole with the probe's reason.
# A fix that is not a code edit (flashinfer_patch: a per-process name table) is a plain ``Patch``
# with its own ``probe``/``prepare``/``plan``. Matching uses the standard library's ``ast``
# (ast-grep-py costs 12-15 ms and 5.4 MiB to import, libcst 250-320 ms and 19 MiB; the
# engine-process goal is at most 1 MiB).

import ast
import builtins
import copy
import functools
import importlib
import re
import sys
import textwrap

from flashfix.core import locate as _locate
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, Shape, function_at  # noqa: F401
from flashfix.core.source import NotBound, ShapeError, walk  # noqa: F401
from flashfix.semantic import MANY, ONE, Block, lacks, layouts, needed_globals, parse_pattern  # defined where they
# outlive this module (``Backport`` checks its patterns without it)
_DESCRIPTOR = re.compile(r"(^|\.)(property|cached_property|setter|getter|deleter)$")  # they bind no function


def pattern(text, keyword="pattern"):
    """The AST of a pattern snippet: an expression, a statement, or a ``Block`` of statements."""
    src, body = parse_pattern(text, keyword)
    node = Block(body) if len(body) > 1 else body[0].value if isinstance(body[0], ast.Expr) else body[0]
    node.flashfix_src = src  # what ``build`` spells its nodes with
    return node


def _meta(node, prefix=ONE):
    """The metavariable ``node`` spells (``$$$X`` also as a statement or a ``**`` keyword), or None."""
    if prefix == MANY and (isinstance(node, ast.Expr) or isinstance(node, ast.keyword) and node.arg is None):
        node = node.value
    return node.id[len(prefix):] if isinstance(node, ast.Name) and node.id.startswith(prefix) else None


def _splat(node):
    return isinstance(node, ast.Starred) or isinstance(node, ast.keyword) and node.arg is None


def _bind(name, value, b):
    old = b.setdefault(name, value) if name != "_" else value
    if isinstance(old, list):
        return isinstance(value, list) and len(old) == len(value) and all(map(_equal, old, value))
    return old is value or _equal(old, value)


def _equal(x, y):
    return x == y if isinstance(x, str) else match(x, y, {})


def match(p, t, b):
    """Does pattern ``p`` match node ``t``? Extends the bindings ``b`` (on failure it may be
    left partly extended: callers pass a copy)."""
    name = _meta(p)
    if name is not None:
        return isinstance(t, ast.expr) and not _splat(t) and _bind(name, t, b)
    if type(p) is not type(t):
        return False
    if isinstance(p, ast.Call):
        return _match_call(p, t, b)
    for field in p._fields:
        if field in ("ctx", "kind", "type_comment"):
            continue
        pv, tv = getattr(p, field, None), getattr(t, field, None)
        if isinstance(pv, list):
            if not isinstance(tv, list) or not _match_list(pv, tv, b):
                return False
        elif isinstance(pv, ast.AST):
            if not isinstance(tv, ast.AST) or not match(pv, tv, b):
                return False
        elif isinstance(pv, str) and pv.startswith(ONE):
            if not isinstance(tv, str) or not _bind(pv[len(ONE):], tv, b):
                return False
        elif type(pv) is not type(tv) or pv != tv:
            return False
    return True


def _match_list(ps, ts, b):
    if not ps:
        return not ts
    many = _meta(ps[0], MANY)
    for n in range(len(ts) + 1) if many is not None else (None,):
        trial = dict(b)
        if many is not None:
            ok = not any(_splat(t) for t in ts[:n]) and _bind(many, ts[:n], trial) and _match_list(ps[1:], ts[n:], trial)
        else:
            ok = bool(ts) and match(ps[0], ts[0], trial) and _match_list(ps[1:], ts[1:], trial)
        if ok:
            b.update(trial)
            return True
    return False


def _match_call(p, t, b):
    given = {kw.arg: kw for kw in t.keywords}  # None in it: the code passes **kwargs, what it passes cannot be told,
    rests = [m for m in (_meta(kw, MANY) for kw in p.keywords if kw.arg is None) if m is not None]
    splat = rests[1] if len(rests) > 1 else None  # unless a second ``**$$$X`` takes it, to pass it on as it is
    if None in given and splat is None or not match(p.func, t.func, b) or not _match_list(p.args, t.args, b):
        return False
    for kw in p.keywords:
        if kw.arg is not None and (kw.arg not in given or not match(kw.value, given[kw.arg].value, b)):
            return False
    named = {k.arg for k in p.keywords if k.arg is not None}
    extra = [kw for kw in t.keywords if kw.arg is not None and kw.arg not in named]
    if not (_bind(rests[0], extra, b) if rests else not extra):
        return False
    return splat is None or _bind(splat, [kw for kw in t.keywords if kw.arg is None], b)


def find(p, scopes, given=None):
    """``[(node, bindings)]`` for every node inside ``scopes`` that ``p`` matches, each binding
    starting from ``given``. A scope whose text (``flashfix_piece``: read from a module in pieces)
    does not spell every name ``p`` spells holds no match: it is not walked."""
    found, needs, kind = [], getattr(p, "flashfix_needs", None), None if isinstance(p, Block) or _meta(p) else type(p)
    if needs is None:  # names, attributes, keywords: the code spells each one a match has (its names are NFKC)
        needs = p.flashfix_needs = {w for n in walk(p) if not isinstance(n, ast.Constant) for w in words(n)
                                    if w.isidentifier() and not w.startswith((ONE, MANY))}
    for scope in [s for s in scopes if all(w in getattr(s, "flashfix_piece", w) for w in needs)]:
        # a module read in pieces: only the pieces that spell the pattern's words are parsed (a block pattern
        # needs the statements around, the whole body)
        body = scope.statements(tuple(needs)) if isinstance(scope, _source.Module) and needs and not isinstance(
            p, Block) else getattr(scope, "body", None)
        for node in [scope] + [n for s in body if not isinstance(s, _source._DEFS) for n in walk(s)] if (
                isinstance(scope, (ast.ClassDef, ast.Module))) else walk(scope):
            if isinstance(p, Block):  # consecutive statements of each block of ``node``
                for block in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                    for i in range(len(block) if isinstance(block, list) else 0):
                        # an earlier patch's one-time marker between the statements is not the engine's code
                        picked, end = [], i
                        while end < len(block) and len(picked) < len(p.body) and not _marker(block[i]):
                            picked += [] if _marker(block[end]) else [block[end]]
                            end += 1
                        b = dict(given or {})
                        if len(picked) == len(p.body) and all(match(x, y, b) for x, y in zip(p.body, picked)):
                            found.append((Block(block[i:end], (block, i)), b))
                continue
            if kind is not None and type(node) is not kind:  # what match() would refuse first
                continue
            b = dict(given or {})
            if match(p, node, b) and all(node is not n for n, _ in found):
                found.append((node, b))
    return found


def _put(root, old, new):
    """``new`` where ``old`` is inside ``root``; a ``Block`` match becomes ``new``'s statements."""
    if not isinstance(old, Block):
        return _source.replace_node(root, old, new)
    block, index = old.at  # the markers it spans stay, ahead of the new statements
    block[index:index + len(old.body)] = [s for s in old.body if _marker(s)] + [
        ast.copy_location(s, old.body[0]) for s in new.body]


def _marker(statement):
    return getattr(statement, "flashfix_marker", False)


def _spliced(item, b):
    """The statements or items a list entry of a template stands for: ``$$$X``, or a
    statement ``$X`` bound to a statement (``$RAN``, the one-time marker); else None."""
    many = _meta(item, MANY)
    if many is not None:
        return b[many]
    one = _meta(item.value) if isinstance(item, ast.Expr) else None
    return [b[one]] if one is not None and isinstance(b.get(one), ast.stmt) else None


def build(template, b, at=None, src=None):
    """A new node: ``template`` with its metavariables replaced by copies of their bindings; its own nodes
    get the position of ``at`` when given, and their spelling (``flashfix_text``, for ``_render``): the
    pattern's own text, each metavariable written as the engine's text of its binding."""
    name = _meta(template)
    if name is not None:  # the binding, in the template's load/store context (``$X = f($X)``)
        new = copy.deepcopy(b[name])
        if hasattr(new, "ctx") and hasattr(template, "ctx"):
            new.ctx = template.ctx
        return new
    src = getattr(template, "flashfix_src", src)
    node = copy.copy(template)
    for field, value in ast.iter_fields(template):
        if isinstance(value, list):
            out = []
            for item in value:
                spliced = _spliced(item, b) if isinstance(item, ast.AST) else None
                out += copy.deepcopy(spliced) if spliced is not None else [
                    build(item, b, at, src) if isinstance(item, ast.AST) else item]
            setattr(node, field, out)
        elif isinstance(value, ast.AST):
            setattr(node, field, build(value, b, at, src))
        elif isinstance(value, str) and value.startswith(ONE):
            setattr(node, field, b[value[len(ONE):]])
    if src is not None and getattr(template, "end_lineno", None) is not None:
        node.flashfix_text = functools.partial(_spell, src, template, b)
    if at is not None and "lineno" in node._attributes:
        ast.copy_location(node, at)
    return node


def _spell(src, template, b, spell, marked):
    """``template``'s text in the pattern ``src``, each metavariable written as ``spell`` of its
    binding (``$RAN``: the marker, or no line unless ``marked``), later lines indented relative to the first."""
    from flashfix.core import render as _render

    text = _render.Writer(_render._lines(src))
    first, last = text.at(template.lineno, template.col_offset), text.at(template.end_lineno, template.end_col_offset)
    names = {text.at(n.lineno, n.col_offset): (n, p) for p in walk(template) for n in ast.iter_child_nodes(p)
             if isinstance(n, ast.Name)}
    out, position = [], first
    for found in re.compile(r"(\*\*)?(__ffx_1_|__ffx_n_)(\w+)").finditer(src, first, last):
        start, end, name = found.start(), found.end(), found.group(3)
        node, parent = names.get(found.start(2), (None, None))
        value = ([b[name]] if marked else []) if name == "RAN" else b[name]
        if isinstance(value, list):
            statements = isinstance(parent, ast.Expr)
            piece = spell(value, "\n" if statements else " %s " % type(parent.op).__name__.lower()
                          if isinstance(parent, ast.BoolOp) else ", ")
            if not value and statements:  # the line goes
                start, end = text.line_start(start), src.find("\n", end) + 1 or len(src)
            elif not value:  # and a separator next to it
                after = re.match(r"\s*(,|and\b|or\b)\s*", src[end:])
                before = re.search(r"(,|\band|\bor)\s*$", src[first:start])
                start, end = (start, end + after.end()) if after else (start - len(before.group(0)) if before else start, end)
        else:  # an attribute name, or an expression in brackets where the pattern binds tighter
            piece = value if isinstance(value, str) else _render.bracketed(spell(value), value, parent, node)
        out += [src[position:start], _render.reindent(piece, text.indent(start))]
        position = end
    out.append(src[position:last])
    return _render.reindent("".join(out), "", text.indent(first))


def _text(value):
    if isinstance(value, (Block, list)):  # statements, or items
        return ("; " if isinstance(value, Block) else ", ").join(_text(v) for v in getattr(value, "body", value))
    return ast.unparse(value) if isinstance(value, ast.AST) else str(value)


def _show(node):  # a pattern as the declaration spells it
    return (getattr(node, "flashfix_src", None) or _text(node)).replace(MANY, "$$$").replace(ONE, "$")


_WORD_FIELDS = {ast.FunctionDef: ("name",), ast.AsyncFunctionDef: ("name",), ast.ClassDef: ("name",),
                ast.ImportFrom: ("module",), ast.alias: ("name", "asname"), ast.Name: ("id",),
                ast.Attribute: ("attr",), ast.keyword: ("arg",), ast.arg: ("arg",)}


def words(node):
    """The identifiers and strings that ``node`` itself spells (not its children's): a def or class name, an
    imported module or name, a name, an attribute, a keyword or argument name, a string constant."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) and node.value else []
    return [w for w in (getattr(node, f) for f in _WORD_FIELDS.get(type(node), ())) if w]


_BODIES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)


def _target(tree, qualname):
    """The def or class ``qualname`` names in ``tree`` (a module's AST), the module itself for None."""
    return (_source.find_def(tree, qualname) if qualname else tree) if isinstance(tree, ast.Module) else None


class Rule:
    """One hunk of a declaration: ``before`` -> ``after`` inside ``module``'s ``function``, the
    compiled patterns and what is derived from them (the keywords: ``Backport``'s docstring)."""

    def __init__(self, module, function, before, after, where=None, inside=None, absent_unless_mentioned=None,
                 fixed=None, buggy=None, fixed_if=None, constraints=None, every=False, parameters=()):
        self.module, self.function, self.name = module, function, function or module
        self.parameters = tuple(parameters or ())  # ((name, default), ...): keyword-only parameters it adds
        self.word, self.every, self.derivable = absent_unless_mentioned, every, fixed_if in (None, False)  # ``after``
        self._texts = before, after, where, inside, [fixed_if] if isinstance(fixed_if, str) else [] if fixed_if is False else (
            fixed_if or [re.sub(r"(?m)^[ \t]*\$RAN[ \t]*(\n|$)", "", after)])  # upstream's form (derive_prefix turns it
        # back), without $RAN; False: the hunk has none of its own (a parameter the fix needs), the other hunks tell
        before, after = (parsed := self._parse())["before"], parsed["after"]  # a pattern that is not Python fails here
        self.constraints = {k: re.compile(v) for k, v in (constraints or {}).items()}
        self.ran = any(isinstance(n, ast.Expr) and _meta(n.value) == "RAN" for n in walk(after))
        self.fixed = fixed or "%s has the fixed form `{form}`" % self.name
        self.buggy = buggy or "%s (line {line}) has the pre-fix form `%s`" % (self.name, _show(
            before.value if isinstance(before, ast.Expr) else before))

    def _parse(self):  # the patterns, kept until forget() like a module's tree: an engine process keeps none
        before, after, where, inside, fixed_if = self._texts
        after, before = pattern(after, "after"), pattern(before, "before")
        if isinstance(after, (ast.stmt, Block)) and isinstance(before, ast.expr):
            before = ast.Expr(before)
        if isinstance(after, Block) != isinstance(before, Block):  # n statements -> m: both blocks
            after, before = (x if isinstance(x, Block) else Block([x]) for x in (after, before))
        return _source._parsed.setdefault(self, {
            "before": before, "after": after, "where": pattern(where, "where") if where else None,
            "inside": pattern(inside, "inside") if inside else None, "fixed_if": [pattern(f, "fixed_if") for f in fixed_if]})

    before, after, where, inside, fixed_if = (property(lambda self, k=k: (_source._parsed.get(self) or self._parse())[k])
                                              for k in ("before", "after", "where", "inside", "fixed_if"))

    def _scopes(self, func):
        return [n for n, _ in find(self.inside, [func])] if self.inside is not None else [func]

    def _given(self, func, given=None):
        args = func.args.posonlyargs + func.args.args if hasattr(func, "args") else ()
        return dict(given or {}, **({"SELF": ast.Name(args[0].arg, ast.Load())} if args else {}))

    def fixed_form(self, func, scopes=None):
        """The fixed-upstream Shape if ``func`` (its ``scopes``) has a ``fixed_if`` form, else None."""
        scopes = self._scopes(func) if scopes is None else scopes
        for form in self.fixed_if:
            found = find(form, scopes, self._given(func))
            if found:
                return Shape(FIXED, self._say(self.fixed, func, *found[0], form=_show(form)))
        return None

    def _allowed(self, b):
        return next(("$%s is `%s`, not `%s`" % (k, _text(item), r.pattern) for k, r in self.constraints.items()
                     for item in (b[k] if isinstance(b.get(k), list) else [b.get(k)])
                     if not r.fullmatch(_text(item))), None)

    def site(self, func, tree=None, given=None):
        """``([(node, bindings)] or None, Shape)`` for the def node ``func`` (None: not there)."""
        if not isinstance(func, _BODIES):
            return None, Shape(ABSENT, "%s has no function %s" % (self.module, self.function))
        scopes, given = self._scopes(func), self._given(func, given)
        fixed = self.fixed_form(func, scopes)
        if fixed is not None:
            return None, fixed
        taken = [a.arg for a in _arguments(func)]
        clash = next((name for name, _ in self.parameters if name in taken), None)
        kwarg = getattr(getattr(func, "args", None), "kwarg", None)
        if self.parameters and (clash is not None or kwarg is not None or not hasattr(func, "args")):
            return None, Shape(UNKNOWN, "%s already takes a parameter %s (not the fixed form)" % (self.name, clash) if clash
                               else "%s takes **%s: a keyword parameter added before it could take what callers pass "
                               "there" % (self.name, kwarg.arg) if kwarg is not None else
                               "%s is a class, not a function: it takes no parameters" % self.name)
        checked = [(n, b, self._allowed(b)) for n, b in find(self.before, scopes, given)]
        found, refused = [(n, b) for n, b, no in checked if not no], [(n, no) for n, _, no in checked if no]
        if len(found) > 1 and not self.every:
            return None, Shape(UNKNOWN, "expected one `%s` in %s, found %d (lines %s)" % (
                _show(self.before), self.name, len(found), ", ".join(str(n.lineno) for n, _ in found)))
        stray = self._stray(scopes, found) if self.every else None
        if stray is not None:
            return None, Shape(UNKNOWN, "`%s` at line %d is not of the form `%s`" % (
                _text(stray)[:80], stray.lineno, _show(self.before)))
        if not found:
            if refused:
                return None, Shape(UNKNOWN, "`%s` at line %d is not the pre-fix form: %s" % (
                    _text(refused[0][0])[:80], refused[0][0].lineno, refused[0][1]))
            return None, self._missing(func, scopes, tree)
        context = find(self.where, [func], given) if self.where is not None else None
        for node, b in found:
            if context is not None and (
                    len(context) != 1 or not all(_bind(k, v, b) for k, v in context[0][1].items())):
                return None, Shape(UNKNOWN, "`%s` (line %d) is the pre-fix form, but %s has %d `%s` %s" % (
                    _show(self.before), node.lineno, self.name, len(context), _show(self.where),
                    "whose bindings differ" if len(context) == 1 else "(expected one)"))
            twice = [k.arg for c in walk(build(self.after, dict(b, RAN=ast.Pass()))) if isinstance(c, ast.Call)
                     for i, k in enumerate(c.keywords) if k.arg and k.arg in [x.arg for x in c.keywords[:i]]]
            if twice:
                return None, Shape(UNKNOWN, "`%s` (line %d) already passes %s" % (
                    _text(node)[:80], node.lineno, ", ".join(twice)))
        return found, Shape(BUGGY, self._say(self.buggy, func, *found[0]))

    def _stray(self, scopes, found):
        """Under ``every``: a call of the pattern's first callee outside every match, or None."""
        head = next((ast.dump(n.func) for n in walk(self.before) if isinstance(n, ast.Call)), None)
        inside = {id(x) for n, _ in found for x in walk(n)}
        return next((c for s in scopes for c in walk(s) if head is not None and isinstance(c, ast.Call)
                     and id(c) not in inside and ast.dump(c.func) == head), None)

    def _say(self, text, func, node, b, **more):
        return text.format(line=node.lineno, name=getattr(func, "name", self.name),
                           **dict({k: _text(v) for k, v in b.items()}, **more))

    def _missing(self, func, scopes, tree):
        if self.word and tree is not None and _mention(tree, self.word) is None:
            owner = _source.find_def(tree, self.function.split(".")[0]) if "." in (self.function or "") else None
            if isinstance(owner, ast.ClassDef) and (owner.keywords or any(
                    not (isinstance(base, ast.Name) and base.id == "object") for base in owner.bases)):
                return Shape(UNKNOWN, "%s never mentions %s, but %s has a base class that might set it"
                             % (self.module, self.word, owner.name))
            return Shape(ABSENT, "%s has no %s in this release (%s never assigns or mentions it)" % (
                owner.name if owner is not None else self.module, self.word, self.module))
        p = self.before.body[0] if isinstance(self.before, Block) else self.before
        p = p.value if isinstance(p, ast.Expr) else p
        near = [n for s in scopes for n in walk(s) if type(n) is type(p)
                and (not isinstance(p, ast.Call) or ast.dump(n.func) == ast.dump(p.func))]
        where = " inside `%s`" % _show(self.inside) if self.inside is not None else ""
        if not near:
            return Shape(UNKNOWN, "no `%s` in %s%s" % (_show(p), self.name, where))
        node = near[0]
        if isinstance(p, ast.Call):
            wanted = [k.arg for k in p.keywords if k.arg]
            has = [k for k in wanted if k in {x.arg for x in node.keywords}]
            fixed = [a for a in p.args if _meta(a, MANY) is None]
            if any(map(_splat, node.args + node.keywords)):
                how = "passes *args/**kwargs"
            elif len(has) < len(wanted):
                how = "has keyword %s but not %s" % (", ".join(has) or "none", ", ".join(k for k in wanted if k not in has))
            elif len(fixed) == len(p.args) and len(node.args) != len(fixed):
                how = "takes %d positional arguments, the pattern %d" % (len(node.args), len(fixed))
            else:
                how = "differs"
            return Shape(UNKNOWN, "the call %s at line %d %s (pattern `%s`)" % (
                ast.unparse(node.func), node.lineno, how, _show(p)))
        return Shape(UNKNOWN, "`%s` at line %d%s differs from `%s`" % (_text(node)[:80], node.lineno, where, _show(p)))

    def touches(self, func_def, given=None):  # the nodes ``edit`` replaces (``_source.copy_paths``)
        return [n for node, _ in self.site(func_def, None, given)[0] for n in (node.body if isinstance(node, Block) else [node])]

    def edit(self, func_def, mark, given=None, names=None):
        """The runtime edit (also ``flashfix diff``'s): each pre-fix node becomes ``after``, with
        the marker at ``$RAN`` or before the edited statement. ``names`` collects the names the
        new code reads that the function does not bind (they must be globals)."""
        found, shape = self.site(func_def, None, given)
        if shape.kind != BUGGY:
            raise ShapeError(shape.reason)
        news = []
        for number, (node, b) in reversed(list(enumerate(found))):  # later statements of a block first
            new = build(self.after, dict(b, RAN=mark), at=node.body[0] if isinstance(node, Block) else node)
            if isinstance(node, ast.stmt) and isinstance(new, ast.expr):  # a statement becomes a call (``after``
                call, new = new, ast.copy_location(ast.Expr(new), node)    # parsed as an expression), spelled as it
                if hasattr(call, "flashfix_text"):
                    new.flashfix_text = call.flashfix_text
            _put(func_def, node, new)
            if not self.ran and number == 0 and mark is not None:  # None: a class body or module, no marker
                _source.insert_before(func_def, new.body[0] if isinstance(new, Block) else new, mark)
            news.append(new)
        if self.parameters:  # keyword-only, after the others (the def node's own, copied: the release's is shared)
            args = func_def.args = copy.copy(func_def.args)
            args.kwonlyargs = args.kwonlyargs + [ast.arg(name) for name, _ in self.parameters]
            args.kw_defaults = args.kw_defaults + [ast.parse(repr(value), mode="eval").body  # -1: as the text parses
                                                   for _, value in self.parameters]
        if names is not None:
            names.update(_free_names(news, func_def))
        ast.fix_missing_locations(func_def)

    def new_parameters(self):
        """The ``ast.arg`` nodes of the parameters it adds (names the new code may read)."""
        return [ast.arg(name) for name, _ in self.parameters]


def _arguments(func):
    """Every parameter of the def node ``func`` (none for a class or a module)."""
    a = getattr(func, "args", None)
    return [] if a is None else a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]


def _series_global(name, news):
    """Is ``name`` an earlier series member's global: read already by the code a hunk edits (``news``: the
    function -> its new code, as ``Declaration.shape`` holds them) and given by a registered patch's ``needs``?"""
    return any(isinstance(n, ast.Name) and n.id == name for func, _ in news.values() for n in walk(func)) and any(
        _provides(m, name) for p in _registry._patches.values() for n, m in (getattr(p.rule, "needs", None) or {}).items()
        if n == name)


def _provides(modname, name):
    """Does ``modname`` bind ``name``? flashfix's own modules are asked as imported (the doctor judges
    with its own flashfix, whatever environment it reads), an engine's from its source."""
    if modname.partition(".")[0] == "flashfix":
        return hasattr(importlib.import_module(modname), name)
    return _source.binds(modname, name)


def _free_names(news, func):
    """Names the new nodes ``news`` read that ``func`` and they bind nowhere: parameters (also of a
    lambda or a nested def), assignment and loop targets, ``as`` names, defs, imports."""
    bound = set()
    for n in (n for root in [func] + news for n in walk(root)):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, (ast.arg, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)):
            bound.add(getattr(n, "arg", None) or n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
    return {n.id for new in news for n in walk(new) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id not in bound and not hasattr(builtins, n.id) and n.id != _source.MARK_NAME}


def _mention(tree, word):
    """The first node of ``tree`` that spells ``word`` (any case) in a name or string, or None."""
    if isinstance(tree, _source.Module) and tree.unspelled(word):  # a module: parsed only where it may spell it
        return None
    return next((n for n in walk(tree) if any(word.lower() in w.lower() for w in words(n))), None)


class Declaration:
    """A backport's hunks, applied together: the probe, the runtime changes and the diff plan."""

    sites = property(lambda self: tuple(layout[0] for layout in self.layouts))  # the first hunk's site per layout

    def __init__(self, id, hunks, sites, needs, context, check):
        self.id, self.hunks, self.needs, self.context, self.check = id, hunks, dict(needs or {}), context, check
        self.layouts = layouts(hunks, sites)

    def targets(self):
        """The module that defines the first hunk's function (from definitions, read when the
        engine is imported), or the first site's where none or several do (the probe says why)."""
        defining = []
        for modname, qualname in self.sites:
            found = _locate.find(modname)
            try:
                node = found is not None and found.text is not None and _target(_source.parse_text(found.text, found.origin), qualname)
            except (ShapeError, SyntaxError, ValueError):
                node = True  # defined, but not readably: the probe says why
            defining += [modname] if node else []
        return (defining[0],) if len(set(defining)) == 1 else (self.sites[0][0],)

    derivable = property(lambda self: all(h.derivable for h in self.hunks))  # every ``after`` is upstream's form

    def locate(self, tree_of, trees=None):
        """``[(module, qualname, def node)]``: each site that defines the first hunk's function;
        ``tree_of(module)`` gives a module's AST, None or ``SOURCELESS`` (kept in ``trees``)."""
        trees, defs = {} if trees is None else trees, []
        for modname, qualname in self.sites:
            tree = trees[modname] = tree_of(modname)
            node = _target(tree, qualname)
            if isinstance(node, _BODIES):
                defs.append((modname, qualname, node))
        return defs

    def shape(self, tree_of):
        """``(Shape, [(rule, module, qualname, found)], bindings)`` with ``tree_of`` as for ``locate``."""
        trees = {}
        defs = self.locate(tree_of, trees)
        if len(defs) != 1:
            return self._absent(trees, defs), None, None
        located, layout = [], next(layout for layout in self.layouts if layout[0] == defs[0][:2])
        for index, rule in enumerate(self.hunks):  # a hunk's function is read only if no earlier one is fixed
            modname, qualname = layout[index]  # layout[0]: the site of defs[0]
            if modname not in trees:
                trees[modname] = tree_of(modname)
            func = defs[0][2] if index == 0 else _target(trees[modname], qualname)
            fixed = rule.fixed_form(func) if func is not None else None
            if fixed is not None:
                return fixed, None, None
            located.append((rule, modname, qualname, func))
        missing = [q for _, _, q, func in located if func is None]
        if missing:
            return Shape(UNKNOWN, "not found: %s" % ", ".join(missing)), None, None
        given = self.context(trees[located[0][1]], located[0][3]) if self.context is not None else {}
        if isinstance(given, Shape):
            return given, None, None
        out, first, names, news = [], None, {}, {}  # module -> the names its new code reads; function -> its new code
        for rule, modname, qualname, func in located:
            found, shape = rule.site(func, trees[modname], given)
            odd = [ast.unparse(d) for d in getattr(func, "decorator_list", ()) if isinstance(func, ast.FunctionDef)
                   and _DESCRIPTOR.search(ast.unparse(getattr(d, "func", d)))]
            if shape.kind == BUGGY and odd:  # the runtime would find no function there to recompile
                shape = Shape(UNKNOWN, "%s is not a plain function of %s: @%s" % (qualname, modname, odd[0]))
            made = _made_from_body(func, trees[modname]) if shape.kind == BUGGY and isinstance(func, ast.ClassDef) else None
            if made is not None and (made != "a dataclass" or _sets_field(rule, found)):  # its body read once when the class is made: setting a name on it changes nothing
                shape = Shape(UNKNOWN, _made_reason(qualname, made))
            if shape.kind != BUGGY:
                return shape, None, None
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):  # what the runtime refuses, the probe does
                _body(trees[modname], func, functools.partial(rule.edit, given=given))
            first = first or shape
            news.setdefault((modname, qualname), (func, []))[1].extend(
                [build(rule.after, dict(b, RAN=ast.Pass())) for _, b in found] + rule.new_parameters())
            out.append((rule, modname, qualname, func))
        for (modname, _), (func, built) in news.items():  # one function's hunks together: a name one binds, another reads
            names.setdefault(modname, set()).update(_free_names(built, func))
        for modname, read in names.items():  # the names each hunk's new code reads, as prepare() asks its module
            lacking = [n for n in sorted(read) if not _source.binds(modname, n, tree=trees[modname])
                       and not (n in self.needs and _provides(self.needs[n], n)) and not _series_global(n, news)]
            if lacking:
                return Shape(UNKNOWN, lacks(lacking[0], modname, self.needs)), None, None
        if self.check is not None:  # what only the imported engine can tell: the doctor's row says so
            first = first._replace(reason="%s; decided at import: %s" % (first.reason, " ".join((
                self.check.__doc__ or self.check.__name__).split("\n\n")[0].split())))
        return first._replace(functions=tuple((m, q) for _, m, q, _ in out)), out, given

    def _absent(self, trees, defs):
        rule, names = self.hunks[0], " or ".join(sorted({(q or m).rsplit(".", 1)[-1] for m, q in self.sites}))
        if len(defs) > 1:
            return Shape(UNKNOWN, "expected one %s, found %s" % (names, ", ".join("%s:%s" % d[:2] for d in defs)))
        sourceless = [m for m, t in trees.items() if t is _source.SOURCELESS]
        if sourceless:
            return Shape(UNKNOWN, "no %s found; the source of %s is not available" % (names, ", ".join(sourceless)))
        read = [m for m, t in trees.items() if t is not None]
        said = {m: _mention(trees[m], rule.word) for m in read} if rule.word else {}
        if not rule.word or any(said.values()):
            return Shape(UNKNOWN, "no %s found in %s%s" % (names, ", ".join(read) or "any module (none of %s is there)"
                                                          % ", ".join(trees), "".join(
                ", but %s mentions %r (line %d)" % (m, next(w for w in words(n) if rule.word.lower() in w.lower())[:50],
                                                    n.lineno)
                for m, n in said.items() if n is not None) or ": moved or renamed? (with absent_unless_mentioned=WORD, "
                "a release whose module never mentions WORD is not-affected)"))
        missing = [m for m, t in trees.items() if t is None]
        return Shape(ABSENT, "nothing in %s defines %s or mentions %r%s" % (
            ", ".join(read), names, rule.word, "; no module %s" % ", ".join(missing) if missing else ""))

    def probe(self, trees):
        return self.shape(lambda m: trees[m] if m in trees else _source.module_ast(m))[0]

    def _plan(self, tree_of):
        shape, located, given = self.shape(tree_of)
        if shape.kind != BUGGY:
            raise ShapeError(shape.reason)
        return located, given

    def ahead(self):
        """What ``prepare_ahead`` needs, made from the source before the targets run (``_registry._read_ahead``):
        ``([(module, qualname, unedited, marked, plain)], names)``; None where a hunk changes a class body or a
        module's top level (``prepare`` then reads the imported code, as it does where the loaded code differs)."""
        located, given = self._plan(_source.module_ast)
        names, made = {}, []
        for rule, modname, qualname, node in located:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None
            edit, mark = functools.partial(rule.edit, given=given, names=names.setdefault(modname, set())), _source.marker(_registry.site_of(self.id, qualname))
            made.append((modname, qualname) + _source.rewrite_ahead(_source.module_ast(modname), qualname, node, lambda n: edit(
                n, mark), functools.partial(rule.touches, given=given)))
        return made, names

    def prepare(self, modules, base=None):
        """The changes; ``base(module)``: the AST its hunks are matched on (default: the source), where patches
        before it in a series changed it (``_registry.series_trees``)."""
        located, given = self._plan(base or (lambda m: _source.module_ast(m, modules)))
        module = modules.get(located[0][1]) or importlib.import_module(located[0][1])
        if self.check is not None:
            self.check(module)
        names, swaps = {}, []
        for rule, modname, qualname, node in located:
            target = modules.get(modname) or importlib.import_module(modname)
            edit = functools.partial(rule.edit, given=given, names=names.setdefault(modname, set()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                swaps.append(_registry.rewrite(function_at(target, qualname), edit, self.id,
                                               functools.partial(rule.touches, given=given)))
                continue  # a class body or module: its new statements run now, what they bind is set on it (ran)
            owner = _owner(target, qualname)
            made = _made_from_class(owner) if qualname else None
            if made is not None and (made != "a dataclass" or _sets_field(rule, rule.site(node, None, given)[0], [
                    f.name for f in importlib.import_module("dataclasses").fields(owner)])):  # what its source did not show (a base imported from elsewhere): refused as the probe does
                raise ShapeError(_made_reason(qualname, made))
            node.body  # noqa: B018  (a module read in pieces parses whole first: what the hunk matches is in the tree edited)
            touched = rule.touches(node, given=given)
            cls = qualname.rsplit(".", 1)[-1] if qualname else None  # a class body's names are bound mangled
            for t in touched:  # the matched statement did not run here: a def under a condition (as function_at says)
                held = next((s for s in node.body if any(n is t for n in walk(s))), None)
                unbound = sorted({_registry.mangled(cls, n) for n in _bound_names(t)} - set(vars(owner)))
                if unbound and isinstance(held, _COMPOUND):
                    raise NotBound("%s.%s is not bound in this process (bound at line %d under a condition, line %d, "
                                   "that did not hold when %s ran)" % (getattr(owner, "__name__", owner), unbound[0],
                                                                       t.lineno, held.lineno, target.__name__))
                if unbound:  # a plain statement of the body, which runs whenever it does: not what the source says
                    raise ShapeError("%s.%s is not found bound where the source defines it (line %d, outside any "
                                     "condition) after %s ran" % (getattr(owner, "__name__", owner), unbound[0],
                                                                  t.lineno, target.__name__))
            held = []  # the statements next to the change under a condition: bound to what they bind if it held
            code = _body(_source.module_ast(modname, modules), node, edit, touches=lambda _: touched, held=held)[1]
            for statement, condition in held:
                for name, value in _would_bind(statement, vars(target), dict(vars(owner))).items():
                    bound = vars(owner).get(_registry.mangled(cls, name), _MISSING)
                    if not _same(bound, value):
                        raise NotBound("%s.%s is %s in this process (bound at line %d under a condition, line %d, that "
                                       "did not hold when %s ran%s)" % (
                                           getattr(owner, "__name__", owner), _registry.mangled(cls, name),
                                           "not bound" if bound is _MISSING else "bound to something else",
                                           statement.lineno, condition.lineno, target.__name__,
                                           "" if bound is _MISSING else ", or later code rebound it"))
            needed = {a.name: a.value for a in needed_globals(target, names[modname], self.needs)}  # ``needs``: read by the new statements
            space = dict(vars(owner), **needed)
            exec(code, vars(target), space)
            swaps += [_registry.SetAttr(owner, k, v, self.id) for k, v in space.items()
                      if vars(owner).get(k, space) is not v and needed.get(k, space) is not v]
        return [g for m, read in names.items()  # each hunk's module gets the globals its new code reads
                for g in needed_globals(modules.get(m) or importlib.import_module(m), read, self.needs)] + swaps

    def plan(self, planner):
        located, given = self._plan(_source.module_ast)
        names, start = {}, len(planner.changes)
        for rule, modname, qualname, node in located:
            edit = functools.partial(rule.edit, given=given, names=names.setdefault(modname, set()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                planner.rewrite(modname, qualname, edit)
            else:
                from flashfix.tools import diff as _diff

                tree = _source.module_ast(modname)
                planner.changes.append(_diff.Rewrite(self.id, modname, qualname, tree.flashfix_origin, tree.flashfix_text,
                                                     _body(tree, node, edit, touches=functools.partial(
                                                         rule.touches, given=given))[0], None, None))
        swaps, planner.changes[start:] = planner.changes[start:], []
        for modname, read in names.items():
            for name in sorted(n for n in read if n in self.needs and not _source.binds(modname, n)):  # the probe checked
                planner.add_name(modname, name, self.needs[name], name)
        planner.changes.extend(swaps)  # the runtime's order: the globals first, then the code


# Classes whose body is read once when the class is made (a decorator or a metaclass turns it into fields or
# members): a class-body hunk sets the new value on the class, which their ``__init__``, accessors or members
# never read again. Refused (unknown-shape), by the probe from the source, by ``prepare`` from the class.
_MADE_DECORATORS = {"dataclass": "a dataclass", "s": "an attrs class", "attrs": "an attrs class",
                    "define": "an attrs class", "frozen": "an attrs class", "mutable": "an attrs class"}
_ATTRS_MODULES = {"", "attr", "attrs"}  # ``@define``, ``@attr.s``, ``@attrs.define``...
_MADE_BASES = dict(dict.fromkeys(("NamedTuple",), "a NamedTuple"), **dict.fromkeys(
    ("BaseModel", "BaseSettings", "RootModel", "GenericModel"), "a pydantic model"), **dict.fromkeys(
    ("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag", "ReprEnum"), "an enum"))


def _made_from_body(node, tree, seen=()):
    """The kind of class (``"a dataclass"``...) the ``ClassDef`` ``node`` of ``tree`` makes from its body, as its
    decorators and bases (a base defined in ``tree`` too, followed) spell it, or None."""
    for d in node.decorator_list:
        parts = ast.unparse(getattr(d, "func", d)).rsplit(".", 1)
        name, owner = parts[-1], parts[0] if len(parts) > 1 else ""
        if name == "dataclass" or name in _MADE_DECORATORS and owner in _ATTRS_MODULES:
            return _MADE_DECORATORS[name] if name != "dataclass" or owner != "attr" else "an attrs class"
    for base in node.bases:
        name = ast.unparse(getattr(base, "value", base) if isinstance(base, ast.Subscript) else base).rsplit(".", 1)[-1]
        if name in _MADE_BASES:
            return _MADE_BASES[name]
        defined = _source.find_def(tree, name) if isinstance(base, ast.Name) and name not in seen else None
        made = _made_from_body(defined, tree, seen + (name,)) if isinstance(defined, ast.ClassDef) else None
        if made is not None:
            return made
    return None


def _made_from_class(owner):
    """The kind of class ``owner`` (an imported class) is, where its body was read once when it was made, or None."""
    if not isinstance(owner, type):
        return None
    has = lambda *names: any(n in vars(k) for k in owner.__mro__ + type(owner).__mro__ for n in names)  # noqa: E731
    enum = sys.modules.get("enum")
    return ("a dataclass" if has("__dataclass_fields__") else "a NamedTuple" if issubclass(owner, tuple) and has(
        "_fields") else "a pydantic model" if has("model_fields", "__fields__", "__pydantic_fields__") else
        "an attrs class" if has("__attrs_attrs__") else "an enum" if enum is not None and isinstance(
            owner, enum.EnumMeta) else None)


def _sets_field(rule, found, fields=()):
    """Does a hunk (its matches ``found``) change or add a dataclass field: an annotated statement, not a
    ``ClassVar``, where it matched or in its new statements, or one that binds a name of ``fields``? (A plain class
    attribute of a dataclass, ``transformers``' config classes' ``attribute_map`` say, is set on it as elsewhere.)"""
    for stmt in [n for node, _ in found for n in (node.body if isinstance(node, Block) else [node])] + [
            build(rule.after, dict(b, RAN=ast.Pass())) for _, b in found]:
        if any(isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation) for n in walk(stmt)) or (
                _bound_names(stmt) & set(fields)):
            return True
    return False


def _made_reason(qualname, kind):
    what = "members" if kind == "an enum" else "fields"
    return ("%s is %s: its %s are read once when the class is made; a class-body hunk cannot change them (write "
            "the fix against __init__ or the code that reads the %s)" % (qualname.rsplit(".", 1)[-1], kind, what, what[:-1]))


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.Match) + (
    (ast.TryStar,) if hasattr(ast, "TryStar") else ())  # what may leave the statements it holds unrun


def _owner(target, qualname):
    """The class ``qualname`` (its names as the source spells them; a private one mangled) of module ``target``,
    or ``target`` for None; ``NotBound``/ShapeError as ``function_at`` where one is not bound."""
    owner, cls = target, None
    for index, part in enumerate(qualname.split(".") if qualname else ()):
        key = _registry.mangled(cls, part)
        if key not in vars(owner) and not hasattr(owner, key):
            _registry.not_bound(target, ".".join(qualname.split(".")[:index + 1]), owner, key)
        owner, cls = getattr(owner, key), part
    return owner


def _bound_names(node):
    """The names a statement (an import, an assignment, a def) binds in the scope that holds it."""
    return {a.asname or a.name.split(".")[0] for a in walk(node) if isinstance(a, ast.alias)} | {
        n.id for n in walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | (
        {node.name} if isinstance(node, _source._DEFS) else set())


def _spelled(statement):
    """The identifiers ``statement`` spells that Python may mangle: names, attributes, defs, parameters, imports,
    keywords, ``global``/``nonlocal`` names."""
    for n in walk(statement):
        yield from [w for w in words(n) if not isinstance(n, (ast.Constant, ast.ImportFrom))] + list(
            getattr(n, "names", None) if isinstance(n, (ast.Global, ast.Nonlocal)) else ())


_HELD = ("body", "orelse", "finalbody", "handlers", "cases")  # the fields of what a compound statement holds


def _inner(old, new):
    """``(old block, new block)``: the one list of statements in which compound statement ``new`` differs from
    ``old`` (of its type, the rest of it the same), else None."""
    from flashfix.core.render import equal

    parts = [[s] + getattr(s, "handlers", []) + getattr(s, "cases", []) for s in (old, new)]
    if type(old) is not type(new) or not isinstance(old, _COMPOUND) or len(parts[0]) != len(parts[1]) or not all(
            equal(getattr(a, f, None), getattr(b, f, None)) for a, b in zip(*parts) for f in a._fields
            if f not in _HELD):
        return None
    changed = [(getattr(a, f), getattr(b, f)) for a, b in zip(*parts) for f in _HELD[:3]
               if isinstance(getattr(a, f, None), list) and not equal(getattr(a, f), getattr(b, f))]
    return changed[0] if len(changed) == 1 else None


_PLAIN = (ast.Constant, ast.Name, ast.Attribute, ast.Load, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp,
          ast.USub, ast.UAdd)  # what an expression read again without effects is made of


def _tells(statement):
    """Does what ``statement`` binds tell whether it ran: an import (not ``*``), or an assignment to names of an
    expression of constants, names and attributes (read again by ``_would_bind``)?"""
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return all(a.name != "*" for a in statement.names)
    targets = getattr(statement, "targets", [getattr(statement, "target", None)])
    return isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None and all(
        isinstance(t, ast.Name) for t in targets) and all(isinstance(n, _PLAIN) for n in walk(statement.value))


def _would_bind(statement, space, local):
    """``{name: value}``: what ``_tells``'s ``statement`` binds were it run now with globals ``space`` (and
    ``local``), read without running it: an import's names as ``sys.modules`` holds them (nothing is imported)."""
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):
        try:
            value = eval(compile(ast.Expression(statement.value), "<flashfix>", "eval"), space, local)
        except Exception as exc:
            raise ShapeError("whether line %d ran cannot be told: reading its value raises %r" % (
                statement.lineno, exc)) from None
        return dict.fromkeys(_bound_names(statement), value)
    if isinstance(statement, ast.Import):
        return {a.asname or a.name.split(".")[0]: sys.modules.get(a.name if a.asname else a.name.split(".")[0],
                                                                  _MISSING) for a in statement.names}
    from importlib.util import resolve_name

    try:
        base = sys.modules.get(resolve_name("." * statement.level + (statement.module or ""), space.get("__package__")))
    except (ImportError, ValueError):  # a relative import outside a package
        base = None
    return {a.asname or a.name: getattr(base, a.name, _MISSING) for a in statement.names}


_MISSING = object()  # what a name not bound is read as (``_would_bind``, ``Declaration.prepare``)


def _same(x, y):
    try:
        return x is y or type(x) is type(y) and bool(x == y)
    except Exception:  # an array's ``==``...
        return False


def _body(tree, node, edit, runs=True, touches=None, held=None):
    """``(Rendered, code)``: the statements of a class body or module top level ``node`` (of ``tree``) that
    ``edit`` changes, as ``flashfix diff`` prints them and the runtime runs them (compiled from that text): inside a
    compound statement (``if``, ``try``, ``with``...) that changes in one of its blocks alone, only what changes
    there. ``touches(node)``: the nodes ``edit`` replaces, so that only they are copied and the statements around
    them keep the file's own spelling. ``held`` (a list): given ``(statement, compound statement)`` for each
    statement next to a change under a condition whose names tell whether it ran (``_tells``)."""
    import difflib

    from flashfix.core import render as _render

    node.body  # noqa: B018  (a module read in pieces parses whole now: what edit finds is then in it)
    edited = copy.deepcopy(node) if touches is None else _source.copy_paths(node, touches(node))
    lines, versions, where = _render._lines(tree.flashfix_text), (_render.MARKED, _render.PLAIN), (
        getattr(node, "name", None) or tree.flashfix_origin)
    edit(edited, None)
    old, new, path = node.body, edited.body, []
    while True:  # down into the one block of a compound statement that changes (its header the same)
        changed = [o for o in difflib.SequenceMatcher(None, *[[ast.dump(s) for s in b] for b in (old, new)], False)
                   .get_opcodes() if o[0] != "equal"]
        if len(changed) != 1 or runs and changed[0][0] == "delete":
            raise ShapeError("%s: a backport of a class body or module top level adds or changes one run of statements"
                             % where)
        _, i, j, k, m = changed[0]
        inner = _inner(old[i], new[k]) if j - i == m - k == 1 else None
        if inner is None:
            break
        path.append(old[i])
        old, new = inner
    # what tells whether the change's block ran: the statements it replaces, else those next to it
    tells = [s for s in old[i:j] if _tells(s)] or [s for s in old[max(i - 1, 0):i] + old[j:j + 1] if _tells(s)]
    loop, line = next((s for s in path if isinstance(s, (ast.For, ast.AsyncFor, ast.While))), None), old[
        min(i, len(old) - 1)].lineno
    if runs and loop is not None:
        raise ShapeError("line %d of %s runs in a loop (line %d): a backport of a class body or module top level runs "
                         "its new statements once" % (line, where, loop.lineno))
    if runs and path and not tells:
        raise ShapeError("line %d of %s is under a condition (line %d), and no statement next to it tells whether it "
                         "ran (an import, or an assignment of constants, names and attributes, does)" % (
                             line, where, path[-1].lineno))
    if path and held is not None:
        held += [(s, path[-1]) for s in tells]
    private = next((w for s in new[k:m] for w in _spelled(s) if _registry.mangled(node.name, w) != w), None) if (
        isinstance(node, ast.ClassDef)) else None
    if private is not None:  # compiled outside the class, as the runtime runs them, they would not be mangled
        raise ShapeError("the new statements of class %s spell the private name %s, which Python mangles in a class "
                         "body: a backport of a class body may not spell one" % (node.name, private))
    start = _render._first_line(old[i]) if i < len(old) else old[-1].end_lineno + 1
    text = None
    if j - i == m - k == 1 and type(old[i]) is type(new[k]):  # one statement changed inside:
        try:  # only what changed is respelled, the rest is the file's text (checked below, as the fallback is)
            writer = _render.Writer(lines, marked=False)
            writer.diff(old[i], new[k], top=True)
            text = writer.text(start, old[i].end_lineno)[0]
            text = text if _render.parses_as(textwrap.dedent(text), new[k]) else None
        except Exception:
            text = None
    if text is None:
        text = textwrap.indent("".join(_render.Writer(lines, marked=False).spell(s) + "\n" for s in new[k:m]),
                               lines[old[0].lineno - 1][:old[0].col_offset])  # the pattern's text, bindings the engine's
    parsed = ast.parse(textwrap.dedent(text))
    if [ast.dump(s) for s in parsed.body] != [ast.dump(s) for s in new[k:m]]:
        raise ShapeError("the new statements of %s cannot be written back as source" % tree.flashfix_origin)
    rendered = _render.Rendered(tree.flashfix_origin, start, "".join(lines[start - 1:old[j - 1].end_lineno if j > i else 0]),
                                dict.fromkeys(versions, text), dict.fromkeys(versions, ()), ())
    return rendered, compile(ast.increment_lineno(parsed, start - 1), tree.flashfix_origin, "exec")


def derive_prefix(patch, text):
    """``text`` (a module's source with the fix) with each hunk's ``after`` turned back into ``before`` in its
    function (of the layout in ``sites`` that ``text`` defines), other lines kept: a pre-fix shape.
    ValueError unless every ``after`` is upstream's form and matches once (at least once under ``every``)."""
    from flashfix.core import render as _render

    decl = patch.rule
    if not decl.derivable:
        raise ValueError("%s: its after-form is not upstream's (fixed_if): nothing to turn back" % decl.id)
    layout = next((l for l in decl.layouts if _target(_source.Module(text, "<derived>"), l[0][1]) is not None),
                  decl.layouts[0])
    for rule, (modname, qualname) in zip(decl.hunks, layout):
        tree = _source.Module(text, "<derived>")
        func = _target(tree, qualname)
        if not isinstance(func, _BODIES):
            raise ValueError("%s has no function %s" % (modname, qualname))
        edited = copy.deepcopy(func)
        found = find(rule.after, rule._scopes(edited))
        if len(found) != 1 and not (rule.every and found):
            raise ValueError("expected one `%s` in %s, found %d" % (_show(rule.after), qualname, len(found)))
        try:
            for node, b in reversed(found):
                _put(edited, node, build(rule.before, b))
        except KeyError as exc:
            raise ValueError("%s: `before` uses $%s, which `after` does not bind: write the pre-fix shape by hand"
                             % (qualname, exc.args[0])) from None
        rendered = _source.render_edit(text, func, ast.fix_missing_locations(edited)) if isinstance(func, (
            ast.FunctionDef, ast.AsyncFunctionDef)) else _body(tree, func, lambda e, _: setattr(e, "body", edited.body), False)[0]
        lines = _render._lines(text)
        text = "".join(lines[:rendered.start - 1] + [rendered.text()] + lines[rendered.start - 1 + len(
            _render._lines(rendered.before)):])
    return text


_built = {}  # flashfix.semantic's Rule or Declaration -> this module's, built on first use


def rule_of(spec):
    """The matcher's ``Rule`` of ``flashfix.semantic.Rule`` ``spec`` (its patterns compiled: one that is not
    Python fails here)."""
    if isinstance(spec, Rule):
        return spec
    rule = _built.get(spec)
    if rule is None:
        module, function, before, after, keywords = spec.written
        rule = _built.setdefault(spec, Rule(module, function, before, after, **keywords))
    return rule


def declaration_of(spec):
    """The matcher's ``Declaration`` of ``flashfix.semantic.Declaration`` ``spec``."""
    decl = _built.get(spec)
    if decl is None:
        decl = _built.setdefault(spec, Declaration(spec.id, tuple(rule_of(h) for h in spec.hunks), spec.sites_written, spec.needs,
                                                   spec.context, spec.check))
    return decl
