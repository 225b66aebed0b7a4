"""Open-loop traffic in phases (a spike, then normal traffic) and what it did: the overload view.

``run_schedule(target, [Phase(800, 3.0), Phase(200, 2.0)])`` sends Poisson arrivals at each phase's rate
for its duration, one after the other, and records every request: when it was sent, how long it took,
and whether it was answered, **rejected** by the server's queue policy (Triton's ``Request timeout
expired`` / ``Exceeds maximum queue size``: shedding, which is the point of a queue policy, not a
fault) or failed. ``Trace.phase_stats(i, slo_ms)`` sums one phase up: accepted p99, rejected fraction,
rejection latency, goodput (answers within the SLO per second); ``Trace.recovery(i, slo_ms)`` says how
long after phase ``i`` began (the load drop) requests again got answers within the SLO.

Unlike ``measure`` there is no in-flight limit: an overload that queues without bound is what this is
for, so a run waits for every answer (up to the transport's timeout). What bounds a run is the client:
once it is ``give_up_lag_s`` behind the schedule it cannot offer the rate asked for (the run is already
"not driven as offered"), so it sends nothing more; the requests left unsent are counted per phase and
make the phase invalid. (Before, asking 100 x capacity of a client that sends ~2,000/s kept it busy for
a minute per run.)
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from repo_manager.adapters.loadgen.measure import Target, arrival_offsets
from repo_manager.adapters.loadgen.transport import AsyncTriton, Workload, error_text, is_rejection

OK, REJECTED, FAILED, UNSENT = 0, 1, 2, 3
GIVE_UP_LAG_S = 2.0
"""A run stops sending once a request would go out this late (see the module docstring)."""


@dataclass(frozen=True)
class Phase:
    rate: float
    seconds: float


@dataclass(frozen=True)
class PhaseStats:
    offered_rps: float
    send_rps: float
    requests: int
    answered: int
    rejected: int
    errors: int
    accepted_p50_ms: float
    accepted_p99_ms: float
    rejection_p50_ms: float | None
    rejection_p99_ms: float | None
    goodput_rps: float
    """Answers within the SLO per second of the phase."""
    lag_p95_ms: float
    valid: bool
    """False when the client, not the server, limited the phase (it sent late, too little, or gave up)."""
    unsent: int = 0
    """Requests of the phase never sent: the client gave up, too far behind the schedule."""

    @property
    def rejected_fraction(self) -> float:
        return self.rejected / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["rejected_fraction"] = round(self.rejected_fraction, 4)
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in data.items()}


@dataclass(frozen=True)
class Trace:
    phases: tuple[Phase, ...]
    starts: tuple[float, ...]
    """Each phase's start, seconds from the first send."""
    sent_s: np.ndarray
    """Per request: when it was sent (seconds from the first scheduled send)."""
    latency_ms: np.ndarray
    outcome: np.ndarray
    """``OK``, ``REJECTED``, ``FAILED`` or ``UNSENT``."""
    lag_ms: np.ndarray
    error_samples: tuple[str, ...]
    phase: np.ndarray
    """Per request: the phase it was scheduled in (a late send still belongs to its phase)."""

    def _in(self, index: int) -> np.ndarray:
        return self.phase == index

    def phase_stats(self, index: int, slo_ms: float) -> PhaseStats:
        scheduled = self._in(index)
        unsent = int((scheduled & (self.outcome == UNSENT)).sum())
        mask = scheduled & (self.outcome != UNSENT)
        phase = self.phases[index]
        latency, outcome, sent = self.latency_ms[mask], self.outcome[mask], self.sent_s[mask]
        answered = latency[outcome == OK]
        rejected = latency[outcome == REJECTED]
        span = float(sent.max() - sent.min()) if len(sent) > 1 else 0.0
        send_rps = (len(sent) - 1) / span if span > 0 else 0.0
        lag = self.lag_ms[mask]
        lag_p95 = _pct(lag, 95) if len(lag) else 0.0

        def opt(values: np.ndarray, q: float) -> float | None:
            return _pct(values, q) if len(values) else None

        return PhaseStats(
            offered_rps=phase.rate, send_rps=round(send_rps, 1), requests=int(mask.sum()), answered=len(answered),
            rejected=len(rejected), errors=int((outcome == FAILED).sum()),
            accepted_p50_ms=_pct(answered, 50), accepted_p99_ms=_pct(answered, 99),
            rejection_p50_ms=opt(rejected, 50), rejection_p99_ms=opt(rejected, 99),
            goodput_rps=round(float((answered <= slo_ms).sum()) / phase.seconds, 1), lag_p95_ms=lag_p95,
            valid=(not unsent and send_rps >= 0.9 * phase.rate * _poisson_slack(len(sent))
                   and lag_p95 <= max_lag_ms(slo_ms)),
            unsent=unsent)

    def recovery(self, index: int, slo_ms: float, tolerance: float = 0.05) -> float | None:
        """Seconds from phase ``index``'s start (the load drop) until the server answered in time again.

        Recovered at the first request from which on at most ``tolerance`` of the phase's requests were
        rejected, failed or slower than the SLO: a backlog still draining makes nearly every request late,
        while a shared machine's odd slow request, late in the phase, does not undo a recovery. 0 when the
        phase was fine from its start; None when it never got there with at least 20 requests left.
        """
        mask = self._in(index) & (self.outcome != UNSENT)
        sent, latency, outcome = self.sent_s[mask], self.latency_ms[mask], self.outcome[mask]
        bad = ((outcome != OK) | (latency > slo_ms)).astype(float)
        suffix_bad = np.cumsum(bad[::-1])[::-1]
        suffix_len = np.arange(len(bad), 0, -1)
        fine = np.nonzero((suffix_bad <= tolerance * suffix_len) & (suffix_len >= 20))[0]
        if not len(fine):
            return None
        first = int(fine[0])
        return 0.0 if first == 0 else round(max(float(sent[first] - self.starts[index]), 0.0), 3)


def max_lag_ms(slo_ms: float) -> float:
    """Send lag (p95) a phase may have and still count as driven as offered: 20 ms, or a quarter of the SLO
    when that is more (sends bunched within a quarter of the SLO do not change what the SLO judges, and a
    busy shared machine lags that much now and then)."""
    return max(20.0, slo_ms / 4)


def _poisson_slack(count: int) -> float:
    # a few hundred exponential gaps can sum several percent away from the nominal rate
    return 1.0 - 3.0 / math.sqrt(max(count, 1))


def _pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q, method="higher")), 3) if len(values) else math.inf


def run_schedule(target: Target, phases: list[Phase], workload: Workload, *, seed: int = 0,
                 timeout_s: float = 60.0, give_up_lag_s: float = GIVE_UP_LAG_S) -> Trace:
    """Send the phases one after the other (open loop, Poisson) and wait for every answer; stop sending
    once ``give_up_lag_s`` behind the schedule."""
    return asyncio.run(_run(target, tuple(phases), workload, seed, timeout_s, give_up_lag_s))


async def _run(target: Target, phases: tuple[Phase, ...], workload: Workload, seed: int,
               timeout_s: float, give_up_lag_s: float) -> Trace:
    offsets, starts, owner, at = [], [], [], 0.0
    for i, phase in enumerate(phases):
        starts.append(at)
        count = max(int(phase.rate * phase.seconds), 1)
        gaps = arrival_offsets(phase.rate, count + 1, "poisson", seed + i)
        offsets.append(at + gaps[:count])
        owner.append(np.full(count, i))
        at += phase.seconds
    schedule = np.concatenate(offsets)
    total = len(schedule)
    sent = np.full(total, np.nan)
    done = np.full(total, np.nan)
    lags = np.zeros(total)
    outcome = np.full(total, FAILED, dtype=np.int8)
    errors: dict[str, int] = {}
    peak = max(p.rate for p in phases)
    sender = AsyncTriton(target.protocol, target.send_url, target.model, workload, version=target.version,
                         max_connections=int(peak * 2) + 64, timeout_s=timeout_s)

    async def one(index: int) -> None:
        sent[index] = time.perf_counter()
        try:
            await sender.infer()
            outcome[index] = OK
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, none crashes the run
            if is_rejection(exc):
                outcome[index] = REJECTED
            else:
                text = error_text(exc)
                errors[text] = errors.get(text, 0) + 1
        finally:
            done[index] = time.perf_counter()

    tasks = []
    try:
        start = time.perf_counter() + 0.01
        for index, offset in enumerate(schedule):
            due = start + offset
            await asyncio.sleep(max(due - time.perf_counter(), 0.0))
            late = time.perf_counter() - due
            if late > give_up_lag_s:
                outcome[index:] = UNSENT
                break
            lags[index] = late * 1000.0
            tasks.append(asyncio.ensure_future(one(index)))
        await asyncio.gather(*tasks)
    finally:
        await sender.close()
    return Trace(phases, tuple(starts), sent - start, (done - sent) * 1000.0, outcome, lags,
                 tuple(sorted(errors, key=errors.get, reverse=True)[:3]), np.concatenate(owner))
