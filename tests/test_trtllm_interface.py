"""The generated TensorRT-LLM layout speaks upstream's request interface (tensorrtllm_backend v0.19.0).

The reference is a copy of upstream's config.pbtxt files (tests/data/llm/tensorrtllm_backend-v0.19.0/,
source and commit named in each): the ensemble's 34 inputs, its outputs and its wiring, and the
tensors of the member models, compared field by field (name, data type, dims, optional, ragged batch,
scalar reshape). Then a real tritonserver serves the published repository, with the engine model
replaced by a Python stand-in (the TensorRT-LLM backend needs a GPU) that keeps the generated engine
config and records every input it receives: an upstream-style client request must arrive at the
engine routed exactly as upstream's ensemble routes it, through the ensemble and through the BLS model.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import llm_fixtures as fx
import numpy as np
import pytest

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, ServerError
from repo_manager.core.settings import Settings
from repo_manager.ops.llm import trtllm_interface as io
from repo_manager.ops.llm.node import NodeFacts
from repo_manager.ops.llm.triton_models import common as route
from repo_manager.ops.llm.trtllm_interface import ensemble_request
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions

UPSTREAM = Path(__file__).parent / "data" / "llm" / "tensorrtllm_backend-v0.19.0"
FINGERPRINT = {"compute_capability": "9.0", "gpu_name": "NVIDIA H200", "tensorrt_llm_version": "0.19.0",
               "tensorrt_version": "10.9.0", "cuda_version": "12.8"}
# not generated, on purpose (trtllm_interface's docstring): multimodal and speculative-decoding tensors
MULTIMODAL_IN = {"IMAGE_BYTES", "IMAGE_URL", "VIDEO_BYTES", "image_input", "image_bytes_input", "image_url_input",
                 "video_bytes_input", "num_draft_tokens", "use_draft_logits"}
MULTIMODAL_OUT = {"PIXEL_VALUES", "ASPECT_RATIO_IDS", "ASPECT_RATIO_MASK", "CROSS_ATTENTION_MASK", "IMAGE_SIZES",
                  "IS_VIDEO_INPUT", "ATTENTION_MASK", "IMAGE_GRID_THW", "VISION_INPUT_ID"}


def _upstream(model: str, logits: str = "TYPE_FP32") -> cfg.ModelConfig:
    text = (UPSTREAM / f"{model}.pbtxt").read_text()
    for key, value in {"triton_max_batch_size": "16", "logits_datatype": logits, "triton_backend": "tensorrtllm",
                       "encoder_input_features_data_type": "TYPE_FP16"}.items():
        text = text.replace("${" + key + "}", value)
    return cfg.parse_config(text, str(UPSTREAM / f"{model}.pbtxt"))


def _fields(tensors, leave_out=frozenset()) -> list[tuple]:
    """Each tensor as (name, type, dims, optional, ragged, scalar), once, in declaration order."""
    rows, seen = [], set()
    for t in tensors:
        if t.name in leave_out or t.name in seen:  # upstream's ensemble declares one output twice
            continue
        seen.add(t.name)
        rows.append((t.name, cfg.dtype_name(t.data_type), list(t.dims), getattr(t, "optional", False),
                     getattr(t, "allow_ragged_batch", False), t.HasField("reshape")))
    return rows


def _publish(root: Path, *, logits_dtype: str = "float32") -> LocalRepository:
    checkpoint = fx.llama_checkpoint(root / "ckpt")
    engine = fx.engine_dir(root / "engine", checkpoint, fingerprint=FINGERPRINT)
    config = json.loads((engine / "config.json").read_text())
    config["pretrained_config"]["logits_dtype"] = logits_dtype
    (engine / "config.json").write_text(json.dumps(config))
    publish_model(Settings(repository=root / "repo"), checkpoint, "llm", fmt="tensorrt-llm",
                  trtllm=TrtllmOptions(engine_dir=engine, gpu_memory_gib=24, bls=True),
                  node=NodeFacts(probe="none (test: a CPU-only node)"))
    return LocalRepository(root / "repo")


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> LocalRepository:
    return _publish(tmp_path_factory.mktemp("trtllm-interface"))


def test_the_ensemble_takes_upstreams_34_inputs_and_returns_its_outputs(published):
    ours, theirs = published.config("llm"), _upstream("ensemble")
    assert _fields(ours.input) == _fields(theirs.input)
    assert len(ours.input) == 34
    assert _fields(ours.output) == _fields(theirs.output)


def test_the_ensemble_routes_every_tensor_as_upstreams(published):
    ours, theirs = published.config("llm"), _upstream("ensemble")
    members = {f"llm_{role}": role for role in ("preprocessing", "tensorrt_llm", "postprocessing")}
    assert [members[s.model_name] for s in ours.ensemble_scheduling.step] == \
        [s.model_name for s in theirs.ensemble_scheduling.step]
    for mine, upstream in zip(ours.ensemble_scheduling.step, theirs.ensemble_scheduling.step, strict=True):
        assert dict(mine.input_map) == dict(upstream.input_map), upstream.model_name
        assert dict(mine.output_map) == dict(upstream.output_map), upstream.model_name


@pytest.mark.parametrize(("member", "role"), [("llm_preprocessing", "preprocessing"),
                                              ("llm_postprocessing", "postprocessing"),
                                              ("llm_tensorrt_llm", "tensorrt_llm"),
                                              ("llm_tensorrt_llm_bls", "tensorrt_llm_bls")])
def test_member_models_declare_upstreams_tensors(published, member, role):
    ours, theirs = published.config(member), _upstream(role)
    assert _fields(ours.input) == _fields(theirs.input, MULTIMODAL_IN)
    assert _fields(ours.output) == _fields(theirs.output, MULTIMODAL_OUT)
    assert ours.max_batch_size == 16  # the engine's, as upstream's ${triton_max_batch_size}


def test_the_routing_tables_name_tensors_the_models_declare(published):
    """The maps the BLS model uses at run time agree with the generated configs."""
    ensemble = {t.name for t in published.config("llm").input}
    pre = published.config("llm_preprocessing")
    engine = {t.name for t in published.config("llm_tensorrt_llm").input}
    assert set(route.PREPROCESSING_FROM_REQUEST.values()) <= ensemble
    assert set(route.PREPROCESSING_FROM_REQUEST) == {t.name for t in pre.input}
    assert {o for o, _ in route.ENGINE_FROM_PREPROCESSING.values()} == {t.name for t in pre.output}
    assert set(route.ENGINE_FROM_REQUEST.values()) <= ensemble
    assert set(route.ENGINE_FROM_REQUEST) | set(route.ENGINE_FROM_PREPROCESSING) <= engine
    assert list(route.RESPONSE_OUTPUTS) == [t.name for t in io.RESPONSE_OUTPUTS]


def test_logits_outputs_take_the_engines_logits_dtype(tmp_path):
    repo = _publish(tmp_path, logits_dtype="float16")
    for model, role in (("llm", "ensemble"), ("llm_tensorrt_llm", "tensorrt_llm"),
                        ("llm_tensorrt_llm_bls", "tensorrt_llm_bls")):
        ours = repo.config(model)
        logits = {t.name: cfg.dtype_name(t.data_type) for t in ours.output if t.name.endswith("_logits")}
        assert logits == {"context_logits": "FP16", "generation_logits": "FP16"}
        assert _fields(ours.output) == _fields(_upstream(role, logits="TYPE_FP16").output, MULTIMODAL_OUT)


# ------------------------------------------------------------------------------------ on a real Triton

RECORDING_ENGINE = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Stand-in for the TensorRT-LLM engine (which needs a GPU): records its inputs, echoes the prompt."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.names = [tensor["name"] for tensor in config["input"]]
        self.record = config["parameters"]["record_to"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            seen = {}
            for name in self.names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    array = tensor.as_numpy()
                    seen[name] = {"shape": list(array.shape), "value": [
                        v.decode() if isinstance(v, bytes) else v for v in array.ravel().tolist()]}
            with open(self.record, "a") as handle:
                handle.write(json.dumps(seen) + "\\n")
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(-1)
            wanted = pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)
            out = np.minimum(lengths, wanted).astype(np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("output_ids", ids[:, None, :].astype(np.int32)),
                pb_utils.Tensor("sequence_length", out.reshape(-1, 1)),
                pb_utils.Tensor("cum_log_probs", np.array([[-0.5]], dtype=np.float32)),
                pb_utils.Tensor("first_token_time_ns", np.array([[1234]], dtype=np.int64))]))
        return responses
'''


def _request(**tensors) -> dict[str, np.ndarray]:
    """A client request of batch 1, the way upstream's clients send it ([1, ...] per input)."""
    return {name: np.array([value], dtype=dtype) for name, (value, dtype) in tensors.items()}


FULL_REQUEST = _request(
    text_input=([b"hello world"], np.object_), decoder_text_input=([b"the engine"], np.object_),
    max_tokens=([8], np.int32), num_return_sequences=([1], np.int32), bad_words=([b"gpu"], np.object_),
    stop_words=([b"on a", b"runs"], np.object_), exclude_input_in_output=([True], np.bool_),
    end_id=([11], np.int32), pad_id=([3], np.int32), top_k=([5], np.int32), top_p=([0.5], np.float32),
    temperature=([0.25], np.float32), length_penalty=([1.5], np.float32), repetition_penalty=([1.25], np.float32),
    min_length=([2], np.int32), presence_penalty=([0.125], np.float32), frequency_penalty=([0.375], np.float32),
    random_seed=([42], np.uint64), return_log_probs=([True], np.bool_), return_context_logits=([False], np.bool_),
    return_generation_logits=([False], np.bool_), return_perf_metrics=([True], np.bool_),
    beam_width=([1], np.int32), stream=([False], np.bool_),
    prompt_embedding_table=(np.full((2, 4), 0.5), np.float16), prompt_table_extra_id=([7], np.uint64),
    prompt_vocab_size=([2], np.int32), embedding_bias_words=([b"hello", b"gpu"], np.object_),
    embedding_bias_weights=([1.0, -2.0], np.float32), lora_task_id=([9], np.uint64),
    lora_weights=(np.ones((2, 6)), np.float16), lora_config=([[0, 0, 2], [1, 0, 2]], np.int32),
    guided_decoding_guide_type=([b"json"], np.object_), guided_decoding_guide=([b'{"type": "object"}'], np.object_),
)
MINIMAL_REQUEST = _request(text_input=([b"the engine runs"], np.object_), max_tokens=([2], np.int32))


def _engine_saw(full: bool) -> dict[str, dict]:
    """What the engine must receive: upstream's routing, the words tokenized in TensorRT-LLM's format."""
    scalar = lambda v: {"shape": [1], "value": [v]}  # noqa: E731 - the backend's reshape to []
    saw = {"input_ids": {"shape": [1, 2 if full else 3], "value": [4, 5] if full else [6, 7, 8]},
           "input_lengths": scalar(2 if full else 3), "request_output_len": scalar(8 if full else 2),
           "end_id": scalar(11 if full else 2), "pad_id": scalar(3 if full else 0),
           "decoder_input_ids": {"shape": [1, 2], "value": [6, 7]} if full else {"shape": [1, 1], "value": [0]},
           "decoder_input_lengths": scalar(2 if full else 1),
           "stop_words_list": {"shape": [1, 2, 3], "value": [9, 10, 8, 2, 3, -1]} if full else
           {"shape": [1, 2, 0], "value": []},
           "bad_words_list": {"shape": [1, 2, 1], "value": [11, 1]} if full else {"shape": [1, 2, 0], "value": []},
           "embedding_bias": {"shape": [1, 12], "value": [0.0] * 4 + [1.0] + [0.0] * 6 + [-2.0]} if full else
           {"shape": [1, 0], "value": []}}
    if full:
        saw |= {"exclude_input_in_output": scalar(True), "runtime_top_k": scalar(5), "runtime_top_p": scalar(0.5),
                "temperature": scalar(0.25), "len_penalty": scalar(1.5), "repetition_penalty": scalar(1.25),
                "min_length": scalar(2), "presence_penalty": scalar(0.125), "frequency_penalty": scalar(0.375),
                "random_seed": scalar(42), "return_log_probs": scalar(True), "return_context_logits": scalar(False),
                "return_generation_logits": scalar(False), "return_perf_metrics": scalar(True),
                "num_return_sequences": scalar(1), "beam_width": scalar(1), "streaming": scalar(False),
                "prompt_embedding_table": {"shape": [1, 2, 4], "value": [0.5] * 8},
                "prompt_table_extra_ids": {"shape": [1, 2], "value": [0, 0]},  # no prompt-table token in it
                "prompt_vocab_size": scalar(2), "lora_task_id": scalar(9),
                "lora_weights": {"shape": [1, 2, 6], "value": [1.0] * 12},
                "lora_config": {"shape": [1, 2, 3], "value": [0, 0, 2, 1, 0, 2]},
                "guided_decoding_guide_type": {"shape": [1, 1], "value": ["json"]},
                "guided_decoding_guide": {"shape": [1, 1], "value": ['{"type": "object"}']}}
    return saw


@pytest.fixture(scope="module")
def served(published, tmp_path_factory):
    from repo_manager.adapters.triton.server import TritonServer

    root = tmp_path_factory.mktemp("trtllm-served")
    shutil.copytree(published.root, root / "repo")
    record = root / "engine-inputs.jsonl"
    engine_config = cfg.read_config(root / "repo" / "llm_tensorrt_llm" / "config.pbtxt")
    engine_config.backend = "python"
    engine_config.parameters["record_to"].string_value = str(record)
    cfg.write_config(root / "repo" / "llm_tensorrt_llm" / "config.pbtxt", engine_config)
    (root / "repo" / "llm_tensorrt_llm" / "1" / "model.py").write_text(RECORDING_ENGINE)
    with TritonServer(root / "repo") as server, TritonClient(server.url) as client:
        for model in ("llm_preprocessing", "llm_tensorrt_llm", "llm_postprocessing", "llm", "llm_tensorrt_llm_bls"):
            client.load(model)

        def infer(model, request):
            record.write_text("")
            out = client.infer(model, request)
            return out, json.loads(record.read_text() or "null")  # null: the engine was not called

        def generate(model, body):
            """Triton's HTTP generate endpoint, the way upstream's docs call the ensemble with curl."""
            record.write_text("")
            post = urllib.request.Request(f"{server.url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(post, timeout=60) as response:
                return json.loads(response.read()), json.loads(record.read_text())

        infer.generate = generate
        yield infer


@pytest.mark.parametrize("model", ["llm", "llm_tensorrt_llm_bls"])
@pytest.mark.parametrize("full", [True, False], ids=["every-input", "text-and-max-tokens"])
def test_an_upstream_style_request_reaches_the_engine_routed_as_upstream(served, model, full):
    out, saw = served(model, FULL_REQUEST if full else MINIMAL_REQUEST)
    assert saw == _engine_saw(full)
    assert out["text_output"].ravel()[0].decode() == ("hello world" if full else "the engine")
    assert out["cum_log_probs"].ravel().tolist() == [-0.5]  # what the engine reports comes back
    assert out["first_token_time_ns"].ravel().tolist() == [1234]


def test_a_malformed_optional_input_is_refused_in_one_line(served):
    request = dict(MINIMAL_REQUEST) | _request(embedding_bias_words=([b"hello", b"gpu"], np.object_),
                                               embedding_bias_weights=([1.0], np.float32))
    with pytest.raises(ServerError, match="embedding_bias_words has 2 words but embedding_bias_weights 1") as exc:
        served("llm", request)
    assert "\n" not in str(exc.value) and "Traceback" not in str(exc.value)


@pytest.mark.parametrize("model", ["llm", "llm_tensorrt_llm_bls"])
def test_the_generate_endpoint_takes_upstreams_json_request(served, model):
    out, saw = served.generate(model, {"text_input": "hello world", "max_tokens": 8, "stop_words": ["on a", "runs"],
                                       "bad_words": ["gpu"], "temperature": 0.25, "random_seed": 42})
    assert out["text_output"] == "hello world"
    assert saw["stop_words_list"] == {"shape": [1, 2, 3], "value": [9, 10, 8, 2, 3, -1]}
    assert saw["bad_words_list"] == {"shape": [1, 2, 1], "value": [11, 1]}
    assert saw["temperature"]["value"] == [0.25] and saw["random_seed"]["value"] == [42]


def test_a_request_with_vllm_sampling_names_becomes_the_ensembles_inputs(served):
    request = ensemble_request("hello world", {"max_tokens": 8, "seed": 42, "min_tokens": 2, "stop": ["on a", "runs"],
                                               "n": 1, "temperature": 0.25, "beam_width": 1}, stream=False)
    _, saw = served("llm", request)
    expected = _engine_saw(True)
    for name in ("stop_words_list", "request_output_len", "random_seed", "min_length", "num_return_sequences",
                 "temperature", "beam_width", "streaming"):
        assert saw[name] == expected[name], name
    _, saw = served("llm", ensemble_request("the engine runs"))  # vLLM's default of 16 tokens, capped by nothing
    assert saw["request_output_len"]["value"] == [16]


def test_a_sampling_parameter_without_a_tensorrt_llm_equivalent_is_named():
    with pytest.raises(InputError, match="no TensorRT-LLM ensemble input for best_of, logit_bias"):
        ensemble_request("hi", {"best_of": 2, "logit_bias": {"4": 1.0}, "temperature": 0.5})


# ------------------------------------------------------------------------------------------ streaming

STREAMING_ENGINE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Stand-in for the decoupled TensorRT-LLM engine: "generates" the prompt's tokens, one response per
    token when the request asks for streaming, else one response with all of them."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            length = int(pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(-1)[0])
            wanted = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
            streaming = pb_utils.get_input_tensor_by_name(request, "streaming")
            streaming = streaming is not None and bool(streaming.as_numpy().reshape(-1)[0])
            tokens = ids[0, :min(length, wanted)].astype(np.int32)
            chunks = [tokens[k:k + 1] for k in range(len(tokens))] if streaming else [tokens]
            for chunk in chunks:
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("output_ids", chunk.reshape(1, 1, -1)),
                    pb_utils.Tensor("sequence_length", np.array([[len(chunk)]], dtype=np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def _generate_stream(url: str, model: str, body: dict) -> list[dict]:
    """Triton's generate_stream endpoint: one server-sent event per response."""
    post = urllib.request.Request(f"{url}/v2/models/{model}/generate_stream", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=60) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]


def test_stream_true_streams_token_by_token_through_the_ensemble_and_the_bls(tmp_path):
    from repo_manager.adapters.triton.server import TritonServer
    from repo_manager.ops.llm.layout import ServingOptions

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, fingerprint=FINGERPRINT)
    publish_model(Settings(repository=tmp_path / "repo"), checkpoint, "llm", fmt="tensorrt-llm",
                  trtllm=TrtllmOptions(engine_dir=engine, gpu_memory_gib=24, bls=True,
                                       serving=ServingOptions(decoupled=True)),
                  node=NodeFacts(probe="none (test: a CPU-only node)"))
    engine_config = cfg.read_config(tmp_path / "repo" / "llm_tensorrt_llm" / "config.pbtxt")
    assert engine_config.model_transaction_policy.decoupled
    engine_config.backend = "python"
    cfg.write_config(tmp_path / "repo" / "llm_tensorrt_llm" / "config.pbtxt", engine_config)
    (tmp_path / "repo" / "llm_tensorrt_llm" / "1" / "model.py").write_text(STREAMING_ENGINE)
    with TritonServer(tmp_path / "repo") as server, TritonClient(server.url) as client:
        for model in ("llm_preprocessing", "llm_tensorrt_llm", "llm_postprocessing", "llm", "llm_tensorrt_llm_bls"):
            client.load(model)
        for model in ("llm", "llm_tensorrt_llm_bls"):
            events = _generate_stream(server.url, model, {"text_input": "the engine runs", "max_tokens": 8,
                                                          "stream": True})
            assert [e["text_output"] for e in events if e.get("text_output")] == ["the", "engine", "runs"], model
            events = _generate_stream(server.url, model, {"text_input": "the engine runs", "max_tokens": 8,
                                                          "stream": False})
            assert [e["text_output"] for e in events if e.get("text_output")] == ["the engine runs"], model


def test_preprocessing_tokenizes_the_words_of_each_request_in_a_batch(served):
    """A batch of two through the preprocessing model alone: word lists padded to the longer one."""
    request = {"QUERY": np.array([[b"hello world"], [b"the engine runs"]], dtype=np.object_),
               "REQUEST_OUTPUT_LEN": np.array([[4], [200]], dtype=np.int32),
               "STOP_WORDS_DICT": np.array([[b"on a", b""], [b"runs", b"gpu"]], dtype=np.object_),
               "END_ID": np.array([[11], [2]], dtype=np.int32)}
    out, engine_saw = served("llm_preprocessing", request)
    assert engine_saw is None
    assert out["STOP_WORDS_IDS"].tolist() == [[[9, 10], [2, -1]], [[8, 11], [1, 2]]]
    assert out["BAD_WORDS_IDS"].shape == (2, 2, 0) and out["EMBEDDING_BIAS"].shape == (2, 0)
    assert out["OUT_END_ID"].ravel().tolist() == [11, 2]
    assert out["REQUEST_OUTPUT_LEN"].ravel().tolist() == [4, 125]  # capped to max_seq_len 128 - 3
    assert "OUT_PROMPT_TABLE_EXTRA_IDS" not in out  # only when the request gives prompt_table_extra_id
