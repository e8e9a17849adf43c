"""Declarative backports: an upstream change written once as code, before -> after.

    from flashfix.semantic import Backport

    PATCHES = (Backport(
        id="sglang-vision-config", engine="sglang", versions=">=0.5.1", fixed_in="0.5.18",
        upstream="https://github.com/sgl-project/sglang/pull/34217",
        module="sglang.srt.configs.model_config", function="ModelConfig.__init__",
        inside="self.is_image_understandable_model = $_",
        before='hasattr($X, "vision_config")',
        after='getattr($X, "vision_config", None) is not None',
        summary="is_image_understandable_model is true only if hf_config.vision_config is not None",
        doc="Why: ...  How: ...  Delete when: flashfix no longer supports SGLang older than 0.5.18"),)

``Backport(...)`` returns an ordinary registry ``Patch``: ``status()``, ``doctor``, ``diff``, the
sweep, ``FLASHFIX_DISABLE`` and strict mode treat it as any other. Patterns are Python source
(one expression or statement), ast-grep style: ``$X`` matches one expression (or an attribute
name, ``obj.$A``), the same ``$X`` twice structurally equal code (ctx, positions ignored), ``$_``
anything; ``$$$X`` zero or more items of a list (arguments, statements, ``and`` operands,
elements) and ``**$$$X`` the keywords a call pattern does not name. Keywords match by name in
any order; metavariables never match ``*x``/``**x``. ``inside``: look for the forms only in code
matching this pattern. ``where``: a pattern that must match once elsewhere in the function; its
bindings (e.g. a sibling call's arguments) serve ``after``.

Derived from the one declaration, anchored to ``module`` and the qualified ``function``:

The rest of this module's documentation is the comment block below.
"""
# * the probe: ``after`` present -> fixed-upstream; ``before`` present once (and ``where`` binds)
#   -> patch; the function absent, or the word ``absent_unless_mentioned`` nowhere in the module
#   -> not-affected; else unknown-shape, naming where the nearest candidate differs. ``fixed`` and
#   ``buggy`` are optional reason texts (``str.format``: ``{line}`` and the metavariables);
# * the runtime edit and ``flashfix diff``'s plan: the function recompiled from its own source
#   with that node replaced (``_registry.rewrite``, a one-time marker before it);
# * ``derive_prefix(patch, text)``: ``after`` -> ``before`` on a fixed release's module, for tests.
#
# ``doc`` says why, how, and (required) ``Delete when:``. What a pattern cannot say is written as
# a plain ``Patch`` with its own ``probe``/``prepare``/``plan``, its doc saying why. Matching uses
# the standard library's ``ast`` (ast-grep-py costs 12-15 ms and 5.4 MiB to import, libcst
# 250-320 ms and 19 MiB; the engine-process goal is at most 1 MiB).

import ast
import copy

from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, Patch, Shape  # noqa: F401  (public)
from flashfix.core.source import ShapeError

ONE, MANY = "__ffx_1_", "__ffx_n_"  # what $X / $$$X become before ast.parse


def pattern(text):
    """The AST of a pattern snippet: an expression, or a statement."""
    (node,) = ast.parse(text.strip().replace("$$$", MANY).replace("$", ONE)).body
    return node.value if isinstance(node, ast.Expr) else node


def _meta(node, prefix=ONE):
    if isinstance(node, ast.Expr) and prefix == MANY:
        node = node.value
    if isinstance(node, ast.keyword) and node.arg is None and prefix == MANY:
        node = node.value
    if isinstance(node, ast.Name) and node.id.startswith(prefix):
        return node.id[len(prefix):]
    return None


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
    if not match(p.func, t.func, b) or not _match_list(p.args, t.args, b):
        return False
    given = {kw.arg: kw for kw in t.keywords}
    if None in given:  # the code passes **kwargs: what it passes cannot be told
        return False
    rest = None
    for kw in p.keywords:
        if kw.arg is None:
            rest = _meta(kw, MANY)
        elif kw.arg not in given or not match(kw.value, given[kw.arg].value, b):
            return False
    named = {kw.arg for kw in p.keywords}
    extra = [kw for kw in t.keywords if kw.arg not in named]
    return _bind(rest, extra, b) if rest is not None else not extra


def find(p, scopes):
    """``[(node, bindings)]`` for every node inside ``scopes`` that ``p`` matches."""
    found = []
    for scope in scopes:
        for node in ast.walk(scope):
            b = {}
            if match(p, node, b) and all(node is not n for n, _ in found):
                found.append((node, b))
    return found


def build(template, b):
    """A new node: ``template`` with its metavariables replaced by copies of their bindings."""
    node = copy.deepcopy(template)
    name = _meta(node)
    if name is not None:
        return copy.deepcopy(b[name])
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            out = []
            for item in value:
                many = _meta(item, MANY)
                if many is not None:
                    out.extend(copy.deepcopy(b[many]))
                else:
                    out.append(build(item, b) if isinstance(item, ast.AST) else item)
            setattr(node, field, out)
        elif isinstance(value, ast.AST):
            setattr(node, field, build(value, b))
        elif isinstance(value, str) and value.startswith(ONE):
            setattr(node, field, b[value[len(ONE):]])
    return node


def _text(value):
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    return ast.unparse(value) if isinstance(value, ast.AST) else str(value)


def _show(node):
    return ast.unparse(node).replace(MANY, "$$$").replace(ONE, "$")


_WORD_FIELDS = {ast.FunctionDef: ("name",), ast.AsyncFunctionDef: ("name",), ast.ClassDef: ("name",),
                ast.ImportFrom: ("module",), ast.alias: ("name", "asname"), ast.Name: ("id",),
                ast.Attribute: ("attr",), ast.keyword: ("arg",), ast.arg: ("arg",)}


def words(node):
    """The identifiers and strings that ``node`` itself spells (not its children's): a def or
    class name, an imported module or name, a name, an attribute, a keyword or argument name,
    a string constant."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) and node.value else []
    return [w for w in (getattr(node, f) for f in _WORD_FIELDS.get(type(node), ())) if w]


def _own_function(owner, name, module):
    """The plain function ``name`` defined by ``owner`` (a class or a module) in ``module``'s
    file, looking through ``functools.wraps`` wrappers; a ShapeError if there is none."""
    obj = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    for _ in range(10):
        code = getattr(obj, "__code__", None)
        if code is not None and code.co_name == name and code.co_filename == getattr(module, "__file__", None):
            return obj
        obj = getattr(obj, "__wrapped__", None)
    raise ShapeError("%s.%s is not a plain function of %s" % (getattr(owner, "__name__", owner), name, module.__name__))


def function_at(module, qualname):
    """The plain function at ``qualname`` (``"Class.method"`` or ``"function"``) of ``module``."""
    owner = module
    *outer, name = qualname.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
        if not isinstance(owner, type):
            raise ShapeError("%s has no class %s" % (module.__name__, part))
    return _own_function(owner, name, module)


class Rule:
    """The compiled patterns of one declaration, and what is derived from them."""

    def __init__(self, module, function, before, after, where=None, inside=None, absent_unless_mentioned=None,
                 fixed=None, buggy=None):
        self.module, self.function = module, function
        self.before, self.after = pattern(before), pattern(after)
        self.where = pattern(where) if where else None
        self.inside = pattern(inside) if inside else None
        self.word = absent_unless_mentioned
        self.fixed = fixed or "%s has the fixed form `%s`" % (function, after.strip())
        self.buggy = buggy or "%s (line {line}) has the pre-fix form `%s`" % (function, before.strip())

    def _scopes(self, func):
        return [n for n, _ in find(self.inside, [func])] if self.inside is not None else [func]

    def site(self, func, tree=None):
        """``((node, bindings) or None, Shape)`` for the def node ``func`` (None: not there)."""
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None, Shape(ABSENT, "%s has no function %s" % (self.module, self.function))
        scopes = self._scopes(func)
        fixed = find(self.after, scopes)
        if fixed:
            return None, Shape(FIXED, self._say(self.fixed, *fixed[0]))
        found = find(self.before, scopes)
        if len(found) > 1:
            return None, Shape(UNKNOWN, "expected one `%s` in %s, found %d (lines %s)" % (
                _show(self.before), self.function, len(found), ", ".join(str(n.lineno) for n, _ in found)))
        if not found:
            return None, self._missing(func, scopes, tree)
        node, b = found[0]
        if self.where is not None:
            context = find(self.where, [func])
            if len(context) != 1 or not all(_bind(k, v, b) for k, v in context[0][1].items()):
                return None, Shape(UNKNOWN, "`%s` (line %d) is the pre-fix form, but %s has %d `%s` %s" % (
                    _show(self.before), node.lineno, self.function, len(context), _show(self.where),
                    "whose bindings differ" if len(context) == 1 else "(expected one)"))
        twice = [k.arg for c in ast.walk(build(self.after, b)) if isinstance(c, ast.Call)
                 for i, k in enumerate(c.keywords) if k.arg and k.arg in [x.arg for x in c.keywords[:i]]]
        if twice:
            return None, Shape(UNKNOWN, "`%s` (line %d) already passes %s" % (
                _text(node)[:80], node.lineno, ", ".join(twice)))
        return (node, b), Shape(BUGGY, self._say(self.buggy, node, b))

    def _say(self, text, node, b):
        return text.format(line=node.lineno, **{k: _text(v) for k, v in b.items()})

    def _missing(self, func, scopes, tree):
        if self.word and tree is not None and not any(self.word in w for n in ast.walk(tree) for w in words(n)):
            owner = _source.find_def(tree, self.function.split(".")[0]) if "." in self.function else None
            if isinstance(owner, ast.ClassDef) and (owner.keywords or any(
                    not (isinstance(base, ast.Name) and base.id == "object") for base in owner.bases)):
                return Shape(UNKNOWN, "%s never mentions %s, but %s has a base class that might set it"
                             % (self.module, self.word, owner.name))
            return Shape(ABSENT, "%s has no %s in this release (%s never assigns or mentions it)" % (
                owner.name if owner is not None else self.module, self.word, self.module))
        p = self.before
        near = [n for s in scopes for n in ast.walk(s) if type(n) is type(p)
                and (not isinstance(p, ast.Call) or ast.dump(n.func) == ast.dump(p.func))]
        where = " inside `%s`" % _show(self.inside) if self.inside is not None else ""
        if not near:
            return Shape(UNKNOWN, "no `%s` in %s%s" % (_show(p), self.function, where))
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

    def probe(self, trees):
        tree = trees[self.module]
        return self.site(_source.find_def(tree, self.function), tree)[1]

    def edit(self, func_def, mark):
        """The runtime edit (also ``flashfix diff``'s): the one pre-fix node becomes ``after``."""
        found, shape = self.site(func_def)
        if shape.kind != BUGGY:
            raise ShapeError(shape.reason)
        node, b = found
        new = build(self.after, b)
        _source.replace_node(func_def, node, new)
        _source.insert_before(func_def, new, mark)


def Backport(*, id, engine, module, function, before, after, versions, upstream, fixed_in, summary, doc,  # noqa: N802
             where=None, inside=None, absent_unless_mentioned=None, fixed=None, buggy=None):
    """A declarative backport (see the module docstring), as a registry ``Patch``."""
    delete_when = " ".join(doc.partition("Delete when:")[2].split("\n\n")[0].split()).rstrip(".")
    if not delete_when:
        raise ValueError("backport %s: its doc has no 'Delete when:' paragraph" % id)
    rule = Rule(module, function, before, after, where, inside, absent_unless_mentioned, fixed, buggy)

    def prepare(modules):
        return [_registry.rewrite(function_at(modules[module], function), rule.edit, id)]

    return Patch(id=id, engine=engine, targets=(module,), versions=versions, upstream=upstream, fixed_in=fixed_in,
                 delete_when=delete_when, summary=summary, probe=rule.probe, prepare=prepare,
                 plan=lambda planner: planner.rewrite(module, function, rule.edit), doc=doc, rule=rule)


def derive_prefix(patch, text):
    """``text`` (a module's source with the fix) with the one ``after`` form in the backport's
    function turned back into ``before``: a pre-fix shape. Lines outside the changed statement
    keep their text. ValueError unless ``after`` matches exactly once there."""
    from flashfix.core import render as _render

    rule = getattr(patch, "rule", patch)
    func = _source.find_def(ast.parse(text), rule.function)
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError("%s has no function %s" % (rule.module, rule.function))
    edited = copy.deepcopy(func)
    found = find(rule.after, rule._scopes(edited))
    if len(found) != 1:
        raise ValueError("expected one `%s` in %s, found %d" % (_show(rule.after), rule.function, len(found)))
    _source.replace_node(edited, found[0][0], build(rule.before, found[0][1]))
    rendered = _source.render_edit(text, func, ast.fix_missing_locations(edited))
    lines = _render._lines(text)
    return "".join(lines[:rendered.start - 1] + [rendered.text()] + lines[rendered.start - 1 + len(
        _render._lines(rendered.before)):])
