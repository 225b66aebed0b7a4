"""The queue policy: under a spike past capacity, shed the excess fast instead of queueing it.

Without a queue policy Triton's dynamic batcher queues without bound: past capacity every request
waits behind all the others, and p99 grows for as long as the spike lasts and long after. The tuner
therefore also chooses ``default_queue_policy { timeout_action: REJECT, default_timeout_microseconds: T,
allow_timeout_override: true }`` by measurement, once the batching settings are chosen:

* **the timeout T** lies between one full batch's execution (Triton checks a queue timeout only when the
  batcher looks at the queue, after the batch in flight: server issue #7512, so a shorter timeout rejects
  requests at normal traffic) and what the SLO leaves once a full batch has run (an accepted request
  waited at most T, then ran in one batch). It starts at ``0.7 * SLO - exec(max_batch) - overhead``
  (within that range) and is bisected: longer when normal traffic is shed, shorter when the accepted p99
  under overload misses (a near miss is measured once more first); a timeout that the mechanism already puts
  past the SLO (an accepted request waits about the timeout, then runs in a full batch:
  ``PolicySearch.miss_expected``) is not driven into the overload, and counts as a miss; a timeout below the
  range (tried when its floor missed) is measured at normal traffic first and not driven into overload when it
  sheds there, and one at or under the queue delay is not measured: it sheds (``PolicySearch.sheds_expected``);
* **max_queue_size as the second bound**: when accepted requests miss the SLO under a timeout, the same
  timeout with a queue of one full batch per instance is tried before a shorter timeout or a simpler
  structure (an accepted request then waits for at most the batch in flight and its own), so the batching
  chosen for capacity keeps it where the bound holds; not where two full batches do not fit in
  ``MAX_TIMEOUT_SHARE`` of the SLO (``PolicySearch._bound_can_hold``: a structure with a timeout range always
  fits them, so this spares a run only where the chosen batching leaves no range and is tried all the same);
* the structures it is tried on: the chosen batching, then without its delay, then a smaller max batch
  (when the chosen one leaves no timeout range), then one instance: simpler structures that a measured
  stand-in showed to hold (a 10 ms timeout on a 3 ms + 3 ms/item model held 39 ms at 2-3 x capacity
  where the chosen two-instance batching with a delay missed at 91 ms); a simpler one only where it keeps
  ``SIMPLER_CAPACITY`` of the choice's capacity (measured by the batching search, where it may also have
  missed the SLO at a busy level the choice met, or bounded by the profile): a policy is not bought with
  capacity at normal traffic; except where the choice leaves no timeout range and the simpler structure's
  own ladder met the choice's capacity, which only the finalists' re-measure took a step off (the two are
  within this machine's noise, and only the simpler one can cover the batch in flight); a choice that
  leaves no range is measured after the structures that have one, so that the fallback still has its tries;
* the capacity is the SLO ladder's; when the ladder stopped early (the time budget), it is what the
  batching sustains closed loop (enough clients to fill every batch), measured once (an overload relative
  to a lower bound would be no overload, and a policy "holding" there would prove nothing);
* each try is one run of open-loop Poisson traffic: a second at the tuning's peak rate (warm-up, not
  counted), ``overload_factor`` x the measured capacity for half a second (its onset, not counted) and a few
  seconds more, then the peak rate again
  (the load drops): accepted p99, rejected fraction,
  rejection latency, goodput (answers within the SLO per second) and time to recover (from the drop
  until every later request is answered within the SLO);
* a policy passes when the overload run was driven as offered, had no errors besides rejections, its
  accepted p99 met the SLO, its goodput kept at least ``MIN_GOODPUT`` of capacity, the server recovered,
  and at peak x headroom the policy sheds at most ``MAX_NORMAL_REJECT`` (a Poisson burst) with the p99 of every
  request, a rejection counted as a miss, in the SLO;
* **max_queue_size on top**, asked with ``--fast-rejection`` (``fast_rejection``), is tried on top of the passing
  timeout and kept if it also passes with at least ``MAX_QUEUE_GOODPUT`` of the timeout-only goodput: it rejects at
  once instead of after T, but on Triton 2.51 a request refused for a full queue did not wake the batcher, and on a
  loaded machine accepted throughput collapsed to a fraction of capacity (measured: 66/s of 250/s; on a quiet one
  254/s vs 270/s). Not by default: one passing try does not show the stall's absence (bench_overload's default
  model, four runs: the two that kept ``max_queue_size`` 32 on one passing try each stalled once at 2 x in the
  independent run, goodput 88 and 89 % of capacity; the two with the timeout alone 100 and 101 %);
* the chosen policy is measured once more at ``HIGHER_FACTOR`` x the asked overload (3 x capacity for 2 x);
  when it misses there, the same timeout without ``max_queue_size`` (when that was added on top), the same
  timeout with the second bound (when it has none) and one shorter timeout on the same structure are tried,
  and replace the choice if they hold at the asked overload and do better at the larger one (held there
  within ``HIGHER_MARGIN`` of the SLO, or closer to it; a run that held with less margin tries them too); the
  result reports both (a remaining miss there is reported, the choice for the asked overload stands);
* when no policy held, the closest one tried that keeps normal traffic at peak x headroom, with a timeout
  at or above the range's floor (``MIN_TIMEOUT_BATCHES`` full batches and the queue delay: a shorter one sheds
  near capacity), is written all the same (``OverloadOutcome.fallback``): it sheds what waited past its
  timeout, where no policy queues a spike without bound;
* ``priority_levels`` (asked with ``--priority-levels``) gives every level the same policy; requests
  without a priority get the lowest level, so callers can mark the ones to keep.

The outcome (``OverloadOutcome.outcome``) is ``policy-held``, ``no-policy-held`` (the runs were driven, or ruled out
by the mechanism, and none kept the SLO: every policy tried is listed) or ``not-measurable`` (no overload run could
be driven as offered from this client: nothing is known of any policy). Without a held policy the batching choice is
still the result, recorded with that outcome; ``--require-overload-policy`` makes it a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from repo_manager.adapters.loadgen import LoadSpec, Phase, PhaseStats, Trace, run_schedule
from repo_manager.ops.tuning.candidates import Candidate, Profile
from repo_manager.ops.tuning.prober import (
    LOAD_S,
    MAX_NORMAL_REJECT,
    Prober,
    near_miss,
    rejected_share,
    within_slo,
)

FIRST_TIMEOUT_SHARE = 0.7
"""The first queue timeout tried is this share of the SLO, less a full batch's execution and the overhead
(at 0.8 a 150 ms SLO's accepted p99 under 2x overload was 132 ms on a quiet machine and missed on a busy
one; at 0.6, 110 ms), but never below ``MIN_TIMEOUT_BATCHES`` full batches (see there). A larger spike is
met by a shorter one only where it is measured to do better (``PolicySearch._hold_the_larger_spike``)."""
MIN_TIMEOUT_BATCHES = 1.2
"""The shortest timeout tried, in full batches' execution times (plus the queue delay). Triton checks a
request's queue timeout only when the batcher looks at the queue, which is when an instance is free (server
issue #7512): a request may wait for the batch in flight, so a timeout shorter than one batch rejects requests
that would have been answered in time (measured: 0.7 x a 40 ms SLO less a full batch of 8 at 10 ms + 2
ms/item left 2 ms and rejected 12.5 % at peak x headroom). Near capacity the batch in flight is a full one:
on 3 ms + 3 ms/item, max batch 4 (15 ms), two instances, under 50 ms, the capacity within the SLO (a
rejection counted as a miss, 10 % steps) was 425/s without a policy, 387/s with an 18 ms timeout and 319/s
with 11 or 14 ms, although the shorter ones had shed at most 1 % at peak x headroom (180/s)."""
MAX_TIMEOUT_SHARE = 0.9
"""The longest timeout tried: an accepted request waited at most T (checked when the batcher took it) and
then ran in one batch, so ``T + exec(max_batch) + overhead`` must stay within this share of the SLO."""
TRIES_PER_STRUCTURE = 3
MIN_GOODPUT = 0.9
"""A policy must keep at least this share of the measured capacity as goodput under overload: a policy on a
structure that carries less than the batching chosen for capacity gives that capacity away exactly when it
is needed."""
NEAR_MISS_GOODPUT = 0.7
"""A try whose accepted p99 missed by at most 25 % and whose goodput kept this share is measured once more."""
MIN_SHED = 0.1
"""An overload run must reject at least this share for ``max_queue_size`` to be judged on it."""
MAX_QUEUE_GOODPUT = 0.9
"""``max_queue_size`` is kept when its overload goodput is at least this share of the timeout-only policy's."""
HIGHER_FACTOR = 1.5
"""The chosen policy is measured once more at this multiple of the asked overload (3 x capacity for 2 x): a
spike is never the size it was tuned for; the result says how the policy does at both."""
HIGHER_MARGIN = 0.8
"""At the larger spike the chosen policy counts as holding with its accepted p99 within this share of the SLO (as
the batching keeps its p99 at peak x headroom within 80 % of it): on 3 ms + 3 ms/item under 50 ms the range's
floor measured 40.3 ms at 3 x in the tuner's run and 54.7 ms in the bench's independent run right after."""
SIMPLER_CAPACITY = 0.95
"""A simpler structure is tried for a queue policy only where the batching search did not measure it to carry
less than this share of the chosen batching's capacity within the SLO: a policy there would give that capacity
away at normal traffic to protect an overload (the tuning check's model, 6 ms + 0.75 ms per item under 25 ms:
max batch 4 carried 480/s where the chosen max batch 8 carried 750/s, and a policy on it held at 2 x)."""
SPIKE_ONSET_S = 0.5
"""Seconds of the spike left out of its figures (``PolicySearch._trace``)."""
OVERLOAD_PHASE, RECOVERY_PHASE = 2, 3
"""The phases of an overload try's trace that are judged: warm-up (0), spike onset (1), overload, recovery."""

HELD, NO_POLICY_HELD, NOT_MEASURABLE = "policy-held", "no-policy-held", "not-measurable"
"""The overload step's outcomes (``OverloadOutcome.outcome``): a policy was shown to keep the SLO; policies were
measured under the overload, or ruled out by the mechanism (``PolicySearch.miss_expected``), and none kept it; no
overload run could be driven as offered here (the client could not send ``factor`` x capacity), which says nothing
of any policy."""


@dataclass(frozen=True)
class OverloadPoint:
    candidate: Candidate
    rate: float
    overload: PhaseStats
    recovery: PhaseStats
    recover_s: float | None
    """Seconds from the load drop until every later request was answered within the SLO (None: not
    within the recovery phase)."""
    meets: bool
    note: str = ""
    trace: Trace | None = field(default=None, repr=False, compare=False)
    sheds_normal_traffic: bool = False
    """The policy rejected more than a burst's worth at peak x headroom: a shorter timeout would only shed more."""
    capacity_rps: float = 0.0
    """The capacity the overload was relative to (``rate`` = factor x this)."""
    misses_under_overload: bool = False
    """Driven as offered, and the accepted p99 under overload missed the SLO: a shorter timeout may help."""
    drive_problem: str = ""
    """Why the overload was not driven as offered ("" when it was)."""
    predicted_miss: bool = False
    """Not driven: the mechanism puts an accepted request past the SLO (``PolicySearch.miss_expected``)."""
    predicted_shed: bool = False
    """Not measured: the mechanism rejects normal traffic under this timeout (``PolicySearch.sheds_expected``)."""

    @property
    def client_limited(self) -> bool:
        """The client could not send the rate at all (not only late): no other policy would change that."""
        o = self.overload
        return bool(o.unsent) or (o.requests > 0 and o.send_rps < 0.9 * self.rate)

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.key,
            "label": self.candidate.label,
            "queue_policy": self.candidate.to_dict().get("queue_policy"),
            "offered_rps": self.rate,
            "capacity_rps": self.capacity_rps,
            "meets": self.meets,
            "note": self.note,
            "predicted_miss": self.predicted_miss,
            "predicted_shed": self.predicted_shed,
            "recover_s": self.recover_s,
            "overload": self.overload.to_dict(),
            "recovery": self.recovery.to_dict(),
        }


@dataclass(frozen=True)
class OverloadOutcome:
    factor: float
    capacity_rps: float
    rate: float
    recover_rps: float
    points: tuple[OverloadPoint, ...]
    chosen: Candidate | None
    closest: Candidate | None
    notes: tuple[str, ...] = ()
    cut_short: bool = False
    """The time budget ended the search before a policy was shown to keep the SLO (or before max_queue_size)."""
    higher: OverloadPoint | None = None
    """The chosen policy at ``HIGHER_FACTOR`` x the asked overload (None: not measured, no policy or budget)."""
    fallback: Candidate | None = None
    """No policy held: the closest one tried, shown to keep normal traffic at peak x headroom (written all the
    same: under a spike it sheds what waited past its timeout, where no policy queues without bound)."""
    slo_ms: float = float("inf")
    """The SLO the tries were judged against (the larger spike's margin is a share of it)."""
    capacity_shed: tuple[float, float] | None = None
    """The written policy at normal traffic near capacity: (its structure's capacity on the batching search's
    ladder, about the share of requests its timeout sheds there: ``shed_estimate``); None without a written policy
    or a ladder above peak x headroom."""
    carried_rps: float | None = None
    """The highest ladder rate at or below that capacity (or ``choice_capacity_rps``) the written config kept within
    the SLO with its policy, a rejection counted as a miss (measured where ``capacity_shed`` or
    ``choice_capacity_rps`` is set; None: not measured, the time budget)."""
    choice_capacity_rps: float | None = None
    """Where the written policy is on a simpler structure than the batching choice that the batching search did not
    climb: the choice's capacity on its ladder, up to which the written config was measured (``carried_rps``)."""

    @property
    def outcome(self) -> str:
        if self.chosen is not None:
            return HELD
        return NOT_MEASURABLE if not_drivable(self.points) else NO_POLICY_HELD

    @property
    def chosen_point(self) -> OverloadPoint | None:
        return next((p for p in tries_at(self.points, self.chosen, self.rate) if p.meets), None)

    def tried(self) -> str:
        """Every policy tried and how it did, for a person (``; `` between tries)."""
        return "; ".join(f"{p.candidate.label} at {p.rate:.0f}/s: " + ("kept the SLO" if p.meets else p.note)
                         for p in self.points)

    def summary(self) -> str:
        """One sentence: what the overload step found."""
        asked = f"{self.factor:g} x capacity {self.capacity_rps:.0f}/s = {self.rate:.0f}/s"
        if self.outcome == HELD:
            held = f"queue policy {self.chosen.label if self.chosen else ''} kept the SLO at {asked}"
            return held + self._at_the_larger_spike() + self.capacity_cost()
        if self.outcome == NOT_MEASURABLE:
            why = "; ".join(dict.fromkeys(p.drive_problem for p in self.points if p.drive_problem))
            return (f"the overload of {asked} could not be driven from this client ({why}): not measurable on "
                    "this machine (the batching choice does not depend on it)")
        why = ""
        if any(p.predicted_miss for p in self.points) and not any(p.overload.requests or p.overload.unsent
                                                                  for p in self.points):
            why = (f"; none was driven into it: the mechanism put every timeout tried past {MAX_TIMEOUT_SHARE:.0%} of "
                   "the SLO (an accepted request waits about its timeout, then runs in a full batch)"
                   + (", or it shed normal traffic" if any(p.sheds_normal_traffic for p in self.points) else ""))
        return f"no queue policy kept the SLO for accepted requests at {asked}" + why + \
            ("; the time budget ended the search" if self.cut_short else "")

    def _at_the_larger_spike(self) -> str:
        """How the held policy did at ``HIGHER_FACTOR`` x the asked overload, as a clause ("" where not measured)."""
        if self.higher is None:
            return ""
        o = self.higher.overload
        at = f"{self.higher.rate:.0f}/s ({self.higher.rate / self.capacity_rps:.2g} x capacity)"
        if self.higher.drive_problem:
            return f"; at {at} not measurable from this client ({self.higher.drive_problem})"
        kept = "kept too" if o.accepted_p99_ms <= HIGHER_MARGIN * self.slo_ms else \
            f"kept, past {HIGHER_MARGIN:.0%} of the SLO"
        return (f"; at {at} accepted p99 {o.accepted_p99_ms:.1f} ms, goodput {o.goodput_rps:.0f}/s: "
                + (kept if self.higher.meets else f"not kept ({self.higher.note})"))

    def fallback_summary(self) -> str:
        """What is written when no policy held, in one sentence ("" when a policy held or none is written)."""
        if self.chosen is not None or self.fallback is None:
            return ""
        point = next(iter(tries_at(self.points, self.fallback, self.rate)), None)
        how = ""
        if point is not None and point.overload.valid:
            o = point.overload
            how = (f"; at {self.rate:.0f}/s it kept accepted p99 {o.accepted_p99_ms:.1f} ms and goodput "
                   f"{o.goodput_rps:.0f}/s ({o.goodput_rps / self.capacity_rps:.0%} of capacity)")
        elif point is not None and point.predicted_miss:
            how = f"; it was {point.note.replace('not driven: ', 'not driven into the overload, since ', 1)}"
        return (f"the closest queue policy tried is written: {self.fallback.label} (it keeps normal traffic at peak "
                f"x headroom{how}){self.capacity_cost()}")

    def capacity_cost(self) -> str:
        """What the written policy costs at normal traffic near capacity, as a clause: "" where it was measured to
        keep the batching's capacity, or, not measured (the time budget), where its timeout is estimated to shed at
        most ``MAX_NORMAL_REJECT`` there."""
        if self.choice_capacity_rps is not None:
            rate, alone = self.choice_capacity_rps, "the batching choice without a policy"
            if self.carried_rps is None:
                return (f"; its structure was not measured above peak x headroom with the policy (the time budget): it "
                        f"may carry less than the batching choice's {rate:.0f}/s")
        elif self.capacity_shed is not None:
            (rate, share), alone = self.capacity_shed, "the batching alone"
            if self.carried_rps is None:
                if round(share, 4) <= MAX_NORMAL_REJECT:  # at most a Poisson burst's worth: nothing to say
                    return ""
                shown = f"{share:.1%}" if share >= 0.01 else f"{share:.2%}"
                return (f"; at {rate:.0f}/s, the batching's capacity, its timeout may shed up to {shown} of normal "
                        "traffic (requests the batching answered there later than the timeout and a full batch; not "
                        "measured with the policy: the time budget)")
        else:
            return ""
        if self.carried_rps >= rate * 0.999:
            return ""
        return (f"; with its timeout the written config kept the SLO up to {self.carried_rps:.0f}/s (a rejection "
                f"counted as a miss), {alone} up to {rate:.0f}/s: size replicas by {self.carried_rps:.0f}/s")

    def to_dict(self) -> dict[str, Any]:
        def summary_of(point: OverloadPoint | None) -> dict[str, Any] | None:
            if point is None:
                return None
            o = point.overload
            return {
                "offered_rps": point.rate,
                "kept_slo": point.meets,
                "drive_problem": point.drive_problem or None,
                "accepted_p99_ms": o.accepted_p99_ms,
                "rejected_fraction": round(o.rejected_fraction, 4),
                "rejection_p50_ms": o.rejection_p50_ms,
                "rejection_p99_ms": o.rejection_p99_ms,
                "goodput_rps": o.goodput_rps,
                "time_to_recover_s": point.recover_s,
            }

        summary = summary_of(self.chosen_point)
        return {
            "outcome": self.outcome,
            "summary": self.summary(),
            "factor": self.factor,
            "capacity_rps": self.capacity_rps,
            "offered_rps": self.rate,
            "recover_rps": self.recover_rps,
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "closest": self.closest.to_dict() if self.closest else None,
            "fallback": self.fallback.to_dict() if self.fallback else None,
            "fallback_summary": self.fallback_summary() or None,
            "overload_point": summary,
            "higher_overload_point": summary_of(self.higher),
            "capacity_shed": None if self.capacity_shed is None else {
                "rate_rps": self.capacity_shed[0], "shed_about": round(self.capacity_shed[1], 4)},
            "carried_with_policy_rps": self.carried_rps,
            "batching_capacity_rps": self.choice_capacity_rps,
            "tried": [p.candidate.label for p in self.points],
            "points": [p.to_dict() for p in self.points],
            "notes": list(self.notes),
            "cut_short": self.cut_short,
        }


def nothing_sent(rate: float) -> PhaseStats:
    """The figures of an overload phase that was not run (a config that did not load, a policy that shed normal
    traffic or that the mechanism rules out)."""
    return PhaseStats(rate, 0.0, 0, 0, 0, 0, float("inf"), float("inf"), None, None, 0.0, 0.0, False)


def tries_at(points: Sequence[OverloadPoint], candidate: Candidate | None, rate: float) -> list[OverloadPoint]:
    """The tries of ``candidate`` at ``rate`` (the asked overload), in the order they were measured (none for no
    candidate)."""
    if candidate is None:
        return []
    return [p for p in points if p.candidate.key == candidate.key and p.rate == rate]


def shed_estimate(latencies_ms: np.ndarray, timeout_ms: float, full_batch_ms: float) -> float:
    """About the share of requests a queue timeout of ``timeout_ms`` sheds at the traffic these latencies were
    measured at without it: near capacity the batch in flight is a full one, so a request answered later than the
    timeout plus a full batch's execution and the overhead (``full_batch_ms``) had waited past the timeout. It
    leans high: rejections leave the others less to wait for (a request that ran in a smaller batch and waited
    past the timeout is missed). 1 for no latencies."""
    if not len(latencies_ms):
        return 1.0
    return float(np.mean(latencies_ms > timeout_ms + full_batch_ms))


def not_drivable(points: Sequence[OverloadPoint]) -> bool:
    """No overload run was driven as offered, and at least one was sent (not merely a config that did not load)."""
    return not any(p.overload.valid for p in points) and any(p.overload.requests or p.overload.unsent
                                                             for p in points)


CLIENT_CEILING = 0.9
"""An overload run that sent too little, and within this ratio of the highest rate this client already drove as
offered in the search (either way), met the client's ceiling, not a hiccup (``drive_again``)."""


def drive_again(over: PhaseStats, rate: float, client_best_rps: float) -> bool:
    """Whether an overload run that was not driven as offered is run once more: after a hiccup of the shared
    machine (it sent at least half the rate; or it stalled before the overload began), not when this client
    cannot offer the rate: it sent less than half of it, or it sent too little and about what it already drove
    as offered at most (``CLIENT_CEILING``: at twice the tuning check's capacity, 1875/s, both drives of one try
    sent what the ladder's last valid point had, about 7 s for nothing). A run that sent its rate and lagged, or
    sent more than the client was ever asked for, is a hiccup."""
    if over.valid:
        return False
    if over.requests == 0:
        return True
    at_ceiling = (client_best_rps > 0 and over.send_rps < CLIENT_CEILING * rate
                  and CLIENT_CEILING * client_best_rps <= over.send_rps <= client_best_rps / CLIENT_CEILING)
    return over.send_rps >= 0.5 * rate and not at_ceiling


def try_cost_s(overload_s: float, recover_s: float, headroom_point_s: float) -> float:
    """What one policy try takes: a load, the four phases (``PolicySearch._trace``), a point of normal traffic at
    peak x headroom (``headroom_point_s``), margin."""
    return 2.0 + 1.0 + SPIKE_ONSET_S + overload_s + recover_s + headroom_point_s


class PolicySearch:
    """The queue-policy search (module docstring): timeouts between one batch's execution and what the SLO
    leaves, up when normal traffic is shed, down when the accepted p99 under overload misses, on the chosen
    batching and then on simpler structures that the measurements show may hold (no delay, a smaller
    max batch, one instance)."""

    def __init__(
        self,
        prober: Prober,
        profile: Profile,
        batching: Candidate,
        capacity_rps: float,
        slo_ms: float,
        factor: float,
        recover_rps: float,
        headroom_rps: float,
        *,
        priority_levels: int = 0,
        overload_s: float = 3.0,
        recover_s: float = 2.0,
        capacity_note: str = "",
        fallback: bool = True,
        capacities: dict[str, float] | None = None,
        missed: dict[str, float] | None = None,
        climbed: dict[str, float] | None = None,
        fast_rejection: bool = False,
    ) -> None:
        self.prober, self.profile, self.batching = prober, profile, batching.without_queue_policy()
        self.measured_key = batching.key
        """The batching's key as the search measured it (with the served config's own queue policy, if any)."""
        self.capacity, self.slo_ms, self.factor = capacity_rps, slo_ms, factor
        self.recover_rps, self.headroom_rps = recover_rps, headroom_rps
        self.priority_levels, self.overload_s, self.recover_s = priority_levels, overload_s, recover_s
        self.fast_rejection = fast_rejection
        """Try ``max_queue_size`` on top of the held timeout (``--fast-rejection``)."""
        self.points: list[OverloadPoint] = []
        self.notes: list[str] = []
        self.cut_short = False
        self.lower_bound = "budget" in capacity_note or capacity_rps <= headroom_rps
        self.capacity_note = capacity_note or "the ladder did not climb"
        self.want_fallback = fallback
        """Whether to look for a fallback when no policy holds (not when a held one is required: never written)."""
        self.capacities = capacities or {}
        """Capacities within the SLO the batching search measured (its ladder), by structure key."""
        self.missed = missed or {}
        """The lowest busy rate at which a structure missed the SLO in the batching search, by structure key."""
        self.climbed = climbed or {}
        """Each ladder's own figure before the finalists' re-measure took a step off it, by structure key."""

    @property
    def rate(self) -> float:
        """The overload offered: ``factor`` x the capacity the search currently judges against."""
        return round(self.capacity * self.factor, 1)

    def timeout_range_ms(self, structure: Candidate) -> tuple[float, float]:
        """The timeouts worth trying on ``structure``: at least ``MIN_TIMEOUT_BATCHES`` full batches plus the queue
        delay (or normal traffic near capacity is shed), at most what ``MAX_TIMEOUT_SHARE`` of the SLO leaves after
        a full batch."""
        full = self.profile.exec_at(structure.max_batch_size)
        low = max(MIN_TIMEOUT_BATCHES * full + structure.delay_us / 1000, 1.0)
        high = MAX_TIMEOUT_SHARE * self.slo_ms - full - self.profile.overhead_ms
        return low, high

    def first_timeout_ms(self, structure: Candidate | None = None) -> float:
        structure = structure or self.batching
        low, high = self.timeout_range_ms(structure)
        full = self.profile.exec_at(structure.max_batch_size)
        first = FIRST_TIMEOUT_SHARE * self.slo_ms - full - self.profile.overhead_ms
        return max(min(first, high), low)

    def structures(self) -> list[Candidate]:
        """The chosen batching, then simpler ones a timeout may hold on: without its delay (a delay holds
        requests back when the batcher looks at the queue), a smaller max batch whose timeout range is not
        empty (one batch's wait is what a timeout must cover), one instance (instances share this machine's
        cores: one may carry as much with less variance)."""
        chosen = self.batching
        out = [chosen]
        plain = Candidate(chosen.max_batch_size, chosen.instances, True, 0, (), "overload")
        out.append(plain)
        fits = [b for b in sorted(self.profile.exec_ms) if b < chosen.max_batch_size
                and self._range_fits(Candidate(b, chosen.instances))
                and self.profile.capacity_bound(b, chosen.instances) >= self.headroom_rps]
        if fits:
            out.append(Candidate(fits[-1], chosen.instances, True, 0, (), "overload"))
        if chosen.instances > 1:
            batch = chosen.max_batch_size if self._range_fits(chosen) or not fits else fits[-1]
            if self.profile.capacity_bound(batch, 1) >= self.headroom_rps:
                out.append(Candidate(batch, 1, True, 0, (), "overload"))
        unique: dict[str, Candidate] = {}
        for candidate in out:
            unique.setdefault(candidate.without_queue_policy().key, candidate)
        return list(unique.values())

    def _gives_capacity_away(self, structure: Candidate) -> bool:
        """Whether a simpler structure carries less than ``SIMPLER_CAPACITY`` of the choice's capacity: as the
        batching search measured it (its ladder, or a busy level it missed where the choice met it), or at most by
        the profile (every execution a full batch). Noted."""
        key = structure.without_queue_policy().key
        if key == self.batching.key:
            return False
        need = SIMPLER_CAPACITY * self.capacity
        carried, missed = self.capacities.get(key), self.missed.get(key)
        bound = self.profile.capacity_bound(structure.max_batch_size, structure.instances)
        if carried is not None and carried < need and not self.lower_bound:  # (a ladder's figure against a ladder's)
            if self._within_noise_where_the_choice_cannot_hold(structure):
                return False
            why = f"it carried {carried:.0f}/s within the SLO in the batching search"
        elif carried is None and missed is not None and missed < need:  # the choice met that rate
            why = f"it missed the SLO at {missed:.0f}/s in the batching search"
        elif bound < need:
            why = f"it carries at most {bound:.0f}/s (every execution a full batch)"
        else:
            return False
        self.notes.append(f"{structure.label}: not tried: {why}, under {SIMPLER_CAPACITY:.0%} of the choice's "
                          f"{self.capacity:.0f}/s (a policy there would give that capacity away at normal traffic)")
        return True

    def _within_noise_where_the_choice_cannot_hold(self, structure: Candidate) -> bool:
        """Whether a structure whose capacity the finalists' re-measure cut a ladder step below the choice's is
        tried all the same: its own ladder met the choice's capacity (the two are within this machine's noise
        of each other), the choice leaves no timeout range, and ``structure`` has one. There a policy on the
        choice cannot cover the batch in flight: an accepted request waits for it and runs in its own, past the
        SLO (3 ms + 3 ms/item under 50 ms: max batch 8, 27 ms a batch, missed at 2 x capacity with every
        timeout down to 8.4 ms, and with it 67.9 ms in the bench's independent run; max batch 4 had met the same
        440/s on its ladder and lost that step on a re-measure at 59 and 120 ms). Noted."""
        climbed = self.climbed.get(structure.without_queue_policy().key)
        if (climbed is None or climbed < SIMPLER_CAPACITY * self.capacity or self._range_fits(self.batching)
                or not self._range_fits(structure)):
            return False
        full = self.profile.exec_at(self.batching.max_batch_size)
        self.notes.append(
            f"{structure.label}: tried although the finalists' re-measure put its capacity a ladder step under the "
            f"choice's: its ladder met {climbed:.0f}/s as the choice's did, and the choice's full batch "
            f"({full:.1f} ms) leaves no timeout that covers the batch in flight within the SLO")
        return True

    def _range_fits(self, structure: Candidate) -> bool:
        low, high = self.timeout_range_ms(structure)
        return low <= high

    def _measure_capacity(self) -> None:
        """When the SLO ladder stopped early its capacity is only a lower bound, and an overload relative to
        it is no overload (measured: 141/s where the config sustained 276/s, so "2x" shed 5 %). The
        capacity is then what the batching sustains closed loop, enough clients to keep every instance's
        batches full: one short run, and the overload is relative to that."""
        if not self.prober.load(self.batching):
            return
        slots = self.batching.max_batch_size * self.batching.instances
        saturated = self.prober.measure(LoadSpec(concurrency=3 * slots, requests=max(300, 30 * slots),
                                                 warmup_s=self.prober.warmup_s, min_duration_s=1.0))
        if saturated.valid and not saturated.errors and saturated.achieved_rps > 1.05 * self.capacity:
            self.notes.append(f"capacity {self.capacity:.0f}/s from the SLO ladder was a lower bound "
                              f"({self.capacity_note}); closed loop with {3 * slots} clients the batching "
                              f"sustains {saturated.achieved_rps:.0f}/s: the overload is relative to that")
            self.capacity = saturated.achieved_rps
        else:
            self.notes.append(f"capacity {self.capacity:.0f}/s is a lower bound ({self.capacity_note}): the "
                              "overload is relative to it; give --budget more time for a true capacity")

    def try_cost_s(self) -> float:
        return try_cost_s(self.overload_s, self.recover_s, self.prober.point_cost_s(self.headroom_rps))

    def _affords_another(self) -> bool:
        """Whether the time budget allows one more try (the first is always made); noted once when not."""
        if not self.points or self.prober.can_afford(self.try_cost_s()):
            return True
        if not self.cut_short:
            self.cut_short = True
            self.notes.append("queue-policy search cut short: time budget (give --budget more time)")
        return False

    def run(self) -> OverloadOutcome:
        if self.lower_bound:  # the first try is always made, and it needs a true capacity to mean anything
            self._measure_capacity()
        chosen: Candidate | None = None
        structures = [c for c in self.structures() if not self._gives_capacity_away(c)]
        fitting = [c for c in structures if self._range_fits(c)]
        def no_room(structure: Candidate) -> str:
            full = self.profile.exec_at(structure.max_batch_size)
            return (f"a full batch ({full:.1f} ms) leaves no timeout that both covers the batch in flight and keeps "
                    "an accepted request within the SLO")

        for structure in structures:
            if structure not in fitting and structure != self.batching:
                self.notes.append(f"{structure.label}: not tried: {no_room(structure)}")
        # where the choice has no range, the structures that have one come first and the choice itself after
        # them (below its range), so that without a held policy the fallback still has the choice's tries
        order = fitting + ([self.batching] if self.batching not in fitting else [])
        for structure in order:
            if not self._affords_another():
                break
            if structure not in fitting:
                self.notes.append(f"{structure.label}: {no_room(structure)}: measured all the same, with timeouts "
                                  "from the range's floor down" + (" (no structure with a range held)" if fitting
                                                                   else ""))
            chosen = self._search_timeout(structure)
            if chosen is not None or any(p.client_limited for p in self.points):
                break
        if self._not_drivable():
            self.notes.append(f"the overload of {self.rate:.0f}/s was not driven as offered from this client: not "
                              "measurable here (a lower --overload-factor, or a faster client machine)")
        if chosen is not None and chosen.without_queue_policy().key != self.batching.key:
            self.notes.append(f"the queue policy held on a simpler structure than the batching choice: {chosen.label} "
                              f"(its normal traffic measured at peak x headroom {self.headroom_rps:.0f}/s); that "
                              "structure is the one chosen")
        if chosen is not None and not chosen.max_queue_size and self.fast_rejection and self._affords_another():
            chosen = self._try_max_queue(chosen)
        higher = None
        if chosen is not None and self._affords_another():
            higher = self.try_policy(chosen, self.factor * HIGHER_FACTOR)
            if higher.overload.valid and not self._holds_with_margin(higher):
                chosen, higher = self._hold_the_larger_spike(chosen, higher)
        closest = None
        if chosen is None and self.points:
            closest = min(self.points, key=lambda p: (not p.overload.valid, p.sheds_normal_traffic,
                                                      p.overload.accepted_p99_ms)).candidate
        fallback = self._fallback() if chosen is None and self.want_fallback else None
        shed, carried, against = self._written_capacity(chosen or fallback)  # (its notes too)
        return OverloadOutcome(self.factor, self.capacity, self.rate, self.recover_rps, tuple(self.points), chosen,
                               closest, tuple(self.notes), self.cut_short, higher, fallback, self.slo_ms, shed, carried,
                               against)

    def _written_capacity(self, written: Candidate | None
                          ) -> tuple[tuple[float, float] | None, float | None, float | None]:
        """(``_capacity_shed``, carried, against) for the written policy: what it would shed at its structure's
        capacity, estimated, and the highest rate of the structure's ladder at or below that capacity that the written
        config keeps within the SLO with its policy, a rejection counted as a miss, measured (None: the budget left no
        point for it). The estimate does not decide whether to measure: it leans high where rejections leave the others
        less to wait for (bench_overload's default model: a 49 ms timeout estimated at 32.7 % shed 11.8 % at 275/s),
        and it reads one point at the edge of capacity, which can be a quiet one (twice on that model it said 0.0 %
        for an 80-82 ms timeout that shed 4.7 % at 275/s by the independent load). Where the written config keeps the
        capacity this costs one point; the estimate is said where the budget leaves none.

        Where the policy is on a simpler structure that the batching search did not climb, its capacity is known only
        by the profile's bound (every execution a full batch), which leans high too (3 ms + 3 ms/item under 50 ms: max
        batch 4 bounded at 533/s, within ``SIMPLER_CAPACITY`` of max batch 8's 489.5/s, carried 351-386/s with an
        18.8 ms timeout by the independent load): it is measured over the batching choice's ladder up to the choice's
        capacity, ``against`` (None otherwise), so that the summary says what the written config carries."""
        shed = self._capacity_shed(written)
        against = self._unclimbed_simpler(written)
        if written is not None and against is not None:
            return shed, self._highest_kept(written, self._ladder_rates(self.batching, against)), against
        if written is None or shed is None:
            return shed, None, None
        return shed, self._highest_kept(written, self._ladder_rates(written, shed[0])), None

    def _ladder_rates(self, structure: Candidate, capacity: float) -> list[float]:
        """The rates the batching search's ladder met the SLO at on ``structure`` (``_measured_keys``), above peak x
        headroom and below ``capacity``, then ``capacity``. For a structure with a queue delay, the rates its
        structure without the delay met count too: a delay tried for a busy batcher is climbed from the ladder's rate
        above the best capacity, the rungs below carried from the structure without it (``Search.climb``'s
        ``carries``). Without them a written config that missed at that rate with its policy was said to keep only
        peak x headroom (the tuning check's model: 480/s, where the ladder below had 600 and 750/s)."""
        keys = self._measured_keys(structure)
        if structure.delay_us:
            keys.add(structure.with_delay(0).key)  # (with_delay leaves the queue policy out)
        below = sorted({p.rate for p in self.prober.points if p.candidate in keys and p.meets_slo
                        and self._above_headroom(p.rate) and p.rate < capacity * 0.999})
        return [*below, capacity]

    def _highest_kept(self, written: Candidate, rungs: list[float]) -> float | None:
        """The highest of ``rungs`` at which ``written`` keeps the SLO with its policy (peak x headroom, which the
        policy's own check kept, where none does; None: the budget left no point for it). Measured at the last rung
        first (one point where the policy costs nothing there), then bisected down to peak x headroom: four points
        at most on a ladder of six rates, and a miss shaped like a disturbance of the machine is measured once more
        (``_normal_traffic``: a single window of a point past the SLO came about once in five points on this
        machine, for the batching alone as with a policy, so a single miss halved the figure said)."""
        kept, missed = -1, len(rungs)  # indexes: peak x headroom (kept by the policy's check), none missed yet
        index = len(rungs) - 1
        while kept + 1 < missed:
            rate = rungs[index]
            if not self.prober.can_afford(self.prober.point_cost_s(rate) + LOAD_S) or not self.prober.load(written):
                self.notes.append(f"{written.label}: not measured at {rate:.0f}/s with its queue policy: time budget")
                return None
            self.prober.say(f"normal traffic {rate:.0f}/s with the queue policy: {written.label}")
            problems = self._normal_traffic(written, rate, once_more=True)
            if problems:
                missed = index
                self.notes.append(f"{written.label} with its queue policy: {problems[0]}")
            else:
                kept = index
                self.notes.append(f"{written.label}: kept the SLO at {rate:.0f}/s with its queue policy (rejections "
                                  "counted as misses)")
            index = (kept + missed) // 2
        return rungs[kept] if kept >= 0 else self.headroom_rps

    def _unclimbed_simpler(self, written: Candidate | None) -> float | None:
        """The batching choice's capacity on its ladder, where ``written`` has a queue policy on another structure
        that the batching search did not climb above peak x headroom and the choice's ladder did; None otherwise."""
        if written is None or not written.has_queue_policy:
            return None
        key = written.without_queue_policy().key
        if key == self.batching.key or self._above_headroom(self.capacities.get(key, 0.0)):
            return None
        capacity = self._ladder_capacity(self._measured_keys(self.batching))
        return capacity if self._above_headroom(capacity) else None

    def _above_headroom(self, rate: float) -> bool:
        """``rate`` is a ladder rate above peak x headroom (the ladder's rates are rounded to 0.1/s)."""
        return rate > self.headroom_rps * 1.001

    def _ladder_capacity(self, keys: set[str]) -> float:
        """The highest capacity the batching search measured under ``keys`` (0 where none)."""
        return max((self.capacities.get(key, 0.0) for key in keys), default=0.0)

    def _measured_keys(self, written: Candidate) -> set[str]:
        """The keys the batching search measured ``written``'s structure under: its own, and, for the batching
        choice, the served config's (whose own queue policy is in its key)."""
        structure = written.without_queue_policy().key
        return {structure} | ({self.measured_key} if self.batching.key == structure else set())

    def _capacity_shed(self, written: Candidate | None) -> tuple[float, float] | None:
        """(rate, ``shed_estimate``) for ``written`` at its structure's capacity on the batching search's ladder
        (the last point measured there within the SLO), from the latencies measured without the policy: no point
        is spent on it. None where the structure was not climbed above peak x headroom (no capacity figure to
        warn about). The policy's own check is at peak x headroom; near capacity Poisson bursts make requests
        wait, and a timeout sheds what waited past it (bench_overload's default model: the batching carried 275/s
        on the tuner's ladder, the written 80 ms timeout 199/s by the independent load, 4.6 % rejected at 275/s)."""
        if written is None or not written.has_queue_policy:
            return None
        keys = self._measured_keys(written)
        capacity = self._ladder_capacity(keys)
        at_capacity = [p for p in self.prober.points if p.candidate in keys and p.meets_slo
                       and abs(p.rate - capacity) <= 0.001 * capacity and p.measurement is not None
                       and len(p.measurement.latencies_ms)]
        if not self._above_headroom(capacity) or not at_capacity:
            return None
        full = self.profile.exec_at(written.max_batch_size) + self.profile.overhead_ms
        return capacity, shed_estimate(at_capacity[-1].measurement.latencies_ms, written.queue_timeout_us / 1000, full)

    def _hold_the_larger_spike(self, chosen: Candidate, higher: OverloadPoint) -> tuple[Candidate, OverloadPoint]:
        """The chosen policy missed at the larger spike, or held there with no margin (``HIGHER_MARGIN``). Tried in
        turn, while the budget allows and the best so far has no margin there:

        1. the same timeout without ``max_queue_size``, when that was added on top (a full queue's refusal can stall
           Triton 2.51's batcher, and a larger spike keeps it full: measured at 3 x capacity on 3 ms + 3 ms/item, an
           11 ms timeout kept 101 % of capacity as goodput alone and 83 % with a bound of 16);
        2. the same timeout with the second bound, when it has none (``_with_queue_bound``: as at the asked overload,
           the bound before a shorter timeout);
        3. a shorter timeout than the best so far, on the same structure (0.6 x: an accepted request waited at most T;
           bench_overload measured the 19 ms timeout alone at 44.4 ms at 3 x in the tuner's run, past the margin, and
           at 69.7 ms in its own run right after). Below the range's floor it is measured at normal traffic first, as
           in the search (on 3 ms + 3 ms/item under 50 ms the floor, 19 ms, held at 2 x and missed at 3 x with
           52-68 ms; 9.5 ms held both, at 28-29 ms).

        One replaces the best so far when it holds at the asked overload (normal traffic at peak x headroom included)
        and comes closer to holding at the larger one (``_closeness``)."""
        best, best_higher = chosen, higher
        for next_option in (self._without_queue_bound, self._with_queue_bound, self._shorter_timeout):
            if self._holds_with_margin(best_higher) or not self._affords_another():
                break
            option = next_option(best)
            if option is None:
                continue
            candidate, needs_asked, below_range = option
            if needs_asked:
                point = self.try_policy(candidate, normal_first=below_range)
                if not point.meets:
                    self.notes.append(f"{candidate.key}, tried for the larger spike: not kept ({point.note})")
                    continue
                if not self._affords_another():
                    break
            again = self.try_policy(candidate, self.factor * HIGHER_FACTOR)
            better = self._closeness(again, spike=True) < self._closeness(best_higher, spike=True)
            o = again.overload
            how = (f"missed at {best_higher.rate:.0f}/s ({best_higher.note})" if not best_higher.meets else
                   f"held at {best_higher.rate:.0f}/s past {HIGHER_MARGIN:.0%} of the SLO "
                   f"({best_higher.overload.accepted_p99_ms:.1f} ms)")
            self.notes.append(
                f"{best.key} {how}; {candidate.key} held at "
                f"{self.rate:.0f}/s and gave accepted p99 {o.accepted_p99_ms:.1f} ms, goodput {o.goodput_rps:.0f}/s "
                "there: " + ("kept" if better else "not kept"))
            if better:
                best, best_higher = candidate, again
        return best, best_higher

    def _without_queue_bound(self, best: Candidate) -> tuple[Candidate, bool, bool] | None:
        """``best``'s timeout without its ``max_queue_size``, where it held at the asked overload already (for
        ``_hold_the_larger_spike``: the candidate, whether it must first hold at the asked overload, whether its
        timeout is below the range's floor); None without a bound, or where the timeout alone did not hold."""
        if not best.max_queue_size:
            return None
        plain = best.without_queue_policy().with_queue_policy(best.queue_timeout_us, 0, self.priority_levels)
        held = any(p.meets for p in tries_at(self.points, plain, self.rate))
        return (plain, False, False) if held else None

    def _with_queue_bound(self, best: Candidate) -> tuple[Candidate, bool, bool] | None:
        """``best``'s timeout with the second bound (``queue_bound``: one full batch waiting per instance), as at the
        asked overload before a shorter timeout (``_search_timeout``): a larger spike keeps the queue full, and the
        bound keeps an accepted request's wait to the batch in flight and its own where a timeout alone is checked
        only when the batcher looks at the queue (bench_overload on 3 ms + 3 ms/item under 50 ms: the 19 ms timeout
        alone measured 54-70 ms at 3 x, the same timeout with a queue of 8 held 37.2 ms there in the tuner and 36.4 ms
        in the bench). For ``_hold_the_larger_spike`` (as ``_without_queue_bound``); None where ``best`` has a bound,
        where the bound cannot hold (``_bound_can_hold``) or where it already missed at the asked overload."""
        structure = best.without_queue_policy()
        if best.max_queue_size or not self._bound_can_hold(structure):
            return None
        bounded = structure.with_queue_policy(best.queue_timeout_us, self.queue_bound(structure), self.priority_levels)
        at_asked = tries_at(self.points, bounded, self.rate)
        if at_asked and not any(p.meets for p in at_asked):
            return None
        return bounded, not at_asked, False

    def _shorter_timeout(self, best: Candidate) -> tuple[Candidate, bool, bool] | None:
        """0.6 x ``best``'s timeout with its queue bound (as ``_without_queue_bound``); None when that is too close to
        ``best``'s to differ, or when the mechanism makes it shed normal traffic (``sheds_expected``: recorded)."""
        timeout = best.queue_timeout_us / 1000
        shorter = max(1.0, 0.6 * timeout)
        if timeout - shorter < max(0.5, 0.1 * timeout):
            return None
        below_range = shorter < self.timeout_range_ms(best)[0] - 0.05
        candidate = best.without_queue_policy().with_queue_policy(round(shorter * 1000), best.max_queue_size,
                                                                  self.priority_levels)
        if self.sheds_expected(candidate):
            self._not_measured_sheds(candidate)
            return None
        return candidate, True, below_range

    def _holds_with_margin(self, point: OverloadPoint) -> bool:
        return point.meets and point.overload.accepted_p99_ms <= HIGHER_MARGIN * self.slo_ms

    def _closeness(self, point: OverloadPoint, *, spike: bool = False) -> tuple[bool, bool, bool, float, float]:
        """How close a try came to holding, smallest first: driven as offered, held (at the larger spike,
        ``spike``: within ``HIGHER_MARGIN`` of the SLO), accepted p99 within the SLO, then the higher goodput,
        then the lower accepted p99."""
        o = point.overload
        held = self._holds_with_margin(point) if spike else point.meets
        return not o.valid, not held, o.accepted_p99_ms > self.slo_ms, -o.goodput_rps, o.accepted_p99_ms

    def _fallback(self) -> Candidate | None:
        """No policy held: the best policy tried that keeps normal traffic, to be written all the same. A timeout
        within the range sheds only what waited past it, where no policy lets the queue grow for as long as the
        spike lasts (measured at 2 x capacity: accepted p99 seconds, goodput near 0). Ranked: driven as
        offered, accepted p99 within the SLO, then goodput, then accepted p99 (``_closeness``); the first two
        that were not already shown to shed normal traffic are measured at peak x headroom, the first that keeps
        it wins. One that misses there is measured once more: without a fallback a spike queues without bound, and
        one measurement at a busy rate on a shared machine is not the evidence to leave that (bench_tuning run 12:
        a 20 ms timeout on max batch 8 with a 5.1 ms delay missed its one check and no policy was written; the
        independent load measured it at 19.7 and 18.5 ms at peak x headroom, rejections counted as misses). Only a
        policy on the batching choice itself: one on a simpler structure is written only when it
        held, since unproven it would also give away the capacity the batching search measured (the tuning
        check's model: a policy on max batch 4 written in place of max batch 16 carried 480/s where the
        batching carried 580-750/s, and shed normal traffic at peak x headroom in one of three rounds). Only a
        timeout at or above the range's floor (``timeout_range_ms``; above its top where the range is empty): a
        shorter one keeps peak x headroom
        but sheds near the batching's capacity, where the batch in flight is a full one (the tuning check's model,
        max batch 16 at 18.9 ms a batch: 11.3 ms written as the fallback, the independent load measured the
        written config's capacity at 480-580/s where the grid's best carried 580-703/s)."""
        tried = {p.candidate.key: p for p in self.points
                 if p.rate == self.rate and p.candidate.has_queue_policy and not p.sheds_normal_traffic
                 and p.candidate.without_queue_policy().key == self.batching.key
                 and (p.overload.requests or p.overload.unsent or p.predicted_miss)}
        for key, point in list(tried.items()):
            floor_ms = self.timeout_range_ms(point.candidate)[0]
            if point.candidate.queue_timeout_us < floor_ms * 1000 - 1:
                del tried[key]
                self.notes.append(f"{point.candidate.label}: not written without a held policy: its timeout is under "
                                  f"the range's floor ({MIN_TIMEOUT_BATCHES:g} full batches and the queue delay, "
                                  f"{floor_ms:.1f} ms), so near capacity it sheds requests the batching answers "
                                  "within the SLO")
        ranked = sorted(tried.values(), key=self._closeness)
        for point in ranked[:2]:
            if not self.prober.load(point.candidate):
                continue
            shed = self._normal_traffic(point.candidate)
            if shed:  # once more: a disturbance of the machine must not leave the batching with no policy at all
                self.notes.append(f"{point.candidate.label}: {shed[0]}: measured once more")
                shed = self._normal_traffic(point.candidate)
            if not shed:
                return point.candidate
            self.notes.append(f"{point.candidate.label}: not written without a held policy: {shed[0]}")
        return None

    def _not_drivable(self) -> bool:
        return not_drivable(self.points)

    def _search_timeout(self, structure: Candidate) -> Candidate | None:
        """Bisect the timeout on one structure: up when normal traffic is shed, down when the accepted p99
        under overload misses; a near miss is measured once more first (one disturbed run of a shared
        machine should not move the timeout); a timeout the mechanism puts past the SLO is not driven and counts
        as a miss (``miss_expected``, ``_not_driven``: it costs nothing, so the budget does not stop it)."""
        low, high = self.timeout_range_ms(structure)
        high = max(high, low)
        shed_below, miss_above = low, high  # the bracket: [too short, too long]
        timeout = self.first_timeout_ms(structure)
        bounded_tried = False
        for _ in range(TRIES_PER_STRUCTURE):
            candidate = structure.with_queue_policy(round(timeout * 1000), 0, self.priority_levels)
            if self.miss_expected(candidate):
                point = self._not_driven(candidate)
            elif self.sheds_expected(candidate):
                point = self._not_measured_sheds(candidate)
            elif not self._affords_another():
                return None
            else:
                # below the range's floor the risk is shedding normal traffic near capacity (the batch in flight
                # is a full one): that is measured first, and a timeout that sheds is not driven into overload
                point = self.try_policy(candidate, normal_first=timeout < low - 0.05)
            if self._near_miss(point) and self._affords_another():
                self.notes.append(f"{candidate.key}: near miss (accepted p99 {point.overload.accepted_p99_ms:.1f} ms)"
                                  ", measured again")
                point = self.try_policy(candidate)
            if point.meets:
                return candidate
            if not point.overload.valid and not point.sheds_normal_traffic and not point.predicted_miss:
                return None  # a longer or shorter timeout cannot fix a client that did not offer the rate
            if point.sheds_normal_traffic:
                shed_below = timeout
                following = (timeout + miss_above) / 2 if miss_above > timeout else timeout
            elif point.misses_under_overload or point.predicted_miss:
                if not bounded_tried and self._affords_another():
                    # the second bound before a shorter timeout: a queue of one batch per instance keeps an
                    # accepted request's wait to the batch in flight and its own, whatever the timeout
                    bounded_tried = True
                    if self._bound_can_hold(structure):
                        bounded = structure.with_queue_policy(round(timeout * 1000), self.queue_bound(structure),
                                                              self.priority_levels)
                        held = self.try_policy(bounded)
                        # a full queue's refusal can stall Triton's batcher (module docstring): kept only when
                        # it also keeps the goodput the timeout alone had (where that was driven)
                        if held.meets and (point.predicted_miss or held.overload.goodput_rps
                                           >= MAX_QUEUE_GOODPUT * point.overload.goodput_rps):
                            return bounded
                miss_above = timeout
                following = (timeout + shed_below) / 2 if shed_below < timeout else timeout / 2
                following = max(following, 1.0)
            else:  # errors, goodput or recovery: not a matter of the timeout's length
                return None
            if abs(following - timeout) < max(0.5, 0.1 * timeout):
                return None
            timeout = following
        return None

    def _bound_can_hold(self, structure: Candidate) -> bool:
        """Whether the queue bound (``queue_bound``) can keep an accepted request within the SLO: it waits for at
        most the batch in flight and then runs in its own, so two full batches (plus the queue delay and the
        overhead) must fit in ``MAX_TIMEOUT_SHARE`` of the SLO, the same room the timeout range leaves. Noted
        when not (on the tuning check's model, max batch 16 at 18.9 ms a batch under 25 ms: accepted p99 69.5 ms
        with the bound, 48.1 ms without)."""
        full = self.profile.exec_at(structure.max_batch_size)
        if full + structure.delay_us / 1000 <= self.timeout_range_ms(structure)[1]:
            return True
        wait = 2 * full + structure.delay_us / 1000 + self.profile.overhead_ms
        self.notes.append(f"{structure.label}: max_queue_size not tried as the second bound: an accepted request "
                          f"would wait for the batch in flight and run in its own, {wait:.1f} ms, past "
                          f"{MAX_TIMEOUT_SHARE:.0%} of the SLO")
        return False

    @staticmethod
    def queue_bound(structure: Candidate) -> int:
        """``max_queue_size`` as the second bound: one full batch waiting per instance."""
        return structure.max_batch_size * structure.instances

    def _near_miss(self, point: OverloadPoint) -> bool:
        """A miss under overload that one disturbed run of a shared machine may explain: close to the SLO, with most
        of the goodput (what the mechanism itself puts at the SLO's edge is not driven at all: ``miss_expected``)."""
        o = point.overload
        return (not point.meets and o.valid and not o.errors and not point.sheds_normal_traffic
                and o.accepted_p99_ms <= 1.25 * self.slo_ms and o.goodput_rps >= NEAR_MISS_GOODPUT * self.capacity)

    def expected_ms(self, candidate: Candidate) -> tuple[float, float]:
        """An accepted request's latency under overload as the mechanism puts it, for a timeout without a queue bound
        (a bound is judged by ``_bound_can_hold``): (its wait in the queue, that wait, a full batch's execution and
        the overhead). With the queue never empty, the batcher takes the oldest requests that have not timed out,
        which waited about the whole timeout, and runs them in a full batch (the queue delay waits for nothing: the
        batch is full at once)."""
        wait = candidate.queue_timeout_us / 1000
        return wait, wait + self.profile.exec_at(candidate.max_batch_size) + self.profile.overhead_ms

    def miss_expected(self, candidate: Candidate) -> bool:
        """Whether an accepted request's expected latency under overload (``expected_ms``) is past ``MAX_TIMEOUT_SHARE``
        of the SLO, the room the timeout range leaves: every latency measured under overload was 1.2-4.6 ms above the
        expected one, so there the mechanism alone makes the miss. Measured on the tuning check's model (a full batch
        of 8 in 12.7 ms and 0.9 ms of overhead under 25 ms): a 15.2 ms timeout, 28.8 ms expected, measured 30.6 and
        31.1 ms at 2 x capacity; on max batch 16 (18.9 ms a batch) 22.6 and 11.3 ms timeouts, 42.4 and 31.1 ms
        expected, measured 43.6 and 35.7 ms; and each timeout tried with its expected latency between 90 % of the SLO
        and the SLO missed: 10.2 ms (23.8 ms expected) at 27.2 ms, 11.3 ms (24.9 ms) at 27.2 and 28.1 ms, 11.4 ms
        (25.0 ms) at 28.8 and 26.2 ms, 7-11 s a try in each recent run of the check's model. Such a policy is not
        driven into the overload (``_not_driven``)."""
        return self.expected_ms(candidate)[1] > MAX_TIMEOUT_SHARE * self.slo_ms

    def sheds_expected(self, candidate: Candidate) -> bool:
        """Whether the mechanism rejects normal traffic under ``candidate``'s timeout: it is at or under the queue
        delay, and at peak x headroom a batch does not fill within the delay. The batcher then takes a batch when
        the delay of its oldest request has run out, past the timeout, and rejects every request that waited that
        long (measured on the tuning check's model, max batch 8 with a 5.1 ms delay: a 5.09 ms timeout rejected
        94.4 % at 480/s, where a batch of 8 takes 16.7 ms to arrive). Such a policy is not measured
        (``_not_measured_sheds``)."""
        delay_ms = candidate.delay_us / 1000
        return (0 < candidate.queue_timeout_us / 1000 <= delay_ms
                and self.headroom_rps * delay_ms / 1000 < candidate.max_batch_size)

    def _not_measured_sheds(self, candidate: Candidate) -> OverloadPoint:
        """The record of a policy the mechanism makes shed normal traffic (``sheds_expected``): not measured (a load
        and a point at peak x headroom, about 5 s), and the timeout search goes on above it as after a measured shed."""
        empty = nothing_sent(self.rate)
        note = (f"not measured: its timeout ({candidate.queue_timeout_us / 1000:.1f} ms) is at or under the queue "
                f"delay ({candidate.delay_us / 1000:.1f} ms), and at peak x headroom ({self.headroom_rps:.0f}/s) a "
                f"batch of {candidate.max_batch_size} does not fill within the delay: the batcher takes a batch when "
                "its oldest request has waited the delay out, and rejects the requests that waited past the timeout")
        point = OverloadPoint(candidate, self.rate, empty, empty, None, False, note, sheds_normal_traffic=True,
                              capacity_rps=self.capacity, predicted_shed=True)
        self.points.append(point)
        self.prober.say(f"normal traffic shed expected, not measured: {candidate.label}")
        return point

    def _not_driven(self, candidate: Candidate) -> OverloadPoint:
        """The record of a policy the mechanism already puts past the SLO (``miss_expected``): not driven into the
        overload (a try is 7-8 s), and the timeout search goes on below it as after a measured miss."""
        wait, expected = self.expected_ms(candidate)
        full = self.profile.exec_at(candidate.max_batch_size)
        empty = nothing_sent(self.rate)
        note = (f"not driven: an accepted request would wait about {wait:.1f} ms in the queue under the overload, then "
                f"run in a full batch ({full:.1f} ms, and {self.profile.overhead_ms:.1f} ms of overhead): "
                f"{expected:.1f} ms, past {MAX_TIMEOUT_SHARE:.0%} of the SLO of {self.slo_ms:g} ms (under overload the "
                "latencies measured were above this figure)")
        point = OverloadPoint(candidate, self.rate, empty, empty, None, False, note, capacity_rps=self.capacity,
                              predicted_miss=True)
        self.points.append(point)
        self.prober.say(f"overload not driven, {expected:.1f} ms expected: {candidate.label}")
        return point

    def _try_max_queue(self, chosen: Candidate) -> Candidate:
        base = next(p for p in reversed(self.points) if p.candidate.key == chosen.key and p.meets)
        size = 2 * chosen.max_batch_size * chosen.instances
        if base.overload.rejected_fraction < MIN_SHED:
            # a bounded queue only shows its fault (the batcher stalls) when it fills: judged on a run
            # that shed nothing it would look harmless and be kept
            self.notes.append(f"max_queue_size not tried: the overload run shed only "
                              f"{base.overload.rejected_fraction:.1%} (the capacity is a lower bound), so a "
                              "bounded queue would not fill")
            return chosen
        bounded = chosen.without_queue_policy().with_queue_policy(chosen.queue_timeout_us, size, self.priority_levels)
        point = self.try_policy(bounded)
        # a bounded queue rejects at once (a client can go elsewhere in a millisecond instead of after T):
        # worth a little goodput, not a collapse (measured on a quiet machine: 254/s vs 270/s, rejections
        # after 0.7 ms instead of 118 ms; on a loaded one the batcher's stalls cost far more)
        better = (
            point.meets
            and point.overload.goodput_rps >= MAX_QUEUE_GOODPUT * base.overload.goodput_rps
            and point.overload.accepted_p99_ms <= self.slo_ms
        )
        self.notes.append(
            f"max_queue_size {size} on top of the timeout: goodput {point.overload.goodput_rps:.0f}/s vs "
            f"{base.overload.goodput_rps:.0f}/s, accepted p99 {point.overload.accepted_p99_ms:.1f} ms vs "
            f"{base.overload.accepted_p99_ms:.1f} ms: " + ("kept" if better else "not used")
        )
        return bounded if better else chosen

    def try_policy(self, candidate: Candidate, factor: float | None = None, *,
                   normal_first: bool = False) -> OverloadPoint:
        """One try of ``candidate``: the overload at ``factor`` x capacity (default: the asked factor), the drop
        back to the peak rate and, when those kept the SLO at the asked factor, normal traffic at peak x
        headroom. With ``normal_first`` normal traffic is measured before the overload, and a policy that sheds
        it is not driven into overload (its overload figures stay empty)."""
        factor = factor or self.factor
        rate = round(self.capacity * factor, 1)
        empty = nothing_sent(rate)
        if not self.prober.load(candidate):
            point = OverloadPoint(
                candidate,
                rate,
                empty,
                empty,
                None,
                False,
                f"did not load: {self.prober.load_errors[candidate.key]}",
            )
            self.points.append(point)
            return point
        if normal_first and factor == self.factor:
            shed = self._normal_traffic(candidate)
            if shed:
                point = OverloadPoint(candidate, rate, empty, empty, None, False,
                                      "; ".join(shed) + " (the overload was not run)", sheds_normal_traffic=True,
                                      capacity_rps=self.capacity)
                self.points.append(point)
                self.prober.say(f"normal traffic shed, overload not run: {candidate.label}")
                return point
        self.prober.say(f"overload {rate:.0f}/s ({factor:g} x capacity): {candidate.label}")
        trace = self._trace(rate)
        over, rec = trace.phase_stats(OVERLOAD_PHASE, self.slo_ms), trace.phase_stats(RECOVERY_PHASE, self.slo_ms)
        if drive_again(over, rate, self.prober.best_valid_send_rps()):
            self.prober.say(f"overload run not driven as offered ({over.send_rps:.0f}/s sent): again")
            trace = self._trace(rate, seed=7)
            over, rec = trace.phase_stats(OVERLOAD_PHASE, self.slo_ms), trace.phase_stats(RECOVERY_PHASE, self.slo_ms)
        recover = trace.recovery(RECOVERY_PHASE, self.slo_ms)
        problems = []
        drive = ""
        if not over.valid:
            gave_up = f", gave up {over.unsent} requests behind" if over.unsent else ""
            drive = f"sent {over.send_rps:.0f}/s, p95 send lag {over.lag_p95_ms:.0f} ms{gave_up}"
            problems.append(f"client could not drive {rate:.0f}/s ({drive})")
        if over.errors or rec.errors:
            problems.append(f"{over.errors + rec.errors} errors besides rejections ({'; '.join(trace.error_samples)})")
        missed = over.valid and over.accepted_p99_ms > self.slo_ms
        if over.accepted_p99_ms > self.slo_ms:
            problems.append(f"accepted p99 {over.accepted_p99_ms:.1f} ms > SLO {self.slo_ms:g} ms")
        if over.goodput_rps < MIN_GOODPUT * self.capacity:
            problems.append(f"goodput {over.goodput_rps:.0f}/s < {MIN_GOODPUT:.0%} of capacity {self.capacity:.0f}/s")
        if recover is None:
            problems.append(f"not recovered {self.recover_s:g} s after the load dropped")
        normal: list[str] = []
        if not problems and factor == self.factor and not normal_first:
            normal = self._normal_traffic(candidate)
            problems += normal
        point = OverloadPoint(candidate, rate, over, rec, recover, not problems, "; ".join(problems), trace,
                              sheds_normal_traffic=bool(normal), capacity_rps=self.capacity,
                              misses_under_overload=missed, drive_problem=drive)
        self.points.append(point)
        verdict = "keeps" if point.meets else "misses"
        self.prober.say(
            f"overload: accepted p99 {over.accepted_p99_ms:.1f} ms, {over.rejected_fraction:.0%} "
            f"rejected, {verdict} the SLO: {candidate.label}"
        )
        return point

    def _normal_traffic(self, candidate: Candidate, rate: float | None = None, *, once_more: bool = False) -> list[str]:
        """At peak x headroom (or ``rate``) the policy may shed a Poisson burst now and then, not more than
        ``MAX_NORMAL_REJECT``, and the p99 of every request, a rejection counted as a miss, meets the SLO.
        ``once_more``: a miss the way a disturbance of the machine misses (``near_miss``, with no more shed than a
        burst's worth) is measured once more, and the repeat counts (noted)."""
        rate = rate or self.headroom_rps
        spec = LoadSpec(rate=rate, requests=self.prober.point_count(rate), warmup_s=self.prober.warmup_s,
                        seed=len(self.points))
        normal = self.prober.measure(spec)
        if (once_more and not within_slo(normal, self.slo_ms) and rejected_share(normal) <= MAX_NORMAL_REJECT
                and near_miss(normal, self.slo_ms, stable=self.prober.stable(normal))):
            windows = "/".join(f"{w:.1f}" for w in normal.window_p99_ms)
            self.notes.append(f"{candidate.label} with its queue policy at {rate:.0f}/s: p99 {normal.p99_ms:.1f} ms "
                              f"(windows {windows} ms) missed as a disturbance does: measured once more, the repeat "
                              "counts")
            normal = self.prober.measure(replace(spec, seed=spec.seed + 3000))
        share = rejected_share(normal)
        if within_slo(normal, self.slo_ms):
            return []
        at = f"at peak x headroom ({rate:.0f}/s)" if rate == self.headroom_rps else f"at {rate:.0f}/s"
        return [
            f"{at}: p99 {normal.p99_ms:.1f} ms with rejections as misses, "
            f"accepted p99 {normal.accepted_p99_ms:.1f} ms, {share:.2%} rejected, {normal.errors} errors"
            + ("" if normal.valid else f" ({normal.invalid_reason})")
            + (" (the server fell behind: more requests waiting than the point allows)" if normal.saturated else "")
        ]

    def _trace(self, rate: float, seed: int = 0) -> Trace:
        # a second at the peak rate first, left out of every figure: a freshly loaded config's first
        # executions are slow (instances starting, connections opening) and are no overload; then the spike's
        # first half second, also left out: the step to the overload rate makes the client open its extra
        # connections, and its sends lagged there (p95 38-64 ms in the first second, 1.5 ms after it, measured
        # at 879/s), which had made every first try of a config "not driven as offered" and cost a second try
        phases = [Phase(self.recover_rps, 1.0), Phase(rate, SPIKE_ONSET_S), Phase(rate, self.overload_s),
                  Phase(self.recover_rps, self.recover_s)]
        # an answer 20 SLOs late is a failure whatever its cause: no need to wait a minute for it
        return run_schedule(self.prober.target, phases, self.prober.workload, seed=seed + len(self.points),
                            timeout_s=max(5.0, 20 * self.slo_ms / 1000))


def timeline(trace: Trace) -> dict[str, np.ndarray]:
    """Per-request send time (s), latency (ms) and outcome, for the report's plot."""
    return {"sent_s": trace.sent_s, "latency_ms": trace.latency_ms, "outcome": trace.outcome}
