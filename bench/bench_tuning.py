"""Benchmark: does `trm tune-batching` find what an exhaustive grid finds, in a fraction of its time?

A Python-backend model with a known cost per batch (``tests/cost_model.py``: a sleep of ``fixed_ms +
per_item_ms * batch`` per execution) is published with the seed's failure as its config: dynamic
batching with a large queue delay and large preferred batch sizes. Then, on one embedded tritonserver:

1. **no dynamic batching** and **the seed's config** are measured at low, peak and peak × headroom;
2. an **exhaustive grid** (max batch × instances × queue delay × preferred sizes) is measured as trm measures a
   candidate (levels hardest first, stopping at the first missed level, which only shortens the grid's
   time; capacity by the same ladder for every config that meets every level), and its best is the
   highest capacity;
3. **trm's search** runs as the command does (its own embedded server, profile, search, budget), and
   its choice is then measured on the bench server like the grid's configs;
4. **an independent check**, ``--rounds`` rounds (default 3): trm's choice and the grid's best, in turn
   (the order alternates), are loaded on the bench server and measured by ``bench/independent_load.py``,
   a separate process with fresh Poisson arrivals (its own seed each round): p99 at each level, then a
   capacity ladder in 10 % steps from peak x headroom. Per round the capacity ratio trm / grid; the
   summary is the worst round's.

Prints one table (markdown) and writes ``bench/results/bench_tuning.json``. Run from the repository root:

    PYTHONPATH=$PWD python bench/bench_tuning.py            # about 10 minutes on 2 cores

Why these numbers: on a 2-core machine the client, tritonserver and the Python stubs share the CPUs, and
one Python client drives about 1,000 requests/s. The model's cost (6 ms + 0.75 ms per item, a sleep) puts
the capacities of the interesting configs between 200 and 1,000 requests/s, where the client still
keeps up, and a batch of 1 at 136/s so that batching is needed for the peak. Low 150/s keeps a point
of 600 requests at 4 s; the SLO (40 ms) is tight enough that a 20+ ms queue delay breaks it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cost_model import write_cost_model  # noqa: E402
from run_and_record import run_and_record  # noqa: E402

from repo_manager.adapters.loadgen import Target  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.serving import load_version, version_config  # noqa: E402
from repo_manager.ops.tuning import Candidate, Profile, TuneRequest, tune_batching  # noqa: E402
from repo_manager.ops.tuning.prober import Prober  # noqa: E402
from repo_manager.ops.tuning.search import Search  # noqa: E402


def measure_all_levels(search: Search, candidate: Candidate) -> dict:
    """A baseline row: every level measured (no early stop), capacity when every level is met."""
    search.candidates[candidate.key] = candidate
    points = {lvl: search.prober.point(candidate, lvl, search.rates[lvl]) for lvl in ("low", "peak", "headroom")}
    capacity = search.climb(candidate) if all(p.meets_slo for p in points.values()) else None
    return row(candidate, points, capacity)


def row(candidate: Candidate, points: dict, capacity: float | None) -> dict:
    return {"config": candidate.label, "key": candidate.key,
            **{f"{lvl}_p99_ms": (round(p.p99_ms, 1) if p else None) for lvl, p in points.items()},
            "meets_slo_everywhere": all(p is not None and p.meets_slo for p in points.values()),
            "capacity_rps": capacity}


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trm-bench-"))
    settings = Settings(repository=tmp / "repo")
    source = write_cost_model(tmp / "src", name="ranker", fixed_ms=args.fixed_ms, per_item_ms=args.per_item_ms,
                              max_batch_size=32, dynamic_batching=True, delay_us=args.seed_delay_us,
                              preferred=(16, 32))
    publish_model(settings, source, "ranker", verify_model=False)
    repo = LocalRepository(settings.repository)
    headroom_rps = args.peak * args.headroom
    results: dict = {"model": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms},
                     "slo": {"p99_ms": args.p99_ms, "low_rps": args.low, "peak_rps": args.peak,
                             "headroom_rps": headroom_rps}, "requests_per_point": args.requests}

    # ---- trm's search, as the command runs it (its own server; its time includes the server start)
    request = TuneRequest("ranker", args.p99_ms, args.low, args.peak, headroom=args.headroom,
                          budget_s=args.budget, requests=args.requests, max_batch_limit=32)
    tuned = tune_batching(settings, request, lambda m, used, budget: print(f"  trm [{used:5.1f}s] {m}",
                                                                          file=sys.stderr, flush=True))
    results["trm_seconds"] = round(tuned.seconds, 1)
    results["trm_choice"] = tuned.chosen.to_dict() if tuned.chosen else None
    results["trm_status"] = tuned.status  # the batching is the choice whether or not a queue policy held
    # the overload step's whole record (its summary, what was written without a held policy, the near-capacity figure)
    results["trm_overload"] = tuned.overload.to_dict() if tuned.overload else None

    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "ranker")
        base = version_config(repo, "ranker", 1)
        prober = Prober(client, Target("ranker", server.url), base, args.p99_ms, 1e9, requests=args.requests,
                        progress=lambda m, used, budget: print(f"  bench [{used:6.1f}s] {m}", file=sys.stderr,
                                                               flush=True))
        search = Search(prober, Profile({1: 1.0}, 0.0, 1), Candidate.from_config(base), args.p99_ms, args.low,
                        args.peak, args.headroom)
        rows = {"no dynamic batching": measure_all_levels(search, Candidate(32, 1, False, origin="baseline")),
                "seed: large delay + preferred [16, 32]": measure_all_levels(search, Candidate.from_config(base))}
        grid_started = time.monotonic()
        grid = []
        for batch in (8, 16, 32):
            for instances in (1, 2):
                for delay, preferred in [(d, p) for d in args.grid_delays_us for p in args.grid_preferred]:
                    # the same space trm searches: preferred batch sizes too (none, or the max batch)
                    candidate = Candidate(batch, instances, True, delay, () if preferred == "none" else (batch,),
                                          "grid")
                    search.candidates[candidate.key] = candidate
                    met = search.evaluate(candidate) and search.meets_low(candidate)  # every level, for every config
                    capacity = search.climb(candidate) if met else None
                    grid.append(row(candidate, {lvl: search._level_point(candidate, lvl)
                                                for lvl in ("low", "peak", "headroom")}, capacity))
        grid_seconds = time.monotonic() - grid_started
        eligible = [g for g in grid if g["meets_slo_everywhere"]]
        best = max(eligible, key=lambda g: g["capacity_rps"]) if eligible else None
        if best:
            rows["grid best"] = best
        if tuned.chosen:
            rows["trm's choice"] = measure_all_levels(search, tuned.chosen)
        if best and tuned.chosen and args.rounds:
            results["independent"] = independent_rounds(args, client, server.url, base,
                                                        {"trm": tuned.chosen,
                                                         "grid best": search.candidates[best["key"]]})
    results.update(rows=rows, grid=grid, grid_configs=len(grid), grid_seconds=round(grid_seconds, 1))
    if best and tuned.chosen and rows["trm's choice"]["capacity_rps"]:
        results["capacity_ratio"] = round(rows["trm's choice"]["capacity_rps"] / best["capacity_rps"], 3)
    results["time_ratio"] = round(tuned.seconds / grid_seconds, 3)
    return results


def independent_rounds(args: argparse.Namespace, client: TritonClient, url: str, base, configs: dict,
                       seed: int = 101) -> dict:
    """Each config measured by a separate process with fresh arrivals (seeds from ``seed``), ``args.rounds`` times,
    interleaved; the capacity ratio per round is the first config's over the second's."""
    rates = [args.low, args.peak, args.peak * args.headroom]
    rounds = []
    for number in range(args.rounds):
        names = list(configs) if number % 2 == 0 else list(reversed(configs))
        measured = {}
        for name in names:
            client.load("ranker", configs[name].apply(base))
            command = [sys.executable, str(ROOT / "bench" / "independent_load.py"), "--url", url, "--model", "ranker",
                       "--p99-ms", str(args.p99_ms), "--rates", *map(str, rates), "--ladder-from", str(rates[-1]),
                       "--seed", str(seed + number)]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if done.returncode != 0:
                raise SystemExit(f"independent load failed: {done.stderr.strip()[-500:]}")
            measured[name] = json.loads(done.stdout)
            m = measured[name]
            print(f"  independent round {number + 1} {name} ({configs[name].key}): p99 "
                  + " / ".join(f"{p['p99_ms']:g}" for p in m["levels"]) + f" ms, capacity {m['capacity_rps']}",
                  file=sys.stderr, flush=True)
        first, second = (measured[name]["capacity_rps"] for name in list(configs)[:2])
        rounds.append({"round": number + 1, "order": names, "measured": measured,
                       "capacity_ratio": round(first / second, 3) if first and second else None})
    ratios = [r["capacity_ratio"] for r in rounds if r["capacity_ratio"] is not None]
    return {"configs": {name: c.key for name, c in configs.items()}, "rounds": rounds,
            "worst_capacity_ratio": min(ratios) if len(ratios) == len(rounds) else None,
            "meets_slo_every_round": {name: all(r["measured"][name]["meets_slo_at_every_level"] for r in rounds)
                                      for name in configs}}


def render(results: dict) -> str:
    slo = results["slo"]
    lines = [f"SLO p99 <= {slo['p99_ms']:g} ms at low {slo['low_rps']:g}/s, peak {slo['peak_rps']:g}/s, "
             f"peak x headroom {slo['headroom_rps']:g}/s; {results['requests_per_point']} requests per point; "
             f"model: {results['model']['fixed_ms']} ms + {results['model']['per_item_ms']} ms per item", "",
             "| configuration | low p99 ms | peak p99 ms | headroom p99 ms | meets SLO at every level | capacity/s |",
             "|---|---|---|---|---|---|"]
    for name, r in results["rows"].items():
        def cell(value):
            return "-" if value is None else f"{value:g}"
        lines.append(f"| {name}: {r['config']} | {cell(r['low_p99_ms'])} | {cell(r['peak_p99_ms'])} | "
                     f"{cell(r['headroom_p99_ms'])} | {'yes' if r['meets_slo_everywhere'] else 'no'} | "
                     f"{cell(r['capacity_rps'])} |")
    lines += ["", f"grid: {results['grid_configs']} configs in {results['grid_seconds']:g} s; "
                  f"trm: {results['trm_seconds']:g} s (time ratio {results['time_ratio']:g}); "
                  f"trm capacity / grid best capacity: {results.get('capacity_ratio', 'n/a')}"]
    independent = results.get("independent")
    if independent:
        lines += ["", "Independent check (a separate process, fresh arrivals each round):", "",
                  "| round | config | low p99 ms | peak p99 ms | headroom p99 ms | meets SLO | capacity/s |",
                  "|---|---|---|---|---|---|---|"]
        for r in independent["rounds"]:
            for name, m in r["measured"].items():
                p99 = [f"{p['p99_ms']:g}" for p in m["levels"]]
                capacity = "-" if m["capacity_rps"] is None else f"{m['capacity_rps']:g}" + (
                    " (lower bound)" if m["capacity_is_lower_bound"] else "")
                lines.append(f"| {r['round']} | {name}: `{independent['configs'][name]}` | {' | '.join(p99)} | "
                             f"{'yes' if m['meets_slo_at_every_level'] else 'no'} | {capacity} |")
        ratios = ", ".join(str(r["capacity_ratio"]) for r in independent["rounds"])
        lines += ["", f"capacity ratio trm / grid best per round: {ratios}; worst: "
                      f"{independent['worst_capacity_ratio']}; trm meets the SLO in every round: "
                      f"{independent['meets_slo_every_round']['trm']}; the grid's best: "
                      f"{independent['meets_slo_every_round']['grid best']}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p99-ms", type=float, default=40.0)
    parser.add_argument("--low", type=float, default=150.0)
    parser.add_argument("--peak", type=float, default=400.0)
    parser.add_argument("--headroom", type=float, default=1.2)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--budget", type=float, default=90.0, help="trm's search budget (s)")
    parser.add_argument("--fixed-ms", type=float, default=6.0)
    parser.add_argument("--per-item-ms", type=float, default=0.75)
    parser.add_argument("--seed-delay-us", type=int, default=40_000)
    parser.add_argument("--grid-delays-us", type=int, nargs="+", default=[0, 5_000, 20_000])
    parser.add_argument("--grid-preferred", nargs="+", choices=["none", "max"], default=["none", "max"],
                        help="preferred_batch_size in the grid: none, and/or [max batch]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the independent check (0: none)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_tuning.json")
    args = parser.parse_args()
    run_and_record(run, render, args)


if __name__ == "__main__":
    main()
