"""config.pbtxt of the Triton TensorRT-LLM layout, built through the ModelConfig schema from an engine.

The layout is the one of tensorrtllm_backend's ``all_models/inflight_batcher_llm`` (preprocessing →
tensorrt_llm → postprocessing, joined by an ensemble, and optionally tensorrt_llm_bls), with trm's names
``<name>_preprocessing`` … so that several LLMs share one repository. Upstream fills text templates
(``${triton_max_batch_size}`` …) with ``fill_template.py``; a forgotten key leaves a placeholder that
Triton rejects at load time. Here every value comes from the engine's own config.json (``EngineConfig``)
or a typed option, every message is a ``ModelConfig`` protobuf, and the text is produced by
``repo_manager.core.config`` — there is no template and no placeholder to forget.

The LLM-API layout (``all_models/llmapi``: one Python model and a ``model.yaml`` of ``LLM`` arguments)
is built by ``llmapi_config`` / ``llmapi_yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError
from repo_manager.ops.llm import trtllm_interface as io
from repo_manager.ops.llm.engine import EngineConfig
from repo_manager.ops.llm.triton_models import common as route

mc = cfg.mc
BATCHING_STRATEGIES = ("inflight_fused_batching", "v1")
SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")
ROLES = ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


@dataclass(frozen=True)
class ServingOptions:
    """How Triton serves the engine; the engine's own limits come from its config.json."""

    batching_strategy: str = "inflight_fused_batching"
    batch_scheduler_policy: str = "guaranteed_no_evict"
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_tokens_in_paged_kv_cache: int | None = None
    """From the memory plan: the KV cache never grows past what the plan counted."""
    decoupled: bool = False
    """Streaming: tokens are sent as they are generated (Triton decoupled mode)."""
    max_queue_delay_microseconds: int = 0
    instances: int = 1
    """Pre/post-processing instances."""
    exclude_input_in_output: bool = True

    def check(self, engine: EngineConfig | None = None) -> ServingOptions:
        if self.batching_strategy not in BATCHING_STRATEGIES:
            raise InputError(f"batching strategy {self.batching_strategy!r} is not one of "
                             f"{', '.join(BATCHING_STRATEGIES)}")
        if self.batch_scheduler_policy not in SCHEDULER_POLICIES:
            raise InputError(f"scheduler policy {self.batch_scheduler_policy!r} is not one of "
                             f"{', '.join(SCHEDULER_POLICIES)}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction <= 1:
            raise InputError("kv_cache_free_gpu_mem_fraction must be in (0, 1]")
        if self.instances < 1:
            raise InputError("instances must be at least 1")
        if engine is not None and self.batching_strategy == "inflight_fused_batching" and \
                not engine.supports_inflight_batching:
            raise InputError(f"engine {engine.path} was built without paged KV cache, packed input or the GPT "
                             "attention plugin, which in-flight batching needs",
                             hint="rebuild with trtllm-build --paged_kv_cache enable --remove_input_padding "
                                  "enable, or pass --batching-strategy v1")
        return self


def names(name: str) -> dict[str, str]:
    return {role: f"{name}_{role}" for role in ROLES} | {"ensemble": name}


def _tensor(target, name: str, dtype: str, dims: list[int] | tuple[int, ...], *, optional: bool = False,
            ragged: bool = False, scalar: bool = False) -> None:
    tensor = target.add()
    tensor.name = name
    tensor.data_type = cfg.data_type(dtype)
    tensor.dims.extend(dims)
    if optional:
        tensor.optional = True
    if ragged:
        tensor.allow_ragged_batch = True
    if scalar:  # the backend takes a scalar per request: [1] -> []
        tensor.reshape.SetInParent()


_TORCH_TO_TRITON = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}


def _engine_dtype(name: str, origin: str) -> str:
    if name not in _TORCH_TO_TRITON:
        raise InputError(f"{origin}: data type {name!r} is not one of {', '.join(_TORCH_TO_TRITON)}")
    return _TORCH_TO_TRITON[name]


def _tensors(inputs, outputs, config: cfg.ModelConfig, engine: EngineConfig | None = None) -> None:
    """Inputs and outputs from the tables of ``trtllm_interface``; their stand-in data types resolved."""
    resolve = {}
    if engine is not None:
        resolve = {io.LOGITS: _engine_dtype(engine.logits_dtype, f"{engine.path} logits_dtype"),
                   io.ENCODER_FEATURES: _engine_dtype(engine.dtype, f"{engine.path} dtype")}
    for target, table in ((config.input, inputs), (config.output, outputs)):
        for t in table:
            _tensor(target, t.name, resolve.get(t.dtype, t.dtype), t.dims, optional=t.optional, ragged=t.ragged,
                    scalar=t.scalar)


def _parameters(config: cfg.ModelConfig, values: dict[str, Any]) -> None:
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = text


def _instances(config: cfg.ModelConfig, count: int, kind: str = "KIND_CPU") -> None:
    group = config.instance_group.add()
    group.count = count
    group.kind = mc.ModelInstanceGroup.Kind.Value(kind)


def preprocessing_config(name: str, engine: EngineConfig, options: ServingOptions) -> cfg.ModelConfig:
    """Tokenizes the prompt, the stop/bad words and the embedding bias words (upstream's inputs and outputs)."""
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=engine.max_batch_size)
    _tensors(io.PREPROCESSING_INPUTS, io.PREPROCESSING_OUTPUTS, config)
    _parameters(config, {"tokenizer_dir": "tokenizer", "add_special_tokens": True,
                         "max_input_len": engine.max_input_len, "max_seq_len": engine.max_seq_len,
                         "vocab_size": engine.shape.vocab_size})
    _instances(config, options.instances)
    return config


def postprocessing_config(name: str, engine: EngineConfig, options: ServingOptions) -> cfg.ModelConfig:
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=engine.max_batch_size)
    _tensors(io.POSTPROCESSING_INPUTS, io.POSTPROCESSING_OUTPUTS, config)
    _parameters(config, {"tokenizer_dir": "tokenizer", "skip_special_tokens": True})
    _instances(config, options.instances)
    return config


def tensorrt_llm_config(name: str, engine: EngineConfig, options: ServingOptions,
                        gpt_model_path: str | Path) -> cfg.ModelConfig:
    """The engine model: limits from the engine's config.json, serving choices from ``options``."""
    options.check(engine)
    config = cfg.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=engine.max_batch_size)
    config.model_transaction_policy.decoupled = options.decoupled
    config.dynamic_batching.preferred_batch_size.append(engine.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_microseconds
    _tensors(io.ENGINE_INPUTS, io.ENGINE_OUTPUTS, config, engine)
    # the backend places the engine on GPUs itself (gpu_device_ids); Triton's instance is a CPU one
    _instances(config, 1)
    params: dict[str, Any] = {
        "gpt_model_type": options.batching_strategy, "gpt_model_path": str(gpt_model_path),
        "max_beam_width": engine.max_beam_width, "batch_scheduler_policy": options.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": options.kv_cache_free_gpu_mem_fraction,
        "max_attention_window_size": engine.max_seq_len, "exclude_input_in_output": options.exclude_input_in_output,
        "enable_kv_cache_reuse": False, "enable_chunked_context": False, "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "decoupled": options.decoupled,
    }
    if options.max_tokens_in_paged_kv_cache:
        params["max_tokens_in_paged_kv_cache"] = options.max_tokens_in_paged_kv_cache
    _parameters(config, params)
    return config


def _step(config: cfg.ModelConfig, model: str, inputs: dict[str, str], outputs: dict[str, str]):
    step = config.ensemble_scheduling.step.add()
    step.model_name = model
    step.model_version = -1
    for key, value in inputs.items():
        step.input_map[key] = value
    for key, value in outputs.items():
        step.output_map[key] = value
    return step


def ensemble_config(name: str, engine: EngineConfig) -> cfg.ModelConfig:
    """Upstream's ensemble: its inputs, outputs and wiring, with trm's member names."""
    member = names(name)
    config = cfg.ModelConfig(name=name, platform="ensemble", max_batch_size=engine.max_batch_size)
    _tensors(io.ENSEMBLE_INPUTS, io.ENSEMBLE_OUTPUTS, config, engine)
    _step(config, member["preprocessing"], route.PREPROCESSING_FROM_REQUEST,
          {output: wire for output, wire in route.ENGINE_FROM_PREPROCESSING.values()})
    _step(config, member["tensorrt_llm"],
          {target: wire for target, (_, wire) in route.ENGINE_FROM_PREPROCESSING.items()} | route.ENGINE_FROM_REQUEST,
          route.ENGINE_TOKENS | {output: output for output in route.RESPONSE_OUTPUTS})
    _step(config, member["postprocessing"], {"TOKENS_BATCH": route.ENGINE_TOKENS["output_ids"],
                                             "SEQUENCE_LENGTH": route.ENGINE_TOKENS["sequence_length"]},
          {"OUTPUT": "text_output"})
    return config


def bls_config(name: str, engine: EngineConfig, options: ServingOptions) -> cfg.ModelConfig:
    """The BLS alternative to the ensemble: the same request in, (streamed) text out."""
    member = names(name)
    config = cfg.ModelConfig(name=member["tensorrt_llm_bls"], backend="python", max_batch_size=engine.max_batch_size)
    config.model_transaction_policy.decoupled = options.decoupled
    _tensors(io.BLS_INPUTS, io.BLS_OUTPUTS, config, engine)
    _instances(config, options.instances)
    _parameters(config, {"preprocessing_model_name": member["preprocessing"],
                         "tensorrt_llm_model_name": member["tensorrt_llm"],
                         "postprocessing_model_name": member["postprocessing"], "decoupled": options.decoupled})
    return config


# ----------------------------------------------------------------------------------------- LLM API

_LLMAPI_INPUTS = [t for t in io.ENSEMBLE_INPUTS
                  if t.name in ("text_input", "max_tokens", "temperature", "top_k", "top_p", "random_seed", "stream")]
"""what trm's llmapi model.py reads (a subset of the ensemble's, same names and types)"""


def llmapi_config(name: str, decoupled: bool) -> cfg.ModelConfig:
    """One Python model (trm's llmapi model.py); TensorRT-LLM batches inside, so max_batch_size is 0."""
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.model_transaction_policy.decoupled = decoupled
    for tensor in _LLMAPI_INPUTS:
        _tensor(config.input, tensor.name, tensor.dtype, tensor.dims, optional=tensor.optional)
    _tensor(config.output, "text_output", "STRING", [-1])
    # the LLM places itself on the GPUs (tensor_parallel_size); KIND_MODEL leaves device choice to it
    _instances(config, 1, "KIND_MODEL")
    return config


def llmapi_yaml(*, tp: int, max_batch_size: int, max_seq_len: int, max_num_tokens: int,
                kv_fraction: float, max_kv_tokens: int | None, decoupled: bool,
                dtype: str | None = None) -> dict[str, Any]:
    """model.yaml for the LLM-API layout: LLM arguments plus ``triton_config``."""
    data: dict[str, Any] = {
        "model": "checkpoint", "backend": "pytorch", "tensor_parallel_size": tp, "pipeline_parallel_size": 1,
        "max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_num_tokens": max_num_tokens,
        "kv_cache_config": {"free_gpu_memory_fraction": kv_fraction},
        "triton_config": {"max_batch_size": 0, "decoupled": decoupled},
    }
    if max_kv_tokens:
        data["kv_cache_config"]["max_tokens"] = max_kv_tokens
    if dtype in ("fp16", "bf16"):
        data["dtype"] = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    return data
