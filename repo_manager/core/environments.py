"""Environments (their names and stores), gate settings and per-model specs: what ``configs/`` says beyond
the settings of ``settings.py``. Push, promote, inventory, observe and the agent read them from here.

``configs/trm.yaml``::

    store: s3://models/trm                # the default store
    environments:
      staging: {}                         # lives in the default store
      production: {store: s3://models-prod/trm}   # a separate production bucket
    gates:
      default: auto                       # or a list: [checksums, load, latency, agreement, eval]
      latency: {max_p99_increase_pct: 25, max_capacity_drop_pct: 15, min_p99_delta_ms: 2}
      llm_latency: {max_ttft_p99_increase_pct: 25, max_tokens_per_s_drop_pct: 15}   # vLLM models

``configs/models/<name>.yaml`` (one per model the pipeline publishes)::

    name: classifier
    source: models/classifier.onnx        # relative to the project folder
    slo: {p99_ms: 50, low_rps: 10, peak_rps: 40}   # tuning, and the latency gate's rate (peak_rps)
    sample: samples/classifier.npz        # inputs for the output-agreement gate
    eval: {command: "python eval.py", threshold: 0.9}   # optional user evaluation gate
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from repo_manager.core.errors import ConfigError, InputError, UsageError
from repo_manager.core.manifest import check_model_name
from repo_manager.core.settings import DEFAULT_CONFIG, Settings

ENV_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
"""What an environment's name may be (``check_env_name`` also refuses ``..`` in it)."""

GATES = ("checksums", "load", "latency", "agreement", "quality", "eval")
ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class LatencyGate:
    """``gates.latency`` in configs/trm.yaml: how the latency gate measures and judges a request/response model."""

    max_p99_increase_pct: float = 25.0
    """p99 of the new version at ``rate`` may be at most this much worse than the replaced one's ..."""
    max_capacity_drop_pct: float = 15.0
    min_p99_delta_ms: float = 2.0
    """... unless the difference is below this: noise on a shared CPU, not a regression."""
    rate: float = 20.0
    requests: int = 200
    concurrency: int = 4
    capacity_slice_s: float = 0.5
    """Each capacity slice (closed loop) runs at least this long: a fast model answers a slice's requests in
    milliseconds, and a point that short measures the scheduler, not the model."""
    rounds: int = 3
    """Interleaved rounds (each measures both versions); a difference within the spread between rounds is
    measured again, up to ``max_rounds``, then inconclusive: not blocking unless ``block_inconclusive``."""
    max_rounds: int = 8
    block_inconclusive: bool = False
    max_lag_ms: float = 10.0
    """A point whose sends ran later than this (p95) was limited by the client; it is measured again."""
    arrivals: str = "poisson"
    """Open-loop arrival process; ``constant`` suits short points (a Poisson send rate over 100 requests varies
    by ~10% and the load generator rightly calls such a point client-limited)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LLMLatencyGate:
    """``gates.llm_latency``: the latency gate of an LLM (a streaming vLLM model). Time to first token (TTFT) p99
    of ``requests`` streams sent at ``rate`` (open loop) may be ``max_ttft_p99_increase_pct`` worse than the
    replaced version's, or ``min_ttft_p99_delta_ms`` when that is larger; output tokens/s of ``concurrency``
    streams in flight (closed loop) at most ``max_tokens_per_s_drop_pct`` lower."""

    max_ttft_p99_increase_pct: float = 25.0
    min_ttft_p99_delta_ms: float = 20.0
    max_tokens_per_s_drop_pct: float = 15.0
    rate: float = 2.0
    requests: int = 16
    concurrency: int = 4
    input_tokens: int = 64
    """Prompt length of every stream, in tokens."""
    output_tokens: int = 32
    """Output length of every stream, in tokens (exactly this many: ignore_eos)."""
    rounds: int = 3
    max_rounds: int = 8
    block_inconclusive: bool = False
    max_lag_ms: float = 20.0
    arrivals: str = "poisson"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GateSettings:
    """``gates`` in configs/trm.yaml: the gates a promotion runs when none are named, and the latency gates'."""

    default: str | list[str] = "auto"
    latency: LatencyGate = field(default_factory=LatencyGate)
    llm_latency: LLMLatencyGate = field(default_factory=LLMLatencyGate)


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
    quality_data: Path | None = None
    """The quality gate's JSON-lines file (a text service's items: ``ops/publish/huggingface/quality.py``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": str(self.source) if self.source else None, "format": self.format,
                "slo": self.slo, "sample": str(self.sample) if self.sample else None,
                "eval_command": self.eval_command, "eval_threshold": self.eval_threshold,
                "publish": self.publish, "quality_data": str(self.quality_data) if self.quality_data else None}


def check_env_name(name: str) -> str:
    """``name`` when it can name an environment (a store key, a history folder), else ``InputError``."""
    if not isinstance(name, str) or not ENV_NAME.match(name) or ".." in name:
        raise InputError(f"environment name {name!r} is not allowed",
                         hint="use letters, digits, '_', '-' and '.'")
    return name


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


def gate_settings(settings: Settings) -> GateSettings:
    """The ``gates`` of ``settings``, checked: an unknown key or a value of the wrong kind is ``ConfigError``."""
    return GateSettings(settings.gates.get("default", "auto"), _gate(settings, "latency", LatencyGate),
                        _gate(settings, "llm_latency", LLMLatencyGate))


_Gate = TypeVar("_Gate", LatencyGate, LLMLatencyGate)


def _gate(settings: Settings, key: str, kind: type[_Gate]) -> _Gate:
    configured = settings.gates.get(key) or {}
    if not isinstance(configured, dict):
        raise ConfigError(f"{settings.source}: gates.{key} must be a mapping")
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(configured) - set(known))
    if unknown:
        raise ConfigError(f"{settings.source}: unknown gates.{key} setting(s) {', '.join(unknown)}",
                          hint=f"known: {', '.join(known)}")
    values: dict[str, Any] = {}
    for name, value in configured.items():
        default = getattr(kind, name)
        if name == "arrivals":
            if value not in ARRIVALS:
                raise ConfigError(f"{settings.source}: gates.{key}.arrivals must be one of {', '.join(ARRIVALS)}")
            values[name] = value
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if isinstance(default, bool):
            wanted, valid = "0 or 1", number in (0.0, 1.0)
        elif isinstance(default, float):
            wanted, valid = "a number, 0 or more", number >= 0  # NaN is not
        else:
            wanted, valid = "a whole number, 0 or more", number >= 0 and number.is_integer()
        if not valid:
            raise ConfigError(f"{settings.source}: gates.{key}.{name} must be {wanted}, not {str(value)[:40]}")
        values[name] = bool(number) if isinstance(default, bool) else number if isinstance(default, float) \
            else int(number)
    return kind(**values)


def parse_gates(text: str | list[str] | None, settings: Settings) -> tuple[str, ...]:
    """``auto`` (empty tuple: decided per version), or the named gates in their fixed order."""
    value = text if text is not None else gate_settings(settings).default
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
    import yaml  # noqa: PLC0415 - the store adapters import this module for check_env_name: YAML only for a spec

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"model spec {path} is not valid YAML: {exc}".splitlines()[0]) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"model spec {path} must be a mapping")
    known = {"name", "source", "format", "slo", "sample", "eval", "publish", "quality_data"}
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
                         dict(data.get("publish") or {}), resolve(data.get("quality_data")))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model spec {path}: a number is not valid ({exc})") from exc
