"""Remote stores: ``open_store("s3://bucket/prefix" | "/some/folder", settings)``. See ``base.py``."""

from __future__ import annotations

from repo_manager.errors import UsageError
from repo_manager.redact import check_no_userinfo
from repo_manager.settings import Settings
from repo_manager.storage.base import EnvPointer, Store, blob_key, check_env_name, env_key, manifest_key
from repo_manager.storage.folder import FolderStore

__all__ = ["EnvPointer", "FolderStore", "Store", "blob_key", "check_env_name", "env_key", "manifest_key",
           "open_store"]


def open_store(location: str | None, settings: Settings | None = None) -> Store:
    """The store at ``location`` (default: ``settings.store``)."""
    location = location or (settings.store if settings else None)
    if not location:
        raise UsageError("no store given", hint="pass STORE (s3://bucket/prefix or a folder) or set TRM_STORE")
    check_no_userinfo(location, "the store location")
    if location.startswith("s3://"):
        from repo_manager.storage.s3 import S3Store  # noqa: PLC0415 - boto3 only when needed

        return S3Store(location, endpoint_url=settings.s3_endpoint_url if settings else None)
    if "://" in location:
        raise UsageError(f"store location {location!r} is not supported",
                         hint="use s3://bucket/prefix or a folder path")
    return FolderStore(location)
