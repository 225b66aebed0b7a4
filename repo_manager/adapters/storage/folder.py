"""The store in a plain folder: the embedded default, and what the contract tests run against first.

Immutable objects (blobs, manifests) are written to a unique temporary file, fsynced, then published
with ``os.link(tmp, final)``: link fails with EEXIST when the name exists, so exactly one writer creates
an object and nobody ever sees it half-written (``O_EXCL`` semantics, but for a complete file).

Mutable objects (environment pointers, ``envs/<env>.json``) need compare-and-swap, which a rename cannot
give (``os.replace`` always wins). They are stored as an append-only series of revisions,
``envs/<env>.json.revs/<000000000001>.json`` …, each created with the same link-if-absent: the tag of a
pointer is its revision number, and writing with ``if_match=N`` means creating revision N+1, which
exactly one writer can do. The newest revision is the pointer; the series doubles as its history.
No lock is involved anywhere, so this holds on network filesystems where locks silently fail.
"""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from repo_manager.adapters.storage.base import Store
from repo_manager.core import documents
from repo_manager.core.errors import ConflictError, IntegrityError, NotFoundError, StoreError, StoreNotFoundError
from repo_manager.core.manifest import CHUNK

_REVS = ".revs"
_REV_WIDTH = 12


class FolderStore(Store):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().absolute()
        self.location = str(self.root)

    def _path(self, key: str) -> Path:
        # keys are built by base.py from checked names; this is a last line of defence
        if key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"refusing key {key!r} outside the store")
        return self.root / key

    @staticmethod
    def _mutable(key: str) -> bool:
        return key.startswith(("envs/", "leases/", "reports/"))

    # ------------------------------------------------------------------------------- primitives
    def _link_new(self, path: Path, write) -> None:
        """Write through ``write(handle)`` into a temp file, then link it to ``path`` if absent."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError as exc:
                raise ConflictError(f"{path} already exists") from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _revisions(self, key: str) -> list[int]:
        folder = self._path(key + _REVS)
        if not folder.is_dir():
            return []
        return sorted(int(p.stem) for p in folder.iterdir() if p.suffix == ".json" and p.stem.isascii()
                      and p.stem.isdigit())

    def put_object(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None,
                   sha256: str | None = None) -> str:
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise IntegrityError(f"refusing to store {key}: content does not match sha256 {sha256}")
        if self._mutable(key):
            if if_match is not None and not if_match.isdigit():
                raise ConflictError(f"{key} has no revision {if_match!r}")
            revisions = self._revisions(key)
            if if_absent and revisions:
                raise ConflictError(f"{key} already exists")
            if if_match is not None and (not revisions or revisions[-1] != int(if_match)):
                raise ConflictError(f"{key} is no longer at revision {if_match}")
            new = (revisions[-1] + 1) if revisions else 1
            target = self._path(key + _REVS) / f"{new:0{_REV_WIDTH}d}.json"
            self._link_new(target, lambda h: h.write(data))
            return str(new)
        if if_match is not None:
            raise StoreError(f"{key} is immutable; it cannot be replaced")
        path = self._path(key)
        if not if_absent:
            raise StoreError(f"{key} is immutable; write it only if absent")
        self._link_new(path, lambda h: h.write(data))
        return hashlib.sha256(data).hexdigest()

    def _missing(self, key: str) -> NotFoundError:
        if not self.root.is_dir():  # the whole store is missing, not one object in it
            return StoreNotFoundError(f"store folder {self.location} does not exist",
                                      hint="check the store location", store=self.location)
        return NotFoundError(f"{key} does not exist in {self.location}", store=self.location)

    def _read_document(self, path: Path, key: str) -> bytes:
        """A document (manifest, pointer, record), its size checked before it is read."""
        try:
            documents.check_size(path.stat().st_size, f"{self.location}/{key}")
            return path.read_bytes()
        except FileNotFoundError as exc:
            raise self._missing(key) from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key} in {self.location}: {exc.strerror}") from exc

    def get_object(self, key: str) -> tuple[bytes, str]:
        if self._mutable(key):
            revisions = self._revisions(key)
            if not revisions:
                raise self._missing(key)
            path = self._path(key + _REVS) / f"{revisions[-1]:0{_REV_WIDTH}d}.json"
            return self._read_document(path, key), str(revisions[-1])
        data = self._read_document(self._path(key), key)
        return data, hashlib.sha256(data).hexdigest()

    def _object_names(self, prefix: str) -> list[str]:
        # a mutable object is its revision series, the folder <name>.revs
        return [n[:-len(_REVS) - 1] if n.endswith(_REVS + "/") else n for n in self.list_names(prefix)
                if not n.endswith("/") or n.endswith(_REVS + "/")]

    def get_object_if_changed(self, key: str, tag: str | None) -> tuple[bytes, str] | None:
        if self._mutable(key) and tag is not None:
            revisions = self._revisions(key)  # one directory read; the pointer itself only when it moved
            if revisions and str(revisions[-1]) == tag:
                return None
        return super().get_object_if_changed(key, tag)

    def read_object(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """Bytes of an object, which must be a regular file of the store: never through a link, never a
        folder or a FIFO (a read that would block) put where an object belongs."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{key} does not exist in {self.location}", store=self.location) from exc
        except OSError as exc:
            raise IntegrityError(f"{key} in {self.location} is not a readable file ({exc.strerror})",
                                 hint="the store is damaged: push the version again") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IntegrityError(f"{key} in {self.location} is not a regular file",
                                 hint="the store is damaged: push the version again")
        handle = os.fdopen(fd, "rb")

        def chunks() -> Iterator[bytes]:
            with handle:
                handle.seek(start)
                left = length
                while left > 0:
                    chunk = handle.read(min(CHUNK, left))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk
        return chunks()

    def object_size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError as exc:
            raise NotFoundError(f"{key} does not exist in {self.location}", store=self.location) from exc

    def list_names(self, prefix: str) -> list[str]:
        folder = self._path(prefix.rstrip("/"))
        if not folder.is_dir():
            return []
        return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                      if not p.name.startswith(".tmp-"))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        folder = self._path(prefix.rstrip("/"))
        if not folder.is_dir():
            return {}
        return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
                if p.is_file() and not p.is_symlink() and not p.name.startswith(".tmp-")}

    def put_stream(self, key: str, chunks: Iterable[bytes], size: int, sha256: str) -> None:
        def copy(handle) -> None:
            digest, written = hashlib.sha256(), 0
            for chunk in chunks:
                digest.update(chunk)
                written += len(chunk)
                handle.write(chunk)
            if written != size or digest.hexdigest() != sha256:
                raise IntegrityError(f"refusing to store {key}: the content does not match sha256 {sha256}")
        try:
            self._link_new(self._path(key), copy)
        except ConflictError:
            pass  # the same content, written by another writer

    def put_file(self, key: str, path: Path, size: int, sha256: str) -> None:
        def copy(handle) -> None:
            digest, written = hashlib.sha256(), 0
            with open(path, "rb") as source:
                while chunk := source.read(CHUNK):
                    digest.update(chunk)
                    written += len(chunk)
                    handle.write(chunk)
            if written != size or digest.hexdigest() != sha256:
                raise IntegrityError(f"{path} changed: it no longer matches its manifest (sha256 {sha256})",
                                     hint="republish the version")
        try:
            self._link_new(self._path(key), copy)
        except ConflictError:
            pass  # the same content, uploaded by another writer
