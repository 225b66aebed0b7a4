"""Python-backend models: a folder with ``model.py`` (tokenizers, pre/post-processing, custom logic).

The folder's config.pbtxt is used when present (parsed through the schema and renamed to the published
name); otherwise the inputs and outputs come from options (``--input NAME:TYPE:DIMS``). Every file of the
folder except config.pbtxt becomes part of the version. There is no reference to compare with, so
verification checks that the model loads and answers with the declared outputs, types and shapes.
"""

from __future__ import annotations

from pathlib import Path

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError
from repo_manager.core.manifest import scan_files
from repo_manager.ops.publish.core import Staged, copy_inside


def python_config(name: str, source: Path, inputs: list[cfg.TensorSpec], outputs: list[cfg.TensorSpec],
                  options: cfg.ConfigOptions) -> cfg.ModelConfig:
    existing = source / "config.pbtxt"
    if existing.is_file():
        config = cfg.read_config(existing)
        config.name = name
        if not config.backend and not config.platform:
            config.backend = "python"
        return config
    if not inputs or not outputs:
        raise InputError(f"{source} has no config.pbtxt; give the tensors with --input and --output",
                         hint="e.g. --input TEXT:STRING:1 --output EMBEDDING:FP32:384")
    batchable = options.max_batch_size is None or options.max_batch_size > 0
    return cfg.build_config(name, "python", inputs, outputs, batchable, options)


def build_python(source: Path, inputs: list[cfg.TensorSpec], outputs: list[cfg.TensorSpec],
                 options: cfg.ConfigOptions):
    if not (source / "model.py").is_file():
        raise InputError(f"{source} has no model.py")
    # every file, read inside the folder: a link anywhere or an unreadable file or folder is refused (exit 3)
    files = [e for e in scan_files(source) if e.path != "config.pbtxt"]

    def build(repo, name: str) -> list[Staged]:
        config = python_config(name, source, inputs, outputs, options)
        staging = repo.stage(name)
        for entry in files:
            copy_inside(staging, source, entry.path)
        record = {"kind": "python", "path": str(source.resolve()),
                  "files": {e.path: e.sha256 for e in files}}
        return [Staged(name, staging, config, record)]

    return build
