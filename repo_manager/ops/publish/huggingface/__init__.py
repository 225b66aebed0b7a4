"""Hugging Face checkpoints: a checkpoint folder in, a text-in Triton ensemble out.

``trm publish model CHECKPOINT --name NAME`` publishes three models, each with its own versions and manifests:

    NAME_tokenizer   Python backend: TEXT (and QUERY for a reranker) -> input_ids, attention_mask[,
                     token_type_ids] (INT64) with the checkpoint's own fast tokenizer (tokenizer.json), its max
                     length, lower-casing and prompt
    NAME_encoder     backend "onnxruntime": the encoder exported with torch.onnx (dynamic batch and sequence
                     axes) *including* the head the checkpoint declares (see ``pipeline``): pooling, Dense,
                     Normalize for embeddings; the classification head and its activation for scores
    NAME             the ensemble: TEXT -> EMBEDDING | SCORE (rerank) | SCORES (classify), pinning the member
                     versions it was verified with

Why the head lives in the ONNX graph rather than in a model of its own: it is a few tensor ops that
onnxruntime runs in the same session call, so the ensemble needs no third Python hop.

Verification sends the same texts through the ensemble on Triton and through the library the checkpoint
came from (``reference``): a sentence, an empty string, a text longer than the max length, non-ASCII
text, emoji, and a mixed-length batch of all. Embeddings must agree in cosine *and* vector length (cosine
alone cannot see a missing or extra normalisation), scores within a tolerance, by the criterion of the
version's precision (``precision.py``). The per-case results and the reference library and version go
into every manifest; ``--eval-data`` adds the quality gate on the user's own texts (``quality.py``).

Every check of the checkpoint (config.json, modules, weights, tokenizer, a trial forward pass) happens
before anything is staged, so bad input writes nothing.

One job per module, in the order a publish runs them:

    pipeline         what the checkpoint declares it computes, read from its files (task, pooling, head)
    checkpoint       the folder checked without loading weights (``inspect_checkpoint``); the PyPI examples
    load             the checkpoint loaded in PyTorch, run and exported to ONNX with its head
    precision        the precisions served (fp32, fp16 where this node runs it, int8 by onnxruntime's quantization
                     in recipes tried in order) and their criteria
    quality          the quality gate: drift from the fp32 reference on the user's own data
    reference        the library the checkpoint came from, which verification compares with
    verify           the verification cases and how each answer is judged
    configs          the three models' Triton configs
    build            ``build_huggingface``: all of the above, then the three models staged
    tokenizer_model  the tokenizer's Triton Python model (copied into each version, never imported)

This module holds the tensor names the three models serve, which several of them share.
"""

from __future__ import annotations

TEXT_INPUT = "TEXT"
QUERY_INPUT = "QUERY"
LABEL_FILE = "labels.txt"
"""A classifier's labels, one a line in the order of its scores: the ``label_filename`` of its output."""
OUTPUTS = {"embedding": "EMBEDDING", "rerank": "SCORE", "classify": "SCORES"}
"""The ensemble's output per task; the encoder's is the same name in lower case."""
