"""The agent's /metrics: trm's shared registry (``repo_manager.adapters.metrics``: operations, sync bytes, the served
versions, the build) plus the agent's own state, read from its status snapshot at scrape time.

Operations the agent records in the shared vocabulary (``trm_operations_total``, ``trm_operation_seconds``,
``trm_operation_last_success_timestamp_seconds``), by ``operation``:

* ``pointer_read``: outcome ``changed``, ``unchanged`` (a 304) or the error's kind;
* ``sync``: the versions of one pointer installed into the node repository (bytes in ``trm_sync_bytes_total``);
* ``rollout`` (per ``model``): one model moved on this server, ``ok``, ``rolled_back`` or the error's kind.

The agent's own families carry ``env`` and ``pod`` labels; shared ones are told apart by the scrape's
``instance`` label, as for ``trm serve``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from repo_manager.adapters import metrics
from repo_manager.ops.agent.state import Phase

STATES = tuple(phase.value for phase in Phase)
"""Every state the agent reports (``Agent.status()["state"]``)."""

_RENDER = threading.Lock()
"""Scrapes run in parallel threads; ``set_serving`` then rendering must not interleave."""


class StatusCollector:
    """The agent's state gauges from one ``Agent.status()`` snapshot."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status
        base, values = ["env", "pod"], [status["env"], status["pod"]]
        ready = GaugeMetricFamily("trm_agent_ready", "1 when /readyz answers 200", labels=base)
        ready.add_metric(values, float(status["ready"]))
        degraded = GaugeMetricFamily("trm_agent_degraded", "1 while the agent refuses the version its "
                                     "environment names", labels=base)
        degraded.add_metric(values, float(status["state"] == "degraded"))
        wanted = GaugeMetricFamily("trm_agent_wanted_version", "Version of each model the environment names",
                                   labels=[*base, "model"])
        for model, version in sorted(status["wanted"].items()):
            wanted.add_metric([*values, model], float(version))
        current = GaugeMetricFamily("trm_agent_state", "1 for the agent's current state (/status state): a pod "
                                    "can be ready while syncing, rolling out or degraded", labels=[*base, "state"])
        for name in STATES:
            current.add_metric([*values, name], float(status["state"] == name))
        behind = GaugeMetricFamily("trm_agent_pending_models", "Models of the environment not served at the "
                                   "version it names (loading, or refused)", labels=base)
        behind.add_metric(values, float(sum(status["served"].get(m) != v for m, v in status["wanted"].items())))
        rollouts = CounterMetricFamily("trm_agent_rollouts", "Local rollouts of the environment's set by outcome "
                                       "(done, refused, failed)", labels=[*base, "outcome"])
        for outcome, count in sorted(status["rollouts"].items()):
            rollouts.add_metric([*values, outcome], float(count))
        yield from (ready, degraded, current, behind, wanted, rollouts)


def render(status: dict[str, Any]) -> bytes:
    """Text for one scrape, from the agent's status snapshot (``Agent.status()``)."""
    with _RENDER:
        metrics.set_serving({m: v for m, v in status["served"].items() if v is not None})
        return metrics.exposition(StatusCollector(status))
