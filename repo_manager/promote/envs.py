"""Environments, per-model specs and gate defaults, read from ``configs/``.

``configs/trm.yaml``::

    store: s3://models/trm                # the default store
    environments:
      staging: {}                         # lives in the default store
      production: {store: s3://models-prod/trm}   # a separate production bucket
    gates:
      default: auto                       # or a list: [checksums, load, latency, agreement, eval]
      latency: {max_p99_increase_pct: 25, max_capacity_drop_pct: 15, min_p99_delta_ms: 2}

``configs/models/<name>.yaml`` (one per model the pipeline publishes)::

    name: classifier
    source: models/classifier.onnx        # relative to the project folder
    slo: {p99_ms: 50, low_rps: 10, peak_rps: 40}   # tuning, and the latency gate's rate (peak_rps)
    sample: samples/classifier.npz        # inputs for the output-agreement gate
    eval: {command: "python eval.py", threshold: 0.9}   # optional user evaluation gate
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from repo_manager.errors import ConfigError, UsageError
from repo_manager.manifest import check_model_name
from repo_manager.settings import DEFAULT_CONFIG, Settings
from repo_manager.storage import check_env_name

GATES = ("checksums", "load", "latency", "agreement", "eval")
LATENCY_DEFAULTS: dict[str, Any] = {
    # p99 of the new version at the spec's rate may be at most this much worse than the replaced one's
    "max_p99_increase_pct": 25.0,
    "max_capacity_drop_pct": 15.0,
    "min_p99_delta_ms": 2.0,
    # below this absolute difference a p99 change is noise on a shared CPU, not a regression
    "rate": 20.0,
    "requests": 200,
    "concurrency": 4,
    # interleaved rounds (each measures both versions); a difference within the spread between rounds is
    # measured again, up to max_rounds, then inconclusive: not blocking unless block_inconclusive is 1
    "rounds": 3,
    "max_rounds": 8,
    "block_inconclusive": 0,
    "max_lag_ms": 10.0,
    # a point whose sends ran later than this (p95) was limited by the client; it is measured again
    # open-loop arrival process; "constant" suits short points (a Poisson send rate over 100 requests
    # varies by ~10% and the load generator rightly calls such a point client-limited)
    "arrivals": "poisson",
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: Path | None = None
    format: str | None = None
    slo: dict[str, float] = field(default_factory=dict)
    sample: Path | None = None
    eval_command: str | None = None
    eval_threshold: float | None = None
    publish: dict[str, Any] = field(default_factory=dict)
    """Extra `trm publish model` options (max_batch_size, instances …)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": str(self.source) if self.source else None, "format": self.format,
                "slo": self.slo, "sample": str(self.sample) if self.sample else None,
                "eval_command": self.eval_command, "eval_threshold": self.eval_threshold,
                "publish": self.publish}


def project_dir(settings: Settings) -> Path:
    """The folder holding ``configs/`` (paths in specs are relative to it)."""
    if settings.source not in ("defaults", "") and Path(settings.source).parent.name == "configs":
        return Path(settings.source).parent.parent
    return DEFAULT_CONFIG.parent.parent.absolute()


def env_store(settings: Settings, env: str, override: str | None = None) -> str:
    """The store ``env`` lives in: ``override``, else its ``store`` in configs, else the default store."""
    check_env_name(env)
    if override:
        return override
    entry = settings.environments.get(env)
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and entry.get("store"):
        return str(entry["store"])
    if entry is not None and not isinstance(entry, dict):
        raise ConfigError(f"environment {env!r} in {settings.source} must be a mapping or a store location")
    if settings.store:
        return settings.store
    raise UsageError(f"no store for environment {env}", hint="pass --store, or set 'store' (or "
                     f"environments.{env}.store) in configs/trm.yaml")


def gate_settings(settings: Settings) -> dict[str, Any]:
    latency = dict(LATENCY_DEFAULTS)
    configured = settings.gates.get("latency") or {}
    if not isinstance(configured, dict):
        raise ConfigError(f"{settings.source}: gates.latency must be a mapping")
    unknown = sorted(set(configured) - set(LATENCY_DEFAULTS))
    if unknown:
        raise ConfigError(f"{settings.source}: unknown gates.latency setting(s) {', '.join(unknown)}",
                          hint=f"known: {', '.join(LATENCY_DEFAULTS)}")
    try:
        latency.update({k: (str(v) if k == "arrivals" else float(v)) for k, v in configured.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{settings.source}: gates.latency values must be numbers ({exc})") from exc
    return {"default": settings.gates.get("default", "auto"), "latency": latency}


def parse_gates(text: str | list[str] | None, settings: Settings) -> tuple[str, ...]:
    """``auto`` (empty tuple: decided per version), or the named gates in their fixed order."""
    value = text if text is not None else gate_settings(settings)["default"]
    names = value if isinstance(value, list) else [n.strip() for n in str(value).split(",") if n.strip()]
    if names in (["auto"], []):
        return ()
    if names == ["all"]:
        return GATES
    unknown = sorted(set(names) - set(GATES))
    if unknown:
        raise UsageError(f"unknown gate(s) {', '.join(unknown)}", hint=f"choose from auto, all, {', '.join(GATES)}")
    return tuple(g for g in GATES if g in names)


def model_specs(settings: Settings, folder: Path | None = None) -> list[ModelSpec]:
    folder = folder or project_dir(settings) / "configs" / "models"
    if not folder.is_dir():
        return []
    return [read_spec(path, folder.parent.parent) for path in sorted(folder.glob("*.yaml"))]


def model_spec(settings: Settings, name: str) -> ModelSpec:
    """The spec of ``name`` from configs/models/, or an empty one (gates then use their defaults)."""
    for spec in model_specs(settings):
        if spec.name == name:
            return spec
    return ModelSpec(check_model_name(name))


def read_spec(path: Path, base: Path) -> ModelSpec:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"model spec {path} is not valid YAML: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"model spec {path} must be a mapping")
    known = {"name", "source", "format", "slo", "sample", "eval", "publish"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"model spec {path}: unknown key(s) {', '.join(unknown)}", hint=f"known: {sorted(known)}")
    name = check_model_name(str(data.get("name") or path.stem))

    def resolve(value: Any) -> Path | None:
        if not value:
            return None
        p = Path(str(value))
        return p if p.is_absolute() else base / p

    slo = data.get("slo") or {}
    evaluation = data.get("eval") or {}
    if not isinstance(slo, dict) or not isinstance(evaluation, dict):
        raise ConfigError(f"model spec {path}: 'slo' and 'eval' must be mappings")
    try:
        return ModelSpec(name, resolve(data.get("source")), data.get("format"),
                         {k: float(v) for k, v in slo.items()}, resolve(data.get("sample")),
                         evaluation.get("command"),
                         float(evaluation["threshold"]) if "threshold" in evaluation else None,
                         dict(data.get("publish") or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model spec {path}: a number is not valid ({exc})") from exc
