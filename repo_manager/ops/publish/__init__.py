"""Publishing: source formats (ONNX, Python-backend folders, Hugging Face checkpoints) into versions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, UsageError
from repo_manager.core.manifest import check_model_name
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.publish.core import PublishResult, detect_format, run_publish

__all__ = ["publish_model", "PublishResult"]


def publish_model(settings: Settings, source: str | Path, name: str, *, fmt: str | None = None,
                  options: cfg.ConfigOptions | None = None, inputs: list[cfg.TensorSpec] | None = None,
                  outputs: list[cfg.TensorSpec] | None = None, verify_model: bool = True,
                  progress: Progress = quiet, **format_options) -> PublishResult:
    """Publish ``source`` as the next version of ``name`` in ``settings.repository``.

    ``fmt="tensorrt-llm"`` takes ``trtllm=TrtllmOptions(...)`` (``publish.tensorrt_llm``); its versions are
    not verified on Triton (that needs a GPU and the TensorRT-LLM backend) and say why in their manifest.
    """
    check_model_name(name)
    source = Path(source)
    options = options or cfg.ConfigOptions()
    fmt = fmt or detect_format(source)
    if fmt != "huggingface" and {"precision", "eval_data", "quality_thresholds"} & \
            {k for k, v in format_options.items() if v}:
        raise UsageError(f"--precision, --eval-data and --quality-threshold are for Hugging Face checkpoints, and "
                         f"{source} is {fmt}",
                         hint="leave them out for this format")
    if fmt == "onnx":
        from repo_manager.ops.publish.onnx import build_onnx  # noqa: PLC0415 - a format's builder only for it
        build = build_onnx(source, options)
    elif fmt == "python":
        from repo_manager.ops.publish.python_model import build_python  # noqa: PLC0415 - a format's builder only for it
        build = build_python(source, inputs or [], outputs or [], options)
    elif fmt == "huggingface":
        from repo_manager.ops.publish.huggingface.build import build_huggingface  # noqa: PLC0415 - a format's builder only for it
        hf_options = {k: v for k, v in format_options.items() if k in ("task", "max_length", "pooling", "normalize",
                                                                           "prompt_name", "precision", "eval_data",
                                                                           "quality_thresholds")}
        build = build_huggingface(source, options, thresholds=settings.quality, settings_origin=settings.source,
                                  **hf_options)
    elif fmt == "tensorrt-llm":
        from repo_manager.ops.llm.node import probe_node  # noqa: PLC0415 - the node probe only for an engine
        from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions, prepare_tensorrt_llm, skipped_verification  # noqa: PLC0415 - a format's builder only for it
        node = format_options.get("node") or probe_node()
        trtllm = format_options.get("trtllm") or TrtllmOptions()
        if not trtllm.builder and settings.trtllm_builder:
            trtllm = replace(trtllm, builder=settings.trtllm_builder)
        build = prepare_tensorrt_llm(source, name, trtllm, node=node, progress=progress)
        return run_publish(settings, name, build, verify_model=False, progress=progress,
                           skipped_verification=skipped_verification(node))
    elif fmt == "vllm":
        from repo_manager.ops.llm.vllm import VllmOptions  # noqa: PLC0415 - only for vLLM
        from repo_manager.ops.publish.vllm import build_vllm, prepare_vllm  # noqa: PLC0415 - a format's builder only for it
        vllm_options = format_options.get("vllm") or VllmOptions()
        gpu = vllm_options.gpu_memory_gib
        if gpu is None:
            from repo_manager.ops.llm.node import probe_node  # noqa: PLC0415 - the node probe only for an engine
            node = format_options.get("node") or probe_node()
            gpu = node.gpus[0].memory_bytes / 1024**3 if node.gpus else None
        build = build_vllm(prepare_vllm(source, vllm_options, gpu_memory_gib=gpu), progress)
    else:
        raise InputError(f"source format {fmt!r} is not supported",
                         hint="publish an .onnx file, a Python-backend folder or a Hugging Face checkpoint")
    return run_publish(settings, name, build, verify_model=verify_model, progress=progress)
