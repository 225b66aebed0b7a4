"""Benchmark: a vLLM rollout under concurrent long streams, TTFT and CPU per phase of the switch.

The request/response counterpart is bench/bench_rollout.py; an LLM needs its own: a stream lasts seconds,
the figure is time to first token (TTFT), and the cost of a switch is a second engine starting beside the
first. The script publishes two versions of a random-weight Llama (tests/llm_checkpoints.py), serves
version 1 on a real tritonserver with trm's vllm backend (vLLM's CPU engine), streams closed-loop over
gRPC (repo_manager.adapters.loadgen.llm, ``--streams`` at a time, ``--tokens`` output tokens each), and runs
``trm rollout`` to version 2 (``plan_rollout`` + ``run_rollout``: pre-check under a temporary name unless
``--no-precheck``, load beside, smoke, drain streams, drop). It reports, per phase (steady before and
after, each rollout step):

* streams sent, TTFT p50/p99 of those streams, failed and broken streams;
* CPU cores used (from /proc, sampled every 0.25 s) by the processes serving before the rollout (the
  tritonserver and version 1's engine), by the processes started during it (version 2's engine, the
  pre-check's engine), and by everything else on the host; and the host's cores.

It answers whether TTFT during a switch exceeds the steady TTFT because of the switch itself or because
the new engine's start takes the CPU the serving engine needs.

    python bench/bench_llm_rollout.py [--streams 3] [--tokens 96] [--no-precheck] [--steady-batches 3]
        [--json out.json]

About 3-5 minutes on a 2-core machine (two or three engine starts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from llm_checkpoints import causal_lm  # noqa: E402

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, run_llm  # noqa: E402
from repo_manager.adapters.loadgen.measure import Target  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.rollout import RolloutOptions, plan_rollout, run_rollout  # noqa: E402
from repo_manager.ops.serving import load_version  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> set[int]:
    """``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _host_busy_ticks() -> int:
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4]  # all but idle and iowait


class CpuSampler(threading.Thread):
    """Every 0.25 s: (time, host busy ticks, ticks of the processes serving at the start, of those started
    since) for the tritonserver's process tree."""

    def __init__(self, server_pid: int) -> None:
        super().__init__(daemon=True)
        self.server_pid, self.stop = server_pid, threading.Event()
        self.first = _tree(server_pid)
        self.seen: dict[int, int] = {}
        self.samples: list[tuple[float, int, int, int]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in _tree(self.server_pid):
                self.seen[pid] = max(self.seen.get(pid, 0), _cpu_ticks(pid))  # a gone process keeps its last
            old = sum(t for p, t in self.seen.items() if p in self.first)
            new = sum(t for p, t in self.seen.items() if p not in self.first)
            self.samples.append((time.time(), _host_busy_ticks(), old, new))
            time.sleep(0.25)

    def cores(self, start: float, end: float) -> dict[str, float | None]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {"serving_cores": None, "started_cores": None, "others_cores": None}
        (t0, h0, o0, n0), (t1, h1, o1, n1) = inside[0], inside[-1]
        seconds = (t1 - t0) * TICK
        old, new = (o1 - o0) / seconds, (n1 - n0) / seconds
        return {"serving_cores": round(old, 2), "started_cores": round(new, 2),
                "others_cores": round(max(0.0, (h1 - h0) / seconds - old - new), 2)}


class Streams(threading.Thread):
    def __init__(self, target: Target, load: LLMLoad) -> None:
        super().__init__(daemon=True)
        self.target, self.load, self.stop, self.results = target, load, threading.Event(), []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.results.append(run_llm(self.target, self.load))
        except BaseException as exc:  # noqa: BLE001 - reported
            self.error = exc

    def wait_batches(self, count: int) -> None:
        while len(self.results) < count and self.error is None and self.is_alive():
            time.sleep(0.5)


def publish(checkpoint: Path, root: Path) -> None:
    for _ in (1, 2):
        done = subprocess.run([sys.executable, "-m", "repo_manager", "publish", "model", str(checkpoint), "--name",
                               "tiny", "--format", "vllm", "--repo", str(root), "--max-num-seqs", "4",
                               "--no-verify"], capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if done.returncode:
            raise SystemExit(done.stderr[-2000:])


def run(streams_at_once: int, tokens: int, precheck: bool, steady_batches: int) -> dict:
    load = LLMLoad(concurrency=streams_at_once, requests=2 * streams_at_once, input_tokens=Lengths(6),
                   output_tokens=Lengths(tokens), timeout_s=600)
    with tempfile.TemporaryDirectory(prefix="trm-bench-llm-rollout-") as scratch:
        scratch_path = Path(scratch)
        os.environ["TRM_VLLM_ENGINE_REGISTRY"] = str(scratch_path / "engines")
        root = scratch_path / "repo"
        publish(causal_lm(scratch_path / "tiny-llama", max_position_embeddings=128), root)
        with TritonServer(root) as server:
            with TritonClient(server.url, timeout_s=1800) as client:
                load_version(client, LocalRepository(root), "tiny", 1)
            sampler = CpuSampler(server.process.pid)
            sampler.start()
            streams = Streams(Target("tiny", server.url, protocol="grpc", grpc_url=server.endpoints.grpc), load)
            streams.start()
            streams.wait_batches(steady_batches)
            began = time.time()
            settings = Settings(repository=root)
            plan = plan_rollout(settings, "tiny", 2, [server.url], RolloutOptions(precheck=precheck),
                                grpc_urls=[server.endpoints.grpc], metrics_urls=[server.endpoints.metrics])
            result = run_rollout(settings, plan)
            ended = time.time()
            streams.wait_batches(len(streams.results) + steady_batches)
            streams.stop.set()
            streams.join(timeout=600)
            sampler.stop.set()
            sampler.join(timeout=5)
    if streams.error is not None:
        raise SystemExit(f"the load failed: {streams.error}")
    sent = np.concatenate([b.sent_at for b in streams.results])
    # sent_at is on the load generator's perf_counter clock; the rollout's steps on the wall clock
    offset = time.time() - time.perf_counter()
    sent = sent + offset
    ttft = np.concatenate([b.ttft for b in streams.results])
    outcomes = [o for b in streams.results for o in b.outcomes]
    phases = [("steady before", sent.min(), began)]
    for step in result.servers[0].steps:
        start = datetime.fromisoformat(step.started_at.replace("Z", "+00:00")).timestamp()
        phases.append((step.name, start, start + step.seconds))
    phases.append(("steady after", ended, float(sent.max()) + 1e-3))
    rows = []
    for name, start, end in phases:
        chosen = [(t, o) for t, o, s in zip(ttft, outcomes, sent) if start <= s < end]
        values = [t for t, o in chosen if o == "complete"]
        rows.append({"phase": name, "seconds": round(end - start, 2), "streams": len(chosen),
                     "ttft_p50_ms": round(float(np.percentile(values, 50)), 1) if values else None,
                     "ttft_p99_ms": round(float(np.percentile(values, 99)), 1) if values else None,
                     **sampler.cores(start, end)})
    return {"precheck": precheck, "streams_at_once": streams_at_once, "output_tokens": tokens,
            "host_cores": os.cpu_count(), "streams": len(outcomes),
            "failed": sum(b.failed for b in streams.results), "broken": sum(b.broken for b in streams.results),
            "short": sum(b.short for b in streams.results), "rollout_seconds": round(ended - began, 1),
            "phases": rows}


def table(report: dict) -> str:
    lines = [f"{report['streams']} streams, {report['failed']} failed, {report['broken']} broken, "
             f"{report['short']} short; rollout {report['rollout_seconds']} s (pre-check "
             f"{'on' if report['precheck'] else 'off'}), host cores {report['host_cores']}",
             "| phase | s | streams sent | TTFT p50 ms | TTFT p99 ms | cores: serving before | cores: started "
             "during | cores: rest of host |", "|" + "---|" * 8]
    for r in report["phases"]:
        lines.append(f"| {r['phase']} | {r['seconds']} | {r['streams']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} "
                     f"| {r['serving_cores']} | {r['started_cores']} | {r['others_cores']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3, help="streams in flight at a time")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per stream")
    parser.add_argument("--no-precheck", dest="precheck", action="store_false")
    parser.add_argument("--steady-batches", type=int, default=3,
                        help="batches of 2 x --streams streams measured before and after the rollout")
    parser.add_argument("--json", dest="json_path", help="also write the report to this file")
    args = parser.parse_args()
    report = run(args.streams, args.tokens, args.precheck, args.steady_batches)
    print(table(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
