"""LLMs on Triton: memory planning, TensorRT-LLM engines and their Triton layout, node compatibility.

- ``shape`` / ``plan``: what a model needs in GPU memory (weights, overhead, KV cache) — ``trm plan``;
- ``engine``: TensorRT-LLM engine folders (config.json, fingerprint) and the ``trtllm-build`` builder;
- ``layout``: the Triton TensorRT-LLM repository layout and the LLM-API layout, every config.pbtxt built
  through ``repo_manager.core.config``'s ModelConfig schema — ``trm publish model --format tensorrt-llm``;
- ``node`` / ``doctor``: the facts of a serving node and whether an engine can run there — ``trm doctor``,
  ``check_engine_compatible`` for sync and rollout.
"""
