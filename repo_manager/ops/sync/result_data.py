"""A sync's result as plain data, for the quick path that answers before ``dataclasses`` is imported.

``SyncResult`` (result.py) is built from these fields and its ``to_dict`` is ``as_dict`` of them, so the
quick path of an unchanged sync (``noop.quick``, called by ``repo_manager/entry.py``) and the full one
(``noop.try_unchanged``) answer the same result from one function. Light on purpose: no typing,
dataclasses or anything else of trm (see noop.py).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see the module docstring)
if TYPE_CHECKING:
    from typing import Any


def unchanged(store: str, env: str, repository: str, models: dict[str, Any], seconds: float) -> dict[str, Any]:
    """``SyncResult``'s fields, in its order, for an unchanged sync of ``env`` from ``store`` into
    ``repository``: what the node cache's record (``models``: per model its version and files) says it serves,
    read with one conditional request."""
    return {"store": store, "env": env, "repository": str(repository),
            "models": {m: int(e["version"]) for m, e in models.items()}, "installed": (), "configs_replaced": (),
            "pruned": (), "kept_loaded": (), "bytes_downloaded": 0, "bytes_resumed": 0, "bytes_reused": 0,
            "files": sum(len(e["files"]) for e in models.values()), "blobs_downloaded": 0, "remote_reads": 1,
            "gc_removed": 0, "gc_freed_bytes": 0, "seconds": seconds, "unchanged": True}


def throughput_mb_s(bytes_downloaded: int, seconds: float) -> float:
    return round(bytes_downloaded / 1e6 / seconds, 1) if seconds > 0 else 0.0


def as_dict(fields: dict[str, Any]) -> dict[str, Any]:
    """``SyncResult.to_dict()`` of a result with these fields (its ``extra`` left out): lists for tuples, the
    seconds rounded to milliseconds, and the download rate."""
    data = {name: list(value) if isinstance(value, tuple) else value for name, value in fields.items()}
    data.update(seconds=round(fields["seconds"], 3),
                throughput_mb_s=throughput_mb_s(fields["bytes_downloaded"], fields["seconds"]))
    return data


def summary(data: dict[str, Any]) -> str:
    """The text `trm sync` prints, from its result's ``to_dict()`` (both paths: the CLI and entry.py)."""
    state = "unchanged" if data["unchanged"] else (f"installed {', '.join(data['installed'])}" if data["installed"]
                                                   else "up to date")
    text = (f"synced {data['env'] or 'newest versions'} from {data['store']}: {state}; "
            f"{data['bytes_downloaded']} bytes downloaded, {data['bytes_reused']} reused from the cache, "
            f"{data['files']} files in {data['seconds']:.2f} s ({data['throughput_mb_s']} MB/s)")
    if data["pruned"] or data["kept_loaded"]:
        text += f"\npruned {data['pruned']}; kept (loaded) {data['kept_loaded']}"
    return text
