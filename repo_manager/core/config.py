"""config.pbtxt through Triton's own ModelConfig schema: the one place that reads and writes it.

Nothing in trm formats config.pbtxt with strings. ``read_config`` parses with protobuf ``text_format``
against ``tritonclient.grpc.model_config_pb2.ModelConfig``, so a config that Triton would reject for
its syntax is rejected here first; ``write_config`` writes atomically (temp file + rename).
``config_to_json`` produces the JSON form Triton's load API takes as a config override.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format, text_format

from repo_manager.core import paths
from repo_manager.core.errors import ConfigError, InputError

if TYPE_CHECKING:
    import numpy as np


def _model_config_pb2() -> Any:
    """tritonclient's ``model_config_pb2`` without running ``tritonclient.grpc/__init__`` (it imports
    grpc and numpy: ~0.3 s that `trm sync` and other config-only commands do not need). The module is
    registered under its own name, so a later ``import tritonclient.grpc`` reuses it (one descriptor)."""
    name = "tritonclient.grpc.model_config_pb2"
    if name in sys.modules:
        return sys.modules[name]

    try:
        package = importlib.util.find_spec("tritonclient")
        path = Path(next(iter(package.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    except Exception:  # noqa: BLE001 - any other layout: the ordinary (slower) import
        sys.modules.pop(name, None)
        from tritonclient.grpc import model_config_pb2  # noqa: PLC0415 - heavy library, imported where used

        return model_config_pb2


mc = _model_config_pb2()
ModelConfig = mc.ModelConfig


@functools.cache
def _triton_to_numpy() -> dict[str, Any]:
    """Triton data type name (without TYPE_) -> numpy dtype. BF16 has no numpy type."""
    import numpy as np  # noqa: PLC0415 - only tensor-shaped work needs numpy

    return {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
            "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
            "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "STRING": np.object_}


def dtype_name(data_type: int) -> str:
    """``mc.TYPE_FP32`` -> ``"FP32"`` (the name Triton's inference protocol uses)."""
    return mc.DataType.Name(data_type).removeprefix("TYPE_")


def data_type(name: str) -> int:
    """``"FP32"`` or ``"TYPE_FP32"`` -> ``mc.TYPE_FP32``."""
    key = name.upper()
    if not key.startswith("TYPE_"):
        key = "TYPE_" + key
    try:
        return mc.DataType.Value(key)
    except ValueError as exc:
        known = ", ".join(n.removeprefix("TYPE_") for n in mc.DataType.keys() if n != "TYPE_INVALID")  # noqa: SIM118
        raise InputError(f"unknown data type {name!r}", hint=f"use one of {known}") from exc


def numpy_dtype(data_type_value: int) -> np.dtype:
    import numpy as np  # noqa: PLC0415 - numpy only where arrays are made

    name = dtype_name(data_type_value)
    if name not in _triton_to_numpy():
        raise InputError(f"data type {name} has no numpy equivalent")
    return np.dtype(_triton_to_numpy()[name])


def from_numpy_dtype(dtype: np.dtype) -> int:
    import numpy as np  # noqa: PLC0415 - numpy only where arrays are made

    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return mc.TYPE_STRING
    for name, np_type in _triton_to_numpy().items():
        if np.dtype(np_type) == dtype:
            return data_type(name)
    raise InputError(f"numpy dtype {dtype} has no Triton data type")


# ----------------------------------------------------------------------------------------------- I/O

def parse_config(text: str, origin: str = "config") -> ModelConfig:
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"{origin} is not a valid Triton model config: {exc}",
                          hint="fix the file, or republish the model so trm regenerates it") from exc
    return config


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from exc
    return parse_config(text, str(path))


def config_to_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def config_to_json(config: ModelConfig) -> str:
    """The JSON form that Triton's load API accepts as a config override."""
    return json_format.MessageToJson(config, preserving_proto_field_name=True, indent=None)


def config_from_json(text: str | dict) -> ModelConfig:
    config = ModelConfig()
    payload = json.dumps(text) if isinstance(text, dict) else text
    json_format.Parse(payload, config, ignore_unknown_fields=True)
    return config


def config_digest(config: ModelConfig) -> str:
    return hashlib.sha256(config_to_text(config).encode()).hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.replace_file(path, (data,))


def write_config(path: str | Path, config: ModelConfig) -> None:
    """Write config.pbtxt atomically. The text is parsed back first, so what lands always parses."""
    text = config_to_text(config)
    parse_config(text, str(path))
    atomic_write_bytes(Path(path), text.encode())


# --------------------------------------------------------------------------------------- generation

MAX_DIM = 2 ** 31 - 1
"""Largest tensor dimension trm writes (Triton's dims are int64; no real tensor axis comes near)."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, Triton data type name (FP32 …) and dims without the batch axis."""

    name: str
    dtype: str
    dims: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> TensorSpec:
        """``NAME:TYPE:D1,D2`` e.g. ``INPUT0:FP32:-1,4`` (``NAME:TYPE:`` for a scalar per batch item)."""
        parts = text.split(":")
        if len(parts) != 3 or not parts[0]:
            raise InputError(f"tensor spec {text!r} is not NAME:TYPE:DIMS", hint="e.g. --input TEXT:STRING:1")
        data_type(parts[1])
        try:
            dims = tuple(int(d) for d in parts[2].split(",") if d.strip())
        except ValueError as exc:
            raise InputError(f"tensor spec {text!r}: dims must be integers (-1 for variable)") from exc
        if any(d != -1 and not 1 <= d <= MAX_DIM for d in dims):
            raise InputError(f"tensor spec {text!r}: each dim is -1 (variable) or from 1 to {MAX_DIM}")
        if any(c.isspace() or not c.isprintable() for c in parts[0]):
            raise InputError(f"tensor spec {text!r}: a tensor name holds no spaces or control characters")
        return cls(parts[0], parts[1].upper().removeprefix("TYPE_"), dims)


@dataclass(frozen=True)
class ConfigOptions:
    """What a user chooses on top of what the model itself dictates."""

    max_batch_size: int | None = None
    """None: derive from the model (a dynamic first axis gives ``DEFAULT_MAX_BATCH``)."""
    instance_count: int = 1
    instance_kind: str = "CPU"
    dynamic_batching: bool = True
    warmup: bool = True


DEFAULT_MAX_BATCH = 8


def _instance_kind(kind: str) -> int:
    try:
        return mc.ModelInstanceGroup.Kind.Value("KIND_" + kind.upper())
    except ValueError as exc:
        raise InputError(f"instance kind {kind!r} must be CPU, GPU or AUTO") from exc


def build_config(name: str, backend: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 batchable: bool, options: ConfigOptions, *, default_model_filename: str | None = None,
                 platform: str | None = None) -> ModelConfig:
    """A complete ModelConfig for a model of ``backend`` with these tensors and options."""
    if options.max_batch_size is not None and options.max_batch_size > 0 and not batchable:
        raise InputError(f"model {name} has no batch axis (a static first dimension), so max_batch_size "
                         f"must be 0, not {options.max_batch_size}")
    config = ModelConfig(name=name)
    if backend:
        config.backend = backend
    if platform:
        config.platform = platform
    if default_model_filename:
        config.default_model_filename = default_model_filename
    max_batch = 0
    if batchable:
        max_batch = DEFAULT_MAX_BATCH if options.max_batch_size is None else options.max_batch_size
    config.max_batch_size = max_batch
    for spec, target in [(s, config.input) for s in inputs] + [(s, config.output) for s in outputs]:
        tensor = target.add()
        tensor.name = spec.name
        tensor.data_type = data_type(spec.dtype)
        tensor.dims.extend(spec.dims)
    if options.instance_count < 1:
        raise InputError("instance count must be at least 1")
    group = config.instance_group.add()
    group.count = options.instance_count
    group.kind = _instance_kind(options.instance_kind)
    if options.dynamic_batching and max_batch > 0:
        config.dynamic_batching.SetInParent()
    if options.warmup:
        add_warmup(config)
    return config


def add_warmup(config: ModelConfig, batch_size: int = 1) -> None:
    """A ``model_warmup`` block with random data, so a newly loaded version is warm before traffic.

    Variable dims (-1) are warmed with size 1. STRING inputs get zero data (Triton's only option).
    """
    del config.model_warmup[:]
    warm = config.model_warmup.add()
    warm.name = "trm_warmup"
    warm.batch_size = batch_size if config.max_batch_size > 0 else 1
    for tensor in config.input:
        data = warm.inputs[tensor.name]
        data.data_type = tensor.data_type
        data.dims.extend([d if d > 0 else 1 for d in tensor.dims] or [1])
        if tensor.data_type == mc.TYPE_STRING:
            data.zero_data = True
        else:
            data.random_data = True


def tensor_specs(config: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    def specs(tensors) -> list[TensorSpec]:
        return [TensorSpec(t.name, dtype_name(t.data_type), tuple(t.dims)) for t in tensors]
    return specs(config.input), specs(config.output)


def summarize(config: ModelConfig) -> dict[str, object]:
    """A small, JSON-friendly view of a config for `trm show`."""
    inputs, outputs = tensor_specs(config)
    summary: dict[str, object] = {
        "backend": config.backend or config.platform,
        "max_batch_size": config.max_batch_size,
        "inputs": [f"{t.name}:{t.dtype}:{list(t.dims)}" for t in inputs],
        "outputs": [f"{t.name}:{t.dtype}:{list(t.dims)}" for t in outputs],
        "instances": [f"{g.count}x{mc.ModelInstanceGroup.Kind.Name(g.kind).removeprefix('KIND_')}"
                      for g in config.instance_group],
        "dynamic_batching": None,
    }
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        summary["dynamic_batching"] = {
            "max_queue_delay_microseconds": db.max_queue_delay_microseconds,
            "preferred_batch_size": list(db.preferred_batch_size),
        }
    if config.HasField("ensemble_scheduling"):
        summary["ensemble_steps"] = [f"{s.model_name}:{s.model_version}" for s in config.ensemble_scheduling.step]
    return summary
