"""A Python-backend model with a known cost per batch, for the load generator, tuning tests and bench.

Each execution of a batch of ``n`` items sleeps ``fixed_ms + per_item_ms * n`` milliseconds (a sleep,
not a busy loop, so that on a 2-core machine the cost is the model's and not CPU contention's), then
answers ``OUTPUT0 = INPUT0 * (version + 1)``, which tells versions apart in rollout tests: a response is
entirely from version ``v`` when every element equals ``input * (v + 1)``.
"""

from __future__ import annotations

from pathlib import Path

from repo_manager.core import config as cfg

MODEL_PY = '''
import json
import time

import numpy as np
import triton_python_backend_utils as pb


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        value = lambda key, default: float(params.get(key, {}).get("string_value", default))
        self.fixed = value("fixed_ms", 2.0) / 1000.0
        self.per_item = value("per_item_ms", 0.5) / 1000.0
        self.scale = np.float32(int(args["model_version"]) + 1)

    def execute(self, requests):
        arrays = [pb.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        time.sleep(self.fixed + self.per_item * sum(a.shape[0] for a in arrays))
        return [pb.InferenceResponse([pb.Tensor("OUTPUT0", a * self.scale)]) for a in arrays]
'''


def cost_config(name: str, *, fixed_ms: float, per_item_ms: float, max_batch_size: int = 8,
                dynamic_batching: bool = False, delay_us: int = 0, preferred: tuple[int, ...] = (),
                width: int = 4) -> cfg.ModelConfig:
    config = cfg.build_config(name, "python", [cfg.TensorSpec("INPUT0", "FP32", (width,))],
                              [cfg.TensorSpec("OUTPUT0", "FP32", (width,))], True,
                              cfg.ConfigOptions(max_batch_size=max_batch_size, dynamic_batching=dynamic_batching,
                                                warmup=False))
    if dynamic_batching:
        config.dynamic_batching.max_queue_delay_microseconds = delay_us
        config.dynamic_batching.preferred_batch_size.extend(preferred)
    for key, value in (("fixed_ms", fixed_ms), ("per_item_ms", per_item_ms)):
        config.parameters[key].string_value = str(value)
    return config


def write_cost_model(folder: Path, name: str = "cost", **kwargs) -> Path:
    """A Python-backend source folder (model.py + config.pbtxt) that `trm publish model` accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_PY)
    cfg.write_config(folder / "config.pbtxt", cost_config(name, **kwargs))
    return folder


def cost_repository(root: Path, name: str = "cost", versions: int = 1, **kwargs) -> Path:
    """A plain Triton repository (no trm manifests) holding the cost model with ``versions`` versions."""
    for version in range(1, versions + 1):
        (root / name / str(version)).mkdir(parents=True, exist_ok=True)
        (root / name / str(version) / "model.py").write_text(MODEL_PY)
    cfg.write_config(root / name / "config.pbtxt", cost_config(name, **kwargs))
    return root
