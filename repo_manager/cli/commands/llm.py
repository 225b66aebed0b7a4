"""`trm plan` and `trm doctor`: LLM memory planning and serving-node checks."""

from __future__ import annotations

import click

from repo_manager.cli import Context, cli, json_option, pass_ctx
from repo_manager.errors import CompatibilityError
from repo_manager.llm.plan import GB, KV_DTYPES, WEIGHT_DTYPES, PlanRequest, plan_memory, require_fit
from repo_manager.llm.shape import load_shape


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
@click.option("--gpu-memory", "gpu_memory", type=float, required=True,
              help="Memory of one GPU in GiB, as nvidia-smi reports it (a '24 GB' card: 24).")
@click.option("--dtype", type=click.Choice(WEIGHT_DTYPES), help="Weight precision (default: the checkpoint's).")
@click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), help="KV-cache precision (default: 16-bit).")
@click.option("--max-batch-size", type=int, default=1, show_default=True)
@click.option("--max-seq-len", type=int, help="Prompt + output tokens per sequence (default: the model's "
              "max_position_embeddings).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel GPUs.")
@click.option("--max-num-tokens", type=int, default=8192, show_default=True,
              help="Tokens per forward pass (sizes the activation memory).")
@click.option("--utilization", type=float, default=0.9, show_default=True,
              help="Fraction of GPU memory the server may use.")
@json_option
@pass_ctx
def plan_command(ctx: Context, checkpoint: str, gpu_memory: float, dtype: str | None, kv_cache_dtype: str | None,
                 max_batch_size: int, max_seq_len: int | None, tp: int, max_num_tokens: int,
                 utilization: float) -> None:
    """Plan GPU memory for CHECKPOINT (a folder or config.json): weights, overhead, KV cache.

    Exits 11 when one sequence of --max-seq-len tokens does not fit, naming the length that does.
    """
    request = PlanRequest(gpu_memory_gib=gpu_memory, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                          max_batch_size=max_batch_size, max_seq_len=max_seq_len, tp=tp,
                          max_num_tokens=max_num_tokens, utilization=utilization)
    plan = plan_memory(load_shape(checkpoint), request)
    ctx.emit(plan.to_dict(), plan_text(plan))
    try:
        require_fit(plan)
    except CompatibilityError as exc:
        exc.reported = True
        raise
