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


def st_checkpoint(folder: Path, *, pooling: str | tuple[str, ...] = "mean", normalize: bool = True,
                  dense: int | None = None, activation: str = "tanh", arch: str = "bert", max_length: int = 24,
                  prompts: dict[str, str] | None = None, default_prompt: str | None = None,
                  include_prompt: bool = True, lowercase: bool = False, seed: int = 0,
                  token_types: bool | None = None) -> Path:
    """A sentence-transformers checkpoint saved by the sentence-transformers library itself (modules.json,
    1_Pooling, optional Dense and Normalize) around a tiny random encoder of architecture ``arch``."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    base = tiny_encoder(folder.with_name(folder.name + "-base"), arch=arch, seed=seed, max_length=max_length,
                        token_types=token_types)
    transformer = models.Transformer(str(base), max_seq_length=max_length, do_lower_case=lowercase)
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling,
                                           include_prompt=include_prompt)]
    width = modules[1].get_embedding_dimension()
    if dense:
        act = {"tanh": torch.nn.Tanh(), "identity": torch.nn.Identity(), "relu": torch.nn.ReLU()}[activation]
        torch.manual_seed(seed + 100)
        modules.append(models.Dense(width, dense, activation_function=act))
    if normalize:
        modules.append(models.Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt)
    model.save(str(folder))
    return folder


def tiny_encoder(folder: Path, *, arch: str = "bert", seed: int = 0, max_length: int = 24,
                 head: str | None = None, num_labels: int = 1, labels: list[str] | None = None,
                 token_types: bool | None = None) -> Path:
    """A 2-layer encoder (hidden 32) of ``arch`` (bert, distilbert, mpnet, roberta, xlm-roberta, modernbert)
    with a WordPiece tokenizer (a BPE-free vocabulary keeps the tests offline); ``head="classify"`` saves
    a *ForSequenceClassification model with ``num_labels`` (and ``labels`` as id2label)."""
    import torch
    import transformers as tf

    if arch in ("bert", "distilbert") and head is None and token_types is None:
        return tiny_bert(folder, seed=seed, model_type=arch, max_length=max_length)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    vocab_file = folder / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n")
    common = dict(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    configs = {"bert": (tf.BertConfig, common), "mpnet": (tf.MPNetConfig, common),
               "roberta": (tf.RobertaConfig, {**common, "max_position_embeddings": 66, "pad_token_id": 0}),
               "xlm-roberta": (tf.XLMRobertaConfig, {**common, "max_position_embeddings": 66}),
               "distilbert": (tf.DistilBertConfig, dict(vocab_size=len(vocab), dim=32, n_layers=2, n_heads=2,
                                                         hidden_dim=64, max_position_embeddings=64)),
               "modernbert": (getattr(tf, "ModernBertConfig", None),
                              {**common, "global_attn_every_n_layers": 1, "local_attention": 16,
                               "cls_token_id": 2, "sep_token_id": 3, "bos_token_id": 2, "eos_token_id": 3})}
    config_class, kwargs = configs[arch]
    if head == "classify":
        names = labels or [f"LABEL_{i}" for i in range(num_labels)]
        kwargs = {**kwargs, "num_labels": len(names), "id2label": dict(enumerate(names)),
                  "label2id": {n: i for i, n in enumerate(names)}}
    config = config_class(**kwargs)
    torch.manual_seed(seed)
    model = (tf.AutoModelForSequenceClassification if head == "classify" else tf.AutoModel).from_config(config)
    model.save_pretrained(str(folder))
    # only BERT has token types: the tokenizers of the others do not produce them
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if (token_types is None and arch == "bert")
                                               or token_types else [])
    tokenizer = tf.BertTokenizerFast(vocab=str(vocab_file), do_lower_case=True, model_max_length=max_length,
                                     model_input_names=names)
    tokenizer.save_pretrained(str(folder))
    return folder


def cross_encoder(folder: Path, *, arch: str = "bert", max_length: int = 24, seed: int = 0) -> Path:
    """A reranker saved by sentence-transformers' CrossEncoder (one score per query/passage pair)."""
    from sentence_transformers import CrossEncoder

    base = tiny_encoder(folder.with_name(folder.name + "-base"), arch=arch, seed=seed, max_length=max_length,
                        head="classify", num_labels=1)
    CrossEncoder(str(base), num_labels=1, max_length=max_length, device="cpu").save(str(folder))
    return folder
