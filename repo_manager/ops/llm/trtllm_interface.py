"""The request interface of Triton's TensorRT-LLM layout: every tensor, as upstream declares it.

Copied (names, data types, dims, ``optional``, ``allow_ragged_batch``, scalar ``reshape``) from
triton-inference-server/tensorrtllm_backend v0.19.0 (commit c1e19638304d287f554f738c1411746555ed348c),
``all_models/inflight_batcher_llm/{ensemble,preprocessing,postprocessing,tensorrt_llm,tensorrt_llm_bls}/
config.pbtxt``, so that a client written for upstream's ensemble works unchanged against trm's. The
routing between the models (which input feeds which) lives in ``triton_models/common.py``, because the
BLS model needs it inside Triton too. ``tests/test_trtllm_interface.py`` compares these tables with
copies of upstream's files (tests/data/llm/tensorrtllm_backend-v0.19.0/).

Left out on purpose: the multimodal inputs of the preprocessing and BLS models (images, video) and the
BLS's speculative-decoding inputs (``num_draft_tokens``, ``use_draft_logits``); trm publishes text
models without a draft model, and upstream's ensemble does not route them either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError

if TYPE_CHECKING:
    import numpy as np

LOGITS = "LOGITS"
"""Stands for the engine's logits data type (``pretrained_config.logits_dtype``) in the tables below."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False
    """allow_ragged_batch"""
    scalar: bool = False
    """reshape to []: the TensorRT-LLM backend takes one value per request, not a [1] tensor."""


def _t(name: str, dtype: str, dims: list[int], flags: str = "") -> Tensor:
    """flags: o = optional, r = allow_ragged_batch, s = reshape to a scalar."""
    return Tensor(name, dtype, tuple(dims), "o" in flags, "r" in flags, "s" in flags)


ENSEMBLE_INPUTS = [
    _t("text_input", "STRING", [1]),
    _t("decoder_text_input", "STRING", [1], "o"),
    _t("max_tokens", "INT32", [1]),
    _t("num_return_sequences", "INT32", [1], "o"),
    _t("bad_words", "STRING", [-1], "o"),
    _t("stop_words", "STRING", [-1], "o"),
    _t("exclude_input_in_output", "BOOL", [1], "o"),
    _t("end_id", "INT32", [1], "o"),
    _t("pad_id", "INT32", [1], "o"),
    _t("top_k", "INT32", [1], "o"),
    _t("top_p", "FP32", [1], "o"),
    _t("temperature", "FP32", [1], "o"),
    _t("length_penalty", "FP32", [1], "o"),
    _t("repetition_penalty", "FP32", [1], "o"),
    _t("min_length", "INT32", [1], "o"),
    _t("presence_penalty", "FP32", [1], "o"),
    _t("frequency_penalty", "FP32", [1], "o"),
    _t("random_seed", "UINT64", [1], "o"),
    _t("return_log_probs", "BOOL", [1], "o"),
    _t("return_context_logits", "BOOL", [1], "o"),
    _t("return_generation_logits", "BOOL", [1], "o"),
    _t("return_perf_metrics", "BOOL", [1], "o"),
    _t("beam_width", "INT32", [1], "o"),
    _t("stream", "BOOL", [1], "o"),
    _t("prompt_embedding_table", "FP16", [-1, -1], "o"),
    _t("prompt_table_extra_id", "UINT64", [1], "o"),
    _t("prompt_vocab_size", "INT32", [1], "o"),
    _t("embedding_bias_words", "STRING", [-1], "o"),
    _t("embedding_bias_weights", "FP32", [-1], "o"),
    _t("lora_task_id", "UINT64", [1], "o"),
    _t("lora_weights", "FP16", [-1, -1], "or"),
    _t("lora_config", "INT32", [-1, 3], "or"),
    _t("guided_decoding_guide_type", "STRING", [1], "or"),
    _t("guided_decoding_guide", "STRING", [1], "or"),
]

# what the engine reports besides its tokens; the ensemble and the BLS return them under the same names
RESPONSE_OUTPUTS = [
    _t("cum_log_probs", "FP32", [-1]),
    _t("output_log_probs", "FP32", [-1, -1]),
    _t("context_logits", LOGITS, [-1, -1]),
    _t("generation_logits", LOGITS, [-1, -1, -1]),
    _t("batch_index", "INT32", [1]),
    _t("sequence_index", "INT32", [1]),
    _t("kv_cache_alloc_new_blocks", "INT32", [1]),
    _t("kv_cache_reused_blocks", "INT32", [1]),
    _t("kv_cache_alloc_total_blocks", "INT32", [1]),
    _t("arrival_time_ns", "INT64", [1]),
    _t("first_scheduled_time_ns", "INT64", [1]),
    _t("first_token_time_ns", "INT64", [1]),
    _t("last_token_time_ns", "INT64", [1]),
    _t("acceptance_rate", "FP32", [1]),
    _t("total_accepted_draft_tokens", "INT32", [1]),
    _t("total_draft_tokens", "INT32", [1]),
]
ENSEMBLE_OUTPUTS = [_t("text_output", "STRING", [-1]), *RESPONSE_OUTPUTS]

PREPROCESSING_INPUTS = [
    _t("QUERY", "STRING", [1]),
    _t("DECODER_QUERY", "STRING", [1], "o"),
    _t("REQUEST_OUTPUT_LEN", "INT32", [1]),
    _t("BAD_WORDS_DICT", "STRING", [-1], "o"),
    _t("STOP_WORDS_DICT", "STRING", [-1], "o"),
    _t("EMBEDDING_BIAS_WORDS", "STRING", [-1], "o"),
    _t("EMBEDDING_BIAS_WEIGHTS", "FP32", [-1], "o"),
    _t("END_ID", "INT32", [1], "o"),
    _t("PAD_ID", "INT32", [1], "o"),
    _t("PROMPT_TABLE_EXTRA_ID", "UINT64", [1], "o"),
]
PREPROCESSING_OUTPUTS = [
    _t("INPUT_ID", "INT32", [-1]),
    _t("REQUEST_INPUT_LEN", "INT32", [1]),
    _t("DECODER_INPUT_ID", "INT32", [-1]),
    _t("REQUEST_DECODER_INPUT_LEN", "INT32", [1]),
    _t("BAD_WORDS_IDS", "INT32", [2, -1]),
    _t("STOP_WORDS_IDS", "INT32", [2, -1]),
    _t("EMBEDDING_BIAS", "FP32", [-1]),
    _t("REQUEST_OUTPUT_LEN", "INT32", [-1]),
    _t("OUT_END_ID", "INT32", [1]),
    _t("OUT_PAD_ID", "INT32", [1]),
    _t("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", [-1]),
]

POSTPROCESSING_INPUTS = [_t("TOKENS_BATCH", "INT32", [-1, -1]), _t("SEQUENCE_LENGTH", "INT32", [-1])]
POSTPROCESSING_OUTPUTS = [_t("OUTPUT", "STRING", [-1])]

ENCODER_FEATURES = "ENCODER_FEATURES"
"""Stands for the engine's own data type (encoder input features of encoder-decoder models)."""

ENGINE_INPUTS = [
    _t("input_ids", "INT32", [-1], "or"),
    _t("encoder_input_features", ENCODER_FEATURES, [-1, -1], "or"),
    _t("encoder_output_lengths", "INT32", [1], "os"),
    _t("input_lengths", "INT32", [1], "s"),
    _t("request_output_len", "INT32", [1], "s"),
    _t("num_return_sequences", "INT32", [1], "os"),
    _t("draft_input_ids", "INT32", [-1], "or"),
    _t("decoder_input_ids", "INT32", [-1], "or"),
    _t("decoder_input_lengths", "INT32", [1], "os"),
    _t("draft_logits", LOGITS, [-1, -1], "or"),
    _t("draft_acceptance_threshold", "FP32", [1], "os"),
    _t("end_id", "INT32", [1], "os"),
    _t("pad_id", "INT32", [1], "os"),
    _t("stop_words_list", "INT32", [2, -1], "or"),
    _t("bad_words_list", "INT32", [2, -1], "or"),
    _t("embedding_bias", "FP32", [-1], "or"),
    _t("beam_width", "INT32", [1], "os"),
    _t("temperature", "FP32", [1], "os"),
    _t("runtime_top_k", "INT32", [1], "os"),
    _t("runtime_top_p", "FP32", [1], "os"),
    _t("runtime_top_p_min", "FP32", [1], "os"),
    _t("runtime_top_p_decay", "FP32", [1], "os"),
    _t("runtime_top_p_reset_ids", "INT32", [1], "os"),
    _t("len_penalty", "FP32", [1], "os"),
    _t("early_stopping", "BOOL", [1], "os"),
    _t("repetition_penalty", "FP32", [1], "os"),
    _t("min_length", "INT32", [1], "os"),
    _t("beam_search_diversity_rate", "FP32", [1], "os"),
    _t("presence_penalty", "FP32", [1], "os"),
    _t("frequency_penalty", "FP32", [1], "os"),
    _t("random_seed", "UINT64", [1], "os"),
    _t("return_log_probs", "BOOL", [1], "os"),
    _t("return_context_logits", "BOOL", [1], "os"),
    _t("return_generation_logits", "BOOL", [1], "os"),
    _t("return_perf_metrics", "BOOL", [1], "os"),
    _t("exclude_input_in_output", "BOOL", [1], "os"),
    _t("stop", "BOOL", [1], "os"),
    _t("streaming", "BOOL", [1], "os"),
    _t("prompt_embedding_table", "FP16", [-1, -1], "or"),
    _t("prompt_table_extra_ids", "UINT64", [-1], "or"),
    _t("prompt_vocab_size", "INT32", [1], "os"),
    _t("cross_attention_mask", "BOOL", [-1, -1], "or"),
    _t("mrope_rotary_cos_sin", "FP32", [-1], "o"),
    _t("mrope_position_deltas", "INT64", [1], "o"),
    _t("lora_task_id", "UINT64", [1], "os"),
    _t("lora_weights", "FP16", [-1, -1], "or"),
    _t("lora_config", "INT32", [-1, 3], "or"),
    _t("context_phase_params", "UINT8", [-1], "or"),
    _t("skip_cross_attn_blocks", "BOOL", [1], "or"),
    _t("retention_token_range_starts", "INT32", [-1], "or"),
    _t("retention_token_range_ends", "INT32", [-1], "or"),
    _t("retention_token_range_priorities", "INT32", [-1], "or"),
    _t("retention_token_range_durations_ms", "INT32", [-1], "or"),
    _t("retention_decode_priority", "INT32", [1], "or"),
    _t("retention_decode_duration_ms", "INT32", [1], "or"),
    _t("guided_decoding_guide_type", "STRING", [1], "or"),
    _t("guided_decoding_guide", "STRING", [1], "or"),
    _t("lookahead_window_size", "INT32", [1], "or"),
    _t("lookahead_ngram_size", "INT32", [1], "or"),
    _t("lookahead_verification_set_size", "INT32", [1], "or"),
]
ENGINE_OUTPUTS = [
    _t("output_ids", "INT32", [-1, -1]),
    _t("sequence_length", "INT32", [-1]),
    *RESPONSE_OUTPUTS[:6],
    _t("context_phase_params", "UINT8", [-1]),
    *RESPONSE_OUTPUTS[6:],
]

# upstream's BLS takes the ensemble's inputs in another order, some as scalars (reshape to []) and the
# guided-decoding ones without allow_ragged_batch
_BLS_ORDER = ["text_input", "decoder_text_input", "max_tokens", "bad_words", "stop_words", "exclude_input_in_output",
              "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty", "repetition_penalty",
              "min_length", "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs",
              "return_context_logits", "return_generation_logits", "num_return_sequences", "beam_width", "stream",
              "prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id", "embedding_bias_words",
              "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config", "return_perf_metrics",
              "guided_decoding_guide_type", "guided_decoding_guide"]
_BLS_SCALARS = {"return_log_probs", "return_context_logits", "return_generation_logits", "num_return_sequences",
                "lora_task_id", "return_perf_metrics"}
_BLS_NOT_RAGGED = {"guided_decoding_guide_type", "guided_decoding_guide"}
_BY_NAME = {t.name: t for t in ENSEMBLE_INPUTS}
BLS_INPUTS = [Tensor(t.name, t.dtype, t.dims, t.optional, t.ragged and t.name not in _BLS_NOT_RAGGED,
                     t.name in _BLS_SCALARS) for t in (_BY_NAME[name] for name in _BLS_ORDER)]
BLS_OUTPUTS = ENSEMBLE_OUTPUTS


# ------------------------------------------------------------------------------ one request, both backends

_FROM_VLLM = {"seed": "random_seed", "min_tokens": "min_length", "stop": "stop_words", "n": "num_return_sequences"}
"""vLLM ``SamplingParams`` names whose TensorRT-LLM input has another name (docs/llm.md has the table)."""

VLLM_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``SamplingParams.max_tokens`` default; the ensemble requires ``max_tokens``, so it gets the same."""


def ensemble_request(prompt: str, parameters: Mapping[str, Any] | None = None, *,
                     stream: bool | None = None) -> dict[str, np.ndarray]:
    """The input tensors (batch of one) of the ensemble or the BLS model for one prompt.

    ``parameters`` are vLLM's sampling parameters (``max_tokens``, ``temperature``, ``seed``, ``stop`` …)
    or the ensemble's own input names (``random_seed``, ``stop_words``, ``beam_width`` …); one with no
    TensorRT-LLM equivalent is refused, naming it.
    """
    import numpy as np  # noqa: PLC0415 - not needed to generate configs

    values: dict[str, Any] = {"text_input": prompt, "max_tokens": VLLM_DEFAULT_MAX_TOKENS}
    for key, value in (parameters or {}).items():
        values[_FROM_VLLM.get(key, key)] = value
    if stream is not None:
        values["stream"] = stream
    by_name = {t.name: t for t in ENSEMBLE_INPUTS}
    unknown = sorted(key for key in values if key not in by_name)
    if unknown:
        raise InputError(f"no TensorRT-LLM ensemble input for {', '.join(unknown)}",
                         hint="see the table of equivalents in docs/llm.md (One client request)")
    tensors = {}
    for name, value in values.items():
        spec = by_name[name]
        items = value if isinstance(value, (list, tuple, np.ndarray)) else [value]
        if spec.dtype == "STRING":
            array = np.array([[str(v).encode() for v in items]], dtype=np.object_)
        else:
            array = np.array([items], dtype=cfg.numpy_dtype(cfg.data_type(spec.dtype)))
        tensors[name] = array
    return tensors
