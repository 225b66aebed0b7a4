"""Probe: how Triton's dynamic batcher sheds load under each queue policy (the table in docs/tuning.md).

One embedded tritonserver, the cost model (20 ms + 1 ms per item, max batch 8, one instance: about
285 requests/s), 4 s of open-loop Poisson arrivals at 560/s under: no queue policy, ``max_queue_size: 16``,
a 30 ms timeout with REJECT, and both. Prints answered / rejected counts and latencies. From the
repository root:

    PYTHONPATH=$PWD python bench/queue_policy_probe.py       # about 40 s
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cost_model import cost_config, cost_repository  # noqa: E402

from repo_manager.adapters.loadgen import Phase, Target, Workload, run_schedule  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.ops.tuning import Candidate  # noqa: E402

COST = {"fixed_ms": 20.0, "per_item_ms": 1.0, "max_batch_size": 8}
POLICIES = {"none": (0, 0), "max_queue_size 16": (0, 16), "timeout 30 ms, reject": (30_000, 0),
            "both": (30_000, 16)}


def main(rate: float = 560.0, seconds: float = 4.0) -> None:
    root = cost_repository(Path(tempfile.mkdtemp(prefix="trm-probe-")), "m", dynamic_batching=True, **COST)
    base = cost_config("m", **COST)
    workload = Workload.from_config(base)
    print("| queue policy | answered | accepted p50 / p99 ms | rejected | rejection p50 / p99 ms |")
    print("|---|---|---|---|---|")
    with TritonServer(root) as server, TritonClient(server.url) as client:
        for name, (timeout_us, max_queue) in POLICIES.items():
            candidate = Candidate(8, 1, True, 0, (), "probe")
            if timeout_us or max_queue:
                candidate = candidate.with_queue_policy(timeout_us, max_queue)
            client.load("m", candidate.apply(base))
            trace = run_schedule(Target("m", server.url), [Phase(60, 1.0), Phase(rate, seconds)], workload)
            s = trace.phase_stats(1, slo_ms=1e9)
            rejection = "-" if s.rejection_p50_ms is None else f"{s.rejection_p50_ms:.1f} / {s.rejection_p99_ms:.1f}"
            print(f"| {name} | {s.answered} of {s.requests} | {s.accepted_p50_ms:.0f} / {s.accepted_p99_ms:.0f} | "
                  f"{s.rejected} | {rejection} |", flush=True)


if __name__ == "__main__":
    main()
