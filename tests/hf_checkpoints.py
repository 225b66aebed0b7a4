"""Tiny Hugging Face checkpoints built locally for the tests (random weights, a hand-written vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["the", "a", "man", "is", "eating", "food", "bread", "piece", "of", "quick", "brown", "fox", "jumps", "over",
         "lazy", "dog", "park", "band", "plays", "small", "while", "stock", "market", "fell", "today", "hello",
         "world", "zurich", "tokyo", "cafe", "naive", "short", "sentence", "long", "text"]


def tiny_bert(folder: Path, *, seed: int = 0, model_type: str = "bert", max_length: int = 24) -> Path:
    """A 2-layer BERT-style encoder (hidden 32) with a WordPiece tokenizer; texts truncate at ``max_length``."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast, DistilBertConfig, DistilBertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    vocab_file = folder / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    torch.manual_seed(seed)
    if model_type == "distilbert":
        model = DistilBertModel(DistilBertConfig(vocab_size=len(vocab), dim=32, n_layers=2, n_heads=2,
                                                 hidden_dim=64, max_position_embeddings=64))
    else:
        model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    model.save_pretrained(str(folder))
    tokenizer = BertTokenizerFast(vocab=str(vocab_file), do_lower_case=True, model_max_length=max_length)
    tokenizer.save_pretrained(str(folder))
    return folder


def break_checkpoint(folder: Path, how: str) -> Path:
    """Make a valid checkpoint folder invalid in one way."""
    if how == "no_config":
        (folder / "config.json").unlink()
    elif how == "no_weights":
        (folder / "model.safetensors").unlink()
    elif how == "no_tokenizer":
        for name in ("tokenizer.json", "vocab.txt"):
            (folder / name).unlink(missing_ok=True)
    elif how == "unsupported":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
        (folder / "config.json").write_text(json.dumps(config))
    else:
        raise ValueError(how)
    return folder
