"""`trm observe rules`: Prometheus alerting rules and a Grafana dashboard for the models an environment serves.

Per model (thresholds from the version's tuning record where it has one):

* ``TrmQueueBacklog``: queued requests per replica (Triton server) above ``queue_per_replica`` (default 1)
  for ``queue_for``. A request that waits in the queue means the servers are busier than they can serve:
  queues grow first and p99 follows once they do, so this fires before the latency alert, while adding
  replicas still helps;
* ``TrmLatencyAboveSLO``: p99 (Triton's ``nv_inference_request_summary_us``) above the SLO recorded by
  ``trm tune-batching`` for ``samples`` evaluations in a row;
* ``TrmRequestsRejected``: the share of requests the queue policy sheds above ``max_rejected``;
* ``TrmInferenceFailures``: failures other than rejections;
* ``TrmModelNotReady``: a scraped server that is up but does not serve the model;
* ``TrmVersionsDiffer``: more than one version answering across the fleet for ``versions_for`` (longer
  than a rollout takes); with an environment, ``TrmVersionNotInEnv``: a server answering with a version
  other than the environment's.

For LLM models (decoupled models such as trm's vLLM backend, whose engine reports the ``vllm:*`` families
through Triton's custom metrics; Triton's queue and durations say nothing about them):

* ``TrmLlmRequestsWaiting``: requests waiting in the engine's own queue, per replica, above
  ``waiting_per_replica`` (default 0) for ``waiting_for`` (default 30s). A running engine takes every
  request its batch and KV cache can hold; one that keeps requests waiting is full, so a request waiting
  on every replica is the signal to add one (the HPA in deploy/kubernetes/overlays/production-llm scales
  on the same series);
* ``TrmTtftAboveSLO`` and ``TrmItlAboveSLO``: p99 time to first token and inter-token latency (from the
  engine's histograms over ``rate_window``) above the SLOs of the version's tuning record
  (``slo.ttft_p99_ms``, ``slo.itl_p99_ms``) or ``--ttft-p99-ms``/``--itl-p99-ms``, for ``samples``
  evaluations in a row.

For the agents (``trm agent``; series from their /metrics, group ``trm-agents``, limited to the
environment's ``env`` label where one is named):

* ``TrmAgentDegraded``: an agent refuses the version its environment names (it keeps serving the last
  good one; ``/status`` says why);
* ``TrmAgentBehind``: a pod serves another version than its environment names for ``versions_for``;
* ``TrmAgentPointerStale``: no successful read of the environment pointer for ``pointer_stale_s`` (the
  store is unreachable: the pod keeps serving what it has, but will not follow a promotion).

The dashboard shows queue depth per replica (against the backlog threshold), the pending batch ratio
(queued requests as a share of a full batch on every instance), the utilisation slope (how fast the
instances' busy share grows) plus latency (p50/p99, queue vs compute) and executed batch size, rejections
and failures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.core.config import atomic_write_bytes
from repo_manager.core.environments import env_store
from repo_manager.core.errors import InputError, UsageError
from repo_manager.core.manifest import Manifest, read_config, read_tuning


@dataclass(frozen=True)
class Thresholds:
    queue_per_replica: float = 1.0
    queue_for: str = "1m"
    samples: int = 3
    """Consecutive evaluations p99 must stay above the SLO before the alert fires."""
    evaluation_interval_s: float = 15.0
    max_rejected: float = 0.01
    rejected_for: str = "1m"
    not_ready_for: str = "1m"
    versions_for: str = "15m"
    rate_window: str = "1m"
    selector: str = ""
    """Extra label matchers for every Triton series, e.g. ``job="triton"``."""
    pointer_stale_s: float = 600.0
    """Seconds without a successful pointer read before ``TrmAgentPointerStale``."""
    waiting_per_replica: float = 0.0
    """LLM models: requests waiting in the engine per replica above which ``TrmLlmRequestsWaiting`` fires."""
    waiting_for: str = "30s"

    def check(self) -> None:
        if not 0 <= self.waiting_per_replica < float("inf"):
            raise UsageError("need a finite --waiting-per-replica >= 0")
        if self.queue_per_replica < 0 or self.samples < 1 or not 0 <= self.max_rejected <= 1:
            raise UsageError("need --queue-per-replica >= 0, --samples >= 1 and 0 <= --max-rejected <= 1")
        if self.evaluation_interval_s <= 0 or self.pointer_stale_s <= 0:
            raise UsageError("--evaluation-interval and --pointer-stale must be positive")

        for flag, value in (("--queue-for", self.queue_for), ("--rejected-for", self.rejected_for),
                            ("--not-ready-for", self.not_ready_for), ("--versions-for", self.versions_for),
                            ("--rate-window", self.rate_window), ("--waiting-for", self.waiting_for)):
            # a Prometheus duration: 30s, 1m, 1h30m (PromQL rejects anything else when the rules load)
            if not re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", value) or not re.search(r"[1-9]", value):
                raise UsageError(f"{flag} {value!r} is not a Prometheus duration", hint="e.g. 30s, 1m, 1h30m")
        # label matchers: name op "value" pairs, nothing that closes the selector or starts another expression
        matcher = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(=~|!~|!=|=)\s*"([^"\\]|\\.)*"\s*'
        if self.selector and not re.fullmatch(f"{matcher}(,{matcher})*,?", self.selector):
            raise UsageError(f"--selector {self.selector!r} is not a list of label matchers",
                             hint='e.g. job="triton",namespace="prod"')


@dataclass(frozen=True)
class ModelWatch:
    """One model to watch: its version (where known), its SLO and its batching shape."""

    name: str
    version: int | None = None
    p99_ms: float | None = None
    """From the tuning record (or given); None: no latency rule for this model."""
    max_batch_size: int = 0
    instances: int = 1
    slo_source: str = ""
    llm: bool = False
    """A decoupled (streaming) model, such as trm's vLLM backend: watched on the engine's ``vllm:*`` series."""
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    llm_slo_source: str = ""

    @classmethod
    def from_manifest(cls, manifest: Manifest, p99_ms: float | None = None, ttft_p99_ms: float | None = None,
                      itl_p99_ms: float | None = None) -> ModelWatch:
        config = read_config(manifest)
        instances = config.instance_group[0].count if config.instance_group else 1
        # a tuning record's SLO must be a positive finite number: NaN or a negative SLO would make an alert
        # that never fires, 0 one that always does; read_tuning refuses them (IntegrityError, exit 7)
        tuned = read_tuning(manifest).p99_ms if p99_ms is None and manifest.tuning else None
        slo = p99_ms if p99_ms is not None else tuned
        source = "--p99-ms" if p99_ms is not None else ("tuning record" if tuned is not None else "")
        llm = config.backend == "vllm" or bool(config.model_transaction_policy.decoupled)
        record = read_tuning(manifest) if llm and manifest.tuning else None
        ttft = ttft_p99_ms if ttft_p99_ms is not None else (record.ttft_p99_ms if record else None)
        itl = itl_p99_ms if itl_p99_ms is not None else (record.itl_p99_ms if record else None)
        llm_source = ", ".join(
            f"{name}: {'--' + name.replace('_', '-') + '-p99-ms' if given is not None else 'tuning record'}"
            for name, given, value in (("ttft", ttft_p99_ms, ttft), ("itl", itl_p99_ms, itl)) if value is not None)
        return cls(manifest.model, manifest.version, float(slo) if slo is not None else None,
                   int(config.max_batch_size), max(int(instances), 1), source, llm,
                   float(ttft) if ttft is not None and llm else None, float(itl) if itl is not None and llm else None,
                   llm_source if llm else "")


@dataclass(frozen=True)
class RulesResult:
    env: str | None
    models: tuple[ModelWatch, ...]
    files: tuple[str, ...]
    alerts: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"env": self.env, "files": list(self.files), "alerts": list(self.alerts), "notes": list(self.notes),
                "models": [{"name": m.name, "version": m.version, "p99_slo_ms": m.p99_ms, "slo_source": m.slo_source,
                            "max_batch_size": m.max_batch_size, "instances": m.instances, "llm": m.llm,
                            "ttft_p99_slo_ms": m.ttft_p99_ms, "itl_p99_slo_ms": m.itl_p99_ms,
                            "llm_slo_source": m.llm_slo_source} for m in self.models]}


Q50, Q99 = 'quantile="0.5"', 'quantile="0.99"'
REJECTED, NOT_REJECTED = 'reason="REJECTED"', 'reason!="REJECTED"'


def _sel(model: str, t: Thresholds, extra: str = "") -> str:
    matchers = [f'model="{model}"'] + ([t.selector] if t.selector else []) + ([extra] if extra else [])
    return "{" + ",".join(matchers) + "}"


def _duration(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{int(seconds * 1000)}ms"


def model_rules(m: ModelWatch, t: Thresholds, env: str | None) -> list[dict[str, Any]]:
    s, w = (lambda extra="": _sel(m.name, t, extra)), t.rate_window
    labels = {"model": m.name, "source": "trm"}
    pending = f"nv_inference_pending_request_count{s()}"
    rules: list[dict[str, Any]] = [{
        "alert": "TrmQueueBacklog",
        "expr": f"sum by (model) ({pending}) / count by (model) (max by (model, instance) ({pending})) "
                f"> {t.queue_per_replica:g}",
        "for": t.queue_for, "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": f"{m.name}: more than {t.queue_per_replica:g} queued request(s) per replica",
                        "description": "{{ $value | printf \"%.1f\" }} requests queued per Triton server for "
                                       f"{t.queue_for}. Requests wait because the servers are busier than they "
                                       "can serve: queues grow first and p99 follows once they do, so add "
                                       "replicas now, before the latency SLO is missed."}}]
    if m.p99_ms is not None and not m.llm:  # a stream's latency is TTFT and ITL (llm_rules), not Triton's
        rules.append({
            "alert": "TrmLatencyAboveSLO",
            "expr": f"max by (model) (nv_inference_request_summary_us{s(Q99)}) / 1000 > {m.p99_ms:g}",
            "for": _duration(t.samples * t.evaluation_interval_s), "labels": {**labels, "severity": "critical"},
            "annotations": {"summary": f"{m.name}: p99 above its SLO of {m.p99_ms:g} ms",
                            "description": "p99 {{ $value | printf \"%.1f\" }} ms for "
                                           f"{t.samples} evaluations in a row (SLO: {m.slo_source})."}})
    rejected = f'sum by (model) (rate(nv_inference_request_failure{s(REJECTED)}[{w}]))'
    success = f"sum by (model) (rate(nv_inference_request_success{s()}[{w}]))"
    rules.append({
        "alert": "TrmRequestsRejected",
        "expr": f"{rejected} / clamp_min({success} + {rejected}, 1e-9) > {t.max_rejected:g}",
        "for": t.rejected_for, "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": f"{m.name}: the queue policy sheds more than {t.max_rejected:.0%} of requests",
                        "description": "{{ $value | humanizePercentage }} of requests rejected: offered load is "
                                       "above capacity; add replicas."}})
    rules.append({
        "alert": "TrmInferenceFailures",
        "expr": f'sum by (model) (rate(nv_inference_request_failure{s(NOT_REJECTED)}[{w}])) > 0',
        "for": t.rejected_for, "labels": {**labels, "severity": "critical"},
        "annotations": {"summary": f"{m.name}: requests failing (not rejections)",
                        "description": "{{ $value | printf \"%.2f\" }} failed requests/s."}})
    up = "up" + ("{" + t.selector + "}" if t.selector else "")
    serving = f"count(count by (instance) (nv_inference_request_success{s()}))"
    rules.append({
        "alert": "TrmModelNotReady",
        "expr": f'label_replace((count({up} == 1) or vector(0)) - ({serving} or vector(0)), "model", '
                f'"{m.name}", "", "") > 0',
        "for": t.not_ready_for, "labels": {**labels, "severity": "critical"},
        "annotations": {"summary": f"{m.name} is not ready on {{{{ $value }}}} server(s) that are up",
                        "description": "A scraped Triton server is up but has no loaded version of "
                                       f"{m.name}: load failed, or it was unloaded."}})
    rules.append({
        "alert": "TrmVersionsDiffer",
        "expr": f"count by (model) (count by (model, version) (nv_inference_request_success{s()})) > 1",
        "for": t.versions_for, "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": f"{m.name}: {{{{ $value }}}} versions loaded across the fleet",
                        "description": f"Longer than {t.versions_for}: a rollout stopped half way or a server "
                                       "did not converge."}})
    if env and m.version is not None:
        other = f'version!="{m.version}"'
        rules.append({
            "alert": "TrmVersionNotInEnv",
            "expr": f"count by (model) (nv_inference_request_success{s(other)}) > 0",
            "for": t.versions_for, "labels": {**labels, "severity": "warning", "env": env},
            "annotations": {"summary": f"{m.name}: a server serves a version other than {env}'s {m.version}",
                            "description": f"{env} says {m.name} version {m.version}."}})
    if m.llm:
        rules += llm_rules(m, t)
    return rules


WAITING, RUNNING, KV_CACHE = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
TTFT, ITL, TOKENS = ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                     "vllm:generation_tokens_total")


def _p99(histogram: str, selector: str, window: str) -> str:
    """p99 in ms of an engine histogram over ``window``, all replicas together."""
    return f"histogram_quantile(0.99, sum by (model, le) (rate({histogram}_bucket{selector}[{window}]))) * 1000"


def llm_rules(m: ModelWatch, t: Thresholds) -> list[dict[str, Any]]:
    """The engine's queue and the TTFT/ITL SLOs of an LLM model (series from the ``vllm:*`` families)."""
    s, w = _sel(m.name, t), t.rate_window
    labels = {"model": m.name, "source": "trm"}
    waiting = f"{WAITING}{s}"
    rules: list[dict[str, Any]] = [{
        "alert": "TrmLlmRequestsWaiting",
        "expr": f"sum by (model) ({waiting}) / count by (model) (max by (model, instance) ({waiting})) "
                f"> {t.waiting_per_replica:g}",
        "for": t.waiting_for, "labels": {**labels, "severity": "warning"},
        "annotations": {
            "summary": f"{m.name}: requests wait in the LLM engine's queue "
                       f"(more than {t.waiting_per_replica:g} per replica)",
            "description": "{{ $value | printf \"%.1f\" }} requests waiting per replica for "
                           f"{t.waiting_for}. The engine runs every request its batch and KV cache can hold; "
                           "requests that keep waiting mean every replica is full, and each waits for running "
                           "streams to finish, so time to first token grows. One request waiting per replica "
                           "is the signal to add a replica."}}]
    for alert, name, histogram, slo in (("TrmTtftAboveSLO", "time to first token", TTFT, m.ttft_p99_ms),
                                        ("TrmItlAboveSLO", "inter-token latency", ITL, m.itl_p99_ms)):
        if slo is None:
            continue
        rules.append({
            "alert": alert, "expr": f"{_p99(histogram, s, w)} > {slo:g}",
            "for": _duration(t.samples * t.evaluation_interval_s), "labels": {**labels, "severity": "critical"},
            "annotations": {"summary": f"{m.name}: {name} p99 above its SLO of {slo:g} ms",
                            "description": f"{name.capitalize()} p99 {{{{ $value | printf \"%.1f\" }}}} ms over "
                                           f"{w}, for {t.samples} evaluations in a row (SLOs: {m.llm_slo_source})."}})
    return rules


def agent_rules(t: Thresholds, env: str | None) -> list[dict[str, Any]]:
    """Rules on the agents' own series (``repo_manager.ops.agent.metrics``), one alert per pod."""
    sel = f'{{env="{env}"}}' if env else ""
    labels = {"source": "trm-agent"} | ({"env": env} if env else {})
    wanted = f"trm_agent_wanted_version{sel}"
    stale = _duration(t.pointer_stale_s)
    return [{
        "alert": "TrmAgentDegraded",
        "expr": f"trm_agent_degraded{sel} == 1",
        "for": t.not_ready_for, "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": "{{ $labels.pod }} refuses the version {{ $labels.env }} names",
                        "description": "The agent keeps serving the last good version; its /status says why "
                                       "(degraded_reason)."}}, {
        "alert": "TrmAgentBehind",
        # the served version is the agent's own trm_serving_version, from the same scrape (same instance)
        "expr": f"{wanted} unless on (instance, model) ({wanted} == on (instance, model) trm_serving_version)",
        "for": t.versions_for, "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": "{{ $labels.pod }} does not serve {{ $labels.model }} version {{ $value }}",
                        "description": f"Longer than {t.versions_for}: the pod's rollout is stuck or refused."}}, {
        "alert": "TrmAgentPointerStale",
        # the agent's pod and env come from its trm_agent_ready series in the same scrape
        "expr": f'(time() - trm_operation_last_success_timestamp_seconds{{operation="pointer_read"}} '
                f"> {t.pointer_stale_s:g}) * on (instance) group_left (env, pod) (0 * trm_agent_ready{sel} + 1)",
        "for": "1m", "labels": {**labels, "severity": "warning"},
        "annotations": {"summary": f"{{{{ $labels.pod }}}}: no pointer read for more than {stale}",
                        "description": "The agent cannot read its environment from the store: it keeps serving "
                                       "what it has and will not follow a promotion."}}]


def rule_file(models: list[ModelWatch], t: Thresholds, env: str | None) -> dict[str, Any]:
    interval = _duration(t.evaluation_interval_s)
    groups = [{"name": f"trm-{m.name}", "interval": interval, "rules": model_rules(m, t, env)} for m in models]
    return {"groups": [*groups, {"name": "trm-agents", "interval": interval, "rules": agent_rules(t, env)}]}


# ------------------------------------------------------------------------------------------ dashboard

def _panel(pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int,
           description: str = "") -> dict[str, Any]:
    return {"id": pid, "type": "timeseries", "title": title, "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(65 + i), "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(exprs)]}


def dashboard(models: list[ModelWatch], t: Thresholds, env: str | None) -> dict[str, Any]:
    sel = '{model=~"$model"' + ("," + t.selector if t.selector else "") + "}"
    w = t.rate_window

    def s(extra: str) -> str:
        return sel[:-1] + "," + extra + "}"

    pending = f"nv_inference_pending_request_count{sel}"
    batch = (f"(sum by (model) (rate(nv_inference_count{sel}[{w}])) / "
             f"sum by (model) (rate(nv_inference_exec_count{sel}[{w}])))")
    # busy time of the instances: every request of a batch is charged the batch's compute time
    busy = (f"(sum by (model) (rate(nv_inference_compute_infer_duration_us{sel}[{w}])) / 1e6 / {batch})")
    capacity = {m.name: m.max_batch_size * m.instances for m in models}
    instances = {m.name: m.instances for m in models}
    # per-model constants enter PromQL as a small vector: one label_replace(vector(k)) per model
    def constant(values: dict[str, float]) -> str:
        return " or ".join(f'label_replace(vector({v:g}), "model", "{k}", "", "")' for k, v in values.items()) \
            or "vector(1)"

    replicas = f"count by (model) (max by (model, instance) ({pending}))"
    panels = [
        _panel(1, "Queue depth per replica", [(f"sum by (model) ({pending}) / {replicas}", "{{model}}"),
                                               (f"{t.queue_per_replica:g} + 0 * sum by (model) ({pending})",
                                                "alert threshold")], "short", 0, 0,
               "Queued requests per Triton server. Above the threshold line (one per replica by default) "
               "requests wait for a busy server: queues grow before p99 does, so it is the signal to add "
               "replicas."),
        _panel(2, "Pending batch ratio", [(f"sum by (model) ({pending}) / on (model) group_left () "
                                           f"({replicas} * on (model) ({constant(capacity)}))", "{{model}}")],
               "percentunit", 12, 0, "Queued requests as a share of one full batch on every instance."),
        _panel(3, "Utilisation slope", [(f"deriv(({busy} / on (model) ({constant(instances)}))[5m:30s])",
                                         "{{model}}")], "percentunit", 0, 8,
               "Change per second of the instances' busy share: positive and steady means capacity runs out."),
        _panel(4, "Latency p50 / p99 (ms)",
               [(f"max by (model) (nv_inference_request_summary_us{s(Q50)}) / 1000", "{{model}} p50"),
                (f"max by (model) (nv_inference_request_summary_us{s(Q99)}) / 1000", "{{model}} p99")], "ms", 12, 8),
        _panel(5, "Queue vs compute time per request (ms)",
               [(f"sum by (model) (rate(nv_inference_queue_duration_us{sel}[{w}])) / "
                 f"sum by (model) (rate(nv_inference_request_success{sel}[{w}])) / 1000", "{{model}} queue"),
                (f"sum by (model) (rate(nv_inference_compute_infer_duration_us{sel}[{w}])) / "
                 f"sum by (model) (rate(nv_inference_request_success{sel}[{w}])) / 1000", "{{model}} compute")],
               "ms", 0, 16),
        _panel(6, "Executed batch size (mean)", [(batch, "{{model}}")], "short", 12, 16),
        _panel(7, "Requests, rejections, failures per second",
               [(f"sum by (model) (rate(nv_inference_request_success{sel}[{w}]))", "{{model}} answered"),
                (f"sum by (model) (rate(nv_inference_request_failure{s(REJECTED)}[{w}]))",
                 "{{model}} rejected"),
                (f"sum by (model) (rate(nv_inference_request_failure{s(NOT_REJECTED)}[{w}]))",
                 "{{model}} failed")], "reqps", 0, 24),
    ]
    llm = [m for m in models if m.llm]
    if llm:
        ls = '{model=~"' + "|".join(m.name for m in llm) + '"' + ("," + t.selector if t.selector else "") + "}"
        waiting = f"{WAITING}{ls}"

        def quantiles(histogram: str) -> list[tuple[str, str]]:
            return [(f"histogram_quantile({q}, sum by (model, le) (rate({histogram}_bucket{ls}[{w}]))) * 1000",
                     f"{{{{model}}}} p{label}") for q, label in ((0.5, "50"), (0.99, "99"))]

        panels += [
            _panel(8, "LLM requests waiting per replica",
                   [(f"sum by (model) ({waiting}) / count by (model) (max by (model, instance) ({waiting}))",
                     "{{model}} waiting"),
                    (f"sum by (model) ({RUNNING}{ls}) / count by (model) (max by (model, instance) ({waiting}))",
                     "{{model}} running")], "short", 0, 32,
                   "Requests in the LLM engine's own queue and in its running batch, per replica. Requests "
                   "wait when the batch or the KV cache is full: waiting above the alert threshold line "
                   f"({t.waiting_per_replica:g}) for long means add replicas."),
            _panel(9, "LLM KV-cache use", [(f"max by (model, instance) ({KV_CACHE}{ls})", "{{model}} {{instance}}")],
                   "percentunit", 12, 32, "Share of the engine's KV-cache blocks in use (1 = full): near full, "
                   "new requests wait and running ones may be preempted."),
            _panel(10, "LLM output tokens per second", [(f"sum by (model) (rate({TOKENS}{ls}[{w}]))", "{{model}}")],
                   "short", 0, 40, "Tokens generated per second, all replicas together."),
            _panel(11, "LLM time to first token p50 / p99 (ms)", quantiles(TTFT), "ms", 12, 40),
            _panel(12, "LLM inter-token latency p50 / p99 (ms)", quantiles(ITL), "ms", 0, 48),
        ]
    names = [m.name for m in models]
    return {
        "title": f"trm: Triton models{' (' + env + ')' if env else ''}", "uid": f"trm-{env or 'models'}"[:40],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "tags": ["trm", "triton"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model", "type": "custom", "query": ",".join(names), "multi": True, "includeAll": True,
             "current": {"text": "All", "value": "$__all"},
             "options": [{"text": n, "value": n, "selected": False} for n in names]}]},
        "panels": panels,
    }


def write_artifacts(folder: Path, models: list[ModelWatch], t: Thresholds, env: str | None) -> RulesResult:
    t.check()
    if not models:
        raise UsageError("no models to watch", hint="name an environment that serves models, or pass --model")
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise InputError(f"--out {folder} is {'a symbolic link' if folder.is_symlink() else 'not a folder'}",
                         hint="give a real folder: trm never writes through a link")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create --out {folder}: {exc.strerror}", hint="give a writable folder") from exc
    rules = rule_file(models, t, env)
    rules_path, dash_path = folder / "trm-rules.yml", folder / "trm-dashboard.json"
    header = (f"# Prometheus alerting rules written by `trm observe rules`{' for ' + env if env else ''}.\n"
              "# Check: promtool check rules trm-rules.yml\n")
    atomic_write_bytes(rules_path, (header + yaml.safe_dump(rules, sort_keys=False, width=200)).encode())
    atomic_write_bytes(dash_path, (json.dumps(dashboard(models, t, env), indent=2) + "\n").encode())
    alerts = tuple(sorted({r["alert"] for g in rules["groups"] for r in g["rules"]}))
    notes = tuple(f"{m.name}: no p99 SLO (no tuning record; pass --p99-ms): no latency alert"
                  for m in models if m.p99_ms is None and not m.llm)
    notes += tuple(f"{m.name}: no {what} p99 SLO (no tuning record; pass --{flag}-p99-ms): no {what} alert"
                   for m in models if m.llm
                   for what, flag, slo in (("TTFT", "ttft", m.ttft_p99_ms), ("ITL", "itl", m.itl_p99_ms))
                   if slo is None)
    return RulesResult(env, tuple(models), (str(rules_path), str(dash_path)), alerts, notes)


# ------------------------------------------------------------------------------------------ sources

def watches_from_env(settings: Any, env: str, store: str | None = None, p99_ms: float | None = None,
                     only: tuple[str, ...] = (), ttft_p99_ms: float | None = None,
                     itl_p99_ms: float | None = None) -> list[ModelWatch]:
    """The models ``env`` serves, at its versions, with the SLOs of those versions' tuning records."""

    opened = open_store(env_store(settings, env, store), settings)
    pointer = opened.get_env(env)
    names = [n for n in sorted(pointer.models) if not only or n in only]
    return [ModelWatch.from_manifest(opened.get_manifest(n, pointer.models[n]), p99_ms, ttft_p99_ms, itl_p99_ms)
            for n in names]


def watches_from_repo(repository: Path, names: tuple[str, ...], p99_ms: float | None = None,
                      ttft_p99_ms: float | None = None, itl_p99_ms: float | None = None) -> list[ModelWatch]:
    """Models of the local repository (``NAME`` or ``NAME:VERSION``; default the latest version)."""

    repo = LocalRepository(repository)
    watches = []
    for item in names or tuple(repo.models()):
        name, _, version = item.partition(":")
        if version and not version.isdigit():
            raise UsageError(f"--model {item}: the version must be a number")
        watches.append(ModelWatch.from_manifest(repo.manifest(name, int(version) if version else None), p99_ms,
                                                ttft_p99_ms, itl_p99_ms))
    return watches
