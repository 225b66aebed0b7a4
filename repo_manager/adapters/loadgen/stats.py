"""Triton's per-model statistics, as a difference between two snapshots: where the time went.

Triton counts, per model, the requests that succeeded, the time they spent queued and computing, and
per executed batch size how many executions ran and how long they took. The difference between a
snapshot before and after a measurement is what that measurement caused (for a model nobody else is
sending to), so each load point shows queue time against compute time and the batch sizes the
dynamic batcher actually formed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from repo_manager.adapters.triton.client import TritonClient


@dataclass(frozen=True)
class StatsSnapshot:
    """Cumulative counters of one model (all its loaded versions together)."""

    success: int = 0
    success_ns: int = 0
    fail: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    inferences: int = 0
    executions: int = 0
    batch_count: dict[int, int] = field(default_factory=dict)
    batch_infer_ns: dict[int, int] = field(default_factory=dict)

    @classmethod
    def read(cls, client: TritonClient, model: str) -> StatsSnapshot:
        return cls.parse(client.statistics(model))

    @classmethod
    def parse(cls, model_stats: list[dict[str, Any]]) -> StatsSnapshot:
        totals: Counter[str] = Counter()
        batch_count: Counter[int] = Counter()
        batch_ns: Counter[int] = Counter()
        for entry in model_stats:
            stats = entry.get("inference_stats", {})
            totals["success"] += int(stats.get("success", {}).get("count", 0))
            totals["success_ns"] += int(stats.get("success", {}).get("ns", 0))
            totals["fail"] += int(stats.get("fail", {}).get("count", 0))
            totals["queue_ns"] += int(stats.get("queue", {}).get("ns", 0))
            totals["compute_ns"] += sum(int(stats.get(k, {}).get("ns", 0))
                                        for k in ("compute_input", "compute_infer", "compute_output"))
            totals["inferences"] += int(entry.get("inference_count", 0))
            totals["executions"] += int(entry.get("execution_count", 0))
            for batch in entry.get("batch_stats", []):
                size = int(batch["batch_size"])
                batch_count[size] += int(batch.get("compute_infer", {}).get("count", 0))
                batch_ns[size] += sum(int(batch.get(k, {}).get("ns", 0))
                                      for k in ("compute_input", "compute_infer", "compute_output"))
        return cls(**{k: totals[k] for k in ("success", "success_ns", "fail", "queue_ns", "compute_ns",
                                             "inferences", "executions")},
                   batch_count=dict(batch_count), batch_infer_ns=dict(batch_ns))


@dataclass(frozen=True)
class ServerStats:
    """What Triton saw between two snapshots. Times are means per request, in milliseconds."""

    requests: int
    failed: int
    queue_ms: float
    compute_ms: float
    server_ms: float
    """Queue + compute + Triton's own overhead: the request's whole time inside the server."""
    executions: int
    mean_batch: float
    batch_histogram: dict[int, int]
    """Executed batch size -> number of executions."""
    exec_ms_by_batch: dict[int, float]
    """Executed batch size -> mean execution time (input + infer + output) of one batch."""

    @classmethod
    def between(cls, before: StatsSnapshot, after: StatsSnapshot) -> ServerStats:
        requests = after.success - before.success

        def per_request(ns: int) -> float:
            return round(ns / requests / 1e6, 3) if requests > 0 else 0.0

        executions = after.executions - before.executions
        histogram = {size: count - before.batch_count.get(size, 0) for size, count in after.batch_count.items()}
        histogram = {size: count for size, count in sorted(histogram.items()) if count > 0}
        exec_ms = {size: round((after.batch_infer_ns[size] - before.batch_infer_ns.get(size, 0)) / count / 1e6, 3)
                   for size, count in histogram.items()}
        inferences = after.inferences - before.inferences
        return cls(requests=requests, failed=after.fail - before.fail,
                   queue_ms=per_request(after.queue_ns - before.queue_ns),
                   compute_ms=per_request(after.compute_ns - before.compute_ns),
                   server_ms=per_request(after.success_ns - before.success_ns),
                   executions=executions, mean_batch=round(inferences / executions, 3) if executions else 0.0,
                   batch_histogram=histogram, exec_ms_by_batch=exec_ms)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "failed": self.failed, "queue_ms": self.queue_ms,
                "compute_ms": self.compute_ms, "server_ms": self.server_ms, "executions": self.executions,
                "mean_batch": self.mean_batch,
                "batch_histogram": {str(k): v for k, v in self.batch_histogram.items()},
                "exec_ms_by_batch": {str(k): v for k, v in self.exec_ms_by_batch.items()}}
