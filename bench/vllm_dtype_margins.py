"""Teacher-forced margins of vLLM CPU greedy generation in bf16/fp16 against transformers float32.

For each prompt: vLLM's greedy token ids (and its logprob of each), then one transformers float32 forward over
prompt + those ids; per position the margin (nats) between transformers' argmax and vLLM's token, vLLM's
logprob minus transformers' logprob of the same token, and the prefix equal to transformers' own greedy.
A deliberately wrong model (one weight tensor scaled, another checkpoint's weights) is served by vLLM while
transformers reads the right one.

    PYTHONPATH=$PWD python bench/vllm_dtype_margins.py CHECKPOINT [--dtype bf16 fp16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("LC_ALL", "C.UTF-8")


def teacher_forced(model, prompt_ids, tokens):
    import torch

    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    top = logp.max(dim=-1).values
    got = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    return (top - got).tolist(), got.tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", nargs="+", default=["bf16"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--wrong", nargs="*", default=[], help="scale:TENSOR:FACTOR or other:CHECKPOINT")
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from repo_manager.ops.publish.vllm import PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(str(args.checkpoint))
    reference = AutoModelForCausalLM.from_pretrained(str(args.checkpoint), dtype=torch.float32).eval()
    prompts = dict(PROMPTS)
    prompts["long"] = " ".join(PROMPTS.values()) + " The quick brown fox jumps over the lazy dog." * 3
    # transformers' own greedy generation equals vLLM's tokens up to the first position whose margin is not 0
    # (teacher forcing on vLLM's prefix): the equal prefix needs no generate() of its own
    greedy = {case: tokenizer(text).input_ids for case, text in prompts.items()}
    runs = [(d, str(args.checkpoint), "right") for d in args.dtype]
    scratch = Path(tempfile.mkdtemp(prefix="wrong-"))
    for spec in args.wrong:
        kind, _, rest = spec.partition(":")
        folder = scratch / spec.replace(":", "_").replace("/", "_")
        shutil.copytree(args.checkpoint, folder)
        if kind == "scale":
            name, factor = rest.rsplit(":", 1)
            weights = load_file(str(folder / "model.safetensors"))
            weights[name] = weights[name] * float(factor)
            save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        else:
            shutil.copy(Path(rest) / "model.safetensors", folder / "model.safetensors")
        runs.append((args.dtype[0], str(folder), spec))
    torch_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    for dtype, folder, label in runs:
        try:
            llm = LLM(model=folder, dtype=torch_dtype[dtype], enforce_eager=True,
                      max_model_len=min(256, reference.config.max_position_embeddings),
                      kv_cache_memory_bytes=int(os.environ.get("KV_BYTES", 64 << 20)), max_num_seqs=4)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"dtype": dtype, "model": label, "error": str(exc).splitlines()[0][:300]}))
            continue
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": greedy[c]} for c in prompts], params, use_tqdm=False)
        for case, out in zip(prompts, outs):
            tokens = list(out.outputs[0].token_ids)
            vllm_lp = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
            margins, tf_lp = teacher_forced(reference, greedy[case], tokens)
            prefix = next((i for i, m in enumerate(margins) if m > 0), len(margins))
            deltas = [abs(a - b) for a, b in zip(vllm_lp, tf_lp)]
            print(json.dumps({"dtype": dtype, "model": label, "case": case, "equal_prefix": prefix,
                              "max_margin": round(max(margins), 4),
                              "first_over": {str(t): next((i for i, m in enumerate(margins) if m > t), None)
                                             for t in (0.1, 0.25, 0.5, 1.0)},
                              "max_logprob_delta": round(max(deltas), 4),
                              "mean_logprob_delta": round(sum(deltas) / len(deltas), 4)}), flush=True)
        del llm
        import gc
        gc.collect()
    shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
