#!/usr/bin/env python3
"""The changed hunks of the FlashInfer-backend files, release against release: find the next fix.

    python scripts/release_hunks.py                        # every pair of consecutive final releases
    python scripts/release_hunks.py --only sglang==0.5.17,sglang==0.5.18 --diff
    python scripts/release_hunks.py --engine vllm --since vllm=0.28.0 --json hunks.json --uncovered

For each engine, each pair of consecutive final releases on the package index (or of the releases
``--only`` names, in version order), every file of the engine's FlashInfer file set (``FILES``
below: glob patterns, so a file that moves is still read) is diffed, old against new, and each
hunk is listed with the functions its changed lines fall in (``Class.method``; ``<module>`` for
top-level code). Nothing is installed: the wheels are read as ``sweep_releases.py`` reads them
(``remotezip``: the zip's central directory, then the members wanted, fetched with HTTP range
requests, neighbouring members in one request).

A hunk is **covered** by a carried fix (a patch of this flashfix, or of the ``--pack`` modules)
when both hold:

1. the doctor judges the older release ``patch`` and the newer one ``fixed-upstream``: the patch
   carries the change this pair of releases made;
2. the hunk changes a line the patch's declaration matches, in a function it declares (``sites``
   included): a ``before`` form in the older release, or a fixed form (``after``/``fixed_if``) in
   the newer one. A hand-written patch (no declaration) matches its target modules whole.

Everything else is **uncovered**: a refactor, a feature, or a fix that nothing carries yet; that
is the list to read. A hunk whose file is new or gone in the pair is one hunk ``added`` /
``removed`` (a file that moved to a path with the same file name is diffed against its old self).

Exit status: 0 done, 2 bad arguments, 3 the index or a wheel could not be read.
"""

import argparse
import ast
import concurrent.futures
import difflib
import json
import re
import struct
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_releases as sweep  # noqa: E402  (also puts this checkout's flashfix first)

from packaging.version import Version  # noqa: E402

from flashfix import semantic  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

# Each engine's FlashInfer file set: (glob, word). A file matching the glob is read; with a word,
# only if it imports a module of that name (``import flashinfer.x``, ``from vllm.utils.flashinfer
# import ...``): the files that call FlashInfer. ``**/`` spans folders, ``*`` stays inside one.
# The modules the carried patches edit are added to the set.
FILES = {
    "vllm": (
        ("vllm/v1/attention/backends/flashinfer*.py", None),
        ("vllm/v1/attention/backends/mla/**/*flashinfer*.py", None),
        ("vllm/v1/attention/backends/mla/**/trtllm*.py", None),
        ("vllm/v1/attention/backends/**/*.py", "flashinfer"),
        ("vllm/model_executor/layers/attention/mla_attention.py", None),
        ("vllm/utils/flashinfer.py", None),
        ("vllm/v1/sample/ops/topk_topp_sampler.py", None),
        ("vllm/model_executor/layers/**/*.py", "flashinfer"),
    ),
    "sglang": (
        ("sglang/srt/layers/attention/flashinfer*_backend.py", None),
        ("sglang/srt/layers/sampler.py", None),
        ("sglang/srt/layers/**/*.py", "flashinfer"),
        ("sglang/srt/speculative/**/*.py", "flashinfer"),
        ("sglang/srt/model_executor/**/*.py", "flashinfer"),
    ),
}
CONTEXT = 3  # lines of context around a hunk, as ``diff -u``
GAP = 256 * 1024  # members closer than this in the zip are fetched in one request


def _glob(pattern):
    out = ""
    for part in re.split(r"(\*\*/|\*|\?)", pattern):
        out += {"**/": "(?:.*/)?", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
    return re.compile(out + r"\Z")


def _imports(word):
    """A file imports ``word`` or a module of that last name (``from vllm.utils.flashinfer import``)."""
    return re.compile(r"^\s*(?:from|import)\s+(?:[\w.]*\.)?%s\b(?![\w])" % word, re.M)


def file_set(dist, names, read, also=()):
    """``{path: text}`` of the files of ``dist``'s set among the archive member ``names``, and of
    the modules ``also`` (the carried patches' sites); ``read(paths)`` gives ``{path: text}``."""
    rules = [(_glob(g), _imports(w) if w else None) for g, w in FILES[dist]]
    rules += [(_glob(m.replace(".", "/") + suffix), None) for m in also for suffix in (".py", "/__init__.py")]
    wanted = sorted({n for n in names for g, _ in rules if g.match(n)})
    texts = read(wanted)
    return {n: t for n, t in texts.items() if any(g.match(n) and (w is None or w.search(t)) for g, w in rules)}


def read_members(archive, infos, http):
    """``{name: text}`` of the zip members ``infos`` of the remote ``archive``: members lying
    within ``GAP`` bytes of each other are fetched in one range request, each checked by its CRC."""
    out, infos = {}, sorted(infos, key=lambda i: i.header_offset)
    runs = []
    for info in infos:
        if runs and info.header_offset - (runs[-1][-1].header_offset + runs[-1][-1].compress_size + 1024) < GAP:
            runs[-1].append(info)
        else:
            runs.append([info])
    for run in runs:
        start, end = run[0].header_offset, run[-1].header_offset + run[-1].compress_size + 1024 + len(run[-1].filename)
        answer = http.get(archive.url, headers={"Range": "bytes=%d-%d" % (start, end)}, timeout=sweep.TIMEOUT)
        answer.raise_for_status()
        data = answer.content
        for info in run:
            at = info.header_offset - start
            name_len, extra_len = struct.unpack("<HH", data[at + 26:at + 30])
            raw = data[at + 30 + name_len + extra_len:at + 30 + name_len + extra_len + info.compress_size]
            body = zlib.decompress(raw, -15) if info.compress_type == 8 else raw
            if info.compress_type not in (0, 8) or zlib.crc32(body) != info.CRC:
                raise sweep.NetworkError("%s: member %s did not read back whole" % (archive.url, info.filename))
            out[info.filename] = body.decode("utf-8", "replace")
    return out


def read_release(dist, version, wheel):
    """One release: its version, the doctor's verdict per patch, and its file set's texts."""
    row = {"dist": dist, "version": version}
    if wheel is None:
        return dict(row, note="no wheel to read", files={}, verdicts={})
    archive, _ = sweep.open_wheel(wheel["url"])
    archive.url = wheel["url"]
    try:
        http = sweep.session()
        by_name = {i.filename: i for i in archive.infolist()}
        also = {module for patch in sweep.patches_of(dist) for module, _ in sites(patch)}
        files = file_set(dist, list(by_name), lambda names: read_members(archive, [by_name[n] for n in names], http), also)
        try:
            _, verdicts = sweep.judge_archive(archive, wheel["filename"], dist)
        finally:
            sweep._source.forget()
    except (sweep.requests.RequestException, sweep.RemoteZipError, OSError, zlib.error) as exc:
        raise sweep.NetworkError("cannot read the wheel %s: %s" % (wheel["url"], exc)) from None
    finally:
        archive.close()
    return dict(row, files=files, verdicts={pid: v for pid, (v, _) in verdicts.items()})


# --- hunks ---------------------------------------------------------------------------------------


def spans(text):
    """``[(first line, last line, qualname)]`` of every function and class of a module's source
    (decorators included); empty when it does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append((first, child.end_lineno, prefix + child.name))
                walk(child, prefix + child.name + ".")
            elif not isinstance(child, (ast.expr, ast.stmt)) or hasattr(child, "body"):
                walk(child, prefix)
    walk(tree, "")
    return out


def _where(lines, table):
    """The innermost qualnames holding each of ``lines`` (1-based); ``<module>`` outside any."""
    found = set()
    for line in lines:
        inner = [(last - first, name) for first, last, name in table if first <= line <= last]
        found.add(min(inner)[1] if inner else "<module>")
    return found


def hunks(old, new):
    """The hunks of ``old`` -> ``new`` (texts; either None for an added or removed file): each
    ``{"old": [start, count], "new": [start, count], "functions": [...], "lines": [...]}``."""
    if old is None or new is None:
        text = new if old is None else old
        every = list(range(1, len(text.splitlines()) + 1))
        return [{"change": "added" if old is None else "removed", "old": [0, 0] if old is None else [1, len(every)],
                 "new": [1, len(every)] if old is None else [0, 0],
                 "functions": sorted({name for _, _, name in spans(text) if "." not in name}) or ["<module>"],
                 "lines": [], "_old": [] if old is None else every, "_new": every if old is None else []}]
    a, b = old.splitlines(), new.splitlines()
    table_a, table_b = spans(old), spans(new)
    out = []
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(CONTEXT):
        body, changed_a, changed_b = [], [], []
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                body += [" " + line for line in a[i1:i2]]
                continue
            body += ["-" + line for line in a[i1:i2]] + ["+" + line for line in b[j1:j2]]
            changed_a += range(i1 + 1, i2 + 1)
            changed_b += range(j1 + 1, j2 + 1)
        first, last = group[0], group[-1]
        out.append({"change": "changed", "old": [first[1] + 1, last[2] - first[1]], "new": [first[3] + 1, last[4] - first[3]],
                    "functions": sorted(_where(changed_a, table_a) | _where(changed_b, table_b)), "lines": body,
                    "_old": changed_a, "_new": changed_b})
    return out


def _file_of(module, names):
    base = module.replace(".", "/")
    return next((n for n in (base + ".py", base + "/__init__.py") if n in names), None)


def sites(patch):
    """``[(module, qualname or None)]``: where ``patch`` edits (None: anywhere in the module)."""
    decl = patch.rule
    if decl is None:
        targets = patch.targets if isinstance(patch.targets, tuple) else ()
        return [(module, None) for module in targets]
    return sorted({(h.module, h.function) for h in decl.hunks} | set(decl.sites))


def matched_lines(patch, path, release, fixed):
    """The lines of ``path`` in ``release`` that ``patch`` matches: its ``before`` forms (``fixed``
    false) or its fixed forms (``after``/``fixed_if``, ``fixed`` true), in each function it
    declares; every line of the file for a hand-written patch's target module."""
    text = release["files"].get(path)
    if text is None:
        return set()
    if patch.rule is None:
        return set(range(1, len(text.splitlines()) + 1)) if any(
            _file_of(m, release["files"]) == path for m, _ in sites(patch)) else set()
    tree, lines = ast.parse(text), set()
    for index, rule in enumerate(patch.rule.hunks):
        for module, function in {(rule.module, rule.function)} | (set(patch.rule.sites) if index == 0 else set()):
            func = _source.find_def(tree, function) if _file_of(module, release["files"]) == path else None
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            scopes, given = rule._scopes(func), rule._given(func)
            for form in rule.fixed_if if fixed else [rule.before]:
                for node, _ in semantic.find(form, scopes, given):
                    first, last = (node.body[0], node.body[-1]) if isinstance(node, semantic.Block) else (node, node)
                    lines.update(range(first.lineno, last.end_lineno + 1))
    return lines


def coverage(patches, path, hunk, old, new):
    """The ids of the patches that cover ``hunk`` of ``path`` in the pair ``old`` -> ``new``: the
    doctor judges ``old`` ``patch`` and ``new`` ``fixed-upstream``, and the hunk changes a line
    that the patch matches (a ``before`` form in ``old`` or a fixed form in ``new``)."""
    return [patch.id for patch in patches
            if old["verdicts"].get(patch.id) == "patch" and new["verdicts"].get(patch.id) == "fixed-upstream"
            and (set(hunk["_old"]) & matched_lines(patch, hunk["_path_old"], old, False)
                 or set(hunk["_new"]) & matched_lines(patch, path, new, True))]


def pair(old, new, patches):
    """The hunks of one pair of releases, each with its file and the patches that cover it."""
    moved = {}
    gone, added = set(old["files"]) - set(new["files"]), set(new["files"]) - set(old["files"])
    for path in sorted(added):
        same = [p for p in gone if p.rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1] and p not in moved]
        if len(same) == 1:
            moved[same[0]] = path
    rows = []
    for path in sorted(set(old["files"]) | set(new["files"])):
        if path in moved or (path in added and path in moved.values()):
            continue
        before = old["files"].get(path)
        after = new["files"].get(path)
        label = source = path
        for was, target in moved.items():
            if target == path:
                before, label, source = old["files"][was], "%s -> %s" % (was, path), was
        if before == after:
            continue
        for hunk in hunks(before, after):
            hunk["_path_old"] = source
            covered = coverage(patches, path, hunk, old, new)
            rows.append(dict({k: v for k, v in hunk.items() if not k.startswith("_")}, file=label, covered_by=covered))
    return rows


# --- the command ---------------------------------------------------------------------------------


def plan(only, since, engines):
    """[(dist, version, wheel)] to read, oldest first per engine."""
    todo = sweep.plan(only, since, dists=engines)
    return [(dist, version, wheel) for dist, version, wheel, _ in todo]


def run(todo, patches, jobs=4):
    """[{"dist", "old", "new", "hunks"}] for each pair of consecutive releases of ``todo``."""
    _registry.load_all()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        read = list(pool.map(lambda item: read_release(*item), todo))
    out = []
    for old, new in zip(read, read[1:]):
        if old["dist"] != new["dist"]:
            continue
        mine = [p for p in patches if sweep.canonicalize_name(p.engine) == old["dist"]]
        out.append({"dist": old["dist"], "old": old["version"], "new": new["version"],
                    "note": old.get("note") or new.get("note"), "hunks": pair(old, new, mine)})
    return out


def print_text(pairs, out=sys.stdout, diff=False, uncovered=False):
    for p in pairs:
        shown = [h for h in p["hunks"] if not (uncovered and h["covered_by"])]
        out.write("%s %s -> %s: %d hunks, %d covered%s\n" % (
            p["dist"], p["old"], p["new"], len(p["hunks"]), sum(1 for h in p["hunks"] if h["covered_by"]),
            " (%s)" % p["note"] if p["note"] else ""))
        for h in shown:
            state = "covered by " + ", ".join(h["covered_by"]) if h["covered_by"] else "uncovered"
            out.write("  %s @@ -%d,%d +%d,%d @@ %s%s  [%s]\n" % (
                h["file"], h["old"][0], h["old"][1], h["new"][0], h["new"][1], ", ".join(h["functions"]),
                "" if h["change"] == "changed" else " (file %s)" % h["change"], state))
            if diff:
                out.writelines("      %s\n" % line for line in h["lines"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="a comma list of DIST==VERSION: their consecutive pairs instead of every release")
    parser.add_argument("--since", default="", help="DIST=VERSION[,...]: oldest release per engine (defaults: %s)"
                        % ", ".join("%s=%s" % (d, sweep.FLOORS[d]) for d in FILES))
    parser.add_argument("--engine", action="append", choices=sorted(FILES), help="only this engine (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write every pair's hunks, with their lines, here")
    parser.add_argument("--diff", action="store_true", help="print each hunk's lines under it")
    parser.add_argument("--uncovered", action="store_true", help="print only the hunks no carried fix covers")
    parser.add_argument("--jobs", type=int, default=4, help="wheels read at once (threads; at most %d)" % sweep.MAX_JOBS)
    parser.add_argument("--pack", action="append", default=[], metavar="MODULE",
                        help="judge coverage by this patch pack's PATCHES instead of every patch (repeatable)")
    args = parser.parse_args(argv)
    try:
        only = sweep.parse_only(args.only) if args.only is not None else None
        since = {}
        for item in filter(None, (p.strip() for p in args.since.split(","))):
            dist, _, version = item.partition("=")
            since[sweep.canonicalize_name(dist)] = Version(version.strip()).public
        engines = [d for d in FILES if (not args.engine or d in args.engine)
                   and (only is None or any(dist == d for dist, _ in only))]
        if only is not None and any(dist not in FILES for dist, _ in only):
            raise ValueError("--only names an engine without a FlashInfer file set (one of %s)" % ", ".join(FILES))
        sweep.use_packs(args.pack)
    except ValueError as exc:
        parser.error(str(exc))
    if not 1 <= args.jobs <= sweep.MAX_JOBS:
        parser.error("--jobs must be 1 to %d" % sweep.MAX_JOBS)
    try:
        todo = plan(only, since, engines)
        pairs = run(todo, [p for d in engines for p in sweep.patches_of(d)], args.jobs)
    except sweep.NetworkError as exc:
        sys.stderr.write("release_hunks: network failure: %s\n" % exc)
        return 3
    except LookupError as exc:
        sys.stderr.write("release_hunks: %s\n" % exc)
        return 2
    print_text(pairs, diff=args.diff, uncovered=args.uncovered)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"files": {d: FILES[d] for d in engines}, "pairs": pairs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
