"""Tiny Python-backend models whose answers say which version produced them (rollout tests, bench).

``tagged`` publishes one version of a model ``Y = X * factor`` with an extra output ``TAG`` equal to the
``tag`` baked into its model.py (the version it was meant to be), so a client can tell from every answer
which version served it. Behaviour switches make the bad versions the rollout tests need: one that fails
to load, one that answers wrongly (another factor), one that fails some requests (negative inputs).

``ensemble`` publishes ``pre`` and ``post`` members and an ensemble ``pipe`` pinning them: every answer
carries ``PRE_TAG`` and ``POST_TAG``, so a response that mixed versions is visible.

Versions go through ``run_publish`` (staging, manifest, atomic commit) without verification, because
some of them are broken on purpose.
"""

from __future__ import annotations

from pathlib import Path

from repo_manager.core import config as cfg
from repo_manager.core.settings import Settings
from repo_manager.ops.publish.core import Staged, run_publish

MODEL_PY = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

TAG = {tag}
FACTOR = {factor}
DELAY_S = {delay}
FAIL_LOAD = {fail_load}
FAIL_NEGATIVE = {fail_negative}
MARKER = {marker!r}
IN, OUT = "{input}", "{output}"


class TritonPythonModel:
    def initialize(self, args):
        if FAIL_LOAD:
            raise pb_utils.TritonModelException("this version is broken on purpose")

    def execute(self, requests):
        responses = []
        if MARKER:  # a test waits for this: a request is being executed
            open(MARKER, "w").close()
        if DELAY_S:
            time.sleep(DELAY_S)
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, IN).as_numpy()
            if FAIL_NEGATIVE and (x < 0).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input refused on purpose")))
                continue
            tag = np.full((x.shape[0], 1), TAG, dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor(OUT, (x * FACTOR).astype(np.float32)),
                pb_utils.Tensor("{tag_output}", tag)]))
        return responses
'''

FEATURES = 4


def _python_config(name: str, input_name: str, output_name: str, tag_output: str,
                   max_batch_size: int, instances: int) -> cfg.ModelConfig:
    options = cfg.ConfigOptions(max_batch_size=max_batch_size, instance_count=instances, warmup=False)
    return cfg.build_config(name, "python", [cfg.TensorSpec(input_name, "FP32", (FEATURES,))],
                            [cfg.TensorSpec(output_name, "FP32", (FEATURES,)),
                             cfg.TensorSpec(tag_output, "INT32", (1,))], True, options)


def _stage_python(repo, name: str, tag: int, *, factor: float = 2.0, delay: float = 0.0,
                  fail_load: bool = False, fail_negative: bool = False, input_name: str = "X",
                  output_name: str = "Y", tag_output: str = "TAG", max_batch_size: int = 8,
                  instances: int = 1, marker: str = "") -> Staged:
    staging = repo.stage(name)
    (staging / "model.py").write_text(MODEL_PY.format(
        tag=tag, factor=factor, delay=delay, fail_load=fail_load, fail_negative=fail_negative,
        input=input_name, output=output_name, tag_output=tag_output, marker=marker))
    config = _python_config(name, input_name, output_name, tag_output, max_batch_size, instances)
    return Staged(name, staging, config, {"kind": "test", "tag": tag})


def tagged(repo_root: Path, name: str, tag: int, **behaviour) -> int:
    """Publish the next version of ``name``; returns its version number (equal to ``tag`` in tests)."""
    settings = Settings(repository=repo_root)
    result = run_publish(settings, name, lambda repo, _n: [_stage_python(repo, name, tag, **behaviour)],
                         verify_model=False)
    return result.version


def ensemble(repo_root: Path, tag: int, *, name: str = "pipe", factor: float = 2.0, pre_delay: float = 0.005,
             pre_marker: str = "") -> int:
    """Publish the next versions of ``pre``, ``post`` and the ensemble ``name`` pinning them (``pre_marker``: a
    file ``pre`` creates when it starts executing a request).

    The pipeline computes ``Y = X * factor``; a factor other than 2 is a version that answers wrongly.
    """
    settings = Settings(repository=repo_root)

    def build(repo, _name: str) -> list[Staged]:
        pre = _stage_python(repo, "pre", tag, output_name="MID", tag_output="PRE_TAG", delay=pre_delay,
                            factor=factor, marker=pre_marker)
        post = _stage_python(repo, "post", tag, input_name="MID", output_name="Y", tag_output="POST_TAG",
                             factor=1.0)
        config = cfg.ModelConfig(name=name, platform="ensemble", max_batch_size=8)
        for source, target in ((pre.config.input, config.input), (post.config.output, config.output)):
            target.extend(source)
        config.output.extend([t for t in pre.config.output if t.name == "PRE_TAG"])
        for member, maps_in, maps_out in (
                ("pre", {"X": "X"}, {"MID": "mid", "PRE_TAG": "PRE_TAG"}),
                ("post", {"MID": "mid"}, {"Y": "Y", "POST_TAG": "POST_TAG"})):
            step = config.ensemble_scheduling.step.add(model_name=member, model_version=-1)
            step.input_map.update(maps_in)
            step.output_map.update(maps_out)
        staging = repo.stage(name)
        return [pre, post, Staged(name, staging, config, {"kind": "test", "tag": tag},
                                  members={"pre": 0, "post": 0})]

    return run_publish(settings, name, build, verify_model=False).version
