"""The planner's table for public models: parameters, weights, KV cache per token, tokens that fit.

    PYTHONPATH=. python bench/llm_plan_table.py [--dtype bf16] [--gpus 24 80 141]

Reads the published config.json files in tests/data/llm/ (no download); the figures come from
``repo_manager.ops.llm.plan`` with its defaults (utilization 0.9, max_num_tokens 8192, tp 1). GPU memory in
GiB as nvidia-smi reports it; weights in GB (1e9 bytes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repo_manager.ops.llm.plan import GB, PlanRequest, plan_memory
from repo_manager.ops.llm.shape import load_shape

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "llm"
MODELS = {"Llama 3.1 8B": "llama-3.1-8b.json", "Mistral 7B v0.3": "mistral-7b-v0.3.json",
          "Qwen2.5 7B": "qwen2.5-7b.json", "Mixtral 8x7B": "mixtral-8x7b-v0.1.json",
          "Llama 3.1 70B": "llama-3.1-70b.json"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--gpus", type=float, nargs="+", default=[24, 80, 141])
    args = parser.parse_args()
    head = ["model", "parameters", f"weights {args.dtype}", "weights int4", "KV/token"] + \
        [f"tokens @ {g:g} GiB" for g in args.gpus]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, file in MODELS.items():
        shape = load_shape(DATA / file)
        plans = [plan_memory(shape, PlanRequest(g, dtype=args.dtype)) for g in args.gpus]
        int4 = plan_memory(shape, PlanRequest(args.gpus[0], dtype="int4"))
        cells = [label, f"{plans[0].parameters.total / 1e9:.2f}B", f"{plans[0].weight_bytes / GB:.1f} GB",
                 f"{int4.weight_bytes / GB:.1f} GB", f"{plans[0].kv_bytes_per_token / 1024:.0f} KiB"]
        cells += [f"{p.max_tokens:,}" if p.max_tokens else "weights do not fit" for p in plans]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
