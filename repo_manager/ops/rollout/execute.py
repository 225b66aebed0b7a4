"""Execute a ``RolloutPlan``: server by server (canary first), every step timed and logged.

One server moves from its ``before`` version sets to its ``after`` sets by ``transition``:

1. members (ensembles only), deepest first: load each member with the union of its old and new versions,
   then load it once more with the same config ("settle", see below);
2. the model: a plain model is loaded with old + new versions (unversioned requests reach the highest
   loaded version, so the new one answers from here on), checked, then reloaded with only the new
   version; an ensemble is reloaded once with the new config, whose steps pin the new member versions;
3. members are reloaded with only their new versions.

Rolling back is the same transition with ``before`` and ``after`` swapped. Triton keeps the old version
serving while a reload runs and swaps only once the new instance is ready, so no request fails (measured
by tests/test_rollout.py and bench/bench_rollout.py under load).

Settle: loading an ensemble makes Triton re-read its members from the repository folder, and any member
whose folder changed since its last load (a Python model writes ``__pycache__`` into its version folder
when it first loads, unless the version holds the empty ``__pycache__`` file that trm writes since
``repository.block_bytecode_cache``; versions installed before lack it) is reloaded with the on-disk
config.pbtxt, which knows nothing of the version set trm chose: old member versions would vanish under
in-flight requests. A config-override load stamps the member with the current time, so a second, identical
load right after the first (a config-only update for Triton when nothing else changed) makes the ensemble
load leave the members alone.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from repo_manager.adapters import metrics
from repo_manager.adapters.process import run_command
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import (
    ModelLoadError,
    Report,
    RolledBackError,
    ServerError,
    TrmError,
    VerificationError,
)
from repo_manager.core.progress import Progress, quiet
from repo_manager.ops.rollout import checks, streams
from repo_manager.ops.rollout.plan import DRAIN, SKIP, SWITCH, RolloutPlan, ServerPlan, served_versions
from repo_manager.ops.rollout.record import append_record
from repo_manager.ops.rollout.result import RolloutResult, ServerResult, Sets, StepRecord
from repo_manager.ops.serving import version_config

COMMAND_TIMEOUT_S = 600
UNLOAD_SETTLE_S = 20.0
"""How long a drop waits for the versions it removed to be gone from the server (their memory freed): a
Python model's in well under a second, a vLLM engine's shutdown in 9-12 s here. One still unloading
after that is said in the step's detail, and the rollout goes on."""
"""Longest a drain or restore command may run (``--drain-cmd``, ``--restore-cmd``); then it is stopped."""


class StepLog:
    """Times each step, logs it through ``progress`` as it ends, and keeps it for the summary."""

    def __init__(self, url: str, progress: Progress) -> None:
        self.url, self.progress = url, progress
        self.steps: list[StepRecord] = []
        self.loads: list[dict[str, Any]] = []
        self.after_step: Callable[[], None] | None = None

    @contextmanager
    def loading(self, model: str, version: int, loaded: tuple[int, ...]) -> Iterator[None]:
        """Time the block, a load that adds ``version`` to the ``loaded`` ones, into
        ``trm_model_load_duration_seconds`` and the server's ``loads`` (nothing when it was loaded already,
        or the load raised)."""
        started = time.monotonic()
        yield
        if version not in loaded:
            seconds = time.monotonic() - started
            metrics.record_load(model, version, seconds)
            self.loads.append({"model": model, "version": version, "seconds": round(seconds, 3)})

    @contextmanager
    def step(self, name: str) -> Iterator[dict[str, str]]:
        started = datetime.now(timezone.utc)
        t0 = time.monotonic()
        info: dict[str, str] = {}
        try:
            yield info
        except BaseException as exc:  # recorded as a failed step, then re-raised (a signal's exit too)
            detail = exc.message if isinstance(exc, TrmError) else type(exc).__name__
            self._add(name, started, time.monotonic() - t0, False, detail.splitlines()[0][:300])
            raise
        self._add(name, started, time.monotonic() - t0, True, info.get("detail", ""))

    def _add(self, name: str, started: datetime, seconds: float, ok: bool, detail: str) -> None:
        record = StepRecord(self.url, name, started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), seconds, ok, detail)
        self.steps.append(record)
        if self.after_step is not None:
            self.after_step()
        self.progress(f"{record.started_at[11:23]} {self.url} {name}: {'ok' if ok else 'FAILED'} "
                      f"({seconds:.2f} s){' ' + detail if detail else ''}")


# ------------------------------------------------------------------------------------- transitions
def load_set(client: TritonClient, repo: LocalRepository, name: str, versions: tuple[int, ...],
             config_version: int) -> None:
    """Load exactly ``versions`` of ``name`` with the config ``config_version`` was validated with."""
    if not versions:
        client.unload(name)
        return
    config = version_config(repo, name, config_version)
    config.version_policy.specific.versions[:] = list(versions)
    client.load(name, config)


def transition(client: TritonClient, repo: LocalRepository, model: str, current: Sets, goal: Sets,
               goal_versions: dict[str, int], log: StepLog, check: Callable[[], str] | None = None,
               *, side_by_side: bool = True, before_switch: Callable[[], str] | None = None,
               direct: bool = False, drain: Callable[[tuple[int, ...]], str] | None = None) -> None:
    """Move one server from ``current`` to ``goal`` version sets (see the module docstring).

    ``goal_versions`` names, per model, the version whose config is used (the one that will answer);
    ``before_switch`` runs once the members are in place, before ``model`` changes (an ensemble's
    pre-check); ``check`` runs once the goal version of ``model`` is loaded, before the old versions go.
    ``direct`` (the switch strategy) reloads ``model`` once with its goal versions, without the union.
    ``drain`` (an LLM's streams) runs with the versions of ``model`` about to go, once the goal version
    answers new requests, before they are unloaded.
    """
    members = [name for name in goal if name != model]
    ensemble = bool(members)
    unions = {name: tuple(sorted(set(current.get(name, ())) | set(goal[name]))) for name in goal}
    if direct:
        unions[model] = goal[model]
    if not side_by_side:  # drain: the old copies go first, so that one copy at a time is loaded
        for name in [model] + members[::-1]:
            if current.get(name) and not set(goal[name]) >= set(current[name]):
                with log.step(f"unload {name} {'/'.join(map(str, current[name]))}"):
                    client.unload(name)
        unions = dict(goal)
        current = {}
    changed = [m for m in members if unions[m] != current.get(m, ())]
    for member in changed:
        with log.step(f"load {member} {'/'.join(map(str, unions[member]))}"), \
                log.loading(member, goal_versions[member], current.get(member, ())):
            load_set(client, repo, member, unions[member], goal_versions[member])
    first = goal[model] if ensemble else unions[model]
    if ensemble and first != current.get(model, ()):
        # Every member, changed or not, so that a folder touched since its last load cannot make the
        # ensemble load reload it from disk (module docstring). A config-only update for Triton.
        with log.step("settle members"):
            for member in members:
                if unions[member]:
                    load_set(client, repo, member, unions[member], goal_versions[member])
    if before_switch is not None:
        with log.step("pre-check ensemble under a temporary name") as info:
            info["detail"] = before_switch()
    if first != current.get(model, ()):
        with log.step(f"load {model} {'/'.join(map(str, first))}"), \
                log.loading(model, goal_versions[model], current.get(model, ())):
            load_set(client, repo, model, first, goal_versions[model])
            if not client.is_model_ready(model, goal_versions[model]):
                raise ModelLoadError(f"{model} version {goal_versions[model]} is not ready on {client.url}",
                                     model=model, url=client.url)
    if check is not None:
        with log.step(f"smoke {model} {goal_versions[model]}") as info:
            info["detail"] = check()
    if not ensemble and unions[model] != goal[model]:
        going = tuple(sorted(set(unions[model]) - set(goal[model])))
        if drain is not None and going and set(goal[model]):
            with log.step(f"drain streams {model} {'/'.join(map(str, going))}") as info:
                info["detail"] = drain(going)
        with log.step(f"drop {model} -> {'/'.join(map(str, goal[model])) or 'unloaded'}") as info:
            load_set(client, repo, model, goal[model], goal_versions[model])
            info["detail"] = settle_unload(client, model, going)
    for member in members[::-1]:
        if unions[member] != goal[member]:
            with log.step(f"drop {member} -> {'/'.join(map(str, goal[member])) or 'unloaded'}") as info:
                load_set(client, repo, member, goal[member], goal_versions[member])
                info["detail"] = settle_unload(client, member, tuple(sorted(set(unions[member]) - set(goal[member]))))
    if ensemble and not client.is_model_ready(model, goal_versions[model]):
        raise ModelLoadError(f"ensemble {model} is not ready on {client.url} after its members changed",
                             model=model, url=client.url)


def settle_unload(client: TritonClient, name: str, going: tuple[int, ...],
                  timeout_s: float = UNLOAD_SETTLE_S) -> str:
    """Wait until the versions ``going`` of ``name`` are gone from the server (Triton unloads a version once
    every request of it is released); what happened, for the step's detail."""
    if not going:
        return ""
    started, numbers = time.monotonic(), {str(v) for v in going}
    try:
        entries = client.wait_unloaded(lambda e: e.get("name") == name and str(e.get("version")) in numbers,
                                       timeout_s)
    except TrmError:
        return "whether the old version finished unloading could not be read"
    if not entries:
        return f"{_versions(going)} unloaded in {time.monotonic() - started:.1f} s"
    left = sorted(int(e["version"]) for e in entries)
    return (f"warning: {_versions(left)} still unloading after {timeout_s:.0f} s, its memory in use: "
            "Triton keeps a version until every request of it is released (on Triton 2.51 a gRPC client "
            "that cancels a stream right after its final response keeps it for good; a restart frees it)")


def _versions(numbers: tuple[int, ...] | list[int]) -> str:
    return ("version " if len(numbers) == 1 else "versions ") + "/".join(map(str, numbers))


def _config_versions(sets: Sets, fallback: dict[str, int]) -> dict[str, int]:
    """The version whose config each model uses: the highest in its set (the one that answers)."""
    return {name: (max(versions) if versions else fallback[name]) for name, versions in sets.items()}


# ---------------------------------------------------------------------------------------- servers
class Executor:
    def __init__(self, plan: RolloutPlan, repo: LocalRepository, progress: Progress = quiet) -> None:
        self.plan, self.repo, self.progress = plan, repo, progress
        self.target = plan.target
        self.goal_versions = dict(plan.target.members) | {plan.target.model: plan.target.version}
        entry_config = cfg.parse_config(repo.manifest(self.target.model, self.target.version).config)
        self.entry_config = entry_config
        self.cases = checks.smoke_cases(entry_config, plan.options.smoke_file)

    # -------------------------------------------------------------------------------- one server
    def _smoke(self, client: TritonClient) -> str:
        count = checks.smoke_live(client, self.target.model, self.target.version, self.entry_config,
                                  self.cases)
        return f"{count} versioned requests answered as expected"

    def _drain(self, server: ServerPlan) -> Callable[[tuple[int, ...]], str] | None:
        """An LLM's old versions are unloaded once their streams in flight finished (rollout/streams.py)."""
        if server.metrics_url is None:
            return None
        url, model, timeout_s = server.metrics_url, self.target.model, self.plan.options.stream_drain_s
        return lambda versions: streams.wait_drained(url, model, versions, timeout_s).text

    def _precheck(self, client: TritonClient) -> str:
        count = checks.precheck(client, self.repo, [(self.target.model, self.target.version)],
                                self.target.model, self.cases)
        return f"{count} requests answered as expected"

    def move(self, server: ServerPlan, log: StepLog) -> None:
        """Forward transition of one server; raises RolledBackError after rolling this server back."""
        opts = self.plan.options
        with TritonClient(server.url, grpc_url=server.grpc_url) as client:
            # Triton cannot load an ensemble whose members exist only under temporary names (it looks
            # for them in its repository), so an ensemble is pre-checked once its new members are
            # loaded beside the old ones, under a temporary name pinned to those members.
            if opts.precheck and not self.target.members:
                try:
                    with log.step("pre-check under a temporary name") as info:
                        info["detail"] = self._precheck(client)
                except ModelLoadError as exc:
                    raise self._failed(server, "load_failed", exc, changed=False) from exc
                except VerificationError as exc:
                    self._require_reachable(client, server)
                    raise self._failed(server, "smoke_failed", exc, changed=False) from exc
            ensemble_check = (lambda: self._precheck(client)) if opts.precheck and self.target.members else None
            if server.strategy == DRAIN:
                self._run_command(opts.drain_cmd, server, log, "drain")
            try:
                transition(client, self.repo, self.target.model, server.before, server.after,
                           self.goal_versions, log, check=lambda: self._smoke(client),
                           side_by_side=server.strategy != DRAIN, before_switch=ensemble_check,
                           direct=server.strategy == SWITCH, drain=self._drain(server))
            except ModelLoadError as exc:
                self._require_reachable(client, server)
                self.roll_back(server, log, drained=True)
                raise self._failed(server, "load_failed", exc, changed=True) from exc
            except VerificationError as exc:
                self._require_reachable(client, server)
                self.roll_back(server, log, drained=True)
                raise self._failed(server, "smoke_failed", exc, changed=True) from exc
            finally:
                if server.strategy == DRAIN:
                    self._run_command(opts.restore_cmd, server, log, "restore")

    def roll_back(self, server: ServerPlan, log: StepLog, *, drained: bool = False) -> None:
        """Back to the server's ``before`` sets, from whatever it serves now.

        A drain-strategy server that is back in rotation (a canary breach found later) is drained again
        around its rollback, since the rollback also swaps one copy for the other.
        """
        drain = server.strategy == DRAIN and not drained
        if drain:
            self._run_command(self.plan.options.drain_cmd, server, log, "drain")
        try:
            with TritonClient(server.url, grpc_url=server.grpc_url) as client:
                current = served_versions(client, list(server.before))
                goal_versions = _config_versions(server.before, dict(self.goal_versions))
                with log.step("roll back"):
                    transition(client, self.repo, self.target.model, current, server.before, goal_versions,
                               log, side_by_side=server.strategy != DRAIN, direct=server.strategy == SWITCH,
                               drain=self._drain(server))
        finally:
            if drain:
                self._run_command(self.plan.options.restore_cmd, server, log, "restore")

    def _require_reachable(self, client: TritonClient, server: ServerPlan) -> None:
        if not client.is_ready():
            raise ServerError(f"Triton at {server.url} became unreachable during the rollout", url=server.url)

    def _failed(self, server: ServerPlan, reason: str, exc: TrmError, *, changed: bool) -> RolledBackError:
        where = "rolled back" if changed else "nothing was changed"
        return RolledBackError(f"rollout of {self.target.model} {self.target.version} on {server.url}: "
                               f"{exc.message.splitlines()[0]} ({where})", changed=changed, reason=reason,
                               url=server.url, model=self.target.model, version=self.target.version)

    def _run_command(self, command: str | None, server: ServerPlan, log: StepLog, what: str) -> None:
        if not command:
            return
        env_note = {"TRM_SERVER_URL": server.url, "TRM_MODEL": self.target.model,
                    "TRM_VERSION": str(self.target.version)}
        with log.step(f"{what} command"):
            try:
                done = run_command(command, env=os.environ | env_note, timeout_s=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ServerError(f"{what} command for {server.url} did not finish within {COMMAND_TIMEOUT_S} s",
                                  url=server.url) from None
            if done.returncode != 0:
                raise ServerError(f"{what} command for {server.url} exited with {done.returncode}: "
                                  f"{(done.stderr or done.stdout).strip()[-300:]}", url=server.url)


class Observer:
    """At least how many requests Triton answered for the model on one server while it changed.

    Triton's statistics are per version, vanish when a version is unloaded and restart from 0 when a
    version is reloaded (a config change, or files touched since the load), so a before/after difference
    undercounts. The counters are sampled after every step; each version contributes what it answered
    between samples, a drop in a counter starting a new count. Requests answered between a version's last
    sample and its unload or reload are missed, hence "at least".
    """

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.counted: dict[str, list[int]] = {}
        """version -> [requests, failed] counted so far."""
        self.last: dict[str, tuple[int, int]] = {}

    def sample(self) -> None:
        try:
            with TritonClient(self.url, timeout_s=5.0) as client:
                entries = client.statistics(self.model)
        except TrmError:
            return  # an unreachable server is reported by the step that needed it
        first_sample = not self.last and not self.counted
        for entry in entries:
            stats = entry.get("inference_stats", {})
            now = (int(stats.get("success", {}).get("count", 0)), int(stats.get("fail", {}).get("count", 0)))
            version = str(entry.get("version"))
            # a version seen for the first time after the start was loaded meanwhile: it counts from 0
            before = self.last.get(version, now if first_sample else (0, 0))
            if now[0] < before[0] or now[1] < before[1]:
                before = (0, 0)  # reloaded: its counters restarted
            counted = self.counted.setdefault(version, [0, 0])
            counted[0] += (now[0] - before[0]) + (now[1] - before[1])
            counted[1] += now[1] - before[1]
            self.last[version] = now

    def totals(self) -> tuple[int, int]:
        """(requests, failed) counted since the first sample."""
        return (sum(c[0] for c in self.counted.values()), sum(c[1] for c in self.counted.values()))


def execute(plan: RolloutPlan, repo: LocalRepository, progress: Progress = quiet) -> RolloutResult:
    """Run ``plan``. Raises RolledBackError (every changed server rolled back) or ServerError (a server
    became unreachable; the others are left consistent). Either carries the result as ``.report``."""
    started = time.monotonic()
    executor = Executor(plan, repo, progress)
    result = RolloutResult(plan)
    changed: list[tuple[ServerPlan, StepLog]] = []
    try:
        for server in plan.servers:
            _one_server(executor, server, result, changed)
    except RolledBackError as exc:
        # refused: the pre-check stopped the first server before anything changed anywhere
        touched = bool(changed) or exc.changed
        _roll_back_all(executor, changed, result, progress)
        result.outcome, result.reason = "rolled_back" if touched else "refused", str(exc.reason)
        _finish(result, started, repo)
        exc.report = Report(result.to_dict(), result.describe(), result)
        raise
    except ServerError as exc:
        failed = exc.url or "a server"
        result.outcome, result.reason = "failed", "server_unreachable"
        on_new = [s.url for s, _ in changed]
        error = ServerError(
            f"{failed} failed during the rollout of {plan.target.model} {plan.target.version}: "
            f"{exc.message.splitlines()[0]}. Already on version {plan.target.version}: "
            f"{', '.join(on_new) or 'none'}; the other servers were not touched",
            hint="rerun the same command once the server is back: servers already on the target are skipped",
            url=failed, reason="server_unreachable")
        _finish(result, started, repo)
        error.report = Report(result.to_dict(), result.describe(), result)
        raise error from exc
    _finish(result, started, repo)
    return result


def _one_server(executor: Executor, server: ServerPlan, result: RolloutResult,
                changed: list[tuple[ServerPlan, StepLog]]) -> None:
    plan, opts = executor.plan, executor.plan.options
    log = StepLog(server.url, executor.progress)
    t0 = time.monotonic()
    if server.strategy == SKIP:
        result.servers.append(ServerResult(server.url, SKIP, "skipped", server.before, server.before))
        return
    soak_here = opts.soak_s > 0 and (server.canary or opts.canary == 0)
    observer = Observer(server.url, plan.target.model)
    observer.sample()
    log.after_step = observer.sample
    baseline = soak = None
    try:
        if soak_here and server.before.get(plan.target.model):
            with log.step("baseline probes") as info:
                baseline = checks.watch(server.url, plan.target.model, min(max(1.0, opts.soak_s / 2), 5.0))
                info["detail"] = f"p99 {baseline.p99_ms or 0:.1f} ms"
        executor.move(server, log)
    except RolledBackError as exc:
        outcome = "rolled_back" if exc.changed else "refused"
        result.servers.append(ServerResult(server.url, server.strategy, outcome, server.before,
                                           server.before, tuple(log.steps), seconds=time.monotonic() - t0,
                                           loads=tuple(log.loads)))
        raise
    except ServerError as exc:
        result.servers.append(ServerResult(server.url, server.strategy, "failed", server.before, {},
                                           tuple(log.steps), seconds=time.monotonic() - t0, loads=tuple(log.loads)))
        exc.url = exc.url or server.url
        raise
    changed.append((server, log))
    if soak_here:
        with log.step(f"soak {opts.soak_s:g} s") as info:
            soak = checks.watch(server.url, plan.target.model, opts.soak_s)
            info["detail"] = (f"{soak.requests} requests, {soak.failed + soak.probe_failures} failed, "
                              f"p99 {soak.p99_ms or 0:.1f} ms")
    observer.sample()
    requests, errors = observer.totals()
    result.servers.append(ServerResult(
        server.url, server.strategy, "done", server.before, server.after, tuple(log.steps),
        requests, errors, time.monotonic() - t0,
        soak.to_dict() if soak else None, tuple(log.loads)))
    why = checks.breach(baseline, soak, opts.max_error_rate, opts.max_p99_increase) if soak else None
    if why:
        raise RolledBackError(f"rollout of {plan.target.model} {plan.target.version} stopped on {server.url}: "
                              f"{why}; every changed server was rolled back", reason="threshold_breached",
                              url=server.url, model=plan.target.model, version=plan.target.version)


def _finish(result: RolloutResult, started: float, repo: LocalRepository) -> None:
    result.seconds = time.monotonic() - started
    done = {s.url for s in result.servers}
    for server in result.plan.servers:
        if server.url not in done:
            result.servers.append(ServerResult(server.url, server.strategy, "not_started", server.before,
                                               server.before))
    for server_result in result.servers:
        append_record(repo.root, result.plan, server_result, result.outcome)


def _roll_back_all(executor: Executor, changed: list[tuple[ServerPlan, StepLog]], result: RolloutResult,
                   progress: Progress) -> None:
    """Roll every changed server back, newest first. A server that cannot be reached is marked failed."""
    for server, log in reversed(changed):
        outcome, after = "rolled_back", server.before
        try:
            executor.roll_back(server, log)
        except TrmError as exc:
            progress(f"could not roll back {server.url}: {exc.message.splitlines()[0]}")
            outcome, after = "failed", {}
        result.servers = [replace(r, outcome=outcome, after=after, steps=tuple(log.steps), loads=tuple(log.loads))
                          if r.url == server.url else r for r in result.servers]
    changed.clear()
