"""The no-op path: an unchanged environment costs one conditional read and local stats.

After every successful ``trm sync --env`` the node cache records what that repository now serves
(``<cache>/state/<store-id>/<key>.json``: the pointer's tag, and per model the version, the sha256 of
its ``trm-manifest.json`` and ``config.pbtxt``, and each file's size). The next sync of the same
environment into the same repository first asks the store for the pointer with ``If-None-Match: <tag>``:

* 304 (unchanged) and the repository still holds exactly that (regular files of the recorded sizes, the
  same manifest and config bytes, nothing a symlink): done, nothing else read, nothing written;
* anything else (a new tag, a missing or unreadable record, a file changed or gone, any doubt at all):
  the full planner runs as before, so this path can only skip work, never change an outcome.

The checks are the planner's own for a version it finds ``present`` (size per file, the manifest it was
installed with, the config it serves), so both paths agree on what "unchanged" means. This module and
what it imports are light on purpose (no protobuf, urllib3, botocore, rich): it is what an init
container runs on every pod start.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repo_manager.sync.result import SyncResult

if TYPE_CHECKING:
    from repo_manager.storage import Store
    from repo_manager.sync.plan import SyncPlan

STATE_SCHEMA = "trm.sync-state/1"
MANIFEST_NAME = "trm-manifest.json"  # repository.MANIFEST_NAME, without importing the repository module
CONFIG_NAME = "config.pbtxt"


def store_id(store: Store) -> str:
    """Names a store in the node cache (manifests and records of different stores never mix)."""
    endpoint = getattr(store, "endpoint_url", None) or ""
    return hashlib.sha256(f"{endpoint}|{store.location}".encode()).hexdigest()[:16]


def state_path(cache: Path, store: Store, env: str, repository: Path, selection: tuple[str, ...]) -> Path:
    key = json.dumps([str(Path(repository).absolute()), env, sorted(selection)])
    return Path(cache) / "state" / store_id(store) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def record(plan: SyncPlan, store: Store) -> None:
    """Record what the repository serves after ``plan`` was carried out (best effort: a record that
    cannot be written only means the next sync plans in full)."""
    if plan.env is None or plan.pointer_etag is None:
        return
    repo = Path(plan.repository)
    models: dict[str, Any] = {}
    try:
        for action in plan.models:
            folder = repo / action.model / str(action.version)
            models[action.model] = {
                "version": action.version,
                "manifest_sha256": _sha256(folder / MANIFEST_NAME),
                "config_sha256": _sha256(repo / action.model / CONFIG_NAME),
                "files": [[f.path, f.size] for f in action.manifest.files]}
        path = state_path(plan.cache, store, plan.env, repo, plan.selection)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"schema": STATE_SCHEMA, "etag": plan.pointer_etag, "env": plan.env,
                                   "models": models}))
        os.replace(tmp, path)
    except OSError:
        return


def _serves(repo: Path, models: dict[str, Any]) -> bool:
    """True if ``repo`` still holds exactly the recorded versions (local stats and two small reads per
    model); any surprise, including a malformed record, is False."""
    try:
        for model, entry in models.items():
            if "/" in model or model in (".", ".."):
                return False
            model_dir = repo / model
            folder = model_dir / str(int(entry["version"]))
            if not stat.S_ISDIR(os.lstat(model_dir).st_mode) or not stat.S_ISDIR(os.lstat(folder).st_mode):
                return False
            if _sha256(folder / MANIFEST_NAME) != entry["manifest_sha256"] or \
                    _sha256(model_dir / CONFIG_NAME) != entry["config_sha256"]:
                return False
            for relative, size in entry["files"]:
                info = os.lstat(folder / relative)
                if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                    return False
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return True


def try_unchanged(store: Store, cache: Path, repository: Path, env: str,
                  selection: tuple[str, ...] = ()) -> SyncResult | None:
    """The result of an unchanged sync, or None when the full planner must run."""
    import time  # noqa: PLC0415

    started = time.monotonic()
    try:
        state = json.loads(state_path(cache, store, env, repository, selection).read_bytes())
        etag, models = state["etag"], state["models"]
        if state.get("schema") != STATE_SCHEMA or state.get("env") != env or not isinstance(etag, str) \
                or not isinstance(models, dict) or not models:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    pointer = store.get_env_if_changed(env, etag)
    if (pointer is not None and pointer.etag != etag) or not _serves(Path(repository), models):
        # (a service that ignores If-None-Match answers 200 with the same tag: still unchanged)
        return None
    return SyncResult(store=store.location, env=env, repository=str(repository),
                      models={m: int(e["version"]) for m, e in models.items()}, installed=(), configs_replaced=(),
                      pruned=(), kept_loaded=(), bytes_downloaded=0, bytes_resumed=0, bytes_reused=0,
                      files=sum(len(e["files"]) for e in models.values()), blobs_downloaded=0, remote_reads=1,
                      gc_removed=0, gc_freed_bytes=0, seconds=time.monotonic() - started, unchanged=True)
