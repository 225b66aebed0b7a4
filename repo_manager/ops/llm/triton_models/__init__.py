"""trm's own Python-backend models for the Triton TensorRT-LLM layout (copied into version folders).

Each file here becomes ``<model>/<version>/model.py``; they run inside Triton's Python backend stub and
are never imported by trm itself, except ``common.py`` (copied as ``trm_common.py``): its routing maps
are what ``repo_manager.ops.llm.layout`` wires the ensemble with, so the ensemble and the BLS model route a
request the same way. They read their settings from config.pbtxt ``parameters`` (written
through the ModelConfig schema by ``repo_manager.ops.llm.layout``) and resolve relative paths (the tokenizer,
the checkpoint) against their own version folder, so a version is self-contained wherever it is synced.
"""
