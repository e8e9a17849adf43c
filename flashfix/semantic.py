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
sweep, ``FLASHFIX_DISABLE`` and strict mode treat it as any other. Patterns are Python source (an
expression, or statements: several match consecutive statements of one block), ast-grep style:
``$X`` matches one expression (or an attribute name, ``obj.$A``), the same ``$X`` twice
structurally equal code (ctx, positions ignored), ``$_`` anything; ``$$$X`` zero or more items
of a list (arguments, statements, ``and`` operands, elements) and ``**$$$X`` the keywords a call
pattern does not name. Keywords match by name in any order; metavariables never match
``*x``/``**x``. ``inside``: look for the forms only in code matching this pattern. ``where``: a
pattern that must match once elsewhere in the function; its bindings (e.g. a sibling call's
arguments) serve ``after``. Every keyword, with its type: ``help(Backport)``; how each is derived: the comment opening
``flashfix/core/matcher.py``.
"""
# This module is what a pack imports, and what an engine process keeps: the declarations as written.
# Everything derived from them (compiled patterns, the probe, the changes) is ``flashfix.core.matcher``'s,
# built when first used, which a process that decides nothing never imports (``flashfix.core.lazy``).

import ast
import importlib
import re
import textwrap

from flashfix.core import lazy as _lazy
from flashfix.core import registry as _registry
from flashfix.core.registry import ABSENT, BUGGY, FIXED, UNKNOWN, NotBound, Patch, Shape, ShapeError  # noqa: F401  (public)

_matcher = _lazy.Module("flashfix.core.matcher")


class Block(ast.AST):
    """A pattern of several statements, matched as consecutive statements of one block; a match
    found in code is a Block too, with ``at``: ``(the block's list, first index)``."""

    _fields = ("body",)

    def __init__(self, body=(), at=None):
        self.body, self.at = list(body), at
        self.lineno = body[0].lineno if body and hasattr(body[0], "lineno") else 0


def _forward(name):
    def call(*args, **kwargs):
        return getattr(_matcher, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = "``flashfix.core.matcher.%s``, imported when called (so that a pack may bind it at import)." % name
    return call


# The matcher's functions a pack's ``context`` or ``check`` may call.
find, match, pattern, build, walk, derive_prefix = map(_forward, ("find", "match", "pattern", "build", "walk", "derive_prefix"))
function_at = _registry.function_at


def __getattr__(name):  # the matcher's other names (``Block``, ...), read through this module
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_matcher, name)


class _Written:
    """Attributes this object does not hold are those of the matcher's object built from it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._built(), name)


ONE, MANY = "__ffx_1_", "__ffx_n_"  # what $X / $$$X become before ast.parse


def pattern_source(text):
    """A pattern snippet as the Python source ``ast.parse`` reads (the matcher's ``pattern`` parses it)."""
    return textwrap.dedent(text).strip().replace("$$$", MANY).replace("$", ONE)


def parse_pattern(text, keyword="pattern"):
    """``(source, its ast.Module body)``; a pattern that is not Python is a ValueError naming ``keyword``."""
    src = pattern_source(text)
    try:
        return src, ast.parse(src).body
    except SyntaxError as exc:
        raise ValueError("`%s` is not Python: %s (line %s of %r)" % (
            keyword, exc.msg.replace(MANY, "$$$").replace(ONE, "$"), exc.lineno, text)) from None


class Rule(_Written):
    """One hunk of a declaration: ``before`` -> ``after`` inside ``module``'s ``function`` (the keywords:
    ``Backport``'s docstring), as written; the matcher compiles it when it is first used."""

    def __init__(self, module, function, before, after, where=None, inside=None, absent_unless_mentioned=None,
                 fixed=None, buggy=None, fixed_if=None, constraints=None, every=False, parameters=None):
        self.module, self.function = module, function
        names = lambda text: set(re.findall(r"\$+(\w+)", text or ""))  # noqa: E731  (the metavariables it spells)
        self.unbound = sorted(names(after) - names(before) - names(where) - {"SELF", "RAN", "_"})
        self.parameters = parse_parameters(parameters, function)
        for keyword, text in (("before", before), ("after", after), ("where", where), ("inside", inside)) + tuple(
                ("fixed_if", f) for f in ([fixed_if] if isinstance(fixed_if, str) else fixed_if or ())):
            if text is not None:  # a pattern that is not Python fails when declared; the matcher compiles it when used
                parse_pattern(text, keyword)
        for regex in (constraints or {}).values():
            re.compile(regex)
        self.written = (module, function, before, after, dict(
            where=where, inside=inside, absent_unless_mentioned=absent_unless_mentioned, fixed=fixed, buggy=buggy,
            fixed_if=fixed_if, constraints=constraints, every=every, parameters=self.parameters))

    def _built(self):
        return _matcher.rule_of(self)


def parse_parameters(text, function):
    """``Rule``'s ``parameters`` (a str or tuple of str, each ``name=default``, the default a literal) as
    ``((name, default), ...)``; a ValueError where one is not that, or the hunk is not a function's."""
    if not text:
        return ()
    if function is None or not isinstance(text, (str, tuple)):
        raise ValueError("`parameters` needs a function and is a str or tuple of `name=default`: %r" % (text,))
    out = []
    for item in (text,) if isinstance(text, str) else text:
        try:
            arg = ast.parse("def f(*, %s): pass" % item).body[0].args
            (name,), (default,) = [a.arg for a in arg.kwonlyargs], arg.kw_defaults
            out.append((name, ast.literal_eval(default)))
        except (SyntaxError, ValueError, TypeError):
            raise ValueError("`parameters` of %s: %r is not `name=default` with a literal default" % (function, item)) from None
    return tuple(out)


def layouts(hunks, sites):
    """Per release layout, one ``(module, function)`` per hunk (``sites``: ``Backport``'s)."""
    return [s if isinstance(s[0], tuple) else (s,) + tuple((h.module, h.function) for h in hunks[1:])
            for s in sites or ((hunks[0].module, hunks[0].function),)]


class Declaration(_Written):
    """A backport's hunks, applied together, as written: the probe, the runtime changes and the diff plan are
    the matcher's ``Declaration``'s, built from it when first asked."""

    def __init__(self, id, hunks, sites, needs, context, check):
        self.id, self.hunks, self.sites_written, self.needs, self.context, self.check = id, hunks, sites, needs, context, check
        self.layouts = layouts(hunks, sites)  # what the registry reads of a series without building the matcher
        self.parameters = {name: value for h in hunks for name, value in getattr(h, "parameters", ())}  # their defaults

    def _built(self):
        return _matcher.declaration_of(self)

    # What the registry holds of a declaration (``Patch``) is these, not the matcher's bound methods.
    def targets(self):
        return self._built().targets()

    def probe(self, trees):
        return self._built().probe(trees)

    def prepare(self, modules, base=None):
        return self._built().prepare(modules, base)

    def plan(self, planner):
        return self._built().plan(planner)

    def ahead(self):
        return self._built().ahead()

    def prepare_ahead(self, modules, made, names):
        """``prepare``'s changes from what ``ahead()`` made, or None where a loaded function does not run the code
        it was made from (``_registry._decide`` then calls ``prepare``). Needs no matcher: after the import, an
        engine process decides from what it read ahead without importing the heavy modules again."""
        target = lambda name: modules.get(name) or importlib.import_module(name)  # noqa: E731
        swaps = [_registry.swap(_registry.function_at(target(m), q), self.id, q, *codes) for m, q, *codes in made]
        if None in swaps:
            return None
        module = target(made[0][0])
        if self.check is not None:
            self.check(module)
        return [g for m, read in names.items() for g in needed_globals(target(m), read, self.needs or {})] + swaps


def lacks(name, modname, needs):
    """The reason a patch whose new code reads ``name`` is refused where ``modname`` (and ``needs``) lacks it."""
    return "the new code reads %s, which %s lacks%s" % (name, modname, (
        ", and the installed %s has no %s" % (needs[name], name)) if name in needs else "")


def needed_globals(module, names, needs):
    """``SetAttr`` changes giving ``module`` the globals in ``names`` it lacks, from ``needs`` (``{name: module}``);
    a ShapeError where neither has one."""
    adds = []
    for name in sorted(n for n in names if not hasattr(module, n)):
        source = importlib.import_module(needs[name]) if name in needs else None
        if not hasattr(source, name):
            raise ShapeError(lacks(name, module.__name__, needs))
        adds.append(_registry.SetAttr(module, name, getattr(source, name)))
    return adds


def Backport(*, id, engine, versions, upstream, fixed_in, summary, doc, module=None, function=None,  # noqa: N802
             before=None, after=None, hunks=(), sites=None, needs=None, context=None, check=None, requires=None, memory=None,
             **rule):
    """A declarative backport (patterns: the module docstring), a ``flashfix.core.registry.Patch``.

    Required ``str``s: ``id`` (unique: your own prefix), ``engine`` (``vllm``, ``sglang``,
    ``flashinfer-python``), ``versions`` (PEP 440: where the pre-fix form is patched), ``upstream`` (the PR's
    URL), ``fixed_in``, ``summary`` (a line), ``doc`` (why, how, ``Delete when:``). One hunk: ``module``,
    ``function`` (``"Class.method"``, ``"function"``, a class, or None: the module's top level), ``before``,
    ``after`` (str patterns), and ``Rule``'s optional keywords: ``where``, ``inside`` (str patterns),
    ``fixed_if`` (str or tuple of str: the fix is in; default ``after``; False: none), ``fixed``, ``buggy`` (str reasons,
    ``str.format``: ``{line}``, ``{name}``, ``{form}``, the metavariables), ``constraints`` (dict:
    metavariable -> regex on its code), ``every`` (bool: replace every match), ``parameters``
    (``name=literal`` str(s): new keyword-only parameters), ``absent_unless_mentioned``
    (str: not-affected where the code never mentions it; else an absent target: unknown-shape). ``$SELF``:
    the first parameter; ``$RAN``, a statement of ``after``: the one-time marker. ``hunks``: tuple
    of ``Rule(module, function, before, after, **keywords)``, all applied or none. ``sites``: tuple of
    ``(module, function)``, the first hunk's function per release layout (or per layout, a tuple of one
    ``(module, function)`` per hunk). ``needs``: dict ``{name: module}``, globals the new code reads that the
    target may lack. ``context``: callable ``(tree, func) -> dict`` of bindings for ``after``, or a ``Shape``
    that decides; ``check``: callable ``(module)``, at apply. Each refuses by raising ``ShapeError``
    (``from flashfix.semantic import ShapeError``): unknown-shape, its message the reason. ``requires``:
    ``{distribution: specifiers}`` the fix needs; unmet: known-unfixed. ``memory``: str, the GPU memory it adds. See docs/writing-a-backport.md."""
    delete_when = " ".join(doc.partition("Delete when:")[2].split("\n\n")[0].split()).rstrip(".")
    if not delete_when:
        raise ValueError("backport %s: its doc has no 'Delete when:' paragraph" % id)
    hunks = ((Rule(module, function, before, after, **rule),) if before is not None else ()) + tuple(hunks)
    unbound = [(h.function or h.module, v) for h in hunks for v in h.unbound]
    unbound = unbound if context is None else []
    if unbound:
        raise ValueError("backport %s: `after` of %s uses $%s, which neither `before` nor `where` binds" % ((id,) + unbound[0]))
    for specifiers in [versions] + list((requires or {}).values()):  # a malformed one fails here, not when judged
        _registry.in_range(None, "0", specifiers)
    decl = Declaration(id, hunks, sites, needs, context, check)
    return Patch(id=id, engine=engine, targets=decl.targets if sites else (hunks[0].module,), versions=versions,
                 upstream=upstream, fixed_in=fixed_in, delete_when=delete_when, summary=summary, probe=decl.probe,
                 prepare=decl.prepare, plan=decl.plan, doc=doc, rule=decl, requires=requires, memory=memory)


def Known(*, id, engine, versions, upstream, summary, why_not, shape=None):  # noqa: N802
    """A fix flashfix knows and does not carry, for an engine patch module's ``KNOWN`` (the doctor's
    ``known-unfixed``; never applied). ``shape``: a ``Rule``, ``before`` the affected code; else by version."""
    decl = Declaration(id, (shape,), None, None, None, None) if shape else None
    return Patch(id, engine, (shape.module,) if shape else (), versions, upstream, None, None, summary,  # doc: why_not
                 decl.probe if decl else lambda trees: Shape(BUGGY, "judged by version"), None, None, why_not)
