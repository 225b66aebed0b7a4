"""config.pbtxt of the Triton TensorRT-LLM layout, built through the ModelConfig schema from an engine.

The layout is the one of tensorrtllm_backend's ``all_models/inflight_batcher_llm`` (preprocessing →
tensorrt_llm → postprocessing, joined by an ensemble, and optionally tensorrt_llm_bls), with trm's names
``<name>_preprocessing`` … so that several LLMs share one repository. Upstream fills text templates
(``${triton_max_batch_size}`` …) with ``fill_template.py``; a forgotten key leaves a placeholder that
Triton rejects at load time. Here every value comes from the engine's own config.json (``EngineConfig``)
or a typed option, every message is a ``ModelConfig`` protobuf, and the text is produced by
``repo_manager.config`` — there is no template and no placeholder to forget.

The LLM-API layout (``all_models/llmapi``: one Python model and a ``model.yaml`` of ``LLM`` arguments)
is built by ``llmapi_config`` / ``llmapi_yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_manager import config as cfg
from repo_manager.errors import InputError
from repo_manager.llm.engine import EngineConfig

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


def _tensor(target, name: str, dtype: str, dims: list[int], *, optional: bool = False, ragged: bool = False,
            scalar: bool = False) -> None:
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


def _parameters(config: cfg.ModelConfig, values: dict[str, Any]) -> None:
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = text


def _instances(config: cfg.ModelConfig, count: int, kind: str = "KIND_CPU") -> None:
    group = config.instance_group.add()
    group.count = count
    group.kind = mc.ModelInstanceGroup.Kind.Value(kind)


def preprocessing_config(name: str, engine: EngineConfig, options: ServingOptions) -> cfg.ModelConfig:
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=engine.max_batch_size)
    _tensor(config.input, "QUERY", "STRING", [1])
    _tensor(config.input, "REQUEST_OUTPUT_LEN", "INT32", [1])
    _tensor(config.output, "INPUT_ID", "INT32", [-1])
    for output in ("REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"):
        _tensor(config.output, output, "INT32", [1])
    _parameters(config, {"tokenizer_dir": "tokenizer", "add_special_tokens": True,
                         "max_input_len": engine.max_input_len, "max_seq_len": engine.max_seq_len})
    _instances(config, options.instances)
    return config


def postprocessing_config(name: str, engine: EngineConfig, options: ServingOptions) -> cfg.ModelConfig:
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=engine.max_batch_size)
    _tensor(config.input, "TOKENS_BATCH", "INT32", [-1, -1])
    _tensor(config.input, "SEQUENCE_LENGTH", "INT32", [-1])
    _tensor(config.output, "OUTPUT", "STRING", [-1])
    _parameters(config, {"tokenizer_dir": "tokenizer", "skip_special_tokens": True})
    _instances(config, options.instances)
    return config


# (name, dtype) of the optional per-request inputs of the tensorrt_llm model; a subset of the backend's.
_ENGINE_OPTIONAL = [("end_id", "INT32"), ("pad_id", "INT32"), ("beam_width", "INT32"), ("temperature", "FP32"),
                    ("runtime_top_k", "INT32"), ("runtime_top_p", "FP32"), ("repetition_penalty", "FP32"),
                    ("len_penalty", "FP32"), ("random_seed", "UINT64"), ("return_log_probs", "BOOL")]


def tensorrt_llm_config(name: str, engine: EngineConfig, options: ServingOptions,
                        gpt_model_path: str | Path) -> cfg.ModelConfig:
    """The engine model: limits from the engine's config.json, serving choices from ``options``."""
    options.check(engine)
    config = cfg.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=engine.max_batch_size)
    config.model_transaction_policy.decoupled = options.decoupled
    config.dynamic_batching.preferred_batch_size.append(engine.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_microseconds
    _tensor(config.input, "input_ids", "INT32", [-1], ragged=True)
    _tensor(config.input, "input_lengths", "INT32", [1], scalar=True)
    _tensor(config.input, "request_output_len", "INT32", [1])
    for input_name, dtype in _ENGINE_OPTIONAL:
        _tensor(config.input, input_name, dtype, [1], optional=True, scalar=True)
    _tensor(config.input, "stop_words_list", "INT32", [2, -1], optional=True, ragged=True)
    _tensor(config.input, "bad_words_list", "INT32", [2, -1], optional=True, ragged=True)
    _tensor(config.input, "streaming", "BOOL", [1], optional=True)
    _tensor(config.output, "output_ids", "INT32", [-1, -1])
    _tensor(config.output, "sequence_length", "INT32", [-1])
    _tensor(config.output, "cum_log_probs", "FP32", [-1])
    _tensor(config.output, "output_log_probs", "FP32", [-1, -1])
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


# ensemble input -> (tensorrt_llm input, dtype): sampling parameters passed straight through
_ENSEMBLE_SAMPLING = {"temperature": ("temperature", "FP32"), "top_k": ("runtime_top_k", "INT32"),
                      "top_p": ("runtime_top_p", "FP32"), "beam_width": ("beam_width", "INT32"),
                      "random_seed": ("random_seed", "UINT64"), "stream": ("streaming", "BOOL")}


def _text_io(config: cfg.ModelConfig, *, with_sampling: bool = True) -> None:
    _tensor(config.input, "text_input", "STRING", [1])
    _tensor(config.input, "max_tokens", "INT32", [1])
    if with_sampling:
        for input_name, (_, dtype) in _ENSEMBLE_SAMPLING.items():
            _tensor(config.input, input_name, dtype, [1], optional=True)
    _tensor(config.output, "text_output", "STRING", [-1])


def ensemble_config(name: str, engine: EngineConfig) -> cfg.ModelConfig:
    """text_input + max_tokens → text_output through the three models, as upstream's ensemble."""
    member = names(name)
    config = cfg.ModelConfig(name=name, platform="ensemble", max_batch_size=engine.max_batch_size)
    _text_io(config)
    _step(config, member["preprocessing"], {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens"},
          {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
           "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID"})
    _step(config, member["tensorrt_llm"],
          {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
           "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_END_ID", "pad_id": "_PAD_ID",
           **{target: source for source, (target, _) in _ENSEMBLE_SAMPLING.items()}},
          {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"})
    _step(config, member["postprocessing"], {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
          {"OUTPUT": "text_output"})
    return config


def bls_config(name: str, options: ServingOptions) -> cfg.ModelConfig:
    """The BLS alternative to the ensemble: one request in, (streamed) text out."""
    member = names(name)
    config = cfg.ModelConfig(name=member["tensorrt_llm_bls"], backend="python", max_batch_size=0)
    config.model_transaction_policy.decoupled = options.decoupled
    _text_io(config)
    _instances(config, options.instances)
    _parameters(config, {"preprocessing_model_name": member["preprocessing"],
                         "tensorrt_llm_model_name": member["tensorrt_llm"],
                         "postprocessing_model_name": member["postprocessing"], "decoupled": options.decoupled})
    return config


# ----------------------------------------------------------------------------------------- LLM API

def llmapi_config(name: str, decoupled: bool) -> cfg.ModelConfig:
    """One Python model (trm's llmapi model.py); TensorRT-LLM batches inside, so max_batch_size is 0."""
    config = cfg.ModelConfig(name=name, backend="python", max_batch_size=0)
    config.model_transaction_policy.decoupled = decoupled
    _text_io(config)
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


def localize_gpt_model_path(config: cfg.ModelConfig, version_dir: str | Path) -> cfg.ModelConfig:
    """A copy of a tensorrt_llm config whose gpt_model_path is ``version_dir`` (absolute).

    The backend needs an absolute engine path. ``trm publish`` writes the path of the version in the
    repository it publishes to; whoever installs the version elsewhere (sync to another root, a load with
    a config override) calls this with the installed version folder.
    """
    localized = cfg.ModelConfig()
    localized.CopyFrom(config)
    if config.backend == "tensorrtllm":
        localized.parameters["gpt_model_path"].string_value = str(Path(version_dir).resolve())
    return localized
