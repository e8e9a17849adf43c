"""``flashfix diff``: the engine code as installed against the code flashfix runs once it applies.

Nothing of the engine is imported: as for ``flashfix doctor``, the source is read through the
current reader (this interpreter, ``--path`` or ``--python``) and each patch that the doctor
says would apply is planned from that source alone:

* a rewritten function (``_registry.rewrite``): the patch's own AST edit run on the def node
  read from the source, written back as text by ``_source.render_edit`` (``flashfix.core.render``),
  the very text the runtime compiles, so the diff printed is the code that runs. The one-time
  marker statement (``__flashfix_mark__``) is named in the header; ``--marker`` shows it.
* a replaced function or an added name (``_registry.SetAttr``): the replacement's source in
  flashfix, and the installed function it delegates to, with file and lines.

A plan is the edit the runtime's ``prepare`` makes from imported modules, made from source: each
``Patch``'s own ``plan(planner)`` runs its edits through ``Planner``. Nothing here knows any engine;
a test compares the printed result, compiled, with the code the runtime swaps in on real releases.
"""

import ast
import copy
import difflib
import inspect
import sys
from collections import namedtuple

from flashfix.core import locate as _locate
from flashfix.core import registry as _registry
from flashfix.core import source as _source
from flashfix.core.render import _lines
from flashfix.core.source import ShapeError


class Rewrite(namedtuple("Rewrite", "patch_id module qualname origin text rendered site edited")):
    kind = "rewrite"  # edited: the def node after the edit (markers included)

    def write(self, out, marker):
        rendered = self.rendered
        out.write("# %s.%s: %s\n" % (self.module, self.qualname or "<module>", "recompiled from the text below and "
                  "swapped into the existing function object" if self.edited is not None else "the new statements below "
                  "run in its namespace when the patch applies,\n# and the names they bind are set on it (setattr, undone "
                  "by revert())"))
        marks = _marker_lines(rendered)
        if marks and not marker:
            out.write("# until its first run it also runs %s, %s;\n"
                      "# it records that the fix ran (status()['ran']) and swaps in this code (flashfix diff --marker"
                      " shows it)\n" % ("one marker line" if len(marks) == 1 else "a marker line in each changed branch",
                                         "; ".join("`%s`, reported as installed line %d" % m for m in marks)))
        for text, at in marks if marker else ():
            out.write("# shown with its one-time marker line `%s` (reported as installed line %d): it records that "
                      "the\n# fix ran (status()['ran']) at the first run, then the same code without that line is "
                      "swapped in\n" % (text, at))
        if rendered.whole:
            out.write("# the function is written whole by ast.unparse (its installed text could not hold the edit)\n")
        out.writelines(_file_diff(self.text, rendered, rendered.MARKED if marker else rendered.PLAIN))


class Replace(namedtuple("Replace", "module owner name replacement call delegate")):
    """``replacement``: the flashfix function whose source is shown; ``call``: how the runtime builds
    the value, e.g. "_wrap_init(<the installed __init__>, ...)"; ``delegate``: the ``Location`` of the
    installed function it calls, or None."""

    kind = "replace"

    def write(self, out, marker=False):
        out.write("# %s.%s.%s is replaced (setattr) by %s, defined in flashfix below\n"
                  % (self.module, self.owner, self.name, self.call))
        if self.delegate is not None:
            out.write("# the installed %s (%s) stays as it is; the replacement calls it for every case it does not "
                      "handle\n" % (self.delegate.qualname, self.delegate.where()))
        try:
            (lines, first), file = inspect.getsourcelines(self.replacement), inspect.getsourcefile(self.replacement)
        except (OSError, TypeError):
            out.write("# (the source of %r is not available)\n" % (self.replacement,))
            return
        out.write("--- %s.%s.%s (installed: %s)\n+++ %s lines %d-%d\n@@ -0,0 +%d,%d @@\n" % (
            self.module, self.owner, self.name, self.delegate.where() if self.delegate else "-", file, first,
            first + len(lines) - 1, first, len(lines)))
        out.writelines("+" + line if line.endswith("\n") else "+" + line + "\n" for line in lines)


class AddName(namedtuple("AddName", "module origin name value defined")):
    kind = "add-name"

    def write(self, out, marker=False):
        where = self.defined.origin + " line %d" % self.defined.first if self.defined else "its source not found"
        out.write("# a module global is added at runtime (no line of the file changes): %s.%s = %s (%s)\n"
                  "--- %s (module globals, installed)\n+++ %s (module globals, as flashfix runs it)\n@@ globals @@\n"
                  "+%s = %s\n" % (self.module, self.name, self.value, where, self.origin, self.origin,
                                   self.name, self.value))


class Location(namedtuple("Location", "module qualname origin first last")):
    """Where a def or class of ``module`` stands: its first line (decorators included) to its last."""

    def where(self):
        return "%s lines %d-%d" % (self.origin, self.first, self.last)


class Series(namedtuple("Series", "module qualname members origin text rendered")):
    """A function that several patches rewrite: the installed text against the code the whole series runs,
    its members' edits made in series order (``_registry.series_trees``), compiled once from this text."""

    def write(self, out, marker=False):
        out.write("=" * 100 + "\n")
        out.write("series of %s.%s: %s, in this order; the function is compiled once from the text below\n" % (
            self.module, self.qualname, ", ".join(self.members)))
        if self.rendered.whole:
            out.write("# the function is written whole by ast.unparse (its installed text could not hold the edits)\n")
        out.writelines(_file_diff(self.text, self.rendered, self.rendered.PLAIN))


class OnSeries(namedtuple("OnSeries", "patch_id module qualname origin text rendered earlier")):
    """A patch planned on the code the patches before it in its functions' series leave (``earlier``, their ids):
    ``text``, the module's source with that code in place of the function; ``rendered``, this patch's edit of it."""
    kind = "series"

    def write(self, out, marker=False):
        out.write("# %s.%s: this patch's own change, on the code %s leave(s) before it in the function's series (line\n"
                  "# numbers of that text); the function is compiled once from the whole series (flashfix diff --series)\n"
                  % (self.module, self.qualname, ", ".join(self.earlier)))
        if self.rendered.whole:
            out.write("# the function is written whole by ast.unparse (that text could not hold the edit)\n")
        lines = _lines(self.text, closed=True)
        end = self.rendered.start + len(_lines(self.rendered.before)) - 1
        after = lines[: self.rendered.start - 1] + _lines(self.rendered.text(self.rendered.PLAIN)) + lines[end:]
        out.writelines(difflib.unified_diff(lines, after, "%s (as %s leave(s) it)" % (self.origin, ", ".join(
            self.earlier)), "%s (with %s)" % (self.origin, self.patch_id), n=3))


class PatchDiff:
    def __init__(self, patch, verdict, reason, version):
        self.patch, self.verdict, self.reason, self.version = patch, verdict, reason, version
        self.changes, self.problem = [], None


# --- reading definitions from source --------------------------------------------------------


def _module(name):
    found = _locate.find(name)
    if found is None:
        raise ShapeError("module %s not found" % name)
    if found.text is None:
        raise ShapeError("module %s has no source (%s)" % (name, found.origin))
    return found, _source.parse_text(found.text, found.origin)


def locate(module, qualname):
    """Where ``module``'s ``qualname`` (a function or class) is defined, from source."""
    found, tree = _module(module)
    node = _source.find_def(tree, qualname)
    if node is None:
        raise ShapeError("%s has no %s" % (module, qualname))
    return Location(module, qualname, found.origin, _source._first_line(node), node.end_lineno)


def _resolve(module, node):
    if not node.level:
        return node.module
    package = module.split(".")
    found = _locate.find(module)
    is_package = found is not None and found.origin and found.origin.replace("\\", "/").endswith("/__init__.py")
    base = package if is_package else package[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


binds = _source.binds  # what ``hasattr(module, name)`` would say once imported, read from source


def definition(module, name, depth=0):
    """Location of the def/class that ``module``'s global ``name`` is, following
    ``from x import name`` and ``from x import *`` re-exports; None if it cannot be told from source."""
    try:
        found, tree = _module(module)
        node = _source.find_def(tree, name)
    except ShapeError:  # no source, or bound in a way the source cannot tell
        return None
    if node is not None:
        return Location(module, name, found.origin, _source._first_line(node), node.end_lineno)
    if depth >= 5:
        return None
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    source = _resolve(module, stmt)
                    if _locate.find("%s.%s" % (source, alias.name)) is not None:  # ``from pkg import submodule``
                        return None
                    return definition(source, alias.name, depth + 1)
    if any(_source._bindings(statement, name) for statement in tree.body):  # bound here, not by a def
        return None
    stars = [s for s in ast.walk(tree) if isinstance(s, ast.ImportFrom) and s.names[0].name == "*"]
    for star in reversed(stars):  # bound, if at all, by a star import: the last one that binds it wins
        if binds(_resolve(module, star), name, depth + 1):
            return definition(_resolve(module, star), name, depth + 1)
    return None


# --- plans: each patch's changes, made from source ----------------------------------------


class Planner:
    """What a plan uses to describe a patch's changes from the source read."""

    def __init__(self, patch_id):
        self.patch_id, self.changes = patch_id, []

    def rewrite(self, module, qualname, edit):
        """``edit(def_node, mark)`` on ``module``'s ``qualname``, as ``_registry.rewrite``
        runs it on the imported function (same marker site)."""
        found, tree = _module(module)
        node = _source.find_def(tree, qualname)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise ShapeError("%s has no function %s" % (module, qualname))
        site = _registry.site_of(self.patch_id, qualname)
        edited = copy.deepcopy(node)
        edit(edited, _source.marker(site))
        rendered = _source.render_edit(found.text, node, edited, found.origin)
        self.changes.append(Rewrite(self.patch_id, module, qualname, found.origin, found.text, rendered, site, edited))
        return self.changes[-1]

    def replace(self, module, owner, name, replacement, call, delegate=None):
        where = locate(module, delegate) if delegate else None
        self.changes.append(Replace(module, owner, name, replacement, call, where))

    def add_name(self, module, name, from_module, from_name):
        found = _locate.find(module)
        self.changes.append(AddName(module, found.origin if found else module, name,
                                    "%s.%s" % (from_module, from_name), definition(from_module, from_name)))


def series(diffs, reader=None, functions=None):
    """A ``Series`` for each function that more than one patch of ``diffs`` (``plan``'s of every patch, in series
    order) that would apply declares; ``functions``: only these ``(module, qualname)``s."""
    members = {}
    for result in diffs:
        for function in sorted(_registry._declared_functions(result.patch)) if result.verdict == "patch" else ():
            members.setdefault(function, []).append(result.patch)
    out = []
    with _locate.reading(reader or _locate.reader()):
        for (module, qualname), patches in members.items():
            if len(patches) < 2 or functions is not None and (module, qualname) not in functions:
                continue
            try:
                found, tree = _module(module)
                original = _source.find_def(tree, qualname)
                if not isinstance(original, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue  # not in this layout (a declaration's other sites)
                copies = _registry.series_trees(patches, {module: tree})
                rendered = _source.render_edit(found.text, original, _source.find_def(copies[module], qualname),
                                               found.origin)
            finally:
                _source.forget()
            out.append(Series(module, qualname, [p.id for p in patches], found.origin, found.text, rendered))
    return out


def plan(ids=None, reader=None):
    """One ``PatchDiff`` per patch (those named, else all), planned from the source read."""
    from flashfix.tools import doctor as _doctor

    with _locate.reading(reader or _locate.reader()):
        rows, _ = _doctor.diagnose()
        patches = {p.id: p for p in _registry.load_all()}
        out, applying = [], [patches[r["id"]] for r in rows if r["verdict"] == "patch"]  # in series order
        for row in [r for r in rows if not ids or r["id"] in ids]:
            result = PatchDiff(patches[row["id"]], row["verdict"], row["reason"], row["engine_version"])
            out.append(result)
            if row["verdict"] != "patch":
                continue
            planner = result.patch.plan
            if planner is None:
                result.problem = "the patch declares no source-only plan: its code cannot be shown"
                continue
            recorder = Planner(row["id"])
            mine = _registry._declared_functions(result.patch)
            earlier = [p for p in applying[:applying.index(result.patch)] if _registry._declared_functions(p) & mine]
            try:
                planner(recorder)
            except ShapeError as exc:  # where it is judged on the code earlier members leave, planned on it
                result.problem = "would not apply: %s" % exc
                try:
                    result.changes, result.problem = (_on_series(result.patch, earlier), None) if earlier else ([], result.problem)
                except ShapeError as again:
                    result.problem = "would not apply on the code %s leave(s): %s" % (", ".join(p.id for p in earlier), again)
            else:
                result.changes = recorder.changes
            finally:
                _source.forget()
    return out


def _on_series(patch, earlier):
    """``OnSeries`` changes of ``patch`` on the code the ``earlier`` members of its series leave: that code written
    as text (the text the runtime would compile for them), then this patch's edit rendered on it."""
    changes = []
    for module, qualname in sorted(_registry._declared_functions(patch)):
        found, tree = _module(module)
        original = _source.find_def(tree, qualname)
        if not isinstance(original, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # a site of another layout
        left = _source.render_edit(found.text, original, _source.find_def(
            _registry.series_trees(earlier, {module: tree})[module], qualname), found.origin)
        lines, end = _lines(found.text, closed=True), left.start + len(_lines(left.before)) - 1
        text = "".join(lines[: left.start - 1] + _lines(left.text(left.PLAIN)) + lines[end:])
        base = _source.parse_text(text, found.origin)
        node, edited = _source.find_def(base, qualname), _source.find_def(
            _registry.series_trees([patch], {module: base})[module], qualname)
        if ast.dump(node) != ast.dump(edited):  # (else the patch changes nothing here)
            changes.append(OnSeries(patch.id, module, qualname, found.origin, text,
                                    _source.render_edit(text, node, edited, found.origin), [p.id for p in earlier]))
    return changes


# --- printing ---------------------------------------------------------------------------------


def _file_diff(text, rendered, version):
    """Unified diff of the installed file against it with the function's lines replaced by
    ``rendered.text(version)``: hunk line numbers are the installed file's."""
    lines = _lines(text, closed=True)
    end = rendered.start + len(_lines(rendered.before)) - 1
    after = lines[: rendered.start - 1] + _lines(rendered.text(version)) + lines[end:]
    return difflib.unified_diff(lines, after, rendered.origin, "%s (as flashfix runs it)" % rendered.origin, n=3)


def _marker_lines(rendered):
    """``[(marker line text, installed line it reports as)]``."""
    plain = set(_lines(rendered.text(rendered.PLAIN)))
    return [(line.strip(), at) for line, at in zip(_lines(rendered.text(rendered.MARKED)),
                                                   rendered.line_map(rendered.MARKED))
            if _source.MARK_NAME in line and line not in plain]


def write(diffs, out, marker=False):
    problems = 0
    for result in diffs:
        patch = result.patch
        head = "%s (%s %s)" % (patch.id, patch.engine, result.version or "-")
        if result.verdict != "patch":
            out.write("%s: not applied: %s: %s\n" % (head, result.verdict, result.reason))
            continue
        if result.problem:
            problems += 1
            out.write("%s: %s\n" % (head, result.problem))
            continue
        out.write("=" * 100 + "\n")
        out.write("%s: applies (%s); %d change%s, %s\n" % (head, result.reason, len(result.changes),
                                                          "" if len(result.changes) == 1 else "s", patch.upstream))
        for change in result.changes:
            out.write("\n")
            change.write(out, marker)
    return problems


def run(ids=None, reader=None, marker=False, out=None, whole_series=False):
    """``flashfix diff``: 0 when every patch named could be shown, 1 when one that would
    apply cannot be planned from source, 2 for an unknown id. ``whole_series``: then, for each function that
    several of them rewrite, the code the whole series runs (``Series``)."""
    out = out or sys.stdout
    with _locate.reading(reader or _locate.reader()):
        known = [p.id for p in _registry.load_all()]
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        sys.stderr.write("flashfix diff: unknown patch id(s) %s; valid: %s\n" % (", ".join(unknown), ", ".join(known)))
        return 2
    diffs = plan(ids, reader)
    errors = list(getattr(reader, "errors", None) or ())
    from flashfix.tools import doctor as _doctor

    sys.stderr.writelines("flashfix diff: %s\n" % p for p in errors or _doctor.pack_problems(reader))
    if errors:
        return 2
    if reader is not None:
        out.write("environment read: %s\n" % reader.describe())
    problems = write(diffs, out, marker)
    if whole_series:
        try:
            shown = {f for d in diffs if d.verdict == "patch" for f in _registry._declared_functions(d.patch)}
            for found in series(plan(None, reader) if ids else diffs, reader, shown):  # every member, named or not
                out.write("\n")
                found.write(out)
        except ShapeError as exc:
            out.write("series: cannot be shown: %s\n" % exc)
            problems += 1
    return 1 if problems else 0
