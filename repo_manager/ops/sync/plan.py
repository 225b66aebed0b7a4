"""Plan a sync: what the environment serves, what the node lacks, what would be removed.

Building the plan reads the environment pointer and the manifests it names (manifests are immutable, so
one verified before is taken from the node cache: an unchanged environment costs one small read plus
local stats) and changes nothing. ``--dry-run`` prints the plan; ``execute`` runs the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repo_manager.adapters.cache import BlobCache
from repo_manager.adapters.repository import CONFIG_NAME, LocalRepository
from repo_manager.adapters.storage import Store
from repo_manager.core import config as cfg
from repo_manager.core import paths
from repo_manager.core.errors import (
    CompatibilityError,
    InputError,
    IntegrityError,
    NotFoundError,
    UsageError,
    VersionExistsError,
)
from repo_manager.core.localized import is_installed, localized_paths
from repo_manager.core.manifest import MANIFEST_NAME, Manifest, check_model_name

if TYPE_CHECKING:
    from repo_manager.ops.llm.node import NodeFacts

PRESENT, INSTALL, REPLACE = "present", "install", "replace"


@dataclass(frozen=True)
class ModelAction:
    model: str
    version: int
    action: str
    """present: nothing to do; install: a new version folder; replace: the folder exists but is incomplete
    or damaged and is swapped for a complete one."""
    config_change: bool
    files: int
    bytes: int
    manifest: Manifest = field(repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "action": self.action,
                "config_change": self.config_change, "files": self.files, "bytes": self.bytes}


@dataclass(frozen=True)
class BlobFetch:
    digest: str
    size: int


@dataclass(frozen=True)
class PruneAction:
    model: str
    version: int
    remove: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "remove": self.remove, "reason": self.reason}


@dataclass(frozen=True)
class SyncPlan:
    store: str
    env: str | None
    repository: Path
    cache: Path
    models: tuple[ModelAction, ...]
    fetch: tuple[BlobFetch, ...]
    reuse_bytes: int
    prune: tuple[PruneAction, ...]
    gc: bool
    remote_reads: int
    """Objects read from the store to build this plan (the pointer and the manifests)."""
    pointer_etag: str | None = None
    """The store's tag of the environment pointer this plan was built from (the no-op path's key)."""
    selection: tuple[str, ...] = ()
    """The models asked for (``--model``); empty: the whole environment."""
    part_size: int | None = None
    """Bytes per ranged request for the blobs this plan fetches (the ``sync_part_size`` setting)."""

    @property
    def fetch_bytes(self) -> int:
        return sum(b.size for b in self.fetch)

    @property
    def unchanged(self) -> bool:
        return all(m.action == PRESENT and not m.config_change for m in self.models) and \
            not any(p.remove for p in self.prune)

    def needed_digests(self) -> set[str]:
        return {f.sha256 for m in self.models for f in m.manifest.files}

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "env": self.env, "repository": str(self.repository), "cache": str(self.cache),
                "models": [m.to_dict() for m in self.models], "download_blobs": len(self.fetch),
                "download_bytes": self.fetch_bytes, "reuse_bytes": self.reuse_bytes,
                "prune": [p.to_dict() for p in self.prune], "gc": self.gc, "remote_reads": self.remote_reads}

    def describe(self) -> str:
        lines = [f"sync {self.store}" + (f" env {self.env}" if self.env else "") + f" -> {self.repository}"]
        for m in self.models:
            lines.append(f"  {m.model}/{m.version}: {m.action}" + (", config.pbtxt replaced" if m.config_change
                                                                     else ""))
        lines.append(f"  download {len(self.fetch)} blobs ({self.fetch_bytes} bytes), "
                     f"reuse {self.reuse_bytes} bytes from {self.cache}")
        for p in self.prune:
            lines.append(f"  {'remove' if p.remove else 'keep'} {p.model}/{p.version}: {p.reason}")
        return "\n".join(lines)


def wanted_versions(store: Store, env: str | None,
                    models: tuple[str, ...]) -> tuple[dict[str, int], int, str | None]:
    """(model -> version to serve, remote reads, the pointer's tag). With an environment: its pointer
    (one read), limited to ``models`` if given. Without: the newest version in the store of each of
    ``models``."""
    for model in models:
        check_model_name(model)
    if env is None:
        if not models:
            raise UsageError("give --env, or --model to sync the newest version of each model")
        wanted = {}
        for model in models:
            versions = store.list_versions(model)
            if not versions:
                raise NotFoundError(f"model {model} has no version in {store.location}", model=model)
            wanted[model] = versions[-1]
        return wanted, len(models), None
    pointer = store.get_env(env)
    if models:
        absent = sorted(set(models) - set(pointer.models))
        if absent:
            raise NotFoundError(f"environment {env} in {store.location} does not serve {', '.join(absent)}",
                                env=env)
        return {m: pointer.models[m] for m in models}, 1, pointer.etag
    return dict(pointer.models), 1, pointer.etag


def load_manifest(store: Store, model: str, version: int) -> tuple[Manifest, bytes, int]:
    """The manifest as the store holds it, checked (its config parsed), its canonical bytes (what trm
    writes as trm-manifest.json) and the remote reads it cost (1).

    Always read from the store, never from the node cache: the cache is shared by every pod of the node,
    so a manifest kept there would be believed on the word of whoever can write that folder (a forged
    ``verification``, another config). A manifest is one small GET; the blobs it names are what the
    cache saves."""
    manifest = store.get_manifest(model, version)
    check_manifest_config(manifest)
    return manifest, manifest.to_json(), 1


def check_manifest_config(manifest: Manifest) -> cfg.ModelConfig:
    origin = f"config in the manifest of {manifest.model}/{manifest.version}"
    try:
        config = cfg.parse_config(manifest.config, origin)
    except Exception as exc:
        raise IntegrityError(f"{origin} is not a valid Triton config") from exc
    if config.name and config.name != manifest.model:
        raise IntegrityError(f"{origin} names another model ({config.name!r})")
    return config


def local_state(repo: LocalRepository, manifest: Manifest, payload: bytes | None = None) -> str:
    """PRESENT if the version folder holds exactly this manifest and files of the right size, else what
    to do. A different version under the same number is a conflict: versions are immutable."""
    folder = repo.version_dir(manifest.model, manifest.version)
    if not folder.exists() and not folder.is_symlink():
        return INSTALL
    if folder.is_symlink() or not folder.is_dir():
        return REPLACE
    try:
        # the common case, an unchanged version: the same bytes trm wrote, no parsing needed
        local_payload = (folder / MANIFEST_NAME).read_bytes()
        same = local_payload == (payload or manifest.to_json())
        local = manifest if same else Manifest.from_json(local_payload, str(folder))
    except (OSError, IntegrityError):
        return REPLACE  # no (valid) manifest: an incomplete folder that readers ignore
    if local.files != manifest.files or local.config != manifest.config:
        raise VersionExistsError(f"{folder} holds a different version {manifest.version} of {manifest.model} "
                                 "than the store; it is never replaced",
                                 hint="move it away (versions are immutable), or sync into another --repo",
                                 model=manifest.model, version=manifest.version, path=str(folder))
    if local != manifest:  # the same files and config, other facts (a forged `verification`): the store's
        return REPLACE
    localized = localized_paths(manifest.config)
    for entry in manifest.files:
        path = folder / entry.path
        try:
            if path.is_symlink():
                return REPLACE
            if entry.path in localized:  # read and compared: it must also name this folder
                if not is_installed(folder, entry):
                    return REPLACE
            elif path.stat().st_size != entry.size:
                return REPLACE
        except FileNotFoundError:
            return REPLACE
    return PRESENT


def check_target(repo: LocalRepository, model: str, version: int, wanted: dict[str, int],
                 local: dict[str, list[str]]) -> None:
    """Before anything is fetched: the version folder and config.pbtxt are reached through real folders of
    the repository (paths.py), and no other model of the repository (``local``: casefolded name -> folder
    names) or of the plan differs only in case."""
    paths.check_within(repo.root, repo.version_dir(model, version) / MANIFEST_NAME)
    paths.check_within(repo.root, repo.model_dir(model) / CONFIG_NAME)
    if any(name != model for name in local.get(model.casefold(), [])):
        repo.check_no_case_twin(model)  # raises, naming them
    twins = sorted(m for m in wanted if m != model and m.casefold() == model.casefold())
    if twins:
        raise InputError(f"the store asks for models {model} and {', '.join(twins)}, which differ only in case",
                         hint="they would collide on a case-insensitive filesystem: rename one in the store",
                         model=model)


def config_differs(repo: LocalRepository, manifest: Manifest) -> bool:
    try:
        return (repo.model_dir(manifest.model) / CONFIG_NAME).read_text() != repo.installed_config(manifest) \
            or repo.model_files_differ(manifest)
    except (OSError, UnicodeDecodeError):
        return True


def prune_actions(repo: LocalRepository, wanted: dict[str, int], loaded: dict[str, list[int]]) -> list[PruneAction]:
    actions = []
    for model, keep in sorted(wanted.items()):
        folder = repo.model_dir(model)
        if not folder.is_dir() or folder.is_symlink():
            continue
        for child in sorted(folder.iterdir(), key=lambda p: p.name):
            if not child.name.isdigit() or int(child.name) == keep:
                continue
            version = int(child.name)
            if version in loaded.get(model, []):
                actions.append(PruneAction(model, version, False, "still loaded on the Triton server"))
            else:
                actions.append(PruneAction(model, version, True, "not served by the environment"))
    return actions


def _from_tensorrt_llm(manifest: Manifest) -> bool:
    """A cheap pre-filter of ``llm.doctor.holds_engine`` (which judges only TensorRT-LLM versions)."""
    return isinstance(manifest.source, dict) and manifest.source.get("kind") == "tensorrt-llm"


def check_engines(actions: list[ModelAction], node: NodeFacts | None) -> None:
    """Refuse the whole plan (CompatibilityError, before anything changes) when a version it would
    install holds an engine this node cannot run. The node is probed only when such a version is in the
    plan, so a node without a GPU syncs models without engines as before."""
    if all(a.action == PRESENT or not _from_tensorrt_llm(a.manifest) for a in actions):
        return  # nothing an engine check judges: do not pay for importing the LLM checks
    from repo_manager.ops.llm.doctor import check_engine_compatible, holds_engine  # noqa: PLC0415 - only for a version that holds an engine
    from repo_manager.ops.llm.node import probe_node  # noqa: PLC0415 - only for a version that holds an engine

    engines = [a for a in actions if a.action != PRESENT and holds_engine(a.manifest)]
    if not engines:
        return
    node = node if node is not None else probe_node()
    for action in engines:
        try:
            check_engine_compatible(action.manifest, node)
        except CompatibilityError as exc:
            others = sorted(a.model for a in actions if a.model not in {e.model for e in engines})
            raise CompatibilityError(exc.message, hint="`trm doctor` lists every check; "
                                     + (f"sync the other models with --model ({', '.join(others)})" if others
                                        else "serve this environment from a node with a matching GPU"),
                                     **exc.facts) from exc
        except (ArithmeticError, AttributeError, KeyError, TypeError, ValueError) as exc:
            # the engine facts come from the store: malformed ones are hostile content, not a bug
            raise IntegrityError(f"the engine record in the manifest of {action.model}/{action.version} is "
                                 f"malformed ({type(exc).__name__})", model=action.model,
                                 version=action.version) from exc


def build_plan(store: Store, repo: LocalRepository, cache: BlobCache, *, env: str | None,
               models: tuple[str, ...] = (), prune: bool = False,
               loaded: dict[str, list[int]] | None = None, node: NodeFacts | None = None,
               versions: dict[str, int] | None = None) -> SyncPlan:
    """``node``: the facts engines are checked against (default: this node, probed when needed).
    ``versions`` (model -> version) replaces the environment's pointer: what a rollout installs.
    Ensemble members pinned by a wanted version are wanted too, at the pinned version."""
    etag = None
    if versions is not None:
        wanted, reads = {check_model_name(m): v for m, v in versions.items()}, 0
    else:
        wanted, reads, etag = wanted_versions(store, env, models)
    actions: list[ModelAction] = []
    fetch: dict[str, BlobFetch] = {}
    reuse = 0
    queue = sorted(wanted.items())
    local: dict[str, list[str]] = {}
    if repo.root.is_dir():  # one listing for the whole plan (an unchanged sync stays a few stats)
        for entry in repo.root.iterdir():
            local.setdefault(entry.name.casefold(), []).append(entry.name)
    while queue:
        model, version = queue.pop(0)
        check_target(repo, model, version, wanted, local)
        manifest, payload, cost = load_manifest(store, model, version)
        reads += cost
        for member, member_version in sorted(manifest.members.items()):
            if member not in wanted:
                wanted[member] = member_version
                queue.append((member, member_version))
        state = local_state(repo, manifest, payload)
        actions.append(ModelAction(model, version, state, config_differs(repo, manifest), len(manifest.files),
                                   manifest.total_size, manifest))
        if state == PRESENT:
            continue
        for entry in manifest.files:
            if entry.sha256 in fetch:
                continue
            if cache.has(entry.sha256, entry.size):
                reuse += entry.size
            else:
                fetch[entry.sha256] = BlobFetch(entry.sha256, entry.size)
    check_engines(actions, node)
    pruning = prune_actions(repo, wanted, loaded or {}) if prune else []
    return SyncPlan(store.location, env, repo.root, cache.root, tuple(actions), tuple(fetch.values()), reuse,
                    tuple(pruning), prune, reads, etag if versions is None else None, tuple(sorted(models)),
                    part_size=cache.part_size)
