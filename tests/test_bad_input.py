"""The CLI on input it cannot use, and its children away from the caller's folder: ``flashfix verify`` run
in a folder holding a ``json.py`` (its children imported it: ``-c`` puts the current directory first on
``sys.path``), ``verify --path`` of a path that is not there (a traceback), ``verify --only`` of an unknown
id (not named), and ``flashfix doctor`` where no engine is installed (a table of not-installed rows, no word
that nothing was found)."""

import os
import re
import subprocess
import sys

import pytest

import engine_env
from conftest import REPO

needs_P = pytest.mark.skipif(sys.version_info < (3, 11), reason="the caller is started with -P (3.11+)")

POISON = ("import os, sys\n"
          "open(os.path.join(os.path.dirname(__file__), 'poisoned'), 'a').write(repr(sys.argv) + '\\n')\n")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _flashfix(*args, cwd="/", python=sys.executable, isolate=False):
    """``python -m flashfix ARGS`` from ``cwd``; ``isolate``: the caller itself started with ``-P``, so that
    only the children it starts could read ``cwd``."""
    return subprocess.run([str(python)] + (["-P"] if isolate else []) + ["-m", "flashfix", *map(str, args)],
                          cwd=str(cwd), env=_env(), capture_output=True, text=True, timeout=300)


def _poisoned_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "json.py").write_text(POISON)
    return work


def _engine_tree(tmp_path):
    """A folder that reads as vLLM 0.28.0 (its metadata only): ``verify --path`` goes on to the GPU probe."""
    dist = tmp_path / "tree" / "vllm-0.28.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.28.0\n")
    return dist.parent


@needs_P
def test_verify_children_do_not_import_the_current_directory(tmp_path):
    """Before: the GPU probe child imported ./json.py (poisoned, then 'GPU probe failed')."""
    work = _poisoned_folder(tmp_path)
    proc = _flashfix("verify", "--path", _engine_tree(tmp_path), cwd=work, isolate=True)
    assert not (work / "poisoned").exists(), (work / "poisoned").read_text()
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "no GPU to check on: torch cannot be imported" in proc.stdout, proc.stdout  # the real json, then no torch


def _run_in(work, code):
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=str(work), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout


@needs_P
def test_verify_check_children_do_not_import_the_current_directory(tmp_path):
    """The numeric checks' children (each ``import json`` first). Before: every check crashed on ./json.py."""
    work = _poisoned_folder(tmp_path)
    out = _run_in(work, '''
import time
from flashfix.tools import verify as _verify
_verify.CHECKS = (("ok", "vllm-sink-prefill", 0.005, "[{'err_flashfix': 0.001, 'err_pre_fix': 0.6}]"),)
print("RESULT", [r["passed"] for r in _verify._run_checks({("vllm-sink-prefill", None)}, False, time.time())])
''')
    assert not (work / "poisoned").exists(), (work / "poisoned").read_text()
    assert "RESULT [True]" in out, out


@needs_P
@pytest.mark.parametrize("version", [(3, 10), tuple(sys.version_info[:2])], ids=["-I with sys.path", "-P"])
def test_isolated_children_on_either_python_have_flashfix_and_not_the_current_directory(tmp_path, version):
    """Both forms of a child: ``-I`` (Python 3.10, sys.path set explicitly) and ``-P`` (3.11+)."""
    work = _poisoned_folder(tmp_path)
    out = _run_in(work, '''
import subprocess
from flashfix.tools import verify as _verify
code = "import json, flashfix.tools.gpu_checks, sys; print('CHILD', json.__file__, sys.flags.isolated)"
argv, env = _verify._isolated(code, version=%r)
print(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout)
''' % (version,))
    assert not (work / "poisoned").exists(), (work / "poisoned").read_text()
    child = next(line for line in out.splitlines() if line.startswith("CHILD")).split()
    assert os.path.dirname(child[1]) != str(work) and child[2] == ("1" if version < (3, 11) else "0"), out


def _one_line_exit_2(proc):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    return proc.stderr.strip()


def test_verify_of_a_missing_path_is_one_line_as_the_doctor_says_it(tmp_path):
    """Before: a SourceError traceback, exit 1."""
    missing = tmp_path / "nonexistent"
    verify = _one_line_exit_2(_flashfix("verify", "--path", missing))
    doctor = _one_line_exit_2(_flashfix("doctor", "--path", missing))
    assert verify == "flashfix verify: %s: no such file or directory" % missing
    assert doctor == "flashfix doctor: %s: no such file or directory" % missing


def test_verify_of_a_path_without_an_engine_is_one_line(tmp_path):
    line = _one_line_exit_2(_flashfix("verify", "--path", tmp_path))
    assert line.startswith("flashfix verify: %s holds none of " % tmp_path), line


def test_verify_names_an_unknown_only_id(tmp_path):
    """Before: the unknown id was silently ignored (exit 4 here, nothing about the id)."""
    line = _one_line_exit_2(_flashfix("verify", "--only", "no-such-id"))
    assert line == "flashfix verify: --only: unknown patch id: no-such-id (`flashfix doctor` lists the ids)"
    line = _one_line_exit_2(_flashfix("verify", "--only", "vllm-sink-prefill,no-such-id,other-id"))
    assert line == "flashfix verify: --only: unknown patch ids: no-such-id, other-id (`flashfix doctor` lists the ids)"
    proc = _flashfix("verify", "--only", "vllm-sink-prefill")  # a known id: on to the next sentence (no engine here)
    assert proc.returncode == 4, (proc.stdout, proc.stderr)


def test_doctor_without_an_engine_says_so_in_its_last_line():
    """This interpreter has neither vLLM nor SGLang (nor FlashInfer). Before: only not-installed rows, exit 0."""
    proc = _flashfix("doctor")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line for line in lines[1:-1] if not line.startswith("    read ")]
    assert rows and all(" not-installed " in row for row in rows), rows
    assert lines[-1] == ("summary: %d not-installed; no engine installed (flashinfer-python, sglang, vllm): "
                         "nothing to patch" % len(rows))
    assert max(map(len, lines)) <= 120, max(lines, key=len)


def test_doctor_rows_fit_120_columns_with_an_engine():
    """SGLang 0.5.17 installed. Before: a reason beside its row made it up to 674 columns wide."""
    proc = _flashfix("doctor", python=engine_env.env_python("sglang==0.5.17"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    table = [line for line in lines if not line.startswith("    read ")]  # a read file's path is as long as it is
    assert max(map(len, table)) <= 120, max(table, key=len)
    rows = [line.split() for line in table[1:-1] if not line.startswith(" ")]
    assert len(rows) >= 20 and all(len(row) >= 4 for row in rows), rows
    counts = {}
    for row in rows:
        counts[row[3]] = counts.get(row[3], 0) + 1
    assert "patch" in counts and "no engine" not in lines[-1]
    head, _, stored = lines[-1].partition("; decisions stored: ")  # flashfix prepare's, whatever this checkout has
    assert head == "summary: " + ", ".join("%d %s" % (n, v) for v, n in sorted(counts.items(), key=lambda i: (-i[1], i[0])))
    assert re.fullmatch(r"\d+/%d( \(run flashfix prepare\))?" % counts["patch"], stored), lines[-1]
