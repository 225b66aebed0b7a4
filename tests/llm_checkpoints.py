"""Tiny causal-LM checkpoints built locally for the LLM tests: random weights from transformers' own config
classes, a byte-level BPE tokenizer trained by ``tokenizers`` on a few sentences (no hub download), float32.

The tokenizer is byte-level, so any text (accents, CJK, emoji) encodes without an unknown token, as a real
Llama/Qwen2 tokenizer does.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating a piece of bread in the park.",
    "Zürich, Tōkyō and São Paulo are cities; naïve café façade.",
    "Hello world! How are you today? I am fine, thank you.",
    "東京は日本の首都です。 北京是中国的首都。",
    "Emoji: 🙂 🚀 🎉 and numbers 0 1 2 3 4 5 6 7 8 9.",
    "def main():\n    return 42\n",
]


def train_tokenizer(folder: Path, vocab_size: int = 384) -> int:
    """A byte-level BPE tokenizer with <s>/</s>/<unk> saved as tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=1 << 20)
    fast.save_pretrained(str(folder))
    return tokenizer.get_vocab_size()


def causal_lm(folder: Path, *, family: str = "llama", head_dim: int = 32, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, max_position_embeddings: int = 256, seed: int = 0,
              tokenizer: bool = True) -> Path:
    """A random-weight ``family`` (llama or qwen2) causal LM in ``folder``: safetensors, fp32, config.json
    from transformers' config class, and (``tokenizer``) a trained byte-level BPE tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder) if tokenizer else 384
    hidden = heads * head_dim
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="float32")
    config = LlamaConfig(head_dim=head_dim, **common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits far apart, no near-ties in greedy
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    if not tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    return folder


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
