"""What a sync reports while it runs and when it is done (light: the no-op path imports only this; the
quick path, before dataclasses, only ``result_data``, whose fields and dict form these are)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repo_manager.ops.sync import result_data


class SyncProgress:
    """What a sync reports while it runs; the CLI draws it (rich bars on stderr). No-op by default."""

    def start(self, total_bytes: int, total_files: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def file_done(self) -> None:
        pass

    def message(self, text: str) -> None:
        pass


@dataclass(frozen=True)
class SyncResult:
    store: str
    env: str | None
    repository: str
    models: dict[str, int]
    installed: tuple[str, ...]
    configs_replaced: tuple[str, ...]
    pruned: tuple[str, ...]
    kept_loaded: tuple[str, ...]
    bytes_downloaded: int
    bytes_resumed: int
    bytes_reused: int
    files: int
    blobs_downloaded: int
    remote_reads: int
    gc_removed: int
    gc_freed_bytes: int
    seconds: float
    unchanged: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput_mb_s(self) -> float:
        return result_data.throughput_mb_s(self.bytes_downloaded, self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return result_data.as_dict({k: v for k, v in self.__dict__.items() if k != "extra"})
