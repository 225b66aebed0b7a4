"""Shared by trm's Triton Python models (copied next to each model.py as trm_common.py)."""

import os


def parameter(config, key, default=None):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def version_path(args, relative):
    """A path from config.pbtxt, relative to this version's folder unless absolute."""
    if os.path.isabs(relative):
        return relative
    return os.path.join(args["model_repository"], args["model_version"], relative)


def load_tokenizer(folder):
    """(tokenizers.Tokenizer, end_id, pad_id) from a Hugging Face tokenizer folder.

    Uses the ``tokenizers`` library on tokenizer.json rather than ``transformers``: it is what the fast
    tokenizers run anyway, it starts in milliseconds, and it needs nothing else in the serving image.
    """
    import json

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    settings = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as handle:
                settings.update(json.load(handle))

    def token_id(key):
        token = settings.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    end_id = token_id("eos_token")
    end_id = 0 if end_id is None else end_id
    pad_id = token_id("pad_token")
    return tokenizer, end_id, end_id if pad_id is None else pad_id


# How a request flows through the layout: upstream's ensemble (tensorrtllm_backend v0.19.0
# all_models/inflight_batcher_llm/ensemble/config.pbtxt). The ensemble's config is generated from these
# maps, and the BLS model routes with the same ones at run time.

PREPROCESSING_FROM_REQUEST = {
    "QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
    "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words",
    "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
    "END_ID": "end_id", "PAD_ID": "pad_id", "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
}
"""preprocessing input <- request input"""

ENGINE_FROM_PREPROCESSING = {
    "input_ids": ("INPUT_ID", "_INPUT_ID"),
    "decoder_input_ids": ("DECODER_INPUT_ID", "_DECODER_INPUT_ID"),
    "input_lengths": ("REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN"),
    "decoder_input_lengths": ("REQUEST_DECODER_INPUT_LEN", "_REQUEST_DECODER_INPUT_LEN"),
    "request_output_len": ("REQUEST_OUTPUT_LEN", "_REQUEST_OUTPUT_LEN"),
    "end_id": ("OUT_END_ID", "_PREPROCESSOR_END_ID"),
    "pad_id": ("OUT_PAD_ID", "_PREPROCESSOR_PAD_ID"),
    "embedding_bias": ("EMBEDDING_BIAS", "_EMBEDDING_BIAS"),
    "stop_words_list": ("STOP_WORDS_IDS", "_STOP_WORDS_IDS"),
    "bad_words_list": ("BAD_WORDS_IDS", "_BAD_WORDS_IDS"),
    "prompt_table_extra_ids": ("OUT_PROMPT_TABLE_EXTRA_IDS", "_OUT_PROMPT_TABLE_EXTRA_IDS"),
}
"""engine input <- (preprocessing output, the ensemble's name for it)"""

ENGINE_FROM_REQUEST = {
    "exclude_input_in_output": "exclude_input_in_output", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
    "temperature": "temperature", "len_penalty": "length_penalty", "repetition_penalty": "repetition_penalty",
    "min_length": "min_length", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "random_seed": "random_seed", "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits", "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics", "num_return_sequences": "num_return_sequences",
    "beam_width": "beam_width", "streaming": "stream", "prompt_embedding_table": "prompt_embedding_table",
    "prompt_vocab_size": "prompt_vocab_size", "lora_task_id": "lora_task_id", "lora_weights": "lora_weights",
    "lora_config": "lora_config", "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
}
"""engine input <- request input, passed through unchanged"""

ENGINE_TOKENS = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
"""engine output -> the ensemble's name for it (postprocessing's TOKENS_BATCH, SEQUENCE_LENGTH)"""

RESPONSE_OUTPUTS = (
    "cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index", "sequence_index",
    "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
    "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
    "total_accepted_draft_tokens", "total_draft_tokens",
)
"""engine outputs returned to the client under their own names, beside text_output"""
