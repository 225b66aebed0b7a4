"""The memory planner against published figures and hand-computed cases (no GPU needed).

Fixtures in tests/data/llm/ are the published config.json files of the models (Hugging Face model cards:
meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, mistralai/Mistral-7B-Instruct-v0.3,
Qwen/Qwen2.5-7B-Instruct, Qwen/Qwen2.5-0.5B, mistralai/Mixtral-8x7B-v0.1), copied as data.
Published figures checked: 8B ≈ 16 GB at FP16 and ≈ 5 GB at 4-bit; 70B ≈ 140 GB at FP16; Llama 3.1 8B
at BF16 on a 24 GB GPU leaves ≈ 45k tokens of KV cache (vLLM's start-up report for that setup).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.ops.llm.plan import GB, PlanRequest, kv_bytes_per_token, plan_memory, require_fit
from repo_manager.ops.llm.shape import FAMILY_DEFAULTS, load_shape, parameter_breakdown, shape_from_config

DATA = Path(__file__).parent / "data" / "llm"
LLAMA8 = DATA / "llama-3.1-8b.json"
LLAMA70 = DATA / "llama-3.1-70b.json"
MISTRAL = DATA / "mistral-7b-v0.3.json"
QWEN7 = DATA / "qwen2.5-7b.json"
QWEN05 = DATA / "qwen2.5-0.5b.json"
MIXTRAL = DATA / "mixtral-8x7b-v0.1.json"


# ------------------------------------------------------------------------------------ published figures

def test_8b_model_is_about_16_gb_at_fp16_and_5_gb_at_4_bit():
    shape = load_shape(LLAMA8)
    fp16 = plan_memory(shape, PlanRequest(80, dtype="fp16"))
    int4 = plan_memory(shape, PlanRequest(80, dtype="int4"))
    assert fp16.parameters.total == 8_030_261_248  # Meta's published 8.03B
    assert 15.5 < fp16.weight_bytes / GB < 16.5
    assert 4.5 < int4.weight_bytes / GB < 5.5


def test_70b_model_needs_about_140_gb_at_fp16():
    plan = plan_memory(load_shape(LLAMA70), PlanRequest(141, dtype="fp16"))
    assert 70.0e9 < plan.parameters.total < 71.0e9  # published 70.6B
    assert 138 < plan.weight_bytes / GB < 143
    assert not plan.fits  # 141 GB of weights do not fit one 141 GB GPU with any KV cache
    two = plan_memory(load_shape(LLAMA70), PlanRequest(80, dtype="fp16", tp=2, max_seq_len=8192))
    assert two.fits and two.weight_bytes_per_gpu == pytest.approx(plan.weight_bytes / 2, abs=1)


def test_llama_3_1_8b_bf16_on_24_gb_leaves_about_45k_tokens_and_refuses_128k_context():
    plan = plan_memory(load_shape(LLAMA8), PlanRequest(24))
    assert plan.dtype == "bf16" and plan.kv_bytes_per_token == 131_072
    assert 42_000 <= plan.max_tokens <= 48_000
    assert plan.max_seq_len == 131_072 and not plan.fits
    with pytest.raises(CompatibilityError, match="max_seq_len 131,072") as info:
        require_fit(plan)
    assert f"--max-seq-len to {plan.max_tokens}" in info.value.hint
    shorter = plan_memory(load_shape(LLAMA8), PlanRequest(24, max_seq_len=plan.max_tokens))
    assert require_fit(shorter).fits and shorter.concurrent_full_sequences == 1


# -------------------------------------------------------------------------------- hand-computed cases

def _dense(h, layers, heads, kv, head_dim, inter, vocab, *, tied=False, qkv_bias=False):
    attention = h * heads * head_dim * 2 + 2 * h * kv * head_dim
    if qkv_bias:
        attention += heads * head_dim + 2 * kv * head_dim
    mlp = 3 * h * inter
    return vocab * h * (1 if tied else 2) + layers * (attention + mlp + 2 * h) + h


def test_llama_parameters_and_kv_match_hand_computation():
    shape = load_shape(LLAMA8)
    assert parameter_breakdown(shape).total == _dense(4096, 32, 32, 8, 128, 14336, 128256)
    # 2 (K,V) × 32 layers × 8 KV heads × 128 × 2 bytes
    assert kv_bytes_per_token(shape, "bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024


def test_mistral_gqa_kv_cache_is_a_quarter_of_full_attention():
    shape = load_shape(MISTRAL)
    assert parameter_breakdown(shape).total == _dense(4096, 32, 32, 8, 128, 14336, 32768) == 7_248_023_552
    mha = shape_from_config({**json.loads(MISTRAL.read_text()), "num_key_value_heads": 32})
    assert kv_bytes_per_token(mha, "fp16") == 4 * kv_bytes_per_token(shape, "fp16")
    assert kv_bytes_per_token(shape, "fp8") == 2 * 32 * 8 * 128 * 1


def test_qwen_gqa_with_qkv_bias_and_tied_embeddings():
    qwen7 = load_shape(QWEN7)
    assert qwen7.qkv_bias and qwen7.num_kv_heads == 4 and qwen7.head_dim == 128
    assert parameter_breakdown(qwen7).total == _dense(3584, 28, 28, 4, 128, 18944, 152064, qkv_bias=True)
    assert 7.6e9 < parameter_breakdown(qwen7).total < 7.62e9  # published 7.61B
    assert kv_bytes_per_token(qwen7, "bf16") == 2 * 28 * 4 * 128 * 2 == 57_344
    qwen05 = load_shape(QWEN05)
    params = parameter_breakdown(qwen05)
    assert qwen05.tied_embeddings and params.lm_head == 0
    assert params.total == _dense(896, 24, 14, 2, 64, 4864, 151936, tied=True, qkv_bias=True)
    assert 0.49e9 < params.total < 0.50e9  # published 0.49B


def test_mixtral_counts_every_expert_in_weights_but_kv_like_a_dense_model():
    shape = load_shape(MIXTRAL)
    assert shape.num_experts == 8 and shape.experts_per_token == 2
    params = parameter_breakdown(shape)
    attention = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024)
    experts = 32 * 8 * 3 * 4096 * 14336
    router = 32 * 4096 * 8
    assert params.attention == attention and params.mlp == experts and params.router == router
    assert params.total == 2 * 32000 * 4096 + attention + experts + router + 32 * 2 * 4096 + 4096
    assert 46.6e9 < params.total < 46.8e9  # published 46.7B
    assert kv_bytes_per_token(shape, "bf16") == kv_bytes_per_token(load_shape(MISTRAL), "bf16")
    # 93 GB in BF16: not on one 80 GB GPU, yes on two
    assert not plan_memory(shape, PlanRequest(80, max_seq_len=4096)).fits
    assert plan_memory(shape, PlanRequest(80, max_seq_len=32768, tp=2)).fits


def test_tensor_parallel_splits_kv_heads_and_never_below_one_head():
    shape = load_shape(QWEN05)  # 2 KV heads
    assert kv_bytes_per_token(shape, "bf16", tp=2) == kv_bytes_per_token(shape, "bf16") // 2
    assert kv_bytes_per_token(shape, "bf16", tp=4) == kv_bytes_per_token(shape, "bf16", tp=2)  # replicated


def test_engine_config_json_gives_the_same_shape_as_the_checkpoint():
    hf = json.loads(LLAMA8.read_text())
    engine = {"version": "0.12.0", "pretrained_config": {
        "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": 131072, "hidden_act": "silu",
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}}, "build_config": {"max_batch_size": 8}}
    a, b = shape_from_config(hf), shape_from_config(engine)
    assert parameter_breakdown(a).total == parameter_breakdown(b).total
    assert kv_bytes_per_token(a, "bf16") == kv_bytes_per_token(b, "bf16")


def test_bad_configs_and_requests_are_refused_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_shape(tmp_path)
    with pytest.raises(InputError, match="no num_attention_heads"):
        shape_from_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10})
    with pytest.raises(InputError, match="not a multiple"):
        shape_from_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 6,
                           "num_key_value_heads": 4, "vocab_size": 10})
    with pytest.raises(InputError, match="GPU memory"):
        plan_memory(load_shape(LLAMA8), PlanRequest(0))


# --------------------------------------------------------------------------------------------- CLI

def test_plan_command_prints_the_arithmetic_and_exits_11_when_the_context_does_not_fit(capsys):
    result = run_cli(capsys, "plan", LLAMA8, "--gpu-memory", "24")
    assert result.code == 11
    assert "131,072 bytes" in result.out and "16.06 GB" in result.out
    assert "--max-seq-len to" in result.err
    ok = run_cli(capsys, "plan", LLAMA8, "--gpu-memory", "24", "--max-seq-len", "32768", "--json")
    assert ok.code == 0
    data = ok.json()
    assert data["fits"] and data["kv_bytes_per_token"] == 131072 and data["parameters"]["total"] == 8030261248
    missing = run_cli(capsys, "plan", "no-such-dir", "--gpu-memory", "24")
    assert missing.code == 3 and "config.json" in missing.err


def test_plan_of_an_engine_folder_takes_the_engines_limits(tmp_path, capsys):
    import llm_fixtures as fx

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt", tokenizer=False)
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, tp=2, max_batch_size=16, max_seq_len=128)
    data = run_cli(capsys, "plan", engine, "--gpu-memory", "24", "--json").json()
    assert data["request"]["max_seq_len"] == 128 and data["request"]["tp"] == 2
    assert data["request"]["max_batch_size"] == 16 and data["request"]["dtype"] == "fp16"
    data = run_cli(capsys, "plan", engine, "--gpu-memory", "24", "--max-seq-len", "64", "--json").json()
    assert data["request"]["max_seq_len"] == 64 and data["request"]["tp"] == 2


def test_fp32_weights_take_four_bytes():
    plan = plan_memory(load_shape(QWEN05), PlanRequest(24, dtype="fp32"))
    assert plan.weight_bytes == 4 * plan.parameters.total and plan.kv_cache_dtype == "fp32"


# ------------------------------------------------------------- family defaults, against transformers itself

GEMMA2 = DATA / "gemma-2-9b.json"  # google/gemma-2-9b's config.json: no tie_word_embeddings (tied by default)
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
            "gemma3_text", "phi3", "olmo", "olmo2", "granite"]


def _transformers_count(data: dict) -> int:
    """Parameters of the model transformers builds from ``data``, on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(data["model_type"],
                                               **{k: v for k, v in data.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding's own tensor: once


def test_gemma2_without_tie_word_embeddings_is_tied_as_transformers_defaults_it():
    data = json.loads(GEMMA2.read_text())
    assert "tie_word_embeddings" not in data
    shape = load_shape(GEMMA2)
    assert shape.tied_embeddings and parameter_breakdown(shape).lm_head == 0
    assert parameter_breakdown(shape).total == _transformers_count(data)  # 9.24B, Google's published figure
    # the whole 8k context fits a 24 GB GPU at BF16 (an untied head, +0.92B parameters, would not leave room)
    assert plan_memory(shape, PlanRequest(24, dtype="bf16")).fits


@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.stem)
def test_published_configs_count_like_transformers(path):
    assert parameter_breakdown(load_shape(path)).total == _transformers_count(json.loads(path.read_text()))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_counts_like_transformers_when_its_config_omits_every_default(family):
    """A small model of each family, its config.json written with every value equal to the family's
    default left out (as save_pretrained does): trm fills the same defaults and counts the same."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=512, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = transformers.AutoConfig.for_model(family, **small)
    if hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = 48
    defaults = transformers.CONFIG_MAPPING[family]().to_dict()
    data = {k: v for k, v in config.to_dict().items() if k not in defaults or defaults[k] != v}
    data["model_type"] = family
    assert parameter_breakdown(shape_from_config(data)).total == _transformers_count(data)


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_family_defaults_are_transformers_own(family):
    import inspect

    transformers = pytest.importorskip("transformers")
    config_class = transformers.CONFIG_MAPPING[family]
    parameters = inspect.signature(config_class.__init__).parameters
    for key, value in FAMILY_DEFAULTS[family].items():
        theirs = parameters[key].default if key in parameters else getattr(config_class(), key)
        assert theirs == value, (family, key)


@pytest.mark.parametrize(("quantization", "weights"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4"),
    ({"quant_method": "gptq", "bits": 8}, "int8"),
    ({"quant_method": "fp8"}, "fp8"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int"}, "targets": ["Linear"]}}}, "int8"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
     "fp8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "int4"),
])
def test_a_quantized_checkpoint_is_planned_at_its_own_weight_type(quantization, weights):
    """A checkpoint's quantization_config (as AWQ, GPTQ, compressed-tensors, fp8 and bitsandbytes write it) is
    its default weight type in the plan: an 8B AWQ checkpoint is about 5 GB, not bf16's 16 GB."""
    data = json.loads(LLAMA8.read_text()) | {"quantization_config": quantization}
    shape = shape_from_config(data)
    assert (shape.quantization, shape.quantization_method) == (weights, quantization["quant_method"])
    plan = plan_memory(shape, PlanRequest(80))
    same = plan_memory(load_shape(LLAMA8), PlanRequest(80, dtype=weights))
    assert plan.dtype == weights and plan.weight_bytes == same.weight_bytes
    assert any(f"from the checkpoint's quantization_config ({quantization['quant_method']})" in s for s in plan.steps)
    assert plan.kv_cache_dtype == "bf16"  # the KV cache stays in the activations' type (torch_dtype bfloat16)


def test_a_quantization_trm_does_not_know_is_planned_at_the_upper_bound_and_says_so():
    data = json.loads(LLAMA8.read_text()) | {"quantization_config": {"quant_method": "hqq", "nbits": 3}}
    plan = plan_memory(shape_from_config(data), PlanRequest(80))
    assert plan.dtype == "bf16" and any("is not one trm plans" in s and "hqq" in s for s in plan.steps)
