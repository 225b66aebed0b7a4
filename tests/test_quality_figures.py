"""The quality gate's figures and verdicts on answers the test constructs: deterministic, no server, no model.

The end-to-end gate (a real checkpoint quantized, served and judged on a file of texts) is in
tests/test_precision.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from repo_manager.core.errors import ConfigError, InputError, UsageError
from repo_manager.ops.publish.huggingface.quality import (
    MIN_ITEMS,
    THRESHOLDS,
    check_thresholds,
    classify_figures,
    embedding_figures,
    judge,
    kendall_tau,
    parse_threshold_options,
    read_eval_data,
    rerank_figures,
)


def _vectors(count: int = 30, width: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, width))


def test_identical_embeddings_agree_fully_and_noise_lowers_cosine_before_retrieval():
    reference = _vectors()
    same = embedding_figures(reference.copy(), reference)
    assert same == {"mean_cosine": 1.0, "p1_cosine": 1.0, "recall_at_10": 1.0}
    scaled = embedding_figures(reference * 3.0, reference)  # a length change is no drift in direction
    assert scaled["mean_cosine"] == pytest.approx(1.0) and scaled["recall_at_10"] == 1.0
    noisy = embedding_figures(reference + np.random.default_rng(1).normal(scale=0.3, size=reference.shape), reference)
    assert 0.9 < noisy["mean_cosine"] < 0.999 and noisy["p1_cosine"] < noisy["mean_cosine"]
    assert noisy["recall_at_10"] < 1.0
    unrelated = embedding_figures(_vectors(seed=2), reference)
    assert unrelated["mean_cosine"] < 0.5 and unrelated["recall_at_10"] < 0.6
    assert judge(unrelated, THRESHOLDS["embedding"]) and not judge(same, THRESHOLDS["embedding"])


def test_kendall_tau_counts_pairs_in_the_same_order():
    scores = np.array([0.9, 0.5, 0.1, -0.3])
    assert kendall_tau(scores, scores * 10) == 1.0
    assert kendall_tau(scores, -scores) == -1.0
    assert kendall_tau(scores, np.array([0.9, 0.1, 0.5, -0.3])) == pytest.approx(4 / 6)  # one swapped pair of six
    # tau-b: a pair tied on one side is no disagreement; it leaves the scale too
    assert kendall_tau(np.array([1.0, 1.0, 0.0]), np.array([2.0, 1.0, 0.0])) == pytest.approx(2 / np.sqrt(6))
    assert kendall_tau(np.array([0.5, 0.5]), np.array([0.7, 0.2])) == 1.0  # nothing ranked: nothing to disagree on


def test_rerank_figures_are_per_query():
    queries = ["q1"] * 4 + ["q2"] * 3 + ["alone"]
    expected = np.array([0.9, 0.5, 0.1, -0.3, 0.2, 0.8, 0.4, 0.7])
    served = expected.copy()
    served[[0, 1]] = served[[1, 0]]  # q1's best passage is now second
    figures = rerank_figures(served, expected, queries)
    assert figures["queries"] == 2  # a query with one passage ranks nothing
    assert figures["top1_agreement"] == 0.5
    assert figures["kendall_tau"] == pytest.approx((4 / 6 + 1.0) / 2, abs=1e-4)
    with pytest.raises(InputError, match="no query with two passages"):
        rerank_figures(served[:1], expected[:1], ["q"])


def test_classify_figures_compare_labels_and_accuracy_where_labels_are_given():
    expected = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    served = expected.copy()
    served[2] = [0.4, 0.6]  # one answer flips
    figures = classify_figures(served, expected, ["neg", "pos", "neg", None], ["neg", "pos"])
    assert figures["label_agreement"] == 0.75
    assert (figures["reference_accuracy"], figures["accuracy"], figures["accuracy_drop"]) == (1.0, 0.6667, 0.3333)
    assert any("accuracy drop" in miss for miss in judge(figures, THRESHOLDS["classify"]))
    assert "accuracy" not in classify_figures(served, expected, [None] * 4, ["neg", "pos"])
    with pytest.raises(InputError, match='the label "POSITIVE", which the classifier does not have'):
        classify_figures(served, expected, ["POSITIVE", None, None, None], ["neg", "pos"])


def test_every_threshold_is_judged_against_its_figure():
    for task, thresholds in THRESHOLDS.items():
        for key, bound in thresholds.items():
            kind, _, name = key.partition("_")
            passing = {name: bound}
            failing = {name: bound - 0.01 if kind == "min" else bound + 0.01}
            assert not judge(passing, THRESHOLDS[task]) and len(judge(failing, THRESHOLDS[task])) == 1, key


@pytest.mark.parametrize("lines, message", [
    (["not json"], "line 1 is not an item of an embedding service"),
    ([json.dumps({"text": 3})], "line 1 is not an item of an embedding service"),
    ([json.dumps(["a list"])], "line 1 is not an item of an embedding service"),
    ([json.dumps({"text": "one"})] * (MIN_ITEMS - 1), f"holds {MIN_ITEMS - 1} items"),
])
def test_eval_data_that_is_not_a_list_of_items_is_one_line_of_error(tmp_path, lines, message):
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=message):
        read_eval_data(path, "embedding")


def test_eval_data_reads_items_per_task_and_records_its_digest(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"query": f"q{i % 3}", "passage": f"passage {i}"} for i in range(MIN_ITEMS)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    data = read_eval_data(path, "rerank")
    assert data.items[0] == ("q0", "passage 0") and len(data.items) == MIN_ITEMS
    assert data.record()["items"] == MIN_ITEMS and len(data.record()["sha256"]) == 64
    with pytest.raises(InputError, match="not a file"):
        read_eval_data(tmp_path / "missing.jsonl", "rerank")


def test_thresholds_are_overridden_by_name_and_bad_ones_are_one_line_of_error():
    chosen = check_thresholds("embedding", {"min_mean_cosine": "0.99", "min_recall_at_10": 0.5}, "--quality-threshold")
    assert chosen == THRESHOLDS["embedding"] | {"min_mean_cosine": 0.99, "min_recall_at_10": 0.5}
    assert check_thresholds("rerank", None, "x") == THRESHOLDS["rerank"] and chosen is not THRESHOLDS["embedding"]
    assert check_thresholds("rerank", {"min_kendall_tau": -0.5}, "x")["min_kendall_tau"] == -0.5  # tau's range
    for bad, message in [({"min_top1_agreement": 0.9}, "min_top1_agreement is not a threshold of an embedding"),
                         ({"min_mean_cosine": "nan"}, "must be a number from -1 to 1, not nan"),
                         ({"min_mean_cosine": float("inf")}, "must be a number from -1 to 1"),
                         ({"min_recall_at_10": 1.5}, "must be a number from 0 to 1, not 1.5"),
                         ({"min_recall_at_10": True}, "must be a number"),
                         ({"min_mean_cosine": "high"}, "not high")]:
        with pytest.raises(UsageError, match=message):
            check_thresholds("embedding", bad, "--quality-threshold")
    with pytest.raises(ConfigError, match="configs/trm.yaml quality.classify: max_accuracy_drop must be"):
        check_thresholds("classify", {"max_accuracy_drop": -0.1}, "configs/trm.yaml quality.classify", ConfigError)
    assert parse_threshold_options(["min_mean_cosine = 0.9"]) == {"min_mean_cosine": "0.9"}
    with pytest.raises(UsageError, match="is not NAME=VALUE"):
        parse_threshold_options(["min_mean_cosine"])
