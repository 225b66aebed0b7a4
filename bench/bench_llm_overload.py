"""Benchmark: a vLLM model at 2 x capacity, with and without trm's bound on waiting requests.

Without a bound the engine's own waiting queue grows for as long as requests arrive faster than it
finishes them: every request waits behind all the earlier ones and TTFT grows for everyone. With
``--max-waiting-requests N`` (config parameter ``max_waiting_requests``) trm's backend answers a request at
once with UNAVAILABLE while N requests wait for their first token.

One random-weight Llama (``tests/llm_checkpoints.causal_lm``) is published twice with ``--format vllm``
(same engine arguments): ``unbounded`` and ``bounded`` (``--max-waiting-requests`` = ``--max-num-seqs``:
one batch waiting). On one embedded tritonserver, capacity is measured closed loop (``--max-num-seqs``
concurrent streams), then each model gets open-loop Poisson traffic (``repo_manager.adapters.loadgen.llm``) at
0.5 x and 2 x that capacity: accepted TTFT p50/p99 (completed streams only), rejected share,
goodput under the TTFT SLO, wall time of the run (a backlog shows there).

    PYTHONPATH=$PWD python bench/bench_llm_overload.py            # about 4 minutes on 2 shared cores

Prints a markdown table and writes ``bench/results/bench_llm_overload.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llm_checkpoints import causal_lm  # noqa: E402

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, run_llm  # noqa: E402
from repo_manager.adapters.loadgen.measure import Target  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402


def publish(checkpoint: Path, repo: Path, name: str, seqs: int, bound: int | None) -> None:
    args = [sys.executable, "-m", "repo_manager", "publish", "model", str(checkpoint), "--name", name, "--format",
            "vllm", "--repo", str(repo), "--max-num-seqs", str(seqs), "--no-verify"]
    if bound:
        args += ["--max-waiting-requests", str(bound)]
    subprocess.run(args, check=True, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4, help="max_num_seqs of both models")
    parser.add_argument("--requests", type=int, default=120, help="measured requests per point")
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--input-tokens", type=int, default=16)
    parser.add_argument("--factors", default="0.5,2")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_llm_overload.json")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trm-llm-overload-") as tmp:
        work = Path(tmp)
        checkpoint = causal_lm(work / "ckpt", max_position_embeddings=256)
        repo = work / "repo"
        publish(checkpoint, repo, "unbounded", options.seqs, None)
        publish(checkpoint, repo, "bounded", options.seqs, options.seqs)
        shape = dict(input_tokens=Lengths(options.input_tokens), output_tokens=Lengths(options.output_tokens))
        rows, record = [], {"seqs": options.seqs, "bound": options.seqs, "points": []}
        with TritonServer(repo) as server, TritonClient(server.url, timeout_s=1800) as client:
            for name in ("unbounded", "bounded"):
                client.load(name)
            closed = run_llm(Target("unbounded", server.url),
                             LLMLoad(concurrency=options.seqs, requests=40, warmup_requests=options.seqs, **shape))
            capacity = closed.request_throughput
            ttft_slo = 4 * closed.ttft_ms.p99 if closed.ttft_ms else 1000.0
            record.update(capacity_rps=capacity, closed_loop=closed.to_dict(), ttft_slo_ms=ttft_slo)
            print(f"capacity: {capacity:.2f} requests/s closed loop at {options.seqs} streams; TTFT p99 there "
                  f"{closed.ttft_ms.p99:.0f} ms; SLO for goodput: TTFT p99 <= {ttft_slo:.0f} ms")
            for factor in (float(f) for f in options.factors.split(",")):
                for name in ("unbounded", "bounded"):
                    started = time.monotonic()
                    result = run_llm(Target(name, server.url),
                                     LLMLoad(rate=capacity * factor, requests=options.requests, ttft_slo_ms=ttft_slo,
                                             warmup_requests=0, seed=int(factor * 10), **shape))
                    wall = time.monotonic() - started
                    rejected = result.failed / result.requests
                    point = {"model": name, "factor": factor, "rate": capacity * factor, "wall_s": wall,
                             "rejected_fraction": rejected, **result.to_dict()}
                    record["points"].append(point)
                    ttft = result.ttft_ms
                    rows.append(f"| {name} | {factor:g} x ({capacity * factor:.1f}/s) | {result.completed} | "
                                f"{rejected:.0%} | {ttft.p50:.0f} | {ttft.p99:.0f} | {result.goodput or 0:.2f} | "
                                f"{wall:.0f} |" if ttft else f"| {name} | {factor:g} x | 0 | {rejected:.0%} | - | - | "
                                f"0 | {wall:.0f} |")
                    print(rows[-1], flush=True)
    print("\n| model | offered | completed | rejected | TTFT p50 ms | TTFT p99 ms | goodput/s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"written: {options.out}")


if __name__ == "__main__":
    main()
