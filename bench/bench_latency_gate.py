"""Benchmark: how the latency gate judges, on this machine, an identical version and one doing twice the work,
beside a CPU hog (the measurement tests/test_promote.py made before its tests moved to sleep-cost stand-ins).

A real tritonserver, a folder store, ONNX models whose cost is compute (``heavy``: 150 vs 300 layers of
512 x 512, about 10 and 20 ms a request here), the gate's own thresholds (25 % p99, 15 % capacity), short
points, three to six rounds. Each run promotes the identical version, then the slower one, with a busy loop
in another process, and records the verdicts, the rounds and the medians.

    python bench/bench_latency_gate.py [--runs 3] [--no-hog] [--out bench/results]

The figures in docs/promotion.md come from this script: the identical version should never be blocked
(pass or inconclusive), the slower one blocked in every run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_promote import BUSY_LATENCY, cpu_hog, heavy, make_settings, point, publish  # noqa: E402

from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.errors import GateError  # noqa: E402
from repo_manager.ops.promote import PromotionRequest, promote  # noqa: E402


def judged(settings, version: int) -> dict:
    """Promote ``version`` from staging with the latency gate: its verdict, rounds and medians."""
    point(settings, "staging", version)
    started = time.perf_counter()
    try:
        result = promote(settings, PromotionRequest("lin", "production", from_env="staging",
                                                    gates=("checksums", "latency")))
        gate, blocked = result.gates[1], False
    except GateError as refused:
        gate, blocked = refused.report.result.gates[1], True
    details = gate.details
    return {"blocked": blocked, "verdict": details["verdict"], "rounds": details["rounds"],
            "new": details["new"], "old": details["old"], "seconds": round(time.perf_counter() - started, 1),
            "summary": gate.summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-hog", action="store_true", help="measure without the busy loop")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp, TritonServer(Path(tmp) / "scratch") as triton:
        for run in range(args.runs):
            work = Path(tmp) / f"run-{run}"
            work.mkdir()
            settings = dataclasses.replace(make_settings(work, triton, str(work / "store")),
                                           gates={"latency": BUSY_LATENCY})
            base = heavy(work / "base.onnx", width=512, layers=150)
            v1 = publish(settings, base)
            point(settings, "production", v1)
            twin, slower = publish(settings, base), publish(settings, heavy(work / "slow.onnx", width=512, layers=300))
            with cpu_hog() if not args.no_hog else contextlib.nullcontext():
                same = judged(settings, twin)
                slow = judged(settings, slower)
            runs.append({"identical": same, "twice_the_work": slow})
            print(f"run {run + 1}: identical {same['verdict']} ({same['rounds']} rounds), twice the work "
                  f"{slow['verdict']} ({slow['rounds']} rounds): {slow['summary']}", flush=True)
    result = {"hog": not args.no_hog, "thresholds": BUSY_LATENCY, "runs": runs,
              "identical_blocked": sum(r["identical"]["blocked"] for r in runs),
              "twice_the_work_blocked": sum(r["twice_the_work"]["blocked"] for r in runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "latency_gate.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"identical version blocked in {result['identical_blocked']} of {len(runs)} runs; twice the work blocked "
          f"in {result['twice_the_work_blocked']} of {len(runs)}; {path}")


if __name__ == "__main__":
    main()
