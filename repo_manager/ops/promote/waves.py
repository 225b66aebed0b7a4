"""Waves: an environment that may only follow another one (``production`` after ``production-canary``).

``configs/trm.yaml``::

    environments:
      production-canary: {}
      production: {requires: production-canary}          # the canary must serve the version first
      # or, with a minimum time on the canary (from its history):
      # production: {requires: {env: production-canary, soak_s: 900}}

A promotion to ``production`` is refused (``GateError``, exit 9, naming the canary) unless the canary
environment serves exactly the version being promoted, and, with ``soak_s``, has served it for at least
that long according to the canary's history. The canary's agents report what their servers do
(``reports/<env>/<pod>.json``, written by `trm agent` when it changes): a version any canary agent
refused is refused here too, naming the pod and its reason, and ``min_pods: N`` requires at least N
canary agents to report serving it. Rollbacks are never held back: going back must be fast.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime

from repo_manager.adapters.storage import open_store
from repo_manager.core.environments import check_env_name, env_store
from repo_manager.core.errors import ConfigError, GateError, NotFoundError
from repo_manager.core.settings import Settings
from repo_manager.ops.promote import history


@dataclass(frozen=True)
class WaveRequirement:
    env: str
    soak_s: float = 0.0
    min_pods: int = 0


def requirement(settings: Settings, env: str) -> WaveRequirement | None:
    """What ``env`` requires before a version may enter it, from its settings entry."""
    entry = settings.environments.get(env)
    if not isinstance(entry, dict) or not entry.get("requires"):
        return None
    value = entry["requires"]
    try:
        if isinstance(value, str):
            return WaveRequirement(check_env_name(value))
        if isinstance(value, dict) and set(value) <= {"env", "soak_s", "min_pods"}:
            return WaveRequirement(check_env_name(str(value["env"])), float(value.get("soak_s") or 0),
                                   int(value.get("min_pods") or 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{settings.source}: environments.{env}.requires is not valid ({exc})") from exc
    raise ConfigError(f"{settings.source}: environments.{env}.requires must be an environment name or "
                      "{env: NAME, soak_s: SECONDS, min_pods: N}")


def check_wave(settings: Settings, model: str, version: int, to_env: str, *, store: str | None = None,
               rollback: bool = False, now: float | None = None) -> None:
    """GateError unless the environment ``to_env`` requires already serves ``model`` ``version``."""
    wave = requirement(settings, to_env)
    if wave is None or rollback:
        return
    canary_store = open_store(env_store(settings, wave.env, store), settings)
    try:
        served = canary_store.get_env(wave.env).models.get(model)
    except NotFoundError:
        served = None
    hint = (f"promote it to {wave.env} first (trm promote {model} --version {version} --to {wave.env}), "
            f"watch the {wave.env} agents' /metrics, then promote {to_env}")
    if served != version:
        raise GateError(f"{to_env} requires {wave.env} to serve {model} version {version} first; {wave.env} "
                        f"serves {f'version {served}' if served is not None else 'no version of it'}",
                        hint=hint, model=model, version=version, env=to_env, requires=wave.env)
    serving = 0
    for pod, payload in sorted(canary_store.get_reports(wave.env).items()):
        report = _parse_report(payload)
        refused = _mapping(report.get("refused"))
        if _mapping(refused.get("models")).get(model) == version:
            raise GateError(f"{to_env} requires {wave.env}, whose agent {pod} refused {model} version {version}: "
                            f"{str(refused.get('reason'))[:300]}",
                            hint=f"publish a fixed version; `curl <agent>/status` on {pod} has the details",
                            model=model, version=version, env=to_env, requires=wave.env, pod=pod)
        serving += _mapping(report.get("served")).get(model) == version
    if serving < wave.min_pods:
        raise GateError(f"{to_env} requires {wave.min_pods} agent(s) of {wave.env} serving {model} version "
                        f"{version}; {serving} report it", hint=hint, model=model, version=version, env=to_env,
                        requires=wave.env)
    if wave.soak_s > 0:
        arrived = [r for r in history.read(canary_store, wave.env, model) if r.to_version == version]
        since = _epoch(arrived[-1].at) if arrived else None
        age = (now if now is not None else time.time()) - since if since is not None else 0.0
        if age < wave.soak_s:
            raise GateError(f"{to_env} requires {model} version {version} to serve in {wave.env} for "
                            f"{wave.soak_s:g} s; it has for {age:.0f} s"
                            + ("" if arrived else " (no promotion of it on record there)"),
                            hint=hint, model=model, version=version, env=to_env, requires=wave.env)


def _parse_report(payload: bytes) -> dict:
    """An agent report; anything malformed counts as an empty one (it holds no refusal)."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) and data.get("schema") == "trm.agent-report/1" else {}


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _epoch(stamp: str) -> float | None:
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
