"""trm's own operation metrics, in Prometheus' vocabulary, for processes that live long enough to be scraped.

A long-running trm process (``trm serve``, the agent) calls ``start_exporter(port)`` once; everything it
does inside ``operation("sync")`` blocks is then counted and timed::

    from repo_manager import metrics

    exporter = metrics.start_exporter(9400)          # http://host:9400/metrics
    with metrics.operation("sync", model="minilm"):  # outcome "ok", or the TrmError's kind, or "internal"
        ...
    metrics.set_serving({"minilm": 3})               # which versions this process serves
    exporter.stop()

Series (the same names whichever process exports them):

* ``trm_operations_total{operation, model, outcome}``: finished operations;
* ``trm_operation_seconds{operation, model, outcome}``: their durations (histogram);
* ``trm_operation_last_success_timestamp_seconds{operation, model}``: when one last succeeded (alert on
  "no successful sync for 10 minutes");
* ``trm_serving_version{model}``: the version this process made its server serve;
* ``trm_build_info{version}``: 1, with trm's version.

Short-lived commands (publish, promote from CI) record into the same registry, which nobody scrapes: it
costs microseconds and keeps one code path; their outcomes are in the manifest and the promotion history.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from repo_manager.errors import ServerError, TrmError

REGISTRY = CollectorRegistry(auto_describe=True)
"""trm's own registry: no Python process/GC collectors, only what trm does."""

OPERATIONS = Counter("trm_operations", "trm operations finished, by outcome", ["operation", "model", "outcome"],
                     registry=REGISTRY)
DURATION = Histogram("trm_operation_seconds", "Duration of trm operations", ["operation", "model", "outcome"],
                     buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=REGISTRY)
LAST_SUCCESS = Gauge("trm_operation_last_success_timestamp_seconds", "When an operation last succeeded",
                     ["operation", "model"], registry=REGISTRY)
SERVING = Gauge("trm_serving_version", "Version of each model this process makes its server serve", ["model"],
                registry=REGISTRY)
BUILD = Gauge("trm_build_info", "trm's version", ["version"], registry=REGISTRY)


def _version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("trm")
    except Exception:  # noqa: BLE001 - an uninstalled checkout still exports
        return "unknown"


@contextmanager
def operation(name: str, model: str = "") -> Iterator[None]:
    """Count and time the block: outcome ``ok``, the ``TrmError`` kind it raised, or ``internal``."""
    started = time.monotonic()
    outcome = "ok"
    try:
        yield
    except TrmError as exc:
        outcome = exc.kind
        raise
    except BaseException:
        outcome = "internal"
        raise
    finally:
        OPERATIONS.labels(name, model, outcome).inc()
        DURATION.labels(name, model, outcome).observe(time.monotonic() - started)
        if outcome == "ok":
            LAST_SUCCESS.labels(name, model).set(time.time())


def set_serving(models: dict[str, int]) -> None:
    """The versions served now (models no longer served are dropped)."""
    SERVING.clear()
    for model, version in models.items():
        SERVING.labels(model).set(version)


@dataclass
class Exporter:
    address: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_exporter(port: int, address: str = "0.0.0.0") -> Exporter:
    """Serve ``REGISTRY`` on ``http://address:port/metrics`` from a daemon thread (0: a free port)."""
    BUILD.labels(_version()).set(1)
    try:
        server, thread = start_http_server(port, address, registry=REGISTRY)
    except OSError as exc:
        raise ServerError(f"cannot export trm's metrics on {address}:{port}: {exc.strerror or exc}",
                          hint="pass a free port with --trm-metrics-port", port=port) from exc
    return Exporter(address, int(server.server_address[1]), server, thread)
