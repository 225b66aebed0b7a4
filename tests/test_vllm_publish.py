"""`trm publish model --format vllm` without an engine: the layout, the plan's engine arguments, bad input.

Every bad input is refused before anything is written (no model folder, no staging folder) and before any
server or engine starts. The layout is checked against the official vllm_backend's inputs and outputs,
written out here from its documentation (not from trm's code).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli
from llm_checkpoints import causal_lm, edit_config

from repo_manager.core import config as cfg

DATA = Path(__file__).parent / "data" / "llm"
# vllm_backend README / src/model.py: name -> (type, dims, optional)
OFFICIAL_INPUTS = {
    "text_input": ("TYPE_STRING", [1], False), "stream": ("TYPE_BOOL", [1], True),
    "sampling_parameters": ("TYPE_STRING", [1], True), "exclude_input_in_output": ("TYPE_BOOL", [1], True),
    "return_finish_reason": ("TYPE_BOOL", [1], True), "return_cumulative_logprob": ("TYPE_BOOL", [1], True),
    "return_logprobs": ("TYPE_BOOL", [1], True), "return_num_input_tokens": ("TYPE_BOOL", [1], True),
    "return_num_output_tokens": ("TYPE_BOOL", [1], True)}
OFFICIAL_OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]), "finish_reason": ("TYPE_STRING", [-1]),
    "cumulative_logprob": ("TYPE_FP32", [-1]), "logprobs": ("TYPE_STRING", [-1]),
    "num_input_tokens": ("TYPE_UINT32", [1]), "num_output_tokens": ("TYPE_UINT32", [-1])}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return causal_lm(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture
def copy(checkpoint, tmp_path):
    def make(name: str = "ckpt") -> Path:
        target = tmp_path / name
        shutil.copytree(checkpoint, target)
        return target
    return make


def _nothing_written(repo: Path) -> None:
    assert not repo.exists() or not any(repo.iterdir()), sorted(p.name for p in repo.rglob("*"))


def test_gpu_plan_writes_the_official_layout_and_engine_arguments(checkpoint, tmp_path, capsys):
    repo = tmp_path / "repo"
    result = run_cli(capsys, "--json", "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm",
                     "--repo", repo, "--gpu-memory", "24", "--no-verify")
    assert result.code == 0, result.err
    config = cfg.read_config(repo / "tiny" / "config.pbtxt")
    data = json.loads(cfg.config_to_json(config))
    assert data["backend"] == "vllm" and data.get("max_batch_size", 0) == 0
    assert data["model_transaction_policy"]["decoupled"] is True
    assert data["instance_group"] == [{"count": 1, "kind": "KIND_MODEL"}]
    inputs = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]], t.get("optional", False))
              for t in data["input"]}
    outputs = {t["name"]: (t["data_type"], [int(d) for d in t["dims"]]) for t in data["output"]}
    assert inputs == OFFICIAL_INPUTS and outputs == OFFICIAL_OUTPUTS
    version = repo / "tiny" / "1"
    args = json.loads((version / "model.json").read_text())
    assert args["model"] == str(version.resolve())  # absolute: the official backend resolves no relative path
    assert args["max_model_len"] == 256 and args["gpu_memory_utilization"] == 0.9
    assert args["tensor_parallel_size"] == 1 and args["max_num_seqs"] == 256 and args["dtype"] == "float32"
    assert "kv_cache_memory_bytes" not in args
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (version / name).read_bytes() == (checkpoint / name).read_bytes()
    manifest = json.loads((version / "trm-manifest.json").read_text())
    plan = manifest["source"]["plan"]
    assert plan["device"] == "cuda" and plan["memory"]["fits"] and plan["engine_args"]["max_model_len"] == 256
    assert manifest["files"]["model.json"]["sha256"] if isinstance(manifest["files"], dict) else True


def test_the_seed_crash_is_refused_at_publish_naming_the_context_that_fits(tmp_path, capsys):
    """Llama 3.1 8B (bf16) on a 24 GiB GPU: vLLM would size the KV cache for 128k and crash; ~45k fit."""
    folder = tmp_path / "llama8b"
    folder.mkdir()
    shutil.copy(DATA / "llama-3.1-8b.json", folder / "config.json")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", folder, "--name", "llama", "--format", "vllm", "--repo", repo,
                     "--gpu-memory", "24")
    assert result.code == 11, result.err
    assert "131,072 tokens does not fit" in result.err and "--max-model-len 4" in result.err
    fits = int(result.err.split("--max-model-len ")[1].split()[0])
    assert 42_000 <= fits <= 48_000
    _nothing_written(repo)


def test_a_quantized_checkpoint_is_planned_at_its_own_weight_type(tmp_path, capsys):
    """The same Llama 3.1 8B saved by AutoAWQ (4-bit weights, quantization_config in config.json, fp16
    activations): vLLM loads its weights as they were saved, so the plan counts ~5 GB of weights, not
    bf16's 16 GB, and the context that fits on 24 GiB is that much longer (the KV cache stays 16-bit)."""
    folder = tmp_path / "llama8b-awq"
    folder.mkdir()
    config = json.loads((DATA / "llama-3.1-8b.json").read_text())
    config |= {"torch_dtype": "float16", "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                                 "version": "gemm", "zero_point": True}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    result = run_cli(capsys, "publish", "model", folder, "--name", "llama", "--format", "vllm", "--repo",
                     tmp_path / "repo", "--gpu-memory", "24")
    assert result.code == 11 and "131,072 tokens does not fit" in result.err, result.err
    fits = int(result.err.split("--max-model-len ")[1].split()[0])
    assert 110_000 <= fits < 131_072  # bf16's weights left ~45k
    plan = run_cli(capsys, "plan", folder / "config.json", "--gpu-memory", "24", "--json")
    assert plan.json()["request"]["dtype"] == "int4" and 4.5e9 < plan.json()["weight_bytes"] < 5.5e9, plan.out


def test_cpu_plan_gives_the_kv_cache_in_bytes(checkpoint, tmp_path):
    from repo_manager.ops.llm.vllm import VllmOptions, plan_engine, read_checkpoint

    plan = plan_engine(read_checkpoint(checkpoint), VllmOptions(cpu_memory_gib=4, max_num_seqs=4),
                       gpu_memory_gib=None)
    # 2 layers x 2 KV heads x 32 head_dim x 2 (K, V) x 4 bytes = 1024 bytes per token; 4 sequences of 256
    assert plan.device == "cpu" and plan.kv_cache_bytes == 4 * 256 * 1024
    assert plan.engine_args["kv_cache_memory_bytes"] == plan.kv_cache_bytes
    assert plan.engine_args["enforce_eager"] is True


@pytest.mark.parametrize("case, code, message", [
    ("not a causal LM", 3, "is not a causal language model"),
    ("no tokenizer", 3, "has no tokenizer"),
    ("no weights", 3, "has no .safetensors weights"),
    ("head size 48", 11, "cannot run head size 48"),
    ("context too long", 11, "does not fit"),
    ("unknown architecture", 11, "vLLM cannot load architecture"),
])
def test_bad_checkpoints_are_refused_with_one_line_and_nothing_written(case, code, message, copy, tmp_path,
                                                                       capsys):
    folder = copy()
    extra: list[str] = []
    if case == "not a causal LM":
        edit_config(folder, architectures=["LlamaModel"])
    elif case == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    elif case == "no weights":
        (folder / "model.safetensors").unlink()
    elif case == "head size 48":
        edit_config(folder, head_dim=48)
    elif case == "context too long":
        edit_config(folder, max_position_embeddings=1 << 20)
        extra = ["--cpu-memory", "1"]
    elif case == "unknown architecture":
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed: its list of architectures is checked where it is")
        edit_config(folder, architectures=["NoSuchForCausalLM"])
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", folder, "--name", "m", "--format", "vllm", "--repo", repo, *extra)
    assert result.code == code, result.err
    assert message in result.err and len(result.err.strip().splitlines()) <= 2, result.err
    if case == "context too long":
        assert "--max-model-len" in result.err
    _nothing_written(repo)


@pytest.mark.parametrize("args, strategy", [
    (("--gpu-memory", "24"), "drain"),  # vLLM takes 0.9 of the GPU: twice does not fit
    (("--gpu-memory", "24", "--gpu-memory-utilization", "0.45"), "side-by-side"),
    (("--cpu-memory", "4", "--max-num-seqs", "4"), "side-by-side"),  # about 2 MB planned, twice, in 4 GiB
])
def test_the_memory_plan_decides_side_by_side_or_drain_for_an_llm(checkpoint, tmp_path, capsys, args, strategy):
    """An LLM version loaded beside another needs its planned memory twice (the engine allocates its KV
    cache up front), not its files' bytes: the plan in the manifest decides the rollout's strategy."""
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.ops.rollout.plan import RolloutOptions, decide_strategy, footprint, model_set, planned_capacity

    repo = tmp_path / "repo"
    for _ in (1, 2):
        result = run_cli(capsys, "--json", "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm",
                         "--repo", repo, "--no-verify", *args)
        assert result.code == 0, result.err
    local = LocalRepository(repo)
    target = model_set(local, "tiny", 2)
    sizes = footprint(local, target)
    assert sizes["tiny"] > local.manifest("tiny", 2).total_size or strategy == "side-by-side"
    decided, reason = decide_strategy({"tiny": (1,)}, {"tiny": (2,)}, sizes, target, RolloutOptions(),
                                      capacity=planned_capacity(local, target))
    assert decided == strategy, reason
    assert "the memory the LLM plan is for" in reason
    # a --memory-budget given still wins over the plan's capacity
    decided, reason = decide_strategy({"tiny": (1,)}, {"tiny": (2,)}, sizes, target,
                                      RolloutOptions(memory_budget=sizes["tiny"] * 2 - 1),
                                      capacity=planned_capacity(local, target))
    assert decided == "drain" and "memory budget" in reason


def _bf16_generation(folder: Path, tokenizer, text: str):
    """Greedy tokens of ``folder`` run by transformers in bfloat16, with their log-probabilities, as vLLM's
    ``logprobs`` output gives them: a reduced-precision generation computed here, not by trm."""
    import torch
    from transformers import AutoModelForCausalLM

    from repo_manager.ops.llm.generate import Generation
    from repo_manager.ops.publish.vllm import GENERATED_TOKENS

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                             max_new_tokens=GENERATED_TOKENS, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    tokens = [int(t) for t in out.sequences[0, ids.shape[1]:]]
    logprobs = [float(torch.log_softmax(score[0].float(), dim=-1)[t]) for score, t in zip(out.scores, tokens)]
    return Generation(text=tokenizer.decode(tokens, skip_special_tokens=True), token_ids=tokens, logprobs=logprobs,
                      num_input_tokens=int(ids.shape[1]), chunks=1)


def test_the_bf16_criterion_passes_a_bf16_generation_and_fails_one_from_other_weights(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    from repo_manager.core.errors import VerificationError
    from repo_manager.ops.publish.vllm import PROMPTS, TOLERANCE_NATS, _judge_forced

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    answers = [(f"{case} (streamed)", case, _bf16_generation(checkpoint, tokenizer, text))
               for case, text in PROMPTS.items()]
    cases = _judge_forced(checkpoint, tokenizer, PROMPTS, answers, TOLERANCE_NATS["bf16"])
    assert [c["case"] for c in cases] == [label for label, _, _ in answers]
    assert all(0 <= c["worst_margin_nats"] <= TOLERANCE_NATS["bf16"] for c in cases), cases
    assert all(c["worst_logprob_difference_nats"] <= TOLERANCE_NATS["bf16"] for c in cases), cases
    other = causal_lm(tmp_path / "other", seed=7)  # same tokenizer and shape, other weights
    wrong = [("short (streamed)", "short", _bf16_generation(other, tokenizer, PROMPTS["short"]))]
    with pytest.raises(VerificationError, match="nats less likely than transformers' most likely token") as caught:
        _judge_forced(checkpoint, tokenizer, PROMPTS, wrong, TOLERANCE_NATS["bf16"])
    assert caught.value.exit_code == 5


def test_tuning_with_prompts_longer_than_the_context_is_refused_before_an_engine_starts(checkpoint, tmp_path,
                                                                                         capsys):
    """`trm tune-batching` of a vLLM version whose max_model_len (256 here) cannot hold --input-tokens plus
    --output-tokens: every request would be refused, so nothing is measured; one line, exit 2."""
    repo = tmp_path / "repo"
    assert run_cli(capsys, "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo", repo,
                   "--no-verify").code == 0
    assert json.loads((repo / "tiny" / "1" / "model.json").read_text())["max_model_len"] == 256
    result = run_cli(capsys, "tune-batching", "tiny", "--repo", repo, "--ttft-p99-ms", "500", "--itl-p99-ms", "50",
                     "--low-rps", "1", "--peak-rps", "2", "--input-tokens", "240", "--output-tokens", "32")
    assert result.code == 2, result.err
    assert "prompts of 240 tokens and 32 generated do not fit tiny's max_model_len of 256 tokens" in result.err
    assert "starting the engine" not in result.err and "Traceback" not in result.err
