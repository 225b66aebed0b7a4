"""Build a TensorRT-LLM engine from a Hugging Face checkpoint with TensorRT-LLM's LLM API.

Runs where TensorRT-LLM and an NVIDIA GPU are (this process imports ``tensorrt_llm``; trm itself never
does). Takes trtllm-build's option names, saves the engine folder (config.json + rank<N>.engine) and
writes ``trm-build.json`` beside it: the compute capability and versions the engine is bound to.

    python -m repo_manager.ops.llm.build_worker --checkpoint_dir HF_DIR --output_dir OUT --max_batch_size 8 ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from repo_manager.ops.llm.engine import FINGERPRINT_FILE
from repo_manager.ops.llm.node import probe_node

_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens", "tp"):
        parser.add_argument(f"--{name}", type=int, default=1 if name in ("tp", "max_beam_width") else None)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args(argv)

    from tensorrt_llm import BuildConfig  # noqa: PLC0415 - only on a GPU machine
    try:  # TensorRT-LLM >= 1.0: the engine-building LLM lives here (the default LLM is the PyTorch one)
        from tensorrt_llm._tensorrt_engine import LLM  # noqa: PLC0415 - heavy library, imported where used
    except ImportError:
        from tensorrt_llm import LLM  # noqa: PLC0415 - optional: present only where TensorRT-LLM is installed

    build = BuildConfig(max_batch_size=args.max_batch_size, max_input_len=args.max_input_len,
                        max_seq_len=args.max_seq_len, max_beam_width=args.max_beam_width,
                        max_num_tokens=args.max_num_tokens)
    llm = LLM(model=args.checkpoint_dir, build_config=build, tensor_parallel_size=args.tp,
              dtype=_DTYPES.get(args.dtype or "", "auto"))
    llm.save(args.output_dir)
    node = probe_node()
    if not node.gpus:
        raise SystemExit("no GPU visible after the build: cannot record the engine's compute capability")
    record = {"compute_capability": node.gpus[0].compute_capability, "gpu_name": node.gpus[0].name,
              "tensorrt_llm_version": node.tensorrt_llm_version, "tensorrt_version": node.tensorrt_version,
              "cuda_version": node.cuda_runtime_version or node.driver_cuda_version}
    Path(args.output_dir, FINGERPRINT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutdown = getattr(llm, "shutdown", None)
    if shutdown:
        shutdown()


if __name__ == "__main__":
    main()
