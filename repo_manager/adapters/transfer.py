"""The parallel ranged-download engine the node cache fetches blobs with: one blob into one file, as ranged
parts in parallel, resumable after a kill or a crash of the machine.

A download works in a partial folder that the cache names and owns (``cache.py``)::

    <folder>/data                 the blob's bytes, each at its offset
    <folder>/done/<part>          one byte per unit written (a record of progress)
    <folder>/done/<part>.synced   the part was made durable before this marker was created
    <folder>/boot, part_size      the boot and the part size the records were written under

Every received unit (1 MiB) is written at its offset as soon as it arrives, whatever its part, and then
recorded (``done/<part>``: one byte per unit, appended after the write returned), so a sync killed with
SIGKILL keeps everything it received except what was in flight (the unit each part was receiving, and at
most ``QUEUED_UNITS`` waiting for the writer); the hash runs in file order beside it, and kept bytes are read
back once for it. The records are true for as long as the machine runs (the page cache is the file, whoever
dies), not after a crash, which can lose written data and keep the record of it: so each completed part is
also made durable (``fdatasync``, then ``done/<part>.synced``, in that order, on a thread of its own), and a
partial folder from another boot keeps only those parts (``resumable``). Ranged reads carry no checksum:
the length of every part is checked here, and the sha256 of the whole file is returned for the caller to
check against the manifest.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from repo_manager.adapters.storage import Store
from repo_manager.core import paths
from repo_manager.core.errors import IntegrityError
from repo_manager.core.manifest import CHUNK

PART_SIZE = 16 * 1024 * 1024
"""Default ranged part size (the ``sync_part_size`` setting): blobs above twice the part size are fetched as
parts of this size."""
PART_WORKERS = 8
UNIT = 1024 * 1024
"""Write and resume granularity of ranged downloads."""
WINDOW = PART_WORKERS
"""Parts of one blob that may be in flight beyond the hash position (bounds memory per blob)."""

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


def start_partial(folder: Path, part_size: int) -> None:
    """Make ``folder`` (new, under a name no adopter looks at) a partial download of ``part_size`` parts."""
    (folder / "done").mkdir(parents=True)
    for name, text in (("boot", _boot_id()), ("part_size", str(part_size))):
        _write_durably(folder / name, text)  # what the progress records mean must survive a crash


def resumable(folder: Path) -> bool:
    """Whether an abandoned partial download can be resumed: one of this boot as it is, one of an earlier
    boot with only its parts that were made durable. False: nothing in it can be trusted."""
    return _same_boot(folder) or _after_a_crash(folder)


def fetch_whole(store: Store, digest: str, size: int, fd: int, *, on_bytes: OnBytes,
                limit: RateLimit | None) -> str:
    """One GET of blob ``digest`` streamed into ``fd`` (a small blob, in one thread) while hashing (no second
    read). Returns the sha256 of what was written; IntegrityError when the store sends more or fewer bytes."""
    hasher = hashlib.sha256()
    _copy(_hashed(store.read_blob(digest, 0, size), hasher), fd, 0, size, digest, on_bytes, limit)
    return hasher.hexdigest()


def download_parts(store: Store, digest: str, size: int, folder: Path, *, part_size: int, on_bytes: OnBytes,
                   parts_pool: ThreadPoolExecutor | None, limit: RateLimit | None) -> tuple[int, int, str]:
    """Fetch what ``folder/data`` lacks, in ranged parts (of the size the folder was started with, else
    ``part_size``). Returns (bytes fetched, bytes resumed, sha256 of the file).

    Each part's progress is ``done/<part>``: one byte appended per ``UNIT`` written, after the write
    returned, so a killed sync resumes every part from its last whole unit (byte-level, to within
    1 MiB). The sha256 is computed from the bytes as they arrive (``_StreamHasher``); only bytes
    kept from an earlier run are read back; the caller checks the whole file against the manifest."""
    data = folder / "data"
    fd = open_nofollow(data, os.O_RDWR | os.O_CREAT)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        part_size = _part_size(folder, part_size)
        count = (size + part_size - 1) // part_size
        done = folder / "done"
        lengths = [min(part_size, size - i * part_size) for i in range(count)]
        have = [lengths[i] if (done / f"{i}{SYNCED}").exists() else min(_units(done / str(i)) * UNIT, lengths[i])
                for i in range(count)]
        missing = [i for i in range(count) if have[i] < lengths[i]]
        checkpoints = _Checkpoints(fd, done)
        hasher = _StreamHasher(fd, part_size, lengths, have, done, recycle=store.recycle,
                               on_part=checkpoints.add)

        def part(index: int) -> int:
            try:
                if not hasher.wait_turn(index):
                    return 0  # another part failed: its error is what the caller sees
                start, length, kept = index * part_size, lengths[index], have[index]
                _receive(store.read_blob(digest, start + kept, length - kept), length - kept, digest,
                         on_bytes, limit, lambda unit: hasher.feed(index, unit))
                return length - kept
            except _Aborted:
                return 0  # another part (or the writer) failed: its error is what the caller sees
            except BaseException:
                hasher.abort()
                raise
        try:
            try:
                if parts_pool is None:
                    got = sum(map(part, missing))
                else:
                    # wait for every part before the fd is closed, even when one fails (the writer
                    # thread is joined before it too: see below)
                    got = sum(settle([parts_pool.submit(part, i) for i in missing]))
            except BaseException:
                if hasher.error is not None:  # the writer failed (ENOSPC …): that is the cause
                    raise hasher.error from None
                raise
            return got, size - got, hasher.finish()
        finally:
            hasher.close()  # the writing threads use the fd: they end before the fd is closed
            checkpoints.close()
    finally:
        os.close(fd)


def _part_size(folder: Path, default: int) -> int:
    """The part size this partial download was started with (markers count in its parts)."""
    record = folder / "part_size"
    try:
        return int(record.read_text())
    except (FileNotFoundError, ValueError):
        record.write_text(str(default))
        return default


def _copy(chunks: Iterator[bytes], fd: int, start: int, length: int, digest: str, on_bytes: OnBytes,
          limit: RateLimit | None) -> None:
    """Write ``chunks`` at ``start`` (a small blob, in one thread)."""
    offset = start
    for chunk in chunks:
        if offset + len(chunk) > start + length:
            raise IntegrityError(f"blob {digest[:12]}… is longer than its manifest says")
        if limit:
            limit.take(len(chunk))
        pwrite_all(fd, chunk, offset)
        offset += len(chunk)
        on_bytes(len(chunk))
    if offset != start + length:
        raise IntegrityError(f"blob {digest[:12]}… was truncated: got {offset - start} of {length} bytes "
                             f"at offset {start}")


def _receive(chunks: Iterator[bytes], length: int, digest: str, on_bytes: OnBytes, limit: RateLimit | None,
             on_unit: Callable[[bytes], None]) -> None:
    """Hand ``length`` bytes of ``chunks`` to ``on_unit`` in units of ``UNIT`` bytes (the last one may be
    shorter); IntegrityError when the store sends more or fewer."""
    got = 0
    pending = bytearray()
    for chunk in chunks:
        got += len(chunk)
        if got > length:
            raise IntegrityError(f"blob {digest[:12]}… is longer than its manifest says")
        if limit:
            limit.take(len(chunk))
        if not pending and len(chunk) == UNIT:  # the S3 reader streams whole units: no copy
            on_unit(chunk)
        else:
            pending += chunk
            while len(pending) >= UNIT:
                on_unit(bytes(pending[:UNIT]))
                del pending[:UNIT]
        on_bytes(len(chunk))
    if pending:
        on_unit(bytes(pending))
    if got != length:
        raise IntegrityError(f"blob {digest[:12]}… was truncated: got {got} of {length} bytes")


def open_nofollow(path: Path, flags: int) -> int:
    """Open a cache file without following a link planted at its name (paths.py's rule, for open())."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise paths.UnsafePathError(f"refusing to write through {path}: it is a symbolic link in the cache",
                                        hint="remove it; the cache holds only trm's own files",
                                        path=str(path)) from exc
        raise


SYNCED = ".synced"
"""``done/<part>.synced``: the part was on disk (``fdatasync``) before this marker was created, so it
survives a crash of the machine; the per-unit records ``done/<part>`` are true only while it runs."""


class _Checkpoints:
    """Makes completed parts of a download survive a crash of the machine, beside the writer: a thread
    ``fdatasync``s the file (one call covers every part completed meanwhile), then creates
    ``done/<part>.synced``. The order is the point: a marker that exists after a crash was created after
    its bytes were durable. The data must reach the disk before the blob is installed anyway (it is
    fsynced then), so this mostly moves that writeback earlier; best effort (a failure only means those
    parts are fetched again after a crash)."""

    def __init__(self, fd: int, done: Path) -> None:
        self.fd, self.done = fd, done
        self.queue: list[int] = []
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="trm-sync-parts", daemon=True)
        self.thread.start()

    def add(self, index: int) -> None:
        with self.cond:
            self.queue.append(index)
            self.cond.notify()

    def close(self) -> None:
        """Stop (parts not yet synced stay unmarked: a finished file is fsynced when it is installed)."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self.closed)
                if self.closed:
                    return
                batch, self.queue = self.queue, []
            try:
                os.fdatasync(self.fd)
                for index in batch:
                    os.close(os.open(self.done / f"{index}{SYNCED}", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
            except OSError:
                return


def _write_durably(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _after_a_crash(folder: Path) -> bool:
    """Make a partial download left by an earlier boot of the machine resumable: the per-unit records
    are appended after each write returned, true while the machine runs (the page cache is the file,
    whichever process dies) but not after a crash, which can lose written data and keep the record of
    it. Only parts marked synced are kept; the others are forgotten. False: nothing can be trusted."""
    try:
        int((folder / "part_size").read_text())
        done = folder / "done"
        for entry in os.scandir(done):
            if not entry.name.endswith(SYNCED) and not (done / f"{entry.name}{SYNCED}").exists():
                os.unlink(entry.path)
        _write_durably(folder / "boot", _boot_id())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return True


@functools.cache
def _boot_id() -> str:
    """This boot of the machine (Linux), "" where it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _same_boot(folder: Path) -> bool:
    try:
        return (folder / "boot").read_text() == _boot_id()
    except (OSError, UnicodeDecodeError):
        return False


def _hashed(chunks: Iterator[bytes], hasher: Any) -> Iterator[bytes]:
    for chunk in chunks:
        hasher.update(chunk)
        yield chunk


def _units(marks: Path) -> int:
    try:
        return marks.stat().st_size
    except FileNotFoundError:
        return 0


class _Marks:
    """``done/<part>``: one byte appended per unit written (created with the first one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def add(self) -> None:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self.fd, b".")

    def __enter__(self) -> _Marks:
        return self

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __exit__(self, *exc: object) -> None:
        self.close()


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    import ctypes  # noqa: PLC0415 - only when blobs are written (ctypes is slow to import)

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    return function


def _start_writeback(fd: int, start: int, length: int) -> None:
    """Start writing a finished part to disk now (Linux ``sync_file_range``, asynchronous, pages stay
    cached), so the fsync before the blob is installed finds little left to write instead of the whole
    file. Elsewhere a no-op: the fsync does it all."""
    function = _sync_file_range()
    if function is not None:
        function(fd, start, length, _SYNC_FILE_RANGE_WRITE)


WRITE_SLICE = 32 * 1024
"""Largest single write: 32 KiB, as s5cmd (Go's copy buffer) writes. The kernel sizes page-cache folios by
the write, and on the development VM (Linux 6.18, ext4) fresh large folios are slow to fill: a cold sync
of 4 x 1100 MiB, interleaved three times with s5cmd, took 17.6-22.8 s (14-16.5 system CPU-s) in 256 KiB
writes, 15.8-17.5 s in 64 KiB, 10.1-15.0 s (4.8-7.1 system CPU-s) in 32 KiB, and s5cmd 7.0-7.8 s (3.9-4.1).
The extra system calls cost ~0.3 CPU-s per 4.6 GB."""


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view[:WRITE_SLICE], offset)
        view, offset = view[written:], offset + written


class _Aborted(Exception):
    """A receiver's signal that its blob's download already failed elsewhere (never reported itself)."""


class Cancelled(BaseException):
    """Raised by an ``on_bytes`` callback to stop a download at once (the sync was interrupted): the partial
    download stays for the next sync to resume. A BaseException, so that no handler of failures takes it
    for one to retry."""


QUEUED_UNITS = 2 * PART_WORKERS
"""Received units of one blob that may wait for its writer (a receiver waits beyond that): what a kill can
lose besides the unit each part is receiving."""


class _StreamHasher:
    """Writes a file whose parts arrive in parallel, and hashes it in file order.

    Receivers queue the units they received; this one thread writes each unit as soon as it is there, at
    its offset, whatever part it belongs to (``pwrite``), and then marks it (``done/<part>``: one byte per
    unit, appended after the write returned). So a killed sync keeps everything it received except the
    units still queued (at most ``QUEUED_UNITS``: a receiver waits when the writer falls that far behind)
    and the unit each part was receiving: a few MiB, wherever the parts were. (Writing parts only in file
    order, as before, kept what was ahead of the write position in memory, and a kill lost it: 141 MB of a
    201 MB model received, 27 MB kept.)

    sha256 is sequential: a unit of the part at the hash position is hashed right after its write, while
    it is still in the CPU's caches; units of parts ahead stay in memory, written, until the position
    reaches them. A part may start only within ``WINDOW`` parts of the position, which bounds that memory
    (``WINDOW * part size`` per blob); the part at the position always started earlier (parts are queued
    in order), so the wait always ends. One writer per file: parallel writers into one file spin on its
    inode lock (measured: twice the system CPU with 8). Bytes kept from an earlier run are read back from
    the file when the position reaches them: the only second read, and only of what this process did not
    receive.
    """

    def __init__(self, fd: int, part_size: int, lengths: list[int], have: list[int], done: Path,
                 recycle: Callable[[bytes], None] = lambda unit: None,
                 on_part: Callable[[int], None] = lambda index: None) -> None:
        self.fd, self.part_size, self.lengths, self.have, self.done = fd, part_size, lengths, have, done
        self.on_part = on_part  # a part is complete in the file (``_Checkpoints`` makes it survive a crash)
        self.recycle = recycle  # a unit written and hashed goes back to the store's receive buffers
        self.hash = hashlib.sha256()
        self.position = 0  # the part being hashed
        self.hashed = 0  # bytes of that part hashed so far (this thread only)
        self.written = list(have)  # bytes of each part in the file (this thread only)
        self.held: dict[int, deque[bytes]] = {}  # written units waiting for the hash position (this thread)
        self.pending: deque[tuple[int, bytes]] = deque()  # received, not yet written, in arrival order
        self.failed = False
        self.error: BaseException | None = None
        self.input_done = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="trm-write-sha256", daemon=True)
        self.thread.start()

    def wait_turn(self, index: int) -> bool:
        """Block until part ``index`` may start; False if the download failed meanwhile."""
        with self.cond:
            self.cond.wait_for(lambda: self.failed or index < self.position + WINDOW)
            return not self.failed

    def feed(self, index: int, unit: bytes) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.failed or len(self.pending) < QUEUED_UNITS)
            if self.failed:
                raise _Aborted  # stop receiving: the failure that caused it is what gets reported
            self.pending.append((index, unit))
            if len(self.pending) == 1:
                self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def _run(self) -> None:
        marks: dict[int, _Marks] = {}
        try:
            self._loop(marks)
        except BaseException as exc:  # noqa: BLE001 - a write that failed (ENOSPC …) ends the download
            self.error = exc  # (before ``failed``: whoever sees the failure finds the error)
            self.abort()
        finally:
            for record in marks.values():
                record.close()

    def _loop(self, marks: dict[int, _Marks]) -> None:
        while True:
            with self.cond:
                while True:
                    if self.failed:
                        return
                    if self.pending:
                        index, unit = self.pending.popleft()
                        if len(self.pending) == QUEUED_UNITS - 1:
                            self.cond.notify_all()  # a receiver may be waiting for room
                        break
                    if self._can_hash():
                        unit = None
                        break
                    if self.position == len(self.lengths) or self.input_done:
                        return  # done, or every part returned and some are short: "incomplete"
                    self.cond.wait()
            if unit is not None:  # outside the lock: receivers keep queueing meanwhile
                pwrite_all(self.fd, unit, index * self.part_size + self.written[index])
                marks.setdefault(index, _Marks(self.done / str(index))).add()
                self.written[index] += len(unit)
                self.held.setdefault(index, deque()).append(unit)
                if self.written[index] >= self.lengths[index]:  # the part is complete
                    marks.pop(index).close()
                    _start_writeback(self.fd, index * self.part_size, self.lengths[index])
                    self.on_part(index)
            self._hash_ready()

    def _can_hash(self) -> bool:
        if self.position == len(self.lengths):
            return False
        index = self.position
        return self.hashed < self.have[index] or bool(self.held.get(index)) or self.hashed >= self.lengths[index]

    def _hash_ready(self) -> None:
        """Hash what the position allows, in file order; back to writing as soon as units are queued."""
        while self.position < len(self.lengths):
            index = self.position
            if self.hashed < self.have[index]:  # resumed bytes: read back from the file, a chunk at a time
                offset = index * self.part_size + self.hashed
                chunk = os.pread(self.fd, min(CHUNK, self.have[index] - self.hashed), offset)
                if not chunk:  # shorter than expected: the size check reports it
                    self.hashed = self.have[index]
                    continue
                self.hash.update(chunk)
                self.hashed += len(chunk)
            elif self.held.get(index):
                unit = self.held[index].popleft()
                self.hash.update(unit)
                self.hashed += len(unit)
                self.recycle(unit)  # written and hashed: nothing refers to it any more
            elif self.hashed >= self.lengths[index]:
                self.held.pop(index, None)
                with self.cond:
                    self.position, self.hashed = index + 1, 0
                    self.cond.notify_all()  # parts waiting for their turn
            else:
                return
            if self.pending:
                return  # write first: what is written and marked survives a kill

    def finish(self) -> str:
        """The sha256, once every part was received and hashed ("incomplete" if some bytes never came)."""
        with self.cond:
            self.input_done = True
            self.cond.notify_all()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.hash.hexdigest() if self.position == len(self.lengths) else "incomplete"

    def close(self) -> None:
        self.abort()
        self.thread.join()
