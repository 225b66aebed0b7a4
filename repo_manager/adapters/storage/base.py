"""The remote store: one interface over a content-addressed layout, for every backend.

Layout under the store's root (a folder or an ``s3://bucket/prefix``)::

    blobs/sha256/<hex>                  every file, immutable, written once
    models/<model>/versions/<N>.json    the manifest of version N; creating it claims N
    envs/<env>.json                     model -> version served by an environment (compare-and-swap)

A backend implements a handful of key-level primitives (``put_object`` with If-None-Match / If-Match,
``get_object``, ``read_object``, ``_exists``, ``list_names``, ``put_file``); this class builds the
store's meaning on top of them, so every backend gives the same guarantees and one contract test suite
(tests/test_storage_contract.py) checks them all:

* a blob is written only if absent, and only with content whose size and sha256 match its name;
* creating a version's manifest succeeds for exactly one writer (``ConflictError`` for the others);
* an environment pointer moves only if it still is what the writer read (``ConflictError`` otherwise);
* every manifest and pointer read back is parsed by the hostile-input checks of ``Manifest.from_json``
  and ``EnvPointer.from_json``.
"""

from __future__ import annotations

import difflib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from repo_manager.core import documents
from repo_manager.core.environments import ENV_NAME, check_env_name
from repo_manager.core.errors import ConflictError, InputError, IntegrityError, NotFoundError, StoreNotFoundError
from repo_manager.core.manifest import Manifest, check_model_name, check_version, now_iso

ENV_SCHEMA = "trm.env/1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_VERSION_OBJECT = re.compile(r"^([1-9][0-9]{0,18})\.json$")
MAX_ENV_MODELS = 100_000


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise IntegrityError(f"{digest!r} is not a sha256 digest")
    return digest


def blob_key(digest: str) -> str:
    return f"blobs/sha256/{check_digest(digest)}"


def manifest_key(model: str, version: int) -> str:
    return f"models/{check_model_name(model)}/versions/{check_version(version)}.json"


def env_key(env: str) -> str:
    return f"envs/{check_env_name(env)}.json"


def report_key(env: str, pod: str) -> str:
    """What one `trm agent` last reported about its server (served, refused); read by promotion waves."""
    try:
        check_env_name(pod)
    except InputError as exc:
        raise InputError(f"pod name {pod!r} is not allowed", hint="use letters, digits, '_', '-' and '.'") from exc
    return f"reports/{check_env_name(env)}/{pod}.json"


def lease_key(env: str) -> str:
    """The drain lease of an environment's agents (``trm agent``: at most K pods out of rotation)."""
    return f"leases/{check_env_name(env)}.json"


@dataclass(frozen=True)
class EnvPointer:
    """Which version of each model an environment serves. ``etag`` is what a compare-and-swap needs."""

    name: str
    models: dict[str, int] = field(default_factory=dict)
    updated_at: str = ""
    etag: str | None = None
    """The store's tag of the object this was read from; None for a pointer not read from a store."""

    def to_json(self) -> bytes:
        data = {"schema": ENV_SCHEMA, "env": self.name, "models": dict(sorted(self.models.items())),
                "updated_at": self.updated_at or now_iso()}
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    def with_models(self, models: dict[str, int]) -> EnvPointer:
        return EnvPointer(self.name, {**self.models, **models}, now_iso(), self.etag)

    @classmethod
    def from_json(cls, payload: bytes, origin: str, etag: str | None = None) -> EnvPointer:
        """Parse a pointer, refusing anything a Triton repository could not hold."""
        data = documents.parse(payload, origin, limit=documents.MAX_POINTER_BYTES)
        if not isinstance(data, dict) or data.get("schema") != ENV_SCHEMA or not isinstance(data.get("models"),
                                                                                             dict):
            raise IntegrityError(f"{origin} is not a trm environment pointer (schema {ENV_SCHEMA})")
        if len(data["models"]) > MAX_ENV_MODELS:
            raise IntegrityError(f"{origin} names more models than an environment can serve")
        models: dict[str, int] = {}
        for model, version in data["models"].items():
            try:
                models[check_model_name(model)] = check_version(version)
            except Exception as exc:
                raise IntegrityError(f"{origin}: bad entry {model!r:.100}: {version!r:.40}") from exc
        try:
            name = check_env_name(str(data.get("env", "")))
        except InputError as exc:
            raise IntegrityError(f"{origin}: {exc.message}") from exc
        return cls(name, models, str(data.get("updated_at", "")), etag)


class Store(ABC):
    """A content-addressed model store. Subclasses implement the object primitives (put, get, ranged read,
    size, list, file upload); everything else (blobs, manifests, pointers, leases, history, copies) is
    built on them here."""

    location: str

    # ------------------------------------------------------------------------- backend primitives
    @abstractmethod
    def put_object(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None,
                   sha256: str | None = None) -> str:
        """Write ``data``; returns the new tag. ``ConflictError`` when a condition does not hold."""

    @abstractmethod
    def get_object(self, key: str) -> tuple[bytes, str]:
        """(content, tag); ``NotFoundError`` when absent."""

    @abstractmethod
    def read_object(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """Stream ``length`` bytes from ``start``; ``NotFoundError`` when absent."""

    @abstractmethod
    def object_size(self, key: str) -> int:
        """Size of the object; ``NotFoundError`` when absent."""

    @abstractmethod
    def list_names(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (a folder-like key ending in '/')."""

    @abstractmethod
    def put_file(self, key: str, path: Path, size: int, sha256: str) -> None:
        """Create ``key`` from ``path`` if absent; the store must check the content's sha256."""

    @abstractmethod
    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (a folder-like key ending in '/'), at any depth: its name below the
        prefix -> its size."""

    @abstractmethod
    def put_stream(self, key: str, chunks: Iterable[bytes], size: int, sha256: str) -> None:
        """Create ``key`` from ``chunks`` if absent, holding at most one part in memory; the content must
        have ``size`` and ``sha256`` (IntegrityError, nothing created, when not)."""

    def copy_server_side(self, source: Store, digest: str, key: str) -> bool:
        """Copy blob ``digest`` of ``source`` to ``key`` here inside the storage service (no bytes through
        this machine). False when this pair of stores cannot: the caller moves the bytes."""
        return False

    def get_object_if_changed(self, key: str, tag: str | None) -> tuple[bytes, str] | None:
        """(content, tag), or None when the object still has ``tag``. Backends override this with a
        request that does not transfer an unchanged object (S3: ``If-None-Match``)."""
        payload, new_tag = self.get_object(key)
        return None if tag is not None and new_tag == tag else (payload, new_tag)

    # ------------------------------------------------------------------------------------ blobs
    def has_blob(self, digest: str) -> bool:
        try:
            self.object_size(blob_key(digest))
        except NotFoundError:
            return False
        return True

    def blob_size(self, digest: str) -> int:
        return self.object_size(blob_key(digest))

    def put_blob(self, digest: str, path: Path, size: int) -> bool:
        """Upload ``path`` as blob ``digest`` unless present. True if uploaded."""
        if self.has_blob(digest):
            return False
        self.put_file(blob_key(digest), path, size, digest)
        return True

    def put_blob_bytes(self, digest: str, data: bytes) -> bool:
        """Store ``data`` (checked against ``digest`` by the store) as blob ``digest`` unless present. True if
        stored."""
        if self.has_blob(digest):
            return False
        try:
            self.put_object(blob_key(digest), data, if_absent=True, sha256=digest)
        except ConflictError:
            return False  # another writer stored it meanwhile: the same bytes, by its name
        return True

    def copy_blob(self, source: Store, digest: str, size: int, key: str | None = None, *,
                  local: Path | None = None) -> bool:
        """Blob ``digest`` of ``source`` into this store at ``key`` (default: its blob key): inside the service
        where both stores allow it, else uploaded from ``local`` (a verified copy on this machine, such as the
        node cache's) when given, else streamed through this machine a part at a time (bounded memory,
        whatever the blob's size) and checked against ``size`` and ``digest``. True when copied server-side."""
        key = key or blob_key(digest)
        if self.copy_server_side(source, digest, key):
            copied = self.object_size(key)
            if copied != size:  # the bytes are not re-sent over an object that exists: say so, never keep it quiet
                raise IntegrityError(f"blob {digest[:12]} copied from {source.location} inside the service holds "
                                     f"{copied} bytes where its manifest says {size}",
                                     hint="the source store is corrupt: push the version again")
            return True
        if local is not None:
            self.put_file(key, local, size, digest)
        else:
            self.put_stream(key, source.read_blob(digest, 0, size), size, digest)
        return False

    def read_blob(self, digest: str, start: int = 0, length: int | None = None) -> Iterator[bytes]:
        """Stream a blob or a byte range of it. The caller verifies what it received."""
        if length is None:
            length = self.blob_size(digest) - start
        return self.read_object(blob_key(digest), start, length)

    def recycle(self, chunk: bytes | bytearray) -> None:
        """The caller of ``read_blob`` is done with ``chunk`` (written and hashed): a store that receives
        into reusable buffers may fill it again. Only call it once nothing refers to the chunk any more."""
        return None  # a store that allocates per read has nothing to reuse

    # -------------------------------------------------------------------------------- manifests
    def put_manifest(self, manifest: Manifest) -> None:
        """Create the manifest of a version: this claims the number. ``ConflictError`` if taken."""
        key = manifest_key(manifest.model, manifest.version)
        try:
            self.put_object(key, manifest.to_json(), if_absent=True)
        except ConflictError as exc:
            raise ConflictError(f"version {manifest.version} of {manifest.model} already exists in "
                                f"{self.location}", hint="publish again to take the next number",
                                model=manifest.model, version=manifest.version) from exc

    def get_manifest(self, model: str, version: int) -> Manifest:
        key = manifest_key(model, version)
        payload, _ = self.get_object(key)
        return self.parse_manifest(payload, model, version)

    def parse_manifest(self, payload: bytes, model: str, version: int) -> Manifest:
        origin = f"{self.location}/{manifest_key(model, version)}"
        manifest = Manifest.from_json(payload, origin)
        if manifest.model != model or manifest.version != version:
            raise IntegrityError(f"{origin} describes {manifest.model}/{manifest.version}")
        return manifest

    def list_versions(self, model: str) -> list[int]:
        """Versions with a manifest (one listing of the model's folder; sync never needs it)."""
        names = self.list_names(f"models/{check_model_name(model)}/versions/")
        found = (_VERSION_OBJECT.match(n) for n in names)  # canonical decimal names only ('01', '١' are not)
        return sorted(v for v in (int(m.group(1)) for m in found if m) if v <= 2 ** 63 - 1)

    def list_models(self) -> list[str]:
        return sorted(n.rstrip("/") for n in self.list_names("models/"))

    # ----------------------------------------------------------------------------- environments
    def list_envs(self) -> list[str]:
        """Environments with a pointer in this store."""
        names = (n.rstrip("/") for n in self.list_names("envs/"))
        found = {n.removesuffix(".revs").removesuffix(".json") for n in names
                 if n.endswith((".json", ".json.revs"))}
        return sorted(n for n in found if ENV_NAME.match(n))

    def env_hint(self, env: str, declared: list[str] | tuple[str, ...] = ()) -> str:
        """What to say about an environment that does not exist: the close names, else how to create it."""
        try:
            known = sorted(set(self.list_envs()) | set(declared))
        except (NotFoundError, ConflictError, IntegrityError, InputError, OSError):
            known = sorted(declared)
        close = difflib.get_close_matches(env, known, n=3, cutoff=0.6)
        if close:
            return f"did you mean {' or '.join(close)}? (known: {', '.join(known)})"
        listing = f"known: {', '.join(known)}; " if known else ""
        return f"{listing}create it with `trm push {self.location} --env {env}`"

    def get_env(self, env: str) -> EnvPointer:
        pointer = self.get_env_if_changed(env, None)
        if pointer is None:  # no tag to compare with: never "unchanged"
            raise AssertionError("a read without a tag answered 'unchanged'")
        return pointer

    def get_env_if_changed(self, env: str, etag: str | None) -> EnvPointer | None:
        """The pointer, or None when it still has ``etag`` (a conditional read: what `trm agent` polls, and
        the one read of an unchanged sync; on S3 one GET on a connection of its own)."""
        try:
            got = self.get_object_if_changed(env_key(env), etag)
        except StoreNotFoundError:
            raise  # the store itself is missing: saying "no such environment" would mislead
        except NotFoundError as exc:
            raise NotFoundError(f"environment {env} does not exist in {self.location}",
                                hint=self.env_hint(env), env=env) from exc
        if got is None:
            return None
        pointer = EnvPointer.from_json(got[0], f"{self.location}/{env_key(env)}", got[1])
        if pointer.name != env:
            raise IntegrityError(f"{self.location}/{env_key(env)} names environment {pointer.name!r}")
        return pointer

    def get_lease(self, env: str) -> tuple[bytes, str] | None:
        """The raw lease object of ``env`` and its tag, None when there is none (see repo_manager.ops.agent)."""
        try:
            return self.get_object(lease_key(env))
        except NotFoundError:
            return None

    def put_lease(self, env: str, payload: bytes, tag: str | None) -> str:
        """Compare-and-swap the lease object (create it when ``tag`` is None). ``ConflictError`` when
        another writer changed it since it was read."""
        return self.put_object(lease_key(env), payload, if_absent=tag is None, if_match=tag)

    def put_report(self, env: str, pod: str, payload: bytes) -> None:
        """Replace the agent report of ``pod`` (last writer wins: each pod writes only its own)."""
        self.put_object(report_key(env, pod), payload)

    def get_reports(self, env: str) -> dict[str, bytes]:
        """pod -> raw report of every agent of ``env`` (one listing; promotion time only)."""
        prefix = f"reports/{check_env_name(env)}/"
        reports = {}
        for name in self._object_names(prefix):
            if name.endswith(".json"):
                try:
                    reports[name[:-5]] = self.get_object(prefix + name)[0]
                except NotFoundError:
                    continue
        return reports

    def _object_names(self, prefix: str) -> list[str]:
        """Object names directly under ``prefix`` (backends that store objects otherwise map them)."""
        return [n for n in self.list_names(prefix) if not n.endswith("/")]

    def put_env(self, pointer: EnvPointer) -> str:
        """Compare-and-swap: write ``pointer`` only if the stored one still has ``pointer.etag``
        (or, with etag None, only if there is none yet). Returns the new tag."""
        try:
            return self.put_object(env_key(pointer.name), pointer.to_json(), if_absent=pointer.etag is None,
                                   if_match=pointer.etag)
        except ConflictError as exc:
            raise ConflictError(f"environment {pointer.name} in {self.location} was changed by another "
                                "writer", hint="read it again and retry", env=pointer.name) from exc

    def update_env(self, env: str, models: dict[str, int], *, retries: int = 5) -> EnvPointer:
        """Point ``env`` at ``models`` (others unchanged), retrying lost compare-and-swap races. A pointer that
        already says so is left as it is: a new revision would wake every agent watching it for nothing."""
        for _ in range(retries):
            try:
                current = self.get_env(env)
            except NotFoundError:
                current = EnvPointer(env)
            else:
                if all(current.models.get(m) == v for m, v in models.items()):
                    return current
            updated = current.with_models(models)
            try:
                tag = self.put_env(updated)
            except ConflictError:
                continue
            return EnvPointer(updated.name, updated.models, updated.updated_at, tag)
        raise ConflictError(f"environment {env} in {self.location} kept changing; gave up after {retries} tries",
                            env=env)
