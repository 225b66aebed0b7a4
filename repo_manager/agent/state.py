"""Readiness from the last good set, what the environment still needs loaded, and pins that disagree.

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
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from repo_manager.errors import TrmError
from repo_manager.repository import LocalRepository
from repo_manager.serving import dependencies


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
        """The pointer still names the refused set: keep it refused, unless it was refused for files
        missing from the store (stage ``store``) and its backoff has passed (they may be back)."""
        refused = self.refused
        return refused is not None and refused["etag"] == etag and not (
            refused["stage"] == "store" and time.monotonic() >= self._refused_until.get(key, 0.0))

    def waiting(self, key: str) -> bool:
        return time.monotonic() < max(self._retry_at, self._refused_until.get(key, 0.0))
