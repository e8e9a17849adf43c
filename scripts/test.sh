#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine and runs them: a virtual environment
# with flashfix and the test tools, then every real engine release the tests use (each in its
# own environment, resolved as of its release date; a shared uv cache makes repeats fast).
# Exits non-zero on any failure, including "no tests collected".
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || python3 -m pip install -q uv
UV="python3 -m uv"
[ -x .venv/bin/python ] || $UV venv -q --python python3 .venv
$UV pip install -q --python .venv/bin/python -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"
echo "== engine environments (tests/engine_env.py)"
.venv/bin/python tests/engine_env.py
echo "== tests"
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
