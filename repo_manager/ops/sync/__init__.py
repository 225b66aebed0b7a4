"""`trm sync`: make a node's local Triton repository serve what an environment in a store says.

``plan_sync`` reads the pointer and manifests and decides (changing nothing); ``execute`` carries the
plan out. See ``adapters/cache.py`` (the shared node cache), ``adapters/transfer.py`` (its ranged downloads),
``plan.py``, ``executor.py`` and ``noop.py`` (an unchanged environment: one conditional read and local stats).

Importing this package is cheap: the planner, executor and their dependencies (protobuf, the store
adapters) are imported when a function needs them, so ``trm sync`` of an unchanged environment never
loads them.
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: `noop` (in this package) is light
if TYPE_CHECKING:
    import threading
    from pathlib import Path
    from typing import Any

    from repo_manager.adapters.storage import Store
    from repo_manager.core.settings import Settings
    from repo_manager.ops.llm.node import NodeFacts
    from repo_manager.ops.sync.plan import SyncPlan
    from repo_manager.ops.sync.result import SyncProgress, SyncResult

__all__ = ["SyncPlan", "SyncProgress", "SyncResult", "cache_dir_for", "execute", "node_cache", "plan_sync",
           "plan_versions", "sync", "sync_versions"]


def cache_dir_for(settings: Settings) -> Path:
    """The node cache: ``settings.cache_dir``, else ``.trm-cache`` beside the repository (same
    filesystem, so files can be hard links)."""
    from pathlib import Path  # noqa: PLC0415 - this package's import stays light (see noop.py)

    return Path(node_cache(settings.repository, settings.cache_dir))


def node_cache(repository: str | Path, cache_dir: str | Path | None) -> str:
    """``cache_dir_for`` from the two settings it reads (`repo_manager/entry.py` has no Settings)."""
    from repo_manager.ops.sync.noop import absolute  # noqa: PLC0415 - off the quick sync path

    if cache_dir is not None:
        return os.fspath(cache_dir)
    return os.path.join(os.path.dirname(absolute(repository)), ".trm-cache")


def __getattr__(name: str) -> Any:
    if name == "execute":
        from repo_manager.ops.sync.executor import execute  # noqa: PLC0415 - off the quick sync path

        return execute
    if name in ("SyncProgress", "SyncResult"):
        from repo_manager.ops.sync import result  # noqa: PLC0415 - off the quick sync path

        return getattr(result, name)
    if name == "SyncPlan":
        from repo_manager.ops.sync.plan import SyncPlan  # noqa: PLC0415 - off the quick sync path

        return SyncPlan
    raise AttributeError(name)


def loaded_versions(url: str, models: list[str]) -> dict[str, list[int]]:
    """Versions of ``models`` the running Triton at ``url`` has loaded (a ServerError when unreachable:
    pruning never guesses)."""
    from repo_manager.adapters.triton.client import TritonClient  # noqa: PLC0415 - off the quick sync path

    with TritonClient(url) as client:
        client.require_ready()
        index = client.repository_index()
    loaded: dict[str, list[int]] = {}
    for entry in index:
        if entry.get("name") in models and entry.get("state") in ("READY", "LOADING", "UNLOADING") \
                and str(entry.get("version", "")).isdigit():
            loaded.setdefault(entry["name"], []).append(int(entry["version"]))
    return loaded


def plan_sync(settings: Settings, store: Store, *, env: str | None, models: tuple[str, ...] = (),
              prune: bool = False, node: NodeFacts | None = None) -> SyncPlan:
    """The plan; CompatibilityError when a version to install holds an engine ``node`` (default: this
    node) cannot run."""
    from repo_manager.adapters.cache import BlobCache  # noqa: PLC0415 - off the quick sync path
    from repo_manager.adapters.repository import LocalRepository  # noqa: PLC0415 - off the quick sync path
    from repo_manager.ops.sync.plan import build_plan  # noqa: PLC0415 - off the quick sync path

    repo = LocalRepository(settings.repository)
    cache = BlobCache(cache_dir_for(settings), part_size=settings.sync_part_size)
    loaded = None
    if prune and settings.triton_url:
        wanted_models = list(models) or (list(store.get_env(env).models) if env else [])
        loaded = loaded_versions(settings.triton_url, wanted_models)
    return build_plan(store, repo, cache, env=env, models=models, prune=prune, loaded=loaded, node=node)


def plan_versions(settings: Settings, store: Store, versions: dict[str, int]) -> SyncPlan:
    """The plan that installs exactly these versions (and the members they pin) from ``store``; reads the
    store and the repository, writes nothing there."""
    from repo_manager.adapters.cache import BlobCache  # noqa: PLC0415 - off the quick sync path
    from repo_manager.adapters.repository import LocalRepository  # noqa: PLC0415 - off the quick sync path
    from repo_manager.ops.sync.plan import build_plan  # noqa: PLC0415 - off the quick sync path

    cache = BlobCache(cache_dir_for(settings), part_size=settings.sync_part_size)
    return build_plan(store, LocalRepository(settings.repository), cache, env=None, versions=versions)


def sync_versions(settings: Settings, store: Store, versions: dict[str, int], *,
                  progress: SyncProgress | None = None, stop: threading.Event | None = None) -> SyncResult:
    """Install exactly these versions (and the members they pin) from ``store`` into the repository
    (``stop``: see ``executor.fetch_blobs``)."""
    from repo_manager.ops.sync.executor import execute  # noqa: PLC0415 - off the quick sync path

    started = time.monotonic()
    return execute(plan_versions(settings, store, versions), store, progress=progress, started=started, stop=stop)


def sync(settings: Settings, store: Store, *, env: str | None, models: tuple[str, ...] = (), prune: bool = False,
         progress: SyncProgress | None = None, limit_bytes_per_s: float | None = None,
         node: NodeFacts | None = None) -> SyncResult:
    from repo_manager.ops.sync.executor import execute  # noqa: PLC0415 - off the quick sync path

    started = time.monotonic()
    plan = plan_sync(settings, store, env=env, models=models, prune=prune, node=node)
    return execute(plan, store, progress=progress, limit_bytes_per_s=limit_bytes_per_s, started=started)
