"""`trm infer`: send one request and print the answer."""

from __future__ import annotations

import json

import click

from repo_manager.cli import Context, cli, complete_models, json_option, pass_ctx, repo_option, url_option
from repo_manager.errors import UsageError
from repo_manager.manifest import MAX_VERSION


@cli.command("infer")
@click.argument("name", shell_complete=complete_models)
@click.option("--text", "texts", multiple=True, help="Text for a model with one STRING input (repeatable).")
@click.option("--query", help="For a reranker: the query the --text passages are scored against.")
@click.option("--input", "input_files", multiple=True, help="NAME=FILE.npy for tensor models (repeatable).")
@click.option("--version", type=click.IntRange(1, MAX_VERSION),
              help="Default: the version the server routes to (the latest).")
@click.option("--max-tokens", type=click.IntRange(1, 1 << 20), help="For an LLM: tokens to generate (default 64).")
@click.option("--temperature", type=click.FloatRange(0, 100), help="For an LLM: sampling temperature (0: greedy).")
@repo_option
@url_option
@json_option
@pass_ctx
def infer_command(ctx: Context, name: str, texts: tuple[str, ...], query: str | None, input_files: tuple[str, ...],
                  version: int | None, max_tokens: int | None, temperature: float | None, repository: str | None,
                  triton_url: str | None) -> None:
    """Send one request to NAME (embedded server on the repository, or --url) and print the outputs. For an
    LLM (a vLLM model) the generated text of each --text is streamed as it arrives."""
    import numpy as np  # noqa: PLC0415 - heavy imports stay off the --help path

    from repo_manager.embeddings import labelled, ranked, text_similarities  # noqa: PLC0415
    from repo_manager.serving import embedded_server  # noqa: PLC0415
    from repo_manager.triton.client import TritonClient  # noqa: PLC0415

    if bool(texts) == bool(input_files):
        raise UsageError("give either --text or --input")
    settings = ctx.settings.replace(repository=repository, triton_url=triton_url)
    from repo_manager.llm.infer import is_llm, llm_infer  # noqa: PLC0415

    if texts and not query and is_llm(settings, name):
        return llm_infer(ctx, settings, name, list(texts), max_tokens=max_tokens, temperature=temperature,
                         version=version)
    if max_tokens is not None or temperature is not None:
        raise UsageError("--max-tokens and --temperature are for an LLM (a model served by vLLM)")
    if settings.triton_url:
        with TritonClient(settings.triton_url) as client:
            client.require_ready()
            outputs, config = _run(settings, client, name, texts, query, input_files, version)
    else:
        ctx.progress("starting an embedded tritonserver")
        with embedded_server(settings, [name], http_port=0, grpc_port=0, metrics_port=0) as info, \
                TritonClient(info.endpoints.http) as client:
            outputs, config = _run(settings, client, name, texts, query, input_files, version)
    data = {"model": name, "outputs": {k: _jsonable(v) for k, v in outputs.items()},
            "shapes": {k: list(v.shape) for k, v in outputs.items()}}
    text = "\n".join(f"{k} {list(v.shape)} {v.dtype}:\n{np.array2string(v, threshold=20, precision=5)}"
                     for k, v in outputs.items())
    task = config.parameters["task"].string_value if config is not None and "task" in config.parameters else ""
    if task == "rerank" and "SCORE" in outputs:
        data["ranking"] = ranked(outputs["SCORE"], list(texts))
        text = f"passages by score for the query {query!r}:" + "".join(
            f"\n  {r['score']:.4f}  [{r['index']}] {_short(r['text'])}" for r in data["ranking"])
    elif task == "classify" and "SCORES" in outputs:
        labels = json.loads(config.parameters["labels"].string_value or "[]")
        data["labels"] = labelled(outputs["SCORES"], labels, list(texts))
        text = "\n".join(f"{_short(r['text'])!r}: {r['label']} ({r['scores'][r['label']]:.4f}); "
                         + ", ".join(f"{k} {v:.4f}" for k, v in r["scores"].items()) for r in data["labels"])
    similarities = text_similarities(outputs, len(texts)) if task in ("", "embedding") else {}
    if similarities:
        data["cosine_similarity"] = similarities
        text += "".join(_similarity_text(output, matrix, texts) for output, matrix in similarities.items())
    ctx.emit(data, text)


def _similarity_text(output: str, matrix: list[list[float]], texts: tuple[str, ...]) -> str:
    if len(texts) == 2:
        return f"\ncosine similarity ({output}) of the two texts: {matrix[0][1]:.4f}"
    lines = [f"\ncosine similarity ({output}):"]
    lines += [f"  [{i}] vs [{j}]: {matrix[i][j]:.4f}" for i in range(len(texts)) for j in range(i + 1, len(texts))]
    return "\n".join(lines)


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _run(settings, client, name, texts, query, input_files, version):
    from repo_manager.embeddings import pair_inputs, takes_pairs  # noqa: PLC0415
    from repo_manager.inputs import load_input_files  # noqa: PLC0415
    from repo_manager.serving import model_config_for, text_inputs  # noqa: PLC0415

    config = None
    if texts:
        config = model_config_for(settings, client, name)
        if takes_pairs(config):
            if query is None:
                raise UsageError(f"{name} is a reranker: give --query and the passages as --text")
            inputs = pair_inputs(query, list(texts))
        elif query is not None:
            raise UsageError(f"{name} takes no --query (only a reranker does)")
        else:
            inputs = text_inputs(config, list(texts))
    else:
        inputs = load_input_files(list(input_files))
    return client.infer(name, inputs, version=version), config


def _jsonable(array):
    if array.dtype.kind in ("O", "S"):
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in array.ravel()]
    return array.tolist()
