"""Patch packs (entry-point group ``flashfix.patches``), each installed as a real distribution.

The failure cases use the fake engine of conftest.py (an import-system mechanism); the README's
example pack (examples/flashfix-pack-example, shown in the README's "Writing a backport") is
installed next to real vLLM releases and shown to fix a real bug there.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import engine_env
from conftest import REPO, run_py

EXAMPLE = REPO / "examples" / "flashfix-pack-example"
PACK_ID = "vllm-cpu-mixed-seed-sampling"


def uv():
    return engine_env.uv()


def make_project(root, dist, module, body, entry="fakeeng"):
    """A tiny pack project: distribution ``dist``, module ``module`` with ``body``, one entry
    point ``entry = module`` in ``flashfix.patches``."""
    project = root / dist
    (project / module).mkdir(parents=True)
    (project / module / "__init__.py").write_text(textwrap.dedent(body))
    (project / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["hatchling>=1.18"]
        build-backend = "hatchling.build"
        [project]
        name = "%s"
        version = "1.0"
        [project.entry-points."flashfix.patches"]
        %s = "%s"
        [tool.hatch.build.targets.wheel]
        packages = ["%s"]
    ''' % (dist, entry, module, module)))
    return project


def install(target, *projects, python=sys.executable):
    subprocess.run([uv(), "pip", "install", "-q", "--no-deps", "--python", str(python), "--target", str(target)]
                   + [str(p) for p in projects], check=True)
    return target


GOOD = '''
from flashfix.core.registry import Patch, Shape, SetAttr, BUGGY

def prepare(modules):
    core = modules["fakeeng.core"]
    return [SetAttr(core.Engine, "other", lambda self: "patched by a pack")]

PATCHES = (Patch(id="ffx-other", engine="fakeeng", targets=("fakeeng.core",), versions="<2", upstream="u",
                 fixed_in="2.0", delete_when="never", summary="other, from a pack",
                 probe=lambda trees: Shape(BUGGY, "always"), prepare=prepare),)
'''

MALFORMED = GOOD.replace("ffx-other", "ffx-good-1").replace("prepare=prepare),)", "prepare=prepare), 'not a patch')")
DUPLICATE = GOOD.replace("ffx-other", "fake-compute")  # flashfix's own (fake) patch id
BROKEN = "raise ImportError('this pack is broken')\n"


@pytest.fixture(scope="module")
def fake_packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")
    projects = [make_project(root, "ffx-good", "ffx_good", GOOD), make_project(root, "ffx-malformed", "ffx_malformed", MALFORMED),
                make_project(root, "ffx-dup", "ffx_dup", DUPLICATE), make_project(root, "ffx-broken", "ffx_broken", BROKEN)]
    return install(root / "site", *projects)


LINES = {
    "ffx-broken": "pack ffx-broken (entry point fakeeng = ffx_broken) skipped, none of its patches is loaded: "
                  "cannot be imported: ImportError('this pack is broken')",
    "ffx-malformed": "pack ffx-malformed (entry point fakeeng = ffx_malformed) skipped, none of its patches is loaded: "
                     "PATCHES[1] is a str, not a flashfix Patch",
    "ffx-dup": "pack ffx-dup (entry point fakeeng = ffx_dup) skipped, none of its patches is loaded: "
               "the id fake-compute is already taken by another pack or by flashfix",
}


def _run(code, site, packs, env=None, check=True):
    return run_py(code, site=os.pathsep.join([str(site), str(packs)]), env=env, check=check)


def test_broken_malformed_and_duplicate_packs_are_skipped_whole_with_one_line_each(fake_site, fake_packs):
    site = fake_site()
    results, proc = _run('''
        use_fake()
        import fakeeng.core
        import flashfix
        rows = {r["id"]: r["state"] for r in flashfix.status() if r["engine"] == "fakeeng"}
        report(rows=rows, other=fakeeng.core.Engine().other(), compute=fakeeng.core.Engine().compute(1))
    ''', site, fake_packs)
    (result,) = results
    # flashfix's own (here the fake) patch and the good pack apply; the bad packs add nothing
    assert result["rows"] == {"fake-compute": "applied", "ffx-other": "applied"}, result
    assert result["other"] == "patched by a pack" and result["compute"] == 3
    for dist, line in LINES.items():
        assert proc.stderr.count(line) == 1, (dist, proc.stderr)
    assert proc.stderr.count("skipped, none of its patches is loaded") == 3, proc.stderr


def test_strict_mode_fails_the_engine_import_naming_the_packs(fake_site, fake_packs):
    site = fake_site()
    results, proc = _run('''
        use_fake()
        import flashfix
        try:
            import fakeeng.core
        except flashfix.PatchError as exc:
            report(error=str(exc))
        else:
            report(error=None)
    ''', site, fake_packs, env={"FLASHFIX_STRICT": "1"})
    (result,) = results
    assert result["error"] is not None
    for line in LINES.values():
        assert line in result["error"], result["error"]


def test_disable_names_a_pack_id_and_doctor_path_reads_the_packs_there(fake_site, fake_packs, tmp_path):
    site = fake_site()
    results, proc = _run('''
        use_fake()
        import fakeeng.core
        import flashfix
        report(rows={r["id"]: r["state"] for r in flashfix.status()}, other=fakeeng.core.Engine().other())
    ''', site, fake_packs, env={"FLASHFIX_DISABLE": "ffx-other"})
    (result,) = results
    assert result["rows"]["ffx-other"] == "disabled" and result["other"] == "patched other", result  # flashfix's own fake
    assert "unknown patch id" not in proc.stderr, proc.stderr
    # doctor --path --run-packs: the packs installed in the folder read are found there and judged here
    results, proc = run_py('''
        import io, contextlib, json, sys
        use_fake()
        from flashfix.tools import cli as _cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = _cli.main(["doctor", "--json", "--run-packs", "--path", %r, "--path", %r])
        report(code=code, rows={r["id"]: r["verdict"] for r in json.loads(out.getvalue())})
    ''' % (str(site), str(fake_packs)), site=site, check=False)  # flashfix's own (fake) module importable here
    (result,) = results
    rows = {k: v for k, v in result["rows"].items() if k.startswith(("fake", "ffx"))}
    assert rows == {"fake-compute": "patch", "ffx-other": "patch"}, (result, proc.stderr)
    for line in LINES.values():
        assert line in proc.stderr, proc.stderr


WRITER = '''
import os
open(os.environ["FFX_WRITER_PROOF"], "w").write("this pack ran")
PATCHES = ()
'''


def test_reading_a_wheel_never_runs_its_pack(tmp_path):
    """Before: `doctor --path pack.whl` imported the wheel's `flashfix.patches` module (which wrote a
    file). Now packs of an environment read are named and not run, unless --run-packs is given."""
    project = make_project(tmp_path, "ffx-writer", "ffx_writer", WRITER, entry="vllm")
    subprocess.run([uv(), "build", "-q", "--wheel", "-o", str(tmp_path / "dist"), str(project)], check=True)
    (wheel,) = (tmp_path / "dist").glob("ffx_writer-*.whl")
    proof = tmp_path / "proof"
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}, PYTHONPATH=str(REPO),
               FFX_WRITER_PROOF=str(proof))
    line = ("pack ffx-writer (entry point vllm = ffx_writer) skipped, none of its patches is loaded: not run: reading "
            "an environment never executes its code (--run-packs imports the pack here, executing it, to judge its "
            "patches)")
    for command in (["doctor"], ["doctor", "--strict"], ["diff"]):
        proc = subprocess.run([sys.executable, "-m", "flashfix", *command, "--path", str(wheel)], capture_output=True,
                              text=True, env=env, timeout=300)
        assert not proof.exists(), (command, proc.stderr)
        assert line in proc.stderr, (command, proc.stderr)
        assert proc.returncode == (1 if "--strict" in command else 0), (command, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--run-packs", "--path", str(wheel)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proof.read_text() == "this pack ran", proc.stderr
    assert "ffx-writer" not in proc.stderr, proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--help"], capture_output=True, text=True,
                               env=env).stdout
    assert "EXECUTING their code" in " ".join(help_text.split())


# --- the README example, as an installed distribution next to real vLLM releases ------------------

SAMPLE = '''
import json, os, sys
ACTIVATE
import torch
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

sampler = TopKTopPSampler()
logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0))

def draw():  # a batch of two requests, only the first one seeded
    out, _ = sampler.forward_cpu(logits.clone(), {0: torch.Generator().manual_seed(1234)}, None, None)
    return out[0].item()

draws = [draw() for _ in range(6)]
flashfix = sys.modules.get("flashfix")
rows = {r["id"]: r for r in flashfix.status()} if flashfix else {}
print("FLASHFIX_RESULT=" + json.dumps({"draws": draws, "flashfix": bool(flashfix),
                                       "row": rows.get("PACK_ID"), "own": sorted(rows)}))
'''.replace("PACK_ID", PACK_ID)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheels")
    for project in (REPO, EXAMPLE):
        subprocess.run([uv(), "build", "-q", "--wheel", "-o", str(root), str(project)], check=True)
    return next(root.glob("flashfix-[0-9]*.whl")), next(root.glob("flashfix_pack_example-*.whl"))


def layered_venv(path, requirement, wheels):
    """A venv over ``requirement``'s shared environment (a .pth line puts its site-packages on
    sys.path; nothing is written there) with flashfix's wheel and ``wheels`` installed: flashfix.pth
    runs at start-up."""
    python = engine_env.env_python(requirement)
    subprocess.run([uv(), "venv", "-q", "--python", str(python), str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    (engine_site,) = python.parent.parent.glob("lib/python*/site-packages")
    (site / "zz_engine.pth").write_text(str(engine_site) + "\n")
    subprocess.run([uv(), "pip", "install", "-q", "--no-deps", "--python", str(path / "bin" / "python")]
                   + [str(w) for w in wheels], check=True)
    return path / "bin" / "python"


def _engine(python, code, env=None, args=("-c",)):
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("FLASHFIX_")}
    full.update({"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1"}, **(env or {}))
    proc = subprocess.run([str(python)] + list(args) + ([code] if code else []), env=full, capture_output=True,
                          text=True, timeout=900)
    results = [json.loads(l[len("FLASHFIX_RESULT="):]) for l in proc.stdout.splitlines()
               if l.startswith("FLASHFIX_RESULT=")]
    return proc, results


def test_readme_example_pack_fixes_vllm_0_28_and_is_fixed_upstream_in_0_29(wheels, tmp_path):
    flashfix_wheel, pack_wheel = wheels
    # 1. without the pack (flashfix alone, `import flashfix`): the seeded request is not reproducible
    bare = install(tmp_path / "bare", flashfix_wheel)
    python28 = engine_env.env_python("vllm==0.28.0")
    proc, (without,) = _engine(python28, SAMPLE.replace("ACTIVATE", "import flashfix"), env={"PYTHONPATH": str(bare)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert without["row"] is None and "vllm-sink-prefill" in without["own"]
    assert len(set(without["draws"])) > 1, without  # the bug: the seed is ignored

    # 2. with the pack, activated by `import flashfix` (flashfix and the pack on PYTHONPATH)
    both = install(tmp_path / "both", flashfix_wheel, pack_wheel)
    proc, (fixed,) = _engine(python28, SAMPLE.replace("ACTIVATE", "import flashfix"), env={"PYTHONPATH": str(both)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(set(fixed["draws"])) == 1, fixed  # the seed is honoured
    assert fixed["row"]["state"] == "applied" and fixed["row"]["ran"] is True, fixed
    assert "applied %s to vllm 0.28.0" % PACK_ID in proc.stderr

    # 3. with the pack, activated by flashfix.pth at start-up (the code never imports flashfix)
    venv28 = layered_venv(tmp_path / "venv28", "vllm==0.28.0", wheels)
    proc, (started,) = _engine(venv28, SAMPLE.replace("ACTIVATE", ""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert started["flashfix"] and len(set(started["draws"])) == 1, started
    assert started["row"]["state"] == "applied", started
    # flashfix's own patches came through the same entry-point group, from the installed metadata
    proc, (entries,) = _engine(venv28, '''
import json
from flashfix.core import packs as _packs
print("FLASHFIX_RESULT=" + json.dumps([list(e) for e in _packs.installed()]))
''')
    assert sorted((e[0], e[2], e[3], e[5]) for e in entries) == [
        ("flashinfer", "flashfix.flashinfer_patch", "flashfix", False), ("sglang", "flashfix.sglang_patch", "flashfix", False),
        ("vllm", "flashfix.vllm_patch", "flashfix", False), ("vllm", "flashfix_pack_example", "flashfix-pack-example", False)]

    # 4. flashfix diff shows the change, as the README shows it
    proc, _ = _engine(venv28, None, args=("-m", "flashfix", "diff", PACK_ID))
    assert proc.returncode == 0, proc.stderr
    assert "-        if len(generators) != logits.shape[0] and not self.use_fp64_gumbel:" in proc.stdout, proc.stdout
    # only the changed operand is rewritten, in the declaration's spelling; the rest of the line is vLLM's
    assert "+        if not generators and not self.use_fp64_gumbel:" in proc.stdout, proc.stdout
    assert "\n             return compiled_random_sample(logits), logits_to_return\n" in proc.stdout  # context only

    # 5. doctor: patch on 0.28.0, fixed-upstream on 0.29.0, read through --python (the pack
    #    installed there) and --path (the pack's folder next to the release's site-packages)
    venv29 = layered_venv(tmp_path / "venv29", "vllm==0.29.0", wheels)
    verdicts = {}
    for label, args in (("0.28.0 --python", ["--python", str(venv28)]), ("0.29.0 --python", ["--python", str(venv29)]),
                        ("0.29.0 --path", ["--path", str(both), "--path", str(next(
                            engine_env.env_python("vllm==0.29.0").parent.parent.glob("lib/python*/site-packages")))])):
        proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--json", "--run-packs"] + args,
                              capture_output=True,
                              text=True, env=dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
                                                  PYTHONPATH=str(REPO)), timeout=300)
        assert proc.returncode == 0, proc.stderr
        verdicts[label] = {r["id"]: r["verdict"] for r in json.loads(proc.stdout)}[PACK_ID]
    assert verdicts == {"0.28.0 --python": "patch", "0.29.0 --python": "fixed-upstream",
                        "0.29.0 --path": "fixed-upstream"}, verdicts


def test_sweep_judges_a_pack_over_releases(tmp_path):
    """`scripts/sweep_releases.py --pack MODULE`, as the guide tells a pack author to run it from the
    pack's own folder; its drift check on the pack's own unchanged sweep finds no drift (before: the
    releases outside `versions` that spell the code differently, left untouched, were reported)."""
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}, PYTHONPATH="src")
    sweep = [sys.executable, str(REPO / "scripts" / "sweep_releases.py"), "--pack", "flashfix_pack_example",
             "--only", "vllm==0.22.1,vllm==0.23.0,vllm==0.28.0,vllm==0.29.0", "--quiet"]
    proc = subprocess.run(sweep + ["--json", str(tmp_path / "pack.json")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    verdicts = [line.split()[1:4] for line in proc.stdout.splitlines()]
    assert verdicts == [["0.22.1", PACK_ID, "unknown-shape"], ["0.23.0", PACK_ID, "patch"], ["0.28.0", PACK_ID, "patch"],
                        ["0.29.0", PACK_ID, "fixed-upstream"]], proc.stdout
    proc = subprocess.run(sweep + ["--check", str(tmp_path / "pack.json")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=EXAMPLE)
    assert proc.returncode == 0 and "no drift" in proc.stderr, proc.stderr
    # a release inside `versions` that reads unknown-shape is drift: the engine would stay unpatched
    wide = tmp_path / "wide"
    wide.mkdir()
    source = (EXAMPLE / "src" / "flashfix_pack_example" / "__init__.py").read_text()
    (wide / "flashfix_pack_wide.py").write_text(source.replace('versions=">=0.23,<0.29"', 'versions=">=0.22,<0.29"'))
    proc = subprocess.run(sweep[:3] + ["flashfix_pack_wide", "--only", "vllm==0.22.1", "--quiet", "--check",
                                       str(tmp_path / "pack.json")], capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=str(wide)), timeout=300)
    assert proc.returncode == 1 and "DRIFT: vllm 0.22.1 %s: unknown-shape" % PACK_ID in proc.stderr, proc.stderr


def test_readme_shows_the_example_files():
    """README's "Writing a backport" shows the example pack's files verbatim: the pack that
    test_readme_example_pack_fixes_vllm_0_28_and_is_fixed_upstream_in_0_29 installs and runs."""
    readme = (REPO / "README.md").read_text()
    assert "## Writing a backport" in readme
    section = readme.split("## Writing a backport", 1)[1].split("\n## ", 1)[0]
    for path in (EXAMPLE / "pyproject.toml", EXAMPLE / "src" / "flashfix_pack_example" / "__init__.py"):
        assert path.read_text() in section, "README's 'Writing a backport' does not show %s as it is" % path


def test_every_keyword_is_documented_with_its_type():
    """The guide's keyword reference names every keyword of Backport and Rule and every field of
    Patch, each with its type; help(Backport) names every keyword; both say where ShapeError is."""
    import inspect
    import re

    from flashfix import semantic
    from flashfix.core.registry import Patch

    reference = (REPO / "docs" / "writing-a-backport.md").read_text().split("## Keyword reference", 1)[1]
    types = {}
    for line in reference.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 2:
            for name in re.findall(r"`(\w+)`", cells[0]):
                types.setdefault(name, cells[1])
    keywords = [name for name, p in inspect.signature(semantic.Backport).parameters.items()
                if p.kind is not p.VAR_KEYWORD] + list(inspect.signature(semantic.Rule).parameters)
    assert not [name for name in keywords + list(Patch._fields) if not types.get(name)], types
    assert not [name for name in keywords if "``%s``" % name not in semantic.Backport.__doc__]
    for text in (reference, semantic.Backport.__doc__):
        assert "from flashfix.semantic import ShapeError" in " ".join(text.split())


KDA_PACK = r'''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="ffx-kda-helion", engine="sglang", versions=">=0.5", upstream="u", fixed_in="0.5.18", summary="s",
    doc="Delete when: never", module="sglang.srt.layers.attention.linear.kda_backend",
    function="KDAKernelDispatcher.__init__",
    before="if decode_backend.is_triton():\n    $$$T\nelse:\n    $$$E",
    after="if decode_backend.is_triton():\n    $$$T\nelif decode_backend.is_helion():\n"
          "    self.decode_kernel = triton_kernel\nelse:\n    $$$E"),)
'''


def test_a_pattern_of_several_lines_reads_as_lines_in_the_doctors_table(tmp_path):
    """Before: the reason's pattern was ast.unparse'd and its later lines started at column 0,
    breaking the table. Now they stand under the reason's first line, as the declaration spells them;
    the pack is tried before installing it next to the engine, as the guide says (--target, --path)."""
    packs = install(tmp_path / "site", make_project(tmp_path, "ffx-kda", "ffx_kda", KDA_PACK, entry="sglang"))
    site = next(engine_env.env_python("sglang==0.5.17").parent.parent.glob("lib/python*/site-packages"))
    proc = subprocess.run([sys.executable, "-m", "flashfix", "doctor", "--run-packs", "--path", str(packs), "--path",
                           str(site)], capture_output=True, text=True, timeout=300,
                          env=dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
                                   PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (row,) = [i for i, line in enumerate(lines) if line.startswith("ffx-kda-helion ")]
    # the reason beside the row where it fits in 120 columns, else on the lines below it, indented (wrapped)
    head = next(i for i in range(row, row + 8) if "KDAKernelDispatcher.__init__ (line " in lines[i])
    column = lines[head].index("KDAKernelDispatcher.__init__ (line ")
    assert lines[row].split()[1:4] == ["sglang", "0.5.17", "patch"], lines[row]
    end = next(i for i in range(head, head + 8) if lines[i].endswith("`if decode_backend.is_triton():"))
    assert lines[end + 1:end + 4] == [" " * column + "    $$$T", " " * column + "else:", " " * column + "    $$$E`"], \
        lines[row:end + 4]


def test_flashfix_own_packs_load_under_python_OO():
    """``python -OO`` drops docstrings: a declaration whose doc was its module's docstring failed to
    load (no 'Delete when:'), and the whole vLLM pack with it. Every own pack loads, each patch
    with its delete-when text, in an interpreter that strips docstrings."""
    code = textwrap.dedent("""
        import json, sys
        assert sys.flags.optimize == 2
        from flashfix import flashinfer_patch, sglang_patch, vllm_patch
        rows = [(p.id, p.delete_when) for m in (flashinfer_patch, sglang_patch, vllm_patch)
                for p in getattr(m, "PATCHES", ()) + ((m.PATCH,) if hasattr(m, "PATCH") else ())]
        print(json.dumps(rows))
    """)
    proc = subprocess.run([sys.executable, "-OO", "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), FLASHFIX_DISABLE="all"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert "vllm-sink-prefill" in dict(rows) and len(rows) >= 20
    assert [pid for pid, delete_when in rows if not delete_when] == []
