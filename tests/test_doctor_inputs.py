"""``flashfix doctor`` on odd inputs: metadata the email parser reads its own way, versions that
are not PEP 440, a wheel member that inflates without bound, a setuptools editable engine read
through ``--path``, malformed wheels, an interpreter that answers in an unexpected form, and the
``--python`` probe program itself. Each case goes through the command line, in a fresh process,
against the real SGLang 0.5.17 code where an engine matters."""

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import engine_env
import vet_helpers
from conftest import REPO

SGLANG = "sglang==0.5.17"
PREFIX = "\x1eflashfix-remote "


def _python():
    return engine_env.env_python(SGLANG)


def _run(*args, python=sys.executable, env=None, limit_as=None):
    """``python -m flashfix ARGS`` from this checkout (cwd /, so only PYTHONPATH decides which
    flashfix runs); ``limit_as``: an address-space limit in bytes, as a CI container has."""
    preexec = None
    if limit_as is not None:
        import resource

        def preexec():
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([str(python), "-m", "flashfix", *map(str, args)], capture_output=True, text=True,
                          env=vet_helpers.clean_env(env), timeout=600, cwd="/", preexec_fn=preexec)


def _one_line_exit_2(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    return lines[0]


def _shadow_metadata(tmp_path, raw):
    """A folder that, put ahead of site-packages, gives sglang a METADATA of bytes ``raw``."""
    folder = tmp_path / "shadow"
    (folder / "sglang-0.5.17.dist-info").mkdir(parents=True)
    (folder / "sglang-0.5.17.dist-info" / "METADATA").write_bytes(raw)
    return folder


ODD_METADATA = {
    "utf8-bom": b"\xef\xbb\xbfMetadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n",
    "non-ascii-header-name": "Metadata-Version: 2.1\nName: sglang\nN\u00e4me: x\nVersion: 0.5.17\n".encode(),
    "whitespace-line-after-version": b"Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n \nSummary: s\n",
}


@pytest.mark.parametrize("case", sorted(ODD_METADATA))
def test_odd_metadata_reads_the_same_inside_and_through_python(tmp_path, case):
    """The doctor run inside the environment and ``doctor --python`` of it read the engine's
    version the same way (both through importlib.metadata), sources included."""
    python = _python()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(_shadow_metadata(tmp_path, ODD_METADATA[case]))])}
    inside = _run("doctor", "--json", python=python, env=env)
    outside = _run("doctor", "--json", "--python", python, env=env)
    assert inside.returncode == 0 and outside.returncode == 0, (inside.stderr, outside.stderr)
    rows = json.loads(inside.stdout)
    assert rows == json.loads(outside.stdout)
    sglang = [r for r in rows if r["engine"] == "sglang" and r["verdict"] != "known-unfixed"]  # named by version
    assert [r["verdict"] for r in sglang] == [
        v for v in vet_helpers.release_verdicts("sglang", "0.5.17") if v != "known-unfixed"], sglang
    from importlib.metadata import PathDistribution

    expected = PathDistribution(tmp_path / "shadow" / "sglang-0.5.17.dist-info").version
    assert all(r["engine_version"] == expected for r in sglang), (expected, sglang)


@pytest.mark.parametrize("version", ["0.5.16.po\u017ft1", "0.5.16prev\u0130ew1"])
def test_invalid_version_gives_a_clean_verdict(tmp_path, version):
    """A version that is not PEP 440 (a long s, a dotted capital I) is in no range: the pre-fix
    shape is unknown-shape, never patch, and never a traceback."""
    raw = ("Metadata-Version: 2.1\nName: sglang\nVersion: %s\n" % version).encode()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(_shadow_metadata(tmp_path, raw))])}
    proc = _run("doctor", "--json", python=_python(), env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    sglang = [r for r in json.loads(proc.stdout) if r["engine"] == "sglang"]
    from flashfix.sglang_patch import PATCHES

    assert [r["id"] for r in sglang] == [p.id for p in PATCHES], sglang  # every patch, no Known: in no range
    assert all(r["engine_version"] == version for r in sglang), sglang
    fixed = {"sglang-eagle-draft-graph-kv-indices", "sglang-eagle-mla-draft-graph-kv-indices",
             "sglang-per-layer-heads-plan", "sglang-cross-attn-decode-plan-lens",
             "sglang-merge-state-launch-limit", "sglang-piecewise-graph-paged-prefill",
             "sglang-triton-per-layer-heads-buffers", "sglang-swa-ragged-prefix-extend-slots", "sglang-swa-ragged-prefix-slots-0.5.10",
             "sglang-encoder-only-paged-causal", "sglang-encoder-only-ragged-causal",
             "sglang-swa-paged-plan-window-left"}  # fixed in 0.5.17's code: no version needed
    absent = {"sglang-trtllm-fp8-moe-swiglu-limit"}  # 0.5.17's code has no such function: that needs no version either
    assert {r["id"]: r["verdict"] for r in sglang} == {r["id"]: "fixed-upstream" if r["id"] in fixed else
                                                       "not-affected" if r["id"] in absent else "unknown-shape"
                                                       for r in sglang}, sglang
    assert all("is outside" in r["reason"] for r in sglang if r["id"] not in fixed | absent), sglang


def _wheel(path, members):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


METADATA = "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n"


def _lie_about_size(wheel, member, size):
    """Make the zip's local and central headers say ``member`` inflates to ``size`` bytes."""
    import struct

    with zipfile.ZipFile(wheel) as archive:
        offset, central = archive.getinfo(member).header_offset, archive.start_dir
    raw = bytearray(wheel.read_bytes())
    assert raw[offset:offset + 4] == b"PK\x03\x04"
    struct.pack_into("<I", raw, offset + 22, size)
    while True:  # the central directory's record of the member
        assert raw[central:central + 4] == b"PK\x01\x02"
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, central + 28)
        if raw[central + 46:central + 46 + name_len] == member.encode():
            break
        central += 46 + name_len + extra_len + comment_len
    struct.pack_into("<I", raw, central + 24, size)
    wheel.write_bytes(bytes(raw))


@pytest.mark.parametrize("header", ["true-size", "lying-size"])
def test_zip_bomb_member_gives_one_line_and_exit_2(tmp_path, header):
    """A 0.5 MB wheel whose engine module inflates to 512 MiB, read under a 1 GiB address-space
    limit: one line, exit status 2, memory bounded; also when the zip's headers claim a small
    size (zipfile stops there, and the CRC check fails)."""
    wheel = tmp_path / "sglang-0.5.17-py3-none-any.whl"
    member = "sglang/srt/configs/model_config.py"
    _wheel(wheel, {"sglang-0.5.17.dist-info/METADATA": METADATA, "sglang/__init__.py": "",
                   "sglang/srt/__init__.py": "", "sglang/srt/configs/__init__.py": ""})
    with zipfile.ZipFile(wheel, "a", zipfile.ZIP_DEFLATED) as archive:
        with archive.open(member, "w") as handle:
            block = b"#" * (1 << 20)
            for _ in range(512):
                handle.write(block)
    assert wheel.stat().st_size < 2 << 20
    if header == "lying-size":
        _lie_about_size(wheel, member, 100)
    line = _one_line_exit_2(_run("doctor", "--path", wheel, limit_as=1 << 30))
    assert "model_config.py" in line and ("MiB" in line if header == "true-size" else "CRC" in line), line


def test_wheel_with_two_dist_info_folders_is_an_error(tmp_path):
    wheel = _wheel(tmp_path / "sglang-0.5.17-py3-none-any.whl", {
        "sglang-0.5.17.dist-info/METADATA": METADATA,
        "sglang-0.5.16.dist-info/METADATA": METADATA.replace("0.5.17", "0.5.16"),
        "sglang/__init__.py": ""})
    line = _one_line_exit_2(_run("doctor", "--path", wheel))
    assert ".dist-info" in line, line


@pytest.mark.parametrize("missing", ["Version", "Name"])
def test_wheel_metadata_without_name_or_version_is_an_error(tmp_path, missing):
    text = "".join(line + "\n" for line in METADATA.splitlines() if not line.startswith(missing + ":"))
    wheel = _wheel(tmp_path / "sglang-0.5.17-py3-none-any.whl", {
        "sglang-0.5.17.dist-info/METADATA": text, "sglang/__init__.py": ""})
    line = _one_line_exit_2(_run("doctor", "--path", wheel))
    assert missing in line, line


def test_other_unreadable_paths_give_one_line(tmp_path):
    (tmp_path / "not-a-zip.whl").write_text("not a zip")
    for path in (tmp_path / "not-a-zip.whl", tmp_path / "does-not-exist"):
        _one_line_exit_2(_run("doctor", "--path", path))


def test_fifo_or_device_path_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "pipe.whl")
    for path in (tmp_path / "pipe.whl", "/dev/zero"):
        try:
            proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--path", str(path)], capture_output=True,
                                  text=True, env=vet_helpers.clean_env(), timeout=30, cwd="/")
        except subprocess.TimeoutExpired:
            pytest.fail("doctor --path %s hangs" % path)
        _one_line_exit_2(proc)


def _fake_interpreter(tmp_path, name, body):
    exe = tmp_path / name
    exe.write_text("#!%s\n%s" % (sys.executable, textwrap.dedent(body)))
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("body", [
    "print(%r + '[1, 2]', flush=True)\n" % PREFIX,
    "print(%r + '{\"hello\": true}', flush=True)\n" % PREFIX,
    "print(%r + '\"hello\"', flush=True)\n" % PREFIX,
    # a proper hello, then answers that are lists
    "import sys\nprint(%r + '{\"hello\": true, \"python\": [3, 11, 0], \"prefix\": \"/x\"}', flush=True)\n"
    "for line in sys.stdin:\n    print(%r + '[]', flush=True)\n" % (PREFIX, PREFIX),
    # a proper hello, then a find answer of the wrong form
    "import sys\nprint(%r + '{\"hello\": true, \"python\": [3, 11, 0], \"prefix\": \"/x\"}', flush=True)\n"
    "for line in sys.stdin:\n    print(%r + '{\"found\": true, \"kind\": \"text\", \"text\": 7}', flush=True)\n"
    % (PREFIX, PREFIX),
], ids=["list", "hello-without-keys", "string", "list-answers", "bad-find-answer"])
def test_python_answering_unexpected_json_gives_one_line(tmp_path, body):
    exe = _fake_interpreter(tmp_path, "python", body)
    _one_line_exit_2(_run("doctor", "--python", exe))


# --- doctor --path SITE-PACKAGES on a setuptools editable engine ------------------------------

def _editable_sglang(tmp_path):
    """A real setuptools (PEP 660) editable install of SGLang 0.5.17's own source tree, flat
    layout (so setuptools installs its ``__editable___*_finder`` module and an import line)."""
    site = vet_helpers.site_packages(_python())
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(site / "sglang", project / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "sglang"\nversion = "0.5.17"\n'
        '[tool.setuptools.packages.find]\ninclude = ["sglang*"]\n')
    (project / "README.md").write_text("x\n")  # another top-level file: setuptools cannot just add the root
    venv = tmp_path / "venv"
    uv = engine_env.uv()
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([uv, "pip", "install", "-q", "--no-deps", "--python", str(python), "packaging",  # flashfix's
                    "-e", str(project)], check=True)
    return python, vet_helpers.site_packages(python), project


def test_path_follows_a_setuptools_editable_finder(tmp_path):
    python, site, project = _editable_sglang(tmp_path)
    pth = [p.read_text() for p in site.glob("*.pth")]
    assert any("__editable___" in text and text.startswith("import") for text in pth), pth
    assert list(site.glob("__editable___*_finder.py")), sorted(os.listdir(site))
    env = {"PYTHONPATH": str(REPO)}
    by_path = _run("doctor", "--json", "--path", site, env=env)
    inside = _run("doctor", "--json", python=python, env=env)
    assert by_path.returncode == 0 and inside.returncode == 0, (by_path.stderr, inside.stderr)
    by_path, inside = json.loads(by_path.stdout), json.loads(inside.stdout)
    sglang = [r for r in by_path if r["engine"] == "sglang"]
    assert [r["verdict"] for r in sglang] == vet_helpers.release_verdicts("sglang", "0.5.17"), sglang
    assert vet_helpers.verdicts(by_path) == vet_helpers.verdicts(inside)
    assert vet_helpers.digests(by_path) == vet_helpers.digests(inside)
    module_files = [s["file"] for r in sglang for s in r["sources"] if "module" in s]
    assert module_files and all(f.startswith(str(project)) for f in module_files), module_files
    strict = _run("doctor", "--strict", "--path", site, env=env)
    assert strict.returncode == 0, strict.stderr


def test_path_never_calls_code_it_cannot_read_not_affected(tmp_path):
    """A site-packages whose .pth imports a finder --path cannot follow (not a setuptools
    editable finder), and whose engine package is a symlink loop: unknown-shape, and --strict
    fails, where it said not-affected and passed."""
    site = _shadow_metadata(tmp_path, METADATA.encode())
    (site / "vendor_finder.pth").write_text("import vendor_finder; vendor_finder.install()\n")
    (site / "vendor_finder.py").write_text("def install():\n    pass\n")
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "sglang-0.5.17.dist-info").mkdir()
    (loop / "sglang-0.5.17.dist-info" / "METADATA").write_text(METADATA)
    os.symlink("sglang", loop / "sglang")  # a link to itself
    for where in (site, loop):
        proc = _run("doctor", "--json", "--path", where)
        assert proc.returncode == 0, proc.stderr
        sglang = [r for r in json.loads(proc.stdout) if r["engine"] == "sglang"]
        # the known, uncarried fix is named by version where its code cannot be read
        expected = vet_helpers.release_verdicts("sglang", "0.5.17")
        assert [r["verdict"] for r in sglang] == [v if v == "known-unfixed" else "unknown-shape" for v in expected], (
            where, sglang)
        assert _run("doctor", "--strict", "--path", where).returncode == 1


def test_metadata_folder_in_a_symlink_loop_gives_one_line(tmp_path):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    os.symlink("sglang-0.5.17.dist-info", site / "sglang-0.5.17.dist-info")  # a link to itself
    line = _one_line_exit_2(_run("doctor", "--path", site))
    assert "symbolic links" in line, line


# --- the --python probe program ---------------------------------------------------------------

def test_remote_probe_is_a_file_run_by_path_that_imports_nothing_of_flashfix():
    probe = REPO / "flashfix" / "tools" / "remote_probe.py"
    proc = subprocess.run([sys.executable, "-X", "importtime", str(probe)], input="", capture_output=True,
                          text=True, timeout=60, cwd="/", env=vet_helpers.clean_env({"PYTHONPATH": ""}))
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "import time:" in line]
    assert "json" in imported and not [m for m in imported if m == "flashfix" or m.startswith("flashfix.")], imported
    hello = json.loads(proc.stdout.split("\n")[0][len(PREFIX):])
    assert hello["hello"] is True and hello["path"][0] == "", hello  # as `python -c` has it
    assert str(REPO / "flashfix") not in hello["path"]


def test_remote_probe_from_a_zipped_flashfix(tmp_path):
    """flashfix imported from a zip (no _remote_probe.py on disk): --python sends the probe's
    source through -c and reads the same as from this checkout."""
    zipped = tmp_path / "flashfix.zip"
    with zipfile.ZipFile(zipped, "w") as archive:
        for path in sorted((REPO / "flashfix").rglob("*.py")):
            archive.write(path, "flashfix/" + path.relative_to(REPO / "flashfix").as_posix())
    python = _python()
    from_zip = _run("doctor", "--json", "--python", python, env={"PYTHONPATH": str(zipped)})
    assert from_zip.returncode == 0, from_zip.stderr
    here = _run("doctor", "--json", "--python", python)
    assert json.loads(from_zip.stdout) == json.loads(here.stdout)
    check = subprocess.run([sys.executable, "-c", "import flashfix.tools.remote as r; print(r.__file__); "
                            "print(r.probe_command('python')[1])"], capture_output=True, text=True, cwd="/",
                           env=vet_helpers.clean_env({"PYTHONPATH": str(zipped)}))
    assert check.stdout.splitlines()[:2] == [str(zipped / "flashfix" / "tools" / "remote.py"), "-c"], check


def test_remote_probe_from_a_sourceless_flashfix(tmp_path):
    """flashfix installed as .pyc files only: the probe's .pyc is run by path (same Python)."""
    copy = tmp_path / "flashfix"
    shutil.copytree(REPO / "flashfix", copy, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-b", str(copy)], check=True)
    for path in copy.rglob("*.py"):
        path.unlink()
    python = _python()
    sourceless = _run("doctor", "--json", "--python", python, env={"PYTHONPATH": str(tmp_path)})
    assert sourceless.returncode == 0, sourceless.stderr
    assert json.loads(sourceless.stdout) == json.loads(_run("doctor", "--json", "--python", python).stdout)


def test_no_program_hides_in_a_string_constant():
    """No string constant in flashfix/ over 2,000 characters, docstrings included (a long
    module's documentation continues as a comment block)."""
    long = []
    files = sorted((REPO / "flashfix").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                if len(node.value) > 2000:
                    long.append("%s:%d (%d characters)" % (path.relative_to(REPO), node.lineno, len(node.value)))
    assert not long, long
