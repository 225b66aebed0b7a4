"""Benchmark: under a spike past capacity, does trm's queue policy shed instead of cascading?

A Python-backend model with a known cost (``tests/cost_model.py``: ``fixed_ms + per_item_ms * batch`` of
sleep per execution) is published with the seed's kind of config (a long queue delay, large preferred
batch sizes). ``trm tune-batching`` tunes it (batching + queue policy at 2 x capacity). Then, on one
embedded tritonserver, three configs, each at 0.5, 1, 1.5, 2 and 3 x the measured capacity, open-loop
Poisson for a few seconds per point:

* **trm: tuned + queue policy** (what ``--write`` publishes);
* **tuned, no queue policy** (the same batching, Triton's default unbounded queue);
* **seed** (the published config).

Per point: accepted p99 (answered requests only), goodput (answers within the SLO per second), rejected
fraction and rejection latency, errors, and the time to recover once the load drops back to the peak rate
(``RECOVER_S`` seconds of it follow each point). A point waits for every answer, so a backlog shows in full.
Prints a markdown table and writes ``bench/results/bench_overload.json``. From the repository root:

    PYTHONPATH=$PWD python bench/bench_overload.py          # about 6 minutes on 2 cores

Capacity is small on purpose (about 150-250 requests/s) so that one Python client on a shared 2-core
machine can still offer 3 x capacity; a point where it could not is marked (``sent`` below ``offered``).
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

from repo_manager.adapters.loadgen import LoadSpec, Phase, Target, Workload, measure, run_schedule  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.serving import load_version, version_config  # noqa: E402
from repo_manager.ops.tuning import Candidate, TuneRequest, tune_batching  # noqa: E402
from repo_manager.ops.tuning.core import DEFAULT_BUDGET_S  # noqa: E402
from repo_manager.ops.tuning.overload import PolicySearch  # noqa: E402
from repo_manager.ops.tuning.prober import Prober  # noqa: E402

MULTIPLES = (0.5, 1.0, 1.5, 2.0, 3.0)
RECOVER_S = 3.0
"""Seconds at the peak rate after each point: the time to recover is measured there (None: not within them)."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trm-bench-overload-"))
    settings = Settings(repository=tmp / "repo")
    source = write_cost_model(tmp / "src", name="ranker", fixed_ms=args.fixed_ms, per_item_ms=args.per_item_ms,
                              max_batch_size=args.seed_max_batch, dynamic_batching=True, delay_us=args.seed_delay_us,
                              preferred=tuple(args.seed_preferred))
    publish_model(settings, source, "ranker", verify_model=False)
    repo = LocalRepository(settings.repository)
    request = TuneRequest("ranker", args.p99_ms, args.low, args.peak, budget_s=args.budget, requests=args.requests,
                          max_batch_limit=args.seed_max_batch, overload_factor=2.0,
                          fast_rejection=args.fast_rejection)
    tuned = tune_batching(settings, request, lambda m, used, budget: log(f"  trm [{used:5.1f}s] {m}"))
    results: dict = {"model": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms},
                     "slo_p99_ms": args.p99_ms, "trm_seconds": round(tuned.seconds, 1), "status": tuned.status,
                     "fast_rejection": args.fast_rejection,
                     "tuning_overload": tuned.overload.to_dict() if tuned.overload else None}
    base = version_config(repo, "ranker", 1)
    rows = []
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "ranker")
        target = Target("ranker", server.url)
        workload = Workload.from_config(base)
        if tuned.overload is not None and tuned.chosen is not None and tuned.chosen.has_queue_policy:
            chosen, capacity = tuned.chosen, tuned.overload.capacity_rps
            results["path"] = ("trm tune-batching (batching + queue policy)" if tuned.overload.chosen else
                               "trm tune-batching (batching + the closest queue policy: none held)")
        else:
            # on a machine too busy for the batching search to pass, the queue policy is still chosen
            # the way the tuner does, on the seed's batch size without a delay, against the throughput
            # the server sustains (closed loop, enough clients to keep every batch full)
            log(f"  tuning chose no queue policy ({tuned.status}; "
                f"{tuned.overload.summary() if tuned.overload else '; '.join(tuned.outcome.notes)}): "
                "queue policy on a fixed batching")
            batching = Candidate(args.seed_max_batch, 1, True, 0, (), "bench")
            prober = Prober(client, target, base, args.p99_ms, 1e9, requests=args.requests,
                            progress=lambda m, used, budget: log(f"  policy [{used:5.1f}s] {m}"))
            profile = prober.profile(batching, args.seed_max_batch)
            prober.load(batching)
            capacity = measure(target, LoadSpec(concurrency=4 * args.seed_max_batch, requests=600, warmup_s=1.0),
                               workload).achieved_rps
            outcome = PolicySearch(prober, profile, batching, capacity, args.p99_ms, 2.0, args.peak,
                                   args.peak * 1.2).run()
            results["tuning_overload"] = outcome.to_dict()
            chosen = outcome.chosen or outcome.fallback
            results["path"] = ("fallback: fixed batching, queue policy by trm's PolicySearch"
                               + ("" if outcome.chosen else " (none passed: its closest)"))
            if chosen is None:
                results["error"] = "no queue policy measured"
                return results
        results["capacity_rps"] = capacity
        configs = {"trm: tuned + queue policy": chosen,
                   "tuned, no queue policy": chosen.without_queue_policy(),
                   "seed": Candidate.from_config(base, "seed")}
        results["configs"] = {name: c.to_dict() for name, c in configs.items()}
        for name, candidate in configs.items():
            client.load("ranker", candidate.apply(base))
            run_schedule(target, [Phase(capacity * 0.3, 1.0)], workload)  # warm: the new instances' first batches
            if name == "trm: tuned + queue policy":
                # the written config's own capacity, by a client that did not choose it: a separate process,
                # fresh arrivals, a ladder in 10 % steps from the peak rate until the p99 (a rejection a miss)
                # breaks the SLO; goodput under overload is judged against it too
                independent = independent_capacity(server.url, args, capacity)
                results["independent"] = independent
            for multiple in args.multiples:
                rate = round(capacity * multiple, 1)
                started = time.monotonic()
                # the spike, then the drop back to the peak rate: how long until answers are in time again
                trace = run_schedule(target, [Phase(rate, args.seconds), Phase(args.peak, RECOVER_S)], workload,
                                     seed=int(multiple * 10))
                stats = trace.phase_stats(0, args.p99_ms)
                row = {"config": name, "multiple": multiple, "seconds": round(time.monotonic() - started, 1),
                       **stats.to_dict(), "goodput_share_of_capacity": round(stats.goodput_rps / capacity, 3),
                       "time_to_recover_s": trace.recovery(1, args.p99_ms)}
                written_capacity = (results.get("independent") or {}).get("capacity_rps")
                if written_capacity:
                    row["goodput_share_of_written_capacity"] = round(stats.goodput_rps / written_capacity, 3)
                rows.append(row)
                log(f"  {name} x{multiple}: accepted p99 {stats.accepted_p99_ms:.1f} ms, goodput "
                    f"{stats.goodput_rps:.0f}/s, rejected {stats.rejected_fraction:.0%}, "
                    f"rejection p99 {stats.rejection_p99_ms}")
                time.sleep(0.5)
    results["rows"] = rows
    return results


def independent_capacity(url: str, args: argparse.Namespace, capacity: float) -> dict:
    """The written config's capacity within the SLO by bench/independent_load.py: from the peak rate or 60 % of
    trm's capacity, whichever is higher, in 10 % steps (twelve at most)."""
    start = round(max(args.peak, 0.6 * capacity), 1)
    command = [sys.executable, str(ROOT / "bench" / "independent_load.py"), "--url", url, "--model", "ranker",
               "--p99-ms", str(args.p99_ms), "--rates", str(args.peak), "--ladder-from", str(start),
               "--seed", "17"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["independent load failed"]}
    return json.loads(done.stdout)


def render(results: dict) -> str:
    if "rows" not in results:
        return f"no result: {results.get('error')}"
    lines = [f"SLO p99 {results['slo_p99_ms']:g} ms; measured capacity {results['capacity_rps']:.0f}/s; "
             f"model {results['model']['fixed_ms']} ms + {results['model']['per_item_ms']} ms per item", "",
             "| config | x capacity | offered/s | sent/s | accepted p99 ms | goodput/s (share of capacity) | "
             "rejected | rejection p50 / p99 ms | errors | recovered after the drop |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def recovered(seconds: float | None) -> str:
        return f"not within {RECOVER_S:g} s" if seconds is None else f"{seconds:.2f} s"

    for r in results["rows"]:
        lines.append(f"| {r['config']} | {r['multiple']:g} | {r['offered_rps']:.0f} | {r['send_rps']:.0f} | "
                     f"{ms(r['accepted_p99_ms'])} | {r['goodput_rps']:.0f} ({r['goodput_share_of_capacity']:.0%}) | "
                     f"{r['rejected_fraction']:.1%} | {ms(r['rejection_p50_ms'])} / {ms(r['rejection_p99_ms'])} | "
                     f"{r['errors']} | {recovered(r.get('time_to_recover_s'))} |")
    policy = results["configs"]["trm: tuned + queue policy"]
    lines += ["", f"trm's choice: `{policy['key']}` ({results['path']}; status {results.get('status')}); tuning "
                  f"took {results['trm_seconds']:g} s"]
    independent = results.get("independent") or {}
    if independent.get("capacity_rps"):
        shares = ", ".join(f"{r['multiple']:g} x: {r['goodput_share_of_written_capacity']:.0%}"
                           for r in results["rows"] if r["config"] == "trm: tuned + queue policy")
        lower = " (a lower bound: the client could not send more)" if independent.get("capacity_is_lower_bound") else ""
        lines.append(f"the written config's own capacity, measured by bench/independent_load.py: "
                     f"{independent['capacity_rps']:.0f}/s{lower}; trm's goodput as a share of it: {shares}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p99-ms", type=float, default=200.0)
    parser.add_argument("--low", type=float, default=30.0)
    parser.add_argument("--peak", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="trm's search budget (s; default: trm tune-batching's own)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--fast-rejection", action="store_true", help="trm tune-batching --fast-rejection")
    parser.add_argument("--fixed-ms", type=float, default=40.0)
    parser.add_argument("--per-item-ms", type=float, default=2.0)
    parser.add_argument("--seed-max-batch", type=int, default=8)
    parser.add_argument("--seed-delay-us", type=int, default=40_000)
    parser.add_argument("--seed-preferred", type=int, nargs="*", default=[8])
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of traffic per point")
    parser.add_argument("--multiples", type=float, nargs="+", default=list(MULTIPLES))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_overload.json")
    args = parser.parse_args()
    run_and_record(run, render, args)


if __name__ == "__main__":
    main()
