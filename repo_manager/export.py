"""`trm export STORE DEST`: a plain Triton layout, for those who point a stock Triton at a folder or S3.

    <dest>/<model>/config.pbtxt           config of the newest exported version
    <dest>/<model>/<N>/<files>

The store's own format stays content-addressed; this is a copy. Into a folder every file is streamed
from the store, checked against its manifest (size and sha256) and renamed into place. Into S3 a file
is copied server-side when both sides are S3 on one endpoint, otherwise uploaded with its SHA-256 as
the checksum the service verifies. Export writes the version folders before config.pbtxt, but a stock
Triton polling the destination can still see a partly exported model: export to a fresh prefix.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from repo_manager import config as cfg
from repo_manager.errors import InputError, IntegrityError, NotFoundError
from repo_manager.manifest import FileEntry, Manifest, check_model_name
from repo_manager.progress import Progress, quiet
from repo_manager.settings import Settings
from repo_manager.storage import Store, blob_key
from repo_manager.storage.folder import FolderStore
from repo_manager.storage.s3 import S3Store, parse_s3_url
from repo_manager.sync.plan import check_manifest_config


@dataclass(frozen=True)
class ExportResult:
    dest: str
    versions: int
    files: int
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def chosen_versions(store: Store, env: str | None, models: tuple[str, ...]) -> dict[str, list[int]]:
    if env is not None:
        pointer = store.get_env(env).models
        absent = sorted(set(models) - set(pointer))
        if absent:
            raise NotFoundError(f"environment {env} in {store.location} does not serve {', '.join(absent)}",
                                env=env)
        return {m: [v] for m, v in pointer.items() if not models or m in models}
    found = {}
    for model in models or tuple(store.list_models()):
        versions = store.list_versions(check_model_name(model))
        if not versions:
            raise NotFoundError(f"model {model} has no version in {store.location}", model=model)
        found[model] = versions
    if not found:  # a mistyped store location must not look like a successful export
        raise NotFoundError(f"nothing to export: {store.location} holds no model",
                            hint="check the store location (and --endpoint-url)")
    return found


class _FolderTarget:
    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def write_file(self, store: Store, entry: FileEntry, key: str) -> None:
        target = self.root / key
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot write the export into {target.parent}: {exc.strerror}",
                             hint="export to a writable folder") from exc
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as handle:
                for chunk in store.read_blob(entry.sha256, 0, entry.size):
                    digest.update(chunk)
                    size += len(chunk)
                    handle.write(chunk)
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise IntegrityError(f"blob of {key} in {store.location} does not match its manifest",
                                     hint="push the version again")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def write_config(self, key: str, text: str) -> None:
        cfg.write_config(self.root / key, cfg.parse_config(text))


class _S3Target:
    def __init__(self, dest: str, settings: Settings) -> None:
        self.store = S3Store(dest, endpoint_url=settings.s3_endpoint_url)

    def write_file(self, store: Store, entry: FileEntry, key: str) -> None:
        target = self.store
        if isinstance(store, S3Store) and store.endpoint_url == target.endpoint_url:
            source = {"Bucket": store.bucket, "Key": store._key(blob_key(entry.sha256))}
            target._call("copy", key, target.client.copy_object, CopySource=source)
        elif isinstance(store, FolderStore):
            target._upload_file(key, store.root / blob_key(entry.sha256), entry.size, entry.sha256)
        else:
            data = b"".join(store.read_blob(entry.sha256, 0, entry.size))
            target._put_bytes(key, data, sha256=entry.sha256)

    def write_config(self, key: str, text: str) -> None:
        config = cfg.parse_config(text)
        self.store._put_bytes(key, cfg.config_to_text(config).encode())


def export(store: Store, dest: str, settings: Settings, *, env: str | None = None, models: tuple[str, ...] = (),
           progress: Progress = quiet) -> ExportResult:
    if dest.startswith("s3://"):
        parse_s3_url(dest)
        target: Any = _S3Target(dest, settings)
    else:
        target = _FolderTarget(dest)
    versions = files = size = 0
    for model, numbers in sorted(chosen_versions(store, env, models).items()):
        newest: Manifest | None = None
        for version in numbers:
            manifest = store.get_manifest(model, version)
            check_manifest_config(manifest)
            for entry in manifest.files:
                target.write_file(store, entry, f"{model}/{version}/{entry.path}")
                files += 1
                size += entry.size
            versions += 1
            newest = manifest
            progress(f"exported {model}/{version}")
        if newest is not None:
            target.write_config(f"{model}/config.pbtxt", newest.config)
    return ExportResult(dest, versions, files, size)
