"""An independent load for a served model: its own process, fresh Poisson arrivals, no state of the tuner.

``bench/bench_tuning.py`` starts this once per configuration and round, after loading the configuration on
its server, so that a choice is judged by a client that did not choose it: a new process (its own event
loop, connections and request samples) and arrivals drawn from ``--seed``, never the tuner's.

It measures the SLO levels (each rate in ``--rates``: p99 of every request, a rejection counted as a miss)
and then climbs a capacity ladder from ``--ladder-from`` in steps of ``--ladder-step`` until a point misses
the SLO or the client cannot send the rate, or for 12 steps (in both last cases the capacity is a lower bound
and says so). Prints one
JSON object. From the repository root:

    PYTHONPATH=$PWD python bench/independent_load.py --url http://127.0.0.1:8000 --model ranker \
        --p99-ms 25 --rates 50 400 480 --ladder-from 480 --seed 11
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from repo_manager.adapters.loadgen import LoadSpec, Target, Workload, measure  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402

MAX_LADDER_STEPS = 12


def point(target: Target, workload: Workload, rate: float, seconds: float, seed: int) -> dict:
    result = measure(target, LoadSpec(rate=rate, requests=max(200, int(rate * seconds)), warmup_s=1.0, seed=seed),
                     workload)
    return {"rate": rate, "p99_ms": round(result.p99_ms, 2), "valid": result.valid,
            "invalid_reason": result.invalid_reason, "errors": result.errors, "rejected": result.rejected,
            "send_rps": round(result.send_rps, 1)}


def run(args: argparse.Namespace) -> dict:
    target = Target(args.model, args.url)
    with TritonClient(args.url) as client:
        workload = Workload.from_config(client.model_config(args.model), variants=16)
    seed = args.seed * 1000
    levels = []
    for number, rate in enumerate(args.rates):
        levels.append(point(target, workload, rate, args.seconds, seed + number))
    meets = all(p["valid"] and not p["errors"] and p["p99_ms"] <= args.p99_ms for p in levels)
    capacity, lower_bound, ladder = None, False, []
    if meets:
        rate = args.ladder_from
        for step in range(MAX_LADDER_STEPS):
            measured = point(target, workload, round(rate, 1), args.seconds, seed + 100 + step)
            ladder.append(measured)
            if not measured["valid"]:
                lower_bound = True  # the client, not the server, limited this point
                break
            if measured["errors"] or measured["p99_ms"] > args.p99_ms:
                break
            capacity = measured["rate"]
            rate *= args.ladder_step
        else:
            lower_bound = True  # every step met the SLO: the capacity is at least the last one
    return {"model": args.model, "seed": args.seed, "slo_p99_ms": args.p99_ms, "levels": levels,
            "meets_slo_at_every_level": meets, "capacity_rps": capacity, "capacity_is_lower_bound": lower_bound,
            "ladder": ladder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--p99-ms", type=float, required=True)
    parser.add_argument("--rates", type=float, nargs="+", required=True, help="the SLO levels, requests/s")
    parser.add_argument("--ladder-from", type=float, required=True)
    parser.add_argument("--ladder-step", type=float, default=1.1)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of arrivals per point (>= 200 requests)")
    parser.add_argument("--seed", type=int, default=1)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
