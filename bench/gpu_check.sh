#!/usr/bin/env bash
# GPU check for the LLM code, for a machine with an NVIDIA GPU (e.g. an H200), no internet needed.
#   bash bench/gpu_check.sh            (from anywhere; results also go to $OUT, default /tmp/trm-gpu-check)
# 1. what the node probe sees (NVML through ctypes, else nvidia-smi) and `trm doctor --json`;
# 2. the gpu-marked test (build + publish + serve a tiny engine) when tensorrt_llm is importable;
# 3. the CPU tests of the planner and doctor, which must pass anywhere.
# Never fails early: each step prints its own exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python /work/main/.venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
  done
fi
OUT=${OUT:-/tmp/trm-gpu-check}
mkdir -p "$OUT"
echo "== python: $PY"

echo "== nvidia-smi"
nvidia-smi 2>&1 | head -20 | tee "$OUT/nvidia-smi.txt"

echo "== trm doctor --json (no repository: node checks only)"
timeout 120 "$PY" -m repo_manager doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
echo "doctor exit status: $? (0: node ok, 11: a mismatch, named in the findings)"
cat "$OUT/doctor.json" "$OUT/doctor.err"

echo "== gpu-marked tests"
if timeout 120 "$PY" -c "import tensorrt_llm; print('tensorrt_llm', tensorrt_llm.__version__)" 2>"$OUT/trtllm-import.err"; then
  timeout 480 "$PY" -m pytest -q -rs -m gpu tests/ 2>&1 | tee "$OUT/gpu-tests.txt"
  echo "gpu tests exit status: ${PIPESTATUS[0]}"
else
  echo "tensorrt_llm is not importable here ($(tail -1 "$OUT/trtllm-import.err")): gpu-marked tests not run" \
    | tee "$OUT/gpu-tests.txt"
fi

echo "== CPU tests of the planner and doctor"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_llm_plan.py tests/test_doctor.py 2>&1 | tail -5 \
  | tee "$OUT/cpu-tests.txt"
echo "results in $OUT"
