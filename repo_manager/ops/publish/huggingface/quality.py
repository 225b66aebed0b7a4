"""The quality gate: how far a version drifts from its full-precision reference on the user's own data.

``trm publish model CKPT --precision int8 --eval-data FILE`` runs every item of FILE through the staged
encoder (onnxruntime, the runtime trm's backend serves it with, fed by the tokenizer the version ships)
and through the reference library (the fp32 checkpoint as its own library runs it), and refuses the
version (exit 5, nothing written) when the drift passes the declared thresholds (``THRESHOLDS``). The
figures, the thresholds and the file's digest go into the manifest, so the evidence travels with the
version (``trm show``).

FILE is JSON lines, one item per line, by task:

* embeddings: ``{"text": "..."}``: cosine of served and reference vectors (mean and 1st percentile), and
  **retrieval agreement**: each text in turn is a query against all the others, and recall@10 is the share
  of the reference's ten nearest that the served vectors also put in their ten nearest (averaged);
* rerankers: ``{"query": "...", "passage": "..."}``: items that share a query are one ranking; **top-1
  agreement** (the same best passage) and **Kendall's tau** of the two rankings (averaged over queries);
* classifiers: ``{"text": "...", "label": "..."}`` (the label optional): **label agreement** (the same
  argmax), and where labels are given the accuracy of both and its drop.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.core.errors import CompatibilityError, InputError, TrmError, UsageError, VerificationError

MIN_ITEMS = 20
"""Fewer items say nothing about a distribution (and recall@10 needs more than ten texts)."""
MAX_ITEMS = 10_000
BATCH = 16
RECALL_AT = 10

THRESHOLDS: dict[str, dict[str, float]] = {
    # a floor each figure must reach (``min_*``) or a ceiling it must stay under (``max_*``)
    "embedding": {"min_mean_cosine": 0.98, "min_p1_cosine": 0.9, "min_recall_at_10": 0.8},
    "rerank": {"min_top1_agreement": 0.8, "min_kendall_tau": 0.7},
    "classify": {"min_label_agreement": 0.95, "max_accuracy_drop": 0.02},
}
RANGES = {"mean_cosine": (-1.0, 1.0), "p1_cosine": (-1.0, 1.0), "recall_at_10": (0.0, 1.0),
          "top1_agreement": (0.0, 1.0), "kendall_tau": (-1.0, 1.0), "label_agreement": (0.0, 1.0),
          "accuracy_drop": (0.0, 1.0)}
"""The values a threshold may take: its figure's range."""
FIELDS = {"embedding": ("text",), "rerank": ("query", "passage"), "classify": ("text",)}
SERVICES = {"embedding": "an embedding service", "rerank": "a reranker", "classify": "a classifier"}


@dataclass(frozen=True)
class EvalData:
    path: Path
    sha256: str
    items: list[Any]
    """Texts (embedding, classify) or (query, passage) pairs (rerank)."""
    labels: list[str | None]

    def record(self) -> dict[str, Any]:
        return {"file": self.path.name, "sha256": self.sha256, "items": len(self.items)}


def read_eval_data(path: str | Path, task: str, option: str = "--eval-data") -> EvalData:
    """The items of a JSON-lines file for ``task``; a one-line InputError naming the line for anything else
    (and ``option``, the flag or setting the file came from)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{option} {path} is not a file", hint="give a JSON-lines file, one item per line")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{option} {path} cannot be read: {exc.strerror or type(exc).__name__}",
                         hint="give a readable JSON-lines file") from exc
    items: list[Any] = []
    labels: list[str | None] = []
    fields = FIELDS[task]
    example = json.dumps({f: "..." for f in fields} | ({"label": "..."} if task == "classify" else {}))
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if not isinstance(item, dict) or not all(isinstance(item.get(f), str) for f in fields) \
                or not isinstance(item.get("label", ""), str):
            raise InputError(f"{option} {path.name} line {number} is not an item of {SERVICES[task]}",
                             hint=f"each line a JSON object like {example}")
        items.append(tuple(item[f] for f in fields) if len(fields) > 1 else item[fields[0]])
        labels.append(item.get("label"))
        if len(items) > MAX_ITEMS:
            raise InputError(f"{option} {path.name} holds more than {MAX_ITEMS} items",
                             hint="a sample of your traffic is enough")
    if len(items) < MIN_ITEMS:
        raise InputError(f"{option} {path.name} holds {len(items)} items; the quality gate needs at least "
                         f"{MIN_ITEMS}", hint="add texts from your own traffic")
    return EvalData(path, hashlib.sha256(raw).hexdigest(), items, labels)


def served_outputs(onnx_path: Path, loaded, items: list[Any]) -> np.ndarray:
    """The staged encoder's answers for ``items``, in batches, as the backend computes them."""
    import onnxruntime  # noqa: PLC0415 - the ONNX runtime only to run a model

    try:
        session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - any refusal of the runtime is the node's, said in its words
        said = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise CompatibilityError(f"this node's onnxruntime {onnxruntime.__version__} cannot run the staged encoder: "
                                 f"{said}", hint="publish it in fp32 or int8") from exc
    names = {i.name for i in session.get_inputs()}
    out = [session.run(None, {k: v for k, v in loaded.encode(items[i:i + BATCH]).items() if k in names})[0]
           for i in range(0, len(items), BATCH)]
    return np.concatenate(out).astype(np.float64)


def reference_outputs(reference, items: list[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(reference(items[i:i + BATCH])) for i in range(0, len(items), BATCH)]) \
        .astype(np.float64)


def drift_figures(task: str, served: np.ndarray, expected: np.ndarray, data: EvalData,
            label_names: list[str] | None = None) -> dict[str, float]:
    """The figures of ``THRESHOLDS[task]`` for served against expected answers (one row per item)."""
    if task == "embedding":
        return embedding_figures(served, expected)
    if task == "rerank":
        return rerank_figures(served.reshape(-1), expected.reshape(-1), [q for q, _ in data.items])
    return classify_figures(served, expected, data.labels, label_names or [])


def _unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def embedding_figures(served: np.ndarray, expected: np.ndarray) -> dict[str, float]:
    a, b = _unit(served), _unit(expected)
    cosine = (a * b).sum(axis=1)
    k = min(RECALL_AT, len(a) - 1)

    def nearest(unit: np.ndarray) -> np.ndarray:
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)  # a text is not its own neighbour
        return np.argsort(-similarity, axis=1, kind="stable")[:, :k]

    ours, theirs = nearest(a), nearest(b)
    recall = np.mean([len(set(ours[i]) & set(theirs[i])) / k for i in range(len(a))])
    return {"mean_cosine": round(float(cosine.mean()), 6), "p1_cosine": round(float(np.percentile(cosine, 1)), 6),
            "recall_at_10": round(float(recall), 4)}


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of two score vectors: 1 for the same order, -1 for the reverse; a pair tied in either
    is left out of the agreement and the scale (two equal passages have no order to keep). 1.0 when either
    side ranks nothing (every score tied)."""
    n = len(x)
    if n < 2:
        return 1.0
    i, j = np.triu_indices(n, 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    scale = np.sqrt(float(np.count_nonzero(dx)) * float(np.count_nonzero(dy)))
    return float((dx * dy).sum() / scale) if scale else 1.0


def rerank_figures(served: np.ndarray, expected: np.ndarray, queries: list[str]) -> dict[str, float]:
    groups: dict[str, list[int]] = {}
    for index, query in enumerate(queries):
        groups.setdefault(query, []).append(index)
    ranked = [rows for rows in groups.values() if len(rows) > 1]
    if not ranked:
        raise InputError("the eval data has no query with two passages or more: nothing to rank",
                         hint="give several passages per query")
    top1 = [int(np.argmax(served[r]) == np.argmax(expected[r])) for r in ranked]
    tau = [kendall_tau(served[r], expected[r]) for r in ranked]
    return {"queries": len(ranked), "top1_agreement": round(float(np.mean(top1)), 4),
            "kendall_tau": round(float(np.mean(tau)), 4)}


def classify_figures(served: np.ndarray, expected: np.ndarray, labels: list[str | None],
                     label_names: list[str]) -> dict[str, float]:
    ours, theirs = np.argmax(served, axis=1), np.argmax(expected, axis=1)
    figures = {"label_agreement": round(float(np.mean(ours == theirs)), 4)}
    known = [(i, label) for i, label in enumerate(labels) if label is not None]
    unknown = next((label for _, label in known if label_names and label not in label_names), None)
    if unknown is not None:
        raise InputError(f'the eval data has the label "{unknown}", which the classifier does not have',
                         hint="its labels: " + ", ".join(label_names[:10]))
    if known and label_names:
        truth = np.array([label_names.index(label) for _, label in known])
        rows = np.array([i for i, _ in known])
        accuracy, reference = float(np.mean(ours[rows] == truth)), float(np.mean(theirs[rows] == truth))
        figures.update(accuracy=round(accuracy, 4), reference_accuracy=round(reference, 4),
                       accuracy_drop=round(reference - accuracy, 4))
    return figures


def check_thresholds(task: str, overrides: Mapping[str, Any] | None, origin: str,
                     error: type[TrmError] = UsageError) -> dict[str, float]:
    """``THRESHOLDS[task]`` with ``overrides`` (a name of that task's thresholds to a number in the figure's
    range) applied; ``error`` (naming ``origin``) for an unknown name or a value that is not a finite number
    in range."""
    chosen = dict(THRESHOLDS[task])
    for key, value in (overrides or {}).items():
        if key not in chosen:
            raise error(f"{origin}: {key} is not a threshold of {SERVICES[task]}",
                        hint=f"its thresholds: {', '.join(chosen)}")
        low, high = RANGES[key.partition("_")[2]]
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not math.isfinite(number) or not low <= number <= high:
            raise error(f"{origin}: {key} must be a number from {low:g} to {high:g}, not {str(value)[:40]}",
                        hint=f"the default is {THRESHOLDS[task][key]:g}")
        chosen[key] = float(number)
    return chosen


def parse_threshold_options(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--quality-threshold NAME=VALUE`` options as a mapping; UsageError for one without ``=``."""
    parsed = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--quality-threshold {pair[:60]} is not NAME=VALUE",
                             hint="e.g. --quality-threshold min_mean_cosine=0.99")
        parsed[name.strip()] = value.strip()
    return parsed


def judge(figures: dict[str, float], thresholds: Mapping[str, float]) -> list[str]:
    """What misses its threshold, one phrase each (empty: the gate passes)."""
    misses = []
    for key, bound in thresholds.items():
        kind, _, name = key.partition("_")
        if name not in figures:
            continue  # accuracy without labels
        value = figures[name]
        if (kind == "min" and not value >= bound) or (kind == "max" and not value <= bound):
            misses.append(f"{name.replace('_', ' ')} {value:g} ({'needs at least' if kind == 'min' else 'at most'} "
                          f"{bound:g})")
    return misses


def assess(task: str, onnx_path: Path, loaded, expected: np.ndarray, data: EvalData,
           thresholds: Mapping[str, float], label_names: list[str] | None = None) -> tuple[dict[str, float], list[str]]:
    """The staged encoder's figures against the reference's answers ``expected``, and what misses."""
    figures = drift_figures(task, served_outputs(onnx_path, loaded, data.items), expected, data, label_names)
    return figures, judge(figures, thresholds)


def refusal(precision: str, data: EvalData, misses: list[str]) -> VerificationError:
    return VerificationError(f"quality gate: the {precision} version drifts from its fp32 reference on "
                             f"{data.path.name}: " + "; ".join(misses),
                             hint="publish it in a higher precision, lower a threshold, or check the eval data is "
                                  "your traffic")
