"""`trm top`: per model and version, what one or more Triton servers are doing, from their own metrics.

Triton's Prometheus endpoint (``/metrics``, port 8002 by default) has cumulative counters per model and
version (requests, failures by reason, executions, inferences, queue and compute time) and a gauge of
pending requests; with ``--metrics-config=summary_latencies=true`` (trm's launcher sets it) also latency
summaries with p50/p99. Rates and means per request need two scrapes: a ``View`` is the difference
between two ``Scrape`` s of each server. Where the server's HTTP API is known too, its statistics add
the histogram of executed batch sizes over the same interval.

LLM models (trm's vLLM backend) report the engine's own ``vllm:*`` families through Triton's custom
metrics, on the same endpoint and with the same ``model``/``version`` labels: for them a second table shows
running and waiting requests and KV-cache use (gauges), output tokens/s (the generation-token counter
between two scrapes) and TTFT/ITL p50/p99 (from the histograms' buckets between two scrapes, interpolated
within a bucket as Prometheus' ``histogram_quantile`` does). Triton's own durations say nothing there: a
decoupled model's execute() returns at once.

``trm agent`` sidecars (``--agent URL``) are read from their ``/status``: one line per pod with its state,
served vs wanted versions, the pointer's age and the last rollout.
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from repo_manager.core import documents
from repo_manager.core.errors import IntegrityError, ServerError
from repo_manager.core.redact import printable

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
COUNTERS = {"nv_inference_request_success": "success", "nv_inference_count": "inferences",
            "nv_inference_exec_count": "executions", "nv_inference_request_duration_us": "request_us",
            "nv_inference_queue_duration_us": "queue_us", "nv_inference_compute_input_duration_us": "compute_us",
            "nv_inference_compute_infer_duration_us": "compute_us", "nv_inference_compute_output_duration_us":
            "compute_us"}
LLM_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
              "vllm:kv_cache_usage_perc": "kv_cache"}
LLM_COUNTERS = {"vllm:generation_tokens_total": "generation_tokens", "vllm:prompt_tokens_total": "prompt_tokens"}
LLM_HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft", "vllm:time_per_output_token_seconds": "itl"}
MAX_METRICS_BYTES = 64 * 1024 * 1024
"""Read at most this much of a /metrics answer (Triton's is about 1 KB per model and version)."""
Key = tuple[str, str]
"""(model, version)."""
TEMPORARY_PREFIX = "trm-verify-"
"""Models trm loads for a moment to check a version (publish.verify.temporary_names): not shown."""


@dataclass(frozen=True)
class Server:
    """A server to watch: its metrics URL and, if known, its HTTP API (for batch-size statistics)."""

    metrics_url: str
    http_url: str | None = None

    @classmethod
    def parse(cls, text: str, metrics_port: int = 8002) -> Server:
        """``http://host:8000`` (metrics on ``metrics_port`` of the same host) or a URL ending in /metrics."""
        url = text if "://" in text else f"http://{text}"
        parsed = urllib.parse.urlsplit(url)
        if parsed.path.rstrip("/").endswith("/metrics"):
            return cls(url)
        return cls(f"{parsed.scheme}://{parsed.hostname}:{metrics_port}/metrics", url.rstrip("/"))


@dataclass(frozen=True)
class Scrape:
    server: Server
    at: float
    counters: dict[Key, dict[str, float]]
    pending: dict[Key, float]
    quantiles: dict[Key, dict[str, float]]
    """p50/p99 of the whole request (ms) from Triton's summary; empty when summaries are off."""
    batches: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per model: executed batch size -> executions (cumulative), from the statistics API."""
    llm: dict[Key, LlmSample] = field(default_factory=dict)
    """Models that report the ``vllm:*`` families (LLM models): their values at this scrape."""


@dataclass(frozen=True)
class LlmSample:
    """One scrape of an LLM model's ``vllm:*`` series: gauges, counters, histogram buckets (cumulative)."""

    gauges: dict[str, float]
    counters: dict[str, float]
    buckets: dict[str, dict[float, float]]
    """``ttft``/``itl`` -> upper bound in seconds (``inf`` for +Inf) -> observations at or below it."""


def parse_llm(text: str) -> dict[Key, LlmSample]:
    """The ``vllm:*`` series of a /metrics text, per (model, version), the series of its engines together
    (trm's backend labels each engine's own series with ``engine``); models without them are absent."""
    found: dict[Key, LlmSample] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = LINE.match(line)
        if not match:
            continue
        name, labels_text, value_text = match.groups()
        labels = dict(LABEL.findall(labels_text or ""))
        if "model" not in labels:
            continue
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        key = (labels["model"], labels.get("version", ""))
        sample = found.setdefault(key, LlmSample({}, {}, {}))
        base = name.removesuffix("_bucket")
        if name in LLM_GAUGES:
            gauge = LLM_GAUGES[name]
            sample.gauges[gauge] = _merge_engines(gauge, sample.gauges.get(gauge), value)
        elif name in LLM_COUNTERS:
            sample.counters[LLM_COUNTERS[name]] = sample.counters.get(LLM_COUNTERS[name], 0.0) + value
        elif name.endswith("_bucket") and base in LLM_HISTOGRAMS and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError:
                continue
            into = sample.buckets.setdefault(LLM_HISTOGRAMS[base], {})
            into[bound] = into.get(bound, 0.0) + value
    return found


def _merge_engines(gauge: str, before: float | None, value: float) -> float:
    """One gauge of two engines of one version (a reload, two instances): requests add up; of the KV caches, the
    fuller one is the one that stops admitting."""
    if before is None:
        return value
    return max(before, value) if gauge == "kv_cache" else before + value


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile of cumulative histogram ``buckets`` (upper bound -> count), as Prometheus'
    ``histogram_quantile`` estimates it: linear within the bucket the rank falls in; the highest finite
    bound when it falls in +Inf. None without observations."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def parse_metrics(text: str) -> tuple[dict[Key, dict[str, float]], dict[Key, float], dict[Key, dict[str, float]]]:
    counters: dict[Key, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    pending: dict[Key, float] = {}
    quantiles: dict[Key, dict[str, float]] = defaultdict(dict)
    for line in text.splitlines():
        match = LINE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels_text, value_text = match.groups()
        labels = dict(LABEL.findall(labels_text or ""))
        if "model" not in labels:
            continue
        key = (labels["model"], labels.get("version", ""))
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value):  # a summary with no observations yet says NaN: no figure, not a number
            continue
        if name in COUNTERS:
            counters[key][COUNTERS[name]] += value
        elif name == "nv_inference_request_failure":
            counters[key]["rejected" if labels.get("reason") == "REJECTED" else "failed"] += value
        elif name == "nv_inference_pending_request_count":
            pending[key] = value
        elif name == "nv_inference_request_summary_us" and labels.get("quantile") in ("0.5", "0.99"):
            quantiles[key]["p50" if labels["quantile"] == "0.5" else "p99"] = value / 1000.0
    return ({k: dict(v) for k, v in counters.items()}, pending, {k: v for k, v in quantiles.items()})


def scrape(server: Server, timeout_s: float = 3.0) -> Scrape:
    """One read of a server's metrics (and statistics). ServerError when metrics are off or unreachable."""
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=timeout_s) as response:
            text = response.read(MAX_METRICS_BYTES).decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{server.http_url or server.metrics_url}: no metrics at {server.metrics_url} "
                          f"(metrics disabled, or not reachable: {getattr(exc, 'reason', exc)})",
                          hint="start tritonserver with --allow-metrics=true (and --metrics-port), or pass "
                               "the metrics URL", url=server.metrics_url) from exc
    at = time.monotonic()
    counters, pending, quantiles = parse_metrics(text)
    return Scrape(server, at, counters, pending, quantiles, _batches(server, timeout_s), parse_llm(text))


def _batches(server: Server, timeout_s: float) -> dict[str, dict[int, int]]:
    if not server.http_url:
        return {}
    from repo_manager.adapters.loadgen.stats import StatsSnapshot  # noqa: PLC0415 - tritonclient only when asked
    from repo_manager.adapters.triton.client import TritonClient  # noqa: PLC0415 - tritonclient only when asked

    try:
        with TritonClient(server.http_url, timeout_s=timeout_s) as client:
            entries = client.statistics()
    except Exception:  # noqa: BLE001 - statistics are an extra; metrics alone still make the view
        return {}
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in entries:
        by_model[entry.get("name", "")].append(entry)
    return {name: StatsSnapshot.parse(items).batch_count for name, items in by_model.items()}


@dataclass(frozen=True)
class Row:
    server: str
    model: str
    version: str
    rate_rps: float
    p50_ms: float | None
    p99_ms: float | None
    queue_ms: float | None
    """Mean queue time per request over the interval."""
    compute_ms: float | None
    pending: float
    mean_batch: float | None
    batch_sizes: dict[int, int]
    failed_rps: float
    rejected_rps: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class LlmRow:
    """One LLM model and version over the interval: the engine's queue, KV cache, token rate and latencies."""

    server: str
    model: str
    version: str
    running: float | None
    waiting: float | None
    kv_cache_pct: float | None
    """KV-cache use in percent (the engine's gauge says 1 for 100 %)."""
    output_tokens_s: float
    """Generated tokens per second between the two scrapes."""
    prompt_tokens_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    """None: no request got its first token (TTFT) or a second one (ITL) in the interval."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def llm_between(before: Scrape, after: Scrape) -> list[LlmRow]:
    """The LLM rows of the interval between two scrapes of one server."""
    dt = max(after.at - before.at, 1e-6)
    rows = []
    for key in sorted(after.llm):
        if key[0].startswith(TEMPORARY_PREFIX):
            continue
        now, then = after.llm[key], before.llm.get(key, LlmSample({}, {}, {}))

        def rate(name: str, now: LlmSample = now, then: LlmSample = then) -> float:
            return round(max(now.counters.get(name, 0.0) - then.counters.get(name, 0.0), 0.0) / dt, 1)

        def quantile(q: float, name: str, now: LlmSample = now, then: LlmSample = then) -> float | None:
            old = then.buckets.get(name, {})
            delta = {b: max(c - old.get(b, 0.0), 0.0) for b, c in now.buckets.get(name, {}).items()}
            value = bucket_quantile(q, delta)
            return None if value is None else round(value * 1000, 1)

        kv = now.gauges.get("kv_cache")
        rows.append(LlmRow(
            server=after.server.http_url or after.server.metrics_url, model=key[0], version=key[1],
            running=now.gauges.get("running"), waiting=now.gauges.get("waiting"),
            kv_cache_pct=None if kv is None else round(kv * 100, 1),
            output_tokens_s=rate("generation_tokens"), prompt_tokens_s=rate("prompt_tokens"),
            ttft_p50_ms=quantile(0.5, "ttft"), ttft_p99_ms=quantile(0.99, "ttft"),
            itl_p50_ms=quantile(0.5, "itl"), itl_p99_ms=quantile(0.99, "itl")))
    return rows


@dataclass(frozen=True)
class AgentRow:
    """One ``trm agent``, from its ``/status``."""

    url: str
    pod: str
    env: str
    state: str
    ready: bool
    served: dict[str, int | None]
    wanted: dict[str, int]
    pointer_age_s: float | None
    last_rollout: str | None
    """``done 2.1s``, ``refused: reason`` ..."""
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


MAX_STATUS_BYTES = 4 * 1024 * 1024
"""An agent's /status is a few KB (tens of models); more is not an agent answering."""
MAX_FIELD = 200
"""Longest text shown from an agent's /status field."""


def read_agent(url: str, timeout_s: float = 3.0) -> AgentRow:
    """One read of an agent's ``/status`` (``http://pod:8090``). ServerError when it does not answer, or
    answers with something other than an agent's status (read bounded, every field used checked for its type)."""
    base = (url if "://" in url else f"http://{url}").rstrip("/").removesuffix("/status")
    try:
        with urllib.request.urlopen(base + "/status", timeout=timeout_s) as response:
            payload = response.read(MAX_STATUS_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerError(f"{base}: no agent status at {base}/status ({getattr(exc, 'reason', exc)})",
                          hint="pass the agent's --listen address", url=base) from exc
    try:
        return agent_row(base, documents.parse(payload, f"{base}/status", limit=MAX_STATUS_BYTES))
    except IntegrityError as exc:
        raise ServerError(f"{base}: not an agent status ({exc.message})",
                          hint="pass the --listen address of a `trm agent`", url=base) from exc


def agent_row(base: str, status: Any) -> AgentRow:
    """The row of one agent from its parsed ``/status``; IntegrityError naming the first field of the wrong
    type (an agent of another trm version may add fields: those are left alone)."""
    def bad(where: str, wanted: str) -> IntegrityError:
        return IntegrityError(f"{where} is not {wanted}")

    def text(value: Any, where: str, default: str = "-") -> str:
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad(where, "a text")
        return value[:MAX_FIELD]

    def seconds(value: Any, where: str) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise bad(where, "a number of seconds")
        return float(value)

    def versions(value: Any, where: str, *, optional: bool) -> dict[str, int | None]:
        if value is None:
            return {}
        if not isinstance(value, dict) or len(value) > 10_000:
            raise bad(where, "a mapping of model -> version")
        for model, version in value.items():
            if not (version is None and optional) and (isinstance(version, bool) or not isinstance(version, int)):
                raise bad(f"{where}[{model[:40]!r}]", "a version number")
        return {model[:MAX_FIELD]: version for model, version in value.items()}

    if not isinstance(status, dict):
        raise bad("the document", "a mapping")
    ready = status.get("ready", False)
    if not isinstance(ready, bool):
        raise bad("ready", "true or false")
    pointer, last = status.get("pointer") or {}, status.get("last_rollout") or None
    if not isinstance(pointer, dict):
        raise bad("pointer", "a mapping")
    summary = None
    if last is not None:
        if not isinstance(last, dict):
            raise bad("last_rollout", "a mapping")
        took = seconds(last.get("seconds"), "last_rollout.seconds")
        reason = text(last.get("reason"), "last_rollout.reason", "")
        summary = " ".join(x for x in (text(last.get("outcome"), "last_rollout.outcome", "?"),
                                       f"{took:.1f}s" if took is not None else "")) + (f": {reason}" if reason else "")
    return AgentRow(base, text(status.get("pod"), "pod"), text(status.get("env"), "env"),
                    text(status.get("state"), "state"), ready,
                    versions(status.get("served"), "served", optional=True),
                    versions(status.get("wanted"), "wanted", optional=False),  # type: ignore[arg-type]
                    seconds(pointer.get("age_s"), "pointer.age_s"), summary,
                    text(status.get("reason"), "reason", "") or None)


@dataclass(frozen=True)
class View:
    rows: tuple[Row, ...]
    interval_s: float
    problems: tuple[str, ...]
    """One line per server (or agent) that could not be read (metrics disabled or unreachable)."""
    summaries_off: tuple[str, ...] = ()
    agents: tuple[AgentRow, ...] = ()
    llm: tuple[LlmRow, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"interval_s": round(self.interval_s, 3), "rows": [r.to_dict() for r in self.rows],
                "llm": [r.to_dict() for r in self.llm],
                "agents": [a.to_dict() for a in self.agents],
                "problems": list(self.problems), "summaries_off": list(self.summaries_off)}


def between(before: Scrape, after: Scrape) -> list[Row]:
    dt = max(after.at - before.at, 1e-6)
    rows = []
    for key in sorted(after.counters):
        if key[0].startswith(TEMPORARY_PREFIX):  # a version trm loads for a moment to verify it
            continue
        now, then = after.counters[key], before.counters.get(key, {})

        def delta(name: str, now: dict = now, then: dict = then) -> float:
            return max(now.get(name, 0.0) - then.get(name, 0.0), 0.0)

        success, executions = delta("success"), delta("executions")
        model = key[0]
        sizes = {size: count - before.batches.get(model, {}).get(size, 0)
                 for size, count in after.batches.get(model, {}).items()}
        quant = after.quantiles.get(key, {})
        rows.append(Row(
            server=after.server.http_url or after.server.metrics_url, model=model, version=key[1],
            rate_rps=round(success / dt, 1), p50_ms=_round(quant.get("p50")), p99_ms=_round(quant.get("p99")),
            queue_ms=round(delta("queue_us") / success / 1000, 2) if success else None,
            compute_ms=round(delta("compute_us") / success / 1000, 2) if success else None,
            pending=after.pending.get(key, 0.0),
            mean_batch=round(delta("inferences") / executions, 2) if executions else None,
            batch_sizes={s: c for s, c in sorted(sizes.items()) if c > 0},
            failed_rps=round(delta("failed") / dt, 2), rejected_rps=round(delta("rejected") / dt, 2)))
    return rows


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 2)


class Watcher:
    """Keeps the last scrape of every server; ``view()`` scrapes again and returns the difference."""

    def __init__(self, servers: list[Server], agents: list[str] | None = None) -> None:
        self.servers = servers
        self.agents = agents or []
        self.last: dict[str, Scrape] = {}

    @property
    def targets(self) -> int:
        return len(self.servers) + len(self.agents)

    def view(self) -> View:
        rows: list[Row] = []
        llm: list[LlmRow] = []
        problems: list[str] = []
        off: list[str] = []
        interval = 0.0
        for server in self.servers:
            try:
                current = scrape(server)
            except ServerError as exc:
                problems.append(exc.message)
                self.last.pop(server.metrics_url, None)
                continue
            previous = self.last.get(server.metrics_url)
            self.last[server.metrics_url] = current
            if previous is None:
                continue
            interval = current.at - previous.at
            rows += between(previous, current)
            llm += llm_between(previous, current)
            if current.counters and not current.quantiles:
                off.append(server.http_url or server.metrics_url)
        agents = []
        for url in self.agents:
            try:
                agents.append(read_agent(url))
            except ServerError as exc:
                problems.append(exc.message)
        return View(tuple(rows), interval, tuple(problems), tuple(off), tuple(agents), tuple(llm))


def snapshot(servers: list[Server], interval_s: float = 1.0, agents: list[str] | None = None) -> View:
    """Two scrapes ``interval_s`` apart: one view (``trm top --json``)."""
    watcher = Watcher(servers, agents)
    first = watcher.view()
    if len(first.problems) == watcher.targets:
        raise ServerError("; ".join(first.problems))
    if not servers:
        return first  # agents only: their status needs no second read
    time.sleep(interval_s)
    return watcher.view()


def _versions(versions: dict[str, Any]) -> str:
    return " ".join(f"{m}:{'-' if v is None else v}" for m, v in sorted(versions.items())) or "-"


def _fit(value: Any, width: int) -> str:
    """``value`` as printable text (escape sequences from a metric label or an agent's field shown, never
    sent to the terminal), cut to ``width``."""
    return printable(str(value))[:width]


def render(view: View) -> str:
    """Plain text table (one line per server, model and version); every value is made printable."""
    head = (f"{'server':<24} {'model':<18} {'ver':>3} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'queue ms':>8} "
            f"{'compute':>8} {'pending':>7} {'batch':>5} {'rej/s':>6} {'fail/s':>6}  batch sizes")
    lines = [head]

    def cell(value: float | None, width: int, fmt: str = ".1f") -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    for r in view.rows:
        sizes = " ".join(f"{s}:{c}" for s, c in r.batch_sizes.items())
        server = _fit(r.server.split("://")[-1], 24)
        lines.append(f"{server:<24} {_fit(r.model, 18):<18} {_fit(r.version, 8):>3} {r.rate_rps:>7.1f} "
                     f"{cell(r.p50_ms, 7)} {cell(r.p99_ms, 7)} {cell(r.queue_ms, 8, '.2f')} "
                     f"{cell(r.compute_ms, 8, '.2f')} {r.pending:>7.0f} {cell(r.mean_batch, 5)} "
                     f"{r.rejected_rps:>6.1f} {r.failed_rps:>6.1f}  {sizes}")
    if not view.rows and view.agents:
        lines = []
    if view.llm:
        lines.append(f"{'server':<24} {'LLM model':<18} {'ver':>3} {'running':>7} {'waiting':>7} {'KV %':>5} "
                     f"{'out tok/s':>9} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>7} {'ITL p99':>7}  (ms)")
    for r in view.llm:
        lines.append(f"{_fit(r.server.split('://')[-1], 24):<24} {_fit(r.model, 18):<18} {_fit(r.version, 8):>3} "
                     f"{cell(r.running, 7, '.0f')} {cell(r.waiting, 7, '.0f')} {cell(r.kv_cache_pct, 5)} "
                     f"{r.output_tokens_s:>9.1f} {cell(r.ttft_p50_ms, 8)} {cell(r.ttft_p99_ms, 8)} "
                     f"{cell(r.itl_p50_ms, 7)} {cell(r.itl_p99_ms, 7)}")
    if view.agents:
        lines.append(f"{'agent':<24} {'env':<12} {'state':<16} {'served':<20} {'wanted':<20} {'pointer':>7}  "
                     "last rollout")
    for a in view.agents:
        age = "-" if a.pointer_age_s is None else f"{a.pointer_age_s:.0f}s"
        state = a.state + ("" if a.ready else " (unready)")
        lines.append(f"{_fit(a.pod, 24):<24} {_fit(a.env, 12):<12} {_fit(state, 16):<16} "
                     f"{_fit(_versions(a.served), 20):<20} {_fit(_versions(a.wanted), 20):<20} {age:>7}  "
                     f"{_fit(a.last_rollout or '-', 200)}")
    lines += [_fit(p, 2000) for p in view.problems]
    lines += [f"{_fit(s, 200)}: no latency summaries (start tritonserver with --metrics-config=summary_latencies=true)"
              for s in view.summaries_off]
    return "\n".join(lines)
