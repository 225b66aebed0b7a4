"""The node-local, content-addressed blob cache that several pods (several `trm sync`) share.

Layout::

    <cache>/blobs/sha256/<hex>            verified blobs, read-only; repositories hard-link to them
    <cache>/partial/<hex>.<token>/data    a download in progress (+ done/<part> markers for resuming)
    <cache>/locks/<hex>                   advisory lock: only avoids two downloads of one blob at once
    <cache>/manifests/<store-id>/<model>/<N>.json   manifests already verified (they are immutable)

Correctness never depends on the locks (flock fails silently on some network filesystems): a blob
enters ``blobs/`` only through ``os.link`` of a file that was fully hashed against the manifest, every
writer works in its own uniquely named partial folder, and an existing blob is only ever replaced by
nothing (``link`` refuses to overwrite). The lock makes a second sync wait for the first one's
download of the same blob and then reuse it, instead of downloading it again.

Large blobs are fetched as ranged parts in parallel; each finished part leaves a marker, so a sync
killed with SIGKILL resumes with the missing parts only. Resuming adopts an abandoned partial folder by
renaming it (atomic: one adopter wins), and only while holding the blob's lock, i.e. when its previous
owner is gone. botocore does not validate ranged reads, so every byte is checked here: length per
part, then size and sha256 of the whole file before it is installed. A mismatch is fetched once more
from scratch, then reported; a bad blob is never installed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from repo_manager.errors import IntegrityError, NotFoundError
from repo_manager.manifest import CHUNK, Manifest
from repo_manager.storage import Store
from repo_manager.storage.base import check_digest

PART_SIZE = int(os.environ.get("TRM_SYNC_PART_SIZE", 16 * 1024 * 1024))
"""Ranged part size; blobs above ``RANGED_THRESHOLD`` are fetched as parts of this size."""
RANGED_THRESHOLD = 2 * PART_SIZE
PART_WORKERS = 8
STALE_PARTIAL_S = 24 * 3600

OnBytes = Callable[[int], None]


class RateLimit:
    """A token bucket shared by all download threads (``--limit-rate``); None: unlimited."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + nbytes / self.rate
            wait = self._next - now - 0.05  # allow a 50 ms burst
        if wait > 0:
            time.sleep(wait)


class BlobCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.blobs = self.root / "blobs" / "sha256"
        self.partial = self.root / "partial"
        self.locks = self.root / "locks"
        for folder in (self.blobs, self.partial, self.locks):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.blobs / check_digest(digest)

    def has(self, digest: str, size: int) -> bool:
        try:
            return self.path(digest).stat().st_size == size
        except FileNotFoundError:
            return False

    # ---------------------------------------------------------------------------- manifest cache
    def _manifest_path(self, store_id: str, model: str, version: int) -> Path:
        return self.root / "manifests" / store_id / model / f"{version}.json"

    def cached_manifest(self, store_id: str, model: str, version: int) -> bytes | None:
        """The verified manifest saved by an earlier sync, or None (then it is read from the store)."""
        try:
            return self._manifest_path(store_id, model, version).read_bytes()
        except FileNotFoundError:
            return None

    def save_manifest(self, store_id: str, manifest: Manifest) -> None:
        from repo_manager.config import atomic_write_bytes  # noqa: PLC0415

        atomic_write_bytes(self._manifest_path(store_id, manifest.model, manifest.version), manifest.to_json())

    # ---------------------------------------------------------------------------------- fetching
    @contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        fd = os.open(self.locks / digest, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass  # no lock support here: still correct, maybe a duplicate download
            yield
        finally:
            os.close(fd)  # releases the lock

    def fetch(self, store: Store, digest: str, size: int, *, on_bytes: OnBytes = lambda n: None,
              parts_pool: ThreadPoolExecutor | None = None, limit: RateLimit | None = None) -> tuple[int, int]:
        """Make sure blob ``digest`` is in the cache. Returns (bytes downloaded, bytes resumed)."""
        if self.has(digest, size):
            return 0, 0
        with self._lock(digest):
            if self.has(digest, size):  # another sync fetched it while we waited
                return 0, 0
            downloaded = resumed = 0
            for attempt in (1, 2):
                folder = self._adopt_partial(digest) if attempt == 1 else None
                folder = folder or self._new_partial(digest)
                try:
                    got, kept = self._download(store, digest, size, folder, on_bytes, parts_pool, limit)
                    downloaded += got
                    resumed += kept
                    self._verify(folder / "data", digest, size)
                except IntegrityError:
                    shutil.rmtree(folder, ignore_errors=True)
                    if attempt == 2:
                        raise
                    continue
                self._install(folder, digest)
                return downloaded, resumed
        raise AssertionError("unreachable")

    def _new_partial(self, digest: str) -> Path:
        folder = self.partial / f"{digest}.{uuid.uuid4().hex}"
        (folder / "done").mkdir(parents=True)
        return folder

    def _adopt_partial(self, digest: str) -> Path | None:
        """Take over an abandoned partial download of ``digest`` (we hold its lock: its owner is gone)."""
        for candidate in sorted(self.partial.glob(f"{digest}.*")):
            mine = self.partial / f"{digest}.{uuid.uuid4().hex}"
            try:
                os.rename(candidate, mine)
            except OSError:
                continue  # someone else adopted it
            (mine / "done").mkdir(exist_ok=True)
            return mine
        return None

    def _download(self, store: Store, digest: str, size: int, folder: Path, on_bytes: OnBytes,
                  parts_pool: ThreadPoolExecutor | None, limit: RateLimit | None) -> tuple[int, int]:
        data = folder / "data"
        fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)
            if size <= RANGED_THRESHOLD:
                self._copy(store.read_blob(digest, 0, size), fd, 0, size, digest, on_bytes, limit)
                return size, 0
            part_size = self._part_size(folder)
            count = (size + part_size - 1) // part_size
            done = folder / "done"
            missing = [i for i in range(count) if not (done / str(i)).exists()]

            def part(index: int) -> int:
                start = index * part_size
                length = min(part_size, size - start)
                self._copy(store.read_blob(digest, start, length), fd, start, length, digest, on_bytes, limit)
                (done / str(index)).touch()  # after the bytes are written: a marker never lies
                return length
            got = sum(parts_pool.map(part, missing) if parts_pool else map(part, missing))
            return got, size - got
        finally:
            os.close(fd)

    @staticmethod
    def _part_size(folder: Path) -> int:
        """The part size this partial download was started with (markers count in its parts)."""
        record = folder / "part_size"
        try:
            return int(record.read_text())
        except (FileNotFoundError, ValueError):
            record.write_text(str(PART_SIZE))
            return PART_SIZE

    @staticmethod
    def _copy(chunks: Iterator[bytes], fd: int, start: int, length: int, digest: str, on_bytes: OnBytes,
              limit: RateLimit | None) -> None:
        offset = start
        for chunk in chunks:
            if offset + len(chunk) > start + length:
                raise IntegrityError(f"blob {digest[:12]}… is longer than its manifest says")
            if limit:
                limit.take(len(chunk))
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
            on_bytes(len(chunk))
        if offset != start + length:
            raise IntegrityError(f"blob {digest[:12]}… was truncated: got {offset - start} of {length} bytes "
                                 f"at offset {start}")

    @staticmethod
    def _verify(path: Path, digest: str, size: int) -> None:
        actual = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                actual.update(chunk)
        if path.stat().st_size != size or actual.hexdigest() != digest:
            raise IntegrityError(f"blob {digest} from the store does not match its manifest (sha256 "
                                 f"{actual.hexdigest()[:12]}…, {path.stat().st_size} bytes)",
                                 hint="the object in the store is corrupt: push the version again")

    def _install(self, folder: Path, digest: str) -> None:
        data = folder / "data"
        os.chmod(data, 0o444)  # repositories hard-link to it: make accidental writes fail
        with open(data, "rb") as handle:
            os.fsync(handle.fileno())
        try:
            os.link(data, self.path(digest))
        except FileExistsError:
            pass  # installed by another writer (only possible where locks do not work): same content
        shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------------------- placing files
    def place(self, digest: str, target: Path) -> None:
        """Hard-link blob ``digest`` at ``target`` (a copy across filesystems). NotFoundError if gone."""
        source = self.path(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except FileNotFoundError as exc:
            raise NotFoundError(f"blob {digest} left the cache") from exc
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copyfile(source, target)

    # ---------------------------------------------------------------------------------------- gc
    def collect(self, keep: set[str]) -> tuple[int, int]:
        """Remove blobs no repository links to (link count 1) and not in ``keep``; stale partials.

        Returns (blobs removed, bytes freed). A sync that planned to reuse a removed blob fetches it
        again (``place`` raises NotFoundError), so collection never breaks a concurrent sync.
        """
        removed = freed = 0
        for path in self.blobs.iterdir():
            if path.name in keep:
                continue
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            if info.st_nlink == 1:
                path.unlink(missing_ok=True)
                removed += 1
                freed += info.st_size
        cutoff = time.time() - STALE_PARTIAL_S
        for folder in self.partial.iterdir():
            try:
                if folder.stat().st_mtime < cutoff:
                    shutil.rmtree(folder, ignore_errors=True)
            except FileNotFoundError:
                continue
        return removed, freed
