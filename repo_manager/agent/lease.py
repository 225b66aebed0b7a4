"""At most K pods of an environment out of rotation at once, coordinated through the store.

A pod that must take itself out of rotation (the drain-swap path: models too large to load twice) first
takes a slot in the environment's lease object, ``leases/<env>.json`` in the same store as its pointer::

    {"schema": "trm.lease/1", "env": "production",
     "holders": {"pod-a": {"expires": 1767000000.0, "since": "2026-11-30T15:00:00Z"}}}

Every change is a compare-and-swap on the object's tag (S3 ``If-Match`` / ``If-None-Match: *``; the folder
store's revision series), so two pods never both take the last slot. Holders whose ``expires`` is past
are ignored and dropped by the next writer: a pod killed while holding a slot frees it after the TTL.
The holder renews its slot while it drains. Why the store rather than a Kubernetes Lease: the agent
needs nothing but the store it already reads (no API-server credentials or RBAC for the sidecar), it
works the same outside Kubernetes (the fleet test on one machine), and the store's conditional writes
are the primitive trm's pointers already rely on. The cost: expiry uses the pods' clocks (keep them in
NTP sync; the TTL is minutes, skew is milliseconds).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable

from repo_manager.errors import ConflictError, StoreError
from repo_manager.manifest import now_iso
from repo_manager.storage import Store

LEASE_SCHEMA = "trm.lease/1"


def parse_holders(payload: bytes | None) -> dict[str, dict[str, object]]:
    """Holders in a lease object; anything malformed counts as no holder (the next CAS replaces it)."""
    if not payload:
        return {}
    try:
        data = json.loads(payload)
        holders = data.get("holders") if isinstance(data, dict) else None
        return {str(k): v for k, v in holders.items() if isinstance(v, dict)
                and isinstance(v.get("expires"), (int, float))} if isinstance(holders, dict) else {}
    except (ValueError, UnicodeDecodeError, AttributeError):
        return {}


class DrainLease:
    def __init__(self, store: Store, env: str, pod: str, slots: int, ttl_s: float = 120.0) -> None:
        self.store, self.env, self.pod, self.slots, self.ttl_s = store, env, pod, max(1, slots), ttl_s

    def _write(self, change: Callable[[dict[str, dict[str, object]]], bool]) -> bool:
        """Read, apply ``change`` to the live holders, CAS-write; retried on lost races. ``change``
        returns False to leave the object as it is (e.g. no free slot)."""
        for _ in range(20):
            current = self.store.get_lease(self.env)
            tag = current[1] if current else None
            now = time.time()
            holders = {k: v for k, v in parse_holders(current[0] if current else None).items()
                       if float(v["expires"]) > now}  # type: ignore[arg-type]
            if not change(holders):
                return False
            payload = json.dumps({"schema": LEASE_SCHEMA, "env": self.env, "holders": holders},
                                 sort_keys=True).encode()
            try:
                self.store.put_lease(self.env, payload, tag)
                return True
            except ConflictError:
                time.sleep(random.uniform(0.01, 0.1))
        return False

    def try_acquire(self) -> bool:
        def take(holders: dict[str, dict[str, object]]) -> bool:
            if self.pod not in holders and len(holders) >= self.slots:
                return False
            since = holders.get(self.pod, {}).get("since") or now_iso()
            holders[self.pod] = {"expires": time.time() + self.ttl_s, "since": since}
            return True
        return self._write(take)

    def acquire(self, stop: threading.Event, on_wait: Callable[[list[str]], None] | None = None,
                poll_s: float = 0.5) -> bool:
        """Wait for a slot; False when ``stop`` was set first."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
            except StoreError:
                pass  # store unreachable: nobody can take a slot; keep serving and retry
            if on_wait is not None:
                current = self.store.get_lease(self.env)
                on_wait(sorted(parse_holders(current[0] if current else None)))
            stop.wait(poll_s * random.uniform(1.0, 2.0))
        return False

    def renew(self) -> None:
        self.try_acquire()

    def release(self) -> None:
        def drop(holders: dict[str, dict[str, object]]) -> bool:
            if self.pod not in holders:
                return False
            del holders[self.pod]
            return True
        try:
            self._write(drop)
        except StoreError:
            pass  # the slot expires after the TTL

    def holders(self) -> list[str]:
        current = self.store.get_lease(self.env)
        now = time.time()
        return sorted(k for k, v in parse_holders(current[0] if current else None).items()
                      if float(v["expires"]) > now)  # type: ignore[arg-type]
