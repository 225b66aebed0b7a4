"""``BackgroundLoad``: steady traffic from several clients while something else happens (a rollout).

Each client sends one request, waits for the answer, sends the next (optionally pausing
``interval_s``), until the ``with`` block ends; requests in flight then finish. Every request is
recorded, in start order, with its outcome, the ``model_version`` Triton says answered it, and either
the outputs (``keep_outputs=True``) or the label that ``check(outputs)`` returned. A rollout test can
then assert that no request failed and that answers went from one version to the other, each one
entirely old or entirely new::

    def label(outputs):            # which version computed this answer?
        ...return "v1" / "v2" / "mixed"

    with BackgroundLoad(url, "model", clients=4, check=label) as load:
        load.wait_for(50)          # traffic is flowing
        rollout(...)
    summary = load.summary()
    assert summary.failed == 0 and "mixed" not in summary.label_counts
    assert summary.stale == 0              # nothing sent after the first v2 answer got v1
    assert summary.labels[0] == "v1" and summary.labels[-1] == "v2"

The clients run on an asyncio loop in one daemon thread, so the test's own thread stays free.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from repo_manager.adapters.loadgen.transport import AsyncTriton, Workload, error_text, is_rejection
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core.errors import ServerError

Check = Callable[[dict[str, np.ndarray]], str]


@dataclass(frozen=True)
class RequestRecord:
    started_at: float
    """Wall-clock time (``time.time()``) the request was sent."""
    latency_s: float
    ok: bool
    error: str | None
    model_version: int | None
    label: str | None = None
    """What ``check(outputs)`` returned; a check that raised gives ``"check failed: ..."``."""
    outputs: dict[str, np.ndarray] | None = None
    client: int = 0
    rejected: bool = False
    """Refused by the server's queue policy (overload shedding): failed, but not a wrong answer."""


@dataclass(frozen=True)
class BackgroundSummary:
    requests: int
    failed: int
    errors: tuple[str, ...]
    """Distinct error texts, most frequent first."""
    versions: tuple[int | None, ...]
    """Versions that answered, run-length collapsed in start order: (1, 2) is a clean switch. With several
    clients, requests sent within a millisecond of the switch can interleave; ``stale`` is the strict test."""
    labels: tuple[str | None, ...]
    """The same for check labels."""
    label_counts: dict[str, int]
    stale: int = 0
    """Requests answered by an older answer kind (label, else version) although they were sent after an
    answer of a newer kind had already arrived. 0 for a clean switch, whatever the concurrency."""
    rejected: int = 0
    """Of ``failed``, how many the server's queue policy rejected (shedding load, not a fault)."""

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "failed": self.failed, "errors": list(self.errors),
                "versions": list(self.versions), "labels": list(self.labels), "label_counts": self.label_counts,
                "stale": self.stale, "rejected": self.rejected}


def _stale(records: list[RequestRecord], kind) -> int:
    """Records of an older kind that started after a newer kind's first answer had arrived."""
    first_done: dict = {}
    for record in records:
        done = record.started_at + record.latency_s
        first_done[kind(record)] = min(first_done.get(kind(record), done), done)
    rank = {k: i for i, k in enumerate(sorted(first_done, key=first_done.get))}
    return sum(1 for r in records
               if any(rank[k] > rank[kind(r)] and first_done[k] < r.started_at for k in first_done))


def _runs(values: list) -> tuple:
    collapsed: list = []
    for value in values:
        if not collapsed or collapsed[-1] != value:
            collapsed.append(value)
    return tuple(collapsed)


class BackgroundLoad:
    """Several clients sending continuously until the ``with`` block ends. See the module docstring."""

    def __init__(self, url: str, model: str, *, clients: int = 4, protocol: str = "http",
                 workload: Workload | None = None, version: int | None = None, check: Check | None = None,
                 keep_outputs: bool = False, interval_s: float = 0.0, timeout_s: float = 30.0,
                 grpc_url: str | None = None) -> None:
        self.url, self.model, self.clients, self.protocol = url, model, clients, protocol
        self.send_url = grpc_url if protocol == "grpc" and grpc_url else url
        self.workload, self.version, self.check = workload, version, check
        self.keep_outputs, self.interval_s, self.timeout_s = keep_outputs, interval_s, timeout_s
        self._records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    # ----------------------------------------------------------------------------------- results
    @property
    def records(self) -> list[RequestRecord]:
        """Every finished request so far, in start order."""
        with self._lock:
            return sorted(self._records, key=lambda r: r.started_at)

    def count(self) -> int:
        with self._lock:
            return len(self._records)

    def wait_for(self, requests: int, timeout_s: float = 30.0) -> None:
        """Block until ``requests`` requests have finished (ok or not); ServerError on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.count() < requests:
            if self._failure is not None:
                raise ServerError(f"background load on {self.model} stopped: {error_text(self._failure)}")
            if time.monotonic() > deadline:
                raise ServerError(f"background load on {self.model}: only {self.count()} of {requests} "
                                  f"requests finished in {timeout_s:g} s", url=self.url)
            time.sleep(0.01)

    def summary(self) -> BackgroundSummary:
        records = self.records
        errors: dict[str, int] = {}
        labels: dict[str, int] = {}
        for record in records:
            if record.error:
                errors[record.error] = errors.get(record.error, 0) + 1
            if record.label is not None:
                labels[record.label] = labels.get(record.label, 0) + 1
        ok = [r for r in records if r.ok]
        return BackgroundSummary(
            requests=len(records), failed=sum(not r.ok for r in records),
            errors=tuple(sorted(errors, key=errors.get, reverse=True)),
            versions=_runs([r.model_version for r in ok]),
            labels=_runs([r.label for r in ok]) if self.check else (), label_counts=labels,
            stale=_stale(ok, (lambda r: r.label) if self.check else (lambda r: r.model_version)),
            rejected=sum(r.rejected for r in records))

    # ------------------------------------------------------------------------------------ control
    def __enter__(self) -> BackgroundLoad:
        if self.workload is None:
            with TritonClient(self.url) as client:
                self.workload = Workload.from_config(client.model_config(self.model, self.version))
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), name=f"trm-load-{self.model}",
                                        daemon=True)
        self._thread.start()
        started.wait(10.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending; wait for the requests in flight to finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5.0)
            self._thread = None

    def _main(self, started: threading.Event) -> None:
        try:
            asyncio.run(self._clients(started))
        except BaseException as exc:  # noqa: BLE001 - surfaced through wait_for
            self._failure = exc
        finally:
            started.set()

    async def _clients(self, started: threading.Event) -> None:
        assert self.workload is not None
        sender = AsyncTriton(self.protocol, self.send_url, self.model, self.workload, version=self.version,
                             max_connections=self.clients + 2, timeout_s=self.timeout_s,
                             keep_outputs=self.keep_outputs or self.check is not None)
        try:
            started.set()
            await asyncio.gather(*(self._client(sender, i) for i in range(self.clients)))
        finally:
            await sender.close()

    async def _client(self, sender: AsyncTriton, index: int) -> None:
        while not self._stop.is_set():
            wall, t0 = time.time(), time.perf_counter()
            try:
                version, outputs = await sender.infer()
                record = RequestRecord(wall, time.perf_counter() - t0, True, None, version,
                                       self._label(outputs), outputs if self.keep_outputs else None, index)
            except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
                record = RequestRecord(wall, time.perf_counter() - t0, False, error_text(exc), None, client=index,
                                       rejected=is_rejection(exc))
            with self._lock:
                self._records.append(record)
            if self.interval_s:
                await asyncio.sleep(self.interval_s)

    def _label(self, outputs: dict[str, np.ndarray] | None) -> str | None:
        if self.check is None or outputs is None:
            return None
        try:
            return str(self.check(outputs))
        except Exception as exc:  # noqa: BLE001 - a broken check is recorded, never silently dropped
            return f"check failed: {error_text(exc)}"
