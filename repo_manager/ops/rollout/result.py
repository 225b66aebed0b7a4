"""What a rollout reports: each step, each server and the whole rollout (``execute.py``
builds them, ``record.py`` appends each server's to the repository's record)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from repo_manager.ops.rollout.plan import RolloutPlan

Sets = dict[str, tuple[int, ...]]
"""Loaded versions per model."""


@dataclass(frozen=True)
class StepRecord:
    server: str
    name: str
    started_at: str
    seconds: float
    ok: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server, "step": self.name, "started_at": self.started_at,
                "seconds": round(self.seconds, 3), "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True)
class ServerResult:
    url: str
    strategy: str
    outcome: str
    """done, skipped, refused (the pre-check refused the version, nothing changed), rolled_back, failed
    (unreachable) or not_started."""
    before: Sets
    after: Sets
    steps: tuple[StepRecord, ...] = ()
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    soak: dict[str, Any] | None = None
    loads: tuple[dict[str, Any], ...] = ()
    """Each load of a version the server did not hold: model, version, seconds (load request to ready)."""

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "strategy": self.strategy, "outcome": self.outcome,
                "before": {k: list(v) for k, v in self.before.items()},
                "after": {k: list(v) for k, v in self.after.items()}, "seconds": round(self.seconds, 3),
                "requests": self.requests, "errors": self.errors, "soak": self.soak, "loads": list(self.loads),
                "steps": [s.to_dict() for s in self.steps]}


@dataclass
class RolloutResult:
    plan: RolloutPlan
    servers: list[ServerResult] = field(default_factory=list)
    outcome: str = "done"
    reason: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.plan.target.model, "version": self.plan.target.version,
                "outcome": self.outcome, "reason": self.reason, "seconds": round(self.seconds, 3),
                "servers": [s.to_dict() for s in self.servers]}

    def describe(self) -> str:
        lines = [f"rollout {self.plan.target.model} -> {self.plan.target.version}: {self.outcome}"
                 + (f" ({self.reason})" if self.reason else "") + f" in {self.seconds:.1f} s"]
        for server in self.servers:
            lines.append(f"  {server.url} [{server.strategy}] {server.outcome}: "
                         f"{_sets_text(server.before)} -> {_sets_text(server.after)}, "
                         f"{server.requests} requests observed, {server.errors} errors, {server.seconds:.1f} s")
            lines += [f"    {s.started_at[11:23]} {s.name:<34} {s.seconds:7.3f} s "
                      f"{'ok' if s.ok else 'FAILED'} {s.detail}" for s in server.steps]
        return "\n".join(lines)


def _sets_text(sets: Sets) -> str:
    return ", ".join(f"{m}:{'/'.join(map(str, v)) or '-'}" for m, v in sets.items())
