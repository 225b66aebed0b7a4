"""Text-service answers for `trm infer`: cosine similarity of embeddings, reranker rankings, classifier labels."""

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


def pair_inputs(query: str, texts: list[str]) -> dict[str, np.ndarray]:
    """A reranker's request: the query repeated beside each passage (one batch item per pair)."""
    def column(values: list[str]) -> np.ndarray:
        return np.array([v.encode() for v in values], dtype=np.object_).reshape(len(values), 1)

    return {"QUERY": column([query] * len(texts)), "TEXT": column(texts)}


def takes_pairs(config) -> bool:
    """A reranker ensemble: QUERY and TEXT string inputs."""
    return sorted(t.name for t in config.input) == ["QUERY", "TEXT"]


def ranked(scores: np.ndarray, texts: list[str]) -> list[dict[str, object]]:
    """Passages by score, highest first (the first score column when there are several)."""
    column = np.asarray(scores, dtype=np.float64).reshape(len(texts), -1)[:, 0]
    order = np.argsort(-column, kind="stable")
    return [{"index": int(i), "score": round(float(column[i]), 6), "text": texts[i]} for i in order]


def labelled(scores: np.ndarray, labels: list[str], texts: list[str]) -> list[dict[str, object]]:
    """Per text: the top label and every label's score."""
    rows = np.asarray(scores, dtype=np.float64).reshape(len(texts), -1)
    names = labels if len(labels) == rows.shape[1] else [f"LABEL_{i}" for i in range(rows.shape[1])]
    return [{"text": text, "label": names[int(np.argmax(row))],
             "scores": {name: round(float(v), 6) for name, v in zip(names, row)}} for text, row in zip(texts, rows)]
