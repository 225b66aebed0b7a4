"""Benchmark: what does the fallback queue policy cost at capacity? One structure with and without it.

Where no queue policy holds under overload, ``trm tune-batching`` writes the closest one that keeps normal traffic
(a queue timeout of a full batch or more). Without a policy, p99 under a 2 x spike is seconds; with it, a request
queued past the timeout is rejected, and near capacity a rejection counts as a miss for any client. This bench
measures that price on the tuning check's model (``tests/cost_model.py``: 6 ms + 0.75 ms per item): the same
batching (default max batch 8, two instances, no queue delay, which trm wrote in bench_tuning runs 7-9) with and
without a queue timeout (default 15.25 ms, run 9's), each through ``bench/independent_load.py`` (a separate
process, fresh Poisson arrivals each round), in ``--rounds`` interleaved rounds after ``--warmup-rounds``
discarded ones. Per round: p99 at low, peak and peak x headroom, the capacity ladder (10 % steps) and the
requests rejected on it.

Prints one table (markdown) and writes ``bench/results/bench_fallback.json``. From the repository root:

    PYTHONPATH=$PWD python bench/bench_fallback.py            # about 7 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_tuning import independent_rounds  # noqa: E402
from cost_model import write_cost_model  # noqa: E402

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core import config as cfg  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.serving import load_version, version_config  # noqa: E402
from repo_manager.ops.tuning import Candidate  # noqa: E402

WITH, WITHOUT = "with the policy", "without"


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trm-bench-fallback-"))
    settings = Settings(repository=tmp / "repo")
    source = write_cost_model(tmp / "src", name="ranker", fixed_ms=args.fixed_ms, per_item_ms=args.per_item_ms,
                              max_batch_size=32, dynamic_batching=True)
    publish_model(settings, source, "ranker", verify_model=False)
    repo = LocalRepository(settings.repository)
    plain = Candidate(args.max_batch, args.instances, True, args.delay_us)
    configs = {WITH: plain.with_queue_policy(args.timeout_us), WITHOUT: plain}
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "ranker")
        base = version_config(repo, "ranker", 1)
        if args.warmup_rounds:
            independent_rounds(argparse.Namespace(**{**vars(args), "rounds": args.warmup_rounds}), client, server.url,
                               base, configs, seed=901)
        measured = independent_rounds(args, client, server.url, base, configs)
    return {"model": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms},
            "slo": {"p99_ms": args.p99_ms, "low_rps": args.low, "peak_rps": args.peak,
                    "headroom_rps": args.peak * args.headroom},
            "configs": {name: c.label for name, c in configs.items()}, **measured}


def render(results: dict) -> str:
    slo = results["slo"]
    lines = [f"SLO p99 <= {slo['p99_ms']:g} ms at low {slo['low_rps']:g}/s, peak {slo['peak_rps']:g}/s, peak x "
             f"headroom {slo['headroom_rps']:g}/s; model: {results['model']['fixed_ms']} ms + "
             f"{results['model']['per_item_ms']} ms per item",
             *(f"{name}: {label}" for name, label in results["configs"].items()), "",
             "| round | config | low / peak / headroom p99 ms | capacity/s | ladder: rate p99 ms (rejected) |",
             "|---|---|---|---|---|"]
    for r in results["rounds"]:
        for name, m in r["measured"].items():
            ladder = ", ".join(f"{p['rate']:g} {p['p99_ms']:g}" + (f" ({p['rejected']})" if p["rejected"] else "")
                               for p in m["ladder"])
            levels = " / ".join(f"{p['p99_ms']:g}" for p in m["levels"])
            lines.append(f"| {r['round']} | {name} | {levels} | "
                         f"{m['capacity_rps'] if m['capacity_rps'] is not None else '-'} | {ladder} |")
    higher = sum(r["measured"][WITH]["levels"][-1]["p99_ms"] > r["measured"][WITHOUT]["levels"][-1]["p99_ms"]
                 for r in results["rounds"])
    ratios = ", ".join(str(r["capacity_ratio"]) for r in results["rounds"])
    lines += ["", f"capacity with / without the policy per round: {ratios}; p99 at peak x headroom higher with the "
                  f"policy in {higher} of {len(results['rounds'])} rounds; every level met in every round: "
                  + ", ".join(f"{name} {ok}" for name, ok in results["meets_slo_every_round"].items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p99-ms", type=float, default=25.0)
    parser.add_argument("--low", type=float, default=50.0)
    parser.add_argument("--peak", type=float, default=400.0)
    parser.add_argument("--headroom", type=float, default=1.2)
    parser.add_argument("--fixed-ms", type=float, default=6.0)
    parser.add_argument("--per-item-ms", type=float, default=0.75)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--delay-us", type=int, default=0)
    parser.add_argument("--timeout-us", type=int, default=15_250, help="the fallback's queue timeout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds measured first and discarded")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_fallback.json")
    args = parser.parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    results = run(args)
    results["total_seconds"] = round(time.monotonic() - started, 1)
    results["load_average"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.atomic_write_bytes(args.out, (json.dumps(results, indent=2, default=str) + "\n").encode())
    print(render(results))
    load = results["load_average"]
    print(f"\ntotal {results['total_seconds']:g} s; load average before/after {load['before'][0]:.1f}"
          f"/{load['after'][0]:.1f} on {os.cpu_count()} CPUs; full results in {args.out}")


if __name__ == "__main__":
    main()
