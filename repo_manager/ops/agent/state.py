"""What the agent knows (``AgentState``, its ``Phase``), readiness from the last good set, what the environment
still needs loaded, and pins that disagree.

Pure decisions over the agent's snapshot (no I/O beyond reading manifests of the node repository), so
each rule is one small function:

* ``is_ready``: the pod is ready while every model of its last good set that the environment still names
  is loaded and has answered. A model the environment adds (loading, refused, or named twice in two
  cases) is not required: it is reported (``syncing``, ``rolling_out``, ``degraded``), and the models the
  pod served keep it in rotation. Before the first good set (a fresh pod) nothing is ready.
* ``keep_loaded``: the models of the environment plus the members their versions pin; whatever else the
  agent loaded is unloaded.
* ``pin_conflict``: the environment names a member at another version than the one its ensemble pins;
* ``Backoff``: when a refused set, or a transient failure, is tried again.

``AgentState`` is what ``/status`` reports, one typed object the agent changes under its lock; ``LoopMemo`` is
what the loop already did, so that a tick does not do it again.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.errors import TrmError
from repo_manager.ops.serving import dependencies


class Phase(str, Enum):
    """What the agent is doing: ``/status`` ``state``, and one ``trm_agent_state`` gauge each. A pod can be
    ready in any of them but ``starting`` and ``waiting`` (``AgentState.ready`` says)."""

    STARTING = "starting"
    WAITING = "waiting"
    """Triton is not ready, or the pointer was never read."""
    SYNCING = "syncing"
    ROLLING_OUT = "rolling_out"
    DRAINING = "draining"
    WAITING_FOR_SLOT = "waiting_for_slot"
    """Waiting for a slot in the environment's drain lease."""
    READY = "ready"
    DEGRADED = "degraded"
    """A set was refused, or a served version does not answer: the last good set keeps serving."""
    ERROR = "error"
    """A transient failure (store or Triton unreachable): retried with a backoff."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SyncReport:
    """One sync of the agent: the versions it installed and what that took."""

    installed: tuple[str, ...]
    bytes_downloaded: int
    bytes_reused: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"installed": list(self.installed), "bytes_downloaded": self.bytes_downloaded,
                "bytes_reused": self.bytes_reused, "seconds": self.seconds}


@dataclass
class SyncTotals:
    """What the agent's syncs installed since it started (``/status`` ``sync``)."""

    bytes_downloaded: int = 0
    bytes_reused: int = 0
    syncs: int = 0
    last: SyncReport | None = None

    def add(self, report: SyncReport) -> None:
        self.bytes_downloaded += report.bytes_downloaded
        self.bytes_reused += report.bytes_reused
        self.syncs += 1
        self.last = report

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_downloaded": self.bytes_downloaded, "bytes_reused": self.bytes_reused, "syncs": self.syncs,
                "last": self.last.to_dict() if self.last else None}


@dataclass
class RolloutReport:
    """One attempt to converge on a set (``/status`` ``last_rollout``): filled in as it goes, ended once."""

    wanted: dict[str, int]
    started_at: str
    models: list[dict[str, Any]] = field(default_factory=list)
    """Per model rolled out: model, version, previous, strategy, outcome, seconds (``AgentRollout.roll_one``)."""
    sync: SyncReport | None = None
    outcome: str | None = None
    """``done`` or ``refused``; None while the attempt runs."""
    reason: str | None = None
    seconds: float | None = None

    def end(self, outcome: str, reason: str | None, seconds: float) -> RolloutReport:
        return dataclasses.replace(self, models=list(self.models), outcome=outcome, reason=reason,
                                   seconds=round(seconds, 3))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"wanted": dict(self.wanted), "started_at": self.started_at,
                                "models": [dict(m) for m in self.models]}
        if self.sync is not None:
            data["sync"] = self.sync.to_dict()
        return data | {"outcome": self.outcome, "reason": self.reason, "seconds": self.seconds}


@dataclass
class AgentState:
    """What the agent knows and reports (``Agent.status()`` copies it), changed only under the agent's lock."""

    phase: Phase = Phase.STARTING
    reason: str | None = "not converged yet"
    ready: bool = False
    """In rotation (``/readyz``): never while draining."""
    draining: bool = False
    wanted: dict[str, int] = field(default_factory=dict)
    """model -> version the pointer named at its last read."""
    served: dict[str, int | None] = field(default_factory=dict)
    """Per model of the environment: the one READY version, or None (absent, or several loaded)."""
    verified: dict[str, int] = field(default_factory=dict)
    """model -> version smoke-checked on this server (cleared when Triton restarts)."""
    last_rollout: RolloutReport | None = None
    rollouts: Counter[str] = field(default_factory=Counter)
    """Rollouts by outcome: done, refused, failed."""
    sync: SyncTotals = field(default_factory=SyncTotals)
    lease_holders: list[str] = field(default_factory=list)
    """The pods out of rotation in the drain lease, as last read."""


@dataclass
class LoopMemo:
    """What the agent loop already did, so that a tick does not do it again."""

    cleaned: bool = False
    """Leftovers of a killed predecessor (pre-check models, staging folders) were removed."""
    pruned_for: str | None = None
    """The set whose unserved version folders were pruned."""
    reported: str | None = None
    """The report last written to the store."""
    kept_for: str | None = None
    """What the loaded models were last judged on (``_unload_dropped``)."""


def required(wanted: Mapping[str, int], good: Mapping[str, int]) -> dict[str, int]:
    """The models readiness is judged on: the last good set, less what the environment dropped."""
    return {m: v for m, v in good.items() if m in wanted}


def is_ready(wanted: Mapping[str, int], good: Mapping[str, int], served: Mapping[str, int | None],
             verified: Mapping[str, int]) -> bool:
    need = required(wanted, good)
    return bool(need) and all(served.get(m) is not None and verified.get(m) == served.get(m) for m in need)


def good_now(wanted: Mapping[str, int], served: Mapping[str, int | None],
             verified: Mapping[str, int]) -> dict[str, int]:
    """After a refusal: the versions of the environment's models that the server still serves and that
    answered (what the agent refused to leave)."""
    return {m: v for m in wanted if (v := served.get(m)) is not None and verified.get(m) == v}


def members(repo: LocalRepository, models: Mapping[str, int]) -> set[str]:
    """Members pinned by these versions; a version whose manifest is missing or unreadable (not
    installed yet, refused by the sync) contributes none."""
    found: set[str] = set()
    for model, version in models.items():
        try:
            found |= {m for m, _ in dependencies(repo, model, version)}
        except (TrmError, OSError, ValueError):
            continue
    return found


def keep_loaded(repo: LocalRepository, wanted: Mapping[str, int], good: Mapping[str, int],
                served: Mapping[str, int | None]) -> set[str]:
    """What must stay loaded: the environment's models, the members of their wanted versions, and the
    members of the versions still served for them (a refused ensemble keeps its old members)."""
    still = {m: v for m, v in (dict(good) | {k: s for k, s in served.items() if s is not None}).items()
             if m in wanted}
    return set(wanted) | members(repo, wanted) | members(repo, still)


def pin_conflict(repo: LocalRepository, wanted: Mapping[str, int]) -> str | None:
    """A reason when the environment names a member at another version than an ensemble it names pins."""
    for model, version in sorted(wanted.items()):
        try:  # the direct members (a nested ensemble is a wanted model of its own, or not installed)
            pins = sorted(repo.manifest(model, version).members.items())
        except (TrmError, OSError, ValueError):
            continue  # the rollout reports a version it cannot read
        for member, pinned in pins:
            if member in wanted and wanted[member] != pinned:
                return (f"the environment names {member} version {wanted[member]}, but {model} version "
                        f"{version} pins {member} version {pinned}")
    return None


RETRIED_STAGES = ("store", "host")
"""Refusals tried again after their backoff while the pointer stays: files missing from the store (``store``: they
may be pushed again) and a Python stub Triton declared unhealthy (``host``: a stub its host stalled answers on a
fresh load; one that dies dies again, and stays refused with a growing backoff)."""


class Backoff:
    """When to try again: per refused set (keyed by its models) and after transient failures, each
    doubling from ``first_s`` up to ``max_s``. ``refused`` describes the last refusal (/status)."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.refused: dict[str, Any] | None = None
        self._failures: Counter[str] = Counter()
        self._refused_until: dict[str, float] = {}
        """Per refused set: before this (monotonic) time, a pointer naming it again is not retried."""
        self._transient = 0
        self._retry_at = 0.0
        """After a transient failure: no new attempt before this (monotonic) time."""

    def _delay(self, count: int) -> float:
        return min(self.first_s * 2 ** (count - 1), self.max_s)

    def refuse(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Note a refusal of the set ``key``; ``record`` (models, etag, reason, stage...) is completed with
        the failure count and the backoff, and becomes ``refused``."""
        self._failures[key] += 1
        delay = self._delay(self._failures[key])
        self._refused_until[key] = time.monotonic() + delay  # a pointer moving back here waits this long
        self.refused = record | {"failures": self._failures[key], "retry_after_s": delay}
        return self.refused

    def transient(self) -> float:
        """Note a transient failure; the delay before the next attempt."""
        self._transient += 1
        delay = self._delay(self._transient)
        self._retry_at = time.monotonic() + delay
        return delay

    def succeeded(self, key: str) -> None:
        self._failures.pop(key, None)
        self._refused_until.pop(key, None)
        self.refused, self._transient, self._retry_at = None, 0, 0.0

    def holds(self, key: str, etag: str | None) -> bool:
        """The pointer still names the refused set: keep it refused, unless it was refused at a stage that is
        tried again (``RETRIED_STAGES``) and its backoff has passed."""
        refused = self.refused
        return refused is not None and refused["etag"] == etag and not (
            refused["stage"] in RETRIED_STAGES and time.monotonic() >= self._refused_until.get(key, 0.0))

    def waiting(self, key: str) -> bool:
        return time.monotonic() < max(self._retry_at, self._refused_until.get(key, 0.0))
