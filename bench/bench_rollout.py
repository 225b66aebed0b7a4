"""Benchmark: a version change under steady load, `trm rollout` against restarting the server.

For each method the script starts a real tritonserver on a fresh repository, loads v1 of a tiny Python
model whose answers carry their version (tests/rollout_models.py), starts steady closed-loop traffic
(the shared load generator, several clients), measures a steady-state window, then changes the version
``--changes`` times, and reports:

* failed requests during the changes (the zero-drop claim),
* p99 and max latency of the requests sent while a change was running, against the steady-state p99,
* the time one change takes on one server, and the longest gap without a successful answer.

Methods:

* ``trm rollout (gRPC control)``: ``plan_rollout`` + ``run_rollout`` (side by side: pre-check, load
  beside, smoke, drop) with ``--grpc-url``, so loads go through Triton's gRPC frontend;
* ``trm rollout (HTTP control)``: the same with loads over HTTP (Triton runs each load on one HTTP worker
  thread: the HTTP clients whose connections it serves wait for the whole load);
* ``restart``: the usual alternative: publish, stop the server (SIGTERM, in-flight requests finish), start
  it again on the same ports with the new latest version, and wait until it is ready.

    python bench/bench_rollout.py [--clients 4] [--changes 2] [--steady 5] [--json out.json]

Bounded to about three minutes on a 2-core machine (a restart waits for Triton's exit timeout).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import rollout_models as rm  # noqa: E402

from repo_manager.adapters.loadgen import BackgroundLoad, Workload  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.rollout import RolloutOptions, plan_rollout, run_rollout  # noqa: E402
from repo_manager.ops.serving import load_version  # noqa: E402

WORKLOAD = Workload(({"X": np.ones((1, rm.FEATURES), np.float32)},))
DELAY_S = 0.002  # each request computes for ~2 ms, so several are always in flight


def p99_ms(records) -> float | None:
    latencies = [r.latency_s * 1000 for r in records if r.ok]
    return round(float(np.percentile(latencies, 99)), 2) if latencies else None


def longest_gap_s(records) -> float:
    """Longest time between two consecutive successful answers (by send time)."""
    times = sorted(r.started_at + r.latency_s for r in records if r.ok)
    return round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 3)


def run_method(method: str, clients: int, changes: int, steady_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="trm-bench-rollout-") as scratch:
        root = Path(scratch) / "repo"
        rm.tagged(root, "m", 1, delay=DELAY_S)
        server = TritonServer(root).start()
        try:
            with TritonClient(server.url) as client:
                load_version(client, LocalRepository(root), "m", 1)
            windows: list[tuple[float, float]] = []
            with BackgroundLoad(server.url, "m", clients=clients, workload=WORKLOAD, timeout_s=30.0) as load:
                load.wait_for(20)
                steady_start = time.time()
                time.sleep(steady_s)
                steady_end = time.time()
                for change in range(changes):
                    version = rm.tagged(root, "m", change + 2, delay=DELAY_S)
                    t0 = time.time()
                    if method.startswith("trm rollout"):
                        settings = Settings(repository=root)
                        grpc = [server.endpoints.grpc] if "gRPC" in method else None
                        plan = plan_rollout(settings, "m", version, [server.url], RolloutOptions(), grpc_urls=grpc)
                        run_rollout(settings, plan)
                    else:
                        server = restart(server, root)
                    windows.append((t0, time.time()))
                    time.sleep(1.0)
            records = load.records
        finally:
            server.stop()
    steady = [r for r in records if steady_start <= r.started_at < steady_end]
    during = [r for r in records if any(a <= r.started_at < b for a, b in windows)]
    return {"method": method, "clients": clients, "changes": changes,
            "requests": len(records), "failed": sum(not r.ok for r in records),
            "failed_during_changes": sum(not r.ok for r in during),
            "steady_p99_ms": p99_ms(steady), "change_p99_ms": p99_ms(during),
            "change_max_ms": round(max((r.latency_s * 1000 for r in during if r.ok), default=0.0), 1),
            "seconds_per_change": round(sum(b - a for a, b in windows) / len(windows), 2),
            "longest_gap_s": longest_gap_s(records),
            "versions_seen": sorted({r.model_version for r in records if r.ok and r.model_version})}


def restart(server: TritonServer, root: Path) -> TritonServer:
    """Stop the server and start it again on the same ports with the repository's latest version."""
    ports = dict(server.ports)
    server.stop()
    fresh = TritonServer(root, http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"])
    fresh.start()
    with TritonClient(fresh.url) as client:
        load_version(client, LocalRepository(root), "m")
    return fresh


def table(rows: list[dict]) -> str:
    head = ("| method | failed requests (during changes / total) | steady p99 ms | p99 during change ms | "
            "max latency during change ms | s per change (1 server) | longest gap without an answer s | requests |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['method']} | {r['failed_during_changes']} / {r['failed']} | "
                     f"{r['steady_p99_ms']} | {r['change_p99_ms']} | {r['change_max_ms']} | "
                     f"{r['seconds_per_change']} | {r['longest_gap_s']} | {r['requests']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--changes", type=int, default=2)
    parser.add_argument("--steady", type=float, default=4.0, help="steady-state window, seconds")
    parser.add_argument("--json", dest="json_path", help="also write the rows to this file")
    args = parser.parse_args()
    methods = ("trm rollout (gRPC control)", "trm rollout (HTTP control)", "restart")
    rows = [run_method(m, args.clients, args.changes, args.steady) for m in methods]
    print(table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
