"""Benchmark: how much latency does trm's load generator add to what it measures?

perf_analyzer (PyPI ``perf-analyzer``) is the reference client, but its wheel needs glibc 2.38 and this
Debian has 2.36 (``version `GLIBC_2.38' not found``), so the comparison here is against the server's own
account instead: Triton's statistics give each request's time inside the server (queue + compute +
its own overhead, ``ServerStats.server_ms``, a mean). The client's mean latency minus that is what the
client, HTTP/gRPC and the network added; the same figure for perf_analyzer would be its own overhead.

A Python-backend model costing ``fixed_ms + per_item_ms * batch`` (a sleep) with dynamic batching, one
instance; its capacity measured closed loop; then open-loop Poisson points at shares of that capacity
(85 % is where the issue compared trm with perf_analyzer), over HTTP and gRPC. From the repository root:

    PYTHONPATH=$PWD python bench/bench_loadgen.py          # about 1 minute

Prints a markdown table and writes ``bench/results/bench_loadgen.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cost_model import cost_config, cost_repository  # noqa: E402

from repo_manager.adapters.loadgen import LoadSpec, Target, Workload, measure  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    root = cost_repository(Path(tempfile.mkdtemp(prefix="trm-bench-loadgen-")), "cost", fixed_ms=args.fixed_ms,
                           per_item_ms=args.per_item_ms, max_batch_size=args.max_batch, dynamic_batching=True)
    config = cost_config("cost", fixed_ms=args.fixed_ms, per_item_ms=args.per_item_ms,
                         max_batch_size=args.max_batch, dynamic_batching=True)
    workload = Workload.from_config(config)
    rows = []
    with TritonServer(root) as server, TritonClient(server.url) as client:
        client.load("cost", config)
        http = Target("cost", server.url)
        saturated = measure(http, LoadSpec(concurrency=3 * args.max_batch, requests=1500, warmup_s=1.0,
                                           min_duration_s=3.0), workload)
        capacity = saturated.achieved_rps
        for share in args.shares:
            for protocol in ("http", "grpc"):
                target = Target("cost", server.url, protocol=protocol, grpc_url=server.endpoints.grpc)
                point = measure(target, LoadSpec(rate=round(share * capacity, 1), requests=args.requests,
                                                 warmup_s=1.0, max_in_flight=10_000), workload)
                s = point.server
                assert s is not None
                rows.append({"share": share, "protocol": protocol, "offered_rps": point.offered_rps,
                             "valid": point.valid, "client_mean_ms": point.mean_ms, "client_p50_ms": point.p50_ms,
                             "client_p99_ms": point.p99_ms, "server_mean_ms": s.server_ms, "queue_ms": s.queue_ms,
                             "compute_ms": s.compute_ms, "added_ms": round(point.mean_ms - s.server_ms, 3),
                             "added_share": round((point.mean_ms - s.server_ms) / point.mean_ms, 4),
                             "lag_p95_ms": point.lag_p95_ms})
    return {"model": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms, "max_batch": args.max_batch},
            "capacity_rps": capacity, "load_average": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows}


def table(result: dict) -> str:
    lines = ["| load | protocol | offered/s | client mean / p99 ms | server mean ms (queue + compute) | "
             "added by the client ms | share of the mean |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['share']:.0%} | {r['protocol']} | {r['offered_rps']:.0f} | {r['client_mean_ms']:.1f} / "
                     f"{r['client_p99_ms']:.1f} | {r['server_mean_ms']:.1f} ({r['queue_ms']:.1f} + "
                     f"{r['compute_ms']:.1f}) | {r['added_ms']:.2f} | {r['added_share']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed-ms", type=float, default=10.0)
    parser.add_argument("--per-item-ms", type=float, default=2.0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.85])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_loadgen.json")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"capacity {result['capacity_rps']:.0f}/s (closed loop), load average {result['load_average']}")
    print(table(result))


if __name__ == "__main__":
    main()
