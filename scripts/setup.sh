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
echo "trm installed in .venv ($(.venv/bin/trm --version))"
