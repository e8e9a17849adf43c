"""``flashfix diff`` keeps comments: those written in a declaration's ``after`` appear in the added
lines, in place, and the engine's own comments inside the span a patch replaces stay as context.
The code compiled is the same (comments are not code)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from conftest import FAKE_DOCTOR, REPO, run_py  # noqa: E402

ENGINE = '''
def helper(x, k):
    return x + k


class Engine:
    def compute(self, x):
        return helper(x, 1)

    def block(self, x):
        y = x * 2
        z = helper(x, 1)
        return y + z

    def branch(self, x):
        if x < 0:
            a = 0
            b = 0
        else:
            # engine comment kept
            a = 1
            b = helper(x, 1)
        return a + b
'''

PACK = '''
from flashfix.semantic import Backport


def bp(id, function, before, after):
    return Backport(id=id, engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
                    module="fakeeng.core", function=function, before=before, after=after,
                    summary="a test", doc="Why: a test. Delete when: never.")


PATCHES = (
    bp("fake-trailing", "Engine.compute", "helper($X, 1)", "helper($X, 2)  # why this is right"),
    bp("fake-lines", "Engine.block", "z = helper($X, 1)",
       "# a comment line\\nz = helper($X, 2)\\n# between the two\\nz += 1  # trailing one"),
    bp("fake-elif", "Engine.branch", "a = 1\\nb = helper($X, 1)",
       "if $X > 3:\\n    # large x\\n    a = 3\\n    b = 0\\nelse:\\n    a = 1\\n    b = helper($X, 1)"),
)
'''

def _changed(text):
    hunks = text.split("\n@@", 1)[1]
    return [line for line in hunks.splitlines()[1:] if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.fixture
def diff(fake_site):
    site = fake_site(engine_source=ENGINE, patches=PACK)

    def run(patch_id):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)])
        proc = subprocess.run([sys.executable, "-c", FAKE_DOCTOR, "diff", patch_id], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "%s (fakeeng 1.0): applies" % patch_id in proc.stdout, proc.stdout
        assert "written whole by ast.unparse" not in proc.stdout, proc.stdout
        return proc.stdout

    run.site = site
    return run


def test_trailing_comment_of_after_is_in_the_added_line(diff):
    """Before: ``+        return helper(x, 2)``, the comment dropped."""
    out = diff("fake-trailing")
    assert _changed(out) == ["-        return helper(x, 1)", "+        return helper(x, 2)  # why this is right"], out


def test_comment_lines_of_after_are_in_the_added_lines_in_place(diff):
    """Before: the three statements' lines only, without the two comment lines and the trailing comment."""
    out = diff("fake-lines")
    assert _changed(out) == ["-        z = helper(x, 1)", "+        # a comment line", "+        z = helper(x, 2)",
                             "+        # between the two", "+        z += 1  # trailing one"], out


def test_engine_comment_in_the_replaced_span_stays(diff):
    """The ``else`` block becomes ``elif ...: else:`` (the engine's ``else`` block is the new ``else``). Before:
    the whole ``if`` statement was written again by ``ast.unparse``, ``# engine comment kept`` deleted."""
    out = diff("fake-elif")
    assert "\n             # engine comment kept\n" in out, out  # context, not a deleted line
    assert _changed(out) == ["+        elif x > 3:", "+            # large x", "+            a = 3", "+            b = 0"], out


def test_the_code_run_is_the_code_of_the_edit(fake_site):
    """Comments change no code: each patch applies and computes what its ``after`` says."""
    site = fake_site(engine_source=ENGINE, patches=PACK)
    (result,), _ = run_py('''
        import flashfix
        flashfix.PATCH_MODULES["fakeeng"] = "fake_patches"
        flashfix.activate()
        from fakeeng import core
        e = core.Engine()
        report(values=[e.compute(5), e.block(5), e.branch(5), e.branch(2), e.branch(-1)],
               states={r["id"]: r["state"] for r in flashfix.status()})
    ''', site=site)
    assert result["values"] == [7, 18, 3, 4, 0], result
    assert all(result["states"][i] == "applied" for i in ("fake-trailing", "fake-lines", "fake-elif")), result


def test_real_sglang_swa_fix_keeps_full_attention_comment():
    """SGLang 0.5.17: ``update_sliding_window``'s ``else:`` block opens with ``# full attention``; the fix puts
    an ``elif use_ragged:`` before it. Before: the whole ``if wrapper_id == 0`` statement was written again
    by ``ast.unparse``, that comment and the engine's others in it deleted and its line breaks lost."""
    import engine_env

    python = engine_env.env_python("sglang==0.5.17")
    source = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec("
                             "'sglang.srt.layers.attention.flashinfer_backend').origin)"], capture_output=True,
                            text=True, check=True).stdout.strip()
    lines = Path(source).read_text().splitlines()
    owner = lines.index("class FlashInferIndicesUpdaterPrefill:")
    start = next(i for i in range(owner, len(lines)) if "def update_sliding_window" in lines[i])
    body = lines[start:next(i for i in range(start + 1, len(lines)) if lines[i].startswith("    def "))]
    assert "                # full attention" in body  # the comment is there, in the branch the fix replaces

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([str(python), "-m", "flashfix", "diff", "sglang-swa-full-attn-ragged-prefix"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\n                 # full attention\n" in out, out  # unchanged context
    assert "-                # full attention" not in out and "written whole" not in out, out
    assert _changed(out) == ["+            elif use_ragged:", "+                paged_kernel_lens = prefix_lens",
                             "+                paged_kernel_lens_sum = prefix_lens.sum().item()",
                             "+                kv_start_idx = None"], out
