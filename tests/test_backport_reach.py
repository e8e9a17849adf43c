"""What a declaration can say and how it fails (issue 22, items 5-8), on real engine source and
in real engine environments: ``requires`` (dependency gates), class bodies and module top levels
as targets, an absent target, and mistakes caught when the declaration is written."""

import json
import os
import subprocess

import pytest

import engine_env
import this_checkout
from conftest import REPO
from test_packs import _engine, install, make_project
from test_semantic import installed, probe

this_checkout.flashfix()
from flashfix import semantic, sglang_patch  # noqa: E402
from flashfix.core import locate as _locate  # noqa: E402
from flashfix.core import paths as _paths  # noqa: E402
from flashfix.core import registry as _registry  # noqa: E402
from flashfix.core import source as _source  # noqa: E402

PACK_ID = "ffx-kimi-attribute-map"
# sglang#40700 (first in 0.5.23): KimiLinearConfig gains a class attribute, so that the shared MoE
# code's `config.num_experts_per_tok` reads the checkpoint's `num_experts_per_token`.
KIMI = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="ffx-kimi-attribute-map", engine="sglang", versions=">=0.5.11,<0.5.23", fixed_in="0.5.23",
    upstream="https://github.com/sgl-project/sglang/pull/40700",
    module="sglang.srt.configs.kimi_linear", function="KimiLinearConfig",
    before="keys_to_ignore_at_inference = $K",
    after="""
        attribute_map = {"num_experts_per_tok": "num_experts_per_token"}
        keys_to_ignore_at_inference = $K
    """, REQUIRES
    summary="KimiLinearConfig maps num_experts_per_tok to the checkpoint's num_experts_per_token",
    doc="Why: the shared MoE code reads num_experts_per_tok.  Delete when: never (a test pack)."),)
'''


def site_of(requirement):
    (site,) = engine_env.env_python(requirement).parent.parent.glob("lib/python*/site-packages")
    return site


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    plain = make_project(root, "ffx-kimi", "ffx_kimi", KIMI.replace("REQUIRES", ""), entry="sglang")
    gated = make_project(root, "ffx-kimi-gated", "ffx_kimi_gated",
                         KIMI.replace("REQUIRES", 'requires={"xgrammar": ">=0.2.7"},'), entry="sglang")
    return install(root / "plain", plain), install(root / "gated", gated)


RUN = '''
import io, json, os
import flashfix
from flashfix.tools import diff, doctor
from sglang.srt.configs.kimi_linear import KimiLinearConfig

def experts():
    try:
        return KimiLinearConfig(num_experts_per_token=8).num_experts_per_tok
    except AttributeError:
        return None

row = {r["id"]: r for r in flashfix.status()}[%r]
doctor_row = {r["id"]: r for r in doctor.diagnose()[0]}[row["id"]]
out = io.StringIO()
diff.run([row["id"]], out=out)
result = dict(row=row, doctor=doctor_row, experts=experts(), diff=out.getvalue(),
              has_map="attribute_map" in vars(KimiLinearConfig))
flashfix.revert()
result.update(reverted=experts(), has_map_reverted="attribute_map" in vars(KimiLinearConfig),
              ran_reverted={r["id"]: r for r in flashfix.status()}[row["id"]]["ran"])
print("FLASHFIX_RESULT=" + json.dumps(result))
''' % PACK_ID


def test_a_class_attribute_backport_and_its_dependency_gate_on_real_sglang(packs):
    """sglang#40700 as a pack on SGLang 0.5.18 (no KimiLinearConfig.attribute_map; xgrammar 0.2.1):
    probe, diff, apply and revert of a class body; with ``requires`` unmet the engine is left
    untouched, the doctor and the runtime say the same (known-unfixed), and strict mode lets the import be."""
    plain, gated = packs
    python = engine_env.env_python("sglang==0.5.18")
    path = os.pathsep.join([str(REPO), str(plain)])
    proc, (res,) = _engine(python, RUN, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res["row"]["state"] == "applied" and res["row"]["ran"] is True, res["row"]
    assert res["doctor"]["verdict"] == "patch" and "KimiLinearConfig (line 12)" in res["doctor"]["reason"], res["doctor"]
    assert res["experts"] == 8 and res["has_map"], res  # the bug: AttributeError without the fix (below)
    assert res["reverted"] is None and not res["has_map_reverted"], res  # revert() removes the class attribute
    assert "KimiLinearConfig: the new statements below run in its namespace" in res["diff"], res["diff"]
    added = [line for line in res["diff"].splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    # upstream's line, in the pack's (and upstream's) spelling: double quotes, as sglang#40700 writes it
    assert added == ['+    attribute_map = {"num_experts_per_tok": "num_experts_per_token"}'], res["diff"]
    assert "applied %s to sglang 0.5.18" % PACK_ID in proc.stderr and "KimiLinearConfig.attribute_map" in proc.stderr

    # the gated pack: xgrammar 0.2.1 is installed, the fix needs >=0.2.7: nothing is touched
    path = os.pathsep.join([str(REPO), str(gated)])
    proc, (res,) = _engine(python, RUN, env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reason = "not carried here: the fix needs xgrammar>=0.2.7 (xgrammar 0.2.1 is installed)"
    assert res["row"]["state"] == "known-unfixed" and reason in res["row"]["reason"], res["row"]
    assert res["doctor"]["verdict"] == "known-unfixed" and res["doctor"]["reason"] == res["row"]["reason"], res
    assert res["experts"] is None and not res["has_map"] and res["row"]["ran"] is False, res
    proc, _ = _engine(python, "import flashfix, sglang.srt.configs.kimi_linear", env={"PYTHONPATH": path, "FLASHFIX_STRICT": "1"})
    assert proc.returncode == 0 and "PatchError" not in proc.stderr, proc.stderr[-3000:]  # a dependency to upgrade

    # 0.5.23 carries the fix: fixed-upstream, in the doctor of that environment
    proc = subprocess.run([str(engine_env.env_python("sglang==0.5.23")), "-m", "flashfix", "doctor", "--json"],
                          capture_output=True, text=True, timeout=300,
                          env=dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")},
                                   PYTHONPATH=os.pathsep.join([str(REPO), str(plain)])))
    assert proc.returncode == 0, proc.stderr
    assert {r["id"]: r["verdict"] for r in json.loads(proc.stdout)}[PACK_ID] == "fixed-upstream"


def _kimi(**more):
    return semantic.Backport(id="t-kimi", engine="sglang", versions=">=0.5", upstream="u", fixed_in="0.5.23",
                             summary="s", doc="Delete when: never", module="sglang.srt.configs.kimi_linear",
                             function="KimiLinearConfig", before="keys_to_ignore_at_inference = $K",
                             after='attribute_map = {"num_experts_per_tok": "num_experts_per_token"}\n'
                                   'keys_to_ignore_at_inference = $K', **more)


def test_requires_is_read_from_the_environment_the_doctor_reads():
    """``doctor --path``: the required distribution's version is read from the folders read."""
    verdicts = {}
    for release in ("0.5.18", "0.5.23"):
        with _locate.reading(_paths.open_path(str(site_of("sglang==" + release)))):
            for spec in (">=0.2.7", "<0.2.7"):
                patch = _kimi(requires={"xgrammar": spec})
                verdicts[release, spec] = _registry.judge(patch, _registry.read_trees(patch.targets),
                                                          _locate.version("sglang"))[:2]
                _source.forget()
            patch = _kimi(requires={"ffx-no-such-distribution": ""})
            verdicts[release, "absent"] = _registry.judge(patch, _registry.read_trees(patch.targets), release)[0]
    assert verdicts["0.5.18", ">=0.2.7"][0] == "known-unfixed", verdicts
    assert "the fix needs xgrammar>=0.2.7 (xgrammar 0.2.1 is installed)" in verdicts["0.5.18", ">=0.2.7"][1]
    assert verdicts["0.5.18", "<0.2.7"][0] == "patch" and verdicts["0.5.18", "absent"] == "known-unfixed", verdicts
    assert verdicts["0.5.23", ">=0.2.7"][0] == verdicts["0.5.23", "<0.2.7"][0] == "fixed-upstream", verdicts


MODULE_CONSTANT = dict(module="vllm.v1.sample.ops.topk_topp_sampler", function=None)


def test_a_module_top_level_target_on_real_vllm_source():
    """A module's top level as the target (``function=None``): the statements there, not those
    inside its functions; probe, the statements run and the derived pre-fix shape on vLLM 0.29.0."""
    text = installed("0.29.0", MODULE_CONSTANT["module"], "vllm")
    patch = semantic.Backport(id="t-top", engine="vllm", versions=">=0.29", upstream="u", fixed_in="9",
                              summary="s", doc="Delete when: never", before="logger = init_logger($N)",
                              after="logger = init_logger($N)\nFFX_SEEN = 1", **MODULE_CONSTANT)
    assert probe(patch, text).kind == _registry.BUGGY, probe(patch, text)
    tree = _source.parse_text(text, "topk")
    rendered, code = semantic._body(tree, tree, lambda node, mark: patch.rule.hunks[0].edit(node, mark))
    assert rendered.text() == "FFX_SEEN = 1\n" and rendered.before == "", rendered.text()
    space = {}
    exec(code, {}, space)
    assert space == {"FFX_SEEN": 1}
    fixed = text.replace("logger = init_logger(__name__)\n", "logger = init_logger(__name__)\nFFX_SEEN = 1\n", 1)
    assert probe(patch, fixed).kind == _registry.FIXED
    assert semantic.derive_prefix(patch, fixed) == text
    # a pattern that only a function's body has is not a top-level statement
    inner = semantic.Backport(id="t-in", engine="vllm", versions=">=0.29", upstream="u", fixed_in="9", summary="s",
                              doc="Delete when: never", before="return apply_top_k_top_p_pytorch($L, $K, $P)",
                              after="return apply_top_k_top_p_pytorch($L, $K, $P, 1)", **MODULE_CONSTANT)
    assert probe(inner, text).kind == _registry.UNKNOWN, probe(inner, text)
    # what the runtime would refuse (two separate runs of changed statements), the doctor refuses too
    two = semantic.Backport(id="t-two", engine="e", versions=">=1", upstream="u", fixed_in="9", summary="s",
                            doc="Delete when: never", module="m", function="C", before="a = $X\nb = $Y\nc = $Z",
                            after="a = $X + 1\nb = $Y\nc = $Z + 1")
    verdict = _registry.judge(two, {"m": _source.parse_text("class C:\n    a = 1\n    b = 2\n    c = 3\n", "m")}, None)
    assert verdict == ("unknown-shape", "C: a backport of a class body or module top level adds or changes one run of "
                                        "statements"), verdict


def test_a_class_body_target_turns_back_on_the_fixed_release():
    fixed = installed("0.5.23", "sglang.srt.configs.kimi_linear")
    prefix = semantic.derive_prefix(_kimi(), fixed)
    assert probe(_kimi(), fixed).kind == _registry.FIXED and probe(_kimi(), prefix).kind == _registry.BUGGY
    assert [line for line in fixed.splitlines() if line not in prefix.splitlines()] == [
        '    attribute_map = {"num_experts_per_tok": "num_experts_per_token"}']


AUTOTUNE_0_5_11 = dict(module="sglang.srt.model_executor.model_runner", function="ModelRunner._should_run_flashinfer_autotune",
                       before="is_sm100_supported()", after="is_sm100_supported() or is_sm120_supported()")


def test_an_absent_function_is_unknown_shape_unless_a_word_says_otherwise():
    """SGLang 0.5.14 moved the autotune decision out of model_runner (AUTOTUNE_SITES): a
    declaration that names only 0.5.11's site finds no function there. That is a move, not a
    release without the bug, so it is unknown-shape, with a reason that says what would make an
    absence not-affected; ``absent_unless_mentioned`` does, but only from the modules declared
    (0.5.14's model_runner no longer mentions autotuning at all), and the guide says both."""
    old_site = semantic.Backport(id="t-old", engine="sglang", versions=">=0.5", upstream="u", fixed_in="0.5.18",
                                 summary="s", doc="Delete when: never", **AUTOTUNE_0_5_11)
    text = installed("0.5.14", AUTOTUNE_0_5_11["module"])
    shape = probe(old_site, text)
    assert shape.kind == _registry.UNKNOWN and "moved or renamed?" in shape.reason, shape
    assert "absent_unless_mentioned" in shape.reason, shape
    worded = semantic.Backport(id="t-word", engine="sglang", versions=">=0.5", upstream="u", fixed_in="0.5.18",
                               summary="s", doc="Delete when: never", absent_unless_mentioned="autotun", **AUTOTUNE_0_5_11)
    assert probe(worded, text).kind == _registry.ABSENT
    # flashfix's own declaration lists every site: 0.5.14's decision is found, and patched
    tree = _source.parse_text(installed("0.5.14", sglang_patch.AUTOTUNE_SITES[1][0]), "runner")
    trees = {m: tree if m == sglang_patch.AUTOTUNE_SITES[1][0] else None for m, _ in sglang_patch.AUTOTUNE_SITES}
    site = engine_env.env_python("sglang==0.5.14").parent.parent.glob("lib/python*/site-packages")
    with _locate.reading(_paths.PathReader([next(site)])):  # the needed global is read from that release
        assert sglang_patch.SM120_FP8_AUTOTUNE.probe(trees).kind == _registry.BUGGY
    assert "the function\nabsent, `unknown-shape`" in (REPO / "README.md").read_text()
    guide = (REPO / "docs" / "writing-a-backport.md").read_text()
    assert "the function is absent: `unknown-shape`" in guide and "absent_unless_mentioned" in guide.split(
        "the function is absent")[1].split("\n\n")[0]


README_EXAMPLE = dict(id="x", engine="vllm", versions=">=0.23,<0.29", upstream="u", fixed_in="0.29.0", summary="s",
                      doc="Delete when: never", module="vllm.v1.sample.ops.topk_topp_sampler",
                      function="TopKTopPSampler.forward_cpu",
                      before="len($G) != $LOGITS.shape[0] and not self.use_fp64_gumbel",
                      after="not $G and not self.use_fp64_gumbel")


def test_mistakes_surface_when_the_backport_is_declared():
    with pytest.raises(ValueError, match=r"`after` of TopKTopPSampler.forward_cpu uses \$N, which neither"):
        semantic.Backport(**dict(README_EXAMPLE, after="not $G and not $N"))
    with pytest.raises(ValueError, match=r"`before` is not Python: .*line 2") as info:
        semantic.Backport(**dict(README_EXAMPLE, before="len($G) != $LOGITS\n  $X"))
    assert "__ffx" not in str(info.value) and "$X" in str(info.value)
    with pytest.raises(ValueError, match=r"`where` is not Python"):
        semantic.Backport(**dict(README_EXAMPLE, where="f($A"))
    with pytest.raises(ValueError, match="Invalid specifier"):  # packaging's InvalidSpecifier
        semantic.Backport(**dict(README_EXAMPLE, requires={"xgrammar": "0.2.7+"}))
    # an indented triple-quoted pattern is read as the code it shows
    semantic.Backport(**dict(README_EXAMPLE, before="""
            len($G) != $LOGITS.shape[0] and not self.use_fp64_gumbel
    """))
    # derive_prefix on the README's own example: before's $LOGITS is not in after: the documented ValueError
    fixed = installed("0.29.0", README_EXAMPLE["module"], "vllm")
    with pytest.raises(ValueError, match=r"`before` uses \$LOGITS, which `after` does not bind"):
        semantic.derive_prefix(semantic.Backport(**README_EXAMPLE), fixed)
