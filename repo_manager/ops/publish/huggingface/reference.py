"""The reference a Hugging Face publish is verified against: the library the checkpoint came from, loaded
from the checkpoint folder exactly as a user would, never trm's own re-implementation (a check that shares
the export's assumptions cannot fail).

    embedding, sentence-transformers folder   SentenceTransformer(path).encode(texts, prompt_name=...)
    embedding, plain transformers checkpoint  SentenceTransformer(modules=[Transformer(path), Pooling(mode),
                                              Normalize()?]).encode(texts): what SentenceTransformer(path)
                                              builds for such a checkpoint, with the chosen pooling
    rerank                                    CrossEncoder(path).predict(pairs)
    classify                                  transformers pipeline("text-classification", path, top_k=None)
"""

from __future__ import annotations

import logging as std_logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.core.errors import InputError
from repo_manager.ops.publish.huggingface.pipeline import Pipeline


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' and sentence-transformers' load reports, length warnings and progress bars off: trm
    prints its own one-line outcome."""

    from transformers.utils import logging  # noqa: PLC0415 - heavy library, imported where used

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    st_logger = std_logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    st_logger.setLevel(std_logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        st_logger.setLevel(st_level)
        if bars:
            logging.enable_progress_bar()


@dataclass
class LibraryReference:
    """Call it with texts (or (query, passage) pairs for rerank); answers [n, d] float32."""

    pipeline: Pipeline
    folder: Path
    max_length: int
    """What trm truncates at; the classification pipeline truncates there too (it does not on its own)."""
    override: int | None = None
    """--max-length, given to the library as a user would; without it the library finds its own length, so
    a wrong guess of trm's would show as a parity failure, not be copied into the reference."""

    def __post_init__(self) -> None:
        self._model: Any = None

    @property
    def library(self) -> str:
        return "transformers" if self.pipeline.task == "classify" else "sentence-transformers"

    def describe(self) -> dict[str, Any]:
        calls = {"embedding": "SentenceTransformer(path).encode(texts"
                              + (f", prompt_name={self.pipeline.prompt_name!r})" if self.pipeline.prompt_name
                                 else ")"),
                 "rerank": "CrossEncoder(path).predict(pairs)",
                 "classify": "pipeline('text-classification', model=path, top_k=None)(texts, truncation=True)"}
        call = calls[self.pipeline.task]
        if self.pipeline.task == "embedding" and not self.pipeline.sentence_transformers:
            call = (f"SentenceTransformer(modules=[Transformer(path), Pooling(mode={self.pipeline.pooling[0]!r})"
                    + (", Normalize()" if self.pipeline.normalize else "") + "]).encode(texts)")
        return {"library": self.library, "version": _version(self.library), "call": call,
                "max_length": self.override or "the library's own"}

    def _load(self) -> Any:
        if self._model is not None:
            return self._model
        path = str(self.folder)
        try:
            with quiet_transformers():
                self._model = self._build(path)
        except ImportError as exc:
            raise InputError(f"verifying a Hugging Face checkpoint needs {self.library} ({exc.name} is missing)",
                             hint="pip install 'trm[torch]'") from exc
        return self._model

    def _build(self, path: str) -> Any:
        if self.pipeline.task == "classify":
            from transformers import pipeline  # noqa: PLC0415 - heavy library, imported where used

            return pipeline("text-classification", model=path, device="cpu", top_k=None)
        if self.pipeline.task == "rerank":
            from sentence_transformers import CrossEncoder  # noqa: PLC0415 - heavy library, imported where used

            return CrossEncoder(path, device="cpu", max_length=self.override)
        from sentence_transformers import SentenceTransformer  # noqa: PLC0415 - heavy library, imported where used

        if self.pipeline.sentence_transformers:
            model = SentenceTransformer(path, device="cpu")
            if self.override:
                model.max_seq_length = self.override
            return model
        from sentence_transformers.models import Normalize, Pooling, Transformer  # noqa: PLC0415 - heavy library, imported where used

        transformer = Transformer(path, max_seq_length=self.override)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=self.pipeline.pooling[0])]
        if self.pipeline.normalize:
            modules.append(Normalize())
        return SentenceTransformer(modules=modules, device="cpu")

    def __call__(self, items: list[Any]) -> np.ndarray:
        with quiet_transformers():
            return self._call(items)

    def _call(self, items: list[Any]) -> np.ndarray:
        model = self._load()
        task = self.pipeline.task
        if task == "embedding":
            out = model.encode(items, prompt_name=self.pipeline.prompt_name, convert_to_numpy=True,
                               batch_size=max(1, len(items)), show_progress_bar=False)
        elif task == "rerank":
            out = model.predict(items, convert_to_numpy=True, batch_size=max(1, len(items)),
                                show_progress_bar=False)
        else:
            order = {label: i for i, label in enumerate(self.pipeline.labels)}
            out = np.zeros((len(items), len(order)), dtype=np.float32)
            for row, answer in enumerate(model(items, truncation=True, max_length=self.max_length)):
                for entry in answer:
                    out[row, order[entry["label"]]] = entry["score"]
        out = np.asarray(out, dtype=np.float32)
        return out.reshape(len(items), -1)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
