#!/usr/bin/env bash
# The whole suite, as CI runs it: tests that measure time (marked `serial` in
# tests/conftest.py) one at a time; every other test two at a time (pytest-xdist, one module per worker, the modules
# with vLLM engines together on one).
# The longest modules start first (tests/conftest.py, LONGEST_FIRST).
# `pytest -q` alone runs the same tests one after the other; `pytest -m fast` the ones that start no server.
# Each pass lists its 30 slowest tests and a reason per failure, and keeps a JUnit XML report in test-results/;
# a failed test that used a tritonserver shows the end of that server's log. The whole CI run aims at 25 minutes.
#
# A pass whose every failure came with a crash of Triton (a server the test used died, SIGSEGV and the like, or
# logged a fatal signal and hung; the kernel killed a Python stub during the test; the failure's report holds
# the server's last log lines and the kernel's lines) runs those tests once more, one at a time, and prints
# which ones. Any other failure fails the run as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
failures=$(mktemp)
trap 'rm -f "$failures"' EXIT
export TEST_FAILURES_FILE="$failures"

run_pass() {
    : > "$failures"
    local code=0
    .venv/bin/python -m pytest "$@" || code=$?
    if [ "$code" -eq 1 ] && [ -s "$failures" ] && ! grep -qv '^crash ' "$failures"; then
        # in the order they ran, each once: a module's tests can depend on its order (test_vllm.py's SIGKILL
        # test kills the module's served server, so a test that uses that server must run before it)
        mapfile -t crashed < <(sed 's/^crash //' "$failures" | awk '!seen[$0]++')
        echo "scripts/test.sh: ${#crashed[@]} test(s) failed where a Triton process had crashed (reports above); running them once more:"
        printf '  %s\n' "${crashed[@]}"
        code=0
        .venv/bin/python -m pytest -q "${crashed[@]}" || code=$?
    fi
    return "$code"
}

# each pass: a line per failure or error with its reason (-rfE), its 30 slowest tests, a JUnit XML report
mkdir -p test-results
run_pass -q -rfE -m "not serial" -n 2 --dist loadfile --no-loadscope-reorder --durations=30 \
    --junitxml=test-results/two-at-a-time.xml "$@" || status=$?
run_pass -q -rfE -m serial --durations=30 --junitxml=test-results/one-at-a-time.xml "$@" || status=$?
exit "$status"
