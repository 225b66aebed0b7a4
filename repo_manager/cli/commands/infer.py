"""`trm infer`: send one request and print the answer.

Three steps, each its own piece so another kind of request (a streamed LLM answer, say) adds a builder
and a renderer without touching the others: ``_Serving`` gives the served config and a client (``--url``, or
an embedded server on the repository at the chosen version, started only once the request passed its
checks); ``_request`` builds the inputs, which ``check_request`` holds against the config before anything
is sent; ``_render`` turns the answer into JSON and text.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any

import click

from repo_manager.cli import Context, cli, complete_models, json_option, pass_ctx, repo_option, url_option
from repo_manager.core.errors import UsageError
from repo_manager.core.manifest import MAX_VERSION


@cli.command("infer")
@click.argument("name", shell_complete=complete_models)
@click.option("--text", "texts", multiple=True, help="Text for a model with one STRING input (repeatable).")
@click.option("--query", help="For a reranker: the query the --text passages are scored against.")
@click.option("--input", "input_files", multiple=True, help="NAME=FILE.npy for tensor models (repeatable).")
@click.option("--version", type=click.IntRange(1, MAX_VERSION),
              help="The version to query: loaded on the embedded server, or already loaded at --url. "
                   "Default: the latest.")
@click.option("--max-tokens", type=click.IntRange(1, 1 << 20), help="For an LLM: tokens to generate (default 64).")
@click.option("--temperature", type=click.FloatRange(0, 100), help="For an LLM: sampling temperature (0: greedy).")
@repo_option
@url_option
@json_option
@pass_ctx
def infer_command(ctx: Context, name: str, texts: tuple[str, ...], query: str | None, input_files: tuple[str, ...],
                  version: int | None, max_tokens: int | None, temperature: float | None,
                  repository: str | None, triton_url: str | None) -> None:
    """Send one request to NAME (embedded server on the repository, or --url) and print the outputs. For an
    LLM (a vLLM model) the generated text of each --text is streamed as it arrives."""
    from repo_manager.adapters.loadgen.inputs import check_request
    from repo_manager.ops.llm.infer import is_llm, llm_infer

    if bool(texts) == bool(input_files):
        raise UsageError("give either --text or --input")
    settings = ctx.settings.replace(repository=repository, triton_url=triton_url)

    if texts and not query and is_llm(settings, name):
        return llm_infer(ctx, settings, name, list(texts), max_tokens=max_tokens, temperature=temperature,
                         version=version)
    if max_tokens is not None or temperature is not None:
        raise UsageError("--max-tokens and --temperature are for an LLM (a model served by vLLM)")
    with _Serving(ctx, settings, name, version) as serving:
        config = serving.config()
        inputs = _request(config, name, texts, query, input_files)
        check_request(config, inputs)  # before an embedded server is even started
        outputs = serving.client().infer(name, inputs, version=version, classes=_classified(config))
    ctx.emit(*_render(name, config, outputs, texts, query))


class _Serving:
    """Where the request goes: the server at --url, or an embedded server on the repository with ``name`` at
    ``version``, started only when the request has passed its checks. ``config()`` is what the model is
    served with: the server's, or the one the repository's version was validated with (the one it loads)."""

    def __init__(self, ctx: Context, settings, name: str, version: int | None) -> None:
        self.ctx, self.settings, self.name, self.version = ctx, settings, name, version
        self._stack = ExitStack()
        self._client = None

    def __enter__(self) -> _Serving:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self._stack.__exit__(*exc)  # an error inside reaches the server's context (it drops its address)

    def config(self):
        if self.settings.triton_url:
            from repo_manager.core.errors import NotFoundError

            try:
                return self.client().model_config(self.name, self.version)
            except NotFoundError as exc:
                version = f" version {self.version}" if self.version else ""
                raise NotFoundError(exc.message, hint=f"load {self.name}{version} there (trm rollout), or leave "
                                    "out --url to query the repository's on an embedded server") from exc
        from repo_manager.adapters.repository import LocalRepository
        from repo_manager.ops.serving import check_version_exists, version_config

        repo = LocalRepository(self.settings.repository)
        return version_config(repo, self.name, check_version_exists(repo, self.name, self.version))

    def client(self):
        from repo_manager.adapters.triton.client import TritonClient
        from repo_manager.ops.serving import embedded_server

        if self._client is None:
            if self.settings.triton_url:
                self._client = self._stack.enter_context(TritonClient(self.settings.triton_url))
                self._client.require_ready()
            else:
                self.ctx.progress("starting an embedded tritonserver"
                                  + (f" with {self.name} version {self.version}" if self.version else ""))
                info = self._stack.enter_context(embedded_server(
                    self.settings, [self.name], http_port=0, grpc_port=0, metrics_port=0,
                    versions={self.name: self.version} if self.version else None))
                self._client = self._stack.enter_context(TritonClient(info.endpoints.http))
        return self._client


def _request(config, name: str, texts: tuple[str, ...], query: str | None, input_files: tuple[str, ...]):
    from repo_manager.adapters.loadgen.inputs import load_input_files
    from repo_manager.ops.embeddings import pair_inputs, takes_pairs
    from repo_manager.ops.serving import text_inputs

    if not texts:
        return load_input_files(list(input_files))
    if takes_pairs(config):
        if query is None:
            raise UsageError(f"{name} is a reranker: give --query and the passages as --text")
        return pair_inputs(query, list(texts))
    if query is not None:
        raise UsageError(f"{name} takes no --query (only a reranker does)")
    return text_inputs(config, list(texts))


def _render(name: str, config, outputs, texts: tuple[str, ...], query: str | None) -> tuple[dict[str, Any], str]:
    import numpy as np

    from repo_manager.ops.embeddings import labelled, ranked, text_similarities

    data: dict[str, Any] = {"model": name, "outputs": {k: _jsonable(v) for k, v in outputs.items()},
                            "shapes": {k: list(v.shape) for k, v in outputs.items()}}
    text = "\n".join(f"{k} {list(v.shape)} {v.dtype}:\n{np.array2string(v, threshold=20, precision=5)}"
                     for k, v in outputs.items())
    if not texts:
        return data, text
    task = config.parameters["task"].string_value if "task" in config.parameters else ""
    if task == "rerank" and "SCORE" in outputs:
        data["ranking"] = ranked(outputs["SCORE"], list(texts))
        text = f"passages by score for the query {query!r}:" + "".join(
            f"\n  {r['score']:.4f}  [{r['index']}] {_short(r['text'])}" for r in data["ranking"])
    elif task == "classify" and "SCORES" in outputs:
        scores, labels = _class_scores(outputs["SCORES"], config)
        data["labels"] = labelled(scores, labels, list(texts))
        text = "\n".join(f"{_short(r['text'])!r}: {r['label']} ({r['scores'][r['label']]:.4f}); "
                         + ", ".join(f"{k} {v:.4f}" for k, v in r["scores"].items()) for r in data["labels"])
    similarities = text_similarities(outputs, len(texts)) if task in ("", "embedding") else {}
    if similarities:
        data["cosine_similarity"] = similarities
        text += "".join(_similarity_text(output, matrix, texts) for output, matrix in similarities.items())
    return data, text


def _classified(config) -> dict[str, int]:
    """Outputs with a ``label_filename``: asked for every class through Triton's classification extension,
    as any Triton client asks (the answer names each score's label)."""
    return {o.name: int(o.dims[-1]) for o in config.output if o.label_filename and o.dims and o.dims[-1] > 0}


def _class_scores(answer, config):
    """(scores in class order, the labels) from "score:index:label" strings, or from plain scores and the
    ``labels`` parameter versions published before classifiers had a label file carried."""
    import numpy as np

    if answer.dtype.kind not in ("O", "S"):
        return answer, json.loads(config.parameters["labels"].string_value or "[]") if "labels" in \
            config.parameters else []
    rows = [[(x.decode() if isinstance(x, bytes) else str(x)).split(":", 2) for x in row]
            for row in answer.reshape(answer.shape[0], -1)]
    width = len(rows[0]) if rows else 0
    scores, labels = np.zeros((len(rows), width), np.float32), [f"LABEL_{i}" for i in range(width)]
    for r, row in enumerate(rows):
        for score, index, label in row:
            scores[r, int(index)] = float(score)
            labels[int(index)] = label
    return scores, labels


def _similarity_text(output: str, matrix: list[list[float]], texts: tuple[str, ...]) -> str:
    if len(texts) == 2:
        return f"\ncosine similarity ({output}) of the two texts: {matrix[0][1]:.4f}"
    lines = [f"\ncosine similarity ({output}):"]
    lines += [f"  [{i}] vs [{j}]: {matrix[i][j]:.4f}" for i in range(len(texts)) for j in range(i + 1, len(texts))]
    return "\n".join(lines)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _jsonable(array):
    if array.dtype.kind in ("O", "S"):
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in array.ravel()]
    return array.tolist()
