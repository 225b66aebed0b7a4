"""At most K pods of an environment out of rotation at once, coordinated through the store.

A pod that must take itself out of rotation (the drain-swap path: models too large to load twice) first
takes a slot in the environment's lease object, ``leases/<env>.json`` in the same store as its pointer::

    {"schema": "trm.lease/1", "env": "production",
     "holders": {"pod-a-3f2a9c1b": {"pod": "pod-a", "expires": 1767000060.0, "ttl_s": 60.0,
                                    "since": "2026-11-30T15:00:00Z"}}}

Holders are keyed by the agent's identity (its pod name and a random id kept in its repository, so two
agents that share a host name still hold two slots). Every change is a compare-and-swap on the object's
tag (S3 ``If-Match`` / ``If-None-Match: *``; the folder store's revision series), so two pods never both
take the last slot. The holder renews its slot from a heartbeat thread the whole time it is out of
rotation (``DrainLease.held``), every third of the TTL: a load longer than the TTL keeps its slot.

A holder counts while its entry is *live*:

* well formed: a finite ``expires`` at most ``MAX_TTL_S + MAX_SKEW_S`` ahead of this pod's clock (an
  ``Infinity``, a ``NaN`` or a date years ahead is ignored: it would block every drain forever);
* not expired, allowing ``MAX_SKEW_S`` of clock skew (a pod whose clock is behind writes an ``expires``
  that already looks past to the others);
* not seen unchanged for longer than its TTL (capped at ``MAX_TTL_S``) on *this* pod's monotonic clock:
  a live holder renews, so an entry that stops changing belongs to a dead pod, whatever its clock said.

Entries that are not live are dropped by the next writer: a pod killed while holding a slot frees it
after one TTL of nobody seeing it renewed. Why the store rather than a Kubernetes Lease: the agent needs
nothing but the store it already reads (no API-server credentials or RBAC for the sidecar), it works the
same outside Kubernetes (the fleet test on one machine), and the store's conditional writes are the
primitive trm's pointers already rely on.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from repo_manager.adapters.storage import Store
from repo_manager.core.errors import ConflictError, StoreError, TrmError
from repo_manager.core.manifest import now_iso

LEASE_SCHEMA = "trm.lease/1"
MIN_TTL_S, MAX_TTL_S, DEFAULT_TTL_S = 2.0, 600.0, 60.0
"""Bounds of a slot's time to live (``trm agent --lease-ttl``); the heartbeat renews every third of it."""
MAX_SKEW_S = 120.0
"""Clock difference between pods tolerated when judging another pod's ``expires``."""
MAX_HOLDERS = 1000
"""Entries read from one lease object (more is hostile content: the rest count as no holder)."""


@dataclass(frozen=True)
class Holder:
    key: str
    pod: str
    expires: float
    ttl_s: float
    since: str

    def to_dict(self) -> dict[str, object]:
        return {"pod": self.pod, "expires": self.expires, "ttl_s": self.ttl_s, "since": self.since}


def parse_holders(payload: bytes | None, now: float) -> dict[str, Holder]:
    """Well-formed holders in a lease object (see the module docstring); anything else counts as no
    holder (the next compare-and-swap replaces it). Never raises."""
    if not payload:
        return {}
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    holders = data.get("holders") if isinstance(data, dict) else None
    if not isinstance(holders, dict):
        return {}
    found: dict[str, Holder] = {}
    for key, entry in list(holders.items())[:MAX_HOLDERS]:
        if not isinstance(entry, dict) or len(key) > 300:
            continue
        expires, ttl = entry.get("expires"), entry.get("ttl_s", MAX_TTL_S)
        if not _finite(expires) or not _finite(ttl) or float(expires) > now + MAX_TTL_S + MAX_SKEW_S:
            continue
        pod, since = entry.get("pod", key), entry.get("since", "")
        found[key] = Holder(key, pod if isinstance(pod, str) else key, float(expires),
                            min(max(float(ttl), 0.0), MAX_TTL_S), since if isinstance(since, str) else "")
    return found


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class DrainLease:
    """One agent's view of its environment's drain lease. Keep one per agent: it remembers since when it
    has seen each holder's entry unchanged (on its own monotonic clock)."""

    def __init__(self, store: Store, env: str, key: str, slots: int, ttl_s: float = DEFAULT_TTL_S, *,
                 pod: str | None = None) -> None:
        self.store, self.env, self.key, self.slots = store, env, key, max(1, slots)
        self.pod = pod or key
        self.ttl_s = min(max(ttl_s, 0.0), MAX_TTL_S)
        self._seen: dict[str, tuple[float, float]] = {}
        """holder key -> (its expires when first seen so, monotonic time first seen so)."""
        self._seen_lock = threading.Lock()  # the heartbeat thread reads too
        self._since: str | None = None

    # ------------------------------------------------------------------------------------ reading
    def _live(self, payload: bytes | None) -> dict[str, Holder]:
        now, mono = time.time(), time.monotonic()
        holders = parse_holders(payload, now)
        with self._seen_lock:
            return self._observe(holders, now, mono)

    def _observe(self, holders: dict[str, Holder], now: float, mono: float) -> dict[str, Holder]:
        live = {}
        for key, holder in holders.items():
            seen = self._seen.get(key)
            if seen is None or seen[0] != holder.expires:
                seen = self._seen[key] = (holder.expires, mono)
            if holder.expires + MAX_SKEW_S >= now and mono - seen[1] <= holder.ttl_s:
                live[key] = holder
        for key in set(self._seen) - set(holders):
            del self._seen[key]
        return live

    def _read(self) -> tuple[dict[str, Holder], str | None]:
        current = self.store.get_lease(self.env)
        return self._live(current[0] if current else None), (current[1] if current else None)

    def holders(self) -> list[str]:
        """Pods holding a slot now (their names, sorted)."""
        return sorted(h.pod for h in self._read()[0].values())

    # ------------------------------------------------------------------------------------ writing
    def _write(self, change: Callable[[dict[str, Holder]], bool]) -> bool:
        """Read, apply ``change`` to the live holders, CAS-write; retried on lost races. ``change``
        returns False to leave the object as it is (e.g. no free slot)."""
        for _ in range(20):
            holders, tag = self._read()
            if not change(holders):
                return False
            payload = json.dumps({"schema": LEASE_SCHEMA, "env": self.env,
                                  "holders": {k: h.to_dict() for k, h in holders.items()}},
                                 sort_keys=True, allow_nan=False).encode()
            try:
                self.store.put_lease(self.env, payload, tag)
                return True
            except ConflictError:
                time.sleep(random.uniform(0.01, 0.1))
        return False

    def try_acquire(self) -> bool:
        """Take (or renew) this agent's slot; False when every slot is held by others."""
        def take(holders: dict[str, Holder]) -> bool:
            if self.key not in holders and len(holders) >= self.slots:
                return False
            since = holders[self.key].since if self.key in holders else (self._since or now_iso())
            holders[self.key] = Holder(self.key, self.pod, time.time() + self.ttl_s, self.ttl_s, since)
            return True
        taken = self._write(take)
        if taken and self._since is None:
            self._since = now_iso()
        return taken

    def acquire(self, stop: threading.Event, on_wait: Callable[[list[str]], None] | None = None,
                poll_s: float = 0.5) -> bool:
        """Wait for a slot; False when ``stop`` was set first."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
                if on_wait is not None:
                    on_wait(self.holders())
            except StoreError:
                pass  # store unreachable: nobody can take a slot; keep serving and retry
            stop.wait(poll_s * random.uniform(1.0, 2.0))
        return False

    def renew(self) -> bool:
        return self.try_acquire()

    def release(self) -> None:
        self._since = None

        def drop(holders: dict[str, Holder]) -> bool:
            if self.key not in holders:
                return False
            del holders[self.key]
            return True
        try:
            self._write(drop)
        except StoreError:
            pass  # the slot expires after the TTL

    @contextmanager
    def held(self, on_lost: Callable[[str], None] | None = None) -> Iterator[None]:
        """Renew the slot (already acquired) every third of the TTL until the body ends, then free it.
        ``on_lost`` hears of a renewal that failed (the store unreachable, or the slot taken)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.ttl_s / 3):
                try:
                    renewed = self.renew()
                    problem = None if renewed else "every slot is held by other pods"
                except TrmError as exc:
                    problem = exc.message.splitlines()[0]
                if problem and on_lost is not None:
                    on_lost(problem)

        thread = threading.Thread(target=beat, name="trm-agent-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.release()
