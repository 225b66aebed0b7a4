"""Batching candidates, the execution-time profile, and the pruning that keeps the search short.

A ``Candidate`` is the four settings the tuner chooses (max_batch_size, instance count, queue delay,
preferred batch sizes) plus whether dynamic batching is on; ``apply`` writes them into a copy of the
model's config, through the schema. The ``Profile`` is Triton's own execution time per batch size
(from its statistics, with dynamic batching off so each request runs as sent); from it follow, without
any load test, facts that prune most of the space:

* a batch of size ``b`` cannot be part of an SLO-meeting configuration when ``exec(b)`` plus the client
  overhead is already above the SLO (a request that lands in a full batch waits at least that long);
* near capacity a request waits for the batch in flight and then runs in the next one, so the largest
  batch that is useful under the SLO is the largest ``b`` with ``2 * exec(b) + overhead <= SLO``;
* an upper bound on capacity is ``instances * b / exec(b)``: a structure whose bound is below
  peak × headroom cannot carry the peak, and one whose bound is below a capacity already measured
  cannot win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repo_manager.core import config as cfg


@dataclass(frozen=True, order=True)
class Candidate:
    max_batch_size: int
    instances: int
    dynamic: bool = True
    delay_us: int = 0
    preferred: tuple[int, ...] = ()
    origin: str = field(default="search", compare=False)
    """Why it is a candidate: ``current``, ``plain`` (``dynamic_batching {}``), ``search``, ``grid``,
    ``overload`` (a queue policy tried under overload)."""
    queue_timeout_us: int = 0
    """The dynamic batcher's queue policy: a request queued longer than this is rejected (0: no timeout)."""
    max_queue_size: int = 0
    """Requests beyond this many queued are rejected at once (0: unbounded)."""
    priority_levels: int = 0
    """Priority levels (1 is the highest; requests without a priority get the lowest); 0: none."""

    @property
    def has_queue_policy(self) -> bool:
        return bool(self.queue_timeout_us or self.max_queue_size or self.priority_levels)

    @property
    def key(self) -> str:
        if not self.dynamic:
            return f"b{self.max_batch_size}-i{self.instances}-nodb"
        pref = "-p" + "_".join(map(str, self.preferred)) if self.preferred else ""
        policy = (f"-q{self.queue_timeout_us}" if self.queue_timeout_us else "") + \
                 (f"-m{self.max_queue_size}" if self.max_queue_size else "") + \
                 (f"-P{self.priority_levels}" if self.priority_levels else "")
        return f"b{self.max_batch_size}-i{self.instances}-d{self.delay_us}{pref}{policy}"

    @property
    def label(self) -> str:
        if not self.dynamic:
            return f"max_batch {self.max_batch_size}, {self.instances} instance(s), no dynamic batching"
        pref = f", preferred {list(self.preferred)}" if self.preferred else ""
        policy = (f", queue timeout {self.queue_timeout_us} us then reject" if self.queue_timeout_us else "") + \
                 (f", max queue {self.max_queue_size}" if self.max_queue_size else "") + \
                 (f", {self.priority_levels} priority levels" if self.priority_levels else "")
        return (f"max_batch {self.max_batch_size}, {self.instances} instance(s), "
                f"delay {self.delay_us} us{pref}{policy}")

    def with_delay(self, delay_us: int, origin: str = "search") -> Candidate:
        return Candidate(self.max_batch_size, self.instances, True, int(delay_us), self.preferred, origin)

    def with_queue_policy(self, timeout_us: int, max_queue_size: int = 0, priority_levels: int = 0,
                          origin: str = "overload") -> Candidate:
        return Candidate(self.max_batch_size, self.instances, True, self.delay_us, self.preferred, origin,
                         int(timeout_us), int(max_queue_size), int(priority_levels))

    def without_queue_policy(self) -> Candidate:
        return Candidate(self.max_batch_size, self.instances, self.dynamic, self.delay_us, self.preferred,
                         self.origin)

    @classmethod
    def from_config(cls, config: cfg.ModelConfig, origin: str = "current") -> Candidate:
        instances = config.instance_group[0].count if config.instance_group else 1
        if not config.HasField("dynamic_batching"):
            return cls(config.max_batch_size, max(instances, 1), False, origin=origin)
        db = config.dynamic_batching
        policy = db.default_queue_policy
        timeout = policy.default_timeout_microseconds if policy.timeout_action == policy.REJECT else 0
        return cls(config.max_batch_size, max(instances, 1), True, db.max_queue_delay_microseconds,
                   tuple(db.preferred_batch_size), origin, int(timeout), int(policy.max_queue_size),
                   int(db.priority_levels))

    def apply(self, base: cfg.ModelConfig) -> cfg.ModelConfig:
        """A copy of ``base`` with these settings (everything else, version policy included, kept)."""
        config = cfg.ModelConfig()
        config.CopyFrom(base)
        config.max_batch_size = self.max_batch_size
        if not config.instance_group:
            config.instance_group.add()
        for group in config.instance_group:
            group.count = self.instances
        config.ClearField("dynamic_batching")
        if self.dynamic:
            config.dynamic_batching.SetInParent()
            config.dynamic_batching.max_queue_delay_microseconds = self.delay_us
            config.dynamic_batching.preferred_batch_size.extend(self.preferred)
            if self.has_queue_policy:
                self._apply_queue_policy(config.dynamic_batching)
        for warmup in config.model_warmup:  # a warm-up batch larger than the new maximum would not load
            warmup.batch_size = min(warmup.batch_size, max(self.max_batch_size, 1))
        return config

    def _apply_queue_policy(self, db: Any) -> None:
        # REJECT on timeout, not DELAY: a delayed request still waits, which is the cascade to avoid.
        # Clients may ask for a shorter timeout of their own (allow_timeout_override).
        policies = [db.default_queue_policy]
        if self.priority_levels:
            db.priority_levels = self.priority_levels
            db.default_priority_level = self.priority_levels
            policies += [db.priority_queue_policy[level] for level in range(1, self.priority_levels + 1)]
        for policy in policies:
            policy.timeout_action = policy.REJECT
            policy.default_timeout_microseconds = self.queue_timeout_us
            policy.allow_timeout_override = True
            policy.max_queue_size = self.max_queue_size

    def to_dict(self) -> dict[str, Any]:
        data = {"key": self.key, "origin": self.origin, "max_batch_size": self.max_batch_size,
                "instances": self.instances, "dynamic_batching": self.dynamic,
                "max_queue_delay_microseconds": self.delay_us, "preferred_batch_size": list(self.preferred)}
        if self.has_queue_policy:
            data["queue_policy"] = {"timeout_action": "REJECT", "default_timeout_microseconds": self.queue_timeout_us,
                                    "allow_timeout_override": True, "max_queue_size": self.max_queue_size,
                                    "priority_levels": self.priority_levels}
        return data


@dataclass(frozen=True)
class Profile:
    """Triton's execution time (ms) per batch size, and the client's overhead on top (ms)."""

    exec_ms: dict[int, float]
    overhead_ms: float
    limit: int
    """The largest batch size that loaded and answered."""

    def exec_at(self, size: int) -> float:
        """Execution time at ``size``, linear between measured sizes (and beyond the last one)."""
        sizes = sorted(self.exec_ms)
        if size in self.exec_ms:
            return self.exec_ms[size]
        lower = max([s for s in sizes if s < size], default=sizes[0])
        upper = min([s for s in sizes if s > size], default=sizes[-1])
        if upper == lower:
            per_item = (self.exec_ms[sizes[-1]] - self.exec_ms[sizes[0]]) / max(sizes[-1] - sizes[0], 1)
            return self.exec_ms[lower] + per_item * (size - lower)
        share = (size - lower) / (upper - lower)
        return self.exec_ms[lower] + share * (self.exec_ms[upper] - self.exec_ms[lower])

    def per_request_ms(self, size: int) -> float:
        return self.exec_at(size) / size

    def capacity_bound(self, batch: int, instances: int) -> float:
        """Requests/s if every execution were a full batch on every instance: nothing does better."""
        return instances * batch * 1000.0 / self.exec_at(batch)

    def busy_delay_ms(self, max_batch: int, instances: int, rate_rps: float) -> float | None:
        """The queue delay after which, at ``rate_rps``, a batch is ready just as an instance frees (None where
        batching cannot keep up or there is nothing to batch).

        A busy batcher forms the next batch while the instances execute. A batch that waited ``D`` ms holds the
        request that opened it and the ``r * D`` that arrived meanwhile (``r`` requests per ms), and executes in
        ``exec(n) = a + b * n``; with ``instances`` busy, one frees every ``exec(n) / instances``. Setting the two
        equal, ``D * instances = a + b + b * r * D``, so ``D = exec(1) / (instances - b * r)``, with ``b`` the cost
        per item between a batch of one and ``max_batch``. A shorter delay sends batches that an instance is not
        yet free for; a longer one keeps a free instance waiting. On the tuning check's model (6 ms + 0.75 ms per
        item, two instances) it gives 4.1 ms at 480/s and 4.7 ms at 750/s: side by side (``bench/bench_configs.py``)
        delays of 3.5-4.7 ms carried at least as much as no delay in every round, with 1-5 ms less p99 at peak x
        headroom, where 3.1 and 6.3 ms did not."""
        if max_batch <= 1:
            return None
        one = self.exec_at(1)
        per_item = (self.exec_at(max_batch) - one) / (max_batch - 1)
        busy = instances - per_item * rate_rps / 1000.0
        return one / busy if busy > 0 else None

    def useful_batch(self, max_batch: int, slo_ms: float) -> int:
        """The largest batch a request can wait behind and still run in, within the SLO (>= 1)."""
        fits = [b for b in range(1, max_batch + 1) if 2 * self.exec_at(b) + self.overhead_ms <= slo_ms]
        return max(fits, default=1)

    def slo_capacity(self, max_batch: int, instances: int, slo_ms: float) -> float:
        """Predicted capacity under the SLO (used only to order candidates; measurements decide)."""
        return self.capacity_bound(self.useful_batch(max_batch, slo_ms), instances)

    def to_dict(self) -> dict[str, Any]:
        return {"exec_ms_by_batch": {str(k): v for k, v in sorted(self.exec_ms.items())},
                "per_request_ms": {str(k): round(v / k, 3) for k, v in sorted(self.exec_ms.items())},
                "overhead_ms": self.overhead_ms, "largest_batch": self.limit}


@dataclass(frozen=True)
class Pruned:
    candidate: Candidate
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.candidate.to_dict(), "reason": self.reason}


def preferred_sizes(profile: Profile, max_batch: int, drop: float = 0.1) -> list[int]:
    """Profiled sizes up to ``max_batch`` where the cost per request still drops by more than ``drop``."""
    sizes = sorted(s for s in profile.exec_ms if s <= max_batch)
    return [b for prev, b in zip(sizes, sizes[1:])
            if profile.per_request_ms(b) < (1 - drop) * profile.per_request_ms(prev)]


def structures(profile: Profile, current: Candidate, slo_ms: float, need_rps: float,
               instance_options: tuple[int, ...] = (1, 2), keep: int = 3) -> tuple[list[Candidate], list[Pruned]]:
    """(max_batch, instances) structures worth measuring, in measuring order, and what was pruned.

    Max batch sizes: the profiled sizes where the cost per request drops, and the current one. First
    comes the simplest structure (fewest instances, then smallest batch) whose predicted capacity under
    the SLO covers ``need_rps`` with 50 % to spare: the prediction ignores contention (instances sharing
    CPU cores, a GPU), so the plainest sufficient structure is the safest first measurement. Then the
    rest by predicted capacity, the highest first: the measured capacity decides between them.
    """
    sizes = sorted(set(preferred_sizes(profile, profile.limit)) | {1} |
                   ({current.max_batch_size} if 0 < current.max_batch_size <= profile.limit else set()))
    kept: list[tuple[float, Candidate]] = []
    pruned: list[Pruned] = []
    for batch in sizes:
        for instances in sorted(set(instance_options) | {current.instances}):
            candidate = Candidate(batch, instances)
            bound = profile.capacity_bound(batch, instances)
            if profile.exec_at(1) + profile.overhead_ms > slo_ms:
                pruned.append(Pruned(candidate, f"a single request takes {profile.exec_at(1):.1f} ms to execute "
                                                f"+ {profile.overhead_ms:.1f} ms overhead, above the SLO"))
            elif bound < need_rps:
                pruned.append(Pruned(candidate, f"capacity bound {bound:.0f}/s (full batches on every "
                                                f"instance) is below peak x headroom {need_rps:.0f}/s"))
            elif batch > 1 and profile.exec_at(batch) + profile.overhead_ms > slo_ms:
                pruned.append(Pruned(candidate, f"a full batch of {batch} executes in "
                                                f"{profile.exec_at(batch):.1f} ms, above the SLO"))
            else:
                kept.append((profile.slo_capacity(batch, instances, slo_ms), candidate))
    kept.sort(key=lambda item: (-round(item[0], -1), item[1].instances, item[1].max_batch_size))
    sufficient = sorted((c for predicted, c in kept if predicted >= 1.5 * need_rps),
                        key=lambda c: (c.instances, c.max_batch_size))
    if sufficient:
        first = next(item for item in kept if item[1] == sufficient[0])
        kept = [first] + [item for item in kept if item is not first]
    for _, candidate in kept[keep:]:
        pruned.append(Pruned(candidate, "lower predicted capacity under the SLO than the structures kept"))
    return [c for _, c in kept[:keep]], pruned
