#!/usr/bin/env bash
# The README's first command: set up trm and run its main job end to end on the embedded defaults:
# publish a model into model_repository/ (verified on a real Triton), serve it, answer a request.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -n "${serve_pid:-}" ] && kill "$serve_pid" 2>/dev/null; wait 2>/dev/null || true' EXIT
python - "$work/linear.onnx" <<'PY'
import sys
import numpy as np
from onnx import TensorProto, helper, numpy_helper, save
w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "W")
graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "linear",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3])], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
save(model, sys.argv[1])
PY
trm publish model "$work/linear.onnx" --name linear
trm list
python -c "import numpy as np; np.save('$work/x.npy', np.ones((2, 4), np.float32))"
trm infer linear --input "X=$work/x.npy"
