"""Moved: the TensorRT-LLM converter lives in ``repo_manager.publish.tensorrt_llm`` (one converter per source
format in ``repo_manager/publish/``). This name stays for code written against it."""

from repo_manager.publish.tensorrt_llm import *  # noqa: F403
from repo_manager.publish.tensorrt_llm import TrtllmOptions, prepare_tensorrt_llm, skipped_verification  # noqa: F401
