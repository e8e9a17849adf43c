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

The hunks of a pair are listed **ranked**, the ones shaped like a fix first (``rank`` below): a hunk
whose changed lines touch a FlashInfer call, a ``plan()``/``begin_forward()`` argument, an LSE, a
buffer size or index/indptr arithmetic; then other code changes; then refactors (imports, renames,
moved code, removed functions), new features (new files, functions, classes), and last the hunks that
change only comments, docstrings or logging. Under each hunk a ``why:`` line gives its rank and the
reason. ``--limit N`` prints only the first N hunks of each pair (the JSON keeps them all).

Exit status: 0 done, 2 bad arguments, 3 the index or a wheel could not be read.
"""

import argparse
import ast
import collections
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
    rows, read = [], []
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
            read.append((hunk, before, after))
    for row, info in zip(rows, rank(read)):
        row.update(info)
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["tier"], -rows[i]["score"], rows[i]["changed"], i))
    rows = [rows[i] for i in order]
    for number, row in enumerate(rows, 1):
        row["rank"] = number
    return rows


# --- ranking -------------------------------------------------------------------------------------
#
# Each hunk's changed lines (its "-" lines, read in the old text, and its "+" lines, read in the new
# one; a line's comment is not read) are scored, and the hunks are listed by (tier, -score, number of
# changed lines, file order). The tiers, first to last:
#
#   0 fix-shaped  a changed line shows a SIGNAL: it calls FlashInfer or is an argument of such a call
#                 (a ``*wrapper*``, ``flashinfer.*``, ``trtllm_*``, ``merge_state*``, ``xqa*``,
#                 ``cute_dsl*``, ``Batch{Prefill,Decode,MLA}*`` callee, or a name imported from the
#                 ``flashinfer`` package), is a ``plan()``/``*_plan()``/``*begin_forward()``/
#                 ``fast_*plan*()`` call or argument (also a line 3 lines from one, as
#                 ``args = [..., +0]; wrapper.plan(*args)``), reads or writes an LSE, sizes a buffer
#                 (the shape of a ``torch.empty/zeros/ones/full`` or ``.new_*`` call), or indexes,
#                 computes with or assigns an index/length (``*indptr*``, ``*indices*``, ``*lens*``,
#                 ``*_len``, ``*_idx``, ``query_start_loc``, ``cu_seqlens``, ``block_table``...).
#                 An assignment to a name that an argument of a FlashInfer or plan call (in the same
#                 function) reads counts as that call's signal: ``fmha_backend = "fa2"`` before
#                 ``BatchPrefillWithRaggedKVCacheWrapper(..., backend=fmha_backend)``.
#                 Score: the sum of the distinct signals' WEIGHTS.
#   1 code        any other code change.
#   2 refactor    imports only; renames only (old and new lines the same token for token but for a
#                 consistent one-to-one renaming of names); moved code (every substantial changed line,
#                 of 10 characters or more, reappears on the other side somewhere in the pair; 3 such
#                 lines and 100 characters at least); a file or functions removed.
#   3 feature     a new file, or new functions/classes (most of the added lines are in them).
#   4 cosmetic    only comments, docstrings, logging calls and blank lines change.
#
# A refactor, a feature or a cosmetic hunk is ranked so even when it shows a signal: a new function
# that calls FlashInfer is a feature. Each hunk gets ``tier``, ``kind``, ``score``, ``changed``,
# ``reason`` (one line) and, once sorted, ``rank``.

TIERS = ("fix-shaped", "code", "refactor", "feature", "cosmetic")
WEIGHTS = {"FlashInfer call": 5, "plan argument": 5, "LSE": 4, "buffer size": 3, "index arithmetic": 3}
_FI_CALLEE = re.compile(r"^flashinfer\.|wrapper|(?:^|\.)(?:trtllm_|merge_state|xqa|cute_dsl)\w*$"
                        r"|(?:^|\.)Batch(?:Prefill|Decode|MLA)\w*$", re.I)
_PLAN_CALLEE = re.compile(r"(?:\w+_)?(?:plan|begin_forward)|fast_\w*plan\w*")
_LSE = re.compile(r"(?<![A-Za-z])lse|logsumexp|\blog2e?\b|LOG2_?E", re.I)
_BUFFER_CALLEE = re.compile(r"torch\.(?:empty|zeros|ones|full)(?:_like)?|.*\.new_(?:empty|zeros|ones|full)")
SIGNALS = (  # regexes on a changed line's code; calls spanning the line are matched by callee above
    ("FlashInfer call", re.compile(
        r"\bflashinfer\b|\bBatch(?:Prefill|Decode|MLA)\w*|\b(?:trtllm_|merge_state|xqa|cute_dsl)\w*\s*\("
        r"|wrapper\w*\.(?:run|forward\w*|plan)\b", re.I)),
    ("plan argument", re.compile(r"\b(?:\w+_)?(?:plan|begin_forward)\s*\(|\bfast_\w*plan\w*\s*\(")),
    ("LSE", _LSE),
    ("buffer size", re.compile(r"\btorch\.(?:empty|zeros|ones|full)(?:_like)?\s*\(|\.new_(?:empty|zeros|ones|full)\s*\(")),
    # an index/length name indexed, in arithmetic, or assigned
    ("index arithmetic", re.compile(
        r"\b\w*(?:{0})\w*\s*\[|^\s*(?:self\.)?\w*(?:{0})\w*\s*(?::[^=]*)?=(?!=)|(?=.*\b\w*(?:{0})\w*)"
        r"(?=.*(?:[+*%]|(?<![-=])-(?!>)|//|\.sum\(|\bcumsum\b|\barange\b|\bsearchsorted\b|\brepeat_interleave\b))".format(
            "indptr|indices|last_page_len|page_table|cu_seqlens|seqlens|lens|_len|_idx|query_start_loc"
            "|block_table|req_to_token|slot_mapping"))),
)
_LOGGING = re.compile(r"(?:^|\.)(?:logger|logging|_logger|log|warnings)\.\w+$|^print$|\w+_once$")
_TOKEN = re.compile(r"'[^']*'|\"[^\"]*\"|[A-Za-z_]\w*|\d[\w.]*|\S")
_NAME = re.compile(r"[A-Za-z_]\w*")
_STRING = re.compile(r"'[^']*'|\"[^\"]*\"")


def _code(line):
    """``line`` without its comment (a ``#`` outside quotes), right-stripped."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[:i].rstrip()
    return line.rstrip()


def facts(text):
    """What each line (1-based) of a module's source is part of: ``calls`` {line: {signal}} for the
    calls spanning it (FlashInfer, plan, LSE and buffer callees), ``quiet`` the docstring and logging
    lines, ``imports`` the import statements' lines, ``defs`` the functions and classes (spans),
    ``lines`` the text's lines."""
    out = {"calls": collections.defaultdict(set), "quiet": set(), "imports": set(), "defs": spans(text),
           "lines": text.splitlines()}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return out
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out["imports"].update(range(node.lineno, node.end_lineno + 1))
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            for alias in node.names:
                if (module or alias.name).split(".")[0] == "flashinfer":
                    imported.add((alias.asname or alias.name).split(".")[0])
    def kinds_of(call):
        try:
            callee = ast.unparse(call.func)
        except Exception:  # noqa: BLE001 - an odd node: no kind
            return set()
        kinds = set()
        if _FI_CALLEE.search(callee) or callee.split(".")[0] in imported:
            kinds.add("FlashInfer call")
        if _PLAN_CALLEE.fullmatch(callee.rsplit(".", 1)[-1]):
            kinds.add("plan argument")
        if _LSE.search(callee):
            kinds.add("LSE")
        if _BUFFER_CALLEE.fullmatch(callee):
            kinds.add("buffer size")
        return kinds

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            out["quiet"].update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            try:
                callee = ast.unparse(node.value.func)
            except Exception:  # noqa: BLE001 - an odd node: not a logging call
                callee = ""
            if _LOGGING.search(callee):
                out["quiet"].update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.Call):
            kinds = kinds_of(node)
            for line in range(node.lineno, node.end_lineno + 1) if kinds else ():
                out["calls"][line] |= kinds
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # an assignment, in this function, to a name an argument of such a call reads
            feeds = collections.defaultdict(set)
            for call in ast.walk(node):
                kinds = kinds_of(call) & {"FlashInfer call", "plan argument"} if isinstance(call, ast.Call) else ()
                for arg in (call.args + [k.value for k in call.keywords]) if kinds else ():
                    for part in ast.walk(arg):
                        if isinstance(part, (ast.Name, ast.Attribute)):
                            feeds[_dotted(part)] |= kinds
            for assign in ast.walk(node) if feeds else ():
                targets = (assign.targets if isinstance(assign, ast.Assign) else [assign.target]
                           if isinstance(assign, (ast.AnnAssign, ast.AugAssign)) else [])
                kinds = set().union(*(feeds.get(_dotted(part), set()) for target in targets
                                      for part in ast.walk(target) if isinstance(part, (ast.Name, ast.Attribute))))
                for line in range(assign.lineno, assign.end_lineno + 1) if kinds else ():
                    out["calls"][line] |= kinds
    return out


def _dotted(node):
    """``a`` or ``self.a.b`` for a Name or an Attribute chain of Names; '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base + "." + node.attr if base else ""
    return ""


def _rename(removed, added):
    """``(old, new)``, the first name renamed, when the ``removed`` code lines become the ``added``
    ones (paired in order) by a consistent one-to-one renaming of names alone; None otherwise."""
    if not removed or len(removed) != len(added):
        return None
    forward, backward, changed = {}, {}, []
    for a, b in zip(removed, added):
        ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
        if len(ta) != len(tb) or ta == tb:
            return None
        for x, y in zip(ta, tb):
            if x != y and not (_NAME.fullmatch(x) and _NAME.fullmatch(y)):
                return None
            if forward.setdefault(x, y) != y or backward.setdefault(y, x) != x:
                return None
            if x != y and (x, y) not in changed:
                changed.append((x, y))
    return changed[0] if changed else None


def _quote(line, width=70):
    line = line.strip()
    return "`%s`" % (line if len(line) <= width else line[:width - 3] + "...")


def rank(read):
    """``[{"tier", "kind", "score", "changed", "reason"}]`` for each ``(hunk, old text, new text)`` of
    one pair of releases, in order (see the ranking notes above)."""
    cache = {}

    def known(text):
        if text is None:
            return {"calls": {}, "quiet": set(), "imports": set(), "defs": [], "lines": []}
        if id(text) not in cache:
            cache[id(text)] = (text, facts(text))
        return cache[id(text)][1]

    sides = []
    removed_all, added_all = collections.Counter(), collections.Counter()
    for hunk, before, after in read:
        old_lines = before.splitlines() if before is not None else []
        new_lines = after.splitlines() if after is not None else []
        fo, fn = known(before), known(after)
        minus = [(n, _code(old_lines[n - 1]), fo) for n in hunk["_old"]]
        plus = [(n, _code(new_lines[n - 1]), fn) for n in hunk["_new"]]
        code_minus = [(n, c, f) for n, c, f in minus if c.strip() and n not in f["quiet"]]
        code_plus = [(n, c, f) for n, c, f in plus if c.strip() and n not in f["quiet"]]
        removed_all.update(c.strip() for _, c, _ in code_minus)
        added_all.update(c.strip() for _, c, _ in code_plus)
        context = [_code(line[1:]) for line in hunk["lines"] if line.startswith(" ")]
        sides.append((hunk, fo, fn, code_minus, code_plus, context))

    out = []
    for hunk, fo, fn, code_minus, code_plus, context in sides:
        changed = len(hunk["_old"]) + len(hunk["_new"])
        reason, tier, score = None, None, 0

        def substantial(lines):
            return [c.strip() for _, c, _ in lines if len(c.strip()) >= 10]

        def moved():
            mine = substantial(code_minus) + substantial(code_plus)
            if len(mine) < 3 or sum(map(len, mine)) < 100:  # a few short lines recur by chance
                return False
            return (all(added_all[c] for c in substantial(code_minus))
                    and all(removed_all[c] for c in substantial(code_plus)))

        def new_defs(lines, table, numbers):
            """The outermost functions/classes wholly inside ``numbers``, and the share of
            ``lines`` (code lines) they hold."""
            inside, names = set(), []
            for first, last, name in sorted(table):
                if first not in inside and set(range(first, last + 1)) <= numbers:
                    names.append(name)
                    inside.update(range(first, last + 1))
            share = sum(1 for n, _, _ in lines if n in inside) / len(lines) if lines else 0
            return names, share

        if not code_minus and not code_plus:
            tier, reason = 4, "comments, docstrings, logging or blank lines only"
        elif ([c for _, c, _ in code_minus] == [c for _, c, _ in code_plus]):
            tier, reason = 4, "only comments change (the code lines are the same)"
        elif hunk["change"] == "removed":
            tier = 2
            reason = "moved: the removed file's code reappears elsewhere" if moved() else "file removed"
        elif hunk["change"] == "added":
            if moved():
                tier, reason = 2, "moved: the new file holds code removed elsewhere"
            else:
                names = [name for _, _, name in fn["defs"] if "." not in name]
                tier = 3
                reason = "new file (%d lines)%s" % (len(hunk["_new"]), ": defines " + ", ".join(names[:4]) + (
                    ", ..." if len(names) > 4 else "") if names else "")
        elif all(n in f["imports"] for n, _, f in code_minus + code_plus):
            tier, reason = 2, "imports only"
        elif _rename([c.strip() for _, c, _ in code_minus], [c.strip() for _, c, _ in code_plus]):
            old_name, new_name = _rename([c.strip() for _, c, _ in code_minus], [c.strip() for _, c, _ in code_plus])
            tier, reason = 2, "renames only (%s -> %s)" % (old_name, new_name)
        elif moved():
            tier, reason = 2, "moved code: its lines reappear elsewhere in this pair"
        else:
            added_names, added_share = new_defs(code_plus, fn["defs"], set(hunk["_new"]))
            removed_names, removed_share = new_defs(code_minus, fo["defs"], set(hunk["_old"]))
            if added_names and added_share >= 0.6 and not substantial(code_minus):
                tier, reason = 3, "new %s" % ", ".join(added_names[:4])
            elif removed_names and removed_share >= 0.6 and not substantial(code_plus):
                tier, reason = 2, "removes %s" % ", ".join(removed_names[:4])
        if tier is None:
            near_plan = any(SIGNALS[1][1].search(_STRING.sub("''", c)) for c in context)
            found = {}
            for n, c, f in code_minus + code_plus:
                bare, raw = _STRING.sub("''", c), f["lines"][n - 1]
                for name, pattern in SIGNALS:
                    if pattern.search(bare):
                        found.setdefault(name, raw)
                for name in sorted(f["calls"].get(n, ())):
                    found.setdefault(name, raw)
                if near_plan:
                    found.setdefault("plan argument", raw)
            if found:
                names = sorted(found, key=lambda k: (-WEIGHTS[k], k))
                tier, score = 0, sum(WEIGHTS[k] for k in names)
                reason = "%s: %s" % (", ".join(names), _quote(found[names[0]]))
            else:
                tier, reason = 1, "code change, no FlashInfer/plan/LSE/buffer/index signal"
        out.append({"tier": tier, "kind": TIERS[tier], "score": score, "changed": changed,
                    "reason": "%s%s: %s" % (TIERS[tier], " +%d" % score if score else "", reason)})
    return out


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


def print_text(pairs, out=sys.stdout, diff=False, uncovered=False, limit=0):
    """Each pair's header, then its hunks in rank order, each with a ``why:`` line (its rank and
    reason) and, with ``diff``, its lines; with ``limit``, only the first ``limit`` hunks shown."""
    for p in pairs:
        shown = [h for h in p["hunks"] if not (uncovered and h["covered_by"])]
        out.write("%s %s -> %s: %d hunks, %d covered%s\n" % (
            p["dist"], p["old"], p["new"], len(p["hunks"]), sum(1 for h in p["hunks"] if h["covered_by"]),
            " (%s)" % p["note"] if p["note"] else ""))
        for h in shown[:limit or None]:
            state = "covered by " + ", ".join(h["covered_by"]) if h["covered_by"] else "uncovered"
            out.write("  %s @@ -%d,%d +%d,%d @@ %s%s  [%s]\n" % (
                h["file"], h["old"][0], h["old"][1], h["new"][0], h["new"][1], ", ".join(h["functions"]),
                "" if h["change"] == "changed" else " (file %s)" % h["change"], state))
            if "reason" in h:
                out.write("      why: #%d %s\n" % (h["rank"], h["reason"]))
            if diff:
                out.writelines("      %s\n" % line for line in h["lines"])
        if limit and len(shown) > limit:
            out.write("  ... %d more hunks, ranked lower (--limit 0 prints them all)\n" % (len(shown) - limit))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="a comma list of DIST==VERSION: their consecutive pairs instead of every release")
    parser.add_argument("--since", default="", help="DIST=VERSION[,...]: oldest release per engine (defaults: %s)"
                        % ", ".join("%s=%s" % (d, sweep.FLOORS[d]) for d in FILES))
    parser.add_argument("--engine", action="append", choices=sorted(FILES), help="only this engine (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write every pair's hunks, with their lines, here")
    parser.add_argument("--diff", action="store_true", help="print each hunk's lines under it")
    parser.add_argument("--uncovered", action="store_true", help="print only the hunks no carried fix covers")
    parser.add_argument("--limit", type=int, default=0, metavar="N",
                        help="print only the first N hunks of each pair, in rank order (0, the default: all; "
                             "--json still writes them all)")
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
    if args.limit < 0:
        parser.error("--limit must be 0 (all) or more")
    try:
        todo = plan(only, since, engines)
        pairs = run(todo, [p for d in engines for p in sweep.patches_of(d)], args.jobs)
    except sweep.NetworkError as exc:
        sys.stderr.write("release_hunks: network failure: %s\n" % exc)
        return 3
    except LookupError as exc:
        sys.stderr.write("release_hunks: %s\n" % exc)
        return 2
    print_text(pairs, diff=args.diff, uncovered=args.uncovered, limit=args.limit)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"files": {d: FILES[d] for d in engines}, "pairs": pairs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
