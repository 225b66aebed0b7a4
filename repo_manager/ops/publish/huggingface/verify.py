"""Verification of a Hugging Face service against its reference library: the cases sent and how each
answer is judged.

Verification sends the same texts through the ensemble on Triton and through the library the checkpoint
came from (``reference``): a sentence, an empty string, a text longer than the max length, non-ASCII
text, emoji, and a mixed-length batch of all. Embeddings must agree in cosine *and* vector length (cosine
alone cannot see a missing or extra normalisation), scores within a tolerance, each by the criterion of the
version's precision (``precision.CRITERIA``: fp32 cosine >= 0.999, length and scores within 1e-3). The
per-case results, the criterion and the reference library and version go into every manifest.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from repo_manager.core.errors import VerificationError
from repo_manager.ops.publish.huggingface import OUTPUTS, QUERY_INPUT, TEXT_INPUT
from repo_manager.ops.publish.huggingface.load import QUERY, LoadedCheckpoint
from repo_manager.ops.publish.huggingface.precision import CRITERIA

MIN_COSINE = CRITERIA["fp32"].min_cosine
LONG_FILLER = "the quick brown fox jumps over the lazy dog while a small band plays in the park "
CASE_TEXTS = (("sentence", "A man is eating a piece of bread."), ("empty", ""),
              ("non_ascii", "Zürich ist schön — 東京は大きい, naïve café"),
              ("emoji", "great news 🎉🚀 ☕ 👍🏽"))


def verification_cases(loaded: LoadedCheckpoint) -> list[tuple[str, list[Any]]]:
    """(case, items) sent as one request each: the edge cases, then all of them as one mixed batch."""
    long_text = LONG_FILLER
    while loaded.token_count(long_text) <= loaded.checkpoint.max_length + 16:
        long_text += LONG_FILLER
    long_text += "but this ending about quantum chemistry is cut off by truncation"
    single = [*CASE_TEXTS[:2], ("long", long_text), *CASE_TEXTS[2:]]
    single.append(("short", "short"))
    rerank = loaded.pipeline.task == "rerank"
    items = [(case, (QUERY, text) if rerank else text) for case, text in single]
    cases = [(case, [item]) for case, item in items[:-1]]
    cases.append(("mixed_batch", [item for _, item in items]))
    return cases


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def criterion(task: str, precision: str = "fp32") -> str:
    limits = CRITERIA[precision]
    if task == "embedding":
        return (f"{precision}: cosine >= {limits.min_cosine} and |length ratio - 1| <= {limits.max_norm_ratio} "
                "for every text")
    return f"{precision}: |served - reference| <= {limits.score_tolerance} * max(1, |reference|) for every score"


def _strings(array: np.ndarray) -> list[str]:
    return [t.decode() if isinstance(t, bytes) else str(t) for t in array.reshape(-1)]


def from_sample(sample: dict[str, np.ndarray], task: str) -> list[Any]:
    texts = _strings(sample[TEXT_INPUT])
    return list(zip(_strings(sample[QUERY_INPUT]), texts)) if task == "rerank" else texts


def to_sample(items: list[Any], task: str) -> dict[str, np.ndarray]:
    def column(values: list[str]) -> np.ndarray:
        return np.array([[v.encode()] for v in values], dtype=np.object_)

    if task == "rerank":
        return {QUERY_INPUT: column([q for q, _ in items]), TEXT_INPUT: column([p for _, p in items])}
    return {TEXT_INPUT: column(items)}


def checker(cases: list[tuple[str, list[Any]]], loaded: LoadedCheckpoint, precision: str = "fp32"):
    """Judge each answer per text by ``precision``'s criterion: embeddings by cosine and length, scores by
    difference; the record names the case. A failure is a parity refusal naming the architecture."""
    task = loaded.pipeline.task
    limits = CRITERIA[precision]
    by_items = {tuple(items): case for case, items in cases}
    output = OUTPUTS[task]
    architecture = loaded.checkpoint.architecture

    def refuse(case: str, message: str) -> VerificationError:
        return VerificationError(f"parity: {architecture}: case {case}: {message}", case=case)

    def check(sample, answer, expected) -> dict[str, Any]:
        items = from_sample(sample, task)
        case = by_items.get(tuple(items), "sample")
        got, want = answer.get(output), expected[output]
        if got is None or got.shape != want.shape:
            raise refuse(case, f"Triton returned shape {None if got is None else list(got.shape)}, "
                               f"the reference library {list(want.shape)}")
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        texts = [p for _, p in items] if task == "rerank" else items
        record: dict[str, Any] = {"case": case, "texts": len(items),
                                  "max_abs_diff": float(np.max(np.abs(got64 - want64))),
                                  "tokens": [loaded.token_count(t) for t in texts],
                                  "max_length": loaded.checkpoint.max_length}
        if task == "embedding":
            cosine = _cosine(got64, want64)
            lengths_got, lengths_want = np.linalg.norm(got64, axis=1), np.linalg.norm(want64, axis=1)
            ratio = np.abs(lengths_got / np.maximum(lengths_want, 1e-12) - 1.0)
            worst, worst_ratio = float(np.min(cosine)), float(np.max(ratio))
            if not worst >= limits.min_cosine:
                raise refuse(case, f"cosine similarity with the reference library is {worst:.6f} "
                                   f"(needs >= {limits.min_cosine} in {precision})")
            if not worst_ratio <= limits.max_norm_ratio:
                row = int(np.argmax(ratio))
                raise refuse(case, f"vector length {lengths_got[row]:.6g} where the reference library has "
                                   f"{lengths_want[row]:.6g} (needs within {limits.max_norm_ratio:.1%} in {precision})")
            record.update(min_cosine=round(worst, 7), max_length_ratio_diff=round(worst_ratio, 9))
        else:
            error = np.abs(got64 - want64) / np.maximum(1.0, np.abs(want64))
            if not float(np.max(error)) <= limits.score_tolerance:
                raise refuse(case, f"score {float(got64.ravel()[np.argmax(error)]):.6g} where the reference "
                                   f"library has {float(want64.ravel()[np.argmax(error)]):.6g}")
            record["max_score_error"] = float(np.max(error))
            if task == "classify":
                record["labels"] = [loaded.pipeline.labels[i] for i in np.argmax(got64, axis=1)]
        return record

    return check
