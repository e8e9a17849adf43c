"""How flashfix reads engine source: what Python runs, not what the text looks like.

Real SGLang 0.5.17 files are copied, edited the way a bad merge, a vendor's override or an odd
but valid spelling would leave them, and read by ``flashfix doctor --path`` (and, where the
import matters, by the runtime in the real SGLang 0.5.17 environment with the edited file
shadowing the installed one). Each case names what the reader took before:

* a triple-quoted f-string whose replacement field holds a triple-quoted string with the same
  quotes (PEP 701, Python 3.12): its text was scanned as code, so a ``class ModelConfig``
  inside the string was taken for the module's class;
* a name defined twice: the first definition was read, Python binds the last;
* the autotune patch's target module was picked from the raw text ``def NAME(``, which a
  comment can spell;
* a backslash continuation line starting with ``@`` (matrix multiplication) was taken for a
  decorator of the class below it.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine_env
import vet_helpers
from conftest import REPO

from flashfix.core import locate as _locate
from flashfix.core import source as _source

RELEASE = "sglang==0.5.17"
MODEL_CONFIG = "sglang/srt/configs/model_config.py"
BACKEND = "sglang/srt/layers/attention/flashinfer_backend.py"
MODEL_RUNNER = "sglang/srt/model_executor/model_runner.py"
FILES = (BACKEND, MODEL_CONFIG, MODEL_RUNNER, "sglang/srt/model_executor/runner/base_runner.py",
         "sglang/srt/model_executor/runner/flashinfer_autotune.py",
         "sglang/srt/utils/__init__.py", "sglang/srt/utils/common.py")  # where the autotune fix's is_sm120_supported is
VISION, AUTOTUNE, FP8 = "sglang-vision-config", "sglang-sm120-fp8-autotune", "sglang-fp8-kv-scales"


def site_packages():
    python = engine_env.env_python(RELEASE)
    return next((python.parent.parent / "lib").glob("python*/site-packages"))


def original(relative):
    return (site_packages() / relative).read_text(encoding="utf-8")


def sglang_tree(dest, edits=None):
    """A site-packages folder holding SGLang 0.5.17's METADATA and the patch targets' files,
    ``edits[relative path](text)`` applied (str, or bytes written as they are)."""
    dest = Path(dest)
    info = dest / "sglang-0.5.17.dist-info"
    info.mkdir(parents=True)
    shutil.copyfile(site_packages() / "sglang-0.5.17.dist-info" / "METADATA", info / "METADATA")
    for relative in FILES:
        path = dest / relative
        for folder in list(path.relative_to(dest).parents)[:-1]:
            (dest / folder).mkdir(parents=True, exist_ok=True)
            (dest / folder / "__init__.py").touch()
        text = original(relative)
        if edits and relative in edits:
            text = edits[relative](text)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
    return dest


def doctor(tree, python=sys.executable):
    proc = vet_helpers.cli("doctor", "--json", "--path", tree, python=python)
    assert proc.returncode == 0, proc.stderr
    return {row["id"]: row for row in json.loads(proc.stdout)}


def insert_before(text, marker, block):
    at = text.index(marker)
    return text[:at] + block + text[at:]


def fixed_init(text):
    """The text of 0.5.17's ``ModelConfig.__init__`` with the upstream fix applied by hand."""
    node = _source.find_def(ast.parse(text), "ModelConfig.__init__")
    lines = text.splitlines(keepends=True)
    init = "".join(lines[node.lineno - 1:node.end_lineno])
    fixed, count = re.subn(r'(is_image_understandable_model = enable_multimodal and )hasattr\(\s*(self\.hf_config),'
                           r'\s*"vision_config"\s*\)', r'\1getattr(\2, "vision_config", None) is not None', init)
    assert count == 1
    return fixed


def fixed_first(text):
    """ModelConfig with a fixed ``__init__`` first and the installed (pre-fix) one last."""
    return insert_before(text, "    def __init__(\n", fixed_init(text) + "\n")


def test_control_the_copied_files_read_as_installed(tmp_path):
    rows = doctor(sglang_tree(tmp_path))
    assert {p: rows[p]["verdict"] for p in (VISION, AUTOTUNE, FP8)} == {VISION: "patch", AUTOTUNE: "patch",
                                                                           FP8: "patch"}


# --- PEP 701: a string that holds code -------------------------------------------------------

FAKE = '''_TEMPLATE = f"""{"}" + """
class ModelConfig:
    def __init__(self, hf_config):
        self.is_image_understandable_model = getattr(hf_config, "vision_config", None) is not None
"""}"""


'''


def find_python(spec=">=3.12"):
    """An interpreter whose version meets ``spec``, found as pyenv and uv find them, never downloaded:
    the versions under ``$PYENV_ROOT`` (default ``~/.pyenv``), then ``uv python find`` (``PATH``, uv's
    managed pythons). No PyPI package installs a CPython, so when none is there the test needing it
    is skipped, the reason naming the version missing and where it looked (only then: any other
    trouble making the interpreter's venv fails)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    def version(path):
        try:
            return Version(path.parent.parent.name)
        except InvalidVersion:
            return None

    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = [p for p in pyenv.glob("versions/*/bin/python3") if version(p) in SpecifierSet(spec)]
    if found:
        return str(max(found, key=version))
    uv = subprocess.run([engine_env.uv(), "python", "find", "--no-python-downloads", spec],
                        capture_output=True, text=True)
    if uv.returncode == 0 and uv.stdout.strip():
        return uv.stdout.strip()
    pytest.skip("no Python %s interpreter: none under %s (PYENV_ROOT), and `uv python find --no-python-downloads "
                "'%s'` found none on PATH or among uv's managed pythons; install one (`pyenv install 3.12`, "
                "`uv python install 3.12`) or put one on PATH" % (spec, pyenv / "versions", spec))


def python312():
    """An interpreter of Python 3.12 or later with packaging (a venv made once by uv)."""
    venv = engine_env.root() / "reader-py312"
    python = venv / "bin" / "python"
    marker = venv / ".flashfix-ready"
    if not marker.exists():
        base = find_python(">=3.12")
        subprocess.run([engine_env.uv(), "venv", "-q", "--clear", "--no-python-downloads", "--python", base,
                        str(venv)], check=True)
        subprocess.run([engine_env.uv(), "pip", "install", "-q", "--python", str(python), "packaging"], check=True)
        marker.write_text("reader\n")
    return python


def test_python_312_is_found_whatever_home(tmp_path, monkeypatch):
    """Before: with another HOME the reader venv asked uv to download a Python, which fails on a
    machine that reaches only PyPI; now the interpreter is found as pyenv and uv find it."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    monkeypatch.setenv("PYENV_ROOT", str(pyenv))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLASHFIX_ENGINE_ROOT", str(tmp_path / "engines"))
    python = python312()
    out = subprocess.run([str(python), "-c", "import sys, packaging; print(sys.version_info >= (3, 12))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_a_missing_python_is_a_skip_that_names_it(tmp_path, monkeypatch):
    """Before: a failure (pytest.fail) where no second interpreter exists."""
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    monkeypatch.setenv("PATH", os.path.dirname(engine_env.uv()))  # uv itself, and no Python 3.12 beside it
    monkeypatch.setenv("UV_PYTHON_INSTALL_DIR", str(tmp_path / "no-uv-pythons"))
    with pytest.raises(pytest.skip.Exception, match=r"no Python ==9\.9 interpreter: none under .*no-pyenv/versions"):
        find_python("==9.9")


def test_a_class_spelled_inside_a_pep701_string_is_not_the_class(tmp_path):
    """Before: fixed-upstream (the string's ``class ModelConfig`` was read as the module's)."""
    python = python312()
    tree = sglang_tree(tmp_path, {MODEL_CONFIG: lambda text: insert_before(text, "class ModelConfig:", FAKE)})
    row = doctor(tree, python=python)[VISION]
    assert row["verdict"] == "patch", row
    assert "line %d" % (444 + FAKE.count("\n")) in row["reason"], row


def test_a_class_spelled_inside_a_pep701_string_after_the_class_is_not_the_class():
    """The string last: read in pieces, its ``class ModelConfig`` would be the last definition (this
    reader's lexer ends the f-string at its nested quotes), so such a file is parsed whole: Python 3.12+
    finds what one parse finds. Before the f-string rule of ``_source._mask``: the string's ``__init__``."""
    code = ("import ast, sys; from flashfix.core import source as s; t = sys.stdin.read(); q = 'ModelConfig.__init__'\n"
            "print(ast.dump(s.find_def(s.Module(t, 'm'), q)) == ast.dump(s.find_def(ast.parse(t), q)))")
    out = subprocess.run([str(python312()), "-c", code], input=original(MODEL_CONFIG) + FAKE, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.strip() == "True", out.stderr


def test_a_pep701_file_on_an_older_python_is_unknown_not_fixed(tmp_path):
    """Read by a Python that cannot parse it (3.11), the module is unknown-shape, never fixed."""
    if sys.version_info >= (3, 12):
        pytest.skip("this Python parses PEP 701 f-strings")
    tree = sglang_tree(tmp_path, {MODEL_CONFIG: lambda text: insert_before(text, "class ModelConfig:", FAKE)})
    row = doctor(tree)[VISION]
    assert row["verdict"] == "unknown-shape" and "SyntaxError" in row["reason"], row


# --- a name defined more than once -------------------------------------------------------------

def after_def(text, qualname, block):
    end = _source.find_def(ast.parse(text), qualname).end_lineno
    lines = text.splitlines(keepends=True)
    return "".join(lines[:end]) + block + "".join(lines[end:])


def conditional_last(text):
    """The installed ``__init__``, then a fixed one bound only when a variable is set."""
    body = "".join("    " + line if line.strip() else line for line in fixed_init(text).splitlines(keepends=True))
    return after_def(text, "ModelConfig.__init__", "\n    if os.environ.get(\"FIXED\"):\n" + body)


def test_python_binds_the_last_definition(tmp_path):
    """Before: fixed-upstream (the fixed first copy was read; the pre-fix last one runs)."""
    row = doctor(sglang_tree(tmp_path, {MODEL_CONFIG: fixed_first}))[VISION]
    assert row["verdict"] == "patch", row
    assert "line %d" % (444 + fixed_init(original(MODEL_CONFIG)).count("\n") + 1) in row["reason"], row


def test_a_definition_bound_conditionally_last_is_unknown(tmp_path):
    """Before: patch (the first, unconditional copy was read: which one runs depends on the
    environment)."""
    row = doctor(sglang_tree(tmp_path, {MODEL_CONFIG: conditional_last}))[VISION]
    assert row["verdict"] == "unknown-shape", row
    assert "ModelConfig.__init__ is bound at lines" in row["reason"] and "if/try" in row["reason"], row


def test_an_assignment_after_the_definition_is_unknown(tmp_path):
    edit = {BACKEND: lambda text: after_def(text, "FlashInferAttnBackend.forward_extend",
                                            "\n    forward_extend = staticmethod(print)\n")}
    row = doctor(sglang_tree(tmp_path, edit))[FP8]
    assert row["verdict"] == "unknown-shape" and "FlashInferAttnBackend.forward_extend is bound" in row["reason"], row


# --- other spellings Python reads one way -------------------------------------------------------

MATMUL = '''class _Matrix:
    def __matmul__(self, other):
        return self


_PRODUCT = _Matrix() \\
@ _Matrix()
'''


def test_a_continuation_line_starting_with_at_is_no_decorator():
    """Before: the class below had the continued operand as its decorator."""
    text = insert_before(original(BACKEND), "class FlashInferAttnBackend(", MATMUL)
    exec(compile(MATMUL, "matmul", "exec"), {})  # valid Python
    node = _source.find_def(_source.parse_text(text, "<edited>"), "FlashInferAttnBackend")
    assert isinstance(node, ast.ClassDef) and node.decorator_list == []


def crlf(text):
    return text.replace("\n", "\r\n").encode("utf-8")


def latin1_with_bom_free_cookie(text):
    return ("# -*- coding: latin-1 -*-\n# caf\xe9\n" + text).encode("latin-1", "replace")


def bom(text):
    return b"\xef\xbb\xbf" + text.encode("utf-8")


def form_feeds(text):
    return text.replace("\nclass ", "\n\x0c\nclass ").replace("\n    def ", "\n\x0c    def ")


def tabs(text):  # the bodies of the methods that probes read indented with a tab (as Python allows)
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for qualname in ("FlashInferAttnBackend.forward_extend", "ModelConfig.__init__"):
        node = _source.find_def(tree, qualname)
        if node is not None:
            for i in range(node.lineno, node.end_lineno):
                if lines[i].startswith("        "):
                    lines[i] = "    \t" + lines[i][8:]
    return "".join(lines)


@pytest.mark.parametrize("spelling", [crlf, latin1_with_bom_free_cookie, bom, form_feeds, tabs])
def test_spellings_python_accepts_read_as_the_installed_file(tmp_path, spelling):
    for relative in (BACKEND, MODEL_CONFIG):
        spelled = spelling(original(relative))
        compile(spelled, relative, "exec", ast.PyCF_ONLY_AST)  # Python reads it
    rows = doctor(sglang_tree(tmp_path, {BACKEND: spelling, MODEL_CONFIG: spelling}))
    assert rows[FP8]["verdict"] == "patch" and "in forward_extend (line" in rows[FP8]["reason"], rows[FP8]
    assert rows[VISION]["verdict"] == "patch", rows[VISION]


# --- the autotune target from definitions, and the runtime on shadowed modules -------------------

COMMENT = "# ModelRunner used to have `def _should_run_flashinfer_autotune(self)`; see runner/flashinfer_autotune.py\n"

RUNTIME = r'''
import json, sys
import flashfix
from sglang.srt.model_executor.runner import flashinfer_autotune
from sglang.srt.configs import model_config
from flashfix import sglang_patch
states = {r["id"]: (r["state"], r["reason"]) for r in flashfix.status()}
init = model_config.ModelConfig.__init__
print("FLASHFIX_RESULT=" + json.dumps(dict(
    states=states, targets=list(sglang_patch.SM120_FP8_AUTOTUNE.targets()),
    files=[model_config.__file__, flashinfer_autotune.__file__],
    runner_imported="sglang.srt.model_executor.model_runner" in sys.modules,
    init_line=init.__code__.co_firstlineno)))
'''


def shadow(dest, edits):
    """A copy of the installed ``sglang`` package (links to its files), with ``edits`` written
    over their links: first on PYTHONPATH, it shadows the installed package."""
    dest = Path(dest)
    subprocess.run(["cp", "-rs", str(site_packages() / "sglang"), str(dest / "sglang")], check=True)
    for relative, edit in edits.items():
        path = dest / relative
        path.unlink()
        path.write_text(edit(original(relative)), encoding="utf-8")
    return dest


def test_runtime_patches_what_python_binds_and_finds_the_autotune_module(tmp_path):
    """In SGLang 0.5.17, with model_config.py defining ``__init__`` twice (fixed first) and a
    comment in model_runner.py spelling ``def _should_run_flashinfer_autotune(``: importing only
    model_config and runner/flashinfer_autotune patches both. Before: vision fixed-upstream
    (the bug ran) and autotune waiting for model_runner (never imported: the bug ran)."""
    edits = {MODEL_CONFIG: fixed_first, MODEL_RUNNER: lambda text: COMMENT + text}
    tree = shadow(tmp_path, edits)
    (r,) = engine_env.run(RELEASE, RUNTIME, pythonpath=os.pathsep.join([str(REPO), str(tree)]))
    assert r["files"][0] == str(tree / MODEL_CONFIG) and r["files"][1].startswith(str(tree)), r
    assert not r["runner_imported"]
    assert r["targets"] == ["sglang.srt.model_executor.runner.flashinfer_autotune"], r
    assert r["states"][VISION][0] == "applied", r["states"][VISION]
    assert r["states"][AUTOTUNE][0] == "applied", r["states"][AUTOTUNE]
    assert r["init_line"] == 248 + fixed_init(original(MODEL_CONFIG)).count("\n") + 1, r  # the last one


def after_text(installed, diff_output, path):
    """The file ``flashfix diff`` says flashfix runs: ``installed`` with the printed hunks applied
    (lines split at newlines only: a form feed inside a line stays in it)."""
    out = diff_output.split("\n")
    i = out.index("+++ %s (as flashfix runs it)" % path) + 1
    old, new, position = installed.split("\n"), [], 0
    while i < len(out) and out[i][:1] in ("@", " ", "+", "-") and not out[i].startswith("--- "):
        match = vet_helpers.HUNK.match(out[i])
        if match:
            start = int(match.group(1)) - 1
            new.extend(old[position:start])
            position = start
        elif out[i][0] in (" ", "-"):
            assert old[position] == out[i][1:], (position + 1, old[position], out[i])
            position += 1
            if out[i][0] == " ":
                new.append(out[i][1:])
        else:
            new.append(out[i][1:])
        i += 1
    return "\n".join(new + old[position:])


def test_diff_with_form_feeds_writes_the_method_inside_its_class(tmp_path):
    """A form feed before ``def`` (Python resets the column there): the rewritten method was
    printed at column 0, which ends the class. Before: ``ModelConfig.__init__`` not found in
    the file that ``flashfix diff`` printed."""
    tree = sglang_tree(tmp_path, {MODEL_CONFIG: form_feeds})
    proc = vet_helpers.cli("diff", "--path", tree, VISION)
    assert proc.returncode == 0, proc.stderr
    path = tree / MODEL_CONFIG
    after = after_text(path.read_text(encoding="utf-8"), proc.stdout, path)
    init = _source.find_def(ast.parse(after), "ModelConfig.__init__")
    assert init is not None and "getattr(self.hf_config, 'vision_config', None) is not None" in ast.unparse(init)


# --- reading run by run equals one parse of the whole file ---------------------------------------

EDGES = '''"""Docstring
class NotAClass:
"""
if X:
    a = 1
else:
    a = 2
try:
    import b
except ImportError:
    b = None
finally:
    pass
@decorator
def f(x=(1,
2)):
    return """
def g():
""" + \\
"text"
TEMPLATE = f"""{'}'}
class AlsoNotAClass:
"""
class C:
    def m(self):
        return 1
'''


def test_pieces_equal_one_parse():
    """Real files and constructs that continue a statement at column 0: the pieces parsed alone are
    exactly the whole file's statements, line and column included."""
    for text in (EDGES, original(MODEL_CONFIG), original(BACKEND)):
        whole = ast.dump(ast.parse(text), include_attributes=True)
        module = _source.Module(text, "<test>")
        assert module._pieces(), "read whole"
        assert ast.dump(ast.Module(body=module.body, type_ignores=[]), include_attributes=True) == whole
    tree = _source.Module(EDGES, "<test>")
    assert _source.find_def(tree, "NotAClass") is None and _source.find_def(tree, "AlsoNotAClass") is None
    assert _source.find_def(tree, "C.m").lineno == 25


def test_a_file_that_does_not_parse_raises():
    with pytest.raises(SyntaxError):
        _source.find_def(_source.Module("def f(:\n    pass\nclass C:\n    pass\n", "<test>"), "C")


def test_kept_runs_are_parsed_once_and_read_as_a_fresh_parse(monkeypatch):
    """The doctor (``kept()``): every patch reads the same modules, each run is parsed once (before:
    once per lookup), a lookup finds what a fresh parse finds, a SyntaxError reaches every reader, and
    leaving the scope forgets the trees."""
    parses = []
    real = ast.parse
    monkeypatch.setattr(_source.ast, "parse", lambda *a, **k: parses.append(1) or real(*a, **k))
    text = original(BACKEND)
    names = ["FlashInferAttnBackend.forward_extend", "FlashInferAttnBackend.__init__", "FlashInferIndicesUpdaterPrefill"]
    fresh = [ast.dump(_source.find_def(_source.Module(text, "<t>"), n), include_attributes=True) for n in names]
    once = len(parses)
    with _source.kept():
        tree = _source.parse_text(text, "<kept>")
        parses.clear()
        for round in range(3):
            assert [ast.dump(_source.find_def(tree, n), include_attributes=True) for n in names] == fresh
            assert 0 < len(parses) <= once if round == 0 else not parses
            parses.clear()
        broken = _source.parse_text("def f(:\n    pass\nclass C:\n    pass\n", "<broken>")
        for _ in range(2):
            with pytest.raises(SyntaxError):
                _source.find_def(broken, "C")
        assert _source.parse_text(text, "<kept>") is tree
    assert _source.parse_text(text, "<kept>") is not tree and not _source.KEEP_RUNS


def vllm_original(relative, release="vllm==0.28.0"):
    python = engine_env.env_python(release)
    return next((python.parent.parent / "lib").glob("python*/site-packages")).joinpath(relative).read_text("utf-8")


LONG_CLASSES = '''class Short:
    x = 1
@decorator(
    1)
class Long(
    Base,
):
    """Doc
    at the body's indentation
    """
    TEXT = """
    def not_a_method(self):
class NotAClass:
"""
    def a(self):
        return (
    1)
    if x:
        b = 1
    else:
        b = 2
    def b(self):
        return f"""{'}'}
    def c(self):
"""
    try:
        import c
    except ImportError:
        c = None
    def d(self): return 1 + \\
    2
\f    def e(self):
        pass
    if x:
        def f(self):
            pass
class Tail:
    def m(self):
        pass
'''


def test_class_pieces_equal_one_parse(monkeypatch):
    """A long class is read in pieces of its body (SGLang 0.5.17's and vLLM 0.28.0's files, and
    constructs that continue a statement at the body's indentation): every node, line and column,
    is the whole file's; where a probe looks up one member, that member is."""
    split = []
    real = _source.Module._members
    monkeypatch.setattr(_source.Module, "_members", lambda *a: split.append(real(*a)) or split[-1])
    texts = {"edges": LONG_CLASSES, MODEL_CONFIG: original(MODEL_CONFIG), BACKEND: original(BACKEND),
             "vllm": vllm_original("vllm/v1/attention/backends/flashinfer.py")}
    for name, text in texts.items():
        split.clear()
        whole = ast.parse(text)
        module = _source.Module(text, "<test>")
        assert ast.dump(ast.Module(body=module.body, type_ignores=[]), include_attributes=True) == \
            ast.dump(whole, include_attributes=True), name
        for cls in (s for s in whole.body if isinstance(s, ast.ClassDef)):
            for member in [s for s in cls.body if isinstance(s, _source._DEFS)][:40]:
                qualname = "%s.%s" % (cls.name, member.name)
                try:
                    expected = ast.dump(_source.find_def(whole, qualname), include_attributes=True)
                except _source.ShapeError as exc:
                    expected = str(exc)
                try:
                    got = ast.dump(_source.find_def(_source.Module(text, "<test>"), qualname), include_attributes=True)
                except _source.ShapeError as exc:
                    got = str(exc)
                assert got == expected, qualname
        assert any(node is not None for node in split), name  # a class was read in pieces of its body
    tree = _source.Module(LONG_CLASSES, "<test>")
    assert _source.find_def(tree, "NotAClass") is None and _source.find_def(tree, "Long.not_a_method") is None
    assert _source.find_def(tree, "Long.c") is None and _source.find_def(tree, "Long.e").lineno == 32
    assert _source.find_def(tree, "Long.b").lineno == 22  # bound in if/else first, defined last
    assert _source.find_def(tree, "Long.f").lineno == 35  # its only binding, inside if: that def where bound


# --- read in pieces: a later binding is still read, and a doubt reads the file whole ----------------

REBOUND = '''class Backend:
    def forward(self, q):
        return q


def helper(backend: Backend):
    return Backend.forward


Backend = register(Backend)
'''


def test_a_later_rebinding_is_read_where_only_pieces_are_parsed(monkeypatch):
    """Only the pieces that spell the name are parsed (not ``helper``: a ``def`` binds its own name),
    and the last one, an assignment, makes the class unreadable, as in one parse of the file."""
    parsed = []
    real = _source.Module._parse
    monkeypatch.setattr(_source.Module, "_parse", lambda self, piece, inner: parsed.append(piece[2]) or real(self, piece, inner))
    for qualname in ("Backend", "Backend.forward"):
        with pytest.raises(_source.ShapeError, match="bound at lines 1, 10"):
            _source.find_def(_source.Module(REBOUND, "<t>"), qualname)
    assert 6 not in parsed and 10 in parsed, parsed


@pytest.mark.parametrize("text", [
    'x = "unterminated\nclass C:\n    pass\n',  # a quote that opens no string: Python cannot read the file
    "def f(:\n    pass\nclass C:\n    pass\n",  # brackets that do not balance
])
def test_a_file_python_cannot_read_raises_where_only_pieces_would_be_read(text):
    with pytest.raises(SyntaxError):
        _source.find_def(_source.Module(text, "<t>"), "C")


def test_a_name_python_reads_in_nfkc_form_is_found():
    """``class \\uff2dodelConfig`` (a full-width M) binds ``ModelConfig``: Python reads names in NFKC form.
    Before: not found (the text never spells ``ModelConfig``)."""
    text = "class \uff2dodelConfig:\n    def __init__(self):\n        self.a = 1\n"
    assert _source.find_def(_source.Module(text, "<t>"), "ModelConfig.__init__").lineno == 2
    assert ast.dump(_source.find_def(_source.Module(text, "<t>"), "ModelConfig")) == \
        ast.dump(_source.find_def(ast.parse(text), "ModelConfig"))


@pytest.mark.parametrize("text", [
    'WHY = "see _prepare_" "flashinfer_params"\n',  # adjacent literals are one string
    'WHY = ("see _prepare_"  # why\n       f"flashinfer_params")\n',
    'WHY = "see _prepare_\\x66lashinfer_params"\n',  # an escape that writes a letter
    'WHY = "see _prepare_\\\nflashinfer_params"\n',  # a backslash that joins two lines of one string
])
def test_a_word_spelled_only_by_a_string_value_is_a_mention(text):
    """``absent_unless_mentioned``: a module whose text does not spell the word is not parsed, unless a
    string's value may spell it; then the parsed tree decides, as before."""
    from flashfix import semantic

    word = "_prepare_flashinfer_params"
    module = _source.Module(text, "<t>")
    assert word not in text and not module.unspelled(word)
    assert semantic._mention(module, word) is not None
    plain = _source.Module('WHY = "see _prepare_ and"\nHOW = "flashinfer_params"\n', "<t>")
    assert plain.unspelled(word) and semantic._mention(plain, word) is None


class CountingReader:
    """A reader that counts what it is asked (one module, one distribution)."""

    def __init__(self):
        self.asked = []

    def find(self, name):
        self.asked.append(("find", name))
        return _locate.Found(name, "/m/%s.py" % name, "X = 1\n", "0" * 64)

    def version(self, dist):
        self.asked.append(("version", dist))
        return "1.0"

    def version_source(self, dist):
        self.asked.append(("version_source", dist))
        return ("/m/METADATA", "1" * 64)


def test_within_kept_a_reader_answers_each_question_once_and_every_row_still_names_its_sources():
    """The doctor asks the same few questions for every patch: within ``kept()`` the reader answers
    each once; each ``recording()`` (a row's sources) still lists what it read. Outside: asked again."""
    r = CountingReader()
    with _locate.reading(r):
        with _source.kept():
            rows = []
            for _ in range(3):
                with _locate.recording() as sources:
                    assert _locate.find("m").text == "X = 1\n" and _locate.version("d") == "1.0"
                rows.append(sources)
            assert sorted(r.asked) == [("find", "m"), ("version", "d"), ("version_source", "d")]
            assert rows[0] == rows[1] == rows[2] and len(rows[0]) == 2
        _locate.find("m")
    assert len(r.asked) == 4
