"""GPU memory plan for serving an LLM: weights + runtime overhead + KV cache, with the arithmetic shown.

The model (all documented in docs/llm.md, every number in ``MemoryPlan.steps``):

- **GPU memory** is given in GiB, as ``nvidia-smi`` reports it (a "24 GB" RTX 4090 reports 24564 MiB,
  an "80 GB" H100 81559 MiB). ``utilization`` (default 0.90) of it may be used; the rest is left for the
  CUDA context, allocator fragmentation and other processes (vLLM's ``gpu_memory_utilization`` and
  TensorRT-LLM's ``kv_cache_free_gpu_mem_fraction`` have the same 0.9 default).
- **Weights**: exact parameter counts (``shape.parameter_breakdown``) × bytes per parameter. FP16/BF16:
  2 bytes; FP8/INT8: 1 byte for the linear layers; INT4: weight-only, group size 128 with an FP16 scale
  and zero point per group (4.25 bits per weight) for the linear layers. Under quantization the
  embedding table and the norms stay 16-bit (they are lookups, not GEMMs); lm_head is quantized.
  With tensor parallelism each GPU holds 1/tp of the weights.
- **Runtime overhead** per GPU: 0.5 GiB of runtime state (TensorRT/cuBLAS workspaces, decoder buffers,
  logits) plus the activations of one forward pass of ``max_num_tokens`` tokens, estimated as
  ``max_num_tokens × (2 × intermediate + 4 × hidden) × 2 bytes`` (the gated MLP's two projections and
  a few hidden-state buffers; for MoE, intermediate × experts per token).
- **KV cache per token** per GPU: ``2 (K and V) × layers × ceil(kv_heads / tp) × head_dim × bytes``.
- **Tokens that fit**: what is left after weights and overhead, divided by the KV bytes per token. A
  configuration fits when at least one sequence of ``max_seq_len`` tokens fits; ``max_batch_size``
  sequences of full length fit ``tokens // max_seq_len`` at a time (paged KV cache shares the rest).

These reproduce the public figures: an 8B model is 16 GB at FP16 and 5 GB at 4-bit, a 70B model 141 GB
at FP16, and Llama 3.1 8B at BF16 on a 24 GB GPU leaves ~45k tokens of KV cache (tests/test_llm_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from repo_manager.core.errors import CompatibilityError, InputError
from repo_manager.ops.llm.shape import ModelShape, Parameters, parameter_breakdown

GIB = 1024**3
GB = 1e9
DEFAULT_UTILIZATION = 0.90
RUNTIME_STATE_BYTES = GIB // 2
DEFAULT_MAX_NUM_TOKENS = 8192  # trtllm-build's default --max_num_tokens
ACTIVATION_BYTES = 2

WEIGHT_DTYPES = ("fp16", "bf16", "fp8", "int8", "int4", "fp32")
KV_DTYPES = ("fp16", "bf16", "fp8", "int8", "fp32")
_LINEAR_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 4.25 / 8}
_KV_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
_TORCH_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "bf16"}


@dataclass(frozen=True)
class PlanRequest:
    gpu_memory_gib: float
    dtype: str | None = None
    """Weight precision; None: the checkpoint's own 16-bit type."""
    kv_cache_dtype: str | None = None
    """None: 16-bit (the activation type)."""
    max_batch_size: int = 1
    max_seq_len: int | None = None
    """None: the model's max_position_embeddings."""
    tp: int = 1
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS
    utilization: float = DEFAULT_UTILIZATION

    def check(self) -> PlanRequest:
        if self.gpu_memory_gib <= 0:
            raise InputError(f"GPU memory must be positive, not {self.gpu_memory_gib}")
        if self.dtype is not None and self.dtype not in WEIGHT_DTYPES:
            raise InputError(f"dtype {self.dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_DTYPES:
            raise InputError(f"KV-cache dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        for name in ("max_batch_size", "tp", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise InputError("max_seq_len must be at least 1")
        if not 0 < self.utilization <= 1:
            raise InputError(f"utilization must be in (0, 1], not {self.utilization}")
        return self


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    request: PlanRequest
    dtype: str
    kv_cache_dtype: str
    parameters: Parameters
    gpu_memory_bytes: int
    usable_bytes: int
    weight_bytes: int
    """All GPUs together."""
    weight_bytes_per_gpu: int
    runtime_state_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    """Per GPU."""
    kv_budget_bytes: int
    max_tokens: int
    """Tokens of KV cache that fit (0 when the weights do not fit)."""
    max_seq_len: int
    concurrent_full_sequences: int
    context_per_sequence_at_batch: int
    fits: bool
    reason: str
    steps: tuple[str, ...] = field(default_factory=tuple)

    @property
    def overhead_bytes(self) -> int:
        return self.runtime_state_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": {"architecture": self.shape.architecture, **self.shape.to_dict()},
            "request": {"gpu_memory_gib": self.request.gpu_memory_gib, "dtype": self.dtype,
                        "kv_cache_dtype": self.kv_cache_dtype, "max_batch_size": self.request.max_batch_size,
                        "max_seq_len": self.max_seq_len, "tp": self.request.tp,
                        "max_num_tokens": self.request.max_num_tokens, "utilization": self.request.utilization},
            "parameters": self.parameters.to_dict(),
            "gpu_memory_bytes": self.gpu_memory_bytes, "usable_bytes": self.usable_bytes,
            "weight_bytes": self.weight_bytes, "weight_bytes_per_gpu": self.weight_bytes_per_gpu,
            "runtime_state_bytes": self.runtime_state_bytes, "activation_bytes": self.activation_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_budget_bytes": self.kv_budget_bytes,
            "max_tokens": self.max_tokens, "concurrent_full_sequences": self.concurrent_full_sequences,
            "context_per_sequence_at_batch": self.context_per_sequence_at_batch,
            "fits": self.fits, "reason": self.reason, "steps": list(self.steps),
        }


def default_dtype(shape: ModelShape) -> str:
    """The checkpoint's own weight type: its quantization's (a quantized checkpoint), else its torch_dtype's."""
    return shape.quantization or _TORCH_DTYPES.get(shape.torch_dtype, "bf16")


def weight_bytes(params: Parameters, dtype: str) -> int:
    if dtype in ("fp16", "bf16", "fp32"):
        return int(_LINEAR_BYTES[dtype]) * params.total
    # quantized: linear layers in the quantized type, embedding table, norms and router in 16 bits
    return round(params.linear * _LINEAR_BYTES[dtype]) + 2 * (params.embedding + params.norms + params.router)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    kv_heads_per_gpu = math.ceil(shape.num_kv_heads / tp)
    return 2 * shape.num_layers * kv_heads_per_gpu * shape.head_dim * _KV_BYTES[kv_dtype]


def _gb(value: float) -> str:
    return f"{value / GB:,.2f} GB"


def plan_memory(shape: ModelShape, request: PlanRequest) -> MemoryPlan:
    """The memory plan of ``shape`` under ``request``; every figure is derived in ``steps``."""
    request.check()
    dtype = request.dtype or default_dtype(shape)
    activations = _TORCH_DTYPES.get(shape.torch_dtype, "fp16") if shape.quantization and request.dtype is None \
        else (dtype if dtype in ("bf16", "fp32") else "fp16")  # a quantized checkpoint's KV cache: its activations'
    kv_dtype = request.kv_cache_dtype or activations
    tp = request.tp
    params = parameter_breakdown(shape)
    steps = [f"parameters = embedding {params.embedding:,} + lm_head {params.lm_head:,}"
             f"{' (tied)' if shape.tied_embeddings else ''} + attention {params.attention:,} + mlp {params.mlp:,}"
             f"{f' ({shape.num_experts} experts)' if shape.num_experts else ''} + router {params.router:,}"
             f" + norms {params.norms:,} = {params.total:,}"]
    weights = weight_bytes(params, dtype)
    if shape.quantization_method and request.dtype is None:
        steps.append(f"weight type {dtype} from the checkpoint's quantization_config ({shape.quantization_method})"
                     if shape.quantization else
                     f"the checkpoint's quantization_config ({shape.quantization_method}) is not one trm plans: "
                     f"planned at its {dtype} activations, an upper bound (--dtype sets the weight type)")
    if dtype in ("fp16", "bf16", "fp32"):
        steps.append(f"weights = {params.total:,} × {_LINEAR_BYTES[dtype]:g} bytes ({dtype}) = {_gb(weights)}")
    else:
        steps.append(f"weights = linear {params.linear:,} × {_LINEAR_BYTES[dtype]:g} bytes ({dtype}) + "
                     f"embedding/norms/router {params.embedding + params.norms + params.router:,} × 2 bytes"
                     f" = {_gb(weights)}")
    per_gpu_weights = math.ceil(weights / tp)
    if tp > 1:
        steps.append(f"weights per GPU = {_gb(weights)} / tp {tp} = {_gb(per_gpu_weights)}")
    gpu_bytes = int(request.gpu_memory_gib * GIB)
    usable = int(gpu_bytes * request.utilization)
    steps.append(f"usable = {request.gpu_memory_gib:g} GiB ({_gb(gpu_bytes)}) × {request.utilization:g} = "
                 f"{_gb(usable)}")
    mlp_width = (shape.moe_intermediate_size * shape.experts_per_token + shape.shared_expert_intermediate_size
                 if shape.num_experts else shape.intermediate_size)
    activations = request.max_num_tokens * (2 * math.ceil(mlp_width / tp) + 4 * shape.hidden_size) * \
        ACTIVATION_BYTES
    steps.append(f"overhead = runtime state {_gb(RUNTIME_STATE_BYTES)} + activations {request.max_num_tokens:,}"
                 f" tokens × (2 × {math.ceil(mlp_width / tp):,} + 4 × {shape.hidden_size:,}) × 2 bytes "
                 f"{_gb(activations)} = {_gb(RUNTIME_STATE_BYTES + activations)}")
    kv_token = kv_bytes_per_token(shape, kv_dtype, tp)
    steps.append(f"KV per token = 2 × {shape.num_layers} layers × {math.ceil(shape.num_kv_heads / tp)} KV heads"
                 f" × {shape.head_dim} head_dim × {_KV_BYTES[kv_dtype]} bytes ({kv_dtype}) = {kv_token:,} bytes")
    budget = usable - per_gpu_weights - RUNTIME_STATE_BYTES - activations
    max_tokens = max(budget, 0) // kv_token
    steps.append(f"KV budget = {_gb(usable)} - {_gb(per_gpu_weights)} - {_gb(RUNTIME_STATE_BYTES + activations)}"
                 f" = {_gb(budget)} → {max_tokens:,} tokens")
    max_seq_len = request.max_seq_len or shape.max_position_embeddings
    concurrent = max_tokens // max_seq_len
    per_sequence = min(max_tokens // request.max_batch_size, max_seq_len)
    steps.append(f"at max_seq_len {max_seq_len:,}: {concurrent:,} full-length sequence(s) at once; at batch "
                 f"{request.max_batch_size}: {per_sequence:,} tokens per sequence")
    if budget <= 0:
        fits = False
        reason = (f"weights {_gb(per_gpu_weights)} + overhead {_gb(RUNTIME_STATE_BYTES + activations)} exceed "
                  f"the usable {_gb(usable)} per GPU")
    elif max_tokens < max_seq_len:
        fits = False
        reason = (f"one sequence of max_seq_len {max_seq_len:,} tokens needs {_gb(max_seq_len * kv_token)} of KV"
                  f" cache, only {max_tokens:,} tokens ({_gb(budget)}) fit")
    else:
        fits = True
        reason = f"{max_tokens:,} tokens of KV cache: {concurrent:,} sequence(s) of {max_seq_len:,} tokens at once"
    return MemoryPlan(
        shape=shape, request=request, dtype=dtype, kv_cache_dtype=kv_dtype, parameters=params,
        gpu_memory_bytes=gpu_bytes, usable_bytes=usable, weight_bytes=weights, weight_bytes_per_gpu=per_gpu_weights,
        runtime_state_bytes=RUNTIME_STATE_BYTES, activation_bytes=activations, kv_bytes_per_token=kv_token,
        kv_budget_bytes=budget, max_tokens=max_tokens, max_seq_len=max_seq_len,
        concurrent_full_sequences=concurrent, context_per_sequence_at_batch=per_sequence, fits=fits,
        reason=reason, steps=tuple(steps))


def require_fit(plan: MemoryPlan) -> MemoryPlan:
    """The plan, or CompatibilityError naming the fix (a shorter max_seq_len, quantization, more GPUs)."""
    if plan.fits:
        return plan
    if plan.max_tokens > 0:
        hint = f"lower --max-seq-len to {plan.max_tokens} or less, or quantize the KV cache (--kv-cache-dtype fp8)"
    else:
        hint = "quantize (--dtype fp8 / int4), use more GPUs (--tp), or a GPU with more memory"
    raise CompatibilityError(f"{plan.shape.architecture} does not fit in {plan.request.gpu_memory_gib:g} GiB "
                             f"({plan.dtype}, tp {plan.request.tp}): {plan.reason}", hint=hint)
