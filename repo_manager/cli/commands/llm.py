"""`trm plan` and `trm doctor`: LLM memory planning and serving-node checks."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from repo_manager.cli import Context, Number, cli, json_option, pass_ctx, repo_option
from repo_manager.core.errors import CompatibilityError, InputError, IntegrityError, Report
from repo_manager.ops.llm.plan import GB, KV_DTYPES, WEIGHT_DTYPES, require_fit

GIB = Number(0, 1e6, low_open=True)
"""GiB of one GPU: positive, finite, below a petabyte."""
COUNT = click.IntRange(max=2 ** 20)
"""Sequences, tokens, GPUs: what a number of them can be (below it, the planner says what is wrong)."""


def plan_text(plan) -> str:
    s = plan.shape
    head = (f"{s.architecture}: {plan.parameters.total / 1e9:.2f}B parameters, {s.num_layers} layers, "
            f"{s.num_heads} heads / {s.num_kv_heads} KV heads × {s.head_dim}"
            + (f", {s.num_experts} experts (top {s.experts_per_token})" if s.num_experts else ""))
    lines = [head, *(f"  {step}" for step in plan.steps),
             f"weights {plan.weight_bytes / GB:.2f} GB ({plan.dtype}), KV cache {plan.kv_bytes_per_token:,} "
             f"bytes/token ({plan.kv_cache_dtype}), {plan.max_tokens:,} tokens fit on "
             f"{plan.request.gpu_memory_gib:g} GiB",
             ("fits: " if plan.fits else "does not fit: ") + plan.reason]
    return "\n".join(lines)


@cli.command("plan")
@click.argument("checkpoint", type=click.Path())
@click.option("--gpu-memory", "gpu_memory", type=GIB, required=True,
              help="Memory of one GPU in GiB, as nvidia-smi reports it (a '24 GB' card: 24).")
@click.option("--dtype", type=click.Choice(WEIGHT_DTYPES), help="Weight precision (default: the checkpoint's).")
@click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), help="KV-cache precision (default: 16-bit).")
@click.option("--max-batch-size", type=COUNT, help="Sequences at once (default: 1, or the engine's).")
@click.option("--max-seq-len", type=COUNT, help="Prompt + output tokens per sequence (default: the model's "
              "max_position_embeddings, or the engine's max_seq_len).")
@click.option("--tp", type=COUNT, help="Tensor-parallel GPUs (default: 1, or the engine's).")
@click.option("--max-num-tokens", type=COUNT, help="Tokens per forward pass, sizing the activation memory "
              "(default: 8192, or the engine's).")
@click.option("--utilization", type=Number(0, 1, low_open=True), default=0.9, show_default=True,
              help="Fraction of GPU memory the server may use.")
@json_option
@pass_ctx
def plan_command(ctx: Context, checkpoint: str, gpu_memory: float, dtype: str | None, kv_cache_dtype: str | None,
                 max_batch_size: int | None, max_seq_len: int | None, tp: int | None, max_num_tokens: int | None,
                 utilization: float) -> None:
    """Plan GPU memory for CHECKPOINT (a folder or config.json, or an engine folder: its limits are the
    defaults): weights, overhead, KV cache.

    Exits 11 when one sequence of --max-seq-len tokens does not fit, naming the length that does.
    """
    from repo_manager.ops.llm.engine import plan_for

    plan = plan_for(checkpoint, gpu_memory, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                    max_batch_size=max_batch_size, max_seq_len=max_seq_len, tp=tp, max_num_tokens=max_num_tokens,
                    utilization=utilization)
    try:
        require_fit(plan)
    except CompatibilityError as exc:
        exc.report = Report(plan.to_dict(), plan_text(plan))
        raise
    ctx.emit(plan.to_dict(), plan_text(plan))


@cli.command("doctor")
@repo_option
@click.option("--node-facts", type=click.Path(dir_okay=False, exists=True),
              help="Judge the facts of another node (the 'node' object of its `trm doctor --json`) instead of "
                   "probing this one.")
@click.option("--require-gpu", is_flag=True, help="Fail (exit 11) when the node has no GPU. Without it a CPU "
              "node passes unless an engine of the repository needs a GPU.")
@json_option
@pass_ctx
def doctor_command(ctx: Context, repository: str | None, node_facts: str | None, require_gpu: bool) -> None:
    """Check this serving node: GPU, driver CUDA, and every engine of the repository (architecture,
    TensorRT/TensorRT-LLM versions, memory plan). Exits 11 naming each mismatch; a CPU node without
    engines that need a GPU passes."""
    from repo_manager.ops.llm.doctor import diagnose
    from repo_manager.ops.llm.node import NodeFacts, probe_node

    settings = ctx.settings.replace(repository=repository)
    if node_facts:
        from repo_manager.core import documents

        try:
            node = NodeFacts.from_dict(documents.parse(Path(node_facts).read_bytes(), str(node_facts)))
        except OSError as exc:
            raise InputError(f"cannot read {node_facts}: {exc.strerror}") from exc
        except IntegrityError as exc:  # not JSON, too deep or too large: a local file, so bad input
            raise InputError(exc.message) from exc
        except ValueError as exc:
            raise InputError(f"{node_facts} does not hold node facts: {exc}") from exc
    else:
        node = probe_node()
    repo = settings.repository if (repository or settings.repository.is_dir()) else None
    report = diagnose(node, repo, require_gpu=require_gpu)
    shown = Report(report.to_dict(), "\n".join(str(f) for f in report.findings) + ("\nok" if report.ok else ""))
    if not report.ok:
        # the text lists each failure once; with --json the one error line on stderr names them
        failures = report.failures
        message = ("; ".join(f"{f.subject}: {f.message}" for f in failures) if ctx.json else
                   f"{len(failures)} of {len(report.findings)} check(s) failed ([fail] above)")
        raise CompatibilityError(message, hint="fix the node (driver, GPU) or rebuild the engines for it",
                                 report=shown)
    ctx.emit(shown.data, shown.text)


# ------------------------------------------------------------------------ publish --format tensorrt-llm

_TRTLLM = [
    click.option("--layout", "trtllm_layout", type=click.Choice(["engine", "llmapi"]), default="engine",
                 show_default=True, help="tensorrt-llm: engine + inflight_batcher_llm models, or the LLM-API "
                 "backend (no engine build)."),
    click.option("--gpu-memory", "trtllm_gpu_memory", type=GIB,
                 help="tensorrt-llm: GiB of one serving GPU to plan for (default: this node's GPU)."),
    click.option("--dtype", "trtllm_dtype", type=click.Choice(WEIGHT_DTYPES), help="tensorrt-llm: weights."),
    click.option("--kv-cache-dtype", "trtllm_kv_dtype", type=click.Choice(KV_DTYPES)),
    click.option("--max-input-len", "trtllm_max_input_len", type=COUNT, help="tensorrt-llm: prompt tokens."),
    click.option("--max-seq-len", "trtllm_max_seq_len", type=COUNT,
                 help="tensorrt-llm: prompt + output tokens (default: the model's maximum)."),
    click.option("--max-beam-width", "trtllm_max_beam_width", type=COUNT, default=1, show_default=True),
    click.option("--max-num-tokens", "trtllm_max_num_tokens", type=COUNT, default=8192, show_default=True),
    click.option("--tp", "trtllm_tp", type=COUNT, default=1, show_default=True, help="tensorrt-llm: GPUs."),
    click.option("--engine-dir", "trtllm_engine_dir", type=click.Path(file_okay=False),
                 help="tensorrt-llm: an engine trtllm-build already built; skips the build."),
    click.option("--builder", "trtllm_builder", help="tensorrt-llm: build command prefix taking trtllm-build's "
                 "options, e.g. 'docker run --gpus all -v /m:/m IMAGE trtllm-build'."),
    click.option("--compute-capability", "trtllm_cc", help="tensorrt-llm: GPU architecture the engine was built "
                 "for (e.g. 9.0), when --engine-dir has no trm-build.json."),
    click.option("--tensorrt-version", "trtllm_trt_version", help="tensorrt-llm: TensorRT of the engine build."),
    click.option("--cuda-version", "trtllm_cuda_version", help="tensorrt-llm: CUDA of the engine build."),
    click.option("--batching-strategy", "trtllm_batching", default="inflight_fused_batching", show_default=True,
                 type=click.Choice(["inflight_fused_batching", "v1"])),
    click.option("--kv-cache-fraction", "trtllm_kv_fraction", type=Number(0, 1, low_open=True), default=0.9,
                 show_default=True,
                 help="tensorrt-llm: kv_cache_free_gpu_mem_fraction."),
    click.option("--streaming/--no-streaming", "trtllm_streaming", default=False, show_default=True,
                 help="tensorrt-llm: decoupled mode, tokens streamed as generated."),
    click.option("--bls/--no-bls", "trtllm_bls", default=False, show_default=True,
                 help="tensorrt-llm: also publish the tensorrt_llm_bls model."),
]


def trtllm_options(function):
    """Adds the tensorrt-llm options to a command and hands them over as one ``trtllm`` argument."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from repo_manager.ops.llm.layout import ServingOptions
        from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions

        values = {key: kwargs.pop(key) for key in list(kwargs) if key.startswith("trtllm_")}
        kwargs["trtllm"] = TrtllmOptions(
            layout=values["trtllm_layout"], gpu_memory_gib=values["trtllm_gpu_memory"],
            dtype=values["trtllm_dtype"], kv_cache_dtype=values["trtllm_kv_dtype"],
            max_batch_size=kwargs.get("max_batch_size") or 8, max_input_len=values["trtllm_max_input_len"],
            max_seq_len=values["trtllm_max_seq_len"], max_beam_width=values["trtllm_max_beam_width"],
            max_num_tokens=values["trtllm_max_num_tokens"], tp=values["trtllm_tp"],
            engine_dir=Path(values["trtllm_engine_dir"]) if values["trtllm_engine_dir"] else None,
            builder=values["trtllm_builder"], compute_capability=values["trtllm_cc"],
            tensorrt_version=values["trtllm_trt_version"], cuda_version=values["trtllm_cuda_version"],
            bls=values["trtllm_bls"],
            serving=ServingOptions(batching_strategy=values["trtllm_batching"],
                                   kv_cache_free_gpu_mem_fraction=values["trtllm_kv_fraction"],
                                   decoupled=values["trtllm_streaming"]))
        return function(*args, **kwargs)

    for option in reversed(_TRTLLM):
        wrapper = option(wrapper)
    return wrapper


# ------------------------------------------------------------------------------ publish --format vllm

_VLLM = [
    click.option("--max-model-len", "vllm_max_model_len", type=COUNT,
                 help="vllm: prompt + output tokens (default: the model's maximum, when the plan says it fits; "
                      "--max-seq-len is taken too)."),
    click.option("--max-num-seqs", "vllm_max_num_seqs", type=COUNT,
                 help="vllm: sequences batched at once (default: 16 on CPU, 256 on a GPU)."),
    click.option("--max-waiting-requests", "vllm_max_waiting", type=click.IntRange(0),
                 help="vllm: reject a request at once (UNAVAILABLE) while this many wait for their first token, "
                      "instead of queueing past capacity (trm's backend; default: no bound)."),
    click.option("--gpu-memory-utilization", "vllm_utilization", type=Number(0, 1, low_open=True), default=0.9,
                 show_default=True, help="vllm: fraction of GPU memory the engine may use."),
    click.option("--cpu-memory", "vllm_cpu_memory", type=GIB,
                 help="vllm on CPU: GiB for weights + KV cache (default: half of the available memory)."),
]


def vllm_options(function):
    """Adds the vllm options to a command and hands them over as one ``vllm`` argument; --gpu-memory,
    --dtype, --max-seq-len and --tp are the tensorrt-llm options' (``trtllm``), shared by both formats."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from repo_manager.ops.llm.vllm import VllmOptions

        values = {key: kwargs.pop(key) for key in list(kwargs) if key.startswith("vllm_")}
        trtllm = kwargs["trtllm"]
        kwargs["vllm"] = VllmOptions(
            gpu_memory_gib=trtllm.gpu_memory_gib, dtype=trtllm.dtype,
            max_model_len=values["vllm_max_model_len"] or trtllm.max_seq_len,
            max_num_seqs=values["vllm_max_num_seqs"], tp=trtllm.tp, utilization=values["vllm_utilization"],
            cpu_memory_gib=values["vllm_cpu_memory"], max_waiting_requests=values["vllm_max_waiting"] or None)
        return function(*args, **kwargs)

    for option in reversed(_VLLM):
        wrapper = option(wrapper)
    return wrapper
