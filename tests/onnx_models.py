"""Small ONNX models generated for the tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="trm-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def linear(path: Path, in_features: int = 4, out_features: int = 3, batch: str | int = "batch",
           seed: int = 0, scale: float = 1.0) -> Path:
    """Y = X @ W + B, FP32; ``batch`` symbolic (dynamic batch axis) or an int (static)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((in_features, out_features)) * scale).astype(np.float32)
    b = rng.standard_normal(out_features).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["XW"]), helper.make_node("Add", ["XW", "B"], ["Y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, in_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, out_features])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    return _save(graph, path)


def multi_io(path: Path) -> Path:
    """Two inputs (FP32 [batch, seq], INT64 [batch, seq]) and three outputs, one FP16, one INT64."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["IDS"], ["IDS_F"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["VALUES", "IDS_F"], ["PRODUCT"]),
         helper.make_node("Cast", ["PRODUCT"], ["PRODUCT_HALF"], to=TensorProto.FLOAT16),
         helper.make_node("Add", ["IDS", "ONE"], ["IDS_PLUS_ONE"]),
         helper.make_node("ReduceSum", ["VALUES", "AXES"], ["TOTAL"], keepdims=1)],
        "multi_io",
        [helper.make_tensor_value_info("VALUES", TensorProto.FLOAT, ["batch", "seq"]),
         helper.make_tensor_value_info("IDS", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("PRODUCT_HALF", TensorProto.FLOAT16, ["batch", "seq"]),
         helper.make_tensor_value_info("IDS_PLUS_ONE", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("TOTAL", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(np.array(1, dtype=np.int64), "ONE"),
         numpy_helper.from_array(np.array([1], dtype=np.int64), "AXES")])
    return _save(graph, path)


def static_fp16(path: Path) -> Path:
    """No batch axis: FP16 [2, 3] -> FP16 [2, 3] (Relu)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["Y"])], "static_fp16",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT16, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [2, 3])])
    return _save(graph, path)


def external_data(path: Path, location: str = "weights.bin") -> Path:
    """``linear`` with its initializers in a separate file ``location`` (relative to the model)."""
    model = onnx.load(str(linear(path, in_features=32, out_features=16)))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    if location != "weights.bin":  # onnx refuses to write a hostile location itself: edit the reference
        model = onnx.load(str(path), load_external_data=False)
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(model, str(path))
    return path


def custom_operator(path: Path, domain: str = "com.example.trm", op_type: str = "Frobnicate") -> Path:
    """A valid ONNX graph whose one node is an operator in a custom domain onnxruntime does not know."""
    graph = helper.make_graph(
        [helper.make_node(op_type, ["X"], ["Y"], domain=domain)], "custom",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)],
                              producer_name="trm-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
