"""Request inputs generated from a model's config, or read from files.

Shared by verification, `trm infer`, the load generator and rollout smoke checks, so every part of trm
sends the same kind of data a config allows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from repo_manager import config as cfg
from repo_manager.errors import InputError

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
