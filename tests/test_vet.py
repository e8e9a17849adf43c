"""The mechanism behind ``flashfix diff`` and ``doctor --path/--python``, without engines.

* ``_render``: an edited function written back as text, with only the text that changed
  replaced (an argument added is one more line where each argument has its own), parsed back to
  exactly the edited AST; the whole function written by ``ast.unparse`` where the installed text
  cannot hold the edit.
* ``_source.rewrite`` compiles the new code from that text (line and column positions are
  those of the text, unchanged lines keep their installed line numbers).
* Bad input to the command line: one clear message on stderr, exit status 2, no traceback.

The same things on real engine releases: tests/test_vet_real.py.
"""

import ast
import copy
import importlib.util
import os
import stat
import sys
import textwrap
import traceback
import zipfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vet_helpers  # noqa: E402
from flashfix.tools import diff as _diff
from flashfix.core import registry as _registry
from flashfix.core import render as _render
from flashfix.core import source as _source  # noqa: E402

SOURCE = '''\
import os


class Engine:
    """An engine."""

    def step(self, layer, q):
        # a comment that must survive
        total = 0
        out = compute(
            q,
            layer.cache,
            causal=False,
        )  # trailing comment
        if layer.kind == "a":
            total += 1
        elif layer.kind == "b":
            total += 2
        else:
            total += 3
        try:
            total += len(q)
        except TypeError:
            total -= 1
        first = 1; second = 2
        note = """text
at column zero"""
        return out, total, first + second, note


def compute(q, cache, causal=True, scale=None):
    return (q, cache, causal, scale)
'''


def parsed():
    tree = ast.parse(SOURCE)
    return tree, _source.find_def(tree, "Engine.step")


def render(edit):
    tree, node = parsed()
    edited = copy.deepcopy(node)
    edit(edited, _source.marker("test:Engine.step"))
    return _render.render(SOURCE, node, edited, "engine.py"), edited


def add_scale(node, mark):
    call = _source.name_calls(node, "compute")[0]
    call.keywords.append(ast.keyword("scale", ast.parse("layer.scale", mode="eval").body))
    _source.insert_before(node, call, mark)


def lines_at(rendered, version):
    return dict(zip(rendered.line_map(version), rendered.text(version).splitlines()))


def test_only_the_changed_statement_is_rewritten():
    rendered, edited = render(add_scale)
    assert rendered.whole == ()
    plain = rendered.text(_render.PLAIN)
    assert rendered.before == "".join(SOURCE.splitlines(keepends=True)[6:28])
    before, after = rendered.before.splitlines(), plain.splitlines()
    assert "        # a comment that must survive" in after
    assert '''at column zero"""''' in after  # a string's own lines are left as they are
    assert "        first = 1; second = 2" in after
    added = [line for line in after if line not in before]
    removed = [line for line in before if line not in after]
    # the call is spread over lines: the new keyword is one more line like the others, nothing else changes
    assert added == ["            scale=layer.scale,"]
    assert removed == []  # the statement's own trailing comment stays
    # parsed back, the text is the edit, and that is what gets compiled
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(_render._strip_markers(copy.deepcopy(edited)))
    assert ast.dump(rendered.tree(_render.MARKED)) == ast.dump(edited)
    marked = rendered.text(_render.MARKED).splitlines()
    assert [line for line in marked if line not in after] == ["        __flashfix_mark__('test:Engine.step')"]


def test_unchanged_lines_keep_their_installed_line_numbers():
    rendered, _ = render(add_scale)
    installed = SOURCE.splitlines()
    for version in (_render.PLAIN, _render.MARKED):
        for number, line in zip(rendered.line_map(version), rendered.text(version).splitlines()):
            if line in ("            scale=layer.scale,", "        __flashfix_mark__('test:Engine.step')"):
                continue
            assert installed[number - 1] == line, (version, number, line)
    marker_line = [n for n, line in zip(rendered.line_map(_render.MARKED), rendered.text(_render.MARKED).splitlines())
                   if "__flashfix_mark__" in line]
    assert marker_line == [10]  # reported as the statement it precedes


def test_elif_and_handler_bodies_are_spliced_in_place():
    def edit(node, mark):
        branch = node.body[2].orelse[0]  # body: total, out, if, try, first, second, note, return
        branch.test = ast.parse('layer.kind in ("b", "c")', mode="eval").body
        handler = node.body[3].handlers[0]
        handler.body[0] = ast.parse("total -= 2").body[0]

    rendered, edited = render(edit)
    assert rendered.whole == ()
    after = rendered.text(_render.PLAIN).splitlines()
    assert "        elif layer.kind in ('b', 'c'):" in after
    assert "            total -= 2" in after
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(edited)


def test_a_statement_sharing_its_line_is_changed_inside_the_line():
    def edit(node, mark):
        assign = [s for s in node.body if isinstance(s, ast.Assign) and s.targets[0].id == "second"][0]
        assign.value = ast.Constant(3)

    rendered, edited = render(edit)
    assert rendered.whole == ()
    assert "        first = 1; second = 3" in rendered.text(_render.PLAIN).splitlines()
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(edited)


def test_a_statement_put_inside_a_shared_line_makes_the_function_written_whole():
    def edit(node, mark):
        index = [i for i, s in enumerate(node.body) if isinstance(s, ast.Assign) and s.targets[0].id == "second"][0]
        node.body.insert(index, ast.parse("third = 3").body[0])

    rendered, edited = render(edit)
    assert rendered.whole == (_render.MARKED, _render.PLAIN)
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(edited)
    assert rendered.text(_render.PLAIN).startswith("    def step(self, layer, q):")


def test_a_deleted_statement_takes_its_lines_and_nothing_else():
    def edit(node, mark):
        del node.body[1]  # the `out = compute(...)` statement: then out is unbound, the code is what the edit says

    rendered, edited = render(edit)
    assert not rendered.whole  # spliced: the other lines keep their text
    before, after = rendered.before.splitlines(), rendered.text(_render.PLAIN).splitlines()
    first = before.index("        out = compute(")
    assert before[first + 4] == "        )  # trailing comment"
    assert after == before[:first] + before[first + 5:]
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(edited)


# --- _source.rewrite compiles from the rendered text -------------------------------------------


@pytest.fixture
def engine_module(tmp_path):
    path = tmp_path / "ff_vet_engine.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("ff_vet_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def positions(code):
    out = list(code.co_positions()) if hasattr(code, "co_positions") else list(code.co_lines())
    return out + [positions(c) for c in code.co_consts if isinstance(c, type(code))]


def test_rewrite_compiles_the_rendered_text(engine_module):
    func = engine_module.Engine.step
    marked, plain = _source.rewrite(func, lambda node: add_scale(node, _source.marker("test:Engine.step")))
    text, origin = _source.function_source(func)
    tree = _source.parse_text(text, origin)
    node = _source._def_node(func, tree)
    edited = copy.deepcopy(node)
    add_scale(edited, _source.marker("test:Engine.step"))
    rendered = _source.render_edit(text, node, edited, origin)
    for version, code in ((_render.PLAIN, plain), (_render.MARKED, marked)):
        from_text = _source._compile(_source._like(func), rendered.tree(version), tree)
        assert _source.code_difference(from_text, code) is None
        assert positions(from_text) == positions(code)
    # compiled straight from the edited AST the positions differ: the check above can tell
    straight = _source._compile(_source._like(func), _render._strip_markers(copy.deepcopy(edited)), tree)
    assert _source.code_difference(straight, plain) is None
    assert positions(straight) != positions(plain)

    class Layer:
        kind, cache, scale = "b", "C", 0.5

    func.__code__ = plain
    out, total, three, note = engine_module.Engine().step(Layer(), "qq")
    assert out == ("qq", "C", False, 0.5) and total == 4 and three == 3


def test_tracebacks_after_a_rewritten_statement_name_the_installed_lines(engine_module):
    func = engine_module.Engine.step
    _, plain = _source.rewrite(func, lambda node: add_scale(node, _source.marker("test:Engine.step")))
    func.__code__ = plain

    class Layer:  # no ``kind``: the first unchanged statement after the rewritten one raises
        cache, scale = "C", 1.0

    with pytest.raises(AttributeError) as info:
        engine_module.Engine().step(Layer(), "q")
    frame = traceback.extract_tb(info.tb)[-1]
    assert (frame.lineno, frame.line) == (15, 'if layer.kind == "a":')
    assert SOURCE.splitlines()[14].strip() == 'if layer.kind == "a":'


# --- every patch can be shown -------------------------------------------------------------------


def test_every_patch_has_a_source_only_plan():
    assert all(callable(p.plan) for p in _registry.load_all())


# --- bad input ------------------------------------------------------------------------------------


def bad(*args):
    proc = vet_helpers.cli(*args)
    assert proc.returncode == 2, (args, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def make_wheel(path, name, version, members=(), compression=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("%s-%s.dist-info/METADATA" % (name, version),
                         "Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version))
        for member, text in members:
            archive.writestr(member, text)
    return path


@pytest.mark.parametrize("command", ["doctor", "diff"])
def test_bad_paths(tmp_path, command):
    assert "no such file or directory" in bad(command, "--path", tmp_path / "missing.whl")
    text = tmp_path / "notes.txt"
    text.write_text("not a wheel")
    assert "neither a wheel" in bad(command, "--path", text)
    fake = tmp_path / "fake-1.0-py3-none-any.whl"
    fake.write_text("not a zip")
    assert "not a readable zip archive" in bad(command, "--path", fake)
    plain_zip = tmp_path / "data.zip"
    with zipfile.ZipFile(plain_zip, "w") as archive:
        archive.writestr("data.txt", "x")
    assert "not a wheel: it has no <name>.dist-info/METADATA" in bad(command, "--path", plain_zip)


def test_truncated_wheel(tmp_path):
    whole = make_wheel(tmp_path / "sglang-0.5.17-py3-none-any.whl", "sglang", "0.5.17",
                       [("sglang/__init__.py", "# " + "x" * 5000 + "\n")])
    data = whole.read_bytes()
    cut = tmp_path / "cut" / whole.name
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) // 2])
    assert "not a readable zip archive (a corrupt or truncated wheel?)" in bad("doctor", "--path", cut)


def test_wheel_with_a_corrupt_member(tmp_path):
    text = "class ModelConfig:\n    def __init__(self):\n        self.x = 1\n" + "# padding\n" * 200
    wheel = make_wheel(tmp_path / "sglang-0.5.17-py3-none-any.whl", "sglang", "0.5.17",
                       [("sglang/__init__.py", ""), ("sglang/srt/__init__.py", ""),
                        ("sglang/srt/configs/__init__.py", ""), ("sglang/srt/configs/model_config.py", text)],
                       compression=zipfile.ZIP_STORED)
    data = bytearray(wheel.read_bytes())
    at = data.index(b"# padding")
    data[at:at + 9] = b"# PADDING"  # same length, wrong CRC
    wheel.write_bytes(bytes(data))
    message = bad("doctor", "--path", wheel)
    assert "cannot read sglang/srt/configs/model_config.py" in message and "CRC" in message, message


def test_wheel_of_an_unrelated_package(tmp_path):
    real = vet_helpers.wheel("packaging==24.2")
    message = bad("doctor", "--path", real)
    assert "holds none of flashinfer-python, sglang, vllm (it holds packaging 24.2)" in message, message
    made = make_wheel(tmp_path / "other-1.0-py3-none-any.whl", "other", "1.0", [("other/__init__.py", "")])
    assert "holds none of" in bad("diff", "--path", made)


def test_interpreters_that_do_not_run(tmp_path):
    assert "no such file" in bad("doctor", "--python", tmp_path / "nothing" / "python")
    assert "is a directory" in bad("doctor", "--python", tmp_path)
    not_executable = tmp_path / "python-not-executable"
    not_executable.write_text("#!/bin/sh\n")
    assert "cannot be run" in bad("doctor", "--python", not_executable)
    failing = tmp_path / "python-failing"
    failing.write_text("#!/bin/sh\necho 'broken interpreter here' >&2\nexit 3\n")
    failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
    message = bad("doctor", "--python", failing)
    assert "did not answer as a Python interpreter (exit status 3): broken interpreter here" in message, message
    chatty = tmp_path / "python-chatty"
    chatty.write_text("#!/bin/sh\necho hello\n")
    chatty.chmod(chatty.stat().st_mode | stat.S_IXUSR)
    assert "did not answer as a Python interpreter (exit status 0)" in bad("diff", "--python", chatty)


def test_unknown_patch_id_for_diff():
    message = bad("diff", "no-such-patch")
    assert "unknown patch id(s) no-such-patch; valid: vllm-sink-prefill" in message


def test_diff_here_without_engines_says_why_per_patch():
    proc = vet_helpers.cli("diff")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["%s (%s -): not applied: not-installed: %s is not installed" % (p.id, p.engine, p.engine)
                     for p in _registry.load_all()], lines
