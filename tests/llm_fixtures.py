"""Test data for the TensorRT-LLM layout: tiny checkpoints and engine folders in TensorRT-LLM's format.

Engine config.json files follow the format ``trtllm-build`` writes and the runtime reads in
NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/runtime/gptJsonConfig.cpp`` (sections ``version``,
``pretrained_config`` with ``mapping`` and ``quantization``, ``build_config`` with ``plugin_config``) and
documented in TensorRT-LLM's ``docs/source/architecture/checkpoint.md``. The ``rank<N>.engine`` files
are opaque bytes here: trm never reads an engine's contents (only Triton's TensorRT-LLM backend does, on
a GPU), it copies, hashes and fingerprints them.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "hello", "world", "the", "engine", "runs", "on", "a", "gpu"]


def write_tokenizer(folder: Path) -> None:
    """A real (tiny, word-level) Hugging Face fast tokenizer, built locally: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(folder))


def llama_checkpoint(folder: Path, *, tokenizer: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": len(WORDS), "max_position_embeddings": 256, "tie_word_embeddings": False,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}, indent=2))
    if tokenizer:
        write_tokenizer(folder)
    return folder


def qwen_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": len(WORDS), "max_position_embeddings": 512, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"}, indent=2))
    write_tokenizer(folder)
    return folder


def engine_dir(folder: Path, checkpoint: Path, *, version: str = "0.12.0", tp: int = 1, max_batch_size: int = 16,
               max_input_len: int = 96, max_seq_len: int = 128, max_beam_width: int = 1, paged_kv_cache: bool = True,
               ranks: int | None = None, fingerprint: dict | None = None) -> Path:
    """An engine folder as trtllm-build leaves it (config.json + rank<N>.engine), for ``checkpoint``."""
    hf = json.loads((checkpoint / "config.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "version": version,
        "pretrained_config": {
            "architecture": hf["architectures"][0], "dtype": hf["torch_dtype"], "logits_dtype": "float32",
            "vocab_size": hf["vocab_size"], "max_position_embeddings": hf["max_position_embeddings"],
            "hidden_size": hf["hidden_size"], "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": hf["num_attention_heads"], "num_key_value_heads": hf["num_key_value_heads"],
            "head_size": hf["hidden_size"] // hf["num_attention_heads"], "hidden_act": hf["hidden_act"],
            "intermediate_size": hf["intermediate_size"], "position_embedding_type": "rope_gpt_neox",
            "share_embedding_table": hf["tie_word_embeddings"],
            "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
            "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        },
        "build_config": {
            "max_input_len": max_input_len, "max_seq_len": max_seq_len, "opt_batch_size": None,
            "max_batch_size": max_batch_size, "max_beam_width": max_beam_width, "max_num_tokens": 8192,
            "opt_num_tokens": None, "max_prompt_embedding_table_size": 0, "gather_context_logits": False,
            "gather_generation_logits": False, "strongly_typed": True, "max_draft_len": 0,
            "plugin_config": {"gpt_attention_plugin": "auto", "gemm_plugin": None, "paged_kv_cache": paged_kv_cache,
                              "tokens_per_block": 64, "remove_input_padding": True, "use_paged_context_fmha": False,
                              "context_fmha": True, "use_custom_all_reduce": True},
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for rank in range(tp if ranks is None else ranks):
        (folder / f"rank{rank}.engine").write_bytes(f"opaque engine bytes rank {rank}".encode() * 64)
    if fingerprint:
        (folder / "trm-build.json").write_text(json.dumps(fingerprint))
    return folder
