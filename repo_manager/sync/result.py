"""What a sync reports while it runs and when it is done (light: the no-op path imports only this)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        return round(self.bytes_downloaded / 1e6 / self.seconds, 1) if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "extra"}
        data.update(seconds=round(self.seconds, 3), throughput_mb_s=self.throughput_mb_s,
                    installed=list(self.installed), configs_replaced=list(self.configs_replaced),
                    pruned=list(self.pruned), kept_loaded=list(self.kept_loaded))
        return data
