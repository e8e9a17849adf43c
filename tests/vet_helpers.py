"""Helpers for the ``flashfix doctor --path/--python`` and ``flashfix diff`` tests (tests/test_vet*.py).

* ``wheel(requirement)``: a released wheel from PyPI, downloaded once into
  ``$FLASHFIX_WHEEL_CACHE`` (default ``~/.cache/flashfix-wheels``) from the URL and sha256 that
  PyPI's JSON API gives (the wheel ``scripts/sweep_releases.py`` would read), so a clean
  machine fetches what it needs without pip, and reruns are fast.
* ``cli(...)``: ``python -m flashfix`` from this checkout, in a fresh process.
* ``doctor_inside(python, pythonpath)``: ``python -m flashfix doctor --json`` run inside an
  environment, flashfix importable from this checkout: what the outside views must equal.
* ``write_prefix_tree``: a source tree holding the vLLM pre-fix shape derived from 0.28.0.
* ``apply_unified_diff``: the "after" side of a printed unified diff, rebuilt from the
  installed file and the hunks, so a test compiles exactly what ``flashfix diff`` printed.
"""

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine_env import site_packages  # noqa: F401  (read from here by the vet tests)

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"


def wheel_cache():
    return Path(os.environ.get("FLASHFIX_WHEEL_CACHE", Path.home() / ".cache" / "flashfix-wheels"))


def _sweep():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_releases", REPO / "scripts" / "sweep_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel(requirement):
    """The path of the released wheel of ``requirement`` (``name==version``), downloaded once."""
    name, version = requirement.split("==")
    cache = wheel_cache()
    stem = re.sub(r"[-_.]+", "_", name).lower()
    pattern = str(cache / ("%s-%s-*.whl" % (stem, version)))
    found = glob.glob(pattern)
    if not found:
        sweep = _sweep()
        (_, _, entry, _), = sweep.plan([(name, version)], dists=[name])  # the sweep's wheel, absolute URL
        assert entry is not None, "%s has no wheel for this platform" % requirement
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / (entry["filename"] + ".part")
        digest = hashlib.sha256()
        url = entry["url"]
        with sweep.session().get(url, stream=True, timeout=120) as answer, open(partial, "wb") as out:
            answer.raise_for_status()
            for chunk in answer.iter_content(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        assert digest.hexdigest() == entry["digests"]["sha256"], "%s: sha256 differs from the index's" % url
        os.replace(partial, cache / entry["filename"])
        found = glob.glob(pattern)
    assert len(found) == 1, (requirement, found)
    return Path(found[0])


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def cli(*args, python=sys.executable, env=None, timeout=300):
    """``python -m flashfix ARGS`` from this checkout: the completed process."""
    return subprocess.run([str(python), "-m", "flashfix", *map(str, args)], capture_output=True, text=True,
                          env=clean_env(env), timeout=timeout, cwd=str(REPO))


def doctor_json(*args, python=sys.executable):
    proc = cli("doctor", "--json", *args, python=python)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


def doctor_inside(python, pythonpath=None):
    """``flashfix doctor --json`` run inside the environment of ``python`` (extra path entries
    ``pythonpath`` after this checkout)."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO)] + [str(p) for p in pythonpath or ()])}
    proc = cli("doctor", "--json", python=python, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def verdicts(rows):
    """The rows without their provenance (whose file names differ between views)."""
    return [{k: v for k, v in row.items() if k != "sources"} for row in rows]


def digests(rows):
    """``{(id, module or distribution): sha256}``: what each verdict was read from, by content."""
    out = {}
    for row in rows:
        for source in row["sources"]:
            key = source.get("module") or "dist:" + source["distribution"]
            out[(row["id"], key)] = source["sha256"]
    return out


def write_prefix_tree(dest, fixed_path, version="0.27.2.dev41+g0123abc"):
    """A source tree with the vLLM pre-fix shape of the FlashInfer backend (derived from the
    0.28.0 file by tests/vllm_prefix_shape.py), its parent packages and a dist-info."""
    sys.path.insert(0, str(TESTS))
    import vllm_prefix_shape

    dest = Path(dest)
    backends = dest / "vllm" / "v1" / "attention" / "backends"
    backends.mkdir(parents=True, exist_ok=True)
    for folder in (dest / "vllm", dest / "vllm" / "v1", dest / "vllm" / "v1" / "attention", backends):
        (folder / "__init__.py").write_text("")
    (backends / "flashinfer.py").write_text(vllm_prefix_shape.derive_prefix_source(Path(fixed_path).read_text()))
    info = dest / ("vllm-%s.dist-info" % version)
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: %s\n" % version)
    return dest


HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def file_diffs(text):
    """``[(old name, new name, [hunk lines])]`` of the unified diffs in ``text`` (other lines skipped)."""
    out, lines, i = [], text.splitlines(keepends=True), 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ") \
                and i + 2 < len(lines) and HUNK.match(lines[i + 2]):
            old, new = lines[i][4:].rstrip("\n"), lines[i + 1][4:].rstrip("\n")
            i += 2
            body = []
            while i < len(lines) and (HUNK.match(lines[i]) or lines[i][:1] in (" ", "+", "-")) \
                    and not lines[i].startswith("--- "):
                body.append(lines[i])
                i += 1
            out.append((old, new, body))
        else:
            i += 1
    return out


def apply_unified_diff(original, hunks):
    """``original`` (text) with ``hunks`` (lines of one file's unified diff) applied; every
    context and removed line must match the original where the hunk says."""
    old = original.splitlines(keepends=True)
    new, position, i = [], 0, 0
    while i < len(hunks):
        match = HUNK.match(hunks[i])
        assert match, hunks[i]
        start = int(match.group(1)) - 1
        new.extend(old[position:start])
        position = start
        i += 1
        while i < len(hunks) and not HUNK.match(hunks[i]):
            tag, line = hunks[i][0], hunks[i][1:]
            if tag in (" ", "-"):
                assert old[position] == line, (position + 1, old[position], line)
                position += 1
            if tag in (" ", "+"):
                new.append(line)
            i += 1
    new.extend(old[position:])
    return "".join(new)


def release_verdicts(dist, version):
    """What the doctor says of one release of ``dist``, in its row order: the committed sweep's verdict
    of each patch (tests/test_sweep.py holds that table equal to a live sweep of the wheels), then
    ``known-unfixed`` for each of the engine's ``Known`` entries whose range holds the version. Tests
    of other ways in (``--path``, editable installs, odd metadata) compare against this, so a new
    catalogue entry is counted once, in the sweep."""
    import importlib

    from packaging.specifiers import SpecifierSet

    releases = json.loads((REPO / "benchmarks" / "results" / "sweep.json").read_text())["releases"]
    (release,) = [r for r in releases if r["dist"] == dist and r["version"] == version]
    known = importlib.import_module("flashfix.%s_patch" % dist).KNOWN
    return [v["verdict"] for v in release["verdicts"].values()] + [
        "known-unfixed" for k in known if k.engine == dist and SpecifierSet(k.versions).contains(version, prereleases=True)]
