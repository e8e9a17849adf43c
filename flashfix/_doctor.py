"""``flashfix doctor``: what flashfix would do here, read from distribution metadata and source.

No engine, torch or FlashInfer is imported: each patch's shape probe reads the target
modules' source with ``ast`` (located as the import system would, through the finders on
``sys.meta_path``: regular, editable, zipped and sourceless installs alike), the same probe
the runtime gate uses once the engine is imported.
"""

import json
import sys

from flashfix import _registry, _source


def diagnose():
    """One dict per patch: id, engine, engine_version, verdict, reason, in_range, upstream, fixed_in."""
    patches = _registry.load_all()
    cfg = _registry.config()
    rows = []
    for patch in patches:
        version = _registry.engine_version(patch.engine)
        in_range = False
        try:
            targets = _registry.targets_of(patch)
        except Exception as exc:
            targets, failure = None, "cannot tell which modules to patch: %r" % (exc,)
        if version is None and (not targets or all(_source.module_file(t) is None for t in targets)):
            verdict, reason = "not-installed", "%s is not installed" % patch.engine
        elif cfg.is_disabled(patch.id):
            verdict, reason = "disabled", "disabled by FLASHFIX_DISABLE"
        elif targets is None:
            verdict, reason, in_range = "unknown-shape", failure, _registry.in_range(patch, version)
        else:
            verdict, reason = _registry.judge(patch, _registry.read_trees(targets), version)
            in_range = _registry.in_range(patch, version)
        _source.forget()
        rows.append({
            "id": patch.id,
            "engine": patch.engine,
            "engine_version": version,
            "verdict": verdict,
            "reason": reason,
            "affected_versions": patch.versions,
            "upstream": patch.upstream,
            "fixed_in": patch.fixed_in,
            "in_range": in_range,
        })
    return rows, cfg


def run(as_json=False, strict=False, out=None):
    out = out or sys.stdout
    rows, cfg = diagnose()
    for problem in cfg.problems:
        sys.stderr.write("flashfix: %s\n" % problem)
    if as_json:
        out.write(json.dumps([{k: v for k, v in r.items() if k != "in_range"} for r in rows], indent=2) + "\n")
    else:
        headers = ("patch", "engine", "version", "verdict", "reason")
        table = [(r["id"], r["engine"], r["engine_version"] or "-", r["verdict"], r["reason"]) for r in rows]
        widths = [max(len(str(row[i])) for row in table + [headers]) for i in range(4)]
        line = "  ".join("%-*s" % (w, h) for w, h in zip(widths, headers[:4])) + "  " + headers[4]
        out.write(line + "\n")
        for row in table:
            out.write("  ".join("%-*s" % (w, c) for w, c in zip(widths, row[:4])) + "  " + row[4] + "\n")
    bad = [r for r in rows if r["verdict"] == "unknown-shape" and r["in_range"]]
    if strict and (bad or (cfg.problems and cfg.strict)):
        for r in bad:
            sys.stderr.write("flashfix: %s: %s %s is affected but its code has an unknown shape: %s\n"
                             % (r["id"], r["engine"], r["engine_version"], r["reason"]))
        return 1
    return 0
