"""The load generator shared by tuning, rollouts and benchmarks.

Two tools, both over Triton's HTTP or gRPC API with asynchronous clients (``transport``):

**Measured load points** (``measure``)::

    from repo_manager.adapters.loadgen import LoadSpec, Target, measure
    point = measure(Target("model", "http://127.0.0.1:8000"), LoadSpec(rate=200, requests=2000))
    point.valid, point.p99_ms, point.achieved_rps, point.server.queue_ms, point.server.batch_histogram

* open loop (``rate``, Poisson or constant arrivals, each request sent on time as its own task) or closed
  loop (``concurrency`` clients, each waiting for its answer);
* inputs generated from the served config (``Workload.from_config``, i.e. ``repo_manager.adapters.loadgen.inputs``) or
  read from a ``.npz`` sample (``Workload.from_file``);
* per-request latency and errors, the achieved rate, p50/p90/p99/max, p99 per window (for a stability
  rule) and Triton's own statistics over the point (``ServerStats``: queue vs compute time, executed batch
  sizes); ``valid`` is False, with ``invalid_reason``, when the client could not keep the offered rate.

**Phased traffic** (``schedule``): ``run_schedule(target, [Phase(rate, seconds), ...], workload)`` for
overload runs (a spike, then normal traffic): every request's outcome is answered, **rejected** by the
queue policy (counted apart from errors) or failed; ``Trace.phase_stats`` and ``Trace.recovery`` sum it up.

**Background traffic** (``BackgroundLoad``) for rollouts: several clients sending until stopped, every
request recorded with its outcome, the version that answered and a label from a ``check(outputs)``
callback; ``summary()`` says how many failed and how the answering version changed over time. See
``repo_manager.adapters.loadgen.background`` for an example.
"""

from repo_manager.adapters.loadgen.background import BackgroundLoad, BackgroundSummary, RequestRecord
from repo_manager.adapters.loadgen.measure import LoadSpec, Measurement, Target, arrival_offsets, measure
from repo_manager.adapters.loadgen.schedule import Phase, PhaseStats, Trace, run_schedule
from repo_manager.adapters.loadgen.stats import ServerStats, StatsSnapshot
from repo_manager.adapters.loadgen.transport import PROTOCOLS, AsyncTriton, Workload, is_rejection

__all__ = ["AsyncTriton", "BackgroundLoad", "BackgroundSummary", "LoadSpec", "Measurement", "PROTOCOLS", "Phase",
           "PhaseStats", "RequestRecord", "ServerStats", "StatsSnapshot", "Target", "Trace", "Workload",
           "arrival_offsets", "is_rejection", "measure", "run_schedule"]
