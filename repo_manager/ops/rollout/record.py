"""What is serving where: an append-only JSON-lines record next to the repository, and ``trm status``.

Every rollout appends one line per server to ``<repository>/.trm-rollouts.jsonl`` (Triton lists only
folders in its repository index, so the file is invisible to it): when, which model, the versions before
and after, the strategy, the outcome, and how long each version the server loaded took (``loads``).
``--to-previous`` and ``trm status`` read it; ``trm status`` asks each server what it has loaded and
compares that with the repository's latest versions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core.errors import TrmError
from repo_manager.core.manifest import now_iso
from repo_manager.core.redact import redact_data

if TYPE_CHECKING:
    from repo_manager.ops.rollout.plan import RolloutPlan
    from repo_manager.ops.rollout.result import ServerResult

RECORD_NAME = ".trm-rollouts.jsonl"


def record_path(root: Path) -> Path:
    return Path(root) / RECORD_NAME


def append_record(root: Path, plan: RolloutPlan, server: ServerResult, outcome: str) -> None:
    """One line per server; a single O_APPEND write, so concurrent rollouts never interleave lines."""
    line = {"time": now_iso(), "model": plan.target.model, "version": plan.target.version,
            "url": server.url, "strategy": server.strategy, "server_outcome": server.outcome,
            "rollout_outcome": outcome, "before": {k: list(v) for k, v in server.before.items()},
            "after": {k: list(v) for k, v in server.after.items()}, "loads": list(server.loads)}
    data = (json.dumps(redact_data(line), sort_keys=True) + "\n").encode()  # no URL credentials on disk
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(record_path(root), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_records(root: Path) -> list[dict[str, Any]]:
    path = record_path(root)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a torn last line after a crash is skipped, not fatal
    return records


@dataclass(frozen=True)
class ServerStatus:
    url: str
    reachable: bool
    models: dict[str, list[int]]
    """Loaded (READY) versions per model."""
    latest: dict[str, int | None]
    """The repository's latest version of each loaded model (None: not in the repository)."""
    last_rollout: dict[str, Any] | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "reachable": self.reachable, "models": self.models, "latest": self.latest,
                "up_to_date": {m: bool(v) and self.latest.get(m) in v for m, v in self.models.items()},
                "last_rollout": self.last_rollout, "error": self.error}


def server_status(root: Path, urls: list[str]) -> list[ServerStatus]:
    """Each server's loaded models and versions against the repository; default: every recorded server."""
    repo = LocalRepository(root)
    records = read_records(root)
    if not urls:
        urls = list(dict.fromkeys(r["url"] for r in records if "url" in r))
    statuses = []
    for url in urls:
        last = next((r for r in reversed(records) if r.get("url") == url), None)
        try:
            with TritonClient(url, timeout_s=5.0) as client:
                index = client.repository_index()
        except TrmError as exc:
            statuses.append(ServerStatus(url, False, {}, {}, last, exc.message.splitlines()[0]))
            continue
        models: dict[str, list[int]] = {}
        for entry in index:
            if entry.get("state") == "READY" and entry.get("version"):
                models.setdefault(entry["name"], []).append(int(entry["version"]))
        latest = {}
        for model in models:
            models[model].sort()
            versions = repo.versions(model) if (repo.root / model).is_dir() else []
            latest[model] = versions[-1] if versions else None
        statuses.append(ServerStatus(url, True, models, latest, last))
    return statuses


def describe_status(statuses: list[ServerStatus]) -> str:
    if not statuses:
        return "no server known: pass --url, or roll out once so that servers are recorded"
    lines = []
    for status in statuses:
        if not status.reachable:
            lines.append(f"{status.url}: UNREACHABLE ({status.error})")
            continue
        lines.append(f"{status.url}:")
        if not status.models:
            lines.append("  no model loaded")
        for model, versions in sorted(status.models.items()):
            latest = status.latest.get(model)
            state = ("not in the repository" if latest is None else
                     "up to date" if latest in versions else f"behind: repository latest is {latest}")
            lines.append(f"  {model}: {'/'.join(map(str, versions))}  ({state})")
        if status.last_rollout:
            r = status.last_rollout
            lines.append(f"  last rollout: {r.get('time')} {r.get('model')} -> {r.get('version')} "
                         f"({r.get('server_outcome')})")
    return "\n".join(lines)
