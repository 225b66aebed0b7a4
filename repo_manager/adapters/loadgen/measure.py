"""One load point: open-loop arrivals at a rate (or closed-loop concurrency), measured end to end.

Open loop: arrival times are drawn up front (Poisson: exponential gaps; constant: equal gaps) and each
request is sent as its own task at its time, so a slow response never delays the next send, which is
what real traffic does and what closed-loop tools (perf_analyzer's concurrency mode, Model Analyzer)
do not: a closed loop slows its own arrivals when the server slows and so hides queueing delay.

A point is **invalid** (``valid=False`` with a reason, and never reported as a result) when the client,
not the server, limited it: it sent less than ``min_send_ratio`` of the offered rate, or its sends ran
late (95th percentile of send lag above ``max_lag_ms``: on a shared machine a rare hiccup of a
few tens of milliseconds happens and does not change the arrival process much; a client that cannot
keep up is late on most sends), or too few requests completed. When the
server falls behind instead, requests pile up: past ``max_in_flight`` the run stops early and the point
is valid and ``saturated`` (its p99 is the latency of a queue that grows without bound).

The first ``warmup_s`` seconds of traffic are sent at the same rate but left out of every figure;
Triton's statistics are read when the first measured request is sent and after the last answer, so
the point also says how much of the latency was queueing and how large the executed batches were.
``window_p99_ms`` splits the measured requests into consecutive windows (in send order) for a
stability rule: a p99 that keeps rising from window to window is a queue that is still growing.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.http.aio as http_aio

from repo_manager.adapters.loadgen.stats import ServerStats, StatsSnapshot
from repo_manager.adapters.loadgen.transport import AsyncTriton, Workload, error_text, is_rejection
from repo_manager.adapters.triton import restricted
from repo_manager.adapters.triton.client import TritonClient, normalize_url
from repo_manager.core.errors import ServerError, UsageError

ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class Target:
    """Where to send: ``url`` is Triton's HTTP endpoint (statistics, config, and HTTP requests)."""

    model: str
    url: str
    protocol: str = "http"
    grpc_url: str | None = None
    """``host:port`` of Triton's gRPC endpoint; required when ``protocol`` is ``grpc``."""
    version: int | None = None

    @property
    def send_url(self) -> str:
        if self.protocol == "grpc":
            if not self.grpc_url:
                raise UsageError("the gRPC protocol needs Triton's gRPC address", hint="pass --grpc-url HOST:PORT")
            return self.grpc_url
        return self.url


def check_arrivals(what: str, rate: float | None, concurrency: int | None, arrivals: str) -> None:
    """One of a rate (open loop, ``arrivals`` of ARRIVALS) or a concurrency (closed loop), each in range."""
    if (rate is None) == (concurrency is None):
        raise UsageError(f"{what} needs either a rate (open loop) or a concurrency (closed loop)")
    if rate is not None and not rate > 0:
        raise UsageError(f"rate must be positive, not {rate}")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"concurrency must be at least 1, not {concurrency}")
    if arrivals not in ARRIVALS:
        raise UsageError(f"arrivals must be one of {', '.join(ARRIVALS)}, not {arrivals!r}")


@dataclass(frozen=True)
class LoadSpec:
    """One load point. Give ``rate`` (open loop, requests/s) or ``concurrency`` (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None
    arrivals: str = "poisson"
    requests: int = 2000
    """Measured requests (after warm-up); at least ``rate * min_duration_s`` in open loop."""
    min_duration_s: float = 0.0
    """Closed loop: measure at least this long too (a fast model answers ``requests`` in milliseconds)."""
    warmup_s: float = 1.0
    windows: int = 3
    max_lag_ms: float = 10.0
    min_send_ratio: float = 0.95
    max_in_flight: int | None = None
    """Open loop: more requests than this waiting for an answer means the server is saturated.
    Default: one second of traffic, at least 64."""
    timeout_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_arrivals("a load point", self.rate, self.concurrency, self.arrivals)
        if self.requests < 1:
            raise UsageError("a load point needs at least one request")

    @property
    def mode(self) -> str:
        return self.arrivals if self.rate is not None else "closed"

    def in_flight_limit(self) -> int:
        return self.max_in_flight or max(64, int(math.ceil(self.rate or 0)))


@dataclass(frozen=True)
class Measurement:
    mode: str
    protocol: str
    offered_rps: float | None
    concurrency: int | None
    requests: int
    errors: int
    """Failed requests, rejections by the queue policy not included."""
    error_samples: tuple[str, ...]
    duration_s: float
    send_rps: float
    achieved_rps: float
    """Successful answers per second over the measured window."""
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    lag_p95_ms: float
    lag_p99_ms: float
    window_p99_ms: tuple[float, ...]
    saturated: bool
    valid: bool
    invalid_reason: str | None
    server: ServerStats | None
    latencies_ms: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    """Every measured request's latency in send order, inf for a failed or rejected one (not in ``to_dict``)."""
    rejected: int = 0
    """Requests the server shed by its queue policy (``Request timeout expired``, ``Exceeds maximum queue
    size``): not errors, but not answers either, so ``p50_ms``..``max_ms`` count them as infinitely slow."""
    accepted_p99_ms: float = math.inf
    """p99 of the answered requests only: what the requests the server accepted experienced."""
    rejection_p50_ms: float | None = None
    rejection_p99_ms: float | None = None
    """How long a rejected request waited for its refusal."""

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in (
            "mode", "protocol", "offered_rps", "concurrency", "requests", "errors", "duration_s", "send_rps",
            "achieved_rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms", "lag_p95_ms", "lag_p99_ms",
            "saturated", "valid", "invalid_reason", "rejected", "accepted_p99_ms", "rejection_p50_ms",
            "rejection_p99_ms")}
        data["error_samples"] = list(self.error_samples)
        data["window_p99_ms"] = list(self.window_p99_ms)
        data["server"] = self.server.to_dict() if self.server else None
        return data


def arrival_offsets(rate: float, count: int, arrivals: str, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: Poisson (exponential gaps) or constant."""
    if arrivals == "constant":
        return np.arange(count) / rate
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.cumsum(gaps) - gaps[0]


def measure(target: Target, spec: LoadSpec, workload: Workload | None = None) -> Measurement:
    """Run one load point against ``target`` and measure it (blocks; runs its own event loop).

    Without a workload, requests are generated from the config the server serves.
    """
    if workload is None:
        with TritonClient(target.url) as client:
            workload = Workload.from_config(client.model_config(target.model, target.version))
    return asyncio.run(_run(target, spec, workload))


class _Snapshots:
    """Statistics read as tasks on the sending loop, so that reading them never delays a scheduled send."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._client = http_aio.InferenceServerClient(normalize_url(url))
        key = restricted.current()  # statistics are one of Triton's restricted groups
        self._headers = key.http_headers() if key else None
        self.taken: dict[str, asyncio.Future] = {}

    def __call__(self, key: str) -> None:
        self.taken[key] = asyncio.ensure_future(self._read())

    async def _read(self) -> StatsSnapshot:
        try:
            data = await self._client.get_inference_statistics(self.model, headers=self._headers)
        except Exception as exc:
            raise ServerError(f"Triton at {self.url} refused statistics of {self.model}: {error_text(exc)}",
                              url=self.url) from exc
        return StatsSnapshot.parse(list(data.get("model_stats", [])))

    async def close(self) -> None:
        await self._client.close()


class _Recorder:
    def __init__(self, total: int) -> None:
        self.sent_at = np.full(total, np.nan)
        self.done_at = np.full(total, np.nan)
        self.ok = np.zeros(total, dtype=bool)
        self.rejected = np.zeros(total, dtype=bool)
        """Shed by the server's queue policy: counted apart from errors (an answer refused, not a fault)."""
        self.errors: dict[str, int] = {}
        self.in_flight = 0

    def reserve(self, index: int) -> None:
        """Room for request ``index`` (closed loop: how many requests a warm-up of ``warmup_s`` seconds
        takes depends on the model's speed, so the record grows instead of having a fixed size)."""
        if index < len(self.sent_at):
            return
        grow = max(len(self.sent_at), index + 1)
        self.sent_at = np.concatenate([self.sent_at, np.full(grow, np.nan)])
        self.done_at = np.concatenate([self.done_at, np.full(grow, np.nan)])
        self.ok = np.concatenate([self.ok, np.zeros(grow, dtype=bool)])
        self.rejected = np.concatenate([self.rejected, np.zeros(grow, dtype=bool)])

    async def send(self, sender: AsyncTriton, index: int) -> None:
        self.in_flight += 1
        self.sent_at[index] = time.perf_counter()
        try:
            await sender.infer()
            self.ok[index] = True
        except Exception as exc:  # noqa: BLE001 - every failure is a recorded error, not a crash
            if is_rejection(exc):
                self.rejected[index] = True
            else:
                text = error_text(exc)
                self.errors[text] = self.errors.get(text, 0) + 1
        finally:
            self.done_at[index] = time.perf_counter()
            self.in_flight -= 1


_LoopResult = tuple[_Recorder, int, np.ndarray, bool]
"""The recorder, the index of the first measured request, send lags (s), and whether it saturated."""


async def _run(target: Target, spec: LoadSpec, workload: Workload) -> Measurement:
    limit = spec.in_flight_limit() if spec.rate else (spec.concurrency or 1)
    sender = AsyncTriton(target.protocol, target.send_url, target.model, workload, version=target.version,
                         max_connections=limit + 8, timeout_s=spec.timeout_s)
    snapshot = _Snapshots(target.url, target.model)
    try:
        if spec.rate is not None:
            result = await _open_loop(sender, spec, snapshot)
        else:
            result = await _closed_loop(sender, spec, snapshot)
        snapshot("after")
        server = ServerStats.between(await snapshot.taken["before"], await snapshot.taken["after"])
    finally:
        await sender.close()
        await snapshot.close()
    return _summarize(target, spec, *result, server)


async def _open_loop(sender: AsyncTriton, spec: LoadSpec, snapshot: _Snapshots) -> _LoopResult:
    assert spec.rate is not None
    warm = int(spec.rate * spec.warmup_s)
    measured = max(spec.requests, int(math.ceil(spec.rate * spec.min_duration_s)))
    offsets = arrival_offsets(spec.rate, warm + measured, spec.arrivals, spec.seed)
    rec = _Recorder(len(offsets))
    lags = np.full(len(offsets), np.nan)
    tasks = []
    saturated = False
    limit = spec.in_flight_limit()
    start = time.perf_counter() + 0.01
    for index, offset in enumerate(offsets):
        if index == warm:
            snapshot("before")
        due = start + offset
        delay = due - time.perf_counter()
        # sleep(0) when late still yields, so that answers are processed between back-to-back sends
        await asyncio.sleep(max(delay, 0.0))
        lags[index] = time.perf_counter() - due
        if rec.in_flight >= limit:
            saturated = True
            break
        tasks.append(asyncio.ensure_future(rec.send(sender, index)))
    if "before" not in snapshot.taken:  # stopped (saturated) during warm-up
        snapshot("before")
    await asyncio.gather(*tasks)
    return rec, warm, lags, saturated


async def _closed_loop(sender: AsyncTriton, spec: LoadSpec, snapshot: _Snapshots) -> _LoopResult:
    """``concurrency`` clients, each sending its next request when its answer came: ``warmup_s`` seconds
    of traffic (however many requests that is), then at least ``requests`` measured requests and at least
    ``min_duration_s`` seconds of them."""
    assert spec.concurrency is not None
    rec = _Recorder(spec.requests + spec.concurrency * 16)
    state = {"next": 0, "first_measured": -1, "measuring_since": 0.0}
    warm_end = time.perf_counter() + spec.warmup_s

    def done() -> bool:
        measured = state["next"] - state["first_measured"]
        return measured >= spec.requests and time.perf_counter() - state["measuring_since"] >= spec.min_duration_s

    async def worker() -> None:
        while True:
            if state["first_measured"] < 0 and time.perf_counter() >= warm_end:
                state["first_measured"] = state["next"]
                state["measuring_since"] = time.perf_counter()
                snapshot("before")
            if state["first_measured"] >= 0 and done():
                return
            index = state["next"]
            state["next"] += 1
            rec.reserve(index)
            await rec.send(sender, index)

    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    return rec, state["first_measured"], np.zeros(0), False


def _summarize(target: Target, spec: LoadSpec, rec: _Recorder, first: int, lags: np.ndarray, saturated: bool,
               server: ServerStats) -> Measurement:
    sent = ~np.isnan(rec.sent_at)
    sent[:first] = False
    sent_at, done_at, ok = rec.sent_at[sent], rec.done_at[sent], rec.ok[sent]
    rejected = rec.rejected[sent]
    latencies = (done_at - sent_at) * 1000.0
    ok_latencies = latencies[ok]
    count = int(sent.sum())
    errors = count - int(ok.sum()) - int(rejected.sum())
    duration = float(np.nanmax(done_at) - np.nanmin(sent_at)) if count else 0.0
    send_span = float(np.nanmax(sent_at) - np.nanmin(sent_at)) if count > 1 else 0.0
    send_rps = (count - 1) / send_span if send_span > 0 else 0.0
    # a failed request counts as infinitely slow for the percentiles: errors can never help p99
    scored = np.where(ok, latencies, np.inf)

    def pct(values: np.ndarray, q: float) -> float:
        return round(float(np.percentile(values, q, method="higher")), 3) if len(values) else math.inf

    windows = tuple(pct(part, 99) for part in np.array_split(scored, spec.windows) if len(part))
    lag_values = lags[first:][~np.isnan(lags[first:])] * 1000.0 if len(lags) else np.zeros(0)
    lag_p95 = pct(lag_values, 95) if len(lag_values) else 0.0
    lag_p99 = pct(lag_values, 99) if len(lag_values) else 0.0
    reason = None
    if spec.rate is not None and not saturated:
        # compare with the rate the drawn schedule asked for: a few hundred Poisson gaps can sum to a
        # rate several percent off the nominal one without any fault of the client
        sent_lags = lags[sent] if len(lags) == len(sent) else np.zeros(0)
        scheduled_span = send_span - float(sent_lags[-1] - sent_lags[0]) if len(sent_lags) > 1 else 0.0
        scheduled_rps = (count - 1) / scheduled_span if scheduled_span > 0 else spec.rate
        if send_rps < spec.min_send_ratio * scheduled_rps:
            reason = (f"client fell behind: sent {send_rps:.0f}/s of {scheduled_rps:.0f}/s scheduled "
                      f"({spec.rate:.0f}/s offered)")
        elif lag_p95 > spec.max_lag_ms:
            reason = f"client fell behind: p95 send lag {lag_p95:.1f} ms > {spec.max_lag_ms:g} ms"
    if reason is None and not saturated and count < 0.9 * spec.requests:
        reason = f"only {count} of {spec.requests} requests were measured"
    return Measurement(
        mode=spec.mode, protocol=target.protocol, offered_rps=spec.rate, concurrency=spec.concurrency,
        requests=count, errors=errors,
        error_samples=tuple(sorted(rec.errors, key=rec.errors.get, reverse=True)[:3]),
        duration_s=round(duration, 3), send_rps=round(send_rps, 1),
        achieved_rps=round(len(ok_latencies) / duration, 1) if duration > 0 else 0.0,
        p50_ms=pct(scored, 50), p90_ms=pct(scored, 90), p99_ms=pct(scored, 99),
        max_ms=pct(scored, 100), mean_ms=round(float(ok_latencies.mean()), 3) if len(ok_latencies) else math.inf,
        lag_p95_ms=lag_p95, lag_p99_ms=lag_p99, window_p99_ms=windows, saturated=saturated, valid=reason is None,
        invalid_reason=reason, server=server, latencies_ms=scored, rejected=int(rejected.sum()),
        accepted_p99_ms=pct(ok_latencies, 99),
        rejection_p50_ms=pct(latencies[rejected], 50) if rejected.any() else None,
        rejection_p99_ms=pct(latencies[rejected], 99) if rejected.any() else None)
