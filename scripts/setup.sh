#!/usr/bin/env bash
# Create .venv and install trm with the test and torch extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build (a looser range pulls a multi-GB CUDA build).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[torch,test]"
# Prometheus (server + promtool) for the alert-rule tests (tests/test_observe.py): Debian's package, as root.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
            || echo "warning: could not install prometheus; tests/test_observe.py will skip its Prometheus tests" >&2
    else
        echo "note: install Debian's prometheus package (root) for tests/test_observe.py" >&2
    fi
fi
echo "trm installed in .venv ($(.venv/bin/trm --version))"
