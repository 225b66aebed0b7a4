"""The shape of a decoder-only LLM, read from its config.json, and its parameter count.

Three documents carry the same facts under different keys, and all three are accepted:

- a Hugging Face ``config.json`` (``num_hidden_layers``, ``num_key_value_heads``, ``tie_word_embeddings``,
  ``num_local_experts`` …);
- a TensorRT-LLM checkpoint ``config.json`` (``architecture``, ``mapping``, ``quantization``, ``moe``);
- a TensorRT-LLM engine ``config.json`` as ``trtllm-build`` writes it: ``{"version", "pretrained_config",
  "build_config"}``, whose ``pretrained_config`` is the checkpoint config.

The parameter count is exact arithmetic over the matrices of the architecture (not a lookup of the
model's advertised size), so it can be checked by hand: see ``parameter_breakdown``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from repo_manager.core.errors import InputError

# Architectures whose MLP is gated (gate, up and down projections: three matrices, SwiGLU/GeGLU).
_GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                      "gemma2", "gemma3_text", "phi3", "deepseek_v2", "deepseek_v3", "olmo", "olmo2",
                      "granite", "internlm2", "yi", "baichuan", "exaone"}
_GATED_ACTS = {"silu", "swiglu", "geglu", "gelu_pytorch_tanh"}
# Qwen2 has a bias on its q, k and v projections without saying so in config.json.
_QKV_BIAS_MODEL_TYPES = {"qwen2", "qwen2_moe"}

# The defaults of transformers' own config classes (``LlamaConfig.__init__`` …) for the keys that change
# the parameter count. ``save_pretrained`` leaves out what equals them, so a published config.json may
# omit them: google/gemma-2-9b's has no ``tie_word_embeddings``, and Gemma2Config defaults it to true.
# tests/test_llm_plan.py checks every value against transformers itself. A family not listed here takes
# them from transformers when it is installed (``family_defaults``).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "mistral": {"tie_word_embeddings": False},
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2": {"tie_word_embeddings": False},
    "qwen2_moe": {"tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    "qwen3": {"tie_word_embeddings": False, "head_dim": 128, "attention_bias": False},
    "qwen3_moe": {"tie_word_embeddings": False, "attention_bias": False, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "gemma": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False},
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False},
    "gemma3_text": {"tie_word_embeddings": True, "head_dim": 256, "attention_bias": False},
    "phi3": {"tie_word_embeddings": False},
    "olmo": {"tie_word_embeddings": False, "attention_bias": False},
    "olmo2": {"tie_word_embeddings": False, "attention_bias": False},
    "granite": {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
}
_DEFAULT_KEYS = ("tie_word_embeddings", "head_dim", "attention_bias", "mlp_bias", "num_local_experts",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")

# What a family's modeling code has beyond the Llama layout (read in transformers' modeling_*.py):
# Gemma2/3 norm before and after both the attention and the MLP (4 per layer); Qwen3 and Gemma3 normalise
# q and k per head, OLMo2 over their full width; OLMo's LayerNorm has no weights; Qwen2-MoE gates its
# shared expert with a (hidden -> 1) projection.
_STRUCTURE: dict[str, dict[str, Any]] = {
    "gemma2": {"norms_per_layer": 4},
    "gemma3_text": {"norms_per_layer": 4, "qk_norm": "head"},
    "qwen3": {"qk_norm": "head"},
    "qwen3_moe": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "full"},
    "olmo": {"norm_weights": False},
    "qwen2_moe": {"shared_expert_gate": True},
}


def family_defaults(model_type: str) -> dict[str, Any]:
    """The defaults transformers' config class for ``model_type`` gives the keys that change the count."""
    if model_type in FAMILY_DEFAULTS:
        return FAMILY_DEFAULTS[model_type]
    try:
        from transformers import CONFIG_MAPPING  # noqa: PLC0415 - optional, slow: only for other families

        parameters = inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters
    except (ImportError, KeyError):
        return {}
    return {k: parameters[k].default for k in _DEFAULT_KEYS
            if k in parameters and parameters[k].default is not inspect.Parameter.empty}


@dataclass(frozen=True)
class ModelShape:
    """Everything the memory plan needs about a model, independent of where it was read from."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    """A bias on the attention output projection (``attention_bias`` in Llama-style families)."""
    mlp_bias: bool = False
    norms_per_layer: int = 2
    qk_norm: str = ""
    """"head": q and k normalised per head (head_dim weights each); "full": over their whole width."""
    norm_weights: bool = True
    shared_expert_gate: bool = False
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    torch_dtype: str = "bfloat16"
    quantization: str = ""
    """The weight type a quantized Hugging Face checkpoint stores its linear layers in (``int4``, ``int8``,
    ``fp8``: ``quantized_weights``); "" for an unquantized one, or a method trm does not know."""
    quantization_method: str = ""
    """``quantization_config.quant_method`` as the checkpoint names it (awq, gptq, compressed-tensors, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelShape:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def read_config_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The config.json of a checkpoint folder, an engine folder, or the file itself."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{path} has no config.json", hint="pass a Hugging Face checkpoint folder, a "
                         "TensorRT-LLM engine folder or a config.json file")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{file} is not valid JSON: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise InputError(f"{file} does not hold a JSON object")
    return data, file


def _int(data: dict[str, Any], *keys: str, default: int | None = None, origin: str) -> int:
    for key in keys:
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{origin}: {key} = {value!r} is not a non-negative integer")
            return value
    if default is None:
        raise InputError(f"{origin} has no {keys[0]}", hint="is this the config.json of a decoder-only LLM?")
    return default


def shape_from_config(data: dict[str, Any], origin: str = "config.json") -> ModelShape:
    """A ModelShape from a Hugging Face, TensorRT-LLM checkpoint or TensorRT-LLM engine config."""
    if "pretrained_config" in data:  # engine config.json written by trtllm-build
        data = data["pretrained_config"]
        if not isinstance(data, dict):
            raise InputError(f"{origin}: pretrained_config is not an object")
    text = data.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in data:  # multimodal wrappers
        data = {**data, **text}
    architecture = data.get("architecture") or (data.get("architectures") or ["unknown"])[0]
    model_type = str(data.get("model_type") or _model_type_from_architecture(str(architecture)))
    hugging_face = "architecture" not in data  # a TensorRT-LLM config names its one architecture
    if hugging_face:  # what the config leaves out, transformers' config class fills in
        data = {**family_defaults(model_type), **{k: v for k, v in data.items() if v is not None}}
    structure = _STRUCTURE.get(model_type, {})
    hidden = _int(data, "hidden_size", "n_embd", "d_model", origin=origin)
    layers = _int(data, "num_hidden_layers", "n_layer", "num_layers", origin=origin)
    heads = _int(data, "num_attention_heads", "n_head", origin=origin)
    kv_heads = _int(data, "num_key_value_heads", "num_kv_heads", default=heads, origin=origin) or heads
    head_dim = _int(data, "head_dim", "head_size", default=hidden // max(heads, 1), origin=origin)
    intermediate = _int(data, "intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden,
                        origin=origin)
    vocab = _int(data, "vocab_size", origin=origin)
    max_pos = _int(data, "max_position_embeddings", "n_positions", "max_seq_len", default=4096, origin=origin)
    moe = data.get("moe") if isinstance(data.get("moe"), dict) else {}
    experts = _int({**moe, **data}, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                   default=0, origin=origin)
    top_k = _int({**moe, **data}, "num_experts_per_tok", "top_k", "moe_top_k", default=2 if experts else 0,
                 origin=origin)
    moe_inter = _int(data, "moe_intermediate_size", default=intermediate if experts else 0, origin=origin)
    shared = _int(data, "shared_expert_intermediate_size", default=0, origin=origin)
    if experts and not shared and data.get("n_shared_experts"):
        shared = moe_inter * int(data["n_shared_experts"])
    act = str(data.get("hidden_act") or data.get("hidden_activation") or data.get("activation_function") or "")
    gated = model_type in _GATED_MODEL_TYPES or act in _GATED_ACTS
    if heads == 0 or layers == 0 or hidden == 0 or vocab == 0 or head_dim == 0:
        raise InputError(f"{origin}: layers, heads, head_dim, hidden size and vocabulary must be positive")
    if heads % kv_heads:
        raise InputError(f"{origin}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    tied = bool(data.get("tie_word_embeddings") if hugging_face else data.get("share_embedding_table", False))
    attention_bias = bool(data.get("attention_bias"))
    return ModelShape(
        architecture=str(architecture), model_type=model_type, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        vocab_size=vocab, max_position_embeddings=max_pos, tied_embeddings=tied, gated_mlp=gated,
        qkv_bias=attention_bias or model_type in _QKV_BIAS_MODEL_TYPES, out_bias=attention_bias,
        mlp_bias=bool(data.get("mlp_bias")), norms_per_layer=structure.get("norms_per_layer", 2),
        qk_norm=structure.get("qk_norm", ""), norm_weights=structure.get("norm_weights", True),
        shared_expert_gate=structure.get("shared_expert_gate", False) and shared > 0,
        num_experts=experts, experts_per_token=top_k if experts else 0,
        moe_intermediate_size=moe_inter if experts else 0, shared_expert_intermediate_size=shared,
        torch_dtype=str(data.get("torch_dtype") or data.get("dtype") or "bfloat16"),
        quantization=quantized_weights(data) if hugging_face else "",
        quantization_method=_quant_method(data) if hugging_face else "")


def _quant_method(data: dict[str, Any]) -> str:
    config = data.get("quantization_config")
    return str(config.get("quant_method") or "unnamed")[:40] if isinstance(config, dict) else ""


def quantized_weights(data: dict[str, Any]) -> str:
    """The weight type of a Hugging Face checkpoint's ``quantization_config``, in the memory plan's names: AWQ
    and GPTQ by their ``bits``, compressed-tensors by its first group's ``weights`` (``num_bits``, ``type``),
    fp8, bitsandbytes by ``load_in_4bit``/``load_in_8bit``; "" when there is none or it is not one of these."""
    config = data.get("quantization_config")
    if not isinstance(config, dict):
        return ""
    method = str(config.get("quant_method") or "").lower()
    by_bits = {4: "int4", 8: "int8"}
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "marlin"):
        bits = config.get("bits", config.get("w_bit", 4))
        return by_bits.get(bits, "") if isinstance(bits, int) else ""
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method == "bitsandbytes":
        return "int4" if config.get("load_in_4bit") else "int8" if config.get("load_in_8bit") else ""
    if method == "compressed-tensors":
        groups = config.get("config_groups")
        first = next(iter(groups.values()), None) if isinstance(groups, dict) and groups else None
        weights = first.get("weights") if isinstance(first, dict) else None
        if not isinstance(weights, dict) or not isinstance(weights.get("num_bits"), int):
            return ""
        if weights.get("type") == "float":
            return "fp8" if weights["num_bits"] == 8 else ""
        return by_bits.get(weights["num_bits"], "")
    return ""


def _model_type_from_architecture(architecture: str) -> str:
    lowered = architecture.lower()
    for candidate in ("mixtral", "mistral", "qwen2", "llama", "gemma2", "gemma", "phi3"):
        if candidate in lowered:
            return candidate
    return lowered.removesuffix("forcausallm")


def load_shape(path: str | Path) -> ModelShape:
    data, file = read_config_json(path)
    return shape_from_config(data, str(file))


# ----------------------------------------------------------------------------------- parameter count

@dataclass(frozen=True)
class Parameters:
    """Parameter counts by kind. ``embedding`` stays in 16 bits under weight-only quantization."""

    embedding: int
    lm_head: int
    attention: int
    mlp: int
    router: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.attention + self.mlp + self.router + self.norms

    @property
    def linear(self) -> int:
        """Matrices that a quantized engine stores in the quantized type (lm_head included)."""
        return self.lm_head + self.attention + self.mlp

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def parameter_breakdown(shape: ModelShape) -> Parameters:
    """Exact counts: embeddings, attention (GQA: K and V have ``kv_heads``), MLP (gated: 3 matrices,
    else 2; MoE: every expert, plus shared experts and the router), RMSNorm/LayerNorm weights."""
    h, layers = shape.hidden_size, shape.num_layers
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if shape.qkv_bias:
        attention += q_width + 2 * kv_width
    if shape.out_bias:
        attention += h
    matrices = 3 if shape.gated_mlp else 2
    if shape.num_experts:
        mlp = shape.num_experts * matrices * h * shape.moe_intermediate_size
        mlp += matrices * h * shape.shared_expert_intermediate_size
        router = h * shape.num_experts + (h if shape.shared_expert_gate else 0)
    else:
        mlp = matrices * h * shape.intermediate_size
        if shape.mlp_bias:
            mlp += (matrices - 1) * shape.intermediate_size + h
        router = 0
    norms = shape.norms_per_layer * h
    norms += {"head": 2 * shape.head_dim, "full": q_width + kv_width}.get(shape.qk_norm, 0)
    embedding = shape.vocab_size * h
    return Parameters(embedding=embedding, lm_head=0 if shape.tied_embeddings else embedding,
                      attention=layers * attention, mlp=layers * mlp, router=layers * router,
                      norms=(layers * norms + h) if shape.norm_weights else 0)
