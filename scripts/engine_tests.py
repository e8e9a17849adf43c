#!/usr/bin/env python3
"""The engines' own unit tests for the files flashfix patches, run with flashfix disabled and active.

    .venv/bin/python scripts/engine_tests.py                      # every ready engine environment
    .venv/bin/python scripts/engine_tests.py --only vllm==0.28.0 --out benchmarks/results/engine_tests.txt
    .venv/bin/python scripts/engine_tests.py --only sglang==0.5.17 --tests /path/to/sglang/test

For each engine environment of tests/engine_env.py (only those already installed: this script
installs no engine), it

1. asks flashfix, in that environment and without importing the engine, which patches it would
   apply there (the doctor's ``patch`` verdict) and which modules those patches rewrite
   (``registry.targets_of``); an environment where nothing applies has nothing to compare;
2. fetches the engine's own tests for exactly that release at run time, into a temporary folder:
   the ``tests/`` of its sdist on PyPI (vLLM ships them), else the tag's source tarball on GitHub
   (SGLang publishes no sdist after 0.5.10), or a tree given with ``--tests``; nothing of them is
   kept in this repository;
3. picks the test files that import one of those modules or name it in a string (monkeypatch
   targets), by reading their AST;
4. runs them twice under pytest in the engine's environment, CPU only (``CUDA_VISIBLE_DEVICES=``):
   ``FLASHFIX_DISABLE=all``, then ``FLASHFIX_STRICT=1`` with flashfix active; the plugin
   ``engine_tests_plugin.py`` imports flashfix before any test module and records each test's
   outcome and ``flashfix.status()``;
5. fails (exit 1) unless every test id has the same outcome in both runs, no patch ended
   ``failed``/``unknown-shape`` and every patch the doctor announced whose module the tests
   imported is ``applied`` in the active run (or ``not-affected`` because what it changes is not
   bound in this process: SGLang's FlashInfer helpers exist only where FlashInfer is available).

pytest (and the two test-only packages vLLM's tests import at collection, tblib and multiprocess)
are not in the engine environments: they are installed once into a separate folder that is put at
the END of ``sys.path``, so the engine's own packages always win. Tests that need a GPU skip (or
fail the same way) on both sides: the summary says how many passed, and which patched code
actually ran (``status()["ran"]``).
"""

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import engine_env  # noqa: E402

CACHE = Path(os.environ.get("FLASHFIX_ENGINE_TESTS_CACHE", Path.home() / ".cache" / "flashfix-engine-tests"))
SIMPLE = "https://pypi.org/simple/{dist}/"
GITHUB = {"vllm": "vllm-project/vllm", "sglang": "sgl-project/sglang"}
TARBALL = "https://codeload.github.com/{repo}/tar.gz/refs/tags/v{version}"
OVERLAY_PACKAGES = ("pytest>=8,<9", "tblib", "multiprocess")
TIMEOUT = 1800  # seconds per pytest run

PLAN = r"""
import json, sys
from flashfix.core import registry
from flashfix.tools import doctor
patches = {p.id: p for p in registry.load_all()}
rows = [r for r in doctor.diagnose()[0] if r["verdict"] == "patch"]
print(json.dumps({r["id"]: [r["engine"], r["engine_version"], list(registry.targets_of(patches[r["id"]]))] for r in rows}))
"""

SHIPPED = r"""
import importlib.util, os
spec = importlib.util.find_spec(%r)
for name in ("test", "tests"):
    folder = os.path.join(spec.submodule_search_locations[0], name)
    if os.path.isdir(folder):
        print(folder)
        break
"""

RUN = r"""
import sys
sys.path.append(%r)   # pytest and the tests' extra packages, after the engine's own
sys.path.append(%r)   # flashfix (this checkout) and the plugin
sys.path.append(%r)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def fetch(url, dest):
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        log("  downloading", url)
        request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json",
                                                       "User-Agent": "flashfix-engine-tests"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            data = answer.read()
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(dest)
    return dest


def sdist_url(dist, version):
    request = urllib.request.Request(SIMPLE.format(dist=dist), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    name = "%s-%s.tar.gz" % (dist, version)
    return next((f["url"] for f in files if f["filename"] == name), None)


def extract_tests(archive, into):
    """The archive's top-level ``tests/`` or ``test/`` folder (one level under its root) into ``into``;
    returns the folder, or None if the archive has none."""
    found = None
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if len(parts) > 2 and parts[1] in ("tests", "test") and (m.isfile() or m.isdir()):
                found = found or parts[1]
                m.name = "/".join(parts[1:])
                members.append(m)
        if not members:
            return None
        tar.extractall(into, members=members, filter="data")
    return Path(into) / found


def engine_tests(dist, version, into, given=None):
    """[(folder of the engine's tests for this release, where they came from)]: ``given``, else the
    ``tests/`` of the release's sdist, else its tag's tarball on GitHub; [] with a note if neither
    can be read (the tests the wheel itself ships are added by the caller)."""
    if given:
        return [(Path(given), "given: %s" % given)], []
    url = sdist_url(dist, version)
    if url:
        folder = extract_tests(fetch(url, CACHE / "sources" / url.rsplit("/", 1)[1]), into)
        if folder:
            return [(folder, url)], []
    url = TARBALL.format(repo=GITHUB[dist], version=version)
    try:
        archive = fetch(url, CACHE / "sources" / ("%s-v%s-github.tar.gz" % (dist, version)))
    except OSError as exc:
        return [], ["no sdist with tests on PyPI, and %s cannot be read here (%s): pass --tests" % (url, exc)]
    folder = extract_tests(archive, into)
    return ([(folder, url)], []) if folder else ([], ["%s has no test/ or tests/ folder" % url])


def mentions(path, modules):
    """The modules of ``modules`` that the test file imports or names in a string literal."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return set()
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
            named.update("%s.%s" % (node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 300:
            named.add(node.value)
    return {m for m in modules if any(n == m or n.startswith(m + ".") for n in named)}


def overlay(python):
    folder = CACHE / ("pytest-overlay-py%s" % subprocess.run(
        [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True).stdout.strip())
    if not (folder / ".ready").exists():
        subprocess.run([engine_env.uv(), "pip", "install", "-q", "--target", str(folder), "--python", str(python),
                        *OVERLAY_PACKAGES], check=True)
        (folder / ".ready").write_text("\n".join(OVERLAY_PACKAGES) + "\n")
    return folder


def pytest_run(python, rootdir, files, env_extra, out_json):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONDONTWRITEBYTECODE": "1", "ENGINE_TESTS_OUT": str(out_json)}, **env_extra)
    env.pop("PYTHONPATH", None)
    code = RUN % (str(overlay(python)), str(REPO), str(REPO / "scripts"))
    cmd = ["nice", "-n", "10", str(python), "-c", code, "-q", "-p", "engine_tests_plugin", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-o", "addopts=", "--rootdir", "/", *files]  # "/": every test has its own id
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=rootdir, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    seconds = time.monotonic() - start
    if not out_json.exists():
        raise SystemExit("pytest wrote no results (exit %d):\n%s\n%s" % (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:]))
    result = json.loads(out_json.read_text())
    result["seconds"] = seconds
    result["tail"] = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    return result


def display(path, work):
    """A test file or id, without the temporary folder or the environment's site-packages."""
    path = ("/" + str(path).lstrip("/")).replace(str(work / "src") + "/", "")  # ids are relative to "/"
    return path.split("site-packages/", 1)[-1]


def counts(outcomes):
    tally = {}
    for outcome in outcomes.values():
        tally[outcome] = tally.get(outcome, 0) + 1
    return ", ".join("%d %s" % (tally[k], k) for k in ("passed", "failed", "error", "skipped") if k in tally) or "no tests"


def one(requirement, given, keep):
    dist, version = requirement.split("==")
    python = engine_env.root() / requirement.replace("==", "-") / "bin" / "python"
    if not (python.parent.parent / ".flashfix-ready").exists():
        return ["%s: environment not installed (tests/engine_env.py %s): not run" % (requirement, requirement)], True
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    plan = json.loads(subprocess.run([str(python), "-c", PLAN], env={**clean, "PYTHONPATH": str(REPO)},
                                     capture_output=True, text=True, check=True).stdout)
    lines = ["%s" % requirement]
    if not any(engine == dist for engine, _, _ in plan.values()):
        lines.append("  no %s patch applies to this release (doctor): nothing to compare, not run" % dist)
        return lines, True
    modules = sorted({m for _, _, targets in plan.values() for m in targets})
    work = Path(tempfile.mkdtemp(prefix="engine-tests-%s-" % requirement.replace("==", "-")))
    sources, notes = engine_tests(dist, version, work / "src", given)
    shipped = subprocess.run([str(python), "-c", SHIPPED % dist], capture_output=True, text=True).stdout.strip()
    if shipped and not given:  # the tests the wheel itself ships (sglang/test/...): run in place, never written to
        sources.append((Path(shipped), "the installed wheel's %s" % shipped))
    picked = {}
    for folder, _ in sources:
        for path in sorted(folder.rglob("test_*.py")):
            hit = mentions(path, modules)
            if hit:
                picked[str(path)] = sorted(hit)
    lines.append("  patches the doctor announces: %s" % ", ".join(sorted(plan)))
    lines += ["  tests from: %s" % source for _, source in sources] + ["  %s" % note for note in notes]
    lines.append("  %d test files import or name a patched module:" % len(picked))
    lines += ["    %s  (%s)" % (display(f, work), ", ".join(m)) for f, m in picked.items()]
    if not picked:
        return lines, not notes
    runs = {}
    for label, extra in (("disabled", {"FLASHFIX_DISABLE": "all"}), ("active", {"FLASHFIX_STRICT": "1"})):
        log("%s: pytest, flashfix %s, %d files" % (requirement, label, len(picked)))
        runs[label] = pytest_run(python, work, list(picked), extra, work / ("%s.json" % label))
        lines.append("  flashfix %-8s %s  (%.0f s)" % (label + ":", counts(runs[label]["outcomes"]), runs[label]["seconds"]))
    off, on = runs["disabled"]["outcomes"], runs["active"]["outcomes"]
    lines.append("  per file, flashfix active:")
    for path in sorted({k.split("::", 1)[0] for k in on}):
        lines.append("    %s: %s (%.0f s)" % (display(path, work), counts({k: v for k, v in on.items() if k.split("::", 1)[0] == path}),
                                            runs["active"].get("file_seconds", {}).get(path, 0.0)))
    differ = sorted(k for k in set(off) | set(on) if off.get(k) != on.get(k))
    ok = not differ
    lines.append("  same outcome per test id: %s" % ("yes (%d ids)" % len(on) if ok else "NO, %d differ:" % len(differ)))
    lines += ["    %s: disabled %s, active %s" % (display(k, work), off.get(k), on.get(k)) for k in differ[:40]]
    imported = set(runs["active"]["imported"])
    states = {row["id"]: row for row in runs["active"]["status"]}
    off_states = {row["id"]: row["state"] for row in runs["disabled"]["status"]}
    if any(s not in ("disabled", "not-installed") for s in off_states.values()):
        ok = False
        lines.append("  FLASHFIX_DISABLE=all run: flashfix was not disabled: %s" % off_states)
    for pid, (_, _, targets) in sorted(plan.items()):
        row = states.get(pid, {})
        seen = all(t in imported for t in targets)
        # not-affected in this process (source.NotBound): what it changes is defined only where FlashInfer is
        # available, which a CPU run is not; the doctor cannot tell that from the source
        unbound = row.get("state") == "not-affected" and "in this process" in row.get("reason", "")
        good = row.get("state") == "applied" or unbound if seen else row.get("state") == "waiting"
        ok = ok and good
        lines.append("  %-40s %s%s%s" % (pid, row.get("state"), ", its patched code ran" if row.get("ran") else
                                         " (%s)" % row["reason"] if unbound else "",
                                         "" if seen else " (the tests never import %s)" % ", ".join(targets)))
    bad = [pid for pid, row in states.items() if row["state"] in ("failed", "unknown-shape")]
    if bad:
        ok = False
        lines.append("  failed or unknown-shape in the active run: %s" % ", ".join(bad))
    if not any(row.get("state") == "applied" for row in states.values()):
        ok = False
        lines.append("  no patch was applied in the active run: the comparison proves nothing")
    if not any(v == "passed" for v in on.values()):
        lines.append("  no test passed on this machine: the comparison covers importing the patched modules only")
    lines.append("  verdict: %s" % ("same outcomes, patches applied" if ok else "FAILED"))
    if keep:
        lines.append("  kept: %s" % work)
    else:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return lines, ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated releases of tests/engine_env.py (default: all installed)")
    parser.add_argument("--tests", help="the engine's test folder to use instead of fetching it (one release)")
    parser.add_argument("--out", help="also write the summary to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders (tests and raw results)")
    args = parser.parse_args(argv)
    releases = args.only.split(",") if args.only else list(engine_env.RELEASES)
    unknown = [r for r in releases if r not in engine_env.RELEASES]
    if unknown:
        parser.error("not in tests/engine_env.py RELEASES: %s" % ", ".join(unknown))
    command = "python scripts/engine_tests.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report, all_ok = ["# %s" % command.strip(), "# %s UTC, flashfix %s" % (
        time.strftime("%Y-%m-%d %H:%M", time.gmtime()), subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip())], True
    for requirement in releases:
        lines, ok = one(requirement, args.tests, args.keep)
        all_ok = all_ok and ok
        report += lines
        print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(report) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
