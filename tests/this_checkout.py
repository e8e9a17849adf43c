"""Make the test process's own ``import flashfix`` mean this checkout's flashfix.

Where the interpreter that runs pytest has another flashfix installed (an editable install of
another working copy: its ``.pth`` imports that copy at interpreter start-up), tests that read
flashfix's probes in-process would silently judge with the other copy. Engine subprocesses get
this checkout through ``PYTHONPATH`` (tests/engine_env.py); this does the same for the pytest
process, and says which copy it is. Nothing of an engine is imported in the pytest process, so
the other copy's import hook has nothing to act on.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ours(module):
    return Path(module.__file__).resolve().parent == REPO / "flashfix"


def flashfix():
    """This checkout's ``flashfix`` package, imported in place of any other copy."""
    loaded = sys.modules.get("flashfix")
    if loaded is not None and not _ours(loaded):
        for name in [n for n in sys.modules if n == "flashfix" or n.startswith("flashfix.")]:
            del sys.modules[name]
    if str(REPO) not in sys.path[:1]:
        sys.path.insert(0, str(REPO))
    import flashfix as package

    assert _ours(package), "flashfix imported from %s, not from %s" % (package.__file__, REPO)
    return package
