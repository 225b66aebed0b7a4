"""LLM versions in a rollout: the memory the plan gives them, and their streams in flight.

Memory: a vLLM version records its memory plan in its manifest (``source.plan``, written by
``llm.vllm.plan_engine``). The engine takes that memory whole when it starts (vLLM allocates its KV cache
up front), so a version loaded beside another needs the planned memory twice, whatever its files weigh:

* GPU: ``gpu_memory_utilization`` x the GPU's memory per GPU;
* CPU: the weights plus the KV cache the plan gave the engine.

The plan was made for a capacity (the GPU's memory, or the host memory the CPU engine may take), which is
the budget side by side is judged against when no ``--memory-budget`` is given.

Streams: once the new version is loaded, Triton sends every new unversioned request to it, and the streams
that started on the old version go on there. Before the old version is unloaded, the rollout waits (at
most ``timeout_s``) until the engine of each old version reports no running and no waiting request
(the ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` gauges of Triton's metrics endpoint,
which trm's vllm backend and the official one both report, labelled with model and version).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from repo_manager.core.manifest import Manifest

DEFAULT_METRICS_PORT = 8002
"""Triton's metrics port when none is given (``--metrics-url``)."""
QUIET_S = 0.5
"""Gauges at zero for this long (two reads) count as drained: a request between Triton and the engine is
not counted by them for a moment."""
FIRST_READ_S = 10.0
"""How long the first reading of the gauges is tried (within the drain's timeout): one slow scrape of a busy
node must not end the wait before it began, and an endpoint that never answers must not hold a rollout for
the whole timeout."""


def planned_memory(manifest: Manifest) -> tuple[int, int] | None:
    """(bytes one loaded copy takes, bytes of the capacity the plan was made for) of an LLM version whose
    manifest records a memory plan; None for any other version."""
    plan = (manifest.source or {}).get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("memory"), dict):
        return None
    memory: dict[str, Any] = plan["memory"]
    try:
        capacity = int(memory["gpu_memory_bytes"])
        if plan.get("device") == "cpu":
            used = int(memory["weight_bytes"]) + int(plan.get("kv_cache_bytes") or 0)
        else:
            utilization = float((plan.get("engine_args") or {}).get("gpu_memory_utilization")
                                or memory["request"]["utilization"])
            used = int(capacity * utilization)
    except (KeyError, TypeError, ValueError):
        return None
    return (used, capacity) if used > 0 and capacity > 0 else None


def metrics_url_for(url: str, metrics_url: str | None = None) -> str:
    """The metrics endpoint of the Triton server at ``url``: ``metrics_url`` when given, else the same host
    on Triton's default metrics port."""
    from repo_manager.ops.observe.top import Server  # noqa: PLC0415 - `trm top`'s parser only where streams drain

    return Server.parse(metrics_url or url, DEFAULT_METRICS_PORT).metrics_url


def in_flight(metrics_url: str, model: str, versions: tuple[int, ...], timeout_s: float = 3.0) -> int | None:
    """Running + waiting requests of ``model``'s ``versions`` as their engines report them; None when the
    endpoint cannot be read or reports no engine gauge for any of them."""
    from repo_manager.ops.observe.top import MAX_METRICS_BYTES, parse_llm  # noqa: PLC0415 - `trm top`'s parser only where streams drain

    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None
    samples = parse_llm(text)
    found = [samples[(model, str(v))].gauges for v in versions if (model, str(v)) in samples]
    if not any("running" in g for g in found):
        return None
    return int(sum(g.get("running", 0.0) + g.get("waiting", 0.0) for g in found))


@dataclass(frozen=True)
class Drained:
    seconds: float
    left: int | None
    """Requests still in flight when the wait ended (0: drained; None: the gauges could not be read)."""
    first: int | None
    """Requests in flight when the wait began."""

    @property
    def text(self) -> str:
        if self.left is None:
            return ("in-flight streams not readable from the metrics endpoint: unloading now (the backend "
                    "lets its streams finish on unload)")
        if self.left:
            return f"{self.left} stream(s) still in flight after {self.seconds:.1f} s: unloading anyway"
        return f"{self.first or 0} stream(s) in flight finished ({self.seconds:.1f} s)"


def wait_drained(metrics_url: str, model: str, versions: tuple[int, ...], timeout_s: float,
                 *, poll_s: float = 0.25, first_read_s: float = FIRST_READ_S,
                 began: Callable[[int], None] | None = None) -> Drained:
    """Until the engines of ``versions`` have had no request for QUIET_S, or ``timeout_s``. The first reading is
    tried for up to ``first_read_s``; the gauges still not readable: no wait (left None); a reading that fails
    later: the last one stands, and the wait goes on. ``began`` is called with the first reading."""
    started = time.monotonic()
    first = in_flight(metrics_url, model, versions)
    while first is None and time.monotonic() - started + poll_s < min(timeout_s, first_read_s):
        time.sleep(poll_s)
        first = in_flight(metrics_url, model, versions)
    if first is None:
        return Drained(time.monotonic() - started, None, None)
    count = first
    if began is not None:
        began(first)
    quiet_since: float | None = None
    while True:
        now = time.monotonic()
        if count == 0:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= QUIET_S:
                return Drained(now - started, 0, first)
        else:
            quiet_since = None
        if now - started >= timeout_s:
            return Drained(now - started, count, first)
        time.sleep(poll_s)
        # a read that fails once the wait has begun (a slow scrape on a busy node) keeps the last count and is
        # tried again until the timeout: ending the drain there would unload under streams still in flight
        latest = in_flight(metrics_url, model, versions)
        if latest is None:
            quiet_since = None  # a quiet spell is only counted on readings
        else:
            count = latest
