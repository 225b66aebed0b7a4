"""Benchmark: a fleet of Triton servers with `trm agent`, following `production` in a real S3 store.

Starts a SeaweedFS S3 server, ``--nodes`` simulated nodes (e.g. ``2,1``: node a with two servers sharing
one node cache, node b with one), each server with its own repository and agent, steady load on every
server (clients count every failure), then ``--rounds`` promotions staging -> production of new
versions of a tiny Python model whose answers carry their version (tests/rollout_models.py). Reports:

* promote -> every server answering with the new version (seconds; target: one poll interval plus one
  local rollout), per round;
* failed requests (target: 0);
* blob bytes downloaded per server per round (target: the second server of a node downloads 0);
* the idle CPU of one agent at ``--idle-interval`` (target: below 1 % of a core at 5 s).

    python bench/bench_fleet.py [--nodes 2,1] [--rounds 3] [--interval 0.5] [--idle-seconds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("PYTHONPATH", str(ROOT))

import rollout_models as rm  # noqa: E402
from agent_helpers import AgentProcess, Fleet  # noqa: E402
from seaweed import BUCKET, SeaweedServer  # noqa: E402

from repo_manager.adapters.loadgen import BackgroundLoad, Workload  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.storage import open_store  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.promote import PromotionRequest, promote  # noqa: E402
from repo_manager.ops.push import push  # noqa: E402

WORKLOAD = Workload(({"X": np.ones((1, rm.FEATURES), np.float32)},))


def tag(outputs) -> str:
    return f"v{int(outputs['TAG'].ravel()[0])}"


def release(src: Path, location: str, version: int) -> None:
    rm.tagged(src, "m", version, delay=0.002)
    push(open_store(location), LocalRepository(src), [("m", version)])
    open_store(location).update_env("staging", {"m": version})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,1", help="servers per simulated node")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--idle-interval", type=float, default=5.0)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    nodes = {chr(ord("a") + i): n for i, n in enumerate(counts)}
    report: dict = {"nodes": nodes, "interval_s": args.interval, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="trm-bench-fleet-") as scratch, \
            SeaweedServer(Path(scratch) / "weed") as weed:
        os.environ.update(weed.env)
        location = f"s3://{BUCKET}/bench-fleet"
        src = Path(scratch) / "src"
        release(src, location, 1)
        open_store(location).update_env("production", {"m": 1})
        fleet = Fleet(Path(scratch) / "fleet", location, "production", nodes, interval=args.interval)
        try:
            started = time.monotonic()
            fleet.start()
            fleet.wait_serving({"m": 1}, timeout=300)
            report["fleet_start_s"] = round(time.monotonic() - started, 2)
            loads = {pod: BackgroundLoad(server.url, "m", clients=2, workload=WORKLOAD, check=tag).__enter__()
                     for pod, server in fleet.servers.items()}
            try:
                for version in range(2, args.rounds + 2):
                    time.sleep(2 * args.interval)
                    before = {p: a.status()["sync"]["bytes_downloaded"] for p, a in fleet.agents.items()}
                    release(src, location, version)
                    t0 = time.monotonic()
                    promote(Settings(), PromotionRequest("m", "production", from_env="staging",
                                                         gates=("checksums",), store=location))
                    moved = time.monotonic()
                    done = {}
                    for pod, agent in fleet.agents.items():
                        agent.wait_serving({"m": version}, timeout=300)
                        done[pod] = round(time.monotonic() - moved, 2)
                    rollouts = {p: a.status()["last_rollout"]["seconds"] for p, a in fleet.agents.items()}
                    report["rounds"].append({
                        "version": version, "promote_s": round(moved - t0, 2),
                        "pointer_moved_to_all_serving_s": max(done.values()),
                        "local_rollout_s": rollouts,
                        "bytes_downloaded": {p: a.status()["sync"]["bytes_downloaded"] - before[p]
                                             for p, a in fleet.agents.items()}})
                    print(json.dumps(report["rounds"][-1]), flush=True)
            finally:
                for load in loads.values():
                    load.stop()
            report["requests"] = {p: {"total": load.summary().requests, "failed": load.summary().failed}
                                  for p, load in loads.items()}
            fleet.stop()
            # idle CPU: one agent at the production interval, everything converged
            node, pod = fleet.layout[0]
            server = fleet.servers[pod]
            server.start()
            agent = AgentProcess(location, "production", server, fleet.repo(pod), fleet.root / node / "cache",
                                 pod=pod, interval=args.idle_interval, log_dir=fleet.root)
            agent.start()
            agent.wait_serving({"m": args.rounds + 1}, timeout=300)
            time.sleep(args.idle_interval)
            c0, w0 = cpu_seconds(agent.process.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            c1, w1 = cpu_seconds(agent.process.pid), time.monotonic()
            report["idle_cpu_pct_of_core"] = round(100 * (c1 - c0) / (w1 - w0), 3)
            report["idle_interval_s"] = args.idle_interval
            agent.stop()
            server.stop()
        finally:
            fleet.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
