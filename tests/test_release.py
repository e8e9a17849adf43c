"""The release: the wheel and sdist that ``uv build`` makes, the long description, ``--version``,
the CHANGELOG, the CI and drift-watch workflows (linted), and the drift watch's comparison."""

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import REPO

VERSION = "0.2.0"
SWEEP = REPO / "scripts" / "sweep_releases.py"
COMMITTED = REPO / "benchmarks" / "results" / "sweep.json"
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def uv():
    return shutil.which("uv") or pytest.fail("uv is not on PATH: run the README's test command")


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([uv(), "build", "-q", "-o", str(out), str(REPO)], capture_output=True, text=True,
                          timeout=600)  # the sdist, and the wheel built from it
    assert proc.returncode == 0, proc.stderr
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert [w.name for w in wheels] == ["flashfix-%s-py3-none-any.whl" % VERSION]
    assert [s.name for s in sdists] == ["flashfix-%s.tar.gz" % VERSION]
    return wheels[0], sdists[0]


def test_wheel_holds_the_startup_files_the_patches_and_its_version(dist):
    wheel, _ = dist
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for start in ("flashfix.pth", "flashfix.start", "_flashfix_boot.py"):  # top level, next to flashfix/
            assert start in names, start
            assert z.read(start) == (REPO / "startup" / start).read_bytes(), start
        for module in ("__init__.py", "vllm_patch.py", "sglang_patch.py", "flashinfer_patch.py"):
            assert "flashfix/" + module in names, module
        shipped = {n for n in names if n.startswith("flashfix/") and n.endswith(".py")}
        source = {"flashfix/" + p.relative_to(REPO / "flashfix").as_posix() for p in (REPO / "flashfix").rglob("*.py")}
        assert shipped == source  # every module of the package, nothing else
        assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/", "docs/"))]
        info = "flashfix-%s.dist-info/" % VERSION
        metadata = z.read(info + "METADATA").decode()
        entry_points = z.read(info + "entry_points.txt").decode()
    assert re.search(r"^Version: %s$" % re.escape(VERSION), metadata, re.M)
    assert re.search(r"^Description-Content-Type: text/markdown", metadata, re.M)
    assert re.search(r"^Requires-Dist: packaging", metadata, re.M)
    assert "flashfix = flashfix.tools.cli:main" in entry_points


def test_sdist_holds_what_the_readme_and_the_tests_need(dist):
    _, sdist = dist
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", "scripts/test.sh", "scripts/sweep_releases.py",
                   ".ci/run", "startup/flashfix.pth", "startup/flashfix.start", "startup/_flashfix_boot.py",
                   "tests/conftest.py", "benchmarks/results/sweep.json", "docs/compatibility.md",
                   "docs/guarantees.md", "docs/overheads.md", "docs/gpu.md", "docs/diff.md",
                   ".github/workflows/ci.yml", ".github/workflows/drift.yml"):
        assert needed in names, needed


def test_long_description_renders(dist):
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict"] + [str(p) for p in dist],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_installed_wheel_says_its_version(dist, tmp_path):
    wheel, _ = dist
    env_dir = tmp_path / "venv"
    subprocess.run([uv(), "venv", "-q", "--python", sys.executable, str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    subprocess.run([uv(), "pip", "install", "-q", "--no-deps", "--python", str(python), str(wheel)], check=True,
                   timeout=300)
    for command in ([str(env_dir / "bin" / "flashfix"), "--version"], [str(python), "-m", "flashfix", "--version"]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "flashfix %s\n" % VERSION, ""), command


def test_version_flag_of_this_checkout_is_cheap():
    """``flashfix --version`` loads neither the engines nor any of flashfix's tools."""
    code = ("import sys\n"
            "from flashfix.tools.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'sglang', 'flashinfer',"
            " 'wrapt', 'packaging') or m.startswith(('flashfix.tools.doctor', 'flashfix.tools.diff', 'flashfix.tools.verify',"
            " 'flashfix.tools.doctor', 'flashfix.tools.diff', 'flashfix.tools.verify')))\n"
            "print('loaded', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "flashfix %s\nloaded []\n" % VERSION


def test_changelog_has_this_release_under_a_fresh_unreleased_section():
    import flashfix

    assert flashfix.__version__ == VERSION
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", text, re.M)
    assert headings[0][0] == "Unreleased"
    assert headings[1] == (VERSION, " - 2026-12-01")
    assert ("0.1.0", " - 2026-11-29") in headings
    section = text.split("## [%s]" % VERSION, 1)[1].split("\n## [", 1)[0]
    assert section.count("\n- ") >= 10  # the release's changes, not a stub


def test_readme_is_a_short_guide_with_the_measurements_linked():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 400
    assert "RUN pip install --no-cache-dir --compile flashfix==%s" % VERSION in readme  # the Dockerfile example
    assert "COPY flashfix-%s-py3-none-any.whl" % VERSION in readme
    for doc in ("docs/gpu.md", "docs/overheads.md", "docs/compatibility.md", "docs/guarantees.md"):
        assert "](%s" % doc in readme, doc
    for page in [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not link.startswith(("http://", "https://")):
                assert (page.parent / link).exists(), (page.name, link)
        # user-facing text: no work history
        assert not re.search(r"\bissue #\d|this session|\(#\d+\)", text, re.I), page.name


# --- the workflows ----------------------------------------------------------------------------


def lint(*paths):
    """check-jsonschema with the GitHub workflow schema it ships (no network)."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows"]
                          + [str(p) for p in paths], capture_output=True, text=True, timeout=120)


def test_workflows_pass_the_linter():
    assert [p.name for p in WORKFLOWS] == ["ci.yml", "drift.yml"]
    proc = lint(*WORKFLOWS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok -- validation done" in proc.stdout


def test_linter_rejects_a_broken_workflow(tmp_path):
    """The lint can fail: a job without runs-on, a trigger that does not exist."""
    broken = tmp_path / "broken.yml"
    text = (REPO / ".github" / "workflows" / "ci.yml").read_text()
    broken.write_text(text.replace("    runs-on: ubuntu-latest\n", "").replace("  pull_request:\n", "  pull_requests:\n"))
    proc = lint(broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def actionlint(*paths):
    """actionlint (the PyPI build of its binary, in the test extra), no shellcheck needed."""
    binary = shutil.which("actionlint", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert binary, "actionlint is not installed: run the README's test command (it installs the test extra)"
    return subprocess.run([binary, "-no-color", "-shellcheck=", "-pyflakes="] + [str(p) for p in paths],
                          capture_output=True, text=True, timeout=120)


def test_workflows_pass_actionlint():
    proc = actionlint(*WORKFLOWS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_actionlint_rejects_what_the_schema_lets_through(tmp_path):
    """actionlint reads what a schema cannot: an expression naming an unknown context, an
    action on a deprecated runtime."""
    broken = tmp_path / "broken.yml"
    text = (REPO / ".github" / "workflows" / "ci.yml").read_text()
    broken.write_text(text.replace("run: bash scripts/test.sh -q", "run: bash scripts/test.sh -q ${{ matrix.nope }}")
                      .replace("actions/checkout@v5", "actions/checkout@v3"))
    assert lint(broken).returncode == 0  # the schema check alone lets it through
    proc = actionlint(broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "matrix" in proc.stdout and "checkout@v3" in proc.stdout, proc.stdout


def test_ci_runs_the_readme_test_command_and_drift_runs_the_checked_sweep():
    readme = (REPO / "README.md").read_text()
    assert "```sh\nbash scripts/test.sh\n```" in readme
    ci = (REPO / ".github" / "workflows" / "ci.yml").read_text()
    assert re.search(r"^on:\n  push:\n  pull_request:\n", ci, re.M)
    assert re.search(r"^\s+run: bash scripts/test\.sh\b", ci, re.M)
    drift = (REPO / ".github" / "workflows" / "drift.yml").read_text()
    assert re.search(r"^on:\n  schedule:\n    - cron: \"[^\"]+\"\n  workflow_dispatch:\n", drift, re.M)
    assert "python scripts/sweep_releases.py --quiet --check benchmarks/results/sweep.json" in drift
    assert "uses: actions/upload-artifact@v6" in drift and "if: always()" in drift


# --- the drift watch's comparison ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_script():
    spec = importlib.util.spec_from_file_location("sweep_releases_under_test", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(dist, version, **verdicts):
    return {"dist": dist, "version": version, "yanked": False,
            "verdicts": {pid: {"verdict": v, "reason": "why %s" % v} for pid, v in verdicts.items()}}


SMALL = [_row("sglang", "0.5.14", **{"sglang-fp8-kv-scales": "patch", "sglang-vision-config": "patch"}),
         _row("vllm", "0.28.0", **{"vllm-sink-prefill": "fixed-upstream"})]


def test_check_identical_sweep_passes(sweep_script):
    assert sweep_script.check(SMALL, copy.deepcopy(SMALL)) == ([], [])


def test_check_changed_verdict_fails(sweep_script):
    now = copy.deepcopy(SMALL)
    now[0]["verdicts"]["sglang-vision-config"] = {"verdict": "not-affected", "reason": "gone"}
    failures, _ = sweep_script.check(SMALL, now)
    assert failures == ["sglang 0.5.14 sglang-vision-config: was patch, now not-affected: gone"]


def test_check_unknown_shape_fails_even_when_committed(sweep_script):
    then = copy.deepcopy(SMALL)
    then[1]["verdicts"]["vllm-sink-prefill"] = {"verdict": "unknown-shape", "reason": "odd factory"}
    failures, _ = sweep_script.check(then, copy.deepcopy(then))
    assert failures == ["vllm 0.28.0 vllm-sink-prefill: unknown-shape: odd factory"]
    new = copy.deepcopy(SMALL) + [_row("vllm", "0.40.0", **{"vllm-sink-prefill": "unknown-shape"})]
    failures, notes = sweep_script.check(SMALL, new)  # a new release of unknown shape fails too
    assert failures == ["vllm 0.40.0 vllm-sink-prefill: unknown-shape: why unknown-shape"]


def test_check_lost_verdict_fails_and_news_are_notes(sweep_script):
    now = copy.deepcopy(SMALL)
    del now[0]["verdicts"]["sglang-fp8-kv-scales"]
    now[1]["verdicts"]["vllm-sink-prefill"]["reason"] = "reworded"
    now.append(_row("sglang", "0.5.99", **{"sglang-fp8-kv-scales": "fixed-upstream"}))
    failures, notes = sweep_script.check(SMALL, now)
    assert failures == ["sglang 0.5.14 sglang-fp8-kv-scales: was patch, now not judged (no verdict)"]
    assert notes == ["vllm 0.28.0 vllm-sink-prefill: fixed-upstream as before, reason now: reworded",
                     "sglang 0.5.99: new since the committed sweep: sglang-fp8-kv-scales=fixed-upstream"]
    _, notes = sweep_script.check(SMALL, now[1:], full=True)
    assert notes[-1] == "sglang 0.5.14: in the committed sweep, no longer listed on the index"
    _, notes = sweep_script.check(SMALL, now[1:], full=False)  # --only: the rest was not asked for
    assert not [n for n in notes if "no longer listed" in n]


def test_check_committed_sweep_passes_against_itself(sweep_script):
    releases = json.loads(COMMITTED.read_text())["releases"]
    assert sweep_script.check(releases, copy.deepcopy(releases)) == ([], [])


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _run(*args):
    env = _env()
    return subprocess.run([sys.executable, str(SWEEP), "--quiet"] + list(args), env=env, capture_output=True,
                          text=True, timeout=600)


def test_check_of_an_unreadable_file_is_refused_before_any_network(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    for path in (bad, tmp_path / "missing.json"):
        proc = _run("--only", "sglang==0.5.1", "--index", "http://127.0.0.1:9/{name}/json", "--check", str(path))
        assert proc.returncode == 2 and "not a sweep result" in proc.stderr, proc.stderr


def test_check_on_a_real_release(tmp_path):
    """The command the drift watch runs, on one release read from PyPI: exit 0 against the
    committed verdict, 1 (naming the drift) against a changed one."""
    committed = json.loads(COMMITTED.read_text())
    row = [r for r in committed["releases"] if (r["dist"], r["version"]) == ("sglang", "0.5.1")]
    same, changed = tmp_path / "same.json", tmp_path / "changed.json"
    same.write_text(json.dumps({"meta": committed["meta"], "releases": row}))
    edited = copy.deepcopy(row)
    edited[0]["verdicts"]["sglang-fp8-kv-scales"]["verdict"] = "fixed-upstream"
    changed.write_text(json.dumps({"meta": committed["meta"], "releases": edited}))
    proc = _run("--only", "sglang==0.5.1", "--check", str(same), "--markdown", str(tmp_path / "table.md"))
    assert proc.returncode == 0, proc.stderr
    assert "no drift from %s (1 releases checked)" % same in proc.stderr
    assert "| 0.5.1 | patch |" in (tmp_path / "table.md").read_text()
    proc = _run("--only", "sglang==0.5.1", "--check", str(changed))
    assert proc.returncode == 1, proc.stderr
    assert "DRIFT: sglang 0.5.1 sglang-fp8-kv-scales: was fixed-upstream, now patch" in proc.stderr


def test_the_readmes_check_command_runs_twice_and_states_its_size(tmp_path):
    """Before: a second run failed (``uv venv`` refuses an existing folder) and no size was said. The command as
    printed, run as a newcomer would (the machine's python3, not this checkout's .venv), its folder moved under
    tmp_path; the second run reuses the first's environment."""
    readme = (REPO / "README.md").read_text()
    intro, block = re.search(r"^Check an environment: (.*?)\n\n```sh\n(.*?)\n```", readme, re.S | re.M).groups()
    assert re.search(r"about \d+ GB on disk", intro) and "can be run again" in intro, intro
    assert block.count("/tmp/ff") >= 3
    command = block.replace("/tmp/ff", str(tmp_path / "ff"))
    venv_bin = str(REPO / ".venv" / "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("FLASHFIX_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    for attempt in ("first", "second"):
        proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, (attempt, proc.stdout[-2000:], proc.stderr[-3000:])
        assert "sglang-fp8-kv-scales" in proc.stdout and "patch" in proc.stdout, (attempt, proc.stdout[-2000:])
