"""``trm rollout`` for the one server beside the agent: its plan (``rollout.plan.build_plan``) and executor
(``rollout.execute``), with the agent's own drain (readiness false, a slot in the drain lease) in place of
operator commands. The agent calls these per change; they decide nothing about refusals or readiness.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import TrmError
from repo_manager.ops.rollout import RolloutOptions, execute, streams
from repo_manager.ops.rollout.checks import generates, precheck, smoke_cases, smoke_live
from repo_manager.ops.rollout.plan import (
    DRAIN,
    SKIP,
    RolloutPlan,
    ServedElsewhereError,
    build_plan,
    served_versions,
    with_settings,
)
from repo_manager.ops.serving import dependencies, load_version

Log = Callable[..., None]


@dataclass(frozen=True)
class LocalRollout:
    repo: LocalRepository
    url: str
    grpc_url: str | None
    side_by_side: bool
    rollout_settings: dict[str, Any]
    """Settings ``rollout`` (configs/trm.yaml): memory budget, single-copy models."""
    log: Log
    drained: Callable[[list[str]], AbstractContextManager[None]]
    """Out of rotation for the body (the agent's drain)."""
    metrics_url: str | None = None
    """Triton's metrics endpoint (an LLM's streams in flight); None: port 8002 of ``url``'s host."""
    stream_drain_s: float = 120.0

    def client(self) -> TritonClient:
        return TritonClient(self.url, timeout_s=60.0, grpc_url=self.grpc_url)

    def plan(self, model: str, version: int, **options: Any) -> RolloutPlan:
        # the agent drains itself around the whole transition (``drained``), so no operator commands
        base = RolloutOptions(side_by_side=self.side_by_side, drain_cmd="true", restore_cmd="true",
                              stream_drain_s=self.stream_drain_s, **options)
        return build_plan(self.repo, model, version, [self.url], with_settings(base, model, self.rollout_settings),
                          grpc_urls=[self.grpc_url] if self.grpc_url else None,
                          metrics_urls=[self.metrics_url] if self.metrics_url else None)

    def top_level(self, wanted: dict[str, int]) -> list[str]:
        """Models of the environment that are not members of another one's version (those move with
        their ensemble)."""
        members = {m for model, version in wanted.items() for m, _ in dependencies(self.repo, model, version)}
        return sorted(m for m in wanted if m not in members)

    def precheck_first(self, wanted: dict[str, int]) -> set[str]:
        """When one change moves several models, pre-check (under temporary names) every one that can
        be before any of them switches, so that a set with a bad model is refused before clients get an
        answer from any of its versions; a failure past this point still rolls back what moved. Only
        side-by-side moves of models without members: an ensemble is pre-checked once its new members
        are loaded, and a drain-swap model may not fit twice. Returns the models checked."""
        candidates = []
        with self.client() as client:
            for model in self.top_level(wanted):
                before = served_versions(client, [model])[model]
                if not before or before == (wanted[model],):
                    continue
                try:
                    candidates.append((model, self.plan(model, wanted[model])))
                except ServedElsewhereError:
                    continue  # loaded by someone else: roll_one loads it directly
            if len(candidates) < 2:
                return set()  # one model moves: its rollout pre-checks it first anyway
            checked = set()
            for model, plan in candidates:
                if plan.servers[0].strategy in (SKIP, DRAIN) or plan.target.members:
                    continue
                config = cfg.parse_config(self.repo.manifest(model, wanted[model]).config)
                started = time.monotonic()
                count = precheck(client, self.repo, [(model, wanted[model])], model, smoke_cases(config, None))
                self.log("pre-checked before any model moves", model=model, version=wanted[model],
                         requests=count, seconds=round(time.monotonic() - started, 3))
                checked.add(model)
        return checked

    def roll_one(self, model: str, version: int, *, prechecked: bool = False) -> dict[str, Any] | None:
        """Roll ``model`` to ``version`` on this server; None when it already serves it."""
        with self.client() as client:
            before = served_versions(client, [model])[model]
        try:
            plan = self.plan(model, version, precheck=bool(before) and not prechecked)
        except ServedElsewhereError as exc:
            # the server serves versions this node repository does not hold (loaded by someone else):
            # nothing to roll back to, so a plain load, which Triton swaps in once the new one is ready
            self.log("no rollout plan; loading directly", model=model, reason=exc.message)
            with self.client() as client:
                load_version(client, self.repo, model, version)
                config = cfg.parse_config(self.repo.manifest(model, version).config)
                smoke_live(client, model, version, config, smoke_cases(config, None))
            return {"model": model, "version": version, "previous": None, "strategy": "load",
                    "outcome": "done"}
        server = plan.servers[0]
        if server.strategy == SKIP:
            return None
        self.log("rolling out", model=model, version=version, strategy=server.strategy, reason=server.reason)
        if server.strategy == DRAIN:
            # one copy at a time: a pre-check would load the new version beside the old one (the smoke
            # check after the swap still refuses a bad version, and the executor rolls it back)
            plan = replace(plan, options=replace(plan.options, precheck=False))
            with self.drained([model, *(m for m, _ in plan.target.members)]):
                result = execute(plan, self.repo, self.log)
        else:
            result = execute(plan, self.repo, self.log)
        previous = max(server.before.get(model, ()) or (0,)) or None
        return {"model": model, "version": version, "previous": previous, "strategy": server.strategy,
                "outcome": result.outcome, "seconds": round(result.seconds, 3)}

    def undo(self, moved: list[tuple[str, int | None]]) -> None:
        """Models already moved in a refused set go back to what they served (newest first)."""
        for model, previous in reversed(moved):
            try:
                if previous is None:
                    with self.client() as client:
                        client.unload(model)
                    continue
                plan = self.plan(model, previous, precheck=False)
                if plan.servers[0].strategy == DRAIN:
                    with self.drained([model]):
                        execute(plan, self.repo, self.log)
                else:
                    execute(plan, self.repo, self.log)
                self.log("rolled back", model=model, version=previous)
            except TrmError as exc:
                self.log("could not roll back", model=model, version=previous, error=exc.message)

    def wait_idle(self, models: list[str], timeout_s: float) -> None:
        """Until Triton's request counters of ``models`` stop moving for a second (in-flight requests
        done), or ``timeout_s``. A streaming LLM's counters stand still while its streams run, so its
        engine's running/waiting gauges are waited on instead (rollout/streams.py)."""
        deadline = time.monotonic() + timeout_s
        last, quiet_since = None, time.monotonic()
        with self.client() as client:
            served = served_versions(client, models)
            for model in [m for m in models if served[m] and self._streams(m, max(served[m]))]:
                drained = streams.wait_drained(
                    streams.metrics_url_for(self.url, self.metrics_url), model, served[model],
                    max(0.0, deadline - time.monotonic()),
                    began=lambda first, model=model: self.log("waiting for streams in flight", model=model,
                                                              detail=f"{first} in flight"))
                self.log("waited for streams in flight", model=model, detail=drained.text)
            while time.monotonic() < deadline:
                total = 0
                for model in models:
                    for entry in client.statistics(model):
                        stats = entry.get("inference_stats", {})
                        total += int(stats.get("success", {}).get("count", 0))
                        total += int(stats.get("fail", {}).get("count", 0))
                now = time.monotonic()
                if total != last:
                    last, quiet_since = total, now
                elif now - quiet_since >= 1.0:
                    return
                time.sleep(0.2)
        self.log("drain timeout: swapping with requests still arriving", timeout_s=timeout_s)

    def _streams(self, model: str, version: int) -> bool:
        try:
            return generates(cfg.parse_config(self.repo.manifest(model, version).config))
        except (TrmError, OSError, ValueError):
            return False
