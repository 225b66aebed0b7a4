"""The node-local, content-addressed blob cache that several pods (several `trm sync`) share.

Layout::

    <cache>/blobs/sha256/<hex>            verified blobs, read-only; repositories hard-link to them
    <cache>/partial/<hex>.<token>/data    a large download in progress (+ done/<part> markers for resuming)
    <cache>/partial/<hex>.<token>.small   a small download in progress where the filesystem has no O_TMPFILE
                                          (elsewhere an anonymous file: a killed sync leaves nothing)
    <cache>/locks/<hex>                   advisory lock: only avoids two downloads of one blob at once
    <cache>/state/<store-id>/<key>.json   what a repository was last synced to (noop.py)

Correctness never depends on the locks (flock fails silently on some network filesystems): a blob
enters ``blobs/`` only through ``os.link`` of a file that was fully hashed against the manifest, every
writer works in its own uniquely named partial folder, and an existing blob is only ever replaced by
nothing (``link`` refuses to overwrite). The lock makes a second sync wait for the first one's
download of the same blob and then reuse it, instead of downloading it again.

The cache is shared by every pod of the node, so what is in it is only as trustworthy as whoever can
write there: a blob is hashed against its sha256 every time it enters a version (``place``: the linked
inode, or the bytes as they are copied), and one that no longer matches is evicted and fetched again,
never installed. Manifests are not kept here at all (the planner reads them from the store).

Large blobs are fetched as ranged parts in parallel, resumably, by the transfer engine (``transfer.py``:
what a partial folder holds and how a killed or crashed download resumes); small ones in one GET.
Resuming adopts an abandoned partial folder by renaming it (atomic: one adopter wins), and only while
holding the blob's lock, i.e. when its previous owner is gone. Ranged reads carry no checksum, so every
byte is checked: length per part (``transfer.py``), then size and sha256 of the whole file here (resumed
bytes included: a corrupted partial is caught) before it is installed. A mismatch is fetched once more from scratch,
then reported; a bad blob is never installed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from repo_manager.adapters import transfer
from repo_manager.adapters.storage import Store
from repo_manager.adapters.storage.base import check_digest
from repo_manager.adapters.transfer import OnBytes, RateLimit, open_nofollow, pwrite_all
from repo_manager.core import paths
from repo_manager.core.errors import InputError, IntegrityError, NotFoundError

STALE_PARTIAL_S = 24 * 3600


class BlobCache:
    def __init__(self, root: str | Path, *, part_size: int | None = None) -> None:
        self.root = Path(root).absolute()
        self.part_size = transfer.PART_SIZE if part_size is None else part_size
        """Bytes per ranged request for a new download (a resumed one keeps the size it was started with)."""
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
        """A regular file of ``size`` bytes at the blob's name (never a link planted there). Its content is
        checked when it enters a version (``place``)."""
        try:
            info = os.lstat(self.path(digest))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(info.st_mode) and info.st_size == size

    # ---------------------------------------------------------------------------------- fetching
    @contextmanager
    def _lock(self, digest: str) -> Iterator[None]:
        fd = open_nofollow(self.locks / check_digest(digest), os.O_RDWR | os.O_CREAT)
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
            if size <= 2 * self.part_size:
                return self._fetch_small(store, digest, size, on_bytes, limit), 0
            downloaded = failures = lost = 0
            adopt = True
            while True:
                folder = None
                try:
                    folder = (self._adopt_partial(digest) if adopt else None) or self._new_partial(digest)
                    adopt = False  # a retry always starts from scratch
                    got, kept, actual = transfer.download_parts(store, digest, size, folder, part_size=self.part_size,
                                                                on_bytes=on_bytes, parts_pool=parts_pool,
                                                                limit=limit)
                    downloaded += got
                    if actual != digest or (folder / "data").stat().st_size != size:
                        raise IntegrityError(f"blob {digest} from the store does not match its manifest (sha256 "
                                             f"{actual[:12]}…)",
                                             hint="the object in the store is corrupt: push the version again")
                    self._install(folder, digest, size)
                    return downloaded, kept  # (kept bytes of a try that failed were thrown away)
                except IntegrityError:
                    if folder is not None:
                        shutil.rmtree(folder, ignore_errors=True)
                    failures += 1
                    if failures == 2:
                        raise
                except FileNotFoundError:
                    # our partial folder was adopted by another sync: only possible where locks do not
                    # work; it finishes that download, we start a fresh one unless it is already done
                    if self.has(digest, size):
                        return downloaded, 0
                    lost += 1
                    if lost == 3:
                        raise

    def _fetch_small(self, store: Store, digest: str, size: int, on_bytes: OnBytes, limit: RateLimit | None) -> int:
        """One GET streamed into a temporary file while hashing (no second read), then linked in."""
        downloaded = 0
        for attempt in (1, 2):
            fd, tmp = self._small_file(digest)
            try:
                actual = transfer.fetch_whole(store, digest, size, fd, on_bytes=on_bytes, limit=limit)
                downloaded += size
                if actual != digest:
                    raise IntegrityError(f"blob {digest} from the store does not match its manifest (sha256 "
                                         f"{actual[:12]}…)",
                                         hint="the object in the store is corrupt: push the version again")
                os.fchmod(fd, 0o444)
                os.fsync(fd)
                self._link_small(fd, tmp, digest, size)
                return downloaded
            except IntegrityError:
                if attempt == 2:
                    raise
            finally:
                os.close(fd)
                if tmp is not None:
                    tmp.unlink(missing_ok=True)
        raise AssertionError("unreachable")

    def _link_small(self, fd: int, tmp: Path | None, digest: str, size: int) -> None:
        """Give the verified file its blob name (``tmp``, or the anonymous file open as ``fd``)."""
        if tmp is not None:
            self._link_blob(lambda target: os.link(tmp, target), digest, size)
            return
        # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N names the anonymous file (os.link makes a plain
        # link(), which would link the /proc entry itself, unless given a directory fd)
        folder = os.open(self.partial, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._link_blob(lambda target: os.link(f"/proc/self/fd/{fd}", target, src_dir_fd=folder,
                                                   follow_symlinks=True), digest, size)
        finally:
            os.close(folder)

    def _link_blob(self, link: Callable[[Path], None], digest: str, size: int) -> None:
        """``link(target)`` the verified file as blob ``digest``. A blob already there is another writer's
        (only where locks do not work: the same content) and kept; one of the wrong size (a repository file
        edited in place writes through its hard link into the cache) is replaced, atomically."""
        try:
            link(self.path(digest))
        except FileExistsError:
            if self.has(digest, size):
                return
            if stat.S_ISDIR(os.lstat(self.path(digest)).st_mode):  # a folder planted at the name
                shutil.rmtree(self.path(digest), ignore_errors=True)
            aside = self.partial / f".replace-{uuid.uuid4().hex}"
            link(aside)
            os.replace(aside, self.path(digest))

    def _small_file(self, digest: str) -> tuple[int, Path | None]:
        """The file a small blob is downloaded into: an anonymous one (Linux ``O_TMPFILE``, given its name by
        ``link`` once verified), so that a sync killed mid-download leaves nothing behind; a uniquely named
        one in ``partial/`` where the filesystem has no anonymous files (removed by ``collect`` when stale)."""
        if hasattr(os, "O_TMPFILE") and Path("/proc/self/fd").is_dir():
            try:
                return os.open(self.partial, os.O_TMPFILE | os.O_WRONLY, 0o644), None
            except OSError:
                pass  # EOPNOTSUPP, EISDIR (kernels before 3.11): a named file
        tmp = self.partial / f"{digest}.{uuid.uuid4().hex}.small"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp

    def _new_partial(self, digest: str) -> Path:
        """A new partial folder, made complete under a name no adopter looks at, then renamed in."""
        token = uuid.uuid4().hex
        fresh = self.partial / f".new-{token}"
        transfer.start_partial(fresh, self.part_size)
        folder = self.partial / f"{digest}.{token}"
        os.rename(fresh, folder)
        return folder

    def _adopt_partial(self, digest: str) -> Path | None:
        """Take over an abandoned partial download of ``digest`` (we hold its lock: its owner is gone)."""
        candidates = [e.path for e in os.scandir(self.partial) if e.name.startswith(digest)
                      and e.is_dir(follow_symlinks=False) and not _holds_links(Path(e.path))]
        for candidate in sorted(candidates):
            if not transfer.resumable(Path(candidate)):
                shutil.rmtree(candidate, ignore_errors=True)
                continue
            mine = self.partial / f"{digest}.{uuid.uuid4().hex}"
            try:
                os.rename(candidate, mine)
            except OSError:
                continue  # someone else adopted it
            (mine / "done").mkdir(exist_ok=True)
            return mine
        return None


    def _install(self, folder: Path, digest: str, size: int) -> None:
        data = folder / "data"
        os.chmod(data, 0o444)  # repositories hard-link to it: make accidental writes fail
        with open(data, "rb") as handle:
            os.fsync(handle.fileno())
        self._link_blob(lambda target: os.link(data, target), digest, size)
        shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------------------- placing files
    def place(self, digest: str, size: int, target: Path) -> None:
        """Hard-link blob ``digest`` at ``target`` (a copy across filesystems), checked against its sha256.

        The cache is shared by every sync of the node, so a blob in it is only as trustworthy as whoever
        can write there: its bytes are hashed whenever they enter a version (the linked inode itself, or
        the bytes as they are copied), and a blob that no longer matches is refused with
        ``CorruptBlobError`` (``target`` removed), never installed. NotFoundError if it left the cache."""
        source = self.path(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target, follow_symlinks=False)  # a link planted at the blob's name is linked as one
        except FileNotFoundError as exc:
            raise NotFoundError(f"blob {digest} left the cache") from exc
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            self._copy_checked(source, digest, size, target)
            return
        try:
            _check_file(target, digest, size, source)  # the inode the version now holds
        except BaseException:
            target.unlink(missing_ok=True)
            raise

    def _copy_checked(self, source: Path, digest: str, size: int, target: Path) -> None:
        """Copy ``source`` to ``target``, hashing the bytes as they are written (one read)."""
        fd = _open_blob(source, digest, size)
        try:
            hasher = hashlib.sha256()
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            try:
                with open(fd, "rb", buffering=0, closefd=False) as reader:
                    buffer, view = _check_buffer()
                    total = 0
                    while n := reader.readinto(buffer):
                        hasher.update(view[:n])
                        pwrite_all(out, view[:n], total)
                        total += n
                if total != size or hasher.hexdigest() != digest:
                    raise CorruptBlobError(source, digest, os.fstat(fd).st_ino)
            except BaseException:
                target.unlink(missing_ok=True)
                raise
            finally:
                os.close(out)
        finally:
            os.close(fd)

    def evict(self, error: CorruptBlobError) -> None:
        """Remove the blob ``error`` found corrupt from the cache (only that inode: a good copy another sync
        fetched meanwhile stays). Versions that link it keep their link; the cache no longer offers it."""
        path = self.path(error.digest)
        try:
            info = os.lstat(path)
            if info.st_ino != error.inode:
                return
            if stat.S_ISDIR(info.st_mode):  # a folder planted at the name (rmtree never follows links)
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        except FileNotFoundError:
            pass

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

def _holds_links(folder: Path) -> bool:
    """A partial download is adopted only when nothing in it is a symbolic link."""
    return any(p.is_symlink() for p in [folder, *folder.rglob("*")])


CHECK_BUFFER = 1024 * 1024
_local = threading.local()


def _check_buffer() -> tuple[bytearray, memoryview]:
    """This thread's read buffer for checking blobs (a fresh 1 MiB per file costs its page faults: a
    version of 300 small files would fault in 300 MiB)."""
    if not hasattr(_local, "buffer"):
        _local.buffer = bytearray(CHECK_BUFFER)
        _local.view = memoryview(_local.buffer)
    return _local.buffer, _local.view


class CorruptBlobError(IntegrityError):
    """A blob in the node cache whose bytes no longer match its name (written by something on this node
    after it was verified): never installed; the caller evicts it and fetches it again."""

    def __init__(self, path: Path, digest: str, inode: int) -> None:
        super().__init__(f"blob {digest} in the node cache ({path}) does not match its sha256",
                         hint="something on this node changed the cache; the blob was removed: sync again",
                         path=str(path))
        self.digest, self.inode = digest, inode


def _open_blob(path: Path, digest: str, size: int, origin: Path | None = None) -> int:
    """A read fd on the regular file at ``path`` of ``size`` bytes (never through a link, never a FIFO),
    else CorruptBlobError naming ``origin`` (the blob's name in the cache; default ``path``)."""
    origin = origin or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise NotFoundError(f"blob {digest} left the cache") from exc
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptBlobError(origin, digest, os.lstat(path).st_ino) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        os.close(fd)
        raise CorruptBlobError(origin, digest, info.st_ino)
    return fd


def _check_file(path: Path, digest: str, size: int, origin: Path) -> None:
    """CorruptBlobError (naming ``origin``, the cache's name for it) unless ``path`` holds exactly blob
    ``digest``. hashlib releases the GIL on large buffers, so files are checked in parallel threads."""
    fd = _open_blob(path, digest, size, origin)
    try:
        hasher = hashlib.sha256()
        buffer, view = _check_buffer()
        total = 0
        with open(fd, "rb", buffering=0, closefd=False) as reader:
            while n := reader.readinto(buffer):
                hasher.update(view[:n])
                total += n
        if total != size or hasher.hexdigest() != digest:
            raise CorruptBlobError(origin, digest, os.fstat(fd).st_ino)
    finally:
        os.close(fd)
