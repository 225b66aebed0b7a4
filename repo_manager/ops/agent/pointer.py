"""The environment pointer as the agent sees it: one conditional read per check (``Store.get_env_if_changed``:
on S3 a GET with If-None-Match, a 304 while nothing changed), the last pointer read, its age and the
read counts /status and /metrics report."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from repo_manager.adapters import metrics
from repo_manager.adapters.storage import EnvPointer, Store
from repo_manager.core.errors import TrmError


class PointerWatch:
    def __init__(self, store: Store, env: str, log: Callable[..., None]) -> None:
        self.store, self.env, self.log = store, env, log
        self._lock = threading.Lock()
        self.pointer: EnvPointer | None = None
        self.read_at: float | None = None
        self.error: str | None = None
        self.reads: Counter[str] = Counter()

    @property
    def etag(self) -> str | None:
        return self.pointer.etag if self.pointer else None

    def poll(self) -> None:
        """Read the pointer if it changed; a failed read keeps the last one (and is counted)."""
        try:
            with metrics.operation("pointer_read") as op:
                pointer = self.store.get_env_if_changed(self.env, self.etag)
                op.outcome = "unchanged" if pointer is None else "changed"
        except TrmError as exc:
            with self._lock:
                self.reads["errors"] += 1
                self.error = exc.message.splitlines()[0]
            if self.pointer is not None:
                self.log("pointer read failed; serving what was converged", error=self.error)
            return
        with self._lock:
            self.read_at, self.error = time.monotonic(), None
            if pointer is None:
                self.reads["unchanged"] += 1
                return
            self.reads["changed"] += 1
            moved = self.pointer is not None
            self.pointer = pointer
        if moved:
            self.log("pointer moved", models=pointer.models, etag=pointer.etag)

    def status(self) -> dict[str, Any]:
        with self._lock:
            pointer, age = self.pointer, None if self.read_at is None else round(time.monotonic() - self.read_at, 3)
            return {"etag": pointer.etag if pointer else None, "updated_at": pointer.updated_at if pointer else None,
                    "age_s": age, "changed": self.reads["changed"], "unchanged": self.reads["unchanged"],
                    "errors": self.reads["errors"], "last_error": self.error}
