"""TensorRT-LLM engine folders: their config.json, their fingerprint, and building them.

An engine folder, as ``trtllm-build`` (TensorRT-LLM ≥ 0.8) writes it, holds ``config.json`` and one
``rank<N>.engine`` per GPU of the world (tp × pp). config.json has three sections, read by the runtime in
``cpp/tensorrt_llm/runtime/gptJsonConfig.cpp`` (NVIDIA/TensorRT-LLM):

- ``version``: the TensorRT-LLM version that built it;
- ``pretrained_config``: the model (``architecture``, ``dtype``, layers, heads, ``num_key_value_heads``,
  ``vocab_size``, ``mapping`` {``world_size``, ``tp_size``, ``pp_size``}, ``quantization`` {``quant_algo``,
  ``kv_cache_quant_algo``});
- ``build_config``: the limits baked into the engine (``max_batch_size``, ``max_input_len``,
  ``max_seq_len`` — older builds: ``max_output_len`` — ``max_beam_width``, ``max_num_tokens``) and
  ``plugin_config`` (``paged_kv_cache``, ``tokens_per_block``, ``remove_input_padding``,
  ``gpt_attention_plugin``), which in-flight batching needs.

A TensorRT engine only deserializes on the GPU architecture (compute capability) and TensorRT version it
was built with; the **fingerprint** records them with the CUDA and TensorRT-LLM versions, so that
``trm doctor`` and ``check_engine_compatible`` can refuse an engine before Triton fails to load it.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from repo_manager.adapters.process import ManagedProcess
from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.ops.llm.plan import DEFAULT_UTILIZATION, MemoryPlan, PlanRequest, plan_memory
from repo_manager.ops.llm.shape import ModelShape, read_config_json, shape_from_config

FINGERPRINT_FILE = "trm-build.json"
"""Written next to an engine by trm's builder: the node facts of the build (Triton ignores it)."""


@dataclass(frozen=True)
class EngineConfig:
    path: Path
    version: str
    architecture: str
    dtype: str
    tp_size: int
    pp_size: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    max_num_tokens: int | None
    paged_kv_cache: bool
    remove_input_padding: bool
    gpt_attention_plugin: bool
    tokens_per_block: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    shape: ModelShape
    logits_dtype: str = "float32"
    """``pretrained_config.logits_dtype``: the data type of the context and generation logits outputs."""

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def supports_inflight_batching(self) -> bool:
        return self.paged_kv_cache and self.remove_input_padding and self.gpt_attention_plugin

    def summary(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("shape")
        data["path"] = str(self.path)
        return data


def _need(section: dict[str, Any], key: str, origin: str, kind: type = int) -> Any:
    value = section.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise InputError(f"{origin}: {key} is missing or not {kind.__name__}",
                         hint="is this the config.json that trtllm-build wrote next to the engine?")
    return value


def parse_engine_config(data: dict[str, Any], path: Path, origin: str = "config.json") -> EngineConfig:
    if not isinstance(data.get("pretrained_config"), dict) or not isinstance(data.get("build_config"), dict):
        raise InputError(f"{origin} is not a TensorRT-LLM engine config (no pretrained_config/build_config)",
                         hint="engines built by TensorRT-LLM 0.8 or later are supported")
    pretrained, build = data["pretrained_config"], data["build_config"]
    mapping = pretrained.get("mapping") or {}
    plugins = build.get("plugin_config") or {}
    quant = pretrained.get("quantization") or {}
    max_input = _need(build, "max_input_len", origin)
    max_seq = build.get("max_seq_len")
    if not isinstance(max_seq, int):  # builds before 0.11 record max_output_len instead
        max_seq = max_input + _need(build, "max_output_len", origin)
    return EngineConfig(
        path=path, version=str(data.get("version", "unknown")),
        architecture=_need(pretrained, "architecture", origin, str), dtype=_need(pretrained, "dtype", origin, str),
        tp_size=int(mapping.get("tp_size", 1)), pp_size=int(mapping.get("pp_size", 1)),
        max_batch_size=_need(build, "max_batch_size", origin), max_input_len=max_input, max_seq_len=max_seq,
        max_beam_width=int(build.get("max_beam_width", 1)),
        max_num_tokens=build.get("max_num_tokens") if isinstance(build.get("max_num_tokens"), int) else None,
        paged_kv_cache=bool(plugins.get("paged_kv_cache", False)),
        remove_input_padding=bool(plugins.get("remove_input_padding", False)),
        gpt_attention_plugin=plugins.get("gpt_attention_plugin") not in (None, False, "disable"),
        tokens_per_block=int(plugins.get("tokens_per_block", 64)),
        quant_algo=quant.get("quant_algo"), kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
        shape=shape_from_config(data, origin), logits_dtype=str(pretrained.get("logits_dtype", "float32")))


def read_engine(engine_dir: str | Path) -> EngineConfig:
    """The engine folder's config, after checking that every rank's engine file is there."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise InputError(f"engine folder {engine_dir} does not exist")
    data, file = read_config_json(engine_dir)
    engine = parse_engine_config(data, engine_dir, str(file))
    missing = [f"rank{r}.engine" for r in range(engine.world_size) if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise InputError(f"engine folder {engine_dir} lacks {', '.join(missing)} (world size {engine.world_size})",
                         hint="point --engine-dir at the output folder of trtllm-build")
    return engine


_QUANT = {"W4A16": "int4", "W4A16_AWQ": "int4", "W4A16_GPTQ": "int4", "W4A8_AWQ": "int4", "W8A16": "int8",
          "W8A8_SQ_PER_CHANNEL": "int8", "FP8": "fp8", "INT8": "int8"}
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def engine_plan_request(engine: EngineConfig, gpu_memory_gib: float, *,
                        kv_cache_dtype: str | None = None) -> PlanRequest:
    """The memory-plan request an engine implies: its precision, limits and tensor parallelism."""
    dtype = _QUANT.get(engine.quant_algo or "", _DTYPES.get(engine.dtype, "bf16"))
    kv = {"FP8": "fp8", "INT8": "int8"}.get(engine.kv_cache_quant_algo or "", kv_cache_dtype)
    if kv is None and dtype == "fp32":
        kv = "fp32"
    return PlanRequest(gpu_memory_gib=gpu_memory_gib, dtype=dtype, kv_cache_dtype=kv,
                       max_batch_size=engine.max_batch_size, max_seq_len=engine.max_seq_len, tp=engine.tp_size,
                       max_num_tokens=engine.max_num_tokens or 8192)


def plan_for(path: str | Path, gpu_memory_gib: float, *, dtype: str | None = None,
             kv_cache_dtype: str | None = None, max_batch_size: int | None = None, max_seq_len: int | None = None,
             tp: int | None = None, max_num_tokens: int | None = None,
             utilization: float = DEFAULT_UTILIZATION) -> MemoryPlan:
    """Plan a checkpoint or an engine folder. What is not given comes from the engine's build_config (for
    an engine) or the plan's defaults (batch 1, the model's maximum length, tp 1, 8192 tokens per step)."""
    data, file = read_config_json(path)
    shape = shape_from_config(data, str(file))
    base = PlanRequest(gpu_memory_gib=gpu_memory_gib)
    if "build_config" in data:
        base = engine_plan_request(parse_engine_config(data, Path(path), str(file)), gpu_memory_gib)
    given = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "max_batch_size": max_batch_size,
             "max_seq_len": max_seq_len, "tp": tp, "max_num_tokens": max_num_tokens}
    request = replace(base, utilization=utilization, **{k: v for k, v in given.items() if v is not None})
    return plan_memory(shape, request)


def check_engine_matches(engine: EngineConfig, checkpoint: ModelShape, origin: str) -> None:
    """An engine built from another model must not be published under this checkpoint's name."""
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
        ours, theirs = getattr(engine.shape, field), getattr(checkpoint, field)
        if field == "vocab_size" and ours == -(-theirs // engine.tp_size) * engine.tp_size:
            continue  # TensorRT-LLM pads the vocabulary to a multiple of tp
        if ours != theirs:
            raise InputError(f"engine {engine.path} has {field} {getattr(engine.shape, field)}, the checkpoint "
                             f"{origin} has {getattr(checkpoint, field)}: it was built from another model")


# ------------------------------------------------------------------------------------------ fingerprint

@dataclass(frozen=True)
class Fingerprint:
    """What an engine is bound to. ``compute_capability`` e.g. "9.0" (H100/H200), "8.9" (L4, RTX 4090)."""

    compute_capability: str
    tensorrt_llm_version: str
    tensorrt_version: str | None = None
    cuda_version: str | None = None
    gpu_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})


def engine_fingerprint(engine: EngineConfig, *, compute_capability: str | None = None,
                       tensorrt_version: str | None = None, cuda_version: str | None = None,
                       gpu_name: str | None = None) -> Fingerprint:
    """Options first, then the build record trm's builder left next to the engine."""
    recorded: dict[str, Any] = {}
    record = engine.path / FINGERPRINT_FILE
    if record.is_file():
        try:
            recorded = json.loads(record.read_text())
        except ValueError as exc:
            raise InputError(f"{record} is not valid JSON") from exc
    capability = compute_capability or recorded.get("compute_capability")
    if not capability:
        raise InputError(f"the GPU architecture engine {engine.path} was built for is unknown",
                         hint="pass --compute-capability (e.g. 9.0 for H100/H200, 8.9 for L4), as reported by "
                              "`nvidia-smi --query-gpu=compute_cap --format=csv` on the build machine")
    check_capability(capability)
    return Fingerprint(compute_capability=capability,
                       tensorrt_llm_version=str(recorded.get("tensorrt_llm_version") or engine.version),
                       tensorrt_version=tensorrt_version or recorded.get("tensorrt_version"),
                       cuda_version=cuda_version or recorded.get("cuda_version"),
                       gpu_name=gpu_name or recorded.get("gpu_name"))


def check_capability(value: str) -> str:
    parts = value.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise InputError(f"compute capability {value!r} is not MAJOR.MINOR (e.g. 9.0)")
    return value


# ---------------------------------------------------------------------------------------------- build

@dataclass(frozen=True)
class BuildOptions:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    dtype: str | None = None
    tp: int = 1

    def trtllm_build_args(self) -> list[str]:
        """The limits as trtllm-build (and trm's LLM-API worker) take them."""
        args = ["--max_batch_size", str(self.max_batch_size), "--max_input_len", str(self.max_input_len),
                "--max_seq_len", str(self.max_seq_len), "--max_beam_width", str(self.max_beam_width),
                "--max_num_tokens", str(self.max_num_tokens)]
        return args


def builder_command(builder: str | None, checkpoint: Path, output: Path, options: BuildOptions) -> list[str]:
    """The build command line.

    ``builder`` is a command prefix (``trtllm-build``, or ``docker run --gpus all -v … <image> trtllm-build``
    for an NGC TensorRT-LLM container) that takes trtllm-build's options; it is given a TensorRT-LLM
    checkpoint. Without one, a Hugging Face checkpoint goes through trm's worker
    (``python -m repo_manager.ops.llm.build_worker``), which builds with TensorRT-LLM's LLM API and records the
    fingerprint; a TensorRT-LLM checkpoint goes to ``trtllm-build``.
    """
    data, _ = read_config_json(checkpoint)
    is_trtllm_checkpoint = "architecture" in data and "mapping" in data
    if builder:
        prefix = shlex.split(builder)
    elif is_trtllm_checkpoint:
        prefix = ["trtllm-build"]
    else:
        prefix = [sys.executable, "-m", "repo_manager.ops.llm.build_worker"]
        if options.dtype:
            prefix += ["--dtype", options.dtype]
        prefix += ["--tp", str(options.tp)]
    return [*prefix, "--checkpoint_dir", str(checkpoint), "--output_dir", str(output), *options.trtllm_build_args()]


def run_builder(command: list[str], output: Path, log: Path) -> EngineConfig:
    """Run the build; its output goes to ``log`` and its tail into the error when it fails."""
    output.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    # a managed process: a build (minutes, a GPU) never outlives trm, whatever ends trm
    builder = ManagedProcess(command, log_path=log)
    try:
        builder.start()
    except FileNotFoundError as exc:
        raise InputError(f"engine builder {command[0]!r} not found",
                         hint="install TensorRT-LLM (pip install 'trm[trtllm]') on a GPU machine, pass "
                              "--builder 'docker run --gpus all … trtllm-build', or --engine-dir") from exc
    try:
        code = builder.wait()
    finally:
        builder.stop()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise CompatibilityError(f"engine build failed (exit {code}): {shlex.join(command)}\n{tail}",
                       hint="TensorRT-LLM builds need an NVIDIA GPU; see the log above")
    return read_engine(output)
