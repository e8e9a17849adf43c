#!/usr/bin/env python3
"""The doctor's verdict for every final release of vLLM, SGLang and FlashInfer on the package index.

    python scripts/sweep_releases.py                   # every final release since the floors below
    python scripts/sweep_releases.py --only sglang==0.5.1,vllm==0.28.0
    python scripts/sweep_releases.py --write-readme    # also the tables in docs/compatibility.md and the
                                                       # README, and benchmarks/results/sweep.json
    python scripts/sweep_releases.py --check benchmarks/results/sweep.json   # the drift watch
    python scripts/sweep_releases.py --pack my_pack.patches --only vllm==0.28.0,vllm==0.29.0
                                                       # a patch pack's backports only (importable module)

Nothing is installed or unpacked. A wheel is a zip: its central directory and the few members
the probes read (each patch's target modules, the modules a probe looks into, and the
``.dist-info/METADATA``) are fetched with HTTP range requests (``remotezip``), so a 400 MB
vLLM wheel costs a few hundred KB. Each wheel is read by ``flashfix.core.paths.ZipReader``
and judged exactly as ``flashfix doctor`` judges an installed engine: under
``_locate.reading(reader)``, through ``_registry.targets_of``, ``read_trees`` and ``judge``,
with the version from the wheel's own METADATA.

Final release: no pre-release or dev segment (post releases are final), per ``packaging``.
One wheel per release: a pure ``py3-none-any`` one if there is one, else the best
CPython 3.11 / manylinux x86_64 one (``abi3`` included); a release without such a wheel is
listed with a note. Exit status: 0 done, 1 drift (with ``--check``: a release judged
``unknown-shape``, or a verdict that differs from the committed sweep), 2 bad arguments,
3 the index or a wheel could not be read (the message says which URL and why).
"""

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from urllib.parse import urljoin

REPO = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/pypi/{name}/json"
# Releases older than these are not swept unless --since says so (the range the project supports).
FLOORS = {"sglang": "0.5.0", "vllm": "0.20.0", "flashinfer-python": "0.5.0"}
TITLES = {"vllm": "vLLM", "sglang": "SGLang", "flashinfer-python": "FlashInfer (`flashinfer-python`)"}
DEFAULT_JSON = REPO / "benchmarks" / "results" / "sweep.json"
README = REPO / "README.md"
COMPATIBILITY = REPO / "docs" / "compatibility.md"
BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"  # docs/compatibility.md: every release
SUMMARY_BEGIN, SUMMARY_END = "<!-- sweep-summary:begin -->", "<!-- sweep-summary:end -->"  # README.md: the counts
MAX_JOBS = 8
TIMEOUT = (15, 120)  # connect, read (seconds) per HTTP request
RETRIES = 4  # per HTTP request, on connection errors and 429/5xx answers (backoff 0, 2, 4, 8 s)


def _own_flashfix(as_script):
    """This checkout's flashfix, not one that an environment's start-up hook (``flashfix.pth``)
    imported from another checkout: run as a script, start again with this checkout first on
    PYTHONPATH; imported, refuse."""
    module = sys.modules.get("flashfix")
    if module is not None and Path(module.__file__).resolve().parents[1] != REPO:
        problem = "flashfix is imported from %s, not from %s" % (module.__file__, REPO)
        if not as_script or os.environ.get("SWEEP_RELEASES_REEXEC"):
            raise ImportError("sweep_releases: %s (put %s first on PYTHONPATH)" % (problem, REPO))
        env = dict(os.environ, SWEEP_RELEASES_REEXEC="1",
                   PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve())] + sys.argv[1:], env)
    if str(REPO) not in sys.path[:1]:
        sys.path.insert(0, str(REPO))


_own_flashfix(__name__ == "__main__")

try:
    import requests  # noqa: E402
    import urllib3  # noqa: E402
    from remotezip import RemoteZip, RemoteZipError  # noqa: E402
except ImportError as exc:
    sys.exit("sweep_releases: %s; it needs remotezip and requests: pip install 'flashfix[sweep]'" % exc)
from packaging.tags import compatible_tags, cpython_tags  # noqa: E402
from packaging.utils import canonicalize_name, parse_wheel_filename  # noqa: E402
from packaging.version import InvalidVersion, Version  # noqa: E402

from flashfix.core import locate as _locate, paths as _paths
from flashfix.core import registry as _registry
from flashfix.core import source as _source  # noqa: E402


class NetworkError(Exception):
    """The index or a wheel could not be read."""


# --- the index -----------------------------------------------------------------------------

_PLATFORMS = (["manylinux_2_%d_x86_64" % minor for minor in range(50, 4, -1)]
              + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"])
_RANK = {tag: i for i, tag in enumerate(list(cpython_tags((3, 11), abis=["cp311"], platforms=_PLATFORMS))
                                        + list(compatible_tags((3, 11), "cp311", _PLATFORMS)))}


def session():
    """An HTTP session that retries connection errors and 429/5xx answers ``RETRIES`` times."""
    s = requests.Session()
    retry = urllib3.util.Retry(total=RETRIES, backoff_factor=1.0, status_forcelist=(429, 500, 502, 503, 504),
                               allowed_methods=frozenset({"GET", "HEAD"}))
    adapter = requests.adapters.HTTPAdapter(max_retries=retry)
    s.mount("https://", adapter)
    s.mount("http://", adapter)
    s.headers["User-Agent"] = "flashfix-sweep (+scripts/sweep_releases.py)"
    return s


def index_json(name, index=INDEX, http=None):
    url = index.format(name=name)
    try:
        answer = (http or session()).get(url, timeout=TIMEOUT)
        answer.raise_for_status()
        return url, answer.json()
    except (requests.RequestException, ValueError) as exc:
        raise NetworkError("cannot read the index page %s: %s" % (url, exc)) from None


def pick_wheel(files):
    """The file dict of the wheel to read: ``py3-none-any`` first, else the best cp311 /
    manylinux x86_64 one; None if the release has no such wheel."""
    best = None
    for entry in files:
        if not entry["filename"].endswith(".whl"):
            continue
        try:
            _, _, _, tags = parse_wheel_filename(entry["filename"])
        except Exception:
            continue
        pure = any(t.abi == "none" and t.platform == "any" for t in tags)
        ranks = [_RANK[t] for t in tags if t in _RANK]
        if not ranks:
            continue
        key = (not pure, min(ranks))
        if best is None or key < best[0]:
            best = (key, entry)
    return best[1] if best else None


def releases(dist, data, page_url, since=None):
    """[(version string, wheel file dict or None, yanked)] of the final releases, oldest first."""
    floor = Version(since) if since else None
    found = []
    for text, files in data["releases"].items():
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if version.is_prerelease or version.is_devrelease or (floor is not None and version < floor):
            continue
        wheel = pick_wheel(files)
        if wheel is not None:
            wheel = dict(wheel, url=urljoin(page_url, wheel["url"]))  # the index may give relative URLs
        found.append((version, text, wheel, bool(files) and all(f.get("yanked") for f in files)))
    return [(text, wheel, yanked) for _, text, wheel, yanked in sorted(found, key=lambda r: r[0])]


# --- one wheel -------------------------------------------------------------------------------


class RecordingZip(RemoteZip):
    """A remote wheel that records the sha256 and size of every member read from it, and every
    read that failed (a probe that reads a module itself would turn such a failure into an
    ``unknown-shape`` verdict; the sweep reports it as the network failure it is)."""

    def __init__(self, url, http, **kwargs):
        self.members_read, self.failures = {}, []
        self._record_lock = threading.Lock()
        super().__init__(url, session=http, **kwargs)

    def open(self, name, mode="r", pwd=None, **kwargs):
        handle = super().open(name, mode, pwd=pwd, **kwargs)
        return _RecordedMember(self, getattr(name, "filename", name), handle) if mode == "r" else handle

    def _record(self, name, digest, size):
        with self._record_lock:
            self.members_read[name] = {"sha256": digest.hexdigest(), "size": size}


class _RecordedMember:
    """A member opened for reading (``ZipFile.read`` opens one too): its bytes as read are
    hashed and counted, recorded once the member is read to its end; a failed read is kept."""

    def __init__(self, archive, name, handle):
        self.archive, self.name, self.handle = archive, name, handle
        self.digest, self.size = hashlib.sha256(), 0

    def read(self, n=-1):
        try:
            data = self.handle.read(n)
        except (requests.RequestException, RemoteZipError, OSError) as exc:
            self.archive.failures.append("%s: %s" % (self.name, exc))
            raise
        self.digest.update(data)
        self.size += len(data)
        if not data or n is None or n < 0 or len(data) < n:
            self.archive._record(self.name, self.digest, self.size)
        return data

    def close(self):
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_wheel(url, http=None):
    """``(archive, counter)``: the remote wheel as a ``zipfile.ZipFile`` and a dict counting the
    HTTP requests made for it and the bytes they asked for."""
    http = http or session()
    counter = {"requests": 0, "bytes": 0}

    def count(response, *args, **kwargs):
        counter["requests"] += 1
        counter["bytes"] += int(response.headers.get("Content-Length") or 0)

    http.hooks["response"].append(count)
    try:
        return RecordingZip(url, http, timeout=TIMEOUT), counter
    except (requests.RequestException, RemoteZipError, OSError) as exc:
        raise NetworkError("cannot read the wheel %s: %s" % (url, exc)) from None


def wheel_reader(dist, version, index=INDEX):
    """A ``ZipReader`` over the remote wheel of ``dist==version`` (for tests and by-hand probing)."""
    (_, _, wheel, _), = plan([(canonicalize_name(dist), version)], index=index)
    if wheel is None:
        raise LookupError("%s==%s has no wheel to read" % (dist, version))
    archive, _ = open_wheel(wheel["url"])
    return _paths.ZipReader(archive, wheel["filename"])


_only_packs = []  # the patches of --pack modules: when set, the sweep judges these alone


def use_packs(modules):
    """Judge the patches of these pack modules (``PATCHES``, checked and registered as the
    entry-point group's packs are) instead of every installed one. ValueError when one cannot
    be loaded."""
    from flashfix.core import packs as _packs

    _registry.load_all()
    for module in modules:
        entry = _packs.Entry("--pack", "--pack", module, "--pack %s" % module, None)
        patches = _registry._declare(entry)
        if not patches:
            raise ValueError("; ".join(_registry.problems("--pack")) or "%s declares no patch" % module)
        _only_packs.extend(patches)


def patches_of(dist):
    patches = _only_packs or _registry.load_all()
    return [p for p in patches if canonicalize_name(p.engine) == canonicalize_name(dist)]


def judge_archive(archive, label, dist):
    """``(version from METADATA, {patch id: (verdict, reason)})`` for the engine ``dist`` in
    ``archive``, as ``flashfix doctor`` would judge it installed."""
    reader = _paths.ZipReader(archive, label)
    verdicts, series = {}, {}  # per function, its series so far, as the doctor and the runtime judge
    shown = [p.id for p in patches_of(dist)]
    judged = [p for p in _registry.load_all() if canonicalize_name(p.engine) == canonicalize_name(dist)] if (
        _only_packs) else patches_of(dist)  # --pack: flashfix's own first, as installed (a fix they make: covered)
    with _locate.reading(reader):
        version = reader.version(dist)
        for patch in judged:
            try:
                targets = _registry.targets_of(patch)
            except Exception as exc:
                verdicts[patch.id] = ("unknown-shape", "cannot tell which modules to patch: %r" % (exc,))
                continue
            verdicts[patch.id] = _registry.judge(patch, _registry.read_trees(targets), version, series)
    return version, {i: verdicts[i] for i in shown}


def sweep_one(dist, version, wheel, yanked):
    row = {"dist": dist, "version": version, "yanked": yanked}
    if wheel is None:
        row["note"] = "no py3-none-any or cp311 manylinux x86_64 wheel on the index"
        return row
    started = time.monotonic()
    archive, counter = open_wheel(wheel["url"])
    try:
        try:
            wheel_version, verdicts = judge_archive(archive, wheel["filename"], dist)
        except (requests.RequestException, RemoteZipError) as exc:
            raise NetworkError("cannot read the wheel %s: %s" % (wheel["url"], exc)) from None
        finally:
            _source.forget()
    finally:
        archive.close()
    if archive.failures:
        raise NetworkError("cannot read the wheel %s: %s" % (wheel["url"], "; ".join(archive.failures)))
    row.update({
        "wheel": wheel["filename"],
        "url": wheel["url"],
        "wheel_sha256": wheel.get("digests", {}).get("sha256"),
        "wheel_size": wheel.get("size"),
        "metadata_version": wheel_version,
        "files_read": dict(sorted(archive.members_read.items())),
        "http_requests": counter["requests"],
        "bytes_fetched": counter["bytes"],
        "seconds": round(time.monotonic() - started, 2),
        "verdicts": {pid: {"verdict": v, "reason": r} for pid, (v, r) in verdicts.items()},
    })
    if wheel_version is None or Version(wheel_version) != Version(version):
        row["note"] = "the wheel's METADATA says version %s" % wheel_version
    return row


# --- the whole sweep ---------------------------------------------------------------------------


def parse_only(text):
    """``"sglang==0.5.1,vllm==0.28.0"`` -> [(dist, version)]."""
    pins = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, version = item.partition("==")
        dist = canonicalize_name(name)
        if not sep or dist not in FLOORS or not version:
            raise ValueError("%r: expected DIST==VERSION with DIST one of %s" % (item, ", ".join(FLOORS)))
        pins.append((dist, version.strip()))
    return pins


def plan(only=None, since=None, index=INDEX, dists=None):
    """[(dist, version, wheel, yanked)] to read, from the index."""
    http = session()
    wanted = {}
    for dist, version in only or ():
        wanted.setdefault(dist, []).append(version)
    todo = []
    for dist in dists or [d for d in FLOORS if not _only_packs or patches_of(d)]:
        if only is not None and dist not in wanted:
            continue
        page_url, data = index_json(dist, index, http)
        floor = None if only is not None else (since or {}).get(dist, FLOORS[dist])
        listed = releases(dist, data, page_url, since=floor)
        if only is None:
            todo.extend((dist, v, w, y) for v, w, y in listed)
            continue
        by_version = {Version(v): (v, w, y) for v, w, y in listed}
        for version in wanted[dist]:
            hit = by_version.get(Version(version))
            if hit is None:
                raise LookupError("%s==%s is not a final release on %s" % (dist, version, page_url))
            todo.append((dist,) + hit)
    return todo


def sweep(todo, jobs=6, progress=None):
    _registry.load_all()  # declare every patch once, before the threads ask for them
    rows = [None] * len(todo)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(jobs, MAX_JOBS))) as pool:
        futures = {pool.submit(sweep_one, *item): i for i, item in enumerate(todo)}
        try:
            for future in concurrent.futures.as_completed(futures):
                rows[futures[future]] = row = future.result()
                if progress:
                    progress(row)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return rows


def git_commit():
    """This checkout's commit, "+dirty" when flashfix/ has uncommitted changes; None outside git."""

    def git(*args):
        return subprocess.run(("git",) + args, cwd=REPO, capture_output=True, text=True, timeout=10)

    try:
        head, dirty = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "--", "flashfix")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


# --- the README table --------------------------------------------------------------------------

VERDICT_ORDER = ("patch", "fixed-upstream", "not-affected", "known-unfixed", "unknown-shape")


def _note_text(row, reason):
    """A reason with the release named generically, so that one note serves every release."""
    return reason.replace("%s %s" % (row["dist"], row["metadata_version"] or row["version"]), "this release")


def _summary(rows, patch_ids):
    lines = ["| patch | " + " | ".join("`%s`" % v for v in VERDICT_ORDER) + " | releases |",
             "| --- |" + " ---: |" * (len(VERDICT_ORDER) + 1)]
    for pid in patch_ids:
        cells = [r["verdicts"][pid]["verdict"] for r in rows if pid in r.get("verdicts", {})]
        lines.append("| `%s` | %s | %d |" % (pid, " | ".join(str(cells.count(v)) for v in VERDICT_ORDER), len(cells)))
    return lines


def _per_engine(rows, dists):
    """One row per engine: its releases, how many have a fix to apply, the fixes carried and how
    many (release, fix) pairs read ``patch`` and ``unknown-shape`` (the per-patch counts are in
    docs/compatibility.md)."""
    lines = ["| engine | releases | releases with a fix to apply | fixes carried | `patch` verdicts | "
             "`unknown-shape` verdicts |", "| --- |" + " ---: |" * 5]
    for dist in dists:
        mine = [r for r in rows if r["dist"] == dist]
        cells = [v["verdict"] for r in mine for v in r["verdicts"].values()]
        lines.append("| %s | %d | %d | %d | %d | %d |" % (
            TITLES[dist].split(" (")[0], len(mine), sum(any(v["verdict"] == "patch" for v in r["verdicts"].values())
                                                         for r in mine),
            len(patches_of(dist)), cells.count("patch"), cells.count("unknown-shape")))
    return lines


def summary_block(rows, meta):
    """The markdown between the README's sweep-summary markers: verdict counts per engine."""
    dists = [d for d in FLOORS if any(r["dist"] == d for r in rows)]
    read = [r for r in rows if "verdicts" in r]
    short = {d: TITLES[d].split(" (")[0] for d in dists}
    intro = ("How the final releases on PyPI, from %s on, are judged by the doctor, read from each wheel's "
             "own source (swept %s, %d releases; each release in [docs/compatibility.md](docs/compatibility.md)):" % (
                 ", ".join("%s %s" % (short[d], meta["floors"][d]) for d in dists), meta["date"], len(rows)))
    out = [SUMMARY_BEGIN,
           "<!-- generated by `python scripts/sweep_releases.py --write-readme`; edit the script, not this block -->",
           ""] + textwrap.wrap(intro, 100, break_on_hyphens=False, break_long_words=False) + [""]
    out += _per_engine(read, dists)
    out.append(SUMMARY_END)
    return "\n".join(out)


def readme_block(rows, meta):
    """The markdown between docs/compatibility.md's sweep markers: every release swept."""
    dists = [d for d in FLOORS if any(r["dist"] == d for r in rows)]
    ids = {d: [p.id for p in patches_of(d)] for d in dists}
    read = [r for r in rows if "verdicts" in r]
    short = {d: TITLES[d].split(" (")[0] for d in dists}
    scope = ("Every final release on PyPI from %s on" % ", ".join("%s %s" % (short[d], meta["floors"][d]) for d in dists)
             if meta.get("floors") else "The releases %s" % ", ".join("%s==%s" % (r["dist"], r["version"]) for r in rows))
    intro = (
        "%s, each wheel's own source judged by the doctor's probes without "
        "installing it (`scripts/sweep_releases.py`; provenance, with each wheel's URL and the sha256 of every file "
        "read, in `%s`). Swept %s with flashfix `%s`: %d releases, %d HTTP requests, %.1f MB read out of %.1f GB "
        "of wheels; wall time **%.0f s** with %d threads on %s." % (
            scope, meta["json_path"], meta["date"],
            meta["flashfix_commit"] or "?", len(rows), sum(r.get("http_requests", 0) for r in rows),
            sum(r.get("bytes_fetched", 0) for r in rows) / 1e6, sum(r.get("wheel_size") or 0 for r in rows) / 1e9,
            meta["wall_s"], meta["jobs"], meta.get("machine") or "this project's CPU machine (2 cores, shared)"))
    out = [BEGIN,
           "<!-- generated by `python scripts/sweep_releases.py --write-readme`; edit the script, not this block -->",
           ""] + textwrap.wrap(intro, 100, break_on_hyphens=False, break_long_words=False) + [""]
    out += _summary(read, [pid for d in dists for pid in ids[d]])
    for dist in dists:
        mine = [r for r in rows if r["dist"] == dist]
        notes = {}
        lines = ["| %s | %s |" % (short[dist], " | ".join("`%s`" % pid for pid in ids[dist])),
                 "| --- |" + " --- |" * len(ids[dist])]
        for r in mine:
            label = r["version"] + (" (yanked)" if r.get("yanked") else "")
            if "verdicts" not in r:
                lines.append("| %s | %s |" % (label, " | ".join([r["note"]] + [""] * (len(ids[dist]) - 1))))
                continue
            cells = []
            for pid in ids[dist]:
                verdict, reason = r["verdicts"][pid]["verdict"], r["verdicts"][pid]["reason"]
                if verdict in ("patch", "fixed-upstream"):
                    cells.append(verdict)
                else:
                    key = (pid, _note_text(r, reason))
                    notes.setdefault(key, len(notes) + 1)
                    cells.append("%s [%s%d]" % (verdict, dist[0], notes[key]))
            if r.get("note"):
                label += " (%s)" % r["note"]
            lines.append("| %s | %s |" % (label, " | ".join(cells)))
        out += ["", "<details><summary>%s: %d releases, %s to %s</summary>" % (
            TITLES[dist], len(mine), mine[0]["version"], mine[-1]["version"]), ""] + lines + [""]
        if notes:
            out += ["- [%s%d] `%s`: %s" % (dist[0], n, pid, text) for (pid, text), n in notes.items()] + [""]
        out += ["</details>"]
    out.append(END)
    return "\n".join(out)


def write_readme(block, path=README, begin=BEGIN, end=END):
    """Replace the text between ``begin`` and ``end`` in ``path`` (markers included) with ``block``."""
    text = path.read_text()
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit("sweep_releases: %s needs one %s ... %s pair" % (path, begin, end))
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + block + tail)


# --- the drift watch ---------------------------------------------------------------------------


def check(committed, rows, full=True):
    """How this sweep's ``rows`` drift from ``committed`` (the ``releases`` of a sweep.json):
    ``(failures, notes)``, each a list of lines.

    A failure: a release inside a patch's ``versions`` judged ``unknown-shape`` (the runtime would
    leave an affected engine unpatched), or a committed verdict that is now different or gone. Only
    verdicts count; a changed reason, a release or patch new since the committed sweep, and (full
    sweep only) a committed release no longer listed are notes. ``unknown-shape`` outside ``versions``
    (a pack's pattern that older or newer releases spell differently: left untouched) is no failure
    by itself; it is one only when the committed sweep said otherwise."""
    failures, notes = [], []
    patches = {p.id: p for p in _only_packs or _registry.load_all()}
    old = {(r["dist"], r["version"]): r for r in committed}
    for r in rows:
        name = "%s %s" % (r["dist"], r["version"])
        now = r.get("verdicts", {})
        for pid, v in now.items():
            affected = pid not in patches or _registry.in_range(patches[pid], r["version"])
            if v["verdict"] == "unknown-shape" and affected:
                failures.append("%s %s: unknown-shape: %s" % (name, pid, v["reason"]))
        before = old.get((r["dist"], r["version"]))
        if before is None:
            notes.append("%s: new since the committed sweep: %s" % (
                name, ", ".join("%s=%s" % (pid, v["verdict"]) for pid, v in now.items()) or r.get("note")))
            continue
        then = before.get("verdicts", {})
        for pid in list(then) + [pid for pid in now if pid not in then]:
            was, got = then.get(pid), now.get(pid)
            if was is None:
                notes.append("%s %s: not in the committed sweep, now %s" % (name, pid, got["verdict"]))
            elif got is None:
                failures.append("%s %s: was %s, now not judged (%s)" % (
                    name, pid, was["verdict"], r.get("note") or "no verdict"))
            elif was["verdict"] != got["verdict"]:
                failures.append("%s %s: was %s, now %s: %s" % (name, pid, was["verdict"], got["verdict"], got["reason"]))
            elif was["reason"] != got["reason"]:
                notes.append("%s %s: %s as before, reason now: %s" % (name, pid, got["verdict"], got["reason"]))
    if full:
        swept = {(r["dist"], r["version"]) for r in rows}
        notes += ["%s %s: in the committed sweep, no longer listed on the index" % key for key in old if key not in swept]
    return failures, notes


def print_table(rows, out=sys.stdout):
    for r in rows:
        if "verdicts" not in r:
            out.write("%-18s %-14s %s\n" % (r["dist"], r["version"], r["note"]))
            continue
        for pid, v in r["verdicts"].items():
            out.write("%-18s %-14s %-28s %-15s %s\n" % (r["dist"], r["version"], pid, v["verdict"], v["reason"]))


def main(argv=None):
    global RETRIES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="a comma list of DIST==VERSION to read instead of every release")
    parser.add_argument("--since", default="", help="DIST=VERSION[,...]: oldest release to sweep per distribution "
                                                    "(defaults: %s)" % ", ".join("%s=%s" % kv for kv in FLOORS.items()))
    parser.add_argument("--jobs", type=int, default=6, help="wheels read at once (threads; at most %d)" % MAX_JOBS)
    parser.add_argument("--json", metavar="PATH", help="write the results (with provenance) here")
    parser.add_argument("--write-readme", action="store_true",
                        help="rewrite the tables of docs/compatibility.md (between %s and %s) and README.md (between "
                             "%s and %s) (full sweep only); also writes the results to %s unless --json says where" % (
                                 BEGIN, END, SUMMARY_BEGIN, SUMMARY_END, DEFAULT_JSON.relative_to(REPO)))
    parser.add_argument("--check", metavar="SWEEP_JSON",
                        help="the drift watch: exit 1 when a release is judged unknown-shape or a verdict differs from "
                             "this committed sweep (e.g. benchmarks/results/sweep.json)")
    parser.add_argument("--markdown", metavar="PATH", help="write the table of every release swept here (markdown)")
    parser.add_argument("--index", default=INDEX, help="the JSON API URL pattern, {name} for the distribution")
    parser.add_argument("--retries", type=int, default=RETRIES, help="retries per HTTP request (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no per-release progress on stderr")
    parser.add_argument("--pack", action="append", default=[], metavar="MODULE",
                        help="sweep the backports of this patch-pack module (its PATCHES; importable from here, e.g. "
                             "with PYTHONPATH) instead of every patch; repeat for several")
    args = parser.parse_args(argv)
    RETRIES = max(0, args.retries)
    try:
        only = parse_only(args.only) if args.only is not None else None
        since = {}
        for item in filter(None, (p.strip() for p in args.since.split(","))):
            dist, _, version = item.partition("=")
            if canonicalize_name(dist) not in FLOORS or not version:
                raise ValueError("--since %r: expected DIST=VERSION" % item)
            since[canonicalize_name(dist)] = Version(version.strip()).public
    except (ValueError, InvalidVersion) as exc:
        parser.error(str(exc))
    if args.write_readme and (only is not None or since or args.pack):
        parser.error("--write-readme needs the full sweep of flashfix's patches (no --only, --since or --pack)")
    try:
        use_packs(args.pack)
    except ValueError as exc:
        parser.error("--pack: %s" % exc)
    if not 1 <= args.jobs <= MAX_JOBS:
        parser.error("--jobs must be 1 to %d" % MAX_JOBS)
    json_path = Path(args.json) if args.json else (DEFAULT_JSON if args.write_readme else None)
    committed = None
    if args.check:
        try:
            committed = json.loads(Path(args.check).read_text())["releases"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            parser.error("--check %s: not a sweep result: %s" % (args.check, exc))

    started = time.monotonic()
    done = []

    def progress(row):
        done.append(row)
        if not args.quiet:
            cells = ", ".join("%s=%s" % (pid, v["verdict"]) for pid, v in row.get("verdicts", {}).items())
            sys.stderr.write("[%d] %s %s: %s\n" % (len(done), row["dist"], row["version"], cells or row.get("note")))

    try:
        todo = plan(only, since, args.index)
        if not args.quiet:
            sys.stderr.write("sweep_releases: %d releases to read with %d threads\n" % (len(todo), args.jobs))
        rows = sweep(todo, args.jobs, progress)
    except NetworkError as exc:
        sys.stderr.write("sweep_releases: network failure, nothing written: %s\n" % exc)
        return 3
    except LookupError as exc:
        sys.stderr.write("sweep_releases: %s\n" % exc)
        return 2
    wall = time.monotonic() - started
    meta = {
        "date": datetime.date.today().isoformat(),
        "flashfix_commit": git_commit(),
        "python": sys.version.split()[0],
        "index": args.index,
        "jobs": args.jobs,
        "wall_s": round(wall, 1),
        "machine": "a machine with %d CPUs" % (os.cpu_count() or 1),
        "json_path": str(json_path.resolve().relative_to(REPO)) if json_path and json_path.resolve().is_relative_to(
            REPO) else str(json_path),
        "floors": None if only is not None else dict(FLOORS, **since),
        "only": args.only,
    }
    print_table(rows)
    sys.stderr.write("sweep_releases: %d releases in %.1f s\n" % (len(rows), wall))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "releases": rows}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(readme_block(rows, meta) + "\n")
    if args.write_readme:
        write_readme(readme_block(rows, meta), COMPATIBILITY)
        write_readme(summary_block(rows, meta), README, SUMMARY_BEGIN, SUMMARY_END)
    if committed is not None:
        failures, notes = check(committed, rows, full=only is None and not since)
        for line in notes:
            sys.stderr.write("sweep_releases: note: %s\n" % line)
        for line in failures:
            sys.stderr.write("sweep_releases: DRIFT: %s\n" % line)
        if failures:
            sys.stderr.write("sweep_releases: %d drift(s) from %s\n" % (len(failures), args.check))
            return 1
        sys.stderr.write("sweep_releases: no drift from %s (%d releases checked)\n" % (args.check, len(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
