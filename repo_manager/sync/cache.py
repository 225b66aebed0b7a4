"""The node-local, content-addressed blob cache that several pods (several `trm sync`) share.

Layout::

    <cache>/blobs/sha256/<hex>            verified blobs, read-only; repositories hard-link to them
    <cache>/partial/<hex>.<token>/data    a large download in progress (+ done/<part> markers for resuming)
    <cache>/partial/<hex>.<token>.small   a small download in progress (one GET, hashed as it streams)
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
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from repo_manager import paths
from repo_manager.errors import InputError, IntegrityError, NotFoundError
from repo_manager.manifest import CHUNK, Manifest
from repo_manager.storage import Store
from repo_manager.storage.base import check_digest

PART_SIZE = int(os.environ.get("TRM_SYNC_PART_SIZE", 16 * 1024 * 1024))
"""Ranged part size; blobs above ``RANGED_THRESHOLD`` are fetched as parts of this size."""
RANGED_THRESHOLD = 2 * PART_SIZE
PART_WORKERS = 8
STALE_PARTIAL_S = 24 * 3600

OnBytes = Callable[[int], None]


def settle(futures: list[Future]) -> list[Any]:
    """Results in order. On the first failure: cancel what has not started, wait for what runs (no thread
    may still write to a file its caller is about to close), then raise that failure. A dead endpoint so
    fails a sync in seconds instead of after every queued download has spent its retries."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for future in futures:
            future.cancel()
        wait(futures)
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


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
        try:
            for folder in (self.blobs, self.partial, self.locks):
                paths.make_dirs(self.root, folder)  # never into a link planted inside the cache
        except OSError as exc:
            raise InputError(f"cannot use {self.root} as the node cache: {exc.strerror}",
                             hint="pass a writable folder to --cache") from exc

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

        target = self._manifest_path(store_id, manifest.model, manifest.version)
        atomic_write_bytes(paths.check_within(self.root, target), manifest.to_json())

    # ---------------------------------------------------------------------------------- fetching
    @contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        fd = _open_nofollow(self.locks / check_digest(digest), os.O_RDWR | os.O_CREAT)
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
            if size <= RANGED_THRESHOLD:
                return self._fetch_small(store, digest, size, on_bytes, limit), 0
            downloaded = resumed = failures = lost = 0
            adopt = True
            while True:
                folder = (self._adopt_partial(digest) if adopt else None) or self._new_partial(digest)
                adopt = False  # a retry always starts from scratch
                try:
                    got, kept, actual = self._download(store, digest, size, folder, on_bytes, parts_pool, limit)
                    downloaded += got
                    resumed += kept
                    if actual != digest or (folder / "data").stat().st_size != size:
                        raise IntegrityError(f"blob {digest} from the store does not match its manifest (sha256 "
                                             f"{actual[:12]}…)",
                                             hint="the object in the store is corrupt: push the version again")
                    self._install(folder, digest)
                    return downloaded, resumed
                except IntegrityError:
                    shutil.rmtree(folder, ignore_errors=True)
                    failures += 1
                    if failures == 2:
                        raise
                except FileNotFoundError:
                    # our partial folder was adopted by another sync: only possible where locks do not
                    # work; it finishes that download, we start a fresh one unless it is already done
                    if self.has(digest, size):
                        return downloaded, resumed
                    lost += 1
                    if lost == 3:
                        raise

    def _fetch_small(self, store: Store, digest: str, size: int, on_bytes: OnBytes, limit: RateLimit | None) -> int:
        """One GET streamed into a unique temporary file while hashing (no second read), then linked in."""
        downloaded = 0
        for attempt in (1, 2):
            tmp = self.partial / f"{digest}.{uuid.uuid4().hex}.small"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                hasher = hashlib.sha256()
                try:
                    self._copy(_hashed(store.read_blob(digest, 0, size), hasher), fd, 0, size, digest, on_bytes,
                               limit)
                    downloaded += size
                    if hasher.hexdigest() != digest:
                        raise IntegrityError(f"blob {digest} from the store does not match its manifest (sha256 "
                                             f"{hasher.hexdigest()[:12]}…)",
                                             hint="the object in the store is corrupt: push the version again")
                    os.fchmod(fd, 0o444)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, self.path(digest))
                except FileExistsError:
                    pass  # installed by another writer (only where locks do not work): same content
                return downloaded
            except IntegrityError:
                if attempt == 2:
                    raise
            finally:
                tmp.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _new_partial(self, digest: str) -> Path:
        folder = self.partial / f"{digest}.{uuid.uuid4().hex}"
        (folder / "done").mkdir(parents=True)
        return folder

    def _adopt_partial(self, digest: str) -> Path | None:
        """Take over an abandoned partial download of ``digest`` (we hold its lock: its owner is gone)."""
        candidates = [e.path for e in os.scandir(self.partial) if e.name.startswith(digest)
                      and e.is_dir(follow_symlinks=False) and not _holds_links(Path(e.path))]
        for candidate in sorted(candidates):
            mine = self.partial / f"{digest}.{uuid.uuid4().hex}"
            try:
                os.rename(candidate, mine)
            except OSError:
                continue  # someone else adopted it
            (mine / "done").mkdir(exist_ok=True)
            return mine
        return None

    def _download(self, store: Store, digest: str, size: int, folder: Path, on_bytes: OnBytes,
                  parts_pool: ThreadPoolExecutor | None, limit: RateLimit | None) -> tuple[int, int, str]:
        """Fetch the missing parts into ``folder/data``. Returns (bytes fetched, bytes resumed, sha256)."""
        data = folder / "data"
        fd = _open_nofollow(data, os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, size)
            part_size = self._part_size(folder)
            count = (size + part_size - 1) // part_size
            done = folder / "done"
            missing = [i for i in range(count) if not (done / str(i)).exists()]
            hasher = _InOrderHasher(fd, size, part_size, set(range(count)) - set(missing))

            def part(index: int) -> int:
                start = index * part_size
                length = min(part_size, size - start)
                self._copy(store.read_blob(digest, start, length), fd, start, length, digest, on_bytes, limit)
                (done / str(index)).touch()  # after the bytes are written: a marker never lies
                hasher.completed(index)
                return length
            if parts_pool is None:
                got = sum(map(part, missing))
            else:
                # wait for every part before the fd is closed, even when one fails: a part still running
                # could otherwise write into whatever file reuses the fd number
                got = sum(settle([parts_pool.submit(part, i) for i in missing]))
            return got, size - got, hasher.finish()
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
        for entry in self.partial.iterdir():
            try:
                if entry.stat().st_mtime >= cutoff:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            except FileNotFoundError:
                continue
        return removed, freed


def _open_nofollow(path: Path, flags: int) -> int:
    """Open a cache file without following a link planted at its name (paths.py's rule, for open())."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise paths.UnsafePathError(f"refusing to write through {path}: it is a symbolic link in the cache",
                                        hint="remove it; the cache holds only trm's own files",
                                        path=str(path)) from exc
        raise


def _holds_links(folder: Path) -> bool:
    """A partial download is adopted only when nothing in it is a symbolic link."""
    return any(p.is_symlink() for p in [folder, *folder.rglob("*")])


def _hashed(chunks: Iterator[bytes], hasher: Any) -> Iterator[bytes]:
    for chunk in chunks:
        hasher.update(chunk)
        yield chunk


class _InOrderHasher:
    """sha256 of a file whose parts arrive out of order, computed while the download runs.

    Each finished part is reported; whichever thread gets the lock hashes every part that is next in
    order (read back from the page cache), so hashing overlaps the remaining downloads instead of
    following them. A thread that finds the lock taken leaves its part to the holder or to ``finish``.
    """

    def __init__(self, fd: int, size: int, part_size: int, ready: set[int]) -> None:
        self.fd, self.size, self.part_size = fd, size, part_size
        self.ready = ready
        self.next = 0
        self.hash = hashlib.sha256()
        self.lock = threading.Lock()

    def completed(self, index: int, block: bool = False) -> None:
        self.ready.add(index)
        if not self.lock.acquire(blocking=block):
            return
        try:
            while self.next in self.ready:
                offset = self.next * self.part_size
                end = min(offset + self.part_size, self.size)
                while offset < end:
                    chunk = os.pread(self.fd, min(CHUNK, end - offset), offset)
                    if not chunk:
                        return  # shorter than expected: the size check reports it
                    self.hash.update(chunk)
                    offset += len(chunk)
                self.next += 1
        finally:
            self.lock.release()

    def finish(self) -> str:
        if self.ready:
            self.completed(next(iter(self.ready)), block=True)
        return self.hash.hexdigest()
