#!/usr/bin/env bash
# The one test command (README, .ci/run): a fresh venv with everything the tests need, then the whole suite.
# Test assets come from the registry: trl's wheel is installed --no-deps and read as data (its chat templates).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ROLLOUT_GATEWAY_TEST_VENV:-.venv-test}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[test]'
"$VENV/bin/python" -m pip install -q --no-deps 'trl==1.16.0'
exec "$VENV/bin/python" -m pytest -n 2 "$@"
