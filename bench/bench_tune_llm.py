"""Benchmark: `trm tune-batching` on a vLLM model, the fast search against the exhaustive grid.

Target (issue 28): the setting the fast search chooses has a peak goodput (streams within both p99 SLOs
per second) of at least 95 % of the grid's best, found in at most a third of the grid's time.

One random-weight Llama (``tests/llm_checkpoints.causal_lm``) is published with ``--format vllm``; then

1. the **grid** (``search="grid"``): every (max_num_seqs, max_num_batched_tokens) at peak and low, on an
   embedded tritonserver, each setting one engine start (``tuning.llm.tune_llm``);
2. the **fast search** (``search="fast"``), by default *replayed on the grid's measurements*: the same
   ``fast_search`` code runs against a prober that answers from the grid's points and charges each the
   seconds it took there (its requests and, when the engine had to start with another setting, that
   start). Same measurements, so the comparison isolates the search; ``--live`` also runs it for real
   afterwards (a second set of engine starts, on a machine whose noise then differs).

    PYTHONPATH=$PWD python bench/bench_tune_llm.py --low-rps 1 --peak-rps 6     # 10-20 minutes on 2 cores

Prints the comparison and writes ``bench/results/bench_tune_llm.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llm_checkpoints import causal_lm  # noqa: E402

from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.tuning.llm import EngineCandidate, LLMPoint, LLMTuneRequest, choose, fast_search, tune_llm  # noqa: E402


class Replay:
    """``fast_search``'s view of a prober, answered from a finished grid's points; it charges each point the
    seconds it took in the grid, and an engine start (as long as the grid's) whenever the setting changes."""

    def __init__(self, request: LLMTuneRequest, grid: dict, served: EngineCandidate) -> None:
        self.request = request
        self.recorded = {(p["candidate"], p["level"]): p for p in grid["points"]}
        self.load_s = grid["load_seconds"]
        self.loaded = served.key
        self.points: list[LLMPoint] = []
        self.seconds = 0.0
        self.loads = 0

    def point(self, candidate: EngineCandidate, level: str) -> LLMPoint:
        done = next((p for p in self.points if p.candidate == candidate.key and p.level == level), None)
        if done is not None:
            return done
        data = dict(self.recorded[(candidate.key, level)])
        if self.loaded != candidate.key:
            self.seconds += self.load_s.get(candidate.key, 0.0)
            self.loads += 1
            self.loaded = candidate.key
        self.seconds += data["seconds"]
        head = {k: data.pop(k) for k in ("candidate", "level", "rate", "meets_slo", "seconds", "note")}
        point = LLMPoint(head["candidate"], head["level"], head["rate"], head["meets_slo"], head["seconds"],
                         head["note"], data)
        self.points.append(point)
        return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low-rps", type=float, default=1.0)
    parser.add_argument("--peak-rps", type=float, default=6.0)
    parser.add_argument("--ttft-p99-ms", type=float, default=1000.0)
    parser.add_argument("--itl-p99-ms", type=float, default=60.0)
    parser.add_argument("--seqs", default="1,2,4,8")
    parser.add_argument("--tokens", default="32,2048")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--input-tokens", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--live", action="store_true", help="also run the fast search for real")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_tune_llm.json")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trm-tune-llm-") as tmp:
        work = Path(tmp)
        checkpoint = causal_lm(work / "ckpt", max_position_embeddings=256)
        repo = work / "repo"
        subprocess.run([sys.executable, "-m", "repo_manager", "publish", "model", str(checkpoint), "--name", "tiny",
                        "--format", "vllm", "--repo", str(repo), "--max-num-seqs", "8", "--no-verify"],
                       check=True, capture_output=True, text=True)
        settings = Settings(repository=repo)
        request = LLMTuneRequest("tiny", options.ttft_p99_ms, options.itl_p99_ms, options.low_rps, options.peak_rps,
                                 seqs=tuple(int(v) for v in options.seqs.split(",")),
                                 tokens=tuple(int(v) for v in options.tokens.split(",")),
                                 search="grid", requests=options.requests, input_tokens=options.input_tokens,
                                 output_tokens=options.output_tokens)
        grid = tune_llm(settings, request, lambda message, used, budget: print(f"[{used:6.0f} s] {message}",
                                                                               flush=True))
        record = grid.to_dict()
        candidates = request.candidates(None)
        replay = Replay(request, record, grid.current)
        # what the grid spent besides its points and engine starts (the server's start, version 1's engine):
        # the fast search spends it too
        replay.seconds = grid.seconds - sum(p.seconds for p in grid.outcome.points) - \
            sum(grid.outcome.load_seconds.values())
        notes = fast_search(replay, candidates, grid.current.max_num_batched_tokens)
        fast_choice = choose(replay.points, candidates)
        best = grid.outcome.best_peak_goodput()
        grid_chosen = grid.chosen

        def peak_goodput(c: EngineCandidate | None) -> float:
            point = grid.outcome.point(c.key, "peak") if c else None
            return point.goodput if point else 0.0

        summary = {
            "grid": {"candidates": len(candidates), "seconds": round(grid.seconds, 1),
                     "engine_loads": grid.outcome.loads, "chosen": grid_chosen.key if grid_chosen else None,
                     "chosen_peak_goodput": peak_goodput(grid_chosen), "best_peak_goodput": best},
            "fast_replayed": {"points": len(replay.points), "seconds": round(replay.seconds, 1),
                              "engine_loads": replay.loads, "chosen": fast_choice.key if fast_choice else None,
                              "chosen_peak_goodput": peak_goodput(fast_choice), "notes": notes},
        }
        summary["goodput_ratio"] = round(peak_goodput(fast_choice) / best, 3) if best else None
        summary["time_ratio"] = round(replay.seconds / grid.seconds, 3)
        if options.live:
            live = tune_llm(settings, LLMTuneRequest(**{**request.__dict__, "search": "fast"}))
            summary["fast_live"] = {"seconds": round(live.seconds, 1), "engine_loads": live.outcome.loads,
                                    "chosen": live.chosen.key if live.chosen else None,
                                    "points": [p.to_dict() for p in live.outcome.points]}
    print(json.dumps(summary, indent=2))
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps({"summary": summary, "grid_record": record}, indent=2, default=str) + "\n")
    print(f"written: {options.out}")


if __name__ == "__main__":
    main()
