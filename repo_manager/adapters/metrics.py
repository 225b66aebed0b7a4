"""trm's own operation metrics, in Prometheus' vocabulary, for processes that live long enough to be scraped.

A long-running trm process (``trm serve``, the agent) calls ``start_exporter(port)`` once; everything it
does inside ``operation("sync")`` blocks is then counted and timed::

    from repo_manager.adapters import metrics

    exporter = metrics.start_exporter(9400)          # http://host:9400/metrics
    with metrics.operation("sync", model="minilm"):  # outcome "ok", or the TrmError's kind, or "internal"
        ...
    with metrics.operation("pointer_read") as op:    # a success with a finer outcome
        op.outcome = "unchanged"
    metrics.count_sync(downloaded=1234, reused=0)
    metrics.set_serving({"minilm": 3})               # which versions this process serves
    exporter.stop()

A process with its own HTTP endpoint (the agent) renders the same series with ``exposition()``, adding its
own collectors.

Series (the same names whichever process exports them):

* ``trm_operations_total{operation, model, outcome}``: finished operations;
* ``trm_operation_seconds{operation, model, outcome}``: their durations (histogram);
* ``trm_operation_last_success_timestamp_seconds{operation, model}``: when one last succeeded (alert on
  "no successful sync for 10 minutes");
* ``trm_sync_bytes_total{source}``: blob bytes synced into a node repository, ``downloaded`` from the store
  or reused from the node ``cache``;
* ``trm_serving_version{model}``: the version this process made its server serve;
* ``trm_model_load_duration_seconds{model, version}``: how long the last load of that version took on the
  server, from the load request to its answer (Triton answers once the version is ready; it exports no load
  time of its own). A rollout's load of a new version and ``trm serve``'s loads record it; the series of the
  two versions of a model loaded last are kept (the new one and the one it replaced);
* ``trm_build_info{version}``: 1, with trm's version.

Short-lived commands (publish, promote from CI) record into the same registry, which nobody scrapes: it
costs microseconds and keeps one code path; their outcomes are in the manifest and the promotion history.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.registry import Collector

from repo_manager.core.errors import ServerError, TrmError

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
MODEL_LOAD = Gauge("trm_model_load_duration_seconds", "Seconds the last load of each model version took on the "
                   "server (load request to ready)", ["model", "version"], registry=REGISTRY)
LOAD_SERIES_PER_MODEL = 2
"""Versions of one model whose load duration is kept (the new one and the one it replaced)."""
_LOADED: dict[str, list[str]] = {}
_LOAD_LOCK = threading.Lock()
SYNC_BYTES = Counter("trm_sync_bytes", "Blob bytes synced into the node repository, by source (downloaded "
                     "from the store, reused from the node cache)", ["source"], registry=REGISTRY)
BUILD = Gauge("trm_build_info", "trm's version", ["version"], registry=REGISTRY)


@functools.cache
def _version() -> str:
    try:
        return metadata.version("trm")
    except Exception:  # noqa: BLE001 - an uninstalled checkout still exports
        return "unknown"


@dataclass
class Operation:
    """The block's handle: a block that returns may name a finer success (``unchanged``, ``rolled_back``)."""

    outcome: str = "ok"


@contextmanager
def operation(name: str, model: str = "") -> Iterator[Operation]:
    """Count and time the block: outcome ``ok`` (or what the block set), the ``TrmError`` kind it raised, or
    ``internal``. A block that returns is a success (its last-success time moves), whatever outcome it set."""
    started = time.monotonic()
    op = Operation()
    failed = True
    try:
        yield op
        failed = False
    except TrmError as exc:
        op.outcome = exc.kind
        raise
    except BaseException:  # recorded and re-raised: a crash (or a signal's exit) counts as ``internal``
        op.outcome = "internal"
        raise
    finally:
        OPERATIONS.labels(name, model, op.outcome).inc()
        DURATION.labels(name, model, op.outcome).observe(time.monotonic() - started)
        if not failed:
            LAST_SUCCESS.labels(name, model).set(time.time())


def count_sync(downloaded: int, reused: int) -> None:
    """Blob bytes one sync moved: ``downloaded`` from the store, ``reused`` from the node cache."""
    SYNC_BYTES.labels("downloaded").inc(downloaded)
    SYNC_BYTES.labels("cache").inc(reused)


def set_serving(models: dict[str, int]) -> None:
    """The versions served now (models no longer served are dropped)."""
    SERVING.clear()
    for model, version in models.items():
        SERVING.labels(model).set(version)


def record_load(model: str, version: int, seconds: float) -> None:
    """The last load of ``model`` ``version`` took ``seconds``; older versions' series beyond the
    ``LOAD_SERIES_PER_MODEL`` loaded last are dropped."""
    with _LOAD_LOCK:
        versions = [v for v in _LOADED.get(model, []) if v != str(version)] + [str(version)]
        for old in versions[:-LOAD_SERIES_PER_MODEL]:
            MODEL_LOAD.remove(model, old)
        _LOADED[model] = versions[-LOAD_SERIES_PER_MODEL:]
        MODEL_LOAD.labels(model, str(version)).set(round(seconds, 3))


@contextmanager
def timed_load(model: str, version: int) -> Iterator[None]:
    """Time the block (one load of ``model`` ``version``) into ``trm_model_load_duration_seconds`` when it
    returns; a load that raised records nothing."""
    started = time.monotonic()
    yield
    record_load(model, version, time.monotonic() - started)


CONTENT_TYPE = CONTENT_TYPE_LATEST


def exposition(*collectors: Collector) -> bytes:
    """One scrape's text: trm's registry, then ``collectors`` (families of their own names)."""
    BUILD.labels(_version()).set(1)
    extra = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        extra.register(collector)
    return generate_latest(REGISTRY) + generate_latest(extra)


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
