"""`trm export STORE DEST`: a plain Triton layout, for those who point a stock Triton at a folder or S3.

    <dest>/<model>/config.pbtxt           config of the newest exported version
    <dest>/<model>/<label and data files> what that config reads from the model folder (label_filename,
                                          warmup/<input_data_file>), carried in its manifest
    <dest>/<model>/<N>/<files>

The store's own format stays content-addressed; this is a copy. Into a folder every file is streamed
from the store, checked against its manifest (size and sha256) and renamed into place. Into S3 a file
is copied server-side when both sides are S3 on one endpoint, otherwise uploaded with its SHA-256 as
the checksum the service verifies. Export writes the version folders before config.pbtxt, but a stock
Triton polling the destination can still see a partly exported model: export to a fresh prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from repo_manager.adapters.repository import version_of
from repo_manager.adapters.storage import Store, blob_key
from repo_manager.adapters.storage.folder import FolderStore
from repo_manager.adapters.storage.s3 import S3Store, parse_s3_url
from repo_manager.core import config as cfg
from repo_manager.core import paths
from repo_manager.core.errors import InputError, IntegrityError, NotFoundError, UsageError, VersionExistsError
from repo_manager.core.localized import MAX_BYTES, entry_digest, installed_form, localized_paths
from repo_manager.core.manifest import FileEntry, Manifest, check_model_name
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.sync.plan import check_manifest_config


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

    def existing(self, prefix: str) -> dict[str, int] | None:
        """Files under ``prefix`` (relative path -> size), None when the folder does not exist."""
        folder = paths.check_within(self.root, self.root / prefix)
        if not folder.exists():
            return None
        if folder.is_symlink() or not folder.is_dir():
            raise paths.UnsafePathError(f"{folder} is not a real folder", path=str(folder))
        found = {}
        for path in folder.rglob("*"):
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                found[path.relative_to(folder).as_posix()] = -1  # never equal to what the store holds
            elif path.is_file():
                found[path.relative_to(folder).as_posix()] = path.stat().st_size
        return found

    def recorded_digest(self, prefix: str, entry: FileEntry, config: str) -> tuple[str, int]:
        return entry_digest(config, self.root / prefix, entry)

    def newest_present(self, model: str) -> int:
        folder = self.root / model
        if not folder.is_dir() or folder.is_symlink():
            return 0
        return max((version_of(p.name) or 0 for p in folder.iterdir()), default=0)

    def write_file(self, store: Store, entry: FileEntry, key: str, localized: bool = False) -> None:
        """``localized``: a file stored with a placeholder for its folder (a vLLM model.json), checked, then
        written naming the folder it lands in."""
        target = self.root / key
        digest, size = hashlib.sha256(), 0

        def chunks():
            nonlocal size
            for chunk in store.read_blob(entry.sha256, 0, entry.size):
                digest.update(chunk)
                size += len(chunk)
                yield chunk
            if size != entry.size or digest.hexdigest() != entry.sha256:
                raise IntegrityError(f"blob of {key} in {store.location} does not match its manifest",
                                     hint="push the version again")
        try:
            if localized:
                installed = installed_form(b"".join(chunks()), self.root / key[:-len(entry.path) - 1])
                paths.write_new_file(self.root, target, [installed])
            else:
                paths.write_new_file(self.root, target, chunks())
        except paths.UnsafePathError:
            raise
        except InputError as exc:
            raise InputError(f"cannot write the export into {target.parent}: {exc.message}",
                             hint="export to a writable folder") from exc
        except OSError as exc:
            raise InputError(f"cannot write the export into {target.parent}: {exc.strerror}",
                             hint="export to a writable folder") from exc

    def write_config(self, key: str, text: str) -> None:
        paths.write_new_file(self.root, self.root / key, [cfg.config_to_text(cfg.parse_config(text)).encode()])

    def write_model_file(self, key: str, content: bytes) -> None:
        paths.write_new_file(self.root, self.root / key, [content])


class _S3Target:
    def __init__(self, dest: str, settings: Settings) -> None:
        self.store = S3Store(dest, endpoint_url=settings.s3_endpoint_url)

    def existing(self, prefix: str) -> dict[str, int] | None:
        return self.store.list_sizes(prefix.rstrip("/") + "/") or None

    def recorded_digest(self, prefix: str, entry: FileEntry, config: str) -> tuple[str, int]:
        key, digest, size = f"{prefix}/{entry.path}", hashlib.sha256(), 0
        for chunk in self.store.read_object(key, 0, self.store.object_size(key)):
            digest.update(chunk)
            size += len(chunk)
        return digest.hexdigest(), size

    def newest_present(self, model: str) -> int:
        names = self.store.list_names(f"{model}/")
        return max((version_of(n.rstrip("/")) or 0 for n in names if n.endswith("/")), default=0)

    def write_file(self, store: Store, entry: FileEntry, key: str, localized: bool = False) -> None:
        """``localized`` is ignored: Triton copies an S3 repository into a temporary folder whose name is not
        known here, so a vLLM model.json keeps its placeholder (see docs)."""
        if isinstance(store, FolderStore):  # parallel parts straight from the store's file
            self.store.put_file(key, store.root / blob_key(entry.sha256), entry.size, entry.sha256)
        else:  # inside the service when it can, else streamed a part at a time
            self.store.copy_blob(store, entry.sha256, entry.size, key=key)

    def write_config(self, key: str, text: str) -> None:
        config = cfg.parse_config(text)
        self.store.put_object(key, cfg.config_to_text(config).encode())

    def write_model_file(self, key: str, content: bytes) -> None:
        self.store.put_object(key, content)


def files_to_write(target: Any, manifest: Manifest, dest: str) -> list[FileEntry]:
    """The files of ``manifest`` the destination lacks. A version already there is left alone when it is
    this one, complete or partly written by an interrupted export (every file present has this version's
    size and sha256, and nothing else is there); any other content under that number is never replaced."""
    prefix = f"{manifest.model}/{manifest.version}"
    present = target.existing(prefix)
    if not present:
        return list(manifest.files)
    wanted = {f.path: f for f in manifest.files}
    localized = localized_paths(manifest.config)  # installed with another size than recorded
    different = sorted(p for p, size in present.items()
                       if p not in wanted or p not in localized and wanted[p].size != size)
    if not different:
        different = sorted(p for p in present if target.recorded_digest(prefix, wanted[p], manifest.config)
                           != (wanted[p].sha256, wanted[p].size))
    if different:
        raise VersionExistsError(f"{dest.rstrip('/')}/{prefix} holds a different version {manifest.version} of "
                                 f"{manifest.model} ({different[0]} differs); it is never replaced",
                                 hint="export into an empty destination, or move that version away",
                                 model=manifest.model, version=manifest.version)
    return [f for f in manifest.files if f.path not in present]


def _overlap(a: str, b: str) -> bool:
    """Whether one of two '/'-separated locations is the other or inside it."""
    a, b = a.strip("/") + "/", b.strip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def export(store: Store, dest: str, settings: Settings, *, env: str | None = None, models: tuple[str, ...] = (),
           progress: Progress = quiet) -> ExportResult:
    if dest.startswith("s3://"):
        bucket, prefix = parse_s3_url(dest)
        if isinstance(store, S3Store) and bucket == store.bucket and _overlap(prefix, store.prefix):
            raise UsageError(f"cannot export {store.location} into {dest}: one holds the other",
                             hint="export to a prefix outside the store")
        target: Any = _S3Target(dest, settings)
    else:
        if isinstance(store, FolderStore) and _overlap(str(Path(dest).resolve()), str(store.root.resolve())):
            raise UsageError(f"cannot export {store.location} into {dest}: one holds the other",
                             hint="export to a folder outside the store")
        target = _FolderTarget(dest)
    versions = files = size = 0
    for model, numbers in sorted(chosen_versions(store, env, models).items()):
        newest: Manifest | None = None
        for version in numbers:
            manifest = store.get_manifest(model, version)
            check_manifest_config(manifest)
            missing = files_to_write(target, manifest, dest)
            if isinstance(target, _FolderTarget):
                paths.check_free_space(target.root, sum(f.size for f in missing), f"export of {model}/{version}")
            localized = localized_paths(manifest.config)
            for entry in missing:
                target.write_file(store, entry, f"{model}/{version}/{entry.path}",
                                  entry.path in localized and entry.size <= MAX_BYTES)
                files += 1
                size += entry.size
            versions += 1
            newest = manifest
            progress(f"exported {model}/{version}" if missing else f"{model}/{version} is already there")
        # config.pbtxt follows the newest version in the destination, which may be newer than this export's
        if newest is not None and newest.version >= target.newest_present(model):
            for path, content in newest.model_files.items():  # label and warm-up files, before the config
                target.write_model_file(f"{model}/{path}", content)
            target.write_config(f"{model}/config.pbtxt", newest.config)
    return ExportResult(dest, versions, files, size)
