"""`trm publish model --format tensorrt-llm` without a GPU: the Triton TensorRT-LLM layout from engine configs.

Engine folders are written in TensorRT-LLM's documented format (tests/llm_fixtures.py cites the source:
NVIDIA/TensorRT-LLM cpp/tensorrt_llm/runtime/gptJsonConfig.cpp and docs/source/architecture/checkpoint.md);
the layout follows triton-inference-server/tensorrtllm_backend all_models/inflight_batcher_llm/
{preprocessing,tensorrt_llm,postprocessing,ensemble,tensorrt_llm_bls}/config.pbtxt and
all_models/llmapi/tensorrt_llm/1/model.yaml (docs/llmapi.md). Two model families: Llama and Qwen2.
The pre/post-processing models are loaded on the real session tritonserver (Python backend, CPU); the
engine model itself needs a GPU and Triton's TensorRT-LLM backend (test marked ``gpu`` at the end).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import llm_fixtures as fx
import numpy as np
import pytest
import yaml
from helpers import run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.core.localized import localize_gpt_model_path
from repo_manager.core.settings import Settings
from repo_manager.ops.llm.layout import ServingOptions
from repo_manager.ops.llm.node import NodeFacts, probe_node
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions

NO_GPU = NodeFacts(probe="none (test: a CPU-only node)")
FINGERPRINT = {"compute_capability": "9.0", "gpu_name": "NVIDIA H200", "tensorrt_llm_version": "0.12.0",
               "tensorrt_version": "10.3.0", "cuda_version": "12.5"}


def _publish(tmp_path, checkpoint, name="llm", node=NO_GPU, **options):
    settings = Settings(repository=tmp_path / "repo")
    options.setdefault("gpu_memory_gib", 24)
    return publish_model(settings, checkpoint, name, fmt="tensorrt-llm", trtllm=TrtllmOptions(**options), node=node)


def _all_configs(repo_root: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted(repo_root.glob("*/config.pbtxt"))}


def _assert_clean(repo_root: Path) -> None:
    """Every config parses with the ModelConfig schema, has no template placeholder, validates."""
    configs = _all_configs(repo_root)
    assert configs
    for model, text in configs.items():
        assert "${" not in text, model
        assert cfg.read_config(repo_root / model / "config.pbtxt").name == model
    for manifest in repo_root.glob("*/*/trm-manifest.json"):
        assert "${" not in json.loads(manifest.read_text())["config"]
    assert LocalRepository(repo_root).validate() == []


def test_llama_engine_publishes_the_inflight_batcher_layout_from_its_config_json(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, max_batch_size=16, max_input_len=96, max_seq_len=128,
                           max_beam_width=2)
    result = _publish(tmp_path, checkpoint, engine_dir=engine, compute_capability="8.9", tensorrt_version="10.3.0",
                      cuda_version="12.5")
    repo_root = tmp_path / "repo"
    assert result.model == "llm" and result.version == 1 and not result.verified
    assert result.members == {"llm_preprocessing": 1, "llm_tensorrt_llm": 1, "llm_postprocessing": 1}
    _assert_clean(repo_root)
    repo = LocalRepository(repo_root)

    trt = repo.config("llm_tensorrt_llm")
    params = {k: v.string_value for k, v in trt.parameters.items()}
    assert trt.backend == "tensorrtllm" and trt.max_batch_size == 16
    assert params["max_beam_width"] == "2" and params["max_attention_window_size"] == "128"
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert int(params["max_tokens_in_paged_kv_cache"]) > 128  # bounded by the memory plan
    assert not trt.model_transaction_policy.decoupled
    engine_path = Path(params["gpt_model_path"])
    assert engine_path == repo.version_dir("llm_tensorrt_llm", 1).resolve()
    assert (engine_path / "config.json").read_bytes() == (engine / "config.json").read_bytes()
    assert (engine_path / "rank0.engine").is_file()

    pre = repo.config("llm_preprocessing")
    assert pre.max_batch_size == 16 and pre.parameters["max_input_len"].string_value == "96"
    assert (repo.version_dir("llm_preprocessing", 1) / "tokenizer" / "tokenizer.json").is_file()
    ensemble = repo.config("llm")
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 16
    assert [(s.model_name, s.model_version) for s in ensemble.ensemble_scheduling.step] == [
        ("llm_preprocessing", 1), ("llm_tensorrt_llm", 1), ("llm_postprocessing", 1)]

    source = repo.manifest("llm_tensorrt_llm").source
    assert source["kind"] == "tensorrt-llm" and source["role"] == "tensorrt_llm"
    assert source["fingerprint"] == {"compute_capability": "8.9", "tensorrt_llm_version": "0.12.0",
                                     "tensorrt_version": "10.3.0", "cuda_version": "12.5", "gpu_name": None}
    assert source["plan"]["fits"] and source["plan"]["request"]["max_seq_len"] == 128
    assert source["engine"]["max_batch_size"] == 16 and len(source["checkpoint_sha256"]) == 64
    verification = repo.manifest("llm").verification
    assert verification["skipped"] == "no GPU"


def test_qwen_tp2_engine_with_streaming_and_bls(tmp_path):
    checkpoint = fx.qwen_checkpoint(tmp_path / "qwen")
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, tp=2, max_batch_size=4, max_seq_len=512,
                           max_input_len=256, fingerprint=FINGERPRINT)
    result = _publish(tmp_path, checkpoint, name="qwen", engine_dir=engine, bls=True,
                      serving=ServingOptions(decoupled=True, batch_scheduler_policy="max_utilization"))
    repo = LocalRepository(tmp_path / "repo")
    _assert_clean(tmp_path / "repo")
    assert set(repo.models()) == {"qwen", "qwen_preprocessing", "qwen_tensorrt_llm", "qwen_postprocessing",
                                  "qwen_tensorrt_llm_bls"}
    trt = repo.config("qwen_tensorrt_llm")
    assert trt.model_transaction_policy.decoupled and trt.max_batch_size == 4
    assert trt.parameters["batch_scheduler_policy"].string_value == "max_utilization"
    bls = repo.config("qwen_tensorrt_llm_bls")
    assert bls.model_transaction_policy.decoupled
    assert bls.parameters["tensorrt_llm_model_name"].string_value == "qwen_tensorrt_llm"
    files = {f.path for f in repo.manifest("qwen_tensorrt_llm").files}
    assert {"config.json", "rank0.engine", "rank1.engine"} <= files
    source = repo.manifest("qwen_tensorrt_llm").source
    assert source["world_size"] == 2 and source["fingerprint"]["compute_capability"] == "9.0"
    assert source["fingerprint"]["gpu_name"] == "NVIDIA H200"
    assert result.members["qwen_tensorrt_llm_bls"] == 1


def test_llmapi_layout_skips_the_engine_build(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    _publish(tmp_path, checkpoint, name="chat", layout="llmapi", max_seq_len=200,
             serving=ServingOptions(decoupled=True))
    repo = LocalRepository(tmp_path / "repo")
    _assert_clean(tmp_path / "repo")
    assert repo.models() == ["chat"]
    config = repo.config("chat")
    assert config.backend == "python" and config.max_batch_size == 0 and config.model_transaction_policy.decoupled
    folder = repo.version_dir("chat", 1)
    settings = yaml.safe_load((folder / "model.yaml").read_text())
    assert settings["model"] == "checkpoint" and settings["max_seq_len"] == 200
    assert settings["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert settings["kv_cache_config"]["max_tokens"] == repo.manifest("chat").source["plan"]["max_tokens"]
    assert (folder / "checkpoint" / "config.json").is_file() and (folder / "model.py").is_file()
    assert repo.manifest("chat").source["role"] == "llmapi"


# ------------------------------------------------------------------------------------------ refusals

def _nothing_written(tmp_path):
    root = tmp_path / "repo"
    return not root.exists() or not any(root.rglob("*"))


def test_a_model_that_does_not_fit_is_refused_before_anything_is_built(tmp_path, capsys):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt", tokenizer=False)
    (checkpoint / "tokenizer.json").write_text("{}")
    llama8 = json.loads((Path(__file__).parent / "data" / "llm" / "llama-3.1-8b.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(llama8))
    with pytest.raises(CompatibilityError, match="max_seq_len 131,072"):
        _publish(tmp_path, checkpoint, builder="/bin/false")  # default: the model's 128k context
    assert _nothing_written(tmp_path)
    result = run_cli(capsys, "publish", "model", checkpoint, "--name", "big", "--format", "tensorrt-llm",
                     "--repo", tmp_path / "repo", "--gpu-memory", "24", "--builder", "/bin/false")
    assert result.code == 11 and "--max-seq-len to 44687" in result.err
    assert _nothing_written(tmp_path)


def test_an_engine_built_from_another_model_is_refused(tmp_path):
    llama = fx.llama_checkpoint(tmp_path / "llama")
    qwen = fx.qwen_checkpoint(tmp_path / "qwen")
    engine = fx.engine_dir(tmp_path / "engine", qwen, fingerprint=FINGERPRINT)
    with pytest.raises(InputError, match="built from another model"):
        _publish(tmp_path, llama, engine_dir=engine)
    assert _nothing_written(tmp_path)


def test_engine_problems_are_named(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    no_paging = fx.engine_dir(tmp_path / "e1", checkpoint, paged_kv_cache=False, fingerprint=FINGERPRINT)
    with pytest.raises(InputError, match="without paged KV cache") as info:
        _publish(tmp_path, checkpoint, engine_dir=no_paging)
    assert "--batching-strategy v1" in info.value.hint
    _publish(tmp_path, checkpoint, engine_dir=no_paging, serving=ServingOptions(batching_strategy="v1"))
    missing_rank = fx.engine_dir(tmp_path / "e2", checkpoint, tp=2, ranks=1, fingerprint=FINGERPRINT)
    with pytest.raises(InputError, match="lacks rank1.engine"):
        _publish(tmp_path, checkpoint, engine_dir=missing_rank)
    unknown_arch = fx.engine_dir(tmp_path / "e3", checkpoint)
    with pytest.raises(InputError, match="GPU architecture .* unknown") as info:
        _publish(tmp_path, checkpoint, engine_dir=unknown_arch)
    assert "--compute-capability" in info.value.hint
    no_tokenizer = fx.llama_checkpoint(tmp_path / "bare", tokenizer=False)
    with pytest.raises(InputError, match="no tokenizer"):
        _publish(tmp_path, no_tokenizer, engine_dir=fx.engine_dir(tmp_path / "e4", no_tokenizer))


def test_without_a_gpu_or_gpu_memory_the_publish_says_what_to_pass(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    with pytest.raises(InputError, match="no GPU visible") as info:
        _publish(tmp_path, checkpoint, gpu_memory_gib=None)
    assert "--gpu-memory" in info.value.hint


def test_a_failing_engine_build_leaves_no_half_version(tmp_path):
    """The default builder really runs here (python -m repo_manager.ops.llm.build_worker) and fails, because
    this machine has no TensorRT-LLM; a missing builder command fails as well."""
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CompatibilityError, match="engine build failed") as info:
        _publish(tmp_path, checkpoint, max_seq_len=128)
    assert "tensorrt_llm" in info.value.message  # the log tail names what is missing
    with pytest.raises(InputError, match="not found"):
        _publish(tmp_path, checkpoint, max_seq_len=128, builder="/nonexistent/trtllm-build")
    root = tmp_path / "repo"
    assert not list(root.rglob(".trm-tmp-*")) and LocalRepository(root).models() == []


def test_builder_command_gets_trtllm_build_options_and_its_engine_is_published(tmp_path):
    """A stand-in for trtllm-build (the real one needs a GPU): a script that records its arguments and
    writes an engine folder in TensorRT-LLM's format. Proves the options trm passes and that the built
    engine, not a given one, ends up in the version."""
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    script = tmp_path / "fake_trtllm_build.py"
    script.write_text(
        "import argparse, json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import llm_fixtures as fx\nfrom pathlib import Path\n"
        "p = argparse.ArgumentParser()\n"
        "for o in ('checkpoint_dir','output_dir','max_batch_size','max_input_len','max_seq_len',"
        "'max_beam_width','max_num_tokens'): p.add_argument('--' + o)\n"
        "a = p.parse_args()\n"
        "fx.engine_dir(Path(a.output_dir), Path(a.checkpoint_dir), max_batch_size=int(a.max_batch_size),"
        " max_input_len=int(a.max_input_len), max_seq_len=int(a.max_seq_len),"
        f" fingerprint={FINGERPRINT!r})\n"
        "Path(a.output_dir, 'args.json').write_text(json.dumps(vars(a)))\n")
    _publish(tmp_path, checkpoint, builder=f"{sys.executable} {script}", max_batch_size=4, max_seq_len=200,
             max_input_len=150)
    repo = LocalRepository(tmp_path / "repo")
    args = json.loads((repo.version_dir("llm_tensorrt_llm", 1) / "args.json").read_text())
    assert args["max_batch_size"] == "4" and args["max_seq_len"] == "200" and args["max_input_len"] == "150"
    assert Path(args["checkpoint_dir"]) == checkpoint
    assert repo.config("llm_tensorrt_llm").max_batch_size == 4
    assert repo.manifest("llm_tensorrt_llm").source["fingerprint"]["compute_capability"] == "9.0"


def test_localized_engine_path_points_at_the_installed_version(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    _publish(tmp_path, checkpoint, engine_dir=fx.engine_dir(tmp_path / "e", checkpoint, fingerprint=FINGERPRINT))
    config = LocalRepository(tmp_path / "repo").config("llm_tensorrt_llm")
    moved = localize_gpt_model_path(config, tmp_path / "node" / "llm_tensorrt_llm" / "1")
    assert moved.parameters["gpt_model_path"].string_value == str((tmp_path / "node/llm_tensorrt_llm/1").resolve())
    assert config.parameters["gpt_model_path"].string_value != moved.parameters["gpt_model_path"].string_value


# --------------------------------------------------------------------- pre/post-processing on Triton

def _load_from_repo(client, repo, model):
    folder = repo.version_dir(model, repo.latest(model))
    config = repo.config(model)
    files = {f"1/{p.relative_to(folder).as_posix()}": p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    client.load(model, config, files)


def test_preprocessing_and_postprocessing_tokenize_on_a_real_triton(tmp_path, triton):
    from transformers import AutoTokenizer

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    _publish(tmp_path, checkpoint, engine_dir=fx.engine_dir(tmp_path / "e", checkpoint, max_input_len=4,
                                                           max_seq_len=10, fingerprint=FINGERPRINT))
    repo = LocalRepository(tmp_path / "repo")
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    with TritonClient(triton.url) as client:
        for model in ("llm_preprocessing", "llm_postprocessing"):
            _load_from_repo(client, repo, model)
        try:
            out = client.infer("llm_preprocessing", {
                "QUERY": np.array([[b"hello world"], [b"the engine runs"]], dtype=np.object_),
                "REQUEST_OUTPUT_LEN": np.array([[100], [3]], dtype=np.int32)})
            assert out["INPUT_ID"][0, :2].tolist() == tokenizer.encode("hello world")
            assert out["REQUEST_INPUT_LEN"].ravel().tolist() == [2, 3]
            assert out["REQUEST_OUTPUT_LEN"].ravel().tolist() == [8, 3]  # capped to max_seq_len 10 - 2
            assert out["OUT_END_ID"].ravel().tolist() == [tokenizer.eos_token_id] * 2
            with pytest.raises(Exception, match="max_input_len 4"):
                client.infer("llm_preprocessing", {
                    "QUERY": np.array([[b"the engine runs on a gpu"]], dtype=np.object_),
                    "REQUEST_OUTPUT_LEN": np.array([[1]], dtype=np.int32)})
            ids = tokenizer.encode("runs on a gpu")
            text = client.infer("llm_postprocessing", {
                "TOKENS_BATCH": np.array([[ids + [0, 0]]], dtype=np.int32),
                "SEQUENCE_LENGTH": np.array([[len(ids)]], dtype=np.int32)})["OUTPUT"]
            assert text.ravel()[0].decode() == "runs on a gpu"
        finally:
            for model in ("llm_preprocessing", "llm_postprocessing"):
                client.unload(model)


# ----------------------------------------------------------------------------------------------- GPU

def _gpu_ready() -> str | None:
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        return "tensorrt_llm is not installed"
    if not probe_node().gpus:
        return "no GPU visible"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_ready() is not None, reason=f"needs a GPU and TensorRT-LLM ({_gpu_ready()})")
def test_gpu_builds_and_serves_a_tiny_engine(tmp_path):
    """Build a random-weight tiny Llama with the default builder, publish, check doctor, and when this
    tritonserver has the TensorRT-LLM backend (TRM_TRTLLM_TRITONSERVER or NGC's /opt/tritonserver), serve it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from repo_manager.adapters.triton.server import TritonServer
    from repo_manager.ops.llm.doctor import check_engine_compatible

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    hf = json.loads((checkpoint / "config.json").read_text())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in hf.items() if k != "architectures"})).half().save_pretrained(
        str(checkpoint))
    node = probe_node()
    result = _publish(tmp_path, checkpoint, node=node, gpu_memory_gib=None, max_batch_size=2, max_seq_len=64,
                      max_input_len=32)
    repo = LocalRepository(tmp_path / "repo")
    assert check_engine_compatible(repo.manifest("llm_tensorrt_llm"), node)
    binary = os.environ.get("TRM_TRTLLM_TRITONSERVER", "/opt/tritonserver/bin/tritonserver")
    if not Path(binary).is_file() or not Path("/opt/tritonserver/backends/tensorrtllm").is_dir():
        pytest.skip(f"published version {result.version}; no tritonserver with the TensorRT-LLM backend to serve it")
    with TritonServer(tmp_path / "repo", binary=binary) as server, TritonClient(server.url) as client:
        for model in ("llm_preprocessing", "llm_tensorrt_llm", "llm_postprocessing", "llm"):
            client.load(model)
        out = client.infer("llm", {"text_input": np.array([[b"hello world"]], dtype=np.object_),
                                   "max_tokens": np.array([[4]], dtype=np.int32)})
        assert out["text_output"].size == 1


def test_builder_setting_comes_from_trm_settings(tmp_path, monkeypatch, capsys):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("TRM_TRTLLM_BUILDER", "/nonexistent/ngc-trtllm-build")
    result = run_cli(capsys, "publish", "model", checkpoint, "--name", "m", "--format", "tensorrt-llm",
                     "--repo", tmp_path / "repo", "--gpu-memory", "24", "--max-seq-len", "128")
    assert result.code == 3 and "/nonexistent/ngc-trtllm-build" in result.err


def test_engine_with_a_vocabulary_padded_for_tensor_parallelism_matches_its_checkpoint(tmp_path):
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, tp=8, fingerprint=FINGERPRINT)
    config = json.loads((engine / "config.json").read_text())
    config["pretrained_config"]["vocab_size"] = 16  # 12 words padded to a multiple of tp 8
    (engine / "config.json").write_text(json.dumps(config))
    result = _publish(tmp_path, checkpoint, engine_dir=engine)
    assert result.members["llm_tensorrt_llm"] == 1


ECHO_ENGINE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Stand-in for the TensorRT-LLM engine (which needs a GPU): "generates" the prompt's own tokens."""

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(-1)
            wanted = pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)
            out = np.minimum(lengths, wanted).astype(np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("output_ids", ids[:, None, :].astype(np.int32)),
                pb_utils.Tensor("sequence_length", out.reshape(-1, 1))]))
        return responses
'''


def test_generated_ensemble_wires_text_through_all_three_models_on_a_real_triton(tmp_path):
    """The published repository served by a real tritonserver: ensemble, BLS, preprocessing and
    postprocessing exactly as published; only the engine model is a stand-in (its generated config with the Python
    backend instead of tensorrtllm, which needs a GPU). Triton checks every tensor name, type and shape of
    the ensemble's wiring when it loads it."""
    import shutil

    from repo_manager.adapters.triton.server import TritonServer

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    _publish(tmp_path, checkpoint, engine_dir=fx.engine_dir(tmp_path / "e", checkpoint, fingerprint=FINGERPRINT),
             bls=True)
    served = tmp_path / "served"
    shutil.copytree(tmp_path / "repo", served)
    engine_config = cfg.read_config(served / "llm_tensorrt_llm" / "config.pbtxt")
    engine_config.backend = "python"
    cfg.write_config(served / "llm_tensorrt_llm" / "config.pbtxt", engine_config)
    (served / "llm_tensorrt_llm" / "1" / "model.py").write_text(ECHO_ENGINE)
    with TritonServer(served) as server, TritonClient(server.url) as client:
        for model in ("llm_preprocessing", "llm_tensorrt_llm", "llm_postprocessing", "llm"):
            client.load(model)
        out = client.infer("llm", {"text_input": np.array([[b"hello world"]], dtype=np.object_),
                                   "max_tokens": np.array([[1]], dtype=np.int32)})
        assert out["text_output"].ravel()[0].decode() == "hello"  # the stand-in echoes max_tokens tokens
        out = client.infer("llm", {"text_input": np.array([[b"the engine runs"]], dtype=np.object_),
                                   "max_tokens": np.array([[8]], dtype=np.int32),
                                   "temperature": np.array([[0.5]], dtype=np.float32)})
        assert out["text_output"].ravel()[0].decode() == "the engine runs"
        client.load("llm_tensorrt_llm_bls")  # the BLS chain takes the same request and gives the same answer
        out = client.infer("llm_tensorrt_llm_bls", {"text_input": np.array([[b"hello world"]], dtype=np.object_),
                                                    "max_tokens": np.array([[2]], dtype=np.int32),
                                                    "top_k": np.array([[1]], dtype=np.int32)})
        assert out["text_output"].ravel()[0].decode() == "hello world"
