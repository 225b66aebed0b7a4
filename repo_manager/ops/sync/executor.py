"""Execute a sync plan: fetch into the cache, materialize version folders, replace configs, prune.

Order is the safety argument. All blobs are fetched and verified into the cache first; if the store
fails or holds bad data, the sync stops there and the local repository was not touched. Then each
version folder is assembled from hard links in a staging folder (``.trm-tmp-*``, which Triton and trm
ignore) and appears by one rename, complete or not at all; a damaged folder is swapped for its
replacement in one ``renameat2(RENAME_EXCHANGE)``. config.pbtxt is replaced atomically after the
version it describes is in place. Pruning renames a version folder out of sight before deleting it.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from repo_manager.adapters.cache import BlobCache, CorruptBlobError
from repo_manager.adapters.repository import CONFIG_NAME, STAGING_PREFIX, LocalRepository, block_bytecode_cache
from repo_manager.adapters.storage import Store
from repo_manager.adapters.transfer import PART_WORKERS, Cancelled, RateLimit, settle
from repo_manager.core import config as cfg
from repo_manager.core import paths
from repo_manager.core.errors import ConflictError, IntegrityError, NotFoundError, TrmError
from repo_manager.core.localized import install_file, localized_paths
from repo_manager.core.manifest import Manifest
from repo_manager.ops.sync.noop import record
from repo_manager.ops.sync.plan import (
    INSTALL,
    PRESENT,
    REPLACE,
    ModelAction,
    SyncPlan,
    config_differs,
    local_state,
)
from repo_manager.ops.sync.result import SyncProgress, SyncResult

BLOB_WORKERS = 16  # small blobs are latency-bound: more in flight than CPU cores


def fetch_blobs(store: Store, cache: BlobCache, plan: SyncPlan, progress: SyncProgress,
                limit: RateLimit, stop: threading.Event | None = None) -> tuple[int, int, int, int]:
    """Fetch every blob of the plan in parallel (large ones in ranged parts).

    Returns (bytes downloaded, bytes resumed from partial downloads, blobs fetched, bytes that another
    sync on this node fetched meanwhile). ``stop``: set by the caller (the agent, on SIGTERM) to end the
    downloads within one piece each: ``Cancelled`` is raised, partial downloads stay for the next sync (it
    is only read here: a failure stops the downloads through this sync's own event)."""
    if not plan.fetch:
        return 0, 0, 0, 0
    ending = threading.Event()  # this sync's: set on an interruption or a failed blob
    caller = stop or ending

    def advance(nbytes: int) -> None:
        if ending.is_set() or caller.is_set():  # every download stops at its next piece
            raise Cancelled
        progress.advance(nbytes)

    failures: list[BaseException] = []

    with ThreadPoolExecutor(PART_WORKERS, thread_name_prefix="trm-part") as parts, \
            ThreadPoolExecutor(BLOB_WORKERS, thread_name_prefix="trm-blob") as blobs:
        def one(blob) -> tuple[int, int]:
            try:
                got = cache.fetch(store, blob.digest, blob.size, on_bytes=advance, parts_pool=parts, limit=limit)
            except Exception as exc:  # a failed blob ends the others at their next piece, not at their end
                failures.append(exc)
                ending.set()
                raise
            if got == (0, 0):  # another sync on this node fetched it meanwhile
                progress.advance(blob.size)
            elif got[1]:
                progress.advance(got[1])
            progress.file_done()
            return got
        futures = [blobs.submit(one, blob) for blob in plan.fetch]
        try:
            results = list(zip(plan.fetch, settle(futures)))
        except BaseException as exc:
            # SIGTERM, SIGINT (raised here, in the main thread) or a failed blob: what has not started never
            # starts and what runs stops within one piece, instead of the pools finishing the whole plan
            # before the process may exit (a pod's grace period). Partial downloads stay for the next sync.
            ending.set()
            for future in futures:
                future.cancel()
            if isinstance(exc, Cancelled) and failures:
                raise failures[0] from None  # the blob that failed, not one it stopped
            raise
    fetched = [got for _, got in results if got != (0, 0)]
    by_others = sum(blob.size for blob, got in results if got == (0, 0))
    return sum(g[0] for g in fetched), sum(g[1] for g in fetched), len(fetched), by_others


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2); elsewhere two renames (a short gap)."""
    import ctypes  # noqa: PLC0415 - only when a config or version is replaced (ctypes is slow to import)

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        if ctypes.get_errno() not in (22, 38, 95):  # EINVAL/ENOSYS/EOPNOTSUPP: fall back
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(a))
    aside = a.parent / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


CHECK_WORKERS = max(1, min(8, os.cpu_count() or 1))
"""Files placed (and hashed) at once: hashlib releases the GIL, so a node's cores share the check."""


class Refetched:
    """Bytes fetched again while a version was assembled (a blob collected or found corrupt meanwhile)."""

    def __init__(self) -> None:
        self.bytes = self.blobs = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.blobs += 1 if nbytes else 0


def place_checked(store: Store, cache: BlobCache, digest: str, size: int, target: Path, limit: RateLimit,
                  refetched: Refetched, progress: SyncProgress) -> None:
    """``cache.place`` (which hashes the blob as it enters the version); a blob gone from the cache or
    no longer matching its sha256 is fetched again (from the store, verified) and placed once more."""
    try:
        cache.place(digest, size, target)
        return
    except NotFoundError:  # collected by a concurrent `sync --prune` since we planned: fetch again
        pass
    except CorruptBlobError as exc:  # changed in the cache since it was verified: never installed
        progress.message(f"blob {digest[:12]}… in the node cache does not match its sha256: fetching it again")
        cache.evict(exc)
    refetched.add(cache.fetch(store, digest, size, limit=limit)[0])
    try:
        cache.place(digest, size, target)
    except CorruptBlobError as exc:
        raise IntegrityError(f"blob {digest} in the node cache ({exc.path}) changed again right after "
                             "it was fetched and verified", hint="something on this node keeps writing into the "
                             "node cache (--cache): stop it; nothing was installed from it",
                             path=exc.path) from exc


def own_copies(repo: LocalRepository, cache: BlobCache, manifest: Manifest) -> dict[str, tuple[Path, int]]:
    """sha256 -> (file, size) of the installed versions of ``manifest``'s model, when the repository is on
    another filesystem than the cache (the Kubernetes layout: two mounts). Each is then this repository's
    own copy, checked when it was copied in and out of reach of the other pods, so a new version that
    shares it is hard-linked to it: no second copy, no second hash. On one filesystem the repository's
    files may be the cache's inodes, and nothing is taken from them."""
    try:
        if os.stat(repo.root).st_dev == os.stat(cache.root).st_dev:
            return {}
        versions = repo.versions(manifest.model)
    except OSError:
        return {}
    found: dict[str, tuple[Path, int]] = {}
    for version in versions:
        if version == manifest.version:
            continue
        try:
            local = repo.manifest(manifest.model, version)
        except TrmError:
            continue  # a version trm cannot read is not a source
        folder = repo.version_dir(manifest.model, version)
        localized = localized_paths(local.config)
        for entry in local.files:
            if entry.path not in localized:  # installed bytes that name that version's folder: not a copy
                found.setdefault(entry.sha256, (folder / entry.path, entry.size))
    return found


def link_own_copy(source: tuple[Path, int] | None, size: int, target: Path) -> bool:
    """Hard-link ``source`` (see ``own_copies``) at ``target`` if it is a regular file of the size; False
    when it cannot be used (then the blob comes from the cache, checked)."""
    if source is None or source[1] != size:
        return False
    try:
        info = os.lstat(source[0])
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source[0], target, follow_symlinks=False)
    except OSError:
        return False
    return True


def materialize(store: Store, cache: BlobCache, repo: LocalRepository, action: ModelAction,
                limit: RateLimit, refetched: Refetched | None = None, progress: SyncProgress | None = None) -> bool:
    """Put one version folder in place from the cache. True if this call installed it."""
    manifest = action.manifest
    refetched = refetched or Refetched()
    progress = progress or SyncProgress()
    sources = own_copies(repo, cache, manifest)
    localized = localized_paths(manifest.config)
    target = repo.version_dir(manifest.model, manifest.version)
    with repo.staging(manifest.model) as staging:
        def one(entry) -> None:
            if not link_own_copy(sources.get(entry.sha256), entry.size, staging / entry.path):
                place_checked(store, cache, entry.sha256, entry.size, staging / entry.path, limit, refetched,
                              progress)
            if entry.path in localized:  # checked in its stored form; installed naming the folder Triton reads
                install_file(staging / entry.path, target)
        if len(manifest.files) > 1 and CHECK_WORKERS > 1:
            with ThreadPoolExecutor(CHECK_WORKERS, thread_name_prefix="trm-place") as pool:
                futures = [pool.submit(one, entry) for entry in manifest.files]
                try:
                    settle(futures)
                except BaseException:  # SIGTERM/SIGINT too: what has not started never starts
                    for future in futures:
                        future.cancel()
                    raise
        else:
            for entry in manifest.files:
                one(entry)
        state = local_state(repo, manifest)  # again: a concurrent sync may have installed it meanwhile
        if state == PRESENT:
            return False  # (the staging folder goes on the way out, as always when not committed)
        if state == REPLACE:
            block_bytecode_cache(staging)  # as repo.commit does
            cfg.atomic_write_bytes(staging / "trm-manifest.json", manifest.to_json())
            _exchange(staging, target)  # the staging path now holds what was there: removed, never followed
            return True
        try:
            repo.commit(staging, manifest, update_config=False)
        except ConflictError:
            if local_state(repo, manifest) != PRESENT:
                raise
            return False
        return True


def replace_config(repo: LocalRepository, action: ModelAction) -> None:
    """config.pbtxt becomes, atomically, exactly the text the version was validated with (parsed through
    Triton's schema when the plan was built; an engine's path localized to this repository), so `trm
    validate` finds them equal."""
    text = repo.installed_config(action.manifest)
    cfg.parse_config(text, f"config of {action.model}/{action.version}")
    repo.install_model_files(action.manifest)  # before the config that names them
    cfg.atomic_write_bytes(paths.check_within(repo.root, repo.model_dir(action.model) / CONFIG_NAME), text.encode())


def prune_version(repo: LocalRepository, model: str, version: int) -> bool:
    """Remove ``<repo>/<model>/<version>``: renamed out of Triton's sight first, then deleted. Only a
    real folder reached through real folders of the repository is touched (paths.py), never a symlink or
    what it points to. True if removed."""
    folder = repo.version_dir(model, version)
    try:
        paths.check_within(repo.root, folder)
    except paths.UnsafePathError:
        return False
    if not folder.is_dir():
        return False
    aside = repo.model_dir(model) / f"{STAGING_PREFIX}prune-{uuid.uuid4().hex}"
    os.rename(folder, aside)
    return paths.remove_tree(repo.root, aside)


def execute(plan: SyncPlan, store: Store, *, progress: SyncProgress | None = None,
            limit_bytes_per_s: float | None = None, started: float | None = None,
            stop: threading.Event | None = None) -> SyncResult:
    progress = progress or SyncProgress()
    started = time.monotonic() if started is None else started
    cache = BlobCache(plan.cache, part_size=plan.part_size)
    repo = LocalRepository(plan.repository)
    limit = RateLimit(limit_bytes_per_s)
    paths.check_free_space(cache.root, plan.fetch_bytes, "this sync")
    progress.start(plan.fetch_bytes, len(plan.fetch))
    with paths.node_writes("this sync", cache.root):
        downloaded, resumed, blobs, by_others = fetch_blobs(store, cache, plan, progress, limit, stop)
    installed, configs = [], []
    refetched = Refetched()
    with paths.node_writes("this sync", repo.root):
        for model in sorted({a.model for a in plan.models if a.action in (INSTALL, REPLACE)}):
            # what a sync killed while assembling a version left: its owner is gone, or it had this pid (a
            # container restarted as pid 1); this sync has written no staging folder yet
            repo.clean_staging(model, ours=True)
        for action in plan.models:
            if action.action in (INSTALL, REPLACE) and \
                    materialize(store, cache, repo, action, limit, refetched, progress):
                installed.append(f"{action.model}/{action.version}")
                progress.message(f"installed {action.model}/{action.version}")
            if (action.config_change or action.action != PRESENT) and config_differs(repo, action.manifest):
                replace_config(repo, action)
                configs.append(action.model)
    pruned, kept = [], []
    for item in plan.prune:
        if item.remove:
            if prune_version(repo, item.model, item.version):
                pruned.append(f"{item.model}/{item.version}")
        else:
            kept.append(f"{item.model}/{item.version}")
    removed = freed = 0
    if plan.gc:
        removed, freed = cache.collect(plan.needed_digests())
    files = sum(a.files for a in plan.models)
    record(plan, store)  # the next sync of an unchanged environment: one conditional read (noop.py)
    return SyncResult(
        store=plan.store, env=plan.env, repository=str(plan.repository),
        models={a.model: a.version for a in plan.models}, installed=tuple(installed), configs_replaced=tuple(configs),
        pruned=tuple(pruned), kept_loaded=tuple(kept), bytes_downloaded=downloaded + refetched.bytes,
        bytes_resumed=resumed, bytes_reused=max(0, plan.reuse_bytes + by_others - refetched.bytes), files=files,
        blobs_downloaded=blobs + refetched.blobs, remote_reads=plan.remote_reads + blobs + refetched.blobs,
        gc_removed=removed, gc_freed_bytes=freed, seconds=time.monotonic() - started, unchanged=plan.unchanged)
