"""The Triton configs of a Hugging Face service's three models: tokenizer, encoder and the ensemble of both."""

from __future__ import annotations

import json
from pathlib import Path

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError
from repo_manager.ops.publish.huggingface import LABEL_FILE, OUTPUTS, QUERY_INPUT, TEXT_INPUT
from repo_manager.ops.publish.huggingface.load import LoadedCheckpoint
from repo_manager.ops.publish.onnx import load_onnx, onnx_config, signature


def _parameter(config: cfg.ModelConfig, key: str, value: object) -> None:
    config.parameters[key].string_value = str(value)


def _text_inputs(task: str) -> list[cfg.TensorSpec]:
    inputs = [cfg.TensorSpec(TEXT_INPUT, "STRING", (1,))]
    return [cfg.TensorSpec(QUERY_INPUT, "STRING", (1,)), *inputs] if task == "rerank" else inputs


def _pad_values(loaded: LoadedCheckpoint) -> dict[str, int]:
    """What the served tokenizer pads each token tensor with (the encoder's ``unpad`` re-pads with the same)."""
    tokenizer = loaded.tokenizer
    return {"input_ids": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            "attention_mask": 0, "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0) or 0}


def tokenizer_config(name: str, loaded: LoadedCheckpoint, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    outputs = [cfg.TensorSpec(n, "INT64", (-1,)) for n in loaded.input_names]
    config = cfg.build_config(name, "python", _text_inputs(loaded.pipeline.task), outputs, True, options)
    tokenizer = loaded.tokenizer
    _parameter(config, "max_length", loaded.checkpoint.max_length)
    pad = _pad_values(loaded)
    _parameter(config, "pad_id", pad["input_ids"])
    _parameter(config, "pad_token", tokenizer.pad_token or "[PAD]")
    _parameter(config, "pad_type_id", pad["token_type_ids"])
    if loaded.pipeline.prompt:
        _parameter(config, "prompt", loaded.pipeline.prompt)
    # Lengths padded to a multiple of 16 tokens: single-text requests of similar length then share a shape,
    # so the encoder's dynamic batcher can run them as one call (it groups requests by shape). The attention
    # mask keeps the answer the same; verification compares it with the library, which pads to the longest.
    multiple = next((m for m in (16, 8) if loaded.checkpoint.max_length % m == 0), 0)
    if multiple:
        _parameter(config, "pad_to_multiple_of", multiple)
    return config


def encoder_config(name: str, onnx_path: Path, loaded: LoadedCheckpoint, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    config = onnx_config(name, signature(load_onnx(onnx_path)), options)
    if "attention_mask" in loaded.input_names and config.max_batch_size > 0:
        # every output is one row per text (no sequence axis): trm's onnxruntime backend may then run each
        # text at its own length instead of the padded one (see its docstring); Triton's own backend ignores it
        pad = {k: v for k, v in _pad_values(loaded).items() if k in loaded.input_names}
        _parameter(config, "unpad", json.dumps({"mask": "attention_mask", "pad": pad}))
    if loaded.pipeline.task == "classify":
        for output in config.output:
            output.label_filename = LABEL_FILE
    # Triton's random warm-up data would be token ids outside the vocabulary: warm up with zeros instead
    for warm in config.model_warmup:
        for data in warm.inputs.values():
            data.ClearField("random_data")
            data.zero_data = True
    return config


def label_file(labels: tuple[str, ...] | list[str]) -> str:
    """The text of a ``label_filename`` file: one label a line, line i naming score i (Triton's format)."""
    broken = [label for label in labels if "\n" in label or "\r" in label]
    if broken:
        raise InputError(f"the label {broken[0]!r} holds a line break; Triton reads one label a line",
                         hint="rename it in the checkpoint's config.json (id2label)")
    return "".join(f"{label}\n" for label in labels)


def ensemble_config(name: str, names: dict[str, str], loaded: LoadedCheckpoint,
                    options: cfg.ConfigOptions) -> cfg.ModelConfig:
    task = loaded.pipeline.task
    plain = cfg.ConfigOptions(max_batch_size=options.max_batch_size, dynamic_batching=False, warmup=False)
    config = cfg.build_config(name, "", _text_inputs(task), [cfg.TensorSpec(OUTPUTS[task], "FP32", (loaded.width,))],
                              True, plain, platform="ensemble")
    config.ClearField("instance_group")  # an ensemble runs no instances of its own
    _parameter(config, "task", task)
    if task == "classify":
        # Triton's classification extension: a client asking for SCORES with class_count K gets the top K as
        # "score:index:label" strings, the labels read from this file beside config.pbtxt
        config.output[0].label_filename = LABEL_FILE
    tokenize = config.ensemble_scheduling.step.add(model_name=names["tokenizer"], model_version=-1)
    for spec in _text_inputs(task):
        tokenize.input_map[spec.name] = spec.name
    encode = config.ensemble_scheduling.step.add(model_name=names["encoder"], model_version=-1)
    for tensor in loaded.input_names:
        tokenize.output_map[tensor] = tensor
        encode.input_map[tensor] = tensor
    encode.output_map[OUTPUTS[task].lower()] = OUTPUTS[task]
    return config
