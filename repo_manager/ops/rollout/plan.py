"""The rollout plan: what will happen on each server, decided before anything changes.

``build_plan`` reads the repository (the target version, its ensemble members and their sizes) and asks
every server which versions of the model and its members it has loaded. The resulting ``RolloutPlan``
says, per server, the versions before and after, the strategy and why. ``--dry-run`` prints exactly this
object, and ``execute`` runs exactly this object.

Strategies:

* ``side-by-side`` (default): load the new version beside the old one, check it, make it the version
  unversioned requests reach, unload the old one. No request fails (see docs/rollout.md for the
  experiments on tritonserver 2.51 this relies on).
* ``drain``: when the model cannot be loaded twice on one server (``--no-side-by-side``, or old + new
  files exceed ``--memory-budget``): the operator's drain command takes the server out of rotation,
  the old version is unloaded, the new one loaded and checked, and the restore command brings it back.
* ``switch``: the new version's inputs, outputs or batching differ from the old one's. Triton keeps one
  config per model, so the old version cannot be loaded beside the new one under the new config; the
  model is reloaded once with only the new version (Triton loads it before it unloads the old one).
* ``skip``: the server already serves exactly the target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import NotFoundError, UsageError
from repo_manager.core.manifest import Manifest
from repo_manager.ops.rollout.checks import generates
from repo_manager.ops.rollout.streams import metrics_url_for, planned_memory
from repo_manager.ops.serving import dependencies

if TYPE_CHECKING:
    from repo_manager.ops.sync.plan import SyncPlan

SIDE_BY_SIDE, SWITCH, DRAIN, SKIP = "side-by-side", "switch", "drain", "skip"


@dataclass(frozen=True)
class RolloutOptions:
    canary: int = 0
    soak_s: float = 0.0
    max_error_rate: float = 0.0
    """Largest tolerated share of failed requests (Triton statistics + trm's probes) during a soak."""
    max_p99_increase: float = 0.5
    """Largest tolerated p99 growth during a soak, as a fraction of the p99 before (0.5 = +50 %)."""
    keep_previous: bool = False
    side_by_side: bool = True
    memory_budget: int | None = None
    """Bytes one server may hold for this model; old + new above it forces the drain strategy."""
    drain_cmd: str | None = None
    restore_cmd: str | None = None
    precheck: bool = True
    """Load and smoke-check the new version under a temporary name before touching the live model."""
    smoke_file: Path | None = None
    stream_drain_s: float = 120.0
    """LLM models: longest wait for the old version's streams in flight before it is unloaded."""


@dataclass(frozen=True)
class ModelSet:
    """A model and the member versions it pins (empty for a plain model)."""

    model: str
    version: int
    members: tuple[tuple[str, int], ...] = ()
    """Ensemble members, deepest first, with the versions this version pins."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "members": dict(self.members)}


@dataclass(frozen=True)
class ServerPlan:
    url: str
    grpc_url: str | None
    """Where trm sends load/unload (see TritonClient); None: over HTTP, which stalls some HTTP clients."""
    before: dict[str, tuple[int, ...]]
    """Loaded (READY) versions of the model and of every member, before the rollout."""
    after: dict[str, tuple[int, ...]]
    strategy: str
    reason: str
    canary: bool = False
    metrics_url: str | None = None
    """Triton's metrics endpoint (an LLM's streams in flight are read there); None: not an LLM rollout."""

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "grpc_url": self.grpc_url, "metrics_url": self.metrics_url,
                "before": {k: list(v) for k, v in self.before.items()},
                "after": {k: list(v) for k, v in self.after.items()}, "strategy": self.strategy,
                "reason": self.reason, "canary": self.canary}


@dataclass(frozen=True)
class RolloutPlan:
    target: ModelSet
    servers: tuple[ServerPlan, ...]
    options: RolloutOptions
    repository: str
    to_previous: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    install: SyncPlan | None = field(default=None, compare=False)
    """``--from STORE``: what is installed into the repository first (nothing is written while planning)."""

    def to_dict(self) -> dict[str, Any]:
        opts = self.options
        install = None if self.install is None else {
            "store": self.install.store, "fetch_bytes": self.install.fetch_bytes,
            "versions": [a.to_dict() for a in self.install.models]}
        return {"target": self.target.to_dict(), "repository": self.repository, "install": install,
                "to_previous": self.to_previous, "servers": [s.to_dict() for s in self.servers],
                "options": {"canary": opts.canary, "soak_s": opts.soak_s,
                            "max_error_rate": opts.max_error_rate, "max_p99_increase": opts.max_p99_increase,
                            "keep_previous": opts.keep_previous, "precheck": opts.precheck,
                            "smoke_file": str(opts.smoke_file) if opts.smoke_file else None},
                "notes": list(self.notes)}

    def describe(self) -> str:
        lines = [f"rollout {self.target.model} -> version {self.target.version}"
                 + (f" (members {', '.join(f'{m}:{v}' for m, v in self.target.members)})"
                    if self.target.members else "")]
        if self.install is not None:
            new = [f"{a.model}:{a.version}" for a in self.install.models if a.action != "present"]
            lines.append(f"  install from {self.install.store}: " + (
                f"{', '.join(new)} ({self.install.fetch_bytes:,} bytes to fetch)" if new else "already installed"))
        for index, server in enumerate(self.servers, 1):
            before = _versions_text(server.before)
            after = _versions_text(server.after)
            tag = " [canary]" if server.canary else ""
            control = f" (control {server.grpc_url})" if server.grpc_url else ""
            lines.append(f"  {index}. {server.url}{control}{tag}: {before} -> {after}  "
                         f"strategy {server.strategy} ({server.reason})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _versions_text(versions: dict[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{m}:{'/'.join(map(str, v)) or '-'}" for m, v in versions.items())


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str | int | None) -> int | None:
    """``24GiB``, ``500MB``, ``1000000`` -> bytes (None stays None)."""
    if text is None or isinstance(text, int):
        return text
    number = str(text).strip().lower()
    unit = number.lstrip("0123456789.")
    try:
        return int(float(number[: len(number) - len(unit)]) * _UNITS[unit.strip()])
    except (ValueError, KeyError) as exc:
        raise UsageError(f"memory budget {text!r} is not a size", hint="e.g. 24GiB, 500MB, 1000000") from exc


def with_settings(options: RolloutOptions, model: str, rollout_settings: dict[str, Any]) -> RolloutOptions:
    """Options not given on the command line come from the ``rollout`` settings (configs/trm.yaml)."""
    changes: dict[str, Any] = {}
    if options.memory_budget is None and rollout_settings.get("memory_budget") is not None:
        changes["memory_budget"] = parse_size(rollout_settings["memory_budget"])
    if model in (rollout_settings.get("single_copy_models") or []):
        changes["side_by_side"] = False
    return dataclasses.replace(options, **changes) if changes else options


class PlannedRepository(LocalRepository):
    """``repo`` as it will be once ``install`` (a sync plan) has run: the versions it installs read from their
    store manifests, the others from disk. For planning only: nothing here writes."""

    def __init__(self, repo: LocalRepository, install: SyncPlan) -> None:
        super().__init__(repo.root)
        self._planned = {(a.model, a.version): a.manifest for a in install.models}

    def versions(self, model: str) -> list[int]:
        planned = {v for m, v in self._planned if m == model}
        return sorted(set(super().versions(model)) | planned)

    def manifest(self, model: str, version: int | None = None) -> Manifest:
        version = self.latest(model) if version is None else version
        planned = self._planned.get((model, version))
        return planned if planned is not None else super().manifest(model, version)


def model_set(repo: LocalRepository, model: str, version: int) -> ModelSet:
    repo.manifest(model, version)  # NotFoundError naming the model and version
    return ModelSet(model, version, tuple(dependencies(repo, model, version)))


def footprint(repo: LocalRepository, target: ModelSet) -> dict[str, int]:
    """Bytes per model of the target set that one loaded copy needs: an LLM version's planned memory
    (``streams.planned_memory``), else the bytes of its files (a proxy)."""
    sizes = {}
    for name, version in [(target.model, target.version), *target.members]:
        manifest = repo.manifest(name, version)
        planned = planned_memory(manifest)
        sizes[name] = planned[0] if planned else manifest.total_size
    return sizes


def planned_capacity(repo: LocalRepository, target: ModelSet) -> int | None:
    """The memory the target version's LLM plan was made for (None: no plan), the budget side by side is
    judged against when none is given."""
    planned = planned_memory(repo.manifest(target.model, target.version))
    return planned[1] if planned else None


def served_versions(client: TritonClient, names: list[str]) -> dict[str, tuple[int, ...]]:
    index = client.repository_index()
    return {name: tuple(sorted(int(e["version"]) for e in index if e.get("name") == name
                               and e.get("state") == "READY" and e.get("version"))) for name in names}


def previous_version(repo: LocalRepository, model: str, serving: list[int]) -> int:
    """For --to-previous: the newest published version below the newest one the servers serve."""
    if not serving:
        raise NotFoundError(f"no server serves {model}, so there is no previous version to go back to",
                            model=model)
    older = [v for v in repo.versions(model) if v < max(serving)]
    if not older:
        raise NotFoundError(f"{model} has no published version older than {max(serving)}",
                            hint="roll out a specific version with --version", model=model)
    return older[-1]


def interface(repo: LocalRepository, model: str, version: int) -> tuple[Any, ...]:
    """What the old version's files depend on: tensors and whether there is a batch axis (not the batch
    size, instances or batcher settings, which any version runs under)."""
    config = cfg.parse_config(repo.manifest(model, version).config)
    inputs, outputs = cfg.tensor_specs(config)
    return tuple(inputs), tuple(outputs), config.max_batch_size > 0


def interface_change(repo: LocalRepository, target: ModelSet, before: dict[str, tuple[int, ...]]) -> str | None:
    """The old version of a plain model whose interface differs from the target's, as a reason."""
    if target.members:
        return None  # an ensemble switches in one reload anyway
    wanted = interface(repo, target.model, target.version)
    for version in before.get(target.model, ()):
        if interface(repo, target.model, version) != wanted:
            return (f"inputs/outputs differ from version {version}, which cannot run under the new config: "
                    "one reload with only the new version")
    return None


class ServedElsewhereError(UsageError):
    """A server serves versions this repository does not hold (loaded by someone else, or from another
    repository): a rollback could not restore them, so there is no rollout plan."""

    def __init__(self, url: str, model: str, versions: tuple[int, ...], root: Path) -> None:
        super().__init__(f"{url} serves {model} version(s) {list(versions)}, which {root} does not hold, so a "
                         "rollback could not restore them", hint="pass the --repo the servers read")
        self.url, self.model, self.versions = url, model, versions


def decide_strategy(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]],
                    sizes: dict[str, int], target: ModelSet, options: RolloutOptions,
                    changed_interface: str | None = None, capacity: int | None = None) -> tuple[str, str]:
    """``capacity``: the memory an LLM version's plan was made for, the budget when none is given (an LLM
    version loaded beside another needs its planned memory twice)."""
    if before == after:
        return SKIP, "already serves the target"
    if not before.get(target.model):
        return SIDE_BY_SIDE, f"{target.model} is not loaded yet: plain load"
    if not options.side_by_side:
        return DRAIN, "cannot be loaded twice (--no-side-by-side or settings rollout.single_copy_models)"
    budget = options.memory_budget if options.memory_budget is not None else capacity
    if budget is not None:
        # Peak while both are loaded: every model whose version changes holds old + new copies.
        peak = sum(sizes[name] * (2 if set(after[name]) - set(before.get(name, ())) and before.get(name)
                                  else 1) for name in sizes)
        what = "the memory budget" if options.memory_budget is not None else "the memory the LLM plan is for"
        if peak > budget:
            return DRAIN, f"old + new need about {peak} bytes, over {what} ({budget})"
        if not changed_interface:
            return SIDE_BY_SIDE, f"old + new ({peak} bytes) fit {what} ({budget})"
    if changed_interface:
        return SWITCH, changed_interface
    return SIDE_BY_SIDE, "new version loads beside the old one"


def build_plan(repo: LocalRepository, model: str, version: int | None, urls: list[str],
               options: RolloutOptions, *, to_previous: bool = False,
               grpc_urls: list[str] | None = None, metrics_urls: list[str] | None = None) -> RolloutPlan:
    if not urls:
        raise UsageError("give at least one --url of a Triton server in explicit model-control mode")
    if grpc_urls and len(grpc_urls) != len(urls):
        raise UsageError(f"{len(grpc_urls)} --grpc-url for {len(urls)} --url",
                         hint="give one --grpc-url per --url, in the same order, or none")
    if metrics_urls and len(metrics_urls) != len(urls):
        raise UsageError(f"{len(metrics_urls)} --metrics-url for {len(urls)} --url",
                         hint="give one --metrics-url per --url, in the same order, or none")
    if len(set(urls)) != len(urls):
        raise UsageError("the same --url is given twice")
    if options.canary < 0 or options.canary > len(urls):
        raise UsageError(f"--canary {options.canary} must be between 0 and the number of servers ({len(urls)})")
    if (version is None) == (not to_previous):
        raise UsageError("give either --version N or --to-previous")
    if to_previous:
        if options.keep_previous:
            raise UsageError("--to-previous with --keep-previous would leave the newer version answering "
                             "unversioned requests", hint="drop --keep-previous")
        serving: set[int] = set()
        for url in urls:
            with TritonClient(url, timeout_s=10.0) as client:
                client.require_ready()
                serving |= set(served_versions(client, [model])[model])
        version = previous_version(repo, model, sorted(serving))
    assert version is not None
    target = model_set(repo, model, version)
    names = [model] + [m for m, _ in target.members]
    sizes = footprint(repo, target)
    capacity = planned_capacity(repo, target)
    streaming = generates(cfg.parse_config(repo.manifest(model, version).config))
    servers = []
    notes = []
    for index, url in enumerate(urls):
        with TritonClient(url, timeout_s=10.0) as client:
            client.require_ready()
            before = served_versions(client, names)
        wanted = dict(target.members) | {model: version}
        after = {}
        if options.keep_previous and any(v > version for v in before.get(model, ())):
            raise UsageError(f"{url} serves a version of {model} newer than {version}; with --keep-previous "
                             "it would keep answering unversioned requests", hint="drop --keep-previous")
        for name in names:
            # An ensemble has one config for all its versions, so only its members can keep old versions.
            keeps = options.keep_previous and not (name == model and target.members)
            keep = before.get(name, ()) if keeps else ()
            after[name] = tuple(sorted(set(keep) | {wanted[name]}))
        for name, versions in before.items():
            missing = [v for v in versions if v not in repo.versions(name)]
            if missing:
                raise ServedElsewhereError(url, name, tuple(missing), repo.root)
        strategy, reason = decide_strategy(before, after, sizes, target, options,
                                           interface_change(repo, target, before), capacity)
        if strategy == DRAIN and not (options.drain_cmd and options.restore_cmd):
            raise UsageError(f"{url} needs the drain strategy ({reason}) but no --drain-cmd/--restore-cmd "
                             "was given", hint="give the commands that take a server out of rotation and "
                                               "bring it back, or raise --memory-budget")
        if strategy in (DRAIN, SWITCH) and options.keep_previous:
            after = {name: (wanted[name],) for name in names}
            reason += "; --keep-previous is impossible when only one copy fits"
        grpc_url = grpc_urls[index] if grpc_urls else None
        metrics_url = (metrics_url_for(url, metrics_urls[index] if metrics_urls else None)
                       if streaming else None)
        servers.append(ServerPlan(url, grpc_url, before, after, strategy, reason, canary=index < options.canary,
                                  metrics_url=metrics_url))
    if not grpc_urls:
        notes.append("model control over HTTP: Triton runs each load on one HTTP worker thread, so some HTTP "
                     "clients wait for the whole load; give --grpc-url per server to avoid it")
    if target.members:
        notes.append("ensemble: members load beside their old versions first, then the ensemble switches "
                     "in one reload, then old members are unloaded; each request is all old or all new")
    return RolloutPlan(target, tuple(servers), options, str(repo.root), to_previous, tuple(notes))
