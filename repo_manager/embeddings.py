"""Embedding answers: cosine similarity between the texts of one request (used by `trm infer`)."""

from __future__ import annotations

import numpy as np


def cosine_matrix(embeddings: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of the rows of a [n, d] array (rows need not be normalised)."""
    rows = np.asarray(embeddings, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    unit = rows / norms
    return unit @ unit.T


def text_similarities(outputs: dict[str, np.ndarray], count: int) -> dict[str, list[list[float]]]:
    """For every output that is one float vector per text ([count, d]), the texts' cosine matrix.

    Empty when there are fewer than two texts or no such output (a tensor model, a classifier's labels).
    """
    if count < 2:
        return {}
    return {name: [[round(float(x), 6) for x in row] for row in cosine_matrix(value)]
            for name, value in outputs.items()
            if value.dtype.kind == "f" and value.ndim == 2 and value.shape[0] == count}
