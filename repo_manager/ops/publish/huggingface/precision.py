"""The precision a Hugging Face service is served in, and how far it may drift from its full-precision reference.

``fp32`` is the exported encoder as it is. ``fp16`` is the same module exported in half precision (weights and
arithmetic), its answers cast back to fp32 so that the service's interface does not change: half the bytes.
``int8`` is onnxruntime's own dynamic quantization of the fp32 encoder (``quantize_dynamic``: weights stored as
signed 8-bit integers, activations quantized per call): about a quarter of the weight bytes, and the CPU's
integer instructions where it has them. Each precision is a version of its own of the same service (the
tokenizer and ensemble do not change), so a client sees nothing change but speed and memory.

Which precisions this node serves is measured, not assumed (``served_here``): a small graph of a
transformer's operators in fp16 is run on onnxruntime's CPU provider, the runtime trm's backend serves an
encoder with; a node whose runtime has no fp16 kernels is told so before any work (exit 11, naming what it
serves).

int8 is tried in ``INT8_RECIPES`` order when the quality gate has the user's data: one scale per output
channel, then 7-bit weights, then MatMul only; the first recipe whose version passes is kept, and the record
lists every recipe tried with its figures. On a CPU without VNNI instructions 8-bit weights can saturate an
intermediate sum (onnxruntime's documentation: "reduce_range ... may improve the accuracy ... on non-VNNI
machine"), hence the 7-bit recipes; MatMul-only leaves the embedding tables (Gather) and the other operators
onnxruntime's dynamic quantization covers in fp32. Without ``--eval-data`` nothing can judge a recipe on the
user's texts: ``UNJUDGED_RECIPE`` is used and judged by the edge cases.

Verification of the edge cases (``verify.py``) judges each precision by its own declared criterion
(``CRITERIA``): a quantized encoder cannot meet fp32's cosine 0.999, and a criterion loose enough for it
would hide a broken fp32 export. How far a precision drifts on the user's own texts is the quality gate's
question (``quality.py``, ``--eval-data``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from repo_manager.core.errors import CompatibilityError, InputError

PRECISIONS = ("fp32", "fp16", "int8")
BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2, "int8": 1}


@dataclass(frozen=True)
class Criterion:
    """How close a served answer must be to the reference library, per text."""

    min_cosine: float
    """Embeddings: the cosine of served and reference vectors, at least."""
    max_norm_ratio: float
    """Embeddings: |len(served) / len(reference) - 1|, at most."""
    score_tolerance: float
    """Scores: |served - reference| / max(1, |reference|), at most."""


CRITERIA = {
    "fp32": Criterion(min_cosine=0.999, max_norm_ratio=1e-3, score_tolerance=1e-3),
    # fp16 keeps 11 bits of mantissa: MiniLM's edge cases stay above cosine 0.9999 (docs/huggingface.md); the
    # length and scores get fp16's own rounding
    "fp16": Criterion(min_cosine=0.999, max_norm_ratio=5e-3, score_tolerance=1e-2),
    # measured on all-MiniLM-L6-v2, all-mpnet-base-v2 and the test suite's random checkpoints (docs/huggingface.md):
    # int8's worst edge case stays well inside these; a wrong export (a lost layer, a wrong pooling) does not
    "int8": Criterion(min_cosine=0.95, max_norm_ratio=0.05, score_tolerance=0.1),
}


@dataclass(frozen=True)
class Recipe:
    """One way of quantizing the encoder to int8 (``quantize_dynamic``'s settings)."""

    name: str
    per_channel: bool = True
    """One scale per output channel of a weight (else one per tensor)."""
    reduce_range: bool = False
    op_types: tuple[str, ...] | None = None
    """Operator types to quantize; None: onnxruntime's dynamic set (MatMul, Gather, Attention, Conv, ...)."""

    def describe(self, version: str) -> str:
        return (f"onnxruntime {version} quantize_dynamic ({self.name}: int8 weights, one scale per "
                f"{'output channel' if self.per_channel else 'tensor'}"
                f"{', 7-bit range' if self.reduce_range else ''}"
                f"{', ' + '/'.join(self.op_types) + ' only' if self.op_types else ''}; activations quantized per call)")


INT8_RECIPES = (
    Recipe("per-channel"),
    Recipe("per-channel, 7-bit", reduce_range=True),
    Recipe("per-channel, 7-bit, MatMul only", reduce_range=True, op_types=("MatMul",)),
)


UNJUDGED_RECIPE = INT8_RECIPES[0]
"""The recipe used without the user's data (and the first tried with it). onnxruntime's default, one scale per
weight tensor, is not tried at all: it drifted to a mean cosine of 0.958 on MiniLM over a licence's paragraphs
(0.964 on the tests' texts) where per-channel kept 0.9925, for the same bytes."""


def check_precision(precision: str) -> str:
    """``precision`` if trm publishes it and this node serves it; else a one-line error naming what it serves."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one trm publishes",
                         hint=f"use one of {', '.join(PRECISIONS)}")
    if precision != "fp16":  # fp32 and int8: every onnxruntime CPU provider runs them
        return precision
    served, why = served_here()
    if precision not in served:
        raise CompatibilityError(f"this node cannot serve an {precision} encoder: {why[precision]}",
                                 hint=f"it serves {', '.join(served)}")
    return precision


@functools.cache
def served_here() -> tuple[tuple[str, ...], dict[str, str]]:
    """The precisions this node's onnxruntime (CPU provider) runs, and why each other one is not."""
    import onnxruntime  # noqa: PLC0415 - the ONNX runtime only to probe it

    why = {}
    try:
        session = onnxruntime.InferenceSession(_fp16_probe(), providers=["CPUExecutionProvider"])
        import numpy as np  # noqa: PLC0415 - numpy with the runtime, for the probe's one call

        session.run(None, {"X": np.ones((2, 8), np.float16)})
    except Exception as exc:  # noqa: BLE001 - any refusal of the runtime means "not here", said in its words
        said = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        why["fp16"] = (f"onnxruntime {onnxruntime.__version__}'s CPU provider has no fp16 kernel for a "
                       f"transformer's operators ({said})")
    return tuple(p for p in PRECISIONS if p not in why), why


def _fp16_probe() -> bytes:
    """A graph of the operators a transformer encoder runs (MatMul, Add, LayerNormalization, Softmax, Erf, Div,
    ReduceMean, Sqrt, Tanh), in fp16."""
    import numpy as np  # noqa: PLC0415 - numpy and onnx only to build the probe
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415 - as above

    half = TensorProto.FLOAT16
    weights = [numpy_helper.from_array(np.full(shape, 0.5, np.float16), name)
               for name, shape in (("W", (8, 8)), ("B", (8,)), ("G", (8,)), ("two", ()))]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "G", "B"], ["n"], axis=-1),
             helper.make_node("Softmax", ["n"], ["s"], axis=-1), helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Div", ["e", "two"], ["d"]), helper.make_node("Tanh", ["d"], ["t"]),
             helper.make_node("ReduceMean", ["t"], ["r"], axes=[1], keepdims=1), helper.make_node("Sqrt", ["r"], ["Y"])]
    graph = helper.make_graph(nodes, "fp16-probe", [helper.make_tensor_value_info("X", half, [2, 8])],
                              [helper.make_tensor_value_info("Y", half, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def quantize_int8(fp32_model: Path, target: Path, recipe: Recipe = UNJUDGED_RECIPE) -> str:
    """Write the int8 version of ``fp32_model`` to ``target`` by ``recipe``; returns how, for the manifest."""
    import onnxruntime  # noqa: PLC0415 - the ONNX runtime only to quantize a model
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415 - as above

    with _quiet_quantizer():
        quantize_dynamic(fp32_model, target, per_channel=recipe.per_channel, reduce_range=recipe.reduce_range,
                         weight_type=QuantType.QInt8, op_types_to_quantize=list(recipe.op_types or ()) or None)
    return recipe.describe(onnxruntime.__version__)


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Drop the quantizer's advice to pre-process the model (a ``logging.warning`` on the root logger at every
    call, not the user's business) and nothing else: a filter on the root logger for records from
    onnxruntime's quantization package, and a handler while none is set so that the warning does not install
    ``basicConfig``'s for the rest of the process."""
    root = logging.getLogger()

    def not_from_quantizer(record: logging.LogRecord) -> bool:
        return "onnxruntime" not in record.pathname or "quantization" not in record.pathname

    placeholder = logging.NullHandler() if not root.handlers else None
    root.addFilter(not_from_quantizer)
    if placeholder:
        root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeFilter(not_from_quantizer)
        if placeholder:
            root.removeHandler(placeholder)
