"""Remote stores: ``open_store("s3://bucket/prefix" | "/some/folder", settings)``. See ``base.py``.

Importing this package is cheap (its names are imported on first use), so that ``sigv4`` (the one
signed read of an unchanged sync) can be imported without the store classes and their dependencies.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see sigv4.py: this path is light)
if TYPE_CHECKING:
    from typing import Any

    from repo_manager.adapters.storage.base import Store
    from repo_manager.core.settings import Settings

__all__ = ["EnvPointer", "FolderStore", "Store", "blob_key", "env_key", "manifest_key", "open_store"]


def __getattr__(name: str) -> Any:
    if name == "FolderStore":
        from repo_manager.adapters.storage.folder import FolderStore  # noqa: PLC0415 - off the quick sync path

        return FolderStore
    if name in __all__:
        from repo_manager.adapters.storage import base  # noqa: PLC0415 - off the quick sync path

        return getattr(base, name)
    raise AttributeError(name)


def open_store(location: str | None, settings: Settings | None = None, *, timeout_s: float | None = None) -> Store:
    """The store at ``location`` (default: ``settings.store``). ``timeout_s`` bounds each network connect
    and read of an S3 store, with no retry (a look-up that must answer quickly)."""
    from repo_manager.core.errors import UsageError  # noqa: PLC0415 - off the quick sync path
    from repo_manager.core.redact import check_no_userinfo  # noqa: PLC0415 - off the quick sync path

    location = location or (settings.store if settings else None)
    if not location:
        raise UsageError("no store given", hint="pass STORE (s3://bucket/prefix or a folder) or set TRM_STORE")
    check_no_userinfo(location, "the store location")
    if location.startswith("s3://"):
        from repo_manager.adapters.storage.s3 import S3Store  # noqa: PLC0415 - boto3 only when needed

        return S3Store(location, endpoint_url=settings.s3_endpoint_url if settings else None, timeout_s=timeout_s)
    if "://" in location:
        raise UsageError(f"store location {location!r} is not supported",
                         hint="use s3://bucket/prefix or a folder path")
    import re  # noqa: PLC0415 - off the quick sync path

    if not location.strip() or location != location.strip() or re.match(r"(?i)[a-z][a-z0-9+.-]+:", location):
        # 's3:/bucket/p', 's3:bucket' (a mistyped URL) or ' ': not a folder anyone means to create
        raise UsageError(f"store location {location!r} is neither s3://bucket/prefix nor a plain folder path",
                         hint="write s3://bucket/prefix, or ./NAME for a folder whose name has a ':' or spaces")
    from repo_manager.adapters.storage.folder import FolderStore  # noqa: PLC0415 - off the quick sync path

    return FolderStore(location)
