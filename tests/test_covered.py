"""A pack whose fix flashfix carries too (issue 34 item 3): ``covered``, not a conflict.

A real installed pack (a distribution with a ``flashfix.patches`` entry point, built and installed by uv)
declares sglang#34217's ``is_image_understandable_model`` fix under its own id, the same edit of the same
function as flashfix's ``sglang-vision-config``, next to real SGLang 0.5.17 (which has the bug). flashfix's
patch is judged first and rewrites ``ModelConfig.__init__``; the pack's is judged on the code that leaves,
where its fix is made: ``covered``, naming flashfix's patch, in the doctor and the runtime alike, and
``--strict`` / ``FLASHFIX_STRICT=1`` accept it (it was ``unknown-shape``: "rewritten by ..., judged first",
strict failed although the fix was in force). With flashfix's patch disabled, the pack's own applies and
makes the fix. A pack whose edit of that function is another change is still refused (``unknown-shape``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import engine_env  # noqa: E402
from conftest import REPO  # noqa: E402
from test_packs import install, make_project  # noqa: E402

OWN = "sglang-vision-config"
PACK = '''
from flashfix.semantic import Backport

PATCHES = (
    Backport(id="pack-vision-none", engine="sglang", versions=">=0.5.5.post1,<0.5.18", fixed_in="0.5.18",
             upstream="https://github.com/sgl-project/sglang/pull/34217",
             module="sglang.srt.configs.model_config", function="ModelConfig.__init__",
             inside="self.is_image_understandable_model = $_",
             before='hasattr($X, "vision_config")', after='getattr($X, "vision_config", None) is not None',
             summary="a text-only model whose vision_config is None is not image-capable",
             doc="""Why: the same bug as flashfix's own fix. Delete when: the engine has it."""),
    Backport(id="pack-vision-other", engine="sglang", versions=">=0.5.5.post1,<0.5.18", fixed_in="0.5.18",
             upstream="https://example.invalid/other",
             module="sglang.srt.configs.model_config", function="ModelConfig.__init__",
             inside="self.is_image_understandable_model = $_",
             before='hasattr($X, "vision_config")', after='hasattr($X, "vision_config") and bool($X.vision_config)',
             summary="another change of the same line",
             doc="""Why: a different edit. Delete when: never."""),
)
'''

RUNTIME = r'''
import json
import flashfix
import sglang.srt.configs.model_config as mc
rows = {r["id"]: [r["state"], r["reason"]] for r in flashfix.status()}
print("FLASHFIX_RESULT=" + json.dumps(rows))
'''


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("covered")
    return install(root / "site", make_project(root, "pack-vision", "pack_vision", PACK, entry="sglang"))


def _run(args, packs, env=None):
    python = engine_env.env_python("sglang==0.5.17")
    full = {k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}
    full.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(packs)]), "CUDA_VISIBLE_DEVICES": "",
                 "HF_HUB_OFFLINE": "1"}, **(env or {}))
    return subprocess.run([str(python)] + args, env=full, capture_output=True, text=True, timeout=900)


def _rows(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["id"]: r for r in json.loads(proc.stdout)}


def test_a_pack_carrying_flashfix_s_fix_is_covered_and_strict_passes(packs):
    rows = _rows(_run(["-m", "flashfix", "doctor", "--json"], packs))
    assert rows[OWN]["verdict"] == "patch", rows[OWN]
    assert rows["pack-vision-none"]["verdict"] == "covered", rows["pack-vision-none"]
    assert OWN in rows["pack-vision-none"]["reason"] and "makes this fix" in rows["pack-vision-none"]["reason"]
    assert rows["pack-vision-other"]["verdict"] == "unknown-shape", rows["pack-vision-other"]  # a real conflict

    proc = _run(["-c", RUNTIME], packs, env={"FLASHFIX_DISABLE": "pack-vision-other", "FLASHFIX_STRICT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]  # strict: the engine's import passes
    (states,) = [json.loads(l[len("FLASHFIX_RESULT="):]) for l in proc.stdout.splitlines()
                 if l.startswith("FLASHFIX_RESULT=")]
    assert states[OWN][0] == "applied" and states["pack-vision-none"][0] == "covered", states
    assert OWN in states["pack-vision-none"][1], states
    strict = _run(["-m", "flashfix", "doctor", "--strict"], packs, env={"FLASHFIX_DISABLE": "pack-vision-other"})
    assert strict.returncode == 0, strict.stdout[-3000:] + strict.stderr[-3000:]


def test_with_flashfix_s_patch_disabled_the_pack_applies_its_own(packs):
    env = {"FLASHFIX_DISABLE": OWN + ",pack-vision-other"}
    rows = _rows(_run(["-m", "flashfix", "doctor", "--json"], packs, env=env))
    assert rows[OWN]["verdict"] == "disabled" and rows["pack-vision-none"]["verdict"] == "patch", rows
    proc = _run(["-c", RUNTIME], packs, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (states,) = [json.loads(l[len("FLASHFIX_RESULT="):]) for l in proc.stdout.splitlines()
                 if l.startswith("FLASHFIX_RESULT=")]
    assert states[OWN][0] == "disabled" and states["pack-vision-none"][0] == "applied", states


def test_the_pack_author_s_sweep_judges_it_with_flashfix_s_patches_in_place(tmp_path):
    """``scripts/sweep_releases.py --pack`` (the wheels, as the doctor reads them): flashfix's own patches
    are judged first, so the pack reads covered on 0.5.17 and fixed-upstream on 0.5.18."""
    (tmp_path / "pack_vision.py").write_text(PACK)
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("FLASHFIX_")}, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_releases.py"), "--pack", "pack_vision",
                           "--only", "sglang==0.5.17,sglang==0.5.18", "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    verdicts = [line.split()[1:4] for line in proc.stdout.splitlines()]
    assert verdicts == [["0.5.17", "pack-vision-none", "covered"], ["0.5.17", "pack-vision-other", "unknown-shape"],
                        ["0.5.18", "pack-vision-none", "fixed-upstream"], ["0.5.18", "pack-vision-other", "unknown-shape"]
                        ], proc.stdout
