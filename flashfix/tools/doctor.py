"""``flashfix doctor``: what flashfix would do here, read from distribution metadata and source.

No engine, torch or FlashInfer is imported: each patch's shape probe, the same the runtime gate
uses, reads the target modules' source with ``ast``, located as the import system would (regular,
editable, zipped and sourceless installs alike). The environment read is this interpreter's, or
``--path``'s wheels (never unpacked), site-packages folders and source trees, several forming one
environment, or ``--python``'s interpreter (``flashfix.tools.remote``). The patches judged are this
flashfix's and the packs' installed there (``flashfix.core.packs``); a pack that cannot be loaded
is one line on stderr (exit 1 under ``--strict``). Each row lists the files its verdict was read
from, with their sha256 (``sources``), as provenance for an image pipeline. The text output fits 120
columns (a reason too long to sit beside its row goes below it; a read file's path is as long as it is)
and ends with one line: the rows per verdict, and where every row is not-installed, that there is no
engine to patch (still exit 0).
"""

import importlib
import json
import sys
import textwrap

import flashfix
from flashfix.core import locate as _locate
from flashfix.core import packs as _packs
from flashfix.core import registry as _registry
from flashfix.core import source as _source


def diagnose(reader=None):
    """One dict per patch: id, engine, engine_version, verdict, reason, in_range, upstream,
    fixed_in, sources. ``reader``: the environment to read (default: this interpreter's)."""
    rows, series = [], {}  # per function, the patches judged so far to rewrite it, in series order, as at run time
    with _locate.reading(reader or _locate.reader()), _source.kept():
        patches, cfg = _registry.load_all(), _registry.config()
        for patch in patches:
            with _locate.recording() as sources:
                row = _diagnose_one(patch, cfg, series)
            rows.append(dict(row, sources=sources))
    return rows, cfg


def _diagnose_one(patch, cfg, series):
    version = _registry.engine_version(patch.engine)
    try:
        targets = _registry.targets_of(patch)
    except Exception as exc:
        targets, failure = None, "cannot tell which modules to patch: %r" % (exc,)
    if version is None and (not targets or all(_source.module_file(t) is None for t in targets)):
        verdict, reason = "not-installed", "%s is not installed" % patch.engine
    elif cfg.is_disabled(patch.id, patch.memory):
        verdict, reason = "disabled", cfg.disabled_reason(patch.id, patch.memory)
    elif targets is None:
        verdict, reason = "unknown-shape", failure
    else:
        verdict, reason = _registry.judge(patch, _registry.read_trees(targets), version, series)
    in_range = verdict not in ("not-installed", "disabled") and _registry.in_range(patch, version)
    return {"id": patch.id, "engine": patch.engine, "engine_version": version, "verdict": verdict, "reason": reason,
            "affected_versions": patch.versions, "upstream": patch.upstream, "fixed_in": patch.fixed_in,
            "in_range": in_range, "memory": patch.memory}


def known(reader=None):
    """``known-unfixed`` rows: the uncarried fixes of the engine modules' ``KNOWN`` that affect the environment read."""
    rows = []
    with _locate.reading(reader or _locate.reader()), _source.kept():
        for item in [k for m in flashfix.PATCH_MODULES.values() for k in getattr(importlib.import_module(m), "KNOWN", ())]:
            with _locate.recording() as sources:
                row = _diagnose_one(item, _registry.config(), None)
            if row.pop("in_range") and row["verdict"] in ("patch", "unknown-shape"):
                rows.append(dict(row, verdict="known-unfixed", sources=sources, reason="%s; not carried: %s; %s (%s)" % (
                    item.summary, item.doc, item.upstream, row["reason"])))
    return rows


def check_holds_an_engine(reader, label):
    """SourceError unless ``reader`` (one ``--path`` value) holds an engine flashfix patches, or patch
    packs: a wheel of an unrelated package is a mistake, not an environment without engines."""
    patches = _registry.load_all()
    with _locate.reading(reader):
        if any(_locate.version(p.engine) is not None for p in patches) or any(
                _locate.find(top) is not None for top in flashfix.PATCH_MODULES):
            return
    lister = getattr(reader, "entry_points", None)
    if lister is not None and lister(_packs.GROUP):  # patch packs, read with the engines beside them
        return
    distributions = getattr(reader, "distributions", None)
    names = ["%s %s" % (n, v) for n, v in distributions() if n] if distributions is not None else []
    raise _locate.SourceError("%s holds none of %s%s" % (
        label, ", ".join(sorted({p.engine for p in patches})), " (it holds %s)" % ", ".join(names) if names else ""))


def pack_problems(reader=None):
    """One line per patch pack of the environment read that could not be loaded (skipped)."""
    with _locate.reading(reader or _locate.reader()):
        return _registry.reader_problems()


WIDTH = 120  # the text output's rows fit this many columns, but for a read file's path or a word longer than that


def _row_text(columns, reason):
    """A row of the text output: the reason beside the other columns where it fits in ``WIDTH`` (a reason's
    later lines, a pattern of several lines, under its first), else on the lines below, indented, wrapped."""
    lines = reason.split("\n")
    beside = "\n".join([columns + "  " + lines[0]] + [" " * (len(columns) + 2) + line for line in lines[1:]])
    if all(len(line) <= WIDTH for line in beside.split("\n")):
        return beside + "\n"
    below = [columns.rstrip()]
    for line in lines:
        below += textwrap.wrap(line, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 8,
                               break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join(below) + "\n"


def _stored(rows):
    """``decisions_stored`` for the rows the runtime would apply here (verdict ``patch``)."""
    patches = {p.id: p for p in _registry.load_all()}
    return _registry.decisions_stored([(patches[r["id"]], r["engine_version"]) for r in rows
                                       if r["verdict"] == "patch" and r["id"] in patches])


def summary(rows, stored=None):
    """The text output's last line: the rows per verdict, and, where every row is ``not-installed``, that
    there is no engine to patch (exit 0 all the same: an environment without engines is not an error).
    ``stored``: ``(stored, of)`` decisions for the patches to apply (``flashfix prepare``), None: not told."""
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    text = "summary: " + ", ".join("%d %s" % (n, verdict) for verdict, n in sorted(
        counts.items(), key=lambda item: (-item[1], item[0])))
    if rows and all(r["verdict"] == "not-installed" for r in rows):
        text += "; no engine installed (%s): nothing to patch" % ", ".join(sorted({r["engine"] for r in rows}))
    elif stored is not None and stored[1]:
        text += "; decisions stored: %d/%d%s" % (stored[0], stored[1], "" if stored[0] == stored[1] else
                                                 " (run flashfix prepare)" if len(text) <= WIDTH - 47 else " (prepare)")
    return text


def run(as_json=False, strict=False, out=None, reader=None):
    out = out or sys.stdout
    with _source.kept():  # every patch reads the same few modules: parse each run once
        rows, cfg = diagnose(reader)
        rows += known(reader)
    errors = getattr(reader, "errors", None)
    if errors:  # a member of a wheel that could not be read: the verdicts are not to be trusted
        sys.stderr.writelines("flashfix: %s\n" % problem for problem in errors)
        return 2
    packs = pack_problems(reader)
    sys.stderr.writelines("flashfix: %s\n" % problem for problem in list(cfg.problems) + packs)
    if as_json:
        out.write(json.dumps([{k: v for k, v in r.items() if k != "in_range"} for r in rows], indent=2) + "\n")
    else:
        if reader is not None:
            out.write("environment read: %s\n" % reader.describe())
        headers = ("patch", "engine", "version", "verdict", "reason")
        table = [(r["id"], r["engine"], r["engine_version"] or "-", r["verdict"], r["reason"]) for r in rows]
        widths = [max(len(str(row[i])) for row in table + [headers]) for i in range(4)]
        out.write("  ".join("%-*s" % (w, h) for w, h in zip(widths, headers[:4])) + "  " + headers[4] + "\n")
        for row, r in zip(table, rows):
            out.write(_row_text("  ".join("%-*s" % (w, c) for w, c in zip(widths, row[:4])), row[4]))
            if r.get("memory") and r["verdict"] == "patch":  # what the fix costs, and how to keep the release's sizing
                out.write("\n".join(textwrap.wrap("GPU memory: %s; FLASHFIX_DISABLE=memory keeps the release's sizing"
                                                   % r["memory"], WIDTH, initial_indent=" " * 4,
                                                   subsequent_indent=" " * 6, break_long_words=False)) + "\n")
            for source in r["sources"]:
                out.write("    read %s  sha256:%s\n" % (source["file"], source["sha256"]))
        out.write(summary(rows, _stored(rows) if reader is None else None) + "\n")
    bad = [r for r in rows if r["verdict"] == "unknown-shape" and r["in_range"]]
    if strict and (bad or packs or (cfg.problems and cfg.strict)):
        sys.stderr.writelines("flashfix: %s: %s %s is affected but its code has an unknown shape: %s\n"
                              % (r["id"], r["engine"], r["engine_version"], r["reason"]) for r in bad)
        return 1
    return 0
