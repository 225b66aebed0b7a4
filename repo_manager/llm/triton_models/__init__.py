"""trm's own Python-backend models for the Triton TensorRT-LLM layout (copied into version folders).

Each file here becomes ``<model>/<version>/model.py``; they run inside Triton's Python backend stub and
are never imported by trm itself. They read their settings from config.pbtxt ``parameters`` (written
through the ModelConfig schema by ``repo_manager.llm.layout``) and resolve relative paths (the tokenizer,
the checkpoint) against their own version folder, so a version is self-contained wherever it is synced.
"""
