"""The search: from an execution-time profile to a measured choice, inside a time budget.

1. **Structures.** From the profile (``candidates.structures``): max batch sizes where the cost per
   request still drops, instance counts 1 and 2 (and the current ones), pruned when they cannot meet
   the SLO or carry peak × headroom, best predicted first. The current config and plain
   ``dynamic_batching {}`` are always measured.
2. **Levels.** Each candidate is measured at peak × headroom first (the level most candidates fail, and
   the shortest to measure), then peak; the first failed level ends it. Low traffic is measured only where
   it can decide: for the structure whose queue delay is searched, and for a finalist in its confirmation
   rounds, after its busy levels (``_confirm``); one that misses it leaves the choice. A point at low
   traffic is the longest to measure (at 50/s a point takes seconds that one at 400/s does not), and
   without a queue delay it rarely separates structures.
3. **Queue delay.** For the best structure that passed the busy levels and low traffic with no delay,
   the delay is searched against the low-traffic SLO by bisection between 0 and the room the zero-delay
   p99 leaves under ``DELAY_SHARE`` of the SLO, instead of a fixed grid; the largest passing delay and a
   third of it become candidates (and, when the profile says a smaller batch is already cheap, the
   largest delay with that size preferred, measured after the capacities below). A delay shorter than the
   mean gap between requests at peak is not measured: it gathers less than one more request into a batch
   (``_shortest_delay_ms``).
   When no candidate at the best capacity keeps its p99 at peak x headroom within ``PEAK_MARGIN`` of
   the SLO, short delays are tried on that structure too: at a busy rate a delay fills batches and can lower
   the peak's p99. First the delay the profile gives for the best capacity (``Profile.busy_delay_ms``: a
   batch ready just as an instance frees), then a half of the room the whole SLO leaves at low traffic; the
   first that brings it within the margin is measured further, one that does not ends at that point.
   When one keeps the margin, the busy delay alone is tried, for capacity: measured further where it lowers
   the p99 at peak x headroom, then at the ladder's rate above the best capacity, and climbed only where it
   meets the SLO there (``_peak_delays``).
4. **Capacity.** Candidates that met the busy levels climb a common ladder of rates above peak ×
   headroom (×1.25 a step) until the SLO breaks; one whose capacity bound cannot beat the best measured
   capacity is skipped.
5. **Finalists** (within one ladder step of the best) are measured once more, interleaved from the config measured
   last, at the best capacity; a finalist that misses it loses that step. Then each must *hold*
   over ``CONFIRM_ROUNDS`` rounds at every level (its search point, then rounds interleaved with the
   finalists confirmed with it, fresh arrivals each): at low traffic and at peak every round meets the SLO
   on its own, judged strictly (the worst round decides); a re-measure or such a round that missed the way a
   disturbance of the machine does is measured once more, once per finalist, and the repeat counts
   (``DISTURBANCE_REPEATS``; the miss stays in the record); at peak x headroom, trm's margin above the asked
   peak, the rounds are pooled: at most ``HEADROOM_LATE_SHARE`` of all their requests past the SLO (one
   round's p99 there is within its sampling error of the SLO for every candidate worth choosing). Its
   low-traffic point, if the search did not measure one, is measured in its first round, after the busy
   levels. The finalists that kept the best capacity are confirmed first: one a
   step below cannot win while one of them holds. While none holds, the other finalists, then the next
   candidates by capacity are tried.
   Among those that hold, the highest capacity; at equal capacity those that kept p99 within ``PEAK_MARGIN``
   of the SLO at peak x headroom in every round (a margin is not bought with a ladder step of capacity: the
   next step down carries a fifth less); a lower worst-round p99 at peak x headroom wins a tie only if lower
   by more than the noise seen between repeats, or lower at peak and at peak x headroom in every round
   (``_lower_in_every_round``); otherwise the simplest wins (the current config, then smaller delay, no
   preferred sizes, fewer instances, smaller batch). Every round is in the record.

The finalists' rounds are budgeted first: the steps before them leave ``confirm_reserve_s`` of the
budget, so the rounds are not what a long search runs out of time for.

Steps 1–2 for the current config, plain batching and the top structure always run; then the structure
predicted to carry the most, and more until one meets the busy levels; the delay search on the
structure predicted to carry the most, the capacities of what met the busy levels, the remaining
structures (each climbing when it meets them), each only while the budget allows; what was skipped is
said in ``notes``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repo_manager.ops.tuning.candidates import Candidate, Profile, Pruned, preferred_sizes, structures
from repo_manager.ops.tuning.prober import LOAD_S, SUPERSEDED, Point, Prober, config_cost_s, near_miss

LEVELS = ("low", "peak", "headroom")
NOT_ROUNDS = ("remeasure", SUPERSEDED)
"""Point levels that are not a round at a level: a finalist's re-measure at the best capacity, a superseded miss."""
ALWAYS_MEASURED = 3
"""Configs every search measures at every level they meet: the current one, plain batching, the top structure."""
STEP = 1.25
CONFIRM_ROUNDS = 3
"""Rounds at every level a finalist must hold before it can be chosen (at low traffic, while a round there was past
``LOW_MARGIN`` of the SLO; within it one round holds): its search measurement, then rounds measured
interleaved with the other finalists (fresh arrivals: a new seed and a new load run each), without the search's
second chance for a near miss (one repeat per finalist instead: ``DISTURBANCE_REPEATS``); at low traffic and peak
each is judged on its own and the worst round decides, at peak x headroom the rounds are pooled
(``HEADROOM_LATE_SHARE``)."""
HEADROOM_LATE_SHARE = 0.01
"""At peak x headroom (the busiest level, trm's margin above the asked peak) a finalist holds when at most this
share of all the requests of its rounds there were past the SLO: the rounds are pooled there, where at low traffic
and at peak every round must meet the SLO on its own. One round's p99 over about a thousand requests is its tenth
slowest answer, give or take three (sampling alone), and at peak x headroom the candidates worth choosing sit a
few milliseconds under the SLO: on the tuning check's model (6 ms + 0.75 ms per item under 25 ms) max batch 8
measured 20.3, 23.7 and 25.1 ms in three rounds at 480/s, lost the choice on the last one, and max batch 4 was
chosen, a fifth less capacity. A round with several percent late (a disturbance of the machine) still breaks
the pool; one measured as not offered, saturated or unstable breaks it whatever its share."""
DISTURBANCE_REPEATS = 1
"""Strict measurements of a finalist (a re-measure at the best capacity, a round at low traffic or at peak) that
may be measured once more when they miss the SLO the way a disturbance of the machine does (``prober.near_miss``:
within ``NEAR_MISS`` of the SLO, or some window of a stable point within it); the repeat counts, the miss stays in
the record (``Prober.supersede``). Once per finalist: a config at its edge misses the repeat or another round, and
the pooled level above peak (``HEADROOM_LATE_SHARE``) keeps its own rule. Measured in bench runs on the tuning
check's model: max batch 8, 19-21 ms at peak in its other rounds, missed one round at 31.4 ms, and another run's
re-measure at 600/s at 44.4 ms (22.2 ms in the next); each time max batch 16 was chosen, and the independent load
put it a ladder step (10-17 %) under the grid's best in two rounds of three."""
PEAK_MARGIN = 0.8
"""At peak x headroom a finalist's worst round must be within this share of the SLO: the busiest level
keeps room for a busier minute, or a measurement on another machine, than its rounds saw."""
LOW_MARGIN = 0.8
"""At low traffic a finalist is measured in further rounds only while a round there was past this share of the
SLO: where requests rarely queue, the p99 is the mechanism's own (the queue delay, then a small batch's execution)
and varies little between rounds; a round more there is the longest point to measure (300 requests: 6 s at 50/s,
7.5 s at 40/s). On the tuning check's model (SLO 25 ms at 50/s) the finalists' low-traffic rounds measured
12.6 / 12.6 / 12.7 ms without a delay and 16.7 / 16.8 / 16.6 ms with a 6.2 ms delay (bench run 7), and no
low-traffic point of a config measured at 17 ms or less in its first round was past 20.5 ms in seven bench runs
(four such rounds and a reload for one were 26 s of that run's 192 s)."""
DELAY_SHARE = 0.5
"""A queue delay may bring the low-traffic p99 up to this share of the SLO, no further: at low traffic
nearly every request waits the whole delay, and a delay that spends the whole SLO there leaves nothing
for a busier minute (at 0.9, two runs on one model picked 2.4 and 13.8 ms under a 40 ms target)."""


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    levels: dict[str, Point | None]
    capacity_rps: float | None
    """Largest ladder rate that met the SLO (None: it missed a level, or was not climbed)."""
    capacity_note: str = ""
    climbed_rps: float | None = None
    """The ladder's largest rate that met the SLO before the finalists' re-measure (which may take a step off
    ``capacity_rps``); None where it did not climb."""

    @property
    def eligible(self) -> bool:
        return all(p is not None and p.meets_slo for p in self.levels.values())

    @property
    def missed_rps(self) -> float | None:
        """The lowest busy rate (peak, peak x headroom) at which it was measured, as offered, to miss the SLO; None if
        it missed none (a config that did not load, or a point the client could not drive, measured nothing)."""
        return min((p.rate for level, p in self.levels.items() if level != "low" and p is not None
                    and not p.meets_slo and p.measurement is not None and p.measurement.valid), default=None)

    def closeness(self) -> tuple[int, float]:
        """For "closest" when nothing passes: more levels met, then the smallest worst p99."""
        measured = [p for p in self.levels.values() if p is not None]
        worst = max((p.p99_ms for p in measured), default=float("inf"))
        return (-sum(p.meets_slo for p in measured), worst)

    def to_dict(self) -> dict[str, Any]:
        return {**self.candidate.to_dict(), "eligible": self.eligible, "capacity_rps": self.capacity_rps,
                "climbed_rps": self.climbed_rps, "capacity_note": self.capacity_note,
                "levels": {k: (p.to_dict() if p else None) for k, p in self.levels.items()}}


@dataclass(frozen=True)
class Outcome:
    profile: Profile
    evaluations: tuple[Evaluation, ...]
    pruned: tuple[Pruned, ...]
    points: tuple[Point, ...]
    chosen: Candidate | None
    closest: Candidate | None
    noise: float
    """Largest relative p99 spread between repeats of one finalist."""
    evidence: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def evaluation(self, key: str) -> Evaluation:
        return next(e for e in self.evaluations if e.candidate.key == key)


def _simplicity(candidate: Candidate) -> tuple:
    return (candidate.origin != "current", candidate.delay_us, len(candidate.preferred), candidate.instances,
            candidate.max_batch_size)


class Search:
    def __init__(self, prober: Prober, profile: Profile, current: Candidate, slo_ms: float, low: float,
                 peak: float, headroom: float) -> None:
        self.prober, self.profile, self.current, self.slo_ms = prober, profile, current, slo_ms
        self.rates = {"low": low, "peak": peak, "headroom": peak * headroom}
        self.candidates: dict[str, Candidate] = {}
        self.notes: list[str] = []
        self.capacity: dict[str, float] = {}
        self.capacity_notes: dict[str, str] = {}
        self.climbed: dict[str, float] = {}
        """Each ladder's own figure, kept when the finalists' re-measure takes a step off ``capacity``."""
        self.deferred: list[Candidate] = []

    # ------------------------------------------------------------------------------------ helpers
    def _add(self, candidate: Candidate) -> Candidate:
        return self.candidates.setdefault(candidate.key, candidate)

    def _cost(self, levels: int = 3) -> float:
        return config_cost_s(self.prober.point_cost_s, list(self.rates.values())[:levels])

    def _level_point(self, candidate: Candidate, level: str) -> Point | None:
        rate = self.rates[level]
        return next((p for p in self.prober.points
                     if p.candidate == candidate.key and p.rate == rate and p.level not in NOT_ROUNDS),
                    None)

    def evaluate(self, candidate: Candidate) -> bool:
        """Measure the busy levels, headroom then peak; stop at the first miss. True if both met (low traffic
        is measured where it can decide: ``meets_low``)."""
        self._add(candidate)  # all() stops at the first miss
        return all(self.prober.point(candidate, level, self.rates[level]).meets_slo for level in ("headroom", "peak"))

    def meets_low(self, candidate: Candidate) -> bool:
        """Measure ``candidate`` at low traffic (once: the point is kept) and say whether it met the SLO."""
        self._add(candidate)
        return self.prober.point(candidate, "low", self.rates["low"]).meets_slo

    def _met_busy(self, candidate: Candidate) -> bool:
        """Met the SLO at peak x headroom and at peak (its low-traffic point may not be measured yet)."""
        return all(p is not None and p.meets_slo for p in (self._level_point(candidate, "headroom"),
                                                            self._level_point(candidate, "peak")))

    def confirm_reserve_s(self) -> float:
        """Budget the steps before the finalists leave for them: two finalists' low-traffic points, their
        re-measure at the best capacity, their ``CONFIRM_ROUNDS`` - 1 further rounds at every level and their repeats
        for a disturbance (``DISTURBANCE_REPEATS``)."""
        remeasure = 2 * (self.prober.point_cost_s(self.rates["headroom"] * STEP) + LOAD_S)
        repeats = DISTURBANCE_REPEATS * (self.prober.point_cost_s(self.rates["peak"]) + LOAD_S)
        return 2 * ((CONFIRM_ROUNDS - 1) * self._cost() + self.prober.point_cost_s(self.rates["low"]) + remeasure
                    + repeats)

    # ------------------------------------------------------------------------------------ phases
    def run(self) -> Outcome:
        need = self.rates["headroom"]
        kept, pruned = structures(self.profile, self.current, self.slo_ms, need)
        plain = Candidate(self.current.max_batch_size, self.current.instances, True, 0, (), "plain")
        mandatory = [self.current, plain] + kept[:1]  # (ALWAYS_MEASURED: what the budget check counts)
        with self.prober.holding_back(self.confirm_reserve_s()):
            self._explore(kept, pruned, mandatory)
        chosen, noise, evidence = self._finalists()
        evaluations = tuple(self._evaluation(c) for c in self.candidates.values())
        pruned = [p for p in pruned if p.candidate.key not in self.candidates]  # measured after all
        closest = None
        if chosen is None and evaluations:
            closest = min(evaluations, key=Evaluation.closeness).candidate
        return Outcome(self.profile, evaluations, tuple(pruned), tuple(self.prober.points), chosen, closest,
                       noise, evidence, tuple(self.notes))

    def _explore(self, kept: list[Candidate], pruned: list[Pruned], mandatory: list[Candidate]) -> None:
        """Steps 1-4: the structures, the queue delay, the capacities (the finalists' budget held back); what the
        budget leaves unmeasured is added to ``pruned``."""
        for candidate in mandatory:
            self.evaluate(candidate)
        # until a structure meets every level, measure the next; then search its delay (the step that
        # most often moves capacity) before spending the budget on the remaining structures
        # the top structure is the simplest sufficient one; the one predicted to carry the most is
        # measured next, and more until one meets every level; then the best one's delay is searched
        rest = list(kept[1:])
        if rest and self.prober.can_afford(self._cost()):
            self.evaluate(rest.pop(0))
        while rest and not any(self._met_busy(c) for c in kept) and self.prober.can_afford(self._cost()):
            self.evaluate(rest.pop(0))
        self._delay_search(sorted(kept, key=lambda c: -self.profile.slo_capacity(c.max_batch_size, c.instances,
                                                                                  self.slo_ms)))
        # capacity decides the choice, so the eligible ones climb before the remaining structures run
        self._capacities()
        for candidate in rest + self.deferred:
            if self._evaluation(candidate).levels["headroom"] is not None:
                continue
            if self.prober.can_afford(self._cost()):
                self.evaluate(self._add(candidate))
                self._capacities()
            else:
                pruned.append(Pruned(candidate, "not measured: time budget"))
        self._peak_delays()

    def _delay_search(self, kept: list[Candidate]) -> None:
        passing = [c for c in kept if self._met_busy(c)]
        if not passing:
            self.notes.append("delay search skipped: no structure met the busy levels without a delay")
            return
        base = passing[0]
        if not self.meets_low(base):
            self.notes.append(f"delay search skipped: {base.label} misses the SLO at low traffic without a delay")
            return
        zero = self._level_point(base, "low")
        assert zero is not None
        # a delay longer than a full batch takes to arrive at the peak rate cannot fill batches further
        fill_ms = 1000.0 * base.max_batch_size / self.rates["peak"]
        room_ms = min(self.slo_ms * DELAY_SHARE - zero.p99_ms, fill_ms)
        if room_ms < self._shortest_delay_ms():
            short = (f", shorter than the {self._shortest_delay_ms():.1f} ms a delay needs to gather one more request "
                     "at peak") if room_ms > 0 else ""
            self.notes.append(f"delay search skipped: {base.label} leaves {max(room_ms, 0.0):.1f} ms of low-traffic "
                              f"p99 room under {DELAY_SHARE:.0%} of the SLO{short}")
            return
        low_cost = self.prober.point_cost_s(self.rates["low"]) + LOAD_S
        lo, hi = 0.0, room_ms
        trial = hi
        for _ in range(2):  # the room itself, then halfway: finer steps cost more than they change
            if trial < self._shortest_delay_ms():
                break
            if not self.prober.can_afford(low_cost + self._cost(2)):
                self.notes.append("delay search cut short: time budget")
                if lo <= 0:
                    return
                break
            candidate = self._add(base.with_delay(int(trial * 1000)))
            point = self.prober.point(candidate, "low", self.rates["low"])
            if point.meets_slo and point.p99_ms <= self.slo_ms * DELAY_SHARE:
                lo = trial
                if trial == hi:
                    break
            else:
                hi = trial
            trial = (lo + hi) / 2
        if lo <= 0:
            self.notes.append(f"delay search: every delay tried took the low-traffic p99 past {DELAY_SHARE:.0%} of the "
                              f"SLO for {base.label}")
            return
        found = base.with_delay(int(lo * 1000))
        # the largest delay the low-traffic SLO allows is not always the one that carries the most: with
        # several instances a shorter wait already fills batches and leaves more room under load, so a
        # third of it is measured too (first: at peak it is the likelier of the two to pass)
        for candidate in (base.with_delay(int(lo * 1000 / 3)), found):
            if candidate.delay_us >= int(self._shortest_delay_ms() * 1000) and self.prober.can_afford(self._cost()):
                self.evaluate(self._add(candidate))
        useful = [b for b in preferred_sizes(self.profile, base.max_batch_size) if b < base.max_batch_size]
        if useful:  # measured with the remaining structures, after the capacities
            self.deferred.append(Candidate(base.max_batch_size, base.instances, True, found.delay_us,
                                           (useful[-1],), "search"))

    def _peak_delays(self) -> None:
        """Queue delays for the busy levels, on the structure with the best measured capacity (and no delay), one
        already measured at low traffic first (it spares that point, 6 s at 50/s), then the one with the lowest p99
        at peak x headroom. The low-traffic search above does not try them when a delay would take the low-traffic
        p99 past ``DELAY_SHARE`` of the SLO; here they stay within the room the whole SLO leaves at low traffic (at
        most the time a full batch takes to arrive at peak). At a busy rate a short delay fills batches that would
        otherwise leave one by one, and fewer, fuller executions drain the queue sooner (the independent check's
        model: 2 ms took p99 at 400/s from about 22 to about 10 ms).

        * **For the margin**: when no candidate at the best capacity keeps its p99 at peak x headroom within
          ``PEAK_MARGIN`` of the SLO, the profile's delay for a busy batcher at the best capacity
          (``Profile.busy_delay_ms``; a quarter of the room where the profile gives none within it), then a half
          of the room. The margin is sought where it costs no capacity (on a structure a ladder step below, a
          delay that kept it would not be chosen: ``_finalists``). Each is measured at peak x headroom first, for
          what it is tried for: one that does not bring the p99 there within the margin is measured no further
          (its low-traffic point and ladder would cost about 20 s on the check's model and could not change the
          choice's margin); the first that does is measured at peak and climbed, and the longer one is then not
          tried (it would only add latency at low traffic).
        * **For capacity**: when one keeps the margin and the base was measured at low traffic already, the busy
          delay alone, measured further only where it lowers the p99 at peak x headroom below the base's, then at
          the ladder's rate above the best capacity (not the rates below it), and measured at peak and climbed only
          where it meets the SLO there: at equal capacity the simpler config would win (``_finalists``), and its
          rounds as a finalist would cost about 20 s for nothing. On the check's model a delay in the busy delay's
          band (3.5-4.7 ms) carried at least as much as no delay in every round side by side, and the grid's best
          config has one."""
        top, best = self._at_best_capacity([c for c in self.candidates.values() if self._met_busy(c)])
        if not best:
            return
        base = min((c for c in best if c.delay_us == 0),
                   key=lambda c: (self._level_point(c, "low") is None, self._worst_headroom_p99(c)), default=None)
        for_margin = not any(self._worst_headroom_p99(c) <= self.slo_ms * PEAK_MARGIN for c in best)
        # for capacity alone a low-traffic point (the room a delay has there) is not worth measuring for it
        if base is None or (not for_margin and self._level_point(base, "low") is None) or not self.meets_low(base):
            return
        zero = self._level_point(base, "low")
        assert zero is not None
        room_ms = min(self.slo_ms - zero.p99_ms, 1000.0 * base.max_batch_size / self.rates["peak"])
        busy_ms = self.profile.busy_delay_ms(base.max_batch_size, base.instances, top)
        has_busy = busy_ms is not None and busy_ms < room_ms
        if for_margin:
            first_ms = busy_ms if has_busy else room_ms / 4
            delays = [first_ms] + ([room_ms / 2] if room_ms / 2 > first_ms else [])
            bar_ms, bar = self.slo_ms * PEAK_MARGIN, f"within {PEAK_MARGIN:.0%} of the SLO"
        elif has_busy:
            delays = [busy_ms]
            bar_ms = self._worst_headroom_p99(base) - 1e-9
            bar = f"under the {bar_ms:.1f} ms of the same structure without it"
        else:
            return
        tried = []
        for delay_ms in delays:
            delay_us = int(delay_ms * 1000)
            if delay_us < int(self._shortest_delay_ms() * 1000) or not self.prober.can_afford(self._cost()):
                continue
            candidate = self._add(base.with_delay(delay_us))
            headroom = self.prober.point(candidate, "headroom", self.rates["headroom"])
            if not headroom.meets_slo or headroom.p99_ms > bar_ms:
                tried.append(f"{candidate.label} (p99 {headroom.p99_ms:.1f} ms at peak x headroom, not {bar}: "
                             "measured no further)")
                continue
            tried.append(candidate.label)
            if for_margin:
                self.evaluate(candidate)
                self._capacities()
                break
            # for capacity it is measured first where it can decide: the ladder's rate above the best capacity
            above = self._rate_above(top)
            if not self.prober.point(candidate, "capacity", above).meets_slo:
                tried[-1] += f" (missed {above:.0f}/s, a step above the best capacity: measured no further)"
            elif self.evaluate(candidate):
                self.capacity[candidate.key] = self.climbed[candidate.key] = self.climb(candidate, carries=above)
            break
        if tried:
            why = (f"no eligible candidate kept p99 at peak x headroom within {PEAK_MARGIN:.0%} of the SLO"
                   if for_margin else "a queue delay for a busy batcher")
            self.notes.append(f"{why}: tried queue delays on {base.label}: {'; '.join(tried)}")

    def _shortest_delay_ms(self) -> float:
        """The shortest queue delay worth measuring: the mean gap between requests at peak (at least 0.5 ms). A
        shorter delay gathers less than one more request into a batch on average, and at low traffic it only adds
        its wait (on the tuning check's model the room for one was 0.9 ms at 400/s: two low-traffic points, 20 s,
        for delays that gathered a third of a request)."""
        return max(0.5, 1000.0 / self.rates["peak"])

    def _at_best_capacity(self, candidates: list[Candidate]) -> tuple[float, list[Candidate]]:
        """The best capacity among ``candidates`` (0 for one not climbed) and the candidates that reached it."""
        top = max((self.capacity.get(c.key, 0.0) for c in candidates), default=0.0)
        return top, [c for c in candidates if self.capacity.get(c.key, 0.0) >= top * 0.999]

    def _capacities(self) -> None:
        """Climb every candidate that met the busy levels and has no capacity yet, best predicted first."""
        eligible = [c for c in self.candidates.values() if c.key not in self.capacity and self._met_busy(c)]
        eligible.sort(key=lambda c: -self.profile.slo_capacity(c.max_batch_size, c.instances, self.slo_ms))
        best = max(self.capacity.values(), default=0.0)
        for candidate in eligible:
            if self.profile.capacity_bound(candidate.max_batch_size, candidate.instances) < best:
                self.capacity[candidate.key] = self.rates["headroom"]
                self.capacity_notes[candidate.key] = "ladder skipped: capacity bound below the best measured"
                continue
            best = max(best, self.climb(candidate))

    def _ladder(self) -> Iterator[float]:
        """The capacity ladder: the rates above peak x headroom, each ``STEP`` x the one below (to 0.1/s)."""
        rate = self.rates["headroom"]
        while True:
            rate *= STEP
            yield round(rate, 1)

    def _rate_above(self, capacity: float) -> float:
        """The ladder's first rate above ``capacity``."""
        return next(rate for rate in self._ladder() if rate > capacity * 1.001)

    def climb(self, candidate: Candidate, max_steps: int = 8, *, carries: float | None = None) -> float:
        """Capacity of a candidate that met the busy levels: the ladder above peak x headroom until the SLO
        breaks; above ``carries`` where the candidate met the SLO at that ladder rate already."""
        capacity = self.rates["headroom"]
        ladder = self._ladder()
        rate = next(ladder)
        while carries is not None and rate <= carries * 1.001:
            capacity, rate = rate, next(ladder)
        for _ in range(max_steps):
            if not self.prober.can_afford(self.prober.point_cost_s(rate) + LOAD_S):
                self.capacity_notes[candidate.key] = "ladder stopped: time budget"
                break
            point = self.prober.point(candidate, "capacity", rate)
            if not point.meets_slo:
                if point.measurement is not None and not point.measurement.valid:
                    self.capacity_notes[candidate.key] = (f"client limit at {rate:.0f}/s: capacity is at "
                                                          f"least {capacity:.0f}/s")
                break
            capacity, rate = rate, next(ladder)
        self.capacity[candidate.key] = self.climbed[candidate.key] = capacity
        return capacity

    def _drop_those_that_missed_low(self) -> None:
        """A candidate measured to miss the SLO at low traffic (the delay search's base) leaves the choice: its
        capacity is dropped, which may bring the next one within a step. The other candidates are measured at
        low traffic in their confirmation rounds, after their busy levels and re-measure (``_confirm``): a
        contender's low-traffic point (about 10 s on the check's model, the longest point) measured before them was
        spent for nothing in the last two runs there: the re-measure took one contender a step down, and the
        other broke its first confirmation round."""
        for key in [k for k in self.capacity if self._misses_low(self.candidates[k])]:
            del self.capacity[key]

    def _best_that_meets_low(self) -> list[Candidate]:
        """When no candidate held: the candidates at the best capacity that met the SLO at low traffic, measuring
        it for those not measured there yet (whatever the budget: no candidate is chosen unmeasured at a level);
        where all of them miss it, the next capacity down. Empty when every candidate that climbed missed it."""
        while True:
            self._drop_those_that_missed_low()
            if not self.capacity:
                return []
            _, tier = self._at_best_capacity([self.candidates[k] for k in self.capacity])
            for candidate in tier:
                if self._level_point(candidate, "low") is None:
                    self.meets_low(candidate)
            met = [c for c in tier if not self._misses_low(c)]
            if met:
                return met

    def _misses_low(self, candidate: Candidate) -> bool:
        point = self._level_point(candidate, "low")
        return point is not None and not point.meets_slo

    def _finalists(self) -> tuple[Candidate | None, float, dict[str, str]]:
        self._drop_those_that_missed_low()
        if not self.capacity:
            return None, 0.0, {}
        best = max(self.capacity.values())
        ranked = sorted(self.capacity, key=lambda k: -self.capacity[k])  # stable: measured order breaks ties
        finalists = [self.candidates[k] for k in ranked if self.capacity[k] * STEP > best * 1.001][:3]
        runs: dict[str, list[Point]] = {c.key: [p for p in self.prober.points
                                                if p.candidate == c.key and abs(p.rate - best) < 0.05]
                                        for c in finalists}
        if len(finalists) > 1:
            # one round, interleaved (a slow minute of the machine hits everyone), from the config measured last (no
            # reload), and the confirmation rounds start where it ends: with its climb point, each finalist's
            # capacity rests on two measurements at the best rate, and its rounds at every level follow
            last = self.prober.points[-1].candidate if self.prober.points else None
            finalists.sort(key=lambda c: c.key != last)
            for candidate in finalists:
                if self.prober.can_afford(self.prober.point_cost_s(best) + LOAD_S):
                    runs[candidate.key].append(self._strict(candidate, "remeasure", best))
                elif "re-measure cut short: time budget" not in self.notes:
                    self.notes.append("re-measure cut short: time budget")
            finalists.reverse()
        noise = 0.0
        for points in runs.values():
            values = [p.p99_ms for p in points if p.measurement is not None and p.measurement.valid]
            if len(values) > 1 and min(values) < float("inf"):
                noise = max(noise, (max(values) - min(values)) / (sum(values) / len(values)))
        confirmed = {c.key: (best if runs[c.key] and all(p.meets_slo for p in runs[c.key]) else
                             (self.capacity[c.key] if self.capacity[c.key] < best else best / STEP))
                     for c in finalists}
        for key, capacity in confirmed.items():
            self.capacity[key] = round(capacity, 1)
        # every level, in rounds: the finalists that kept the best capacity first (one a step below cannot win
        # while one of them holds), then the other finalists, then (while none holds the SLO) the next by capacity
        held, tried = [], set()
        _, batch = self._at_best_capacity(finalists)
        while batch and not held:
            completed = self._confirm_those_that_can_win(batch)
            tried |= {c.key for c in batch}
            held = [c for c in batch if self._holds(c, margin=False)]
            rest = [c for c in finalists if c.key not in tried] or \
                [self.candidates[k] for k in ranked if k not in tried][:3]
            batch = rest if completed else []
        if not held:
            self.notes.append("no candidate held every level in every round measured: chosen on the search's "
                              "measurements, as the record shows")
            held = self._best_that_meets_low()
            if not held:
                return None, noise, {}
        top, group = self._at_best_capacity(held)
        # the margin decides among equal capacities; a ladder step of capacity (a fifth) is not given for it
        with_margin = [c for c in group if self._holds(c)]
        if with_margin:
            group = with_margin
        elif held:
            worst = min(self._worst_headroom_p99(c) for c in group)
            self.notes.append(f"no candidate at the best capacity kept p99 at peak x headroom within {PEAK_MARGIN:.0%} "
                              f"of the SLO in every round (best worst round {worst:.1f} ms): chosen for capacity, "
                              "since the candidates that keep the margin carry a ladder step (a fifth) less")

        simplest = min(group, key=_simplicity)
        fastest = min(group, key=self._worst_headroom_p99)
        chosen = simplest
        why = f"simplest of {len(group)} candidate(s) tied at {top:.0f}/s within noise {noise:.0%}"
        worst_simplest, worst_fastest = self._worst_headroom_p99(simplest), self._worst_headroom_p99(fastest)
        if fastest is not simplest and worst_simplest - worst_fastest > noise * worst_simplest:
            chosen = fastest
            why = (f"worst-round p99 at peak x headroom {worst_fastest:.1f} ms vs {worst_simplest:.1f} ms, a "
                   f"difference beyond the measured noise {noise:.0%}")
        elif fastest is not simplest and self._lower_in_every_round(fastest, simplest):
            chosen = fastest
            rounds = min(len(self._rounds(fastest)[level]) for level in ("headroom", "peak"))
            why = (f"p99 lower than {simplest.label} at peak and at peak x headroom in each of {rounds} rounds "
                   f"(worst round at peak x headroom {worst_fastest:.1f} ms vs {worst_simplest:.1f} ms): a "
                   "consistent difference, not noise")
        return chosen, noise, self._evidence(chosen, top, why)

    def _lower_in_every_round(self, candidate: Candidate, other: Candidate) -> bool:
        """``candidate``'s p99 was below ``other``'s in every round at both busy levels, pair by pair, over at
        least ``CONFIRM_ROUNDS`` rounds: the first pair is the search's own points, and each later pair saw the same
        minutes of the machine (the confirmation rounds are interleaved). Two configs that perform the same do
        that by chance once in 2^6 = 64 (more often when more are tied, since the lowest is the one compared).
        The spread between repeats at the best capacity (``noise``) is no measure of it: one repeat past the knee
        of the curve or one disturbed minute makes that spread large (on the tuning check's model a 2.5 ms delay
        was 1.4-2.0 ms below no delay in each of six pairs, and a disturbed repeat put the noise at 90 %)."""
        mine, theirs = self._rounds(candidate), self._rounds(other)
        pairs = [(a.p99_ms, b.p99_ms) for level in ("headroom", "peak") for a, b in zip(mine[level], theirs[level])]
        rounds = min(len(mine[level]) for level in ("headroom", "peak"))
        return rounds >= CONFIRM_ROUNDS and all(a < b for a, b in pairs) and len(pairs) >= 2 * CONFIRM_ROUNDS

    def _rounds(self, candidate: Candidate) -> dict[str, list[Point]]:
        """Every measurement of ``candidate`` at each level: its search point, then its confirmation rounds."""
        return {level: [p for p in self.prober.points if p.candidate == candidate.key and p.rate == self.rates[level]
                        and p.level not in NOT_ROUNDS] for level in LEVELS}

    def _holds(self, candidate: Candidate, *, margin: bool = True) -> bool:
        """Met the SLO at low traffic and at peak in every round measured, and at peak x headroom over its rounds
        pooled (``_holds_headroom``); with ``margin``, p99 within ``PEAK_MARGIN`` of the SLO at peak x headroom in
        every round."""
        rounds = self._rounds(candidate)
        if not all(rounds[level] and all(p.meets_slo for p in rounds[level]) for level in ("low", "peak")):
            return False
        if margin:
            return bool(rounds["headroom"]) and self._kept_margin(candidate)
        return self._holds_headroom(candidate)

    def _kept_margin(self, candidate: Candidate) -> bool:
        """Every round of ``candidate`` at peak x headroom so far met the SLO within ``PEAK_MARGIN`` of it."""
        limit = self.slo_ms * PEAK_MARGIN
        return all(p.meets_slo and p.p99_ms <= limit for p in self._rounds(candidate)["headroom"])

    def _holds_headroom(self, candidate: Candidate) -> bool:
        """At peak x headroom, the rounds measured so far pooled: every one measured as offered, and at most
        ``HEADROOM_LATE_SHARE`` of all their requests past the SLO (a failure or rejection counts as late)."""
        late, total = self._headroom_late(candidate)
        return total > 0 and late <= HEADROOM_LATE_SHARE * total

    def _headroom_late(self, candidate: Candidate) -> tuple[int, int]:
        """Requests past the SLO and requests in all, over the rounds at peak x headroom; (0, 0) when a round was not
        measured as offered, saturated the server, measured nothing or was unstable (a growing queue): such a round
        is a miss that no pool can make up for."""
        points = self._rounds(candidate)["headroom"]
        if any(p.measurement is None or not p.measurement.valid or p.measurement.saturated or not p.stable
               or not len(p.measurement.latencies_ms) for p in points):
            return 0, 0
        late = sum(int(np.count_nonzero(p.measurement.latencies_ms > self.slo_ms)) for p in points)
        return late, sum(len(p.measurement.latencies_ms) for p in points)

    def _worst_headroom_p99(self, candidate: Candidate) -> float:
        return max((p.p99_ms for p in self._rounds(candidate)["headroom"]), default=float("inf"))

    def _confirm_those_that_can_win(self, batch: list[Candidate]) -> bool:
        """``_confirm`` for finalists of equal capacity, those whose rounds so far kept the margin at peak x headroom
        first. The margin decides among equal capacities, so where one of them holds with it, a finalist already past
        the margin cannot be chosen: its rounds are not measured (noted; about 17 s each on the tuning check's model,
        a low-traffic point included, where three finalists kept 750/s and two were past the margin). Where none of
        them holds with it, the others are confirmed too. False when the time budget ended the rounds."""
        first = [c for c in batch if self._kept_margin(c)]
        rest = [c for c in batch if c not in first]
        if not first or not rest:
            return self._confirm(batch)
        completed = self._confirm(first)
        holding = [c for c in first if self._holds(c)]
        if holding:
            self.notes.append(f"{'; '.join(c.label for c in rest)}: not confirmed: past {PEAK_MARGIN:.0%} of the SLO "
                              f"at peak x headroom, where {holding[0].label} held within it at the same capacity")
            return completed
        completed_rest = self._confirm(rest)
        return completed and completed_rest

    def _confirm(self, candidates: list[Candidate]) -> bool:
        """Up to ``CONFIRM_ROUNDS`` rounds of each candidate at every level (busiest first), interleaved by
        round (every other round in reverse order), each measured with fresh arrivals; one that misses
        (``_missed``: a round at low traffic or peak on its own, peak x headroom pooled) is not measured further.
        A level not measured yet (low traffic) is measured in its turn, with the search's second chance for a near
        miss and whatever the budget (no candidate is chosen unmeasured at a level): after the busy levels, so that
        one that breaks there costs no low-traffic point (the longest to measure); a candidate whose rounds there so
        far kept within ``LOW_MARGIN`` of the SLO gets no further round at low traffic. False when the time budget
        ended the rounds."""
        completed = True
        for round_ in range(CONFIRM_ROUNDS):
            # every other round in reverse: the candidate measured last goes again without a reload
            for candidate in (candidates if round_ % 2 == 0 else candidates[::-1]):
                for level in ("headroom", "peak", "low"):
                    done = len(self._rounds(candidate)[level])
                    if self._missed(candidate) or done >= CONFIRM_ROUNDS:
                        continue
                    if level == "low" and done and self._low_settled(candidate):
                        continue
                    rate = self.rates[level]
                    if not done:
                        self.prober.point(candidate, level, rate)
                        continue
                    if not completed:
                        continue
                    if not self.prober.can_afford(self.prober.point_cost_s(rate) + LOAD_S):
                        self.notes.append("confirmation cut short: time budget")
                        completed = False  # the levels not measured yet are still measured
                        continue
                    if level == "headroom":  # pooled: a disturbed round is diluted there, not measured again
                        self.prober.point(candidate, "confirm", rate, strict=True)
                    else:
                        self._strict(candidate, "confirm", rate)
        return completed

    def _low_settled(self, candidate: Candidate) -> bool:
        """Every round of ``candidate`` at low traffic met the SLO within ``LOW_MARGIN`` of it: no further round there
        is measured."""
        rounds = self._rounds(candidate)["low"]
        return bool(rounds) and all(p.meets_slo and p.p99_ms <= LOW_MARGIN * self.slo_ms for p in rounds)

    def _strict(self, candidate: Candidate, level: str, rate: float) -> Point:
        """A strict point (no second chance in the prober), measured once more where it missed the way a disturbance
        does and ``candidate`` has a repeat left (``DISTURBANCE_REPEATS``) and the budget allows: the repeat counts,
        the miss stays in the record as superseded."""
        point = self.prober.point(candidate, level, rate, strict=True)
        if (point.meets_slo or point.measurement is None
                or len(self._superseded(candidate)) >= DISTURBANCE_REPEATS
                or not near_miss(point.measurement, self.slo_ms, stable=point.stable)
                or not self.prober.can_afford(self.prober.point_cost_s(rate) + LOAD_S)):
            return point
        windows = "/".join(f"{w:.1f}" for w in point.measurement.window_p99_ms)
        self.prober.supersede(point, f"missed at p99 {point.p99_ms:.1f} ms (windows {windows} ms) as a disturbance "
                                     "does: measured once more, the repeat counts")
        return self.prober.point(candidate, level, rate, strict=True)

    def _superseded(self, candidate: Candidate) -> list[Point]:
        """``candidate``'s strict points that a repeat replaced (``_strict``): the record is the one count of them."""
        return [p for p in self.prober.points if p.candidate == candidate.key and p.level == SUPERSEDED]

    def _missed(self, candidate: Candidate) -> bool:
        """Missed the SLO in a round measured at low traffic or at peak, or over the rounds at peak x headroom
        measured so far (``_holds_headroom``). A candidate whose rounds so far are past the share is not measured
        further, though later rounds might have diluted them: the cautious side, which also spares the rounds (and
        the low-traffic point, about 6 s) of a candidate that would need every later round clean to hold."""
        rounds = self._rounds(candidate)
        return (any(not p.meets_slo for level in ("low", "peak") for p in rounds[level])
                or (bool(rounds["headroom"]) and not self._holds_headroom(candidate)))

    def _evidence(self, chosen: Candidate, capacity: float, why: str) -> dict[str, str]:
        p = self.profile
        evidence = {
            "rule": ("highest capacity (largest measured rate with p99 within the SLO) among candidates that met "
                     f"the SLO at low ({self.rates['low']:.0f}/s), peak ({self.rates['peak']:.0f}/s) and "
                     f"peak x headroom ({self.rates['headroom']:.0f}/s); ties within measured noise go to the "
                     "simplest"),
            "choice": f"{chosen.label}: capacity {capacity:.0f}/s; {why}",
            "max_batch_size": (f"{chosen.max_batch_size}: execution {p.exec_at(chosen.max_batch_size):.2f} ms for a "
                               f"full batch ({p.per_request_ms(chosen.max_batch_size):.2f} ms per request vs "
                               f"{p.per_request_ms(1):.2f} ms alone)"),
            "instance_count": f"{chosen.instances}: measured capacities "
                              + ", ".join(f"{k} {v:.0f}/s" for k, v in sorted(self.capacity.items())),
        }
        low = self._level_point(chosen, "low")
        low_text = f"low-traffic p99 {low.p99_ms:.1f} ms" if low else "low-traffic p99 not measured"
        evidence["max_queue_delay_microseconds"] = f"{chosen.delay_us}: {low_text} against the SLO {self.slo_ms:g} ms"
        evidence["preferred_batch_size"] = (f"{list(chosen.preferred)}: cost per request still drops there"
                                            if chosen.preferred else "none: the batcher takes what is queued")
        rounds = self._rounds(chosen)
        late, total = self._headroom_late(chosen)
        held = ("held the SLO in every round measured at low traffic and peak, and at peak x headroom over its rounds "
                f"pooled ({late} of {total} requests past it, at most {HEADROOM_LATE_SHARE:.0%}), "
                + ("within" if self._holds(chosen) else "past") + f" {PEAK_MARGIN:.0%} of it there in every round"
                ) if self._holds(chosen, margin=False) else "did not hold the SLO in every round measured"
        evidence["rounds"] = (
            f"{held}; worst p99 "
            + ", ".join(f"{level} {max(p.p99_ms for p in points):.1f} ms over {len(points)} round(s)"
                        for level, points in rounds.items() if points)
            + (f" (low traffic: no further round within {LOW_MARGIN:.0%} of the SLO there)"
               if len(rounds["low"]) < CONFIRM_ROUNDS and self._low_settled(chosen) else "")
            + "".join(f"; a miss measured once more for a disturbance: {p.note.split(':')[0]} {p.rate:.0f}/s at p99 "
                      f"{p.p99_ms:.1f} ms" for p in self._superseded(chosen)))
        return evidence

    def _evaluation(self, candidate: Candidate) -> Evaluation:
        levels = {level: self._level_point(candidate, level) for level in LEVELS}
        evaluation = Evaluation(candidate, levels, None)
        climbed = self.climbed.get(candidate.key)
        if evaluation.eligible:
            return Evaluation(candidate, levels, self.capacity.get(candidate.key, self.rates["headroom"]),
                              self.capacity_notes.get(candidate.key, ""), climbed)
        if levels["low"] is None and candidate.key in self.capacity:  # climbed, no contender: low not measured
            return Evaluation(candidate, levels, self.capacity[candidate.key],
                              self.capacity_notes.get(candidate.key, ""), climbed)
        return evaluation
