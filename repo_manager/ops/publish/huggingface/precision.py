"""The precision a Hugging Face service is served in, and how far it may drift from its full-precision reference.

``fp32`` is the exported encoder as it is. ``int8`` is onnxruntime's own dynamic quantization of it
(``quantize_dynamic``: weights of MatMul/Gemm/Attention stored as signed 8-bit integers, one scale per
output channel; activations quantized per call): about a quarter of the weight bytes, and the CPU's integer
instructions where it has them. Each precision is a version of its own of the same service (the tokenizer
and ensemble do not change), so a client sees nothing change but speed and memory.

``fp16`` is not offered: onnxruntime's CPU provider, the runtime trm's backend serves an encoder with on
this kind of node, has no fp16 kernels for most of a transformer's operators, and a version this node
cannot serve is not published here.

Verification of the edge cases (``verify.py``) judges each precision by its own declared criterion
(``CRITERIA``): a quantized encoder cannot meet fp32's cosine 0.999, and a criterion loose enough for it
would hide a broken fp32 export. How far a precision drifts on the user's own texts is the quality gate's
question (``quality.py``, ``--eval-data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from repo_manager.core.errors import InputError

PRECISIONS = ("fp32", "int8")


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
    # measured on all-MiniLM-L6-v2, all-mpnet-base-v2 and the test suite's random checkpoints (docs/huggingface.md):
    # int8's worst edge case stays well inside these; a wrong export (a lost layer, a wrong pooling) does not
    "int8": Criterion(min_cosine=0.95, max_norm_ratio=0.05, score_tolerance=0.1),
}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one trm publishes",
                         hint=f"use one of {', '.join(PRECISIONS)}")
    return precision


def quantize_int8(fp32_model: Path, target: Path) -> str:
    """Write the int8 version of ``fp32_model`` to ``target``; returns how, for the manifest."""
    import onnxruntime  # noqa: PLC0415 - the ONNX runtime only to quantize a model
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415 - as above

    quantize_dynamic(fp32_model, target, per_channel=True, weight_type=QuantType.QInt8)
    return (f"onnxruntime {onnxruntime.__version__} quantize_dynamic (int8 weights, one scale per output channel; "
            "activations quantized per call)")
