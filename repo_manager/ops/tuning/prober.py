"""Measuring candidates on a live server: load through the API, warm up, measure, judge stability.

Every candidate is applied with Triton's load API and a config override (``TritonClient.load``): no
file is written and the server never restarts. A point passes the SLO only when it is valid (the client
kept the offered rate), not saturated, without errors, stable, and its p99 is within the SLO.

Stability rule: a point's measured requests are split into three windows in send order. When the p99
of the last window is more than 1.5 times the first one's (and not trivially small), the queue was
still growing or the machine was disturbed; the point is measured again with twice the requests, and
if it is still unstable it passes only if every window's p99 is within the SLO. Below a rate the same
config already kept stably the queue cannot be growing, so there the windows' difference is noise and
the point is taken as it is. A point the client
could not drive (invalid) is retried once; if it stays invalid it is reported as such and never passes.
A near miss is measured once more and the level is met if the retry meets it: on a shared machine one
disturbed measurement should not condemn a config; the finalists' interleaved re-measure (``search``)
catches a config that only passed by luck. A miss is near (``near_miss``) when a disturbance can explain it:
the p99 missed the SLO by at most ``NEAR_MISS``, or some window of a stable point met it; a config that cannot
carry the rate misses in every window or its queue grows, and measuring it again only costs time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from repo_manager.adapters.loadgen import LoadSpec, Measurement, Target, Workload, measure
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import ServerError, TrmError
from repo_manager.ops.tuning.candidates import Candidate, Profile

Progress = Callable[[str, float, float], None]
"""``progress(message, seconds_used, budget_seconds)``."""

LOAD_S = 1.5
"""Allowance for loading one candidate (Triton's load API with a config override)."""
SUPERSEDED = "superseded"
"""The level a strict point is recorded under once a repeat replaced it (``Prober.supersede``)."""
REPEATED = ("remeasure", "confirm", SUPERSEDED)
"""Levels measured again on purpose (never answered from an earlier point)."""
MAX_POINT_S = 6.0
"""A point is ``requests`` requests but at most this many seconds of traffic (and at least 300 requests):
at a low rate a longer point is the search's largest cost (at 50/s, 15 s a point made the low-traffic
points half of a 300 s search; at 8 s, five low-traffic points of 8.3-9.7 s each were 45 s of a 163 s search),
and a level a choice rests on is measured in ``CONFIRM_ROUNDS`` rounds (``search.CONFIRM_ROUNDS``)."""
WARM_CONFIG_WARMUP = 0.15
"""Share of the warm-up a point gets when its config was measured just before (no load in between) at a rate
at least half of this one's: the model's batches of that size are warm, only the new rate's queue has to settle
(tens of milliseconds at the rates a search measures). Measured on the tuning check's model (max batch 8, two
instances, 600/s right after 480/s, eight points each): with 0.5, 0.15 and 0.05 s of warm-up the median p99 was
22.4, 21.4 and 21.6 ms and the median p99 of the first third 22.1, 21.0 and 21.6 ms; the disturbances (30-44 ms)
fell in every variant alike. After a slower point the whole warm-up: there a confirmation round at 480/s
measured right after one at 50/s on the same config missed the SLO in three runs of three (25.7, 33.8, 42.4 ms,
where its other rounds there measured 20-22 ms)."""
MAX_NORMAL_REJECT = 0.002
"""Share of a point's requests a queue policy may reject (Triton's queue timeout shedding a Poisson burst), where the
p99 of every request, a rejection counted as a miss, must also meet the SLO: a fifth of the p99's 1 % room. The same
rule for the search, a queue policy's normal traffic (``overload``) and ``--check``. At 1 %, a 7.6 ms timeout on
the tuning check's model (a full batch of 8 takes 12 ms) passed trm's measurement and shed 1.7-1.8 % at 400/s in
each of three independent rounds, which put that config's p99 at peak out of the SLO."""


def rejected_share(result: Measurement) -> float:
    """The share of a measurement's requests the server's queue policy rejected (1 when nothing was measured)."""
    return result.rejected / result.requests if result.requests else 1.0


def within_slo(result: Measurement, slo_ms: float, *, stable: bool = True) -> bool:
    """Whether a measured point keeps the SLO: measured as offered, the server not saturated, no errors, at most
    ``MAX_NORMAL_REJECT`` rejected by a queue policy, and the p99 of every request (a rejection counted as a miss)
    within the SLO; for an unstable point (a growing queue), the p99 of every window. The one rule for the search's
    points, ``--check`` and a queue policy's normal traffic (``overload.PolicySearch._normal_traffic``)."""
    if not result.valid or result.saturated or result.errors or rejected_share(result) > MAX_NORMAL_REJECT:
        return False
    if not stable:
        return max(result.window_p99_ms) <= slo_ms
    return result.p99_ms <= slo_ms


NEAR_MISS = 1.2
"""A point whose every window missed the SLO is a near miss only within this multiple of it (``near_miss``): on the
tuning check's model (SLO 25 ms) a second measurement of the current config (59.7 ms in each of three windows)
and of plain batching (33.5 / 29.8 / 27.1 ms) missed the same way, about 3.5 s each for nothing."""
PROFILE_REQUESTS = 8
"""Requests per profiled batch size, at least (and at least ``PROFILE_MEASURE_S`` of them)."""
PROFILE_WARMUP_S = 0.2
PROFILE_MEASURE_S = 0.3


def point_count(rate: float, *, requests: int, max_point_s: float) -> int:
    """Requests for a point at ``rate``: ``requests``, capped at ``max_point_s`` of traffic (>= 300)."""
    return int(max(min(requests, rate * max_point_s), min(requests, 300)))


def point_cost_s(rate: float, *, requests: int, max_point_s: float, warmup_s: float) -> float:
    """Seconds one measured point at ``rate`` takes at least: warm-up, its requests at that rate, wind-down."""
    return warmup_s + point_count(rate, requests=requests, max_point_s=max_point_s) / rate + 0.3


def config_cost_s(point_cost: Callable[[float], float], rates: Iterable[float]) -> float:
    """Seconds measuring one config at ``rates`` takes at least: its load and a point at each rate."""
    return sum(map(point_cost, rates)) + LOAD_S


def profile_cost_s(max_batch_size: int) -> float:
    """Seconds the execution-time profile takes at least: a load, then batch sizes 1, 2, 4 … (warm-up and
    measurement by time each, and the wind-down)."""
    sizes = max(max_batch_size, 1).bit_length()
    return LOAD_S + sizes * (PROFILE_WARMUP_S + PROFILE_MEASURE_S + 0.1)


@dataclass(frozen=True)
class Point:
    candidate: str
    """The candidate's key."""
    level: str
    """``low``, ``peak``, ``headroom``, ``capacity``, ``delay-search``, ``remeasure`` (a finalist at the best
    capacity), ``confirm`` (a finalist's round at one of the levels, without the prober's second chance for a near
    miss: ``Prober.point``'s ``strict``) or ``superseded`` (a strict point that a repeat replaced:
    ``search.DISTURBANCE_REPEATS``)."""
    rate: float
    meets_slo: bool
    stable: bool
    measurement: Measurement | None
    note: str = ""

    @property
    def p99_ms(self) -> float:
        return self.measurement.p99_ms if self.measurement else float("inf")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"candidate": self.candidate, "level": self.level, "rate": self.rate,
                                "meets_slo": self.meets_slo, "stable": self.stable, "note": self.note}
        if self.measurement is not None:
            data.update(self.measurement.to_dict())
        return data


class Prober:
    def __init__(self, client: TritonClient, target: Target, base: cfg.ModelConfig, slo_ms: float,
                 budget_s: float, *, requests: int = 1000, max_point_s: float = MAX_POINT_S, warmup_s: float = 1.0,
                 progress: Progress | None = None) -> None:
        self.client, self.target, self.base, self.slo_ms = client, target, base, slo_ms
        self.budget_s, self.requests, self.max_point_s, self.warmup_s = budget_s, requests, max_point_s, warmup_s
        self.started = time.monotonic()
        self.held_back_s = 0.0
        self.points: list[Point] = []
        self.loaded: str | None = None
        self.load_errors: dict[str, str] = {}
        self._progress = progress
        self._workload = Workload.from_config(base)

    @property
    def workload(self) -> Workload:
        return self._workload

    # ------------------------------------------------------------------------------------ budget
    @property
    def used_s(self) -> float:
        return time.monotonic() - self.started

    def remaining_s(self) -> float:
        return self.budget_s - self.used_s

    def point_count(self, rate: float) -> int:
        return point_count(rate, requests=self.requests, max_point_s=self.max_point_s)

    def point_cost_s(self, rate: float) -> float:
        return point_cost_s(rate, requests=self.requests, max_point_s=self.max_point_s, warmup_s=self.warmup_s)

    def best_valid_send_rps(self) -> float:
        """The highest rate this client sent at in a point it drove as offered (0 before any)."""
        return max((p.measurement.send_rps for p in self.points if p.measurement and p.measurement.valid),
                   default=0.0)

    def can_afford(self, seconds: float) -> bool:
        return seconds <= self.remaining_s() - self.held_back_s

    @contextmanager
    def holding_back(self, seconds: float) -> Iterator[None]:
        """Within the block, ``seconds`` more of the budget are kept for what comes after it (blocks nest: the
        finalists' rounds are held back inside the queue-policy search's share)."""
        before = self.held_back_s
        self.held_back_s = before + seconds
        try:
            yield
        finally:
            self.held_back_s = before

    def say(self, message: str) -> None:
        if self._progress:
            self._progress(message, self.used_s, self.budget_s)

    # ------------------------------------------------------------------------------------ loading
    def load(self, candidate: Candidate) -> bool:
        """Apply ``candidate`` (no-op when it is what is loaded). False, with the reason kept, if it fails."""
        if self.loaded == candidate.key:
            return True
        if candidate.key in self.load_errors:
            return False
        self.say(f"loading {candidate.label}")
        try:
            self.client.load(self.target.model, candidate.apply(self.base))
        except ServerError as exc:
            self.load_errors[candidate.key] = exc.message
            self.loaded = None
            return False
        self.loaded = candidate.key
        return True

    def restore(self, config: cfg.ModelConfig) -> None:
        self.client.load(self.target.model, config)
        self.loaded = None

    # ------------------------------------------------------------------------------------ measuring
    def point(self, candidate: Candidate, level: str, rate: float, *, strict: bool = False) -> Point:
        """Measure ``candidate`` at ``rate`` (cached per candidate and rate unless ``remeasure`` or
        ``confirm``). ``strict``: a near miss is not measured again here (a finalist's re-measure or round: the
        search decides on a repeat, ``search.Search._strict``)."""
        kept = self.kept_point(candidate, level, rate)
        if kept is not None:
            return kept
        loaded_before = self.loaded
        if not self.load(candidate):
            point = Point(candidate.key, level, rate, False, True, None,
                          f"did not load: {self.load_errors[candidate.key]}")
            self.points.append(point)
            return point
        # a config just loaded runs its first batches in the whole warm-up; one measured just before is warm
        # (at a rate not far below this one: WARM_CONFIG_WARMUP)
        previous = self.points[-1] if self.points else None
        warm = (self.loaded == loaded_before and previous is not None and previous.candidate == candidate.key
                and previous.rate >= 0.5 * rate)
        warmup_s = self.warmup_s * WARM_CONFIG_WARMUP if warm else self.warmup_s
        self.say(f"{level} {rate:.0f}/s: {candidate.label}")
        # far more requests in flight than the SLO allows means the server fell behind: stop early (but
        # not on a hiccup of a shared machine: allow half a second of traffic, or ten SLOs' worth)
        in_flight = max(64, int(rate * max(0.5, self.slo_ms / 100.0)))
        spec = LoadSpec(rate=rate, requests=self.point_count(rate), warmup_s=warmup_s,
                        seed=len(self.points), max_in_flight=in_flight)
        result = self._measure(spec)
        note = ""
        if not result.valid:
            note = f"retried: {result.invalid_reason}"
            result = self._measure(replace(spec, seed=spec.seed + 1000))
        stable = self.stable(result)
        if result.valid and not stable and self._kept_faster(candidate.key, rate):
            # a queue cannot grow at a rate below one the same config kept stably: the windows differ by noise
            note, stable = "windows differed, not a growing queue: a higher rate was kept", True
        if result.valid and not stable:
            note = "unstable, measured again with twice the requests"
            result = self._measure(replace(spec, requests=spec.requests * 2, seed=spec.seed + 2000))
            stable = self.stable(result)
        passed = self._passes(result, stable)
        if not strict and not passed and near_miss(result, self.slo_ms, stable=stable):
            # a near miss on a shared machine may be a disturbance of the machine, not the config: one
            # more measurement decides (finalists are measured again, interleaved, before any choice)
            retry = self._measure(replace(spec, seed=spec.seed + 3000))
            if self._passes(retry, self.stable(retry)):
                note = (note + "; " if note else "") + f"missed at p99 {result.p99_ms:.1f} ms, met on a retry"
                result, stable, passed = retry, self.stable(retry), True
            else:
                note = (note + "; " if note else "") + f"missed twice (p99 {result.p99_ms:.1f}, {retry.p99_ms:.1f} ms)"
        point = Point(candidate.key, level, rate, passed, stable, result,
                      (note + "; " if note else "") + (result.invalid_reason or ""))
        self.points.append(point)
        verdict = "meets" if point.meets_slo else "misses"
        self.say(f"{level} {rate:.0f}/s: p99 {point.p99_ms:.1f} ms {verdict} the SLO: {candidate.label}")
        return point

    def kept_point(self, candidate: Candidate, level: str, rate: float) -> Point | None:
        """The point already measured for ``candidate`` at ``rate`` that answers a request at ``level`` again (None
        for a level measured again on purpose, ``REPEATED``, or where there is none)."""
        if level in REPEATED:
            return None
        return next((p for p in self.points if p.candidate == candidate.key and p.rate == rate
                     and p.level not in REPEATED), None)

    def supersede(self, point: Point, why: str) -> None:
        """Keep ``point`` in the record under the level ``SUPERSEDED``, with ``why``: a strict point that a repeat
        replaces (``search.Search._strict``), so that no rule counts it any more and the record still shows it."""
        index = next((i for i in range(len(self.points) - 1, -1, -1) if self.points[i] is point), None)
        if index is None:
            raise ValueError(f"{point.level} {point.rate:.0f}/s of {point.candidate} is not in the record")
        note = f"{point.level}: {why}" + (f"; {point.note}" if point.note else "")
        self.points[index] = replace(point, level=SUPERSEDED, note=note)

    def measure(self, spec: LoadSpec) -> Measurement:
        """One load point on what is loaded, as measured (no SLO judgement, nothing recorded)."""
        return self._measure(spec)

    def _measure(self, spec: LoadSpec, workload: Workload | None = None) -> Measurement:
        try:
            return measure(self.target, spec, workload or self._workload)
        except TrmError:
            raise
        except Exception as exc:
            raise ServerError(f"measuring {self.target.model} on {self.target.url} failed: {exc}",
                              url=self.target.url) from exc

    def _kept_faster(self, key: str, rate: float) -> bool:
        """``key`` met the SLO, stably, at a higher rate than ``rate``."""
        return any(p.candidate == key and p.rate > rate and p.meets_slo and p.stable for p in self.points)

    def stable(self, result: Measurement) -> bool:
        """Whether ``result`` shows no growing queue: its last window's p99 within 1.5 x its first's (or a quarter of
        the SLO, whichever is more). A point that is not stable is measured again with twice the requests."""
        windows = result.window_p99_ms
        if not result.valid or result.saturated or len(windows) < 2:
            return True
        floor = max(windows[0], self.slo_ms * 0.25)
        return not windows[-1] > 1.5 * floor

    def _passes(self, result: Measurement, stable: bool) -> bool:
        return within_slo(result, self.slo_ms, stable=stable)

    # ------------------------------------------------------------------------------------ profile
    def profile(self, current: Candidate, limit: int, per_size: int = PROFILE_REQUESTS) -> Profile:
        """Execution time per batch size, dynamic batching off, one request at a time.

        Each size gets ``PROFILE_WARMUP_S`` of warm-up and then at least ``per_size`` requests and at least
        ``PROFILE_MEASURE_S`` of them: sized by time, so a sub-millisecond model is measured over
        hundreds of requests and a slow one over a few. Sizes stop once a batch alone executes past the
        SLO (no larger batch can be part of a config that meets it)."""
        probe = Candidate(max(limit, current.max_batch_size), 1, dynamic=False, origin="profile")
        if not self.load(probe):
            probe = Candidate(current.max_batch_size, 1, dynamic=False, origin="profile")
            if not self.load(probe):
                raise ServerError(f"{self.target.model} does not load even with its own max_batch_size: "
                                  f"{self.load_errors[probe.key]}", url=self.target.url)
        exec_ms: dict[int, float] = {}
        overhead = 0.0
        size = 1
        why = ""
        while size <= probe.max_batch_size:
            self.say(f"profiling execution time at batch size {size}")
            workload = Workload.from_config(self.base, batch_size=size, variants=2)
            result = self._measure(LoadSpec(concurrency=1, requests=per_size, warmup_s=PROFILE_WARMUP_S,
                                            min_duration_s=PROFILE_MEASURE_S), workload)
            why = profile_problem(result, size)
            if why:
                break
            assert result.server is not None
            exec_ms[size] = result.server.exec_ms_by_batch[size]
            if size == 1:
                overhead = max(result.p50_ms - result.server.server_ms, 0.0)
            if exec_ms[size] > self.slo_ms:
                break
            size *= 2
        if not exec_ms:
            raise ServerError(f"{self.target.model} could not be profiled at batch size 1: {why}",
                              url=self.target.url)
        if why:
            self.say(f"profile stopped at batch size {size}: {why}")
        return Profile(exec_ms, round(overhead, 3), max(exec_ms))


def near_miss(result: Measurement, slo_ms: float, *, stable: bool = True) -> bool:
    """Whether a point that missed ``slo_ms`` may have missed by a disturbance of the machine (worth one more
    measurement): driven as offered, not saturated, within three times the SLO, and the p99 missed it by at most
    ``NEAR_MISS`` or, on a ``stable`` point, some window met the SLO (a growing queue starts empty, so its first
    window meeting the SLO says nothing of a disturbance)."""
    if not result.valid or result.saturated or result.p99_ms > 3 * slo_ms:
        return False
    some_window_met = min(result.window_p99_ms, default=float("inf")) <= slo_ms
    return result.p99_ms <= NEAR_MISS * slo_ms or (stable and some_window_met)


def profile_problem(result: Measurement, size: int) -> str:
    """Why a profiled batch size gave no execution time ("" when it did)."""
    if result.errors:
        return f"{result.errors} of {result.requests} requests failed ({'; '.join(result.error_samples)})"
    if result.requests == 0:
        return "no request was measured after the warm-up"
    if result.server is None or result.server.requests == 0:
        return (f"{result.requests} requests were answered but Triton's statistics counted none of them "
                "(another client or a reload reset them?)")
    if size not in result.server.exec_ms_by_batch:
        executed = ", ".join(map(str, result.server.batch_histogram)) or "none"
        return f"Triton executed no batch of {size} (executed batch sizes: {executed})"
    return ""
