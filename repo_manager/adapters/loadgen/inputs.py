"""Request inputs generated from a model's config, or read from files.

Shared by verification, `trm infer`, the load generator and rollout smoke checks, so every part of trm
sends the same kind of data a config allows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError

SAMPLE_TEXT = ["hello world", "Triton serves this model", "", "naïve café ☕ — ünïcode", "a b c " * 20]


def generate_inputs(config: cfg.ModelConfig, *, batch_size: int = 1, variable_dim: int = 4,
                    seed: int = 0, int_high: int = 16) -> dict[str, np.ndarray]:
    """Random inputs that respect ``config``: types, dims (-1 -> ``variable_dim``) and the batch axis.

    Integer inputs are drawn from [0, int_high) so that they are valid indices (token ids, say).
    """
    rng = np.random.default_rng(seed)
    result: dict[str, np.ndarray] = {}
    for tensor in config.input:
        shape = [variable_dim if d < 0 else d for d in tensor.dims]
        if config.max_batch_size > 0:
            shape = [batch_size] + shape
        if tensor.data_type == cfg.mc.TYPE_STRING:
            count = int(np.prod(shape)) if shape else 1
            texts = [SAMPLE_TEXT[i % len(SAMPLE_TEXT)].encode() for i in range(count)]
            result[tensor.name] = np.array(texts, dtype=np.object_).reshape(shape)
            continue
        dtype = cfg.numpy_dtype(tensor.data_type)
        if dtype == np.bool_:
            result[tensor.name] = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif dtype.kind in ("i", "u"):
            result[tensor.name] = rng.integers(0, int_high, size=shape).astype(dtype)
        else:
            result[tensor.name] = rng.standard_normal(size=shape).astype(dtype)
    return result


def verification_samples(config: cfg.ModelConfig, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A few requests that exercise the config: batch 1, a larger batch, other variable-dim sizes."""
    samples = [generate_inputs(config, batch_size=1, variable_dim=3, seed=seed)]
    if config.max_batch_size > 0:
        samples.append(generate_inputs(config, batch_size=min(4, config.max_batch_size), variable_dim=5,
                                       seed=seed + 1))
        samples.append(generate_inputs(config, batch_size=config.max_batch_size, variable_dim=2,
                                       seed=seed + 2))
    elif any(d < 0 for t in config.input for d in t.dims):
        samples.append(generate_inputs(config, variable_dim=7, seed=seed + 1))
    return samples


def load_input_files(specs: list[str]) -> dict[str, np.ndarray]:
    """``NAME=path.npy`` pairs -> arrays."""
    result = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise InputError(f"input {spec!r} is not NAME=FILE.npy")
        file = Path(path)
        if not file.is_file():
            raise InputError(f"input file {path} does not exist")
        try:
            result[name] = np.load(file, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise InputError(f"input file {path} is not a .npy array: {exc}") from exc
    return result


def _takes(config: cfg.ModelConfig, tensor: cfg.mc.ModelInput) -> str:
    dims = ["batch"] * (config.max_batch_size > 0) + [str(d) if d >= 0 else "any" for d in tensor.dims]
    return f"{tensor.name} {cfg.dtype_name(tensor.data_type)} [{', '.join(dims)}]"


def check_request(config: cfg.ModelConfig, inputs: Mapping[str, np.ndarray]) -> None:
    """Refuse, before anything is sent, a request the model's config does not allow: an input it does not
    declare, one it needs and did not get, another dtype, another shape, a missing batch axis, a batch larger
    than ``max_batch_size``. InputError (exit 3) whose hint names the fix."""
    declared = {t.name: t for t in config.input}
    signature = "; ".join(_takes(config, t) for t in config.input)
    model = config.name
    for name in inputs:
        if name not in declared:
            raise InputError(f"{model} has no input {name!r}", hint=f"its inputs: {signature}")
    for name, tensor in declared.items():
        if name not in inputs and not tensor.optional:
            raise InputError(f"{model} needs the input {name}, which the request lacks",
                             hint=f"add --input {name}=FILE.npy ({_takes(config, tensor)})")
    batched = config.max_batch_size > 0
    batch_sizes: set[int] = set()
    for name, array in inputs.items():
        tensor, array = declared[name], np.asarray(array)
        want = cfg.dtype_name(tensor.data_type)
        if tensor.data_type == cfg.mc.TYPE_STRING:
            if array.dtype.kind not in ("O", "S", "U"):
                raise InputError(f"input {name} holds {array.dtype} values; {model} takes {want} (text)",
                                 hint="save an array of strings (np.array([...], dtype=object))")
        elif want in ("BF16",):
            pass  # no numpy type: the server judges it
        elif array.dtype != cfg.numpy_dtype(tensor.data_type):
            numpy_name = cfg.numpy_dtype(tensor.data_type).name
            raise InputError(f"input {name} is {array.dtype}; {model} takes {want}",
                             hint=f"convert it: np.save(FILE, x.astype(np.{numpy_name}))")
        dims, shape = list(tensor.dims), list(array.shape)
        fits = len(shape) == len(dims) and all(d < 0 or d == s for d, s in zip(dims, shape))
        if batched and fits:
            raise InputError(f"input {name} has shape {shape} without a batch dimension; {model} takes "
                             f"{_takes(config, tensor)} (batches of up to {config.max_batch_size})",
                             hint=f"add a leading batch axis: x[np.newaxis] (shape {[1, *shape]})")
        body = shape[1:] if batched else shape
        if len(body) != len(dims) or len(shape) < batched or any(d >= 0 and d != s for d, s in zip(dims, body)):
            raise InputError(f"input {name} has shape {shape}; {model} takes {_takes(config, tensor)}",
                             hint="reshape it to the dims the config declares (any: any size)")
        if batched:
            batch_sizes.add(shape[0])
            if shape[0] > config.max_batch_size:
                raise InputError(f"input {name} is a batch of {shape[0]}; {model} takes at most "
                                 f"{config.max_batch_size} (max_batch_size)",
                                 hint=f"split it into requests of at most {config.max_batch_size}")
    if len(batch_sizes) > 1:
        raise InputError(f"the inputs of one request disagree on the batch size: {sorted(batch_sizes)}",
                         hint="give every input the same first (batch) dimension")
