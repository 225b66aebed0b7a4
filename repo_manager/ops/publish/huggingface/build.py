"""Publishing a Hugging Face checkpoint: check, load, export, then stage the tokenizer, the encoder and the
ensemble.

Every check of the checkpoint (config.json, modules, weights, tokenizer, a trial forward pass) happens
before anything is staged, so bad input writes nothing.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from repo_manager.core import config as cfg
from repo_manager.core.errors import ConfigError, InputError, UsageError
from repo_manager.core.manifest import check_model_name, sha256_file
from repo_manager.ops.publish.core import Staged, copy_into
from repo_manager.ops.publish.huggingface import LABEL_FILE, OUTPUTS
from repo_manager.ops.publish.huggingface.checkpoint import inspect_checkpoint
from repo_manager.ops.publish.huggingface.configs import encoder_config, ensemble_config, label_file, tokenizer_config
from repo_manager.ops.publish.huggingface.load import OPSET, LoadedCheckpoint
from repo_manager.ops.publish.huggingface.precision import INT8_RECIPES, UNJUDGED_RECIPE, check_precision, quantize_int8
from repo_manager.ops.publish.huggingface.quality import (
    EvalData,
    assess,
    check_thresholds,
    read_eval_data,
    reference_outputs,
    refusal,
)
from repo_manager.ops.publish.huggingface.reference import LibraryReference, quiet_transformers
from repo_manager.ops.publish.huggingface.verify import checker, criterion, from_sample, to_sample, verification_cases

# Default max_batch_size of a text service (all three models): a batch of short texts costs little per text,
# and trm's onnxruntime backend runs the rows of a batch at their own lengths, so merging several client
# requests into one call is where throughput comes from (bench/bench_hf_publish.py: 4 clients sending 8 texts
# each got 1.5-1.7x sentence-transformers with 32, 1.2-1.4x with 8).
TEXT_MAX_BATCH = 32


def build_huggingface(source: Path, options: cfg.ConfigOptions, *, task: str | None = None,
                      max_length: int | None = None, pooling: str | None = None, normalize: bool | None = None,
                      prompt_name: str | None = None, precision: str = "fp32", eval_data: str | Path | None = None,
                      thresholds: Mapping[str, Any] | None = None, settings_origin: str = "settings",
                      quality_thresholds: Mapping[str, str] | None = None):
    """A ``build`` function for ``run_publish``: tokenizer, encoder and ensemble, staged in that order.
    ``precision``: the encoder's (``precision.py``); ``eval_data``: the quality gate's file (``quality.py``);
    ``thresholds``: the settings' ``quality`` mapping (by task, from ``settings_origin``);
    ``quality_thresholds``: ``--quality-threshold`` options (over the settings')."""

    if options.max_batch_size is not None and options.max_batch_size < 1:
        raise InputError("a text service takes a batch of texts: --max-batch-size must be at least 1")
    if options.max_batch_size is None:
        options = dataclasses.replace(options, max_batch_size=TEXT_MAX_BATCH)
    checkpoint = inspect_checkpoint(source, max_length, task=task, pooling=pooling, normalize=normalize,
                                    prompt_name=prompt_name)
    pipeline = checkpoint.pipeline
    precision = check_precision(precision)
    if quality_thresholds and eval_data is None:
        raise UsageError("--quality-threshold sets the quality gate's thresholds, and the gate needs --eval-data FILE",
                         hint="give --eval-data, or leave the thresholds out")
    # bad input: before loading
    data = read_eval_data(eval_data, pipeline.task) if eval_data is not None else None
    task_settings = (thresholds or {}).get(pipeline.task)
    if task_settings is not None and not isinstance(task_settings, Mapping):
        raise ConfigError(f"{settings_origin}: quality.{pipeline.task} must be a mapping of thresholds")
    limits = check_thresholds(pipeline.task, task_settings, f"{settings_origin} quality.{pipeline.task}", ConfigError)
    limits = check_thresholds(pipeline.task, {**limits, **(quality_thresholds or {})}, "--quality-threshold")
    loaded = LoadedCheckpoint(checkpoint)  # loads tokenizer and weights: any failure here is still before staging
    reference = LibraryReference(pipeline, checkpoint.path, checkpoint.max_length, override=max_length)
    with quiet_transformers():  # the long case is longer than the max length on purpose: no warning
        cases = verification_cases(loaded)
    record = {"kind": "huggingface", "path": str(source.resolve()), **pipeline.record(), "precision": precision,
              "architecture": checkpoint.architecture, "model_type": checkpoint.model_type,
              "max_length": checkpoint.max_length, "inputs": loaded.input_names,
              "files": {rel: sha256_file(source / rel) for rel in checkpoint.files}}
    output = OUTPUTS[pipeline.task]

    def build(repo, name: str) -> list[Staged]:
        names = {"tokenizer": check_model_name(f"{name}_tokenizer"), "encoder": check_model_name(f"{name}_encoder")}
        # run_publish's staging scope removes these folders whatever happens before they are committed
        staging = repo.stage(names["tokenizer"])
        copy_into(staging, Path(__file__).with_name("tokenizer_model.py"), "model.py")
        loaded.save_tokenizer(staging / "tokenizer.json")
        tokenizer = Staged(names["tokenizer"], staging, tokenizer_config(names["tokenizer"], loaded, options),
                           {**record, "converter": "tokenizers (tokenizer.json)"},
                           environment_packages=("tokenizers", "transformers"))

        staging = repo.stage(names["encoder"])
        converter, quality = stage_encoder(loaded, staging / "model.onnx", precision, reference, data, limits)
        encoder = Staged(names["encoder"], staging,
                         encoder_config(names["encoder"], staging / "model.onnx", loaded, options),
                         {**record, "converter": converter}, environment_packages=("torch", "transformers"))

        labels = {LABEL_FILE: label_file(pipeline.labels)} if pipeline.task == "classify" else {}
        encoder.labels = dict(labels)  # the encoder alone is a classifier too, for a client that calls it
        ensemble = Staged(name, repo.stage(name), ensemble_config(name, names, loaded, options),
                          {**record, "converter": "ensemble", **({"quality": quality} if quality else {})},
                          labels=labels,
                          reference=lambda sample: {output: reference(from_sample(sample, pipeline.task))},
                          samples=[to_sample(items, pipeline.task) for _, items in cases],
                          check=checker(cases, loaded, precision),
                          # placeholders: run_publish pins the versions it commits for the members
                          members={names["tokenizer"]: 1, names["encoder"]: 1},
                          environment_packages=("torch", "transformers", "tokenizers", "sentence-transformers"),
                          verification_extra={"reference": reference.describe(),
                                              "criterion": criterion(pipeline.task, precision)})
        return [tokenizer, encoder, ensemble]

    return build


def stage_encoder(loaded: LoadedCheckpoint, target: Path, precision: str, reference: LibraryReference,
                  data: EvalData | None, thresholds: Mapping[str, float]) -> tuple[str, dict[str, Any] | None]:
    """Export the encoder to ``target`` in ``precision``; with ``data``, judge it by the quality gate.

    int8 tries ``INT8_RECIPES`` in order until one passes (without data: ``UNJUDGED_RECIPE``); every try is in the
    record. Returns how the encoder was made and the gate's record; a VerificationError when nothing passes.
    """
    converter = f"torch.onnx.export (TorchScript, opset {OPSET}) with the checkpoint's {loaded.pipeline.task} head"
    if precision == "fp16":
        loaded.export(target, half=True)
        converter += " in fp16 (weights and arithmetic), its answer cast to fp32"
    elif precision == "fp32":
        loaded.export(target)
    expected = reference_outputs(reference, data.items) if data is not None else None
    labels = list(loaded.pipeline.labels)

    def record(figures: dict[str, float], passed: bool) -> dict[str, Any]:
        return {"precision": precision, "data": data.record(), "figures": figures, "thresholds": dict(thresholds),
                "reference": "the checkpoint's own library in fp32", "passed": passed}

    if precision != "int8":
        if data is None:
            return converter, None
        figures, misses = assess(loaded.pipeline.task, target, loaded, expected, data, thresholds, labels)
        if misses:
            raise refusal(precision, data, misses)
        return converter, record(figures, True)
    tried: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="trm-fp32-") as folder:
        fp32 = Path(folder) / "model.onnx"
        loaded.export(fp32)
        for recipe in INT8_RECIPES if data is not None else (UNJUDGED_RECIPE,):
            how = quantize_int8(fp32, target, recipe)
            if data is None:
                return f"{converter}; then {how}", None
            figures, misses = assess(loaded.pipeline.task, target, loaded, expected, data, thresholds, labels)
            tried.append({"recipe": recipe.name, "figures": figures, "passed": not misses})
            if not misses:
                return f"{converter}; then {how}", record(figures, True) | {"tried": tried}
            failed.append(f"{recipe.name}: {', '.join(misses)}")
    raise refusal(precision, data, failed)
