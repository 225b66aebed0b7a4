"""The agent loop: make one Triton server serve what an environment says, forever.

It composes trm's one-node operations rather than repeating them:

* **sync** (``repo_manager.ops.sync.sync_versions``): the versions the pointer names are installed into the
  node repository through the node cache (blobs verified, each version folder appears complete or not at
  all; a second pod on the node downloads nothing);
* **rollout** (``repo_manager.ops.rollout``, through ``agent/rollout.py``): per model, the plan ``trm rollout``
  makes for one server and its executor (pre-check under a temporary name, load beside, smoke check,
  switch, unload; rolled back on failure); the drain strategy is wrapped by the agent's own drain
  (readiness false, a slot in the environment's drain lease renewed by a heartbeat, in-flight requests
  finished) instead of operator commands, and is never pre-checked beside the old copy;
* **the store's conditional read** (``agent/pointer.py``): every interval (plus jitter) one
  If-None-Match GET of the pointer, no listing; an unchanged pointer costs a 304.

Readiness comes from the last good set (``agent/state.py``): a model the environment adds, loading or
refused, never takes the pod out of rotation. What the agent loaded is recorded in the repository
(``agent/record.py``), so models the environment drops are unloaded, also after a restart.

A version that fails (it does not load, does not answer, is corrupt in the store, cannot run on the
node) is *refused*: whatever was moved is rolled back, the server keeps serving the last good versions,
the agent reports ``degraded`` with the reason and tries again when the pointer moves, with a backoff
when it moves back to a set that already failed. A set refused because files are missing from the store
is also tried again, with the same backoff, while the pointer stays: pushing the files again repairs it
without a new promotion; so is a set refused because Triton declared a Python stub unhealthy during the
rollout (a stub its host stalled answers on a fresh load). Transient failures (store or Triton
unreachable) are retried with a backoff. Nothing in the loop raises out of it: the agent never exits on
a bad version, so Kubernetes never restarts it into a crash loop.

Killed at any moment, a restarted agent reads what the server has loaded (Triton keeps serving while the
agent is away), smoke-checks it, and converges from there: a half-finished rollout leaves old + new
loaded, which is the plan's ``before``; a half-finished sync left only staging folders, which readers
ignore, and partial downloads in the cache, which resume.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from repo_manager.adapters import metrics
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import Store, open_store
from repo_manager.adapters.transfer import Cancelled
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import (
    CompatibilityError,
    ConflictError,
    InputError,
    IntegrityError,
    ModelLoadError,
    NotFoundError,
    RolledBackError,
    ServerError,
    TrmError,
    UsageError,
    VerificationError,
)
from repo_manager.core.manifest import now_iso
from repo_manager.core.settings import Settings
from repo_manager.ops.agent import state
from repo_manager.ops.agent.lease import DEFAULT_TTL_S, MAX_TTL_S, MIN_TTL_S, DrainLease
from repo_manager.ops.agent.pointer import PointerWatch
from repo_manager.ops.agent.record import RECORD_NAME, AgentRecord, read_record, write_record
from repo_manager.ops.agent.rollout import LocalRollout
from repo_manager.ops.agent.state import AgentState, LoopMemo, Phase
from repo_manager.ops.rollout.checks import smoke_cases, smoke_live
from repo_manager.ops.rollout.plan import served_versions
from repo_manager.ops.serving import dependencies
from repo_manager.ops.sync import loaded_versions, sync_versions
from repo_manager.ops.sync.executor import prune_version
from repo_manager.ops.sync.plan import prune_actions
from repo_manager.ops.verify import STUB_DECLARED_UNHEALTHY

# what makes a version refused (until the pointer moves) rather than retried
# (InputError: the pointer names models a node repository cannot hold, e.g. two that differ only in case)
REFUSALS = (RolledBackError, ModelLoadError, VerificationError, IntegrityError, CompatibilityError,
            ConflictError, NotFoundError, UsageError, InputError)
VERIFY_PREFIX = "trm-verify-"  # publish.verify.temporary_names


@dataclass(frozen=True)
class AgentOptions:
    store: str
    env: str
    repository: Path
    cache: Path
    url: str
    grpc_url: str | None = None
    metrics_url: str | None = None
    """Triton's metrics endpoint, where an LLM's streams in flight are read; None: port 8002 of --url's host."""
    listen: str = "127.0.0.1:8090"
    interval_s: float = 5.0
    jitter: float = 0.2
    max_unavailable: int = 1
    side_by_side: bool = True
    pod: str = "agent"
    json_logs: bool = False
    drain_grace_s: float = 5.0
    """After readiness goes false, time for the load balancer to stop sending (readiness probe period)."""
    drain_timeout_s: float = 120.0
    head_timeout_s: float = 5.0
    """How long a connection to the agent's endpoint has to send its request head (``http.HEAD_TIMEOUT_S``,
    the endpoint's own default: tests/test_layers.py holds the two, and the CLI's, equal)."""
    lease_ttl_s: float = DEFAULT_TTL_S
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


class Agent:
    def __init__(self, options: AgentOptions, settings: Settings, store: Store | None = None) -> None:
        if options.interval_s <= 0 or not 0 <= options.jitter <= 1 or options.max_unavailable < 1:
            raise UsageError("--interval must be > 0, --jitter between 0 and 1, --max-unavailable >= 1")
        if not MIN_TTL_S <= options.lease_ttl_s <= MAX_TTL_S:
            raise UsageError(f"--lease-ttl must be between {MIN_TTL_S:g} and {MAX_TTL_S:g} seconds")
        self.options = options
        self.settings = settings.replace(repository=options.repository, cache_dir=options.cache)
        self.store = store or open_store(options.store, self.settings)
        self.repo = LocalRepository(options.repository)
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self.started_at = now_iso()
        self.current = AgentState()
        """What /status reports (changed under ``_lock``)."""
        self.memo = LoopMemo()
        self.watch = PointerWatch(self.store, options.env, self.log)
        self.backoff = state.Backoff(options.backoff_s, options.backoff_max_s)
        self.record_path = options.repository / RECORD_NAME
        self.record, note = read_record(self.record_path)
        if note:
            self.log(note)
        self.identity = _object_name(f"{options.pod}-{self.record.agent_id}")
        """Unique per agent (two pods may share a host name): its drain slot and its report's name."""
        self.lease = DrainLease(self.store, options.env, self.identity, options.max_unavailable,
                                options.lease_ttl_s, pod=options.pod)
        self.rollout = LocalRollout(self.repo, options.url, options.grpc_url, options.side_by_side,
                                    self.settings.rollout, self.log, self._drained, options.metrics_url,
                                    options.drain_timeout_s)

    # ------------------------------------------------------------------------------------- output
    def log(self, message: str, **facts: Any) -> None:
        if self.options.json_logs:
            line = json.dumps({"time": now_iso(), "pod": self.options.pod, "env": self.options.env,
                               "message": message, **facts}, default=str)
        else:
            line = f"{now_iso()} trm agent {self.options.pod}: {message}" + (
                f" {json.dumps(facts, default=str)}" if facts else "")
        print(line, file=sys.stderr, flush=True)

    def _set(self, phase: Phase, reason: str | None, *, ready: bool | None = None) -> None:
        now = self.current
        with self._lock:
            changed = (phase, reason) != (now.phase, now.reason)
            now.phase, now.reason = phase, reason
            if ready is not None:
                now.ready = ready and not now.draining
        if changed:
            self.log(phase.value + (f": {reason}" if reason else ""))
        if phase in (Phase.READY, Phase.DEGRADED):
            self._report()

    def _report(self) -> None:
        """Write this pod's report into the store when what it says changed (events, not a heartbeat:
        a fleet of 10,000 pods must not cost a PUT per pod per interval). ``trm promote`` reads the
        reports of a canary environment (promote/waves.py)."""
        now = self.current
        with self._lock:
            last = self.backoff.refused
            refused = {"models": last["models"], "reason": last["reason"]} if last else None
            body = {"schema": "trm.agent-report/1", "env": self.options.env, "pod": self.options.pod,
                    "agent": self.identity, "state": now.phase.value, "ready": now.ready, "served": dict(now.served),
                    "wanted": dict(now.wanted), "refused": refused}
        signature = json.dumps(body, sort_keys=True)
        if signature == self.memo.reported:
            return
        try:
            self.store.put_report(self.options.env, self.identity,
                                  json.dumps(body | {"at": now_iso()}, sort_keys=True).encode())
            self.memo.reported = signature
        except TrmError as exc:
            self.log("could not write the agent report", error=exc.message.splitlines()[0])

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot (what /status returns and /metrics renders)."""
        now = self.current
        with self._lock:
            return {
                "pod": self.options.pod, "agent": self.identity, "env": self.options.env,
                "store": self.store.location,
                "server": {"url": self.options.url, "grpc_url": self.options.grpc_url},
                "state": now.phase.value, "reason": now.reason, "ready": now.ready, "draining": now.draining,
                "degraded_reason": self.backoff.refused["reason"] if self.backoff.refused else None,
                "wanted": dict(now.wanted), "served": dict(now.served), "last_good": dict(self.record.good),
                "refused": dict(self.backoff.refused) if self.backoff.refused else None,
                "last_rollout": now.last_rollout.to_dict() if now.last_rollout else None,
                "rollouts": dict(now.rollouts),
                "pointer": self.watch.status(),
                "sync": now.sync.to_dict(),
                "lease_holders": list(now.lease_holders), "started_at": self.started_at,
                "options": {"interval_s": self.options.interval_s, "side_by_side": self.options.side_by_side,
                            "max_unavailable": self.options.max_unavailable,
                            "lease_ttl_s": self.options.lease_ttl_s},
            }

    # --------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        """Tick until ``stop_event`` is set (SIGTERM). Never raises for a bad version or a failure
        outside the agent: those are reported in /status and retried."""
        while not self.stop_event.is_set():
            try:
                self.tick()
            except TrmError as exc:
                self._transient(exc)
            except Exception as exc:  # noqa: BLE001 - a bug must not stop the sidecar; Triton keeps serving
                self.log("internal error", error=f"{type(exc).__name__}: {exc}",
                         traceback=traceback.format_exc(limit=5))
                self._transient(ServerError(f"internal error: {type(exc).__name__}: {exc}"))
            interval = self.options.interval_s
            self.stop_event.wait(interval + random.uniform(0, self.options.jitter * interval))

    def _client(self) -> TritonClient:
        return self.rollout.client()

    def tick(self) -> None:
        with self._client() as client:
            if not client.is_ready():
                with self._lock:
                    self.current.verified.clear()  # a restarted server has loaded nothing
                self._set(Phase.WAITING, f"Triton at {self.options.url} is not ready", ready=False)
                return
            if not self.memo.cleaned:
                self._clean_leftovers(client)
            self.watch.poll()
            if self.watch.pointer is None:
                self._set(Phase.WAITING, f"the pointer of {self.options.env} was never read: {self.watch.error}",
                          ready=False)
                return
            wanted = dict(self.watch.pointer.models)
            with self._lock:
                self.current.wanted = wanted
            served = self._read_served(client, wanted)
            self._unload_dropped(client, wanted)
            if all(served.get(m) == v for m, v in wanted.items()):
                if self._verify_served(client):
                    with self._lock:
                        self.backoff.refused = None
                    self._converged(wanted)
                    if self.memo.pruned_for != _key(wanted):
                        self._prune(wanted)
                return
            if self.backoff.holds(_key(wanted), self.watch.etag):
                self._verify_served(client)
                self._set(Phase.DEGRADED, _refusal_text(self.backoff.refused), ready=self._ready_now())
                return
            if self.backoff.waiting(_key(wanted)):
                return
            self._verify_served(client)  # a restarted agent: what it served keeps the pod ready meanwhile
        self.converge(wanted)

    def _read_served(self, client: TritonClient, wanted: dict[str, int]) -> dict[str, int | None]:
        """Per model of the environment: the one READY version, or None (absent, or several loaded)."""
        sets = served_versions(client, sorted(wanted))
        served = {m: (v[0] if len(v) == 1 else None) for m, v in sets.items()}
        with self._lock:
            self.current.served = served
            verified = self.current.verified
            for model, version in list(verified.items()):
                if served.get(model) != version:
                    del verified[model]
        return served

    def _verify_served(self, client: TritonClient) -> bool:
        """Smoke-check every served version not checked yet (after a restart of the agent). True when
        every served model answered."""
        for model, version in sorted(self.current.served.items()):
            if version is None or self.current.verified.get(model) == version:
                continue
            try:
                config = cfg.parse_config(self.repo.manifest(model, version).config)
                smoke_live(client, model, version, config, smoke_cases(config, None))
            except (TrmError, ValueError, TypeError) as exc:
                text = exc.message.splitlines()[0] if isinstance(exc, TrmError) else f"{type(exc).__name__}: {exc}"
                self._set(Phase.DEGRADED, f"{model} version {version} is loaded but does not answer: {text}",
                          ready=self._ready_now())
                return False
            with self._lock:
                self.current.verified[model] = version
        return True

    def _ready_now(self) -> bool:
        """Readiness from the last good set (``state.is_ready``)."""
        now = self.current
        with self._lock:
            return not now.draining and state.is_ready(now.wanted, self.record.good, now.served, now.verified)

    def _converged(self, wanted: dict[str, int]) -> None:
        """Every model of ``wanted`` served and answering: it is the last good set."""
        self._remember(good=wanted, add=set(wanted) | state.members(self.repo, wanted))
        self._set(Phase.READY, None, ready=True)

    def _remember(self, *, good: dict[str, int] | None = None, add: set[str] = frozenset(),
                  drop: set[str] = frozenset()) -> None:
        """Update the record (record.py) when it changes: on disk first, so that what /status shows was
        written (only this thread changes it)."""
        record = AgentRecord(self.record.agent_id, dict(self.record.good if good is None else good),
                             (self.record.loaded | add) - drop)
        if record == self.record:
            return
        try:
            write_record(self.record_path, record, self.options.env)
        except OSError as exc:
            self.log("could not write the agent record", path=str(self.record_path), error=str(exc))
        with self._lock:
            self.record = record

    def _clean_leftovers(self, client: TritonClient) -> None:
        """Unload pre-check models an agent killed mid-rollout left loaded under temporary names, and
        remove the staging folders a sync killed mid-way left in the node repository (Triton ignores
        them, but `trm validate` reports them and they hold disk). Nothing of this agent's is being
        written yet, so folders named with its own pid are a killed predecessor's too (pid 1 again in
        a restarted container)."""
        try:
            for folder in self.repo.clean_staging(ours=True):
                self.log("removed a staging folder a killed sync left", folder=str(folder))
        except OSError as exc:
            self.log("could not remove leftover staging folders", error=str(exc))
        # A pre-check model is loaded with file overrides, so it is not in the repository index (that
        # lists the folder); Triton's statistics list every loaded model, overrides included.
        loaded = {str(e.get("name", "")) for e in client.statistics()}
        loaded |= {str(e.get("name", "")) for e in client.repository_index() if e.get("state") == "READY"}
        for name in sorted(loaded):
            if name.startswith(VERIFY_PREFIX):
                try:
                    client.unload(name)
                    self.log("unloaded a leftover pre-check model", model=name)
                except TrmError:
                    pass
        self.memo.cleaned = True

    # ---------------------------------------------------------------------------------- converge
    def converge(self, wanted: dict[str, int]) -> None:
        """Sync ``wanted`` into the node repository, then roll every model that differs out on this
        server; refuse the whole set (rolling back what moved) when any model fails."""
        pointer_tag = self.watch.etag
        started, t0 = now_iso(), time.monotonic()
        record = state.RolloutReport(dict(wanted), started)
        self._set(Phase.SYNCING, f"installing {_fmt(wanted)} from {self.store.location}", ready=self._ready_now())
        try:
            with metrics.operation("sync"):
                result = sync_versions(self.settings, self.store, wanted, stop=self.stop_event)
            metrics.count_sync(result.bytes_downloaded, result.bytes_reused)
        except Cancelled:  # SIGTERM mid-download: stop now (the pod's grace period); the next start resumes
            self.log("sync stopped: the agent is stopping", wanted=_fmt(wanted))
            return
        except REFUSALS as exc:
            # a file missing from the store can appear under the same pointer (pushed again): retried on
            # the backoff; anything else the sync refuses (corrupt, incompatible) waits for the pointer
            self._refuse(wanted, pointer_tag, f"sync: {exc.message.splitlines()[0]}", record, t0,
                         stage="store" if isinstance(exc, NotFoundError) else "sync")
            return
        except TrmError as exc:
            self._transient(exc)
            return
        record.sync = state.SyncReport(tuple(result.installed), result.bytes_downloaded, result.bytes_reused,
                                       round(result.seconds, 3))
        with self._lock:
            self.current.sync.add(record.sync)
        conflict = state.pin_conflict(self.repo, wanted)
        if conflict:
            self._refuse(wanted, pointer_tag, conflict, record, t0, stage="sync")
            return
        # recorded before anything loads, so that an agent killed mid-way still unloads what it loaded
        self._remember(add=state.keep_loaded(self.repo, wanted, self.record.good, self.current.served))
        self._set(Phase.ROLLING_OUT, f"moving to {_fmt(wanted)}", ready=self._ready_now())
        moved: list[tuple[str, int | None]] = []
        try:
            prechecked = self.rollout.precheck_first(wanted)
            for model in self.rollout.top_level(wanted):
                with metrics.operation("rollout", model=model) as op:
                    outcome = self.rollout.roll_one(model, wanted[model], prechecked=model in prechecked)
                    op.outcome = "skipped" if outcome is None else ("ok" if outcome["outcome"] == "done"
                                                                    else outcome["outcome"])
                if outcome is not None:
                    with self._lock:
                        self.current.verified[model] = wanted[model]
                    moved.append((model, outcome["previous"]))
                    record.models.append(outcome)
        except REFUSALS as exc:
            self.rollout.undo(moved)
            # a stub Triton declared unhealthy (stalled by its host, or dead) is no verdict on the version
            stage = "host" if STUB_DECLARED_UNHEALTHY.search(exc.message) else "rollout"
            self._refuse(wanted, pointer_tag, exc.message.splitlines()[0], record, t0, stage=stage)
            return
        except TrmError as exc:
            self.rollout.undo(moved)
            self._transient(exc)
            return
        with self._lock:
            self.backoff.succeeded(_key(wanted))
            self.current.rollouts["done"] += 1
            self.current.last_rollout = record.end("done", None, time.monotonic() - t0)
        self.log("converged", models=wanted, seconds=round(time.monotonic() - t0, 3),
                 bytes_downloaded=result.bytes_downloaded)
        with self._client() as client:
            served = self._read_served(client, wanted)
            self._unload_dropped(client, wanted)
            if self._verify_served(client) and all(served.get(m) == v for m, v in wanted.items()):
                self._converged(wanted)

    def _unload_dropped(self, client: TritonClient, wanted: dict[str, int]) -> None:
        """Models this agent loaded (its record, so also those of an agent before a restart) that the
        environment no longer needs are unloaded, ensembles before their members; models loaded by anyone
        else are left alone."""
        if not self.record.loaded - set(wanted):
            return
        # members of the environment's ensembles stay loaded: judged once per change, not every tick
        served = self.current.served
        seen = json.dumps([sorted(self.record.loaded), wanted, self.record.good, served], sort_keys=True)
        if seen == self.memo.kept_for:
            return
        dropped = self.record.loaded - state.keep_loaded(self.repo, wanted, self.record.good, served)
        if not dropped:
            self.memo.kept_for = seen
            return
        loaded = {m: v for m, v in served_versions(client, sorted(dropped)).items() if v}
        inner = state.members(self.repo, {m: max(v) for m, v in loaded.items()})
        done = set(dropped - set(loaded))
        for model in sorted(loaded, key=lambda m: (m in inner, m)):
            try:
                client.unload(model)
                done.add(model)
                self.log("unloaded a model the environment no longer serves", model=model)
            except TrmError as exc:
                self.log("could not unload", model=model, error=exc.message.splitlines()[0])
        self._remember(drop=done)

    def _refuse(self, wanted: dict[str, int], etag: str | None, reason: str, record: state.RolloutReport,
                t0: float, *, stage: str = "rollout") -> None:
        """Keep serving the last good set and report why. ``stage`` "store" (a file missing from the
        store) is tried again after the backoff even while the pointer stays (the files can be pushed again
        under the same pointer; a retry downloads only what is missing), and so is "host" (a Python stub
        Triton declared unhealthy during the rollout: a stalled stub answers on a fresh load); "sync" (corrupt
        in the store, or not for this node) and "rollout" (failed on the server) are tried again only when
        the pointer moves."""
        key = _key(wanted)
        with self._lock:
            refused = self.backoff.refuse(key, {"models": dict(wanted), "etag": etag, "reason": reason,
                                                "at": now_iso(), "stage": stage})
            self.current.rollouts["refused"] += 1
            self.current.last_rollout = record.end("refused", reason, time.monotonic() - t0)
        with self._client() as client:
            try:
                self._read_served(client, wanted)
                self._verify_served(client)
            except TrmError:
                pass
        with self._lock:
            kept = state.good_now(wanted, self.current.served, self.current.verified)
        self._remember(good=kept)
        self._set(Phase.DEGRADED, _refusal_text(refused), ready=self._ready_now())

    def _transient(self, exc: TrmError) -> None:
        with self._lock:
            delay = self.backoff.transient()
            self.current.rollouts["failed"] += 1 if self.current.phase in (Phase.SYNCING, Phase.ROLLING_OUT) else 0
        self._set(Phase.ERROR, f"{exc.message.splitlines()[0]} (retrying in {delay:.0f} s)",
                  ready=self._ready_now() and not isinstance(exc, ServerError))

    def _prune(self, wanted: dict[str, int]) -> None:
        """Remove version folders the environment no longer serves and the server has not loaded (the
        node cache keeps their blobs, so going back costs no download)."""
        try:
            keep = dict(wanted)
            for model, version in wanted.items():
                keep.update(dict(dependencies(self.repo, model, version)))
            loaded = loaded_versions(self.options.url, sorted(keep))
            actions = prune_actions(self.repo, keep, loaded)
            for action in actions:
                if action.remove:
                    prune_version(self.repo, action.model, action.version)
            if all(a.remove for a in actions):  # else: again once the server has unloaded the old version
                self.memo.pruned_for = _key(wanted)
        except (TrmError, OSError) as exc:
            self.log("prune skipped", error=str(exc))

    # ------------------------------------------------------------------------------------- drain
    @contextmanager
    def _drained(self, models: list[str]) -> Iterator[None]:
        """Out of rotation for the body: a slot in the drain lease, renewed by a heartbeat the whole time
        (lease.py), readiness false, in-flight requests finished; back in rotation (and the slot freed)
        after."""
        max_unavailable = self.options.max_unavailable

        def waiting(holders: list[str]) -> None:
            with self._lock:
                self.current.lease_holders = holders
            self._set(Phase.WAITING_FOR_SLOT, f"{len(holders)} of {max_unavailable} pod(s) out of "
                      f"rotation: {', '.join(holders)}", ready=self._ready_now())

        if not self.lease.acquire(self.stop_event, waiting):
            raise ServerError("stopping before a drain slot was free; nothing changed")
        with self.lease.held(lambda problem: self.log("could not renew the drain slot", error=problem)):
            try:
                try:
                    holders = self.lease.holders()
                except TrmError:
                    holders = [self.options.pod]
                with self._lock:
                    self.current.draining, self.current.ready = True, False
                    self.current.lease_holders = holders
                self._set(Phase.DRAINING, f"out of rotation to swap {', '.join(models)}")
                self.stop_event.wait(self.options.drain_grace_s)
                self.rollout.wait_idle(models, self.options.drain_timeout_s)
                yield
            finally:
                with self._lock:
                    self.current.draining = False
                with self._client() as client:
                    try:
                        self._read_served(client, self.current.wanted)
                        self._verify_served(client)
                    except TrmError:
                        pass
                self._set(Phase.ROLLING_OUT, "back in rotation", ready=self._ready_now())
                time.sleep(min(self.options.drain_grace_s, 5.0))  # the load balancer sees the pod ready again
        with self._lock:
            self.current.lease_holders = []


def _fmt(models: dict[str, int]) -> str:
    return ", ".join(f"{m}:{v}" for m, v in sorted(models.items())) or "nothing"


def _object_name(pod: str) -> str:
    """``pod`` as a store object name: Kubernetes names may be longer (253) than store names (64)."""
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", pod) and ".." not in pod:
        return pod
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", pod).replace("..", "-").lstrip(".-")[:48] or "pod"
    return f"{clean}-{hashlib.sha256(pod.encode()).hexdigest()[:12]}"


def _refusal_text(refused: dict[str, Any]) -> str:
    return f"refused {_fmt(refused['models'])}: {refused['reason']}"


def _key(models: dict[str, int]) -> str:
    return _fmt(models)


def options_with(options: AgentOptions, **changes: Any) -> AgentOptions:
    return replace(options, **changes)
