"""The latency gate: the new version and the one it replaces, side by side on one Triton, judged against the
noise of the machine they are measured on.

Rounds interleave the versions (new old, old new, …). In a round the two p99 points (open loop at the spec's
rate) run back to back, then capacity (closed loop) in alternating slices (B A B A …); both versions are
loaded afresh every round. Every round is one sample of how far the new version is from its threshold;
``judge`` turns the samples into a verdict from their own spread (Student's t over the rounds, and a sign
test): ``pass``, ``fail`` beyond the noise, or ``inconclusive`` within it, after measuring again up to
``max_rounds``. docs/promotion.md has the table.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repo_manager.adapters.loadgen import LoadSpec, Measurement, Target, Workload, measure
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core.environments import LatencyGate
from repo_manager.core.progress import Progress
from repo_manager.ops.promote.gates import FetchedVersion, GateResult, loaded, workload_for

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Student's t, 97.5 % one-sided, by degrees of freedom (beyond 10: 2.2, a little wide of the true value)."""
MIN_SAMPLES_TO_BLOCK = 3
"""A difference is called beyond the noise only from at least this many rounds: two cannot show a spread."""


@dataclass(frozen=True)
class Verdict:
    """One metric of the latency gate, judged from paired rounds: ``ratios[k]`` is how far the new version is
    from its threshold in round k (its p99 over the
    p99 limit, or the capacity floor over its capacity; above 1 misses it). ``estimate`` is their geometric
    mean, ``low``..``high`` its 95 % interval from the spread between rounds (the machine's own noise,
    measured in the same minutes)."""

    metric: str
    ratios: tuple[float, ...]
    estimate: float
    low: float
    high: float

    @property
    def sign_p(self) -> float:
        """The chance that this many rounds or more miss the threshold if each were a coin toss (a sign
        test: one wild round cannot hide a miss every other round shows)."""
        n, missed = len(self.ratios), sum(r > 1.0 for r in self.ratios)
        return sum(math.comb(n, k) for k in range(missed, n + 1)) / 2 ** n if n else 1.0

    @property
    def outcome(self) -> str:
        """``meets`` the threshold; ``misses`` it beyond the noise (the interval is above 1, or the rounds miss
        it too consistently for chance); ``within_noise``: misses it, by less than the rounds vary."""
        if self.estimate <= 1.0:
            return "meets"
        if len(self.ratios) >= MIN_SAMPLES_TO_BLOCK and (self.low > 1.0 or self.sign_p < 0.025):
            return "misses"
        return "within_noise"

    @property
    def spread_pct(self) -> float:
        """The half-width of the interval, in percent of the estimate: what this machine's noise allows."""
        return (self.high / self.estimate - 1.0) * 100 if self.estimate > 0 and math.isfinite(self.high) else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "outcome": self.outcome, "ratios": [round(r, 4) for r in self.ratios],
                "estimate": round(self.estimate, 4), "interval": [round(self.low, 4), _finite(self.high)],
                "spread_pct": _finite(self.spread_pct), "rounds_missing": sum(r > 1.0 for r in self.ratios),
                "sign_p": round(self.sign_p, 4)}


def _finite(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def judge(metric: str, ratios: list[float]) -> Verdict:
    """A verdict on paired per-round ratios (above 1: the new version misses its threshold in that round)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    if not logs:
        return Verdict(metric, tuple(ratios), math.inf, 0.0, math.inf)
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return Verdict(metric, tuple(ratios), math.exp(mean), 0.0, math.inf)
    half = T_975.get(len(logs) - 1, 2.2) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Verdict(metric, tuple(ratios), math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def latency_gate(client: TritonClient, new: FetchedVersion, old: FetchedVersion, params: LatencyGate,
                 sample: Path | None, progress: Progress, repository: Path | None = None) -> GateResult:
    """Side by side, in interleaved rounds (new old, old new, …) so a busy moment of a shared machine hits both;
    each round pairs the two versions' p99 and capacity. Blocks only on a difference beyond the spread the
    rounds themselves show; within it, measures more rounds, up to ``max_rounds``, and then says it could not
    tell (inconclusive: not blocked unless ``block_inconclusive``)."""
    started = time.monotonic()
    rate, requests = params.rate, params.requests
    rounds, concurrency = max(1, params.rounds), max(1, params.concurrency)
    max_rounds = max(rounds, params.max_rounds)
    per_round: list[dict[str, dict[str, Any]]] = []
    invalid: list[str] = []
    failed: dict[str, list[str]] = {"new": [], "old": []}
    versions = {"new": new, "old": old}
    workloads = {"new": workload_for(new.config, sample), "old": workload_for(old.config, sample)}
    while True:
        index = len(per_round)
        first, second = ("new", "old") if index % 2 == 0 else ("old", "new")
        measured: dict[str, dict[str, Any]] = {"new": {}, "old": {}}
        # loaded afresh every round (in the round's order): Triton's model processes of one round may sit
        # worse on a busy machine than the other's, and that must not follow one version through every round
        with loaded(client, versions[first], versions[second], repository=repository) as loaded_names:
            names = dict(zip((first, second), loaded_names))
            # A B for p99, then B A B A … for capacity: the points of a pair run back to back, and a machine
            # getting busier (or quieter) during the round favours neither version
            for side in (first, second):
                progress(f"latency round {index + 1} (of {rounds} to {max_rounds}): {side} version, p99 at "
                         f"{rate:g} req/s")
                point = _measure_valid(Target(names[side], client.url), LoadSpec(
                    rate=rate, requests=requests, warmup_s=0.5, seed=index, max_lag_ms=params.max_lag_ms,
                    arrivals=params.arrivals), workloads[side], invalid, f"round {index + 1} {side} p99",
                    failed[side])
                measured[side]["p99_ms"] = point.p99_ms if point is not None else None
            progress(f"latency round {index + 1} (of {rounds} to {max_rounds}): capacity, "
                     f"{CAPACITY_SLICES} slices of each version in turn")
            slices = _capacity_pair(client.url, names, workloads, (second, first), concurrency, requests,
                                    params.capacity_slice_s, invalid, failed, f"round {index + 1}")
        for side in ("new", "old"):
            measured[side]["capacity_rps"] = _overall(slices[side])
            measured[side]["capacity_slices_rps"] = slices[side]
        per_round.append(measured)
        verdicts = _verdicts(per_round, params)
        if rounds_finished(len(per_round), verdicts, METRICS, bool(failed["new"]), rounds, max_rounds):
            break
    return _latency_result(per_round, verdicts, params, invalid, failed, time.monotonic() - started)


METRICS = ("p99", "capacity")


def rounds_finished(done: int, verdicts: dict[str, Verdict], metrics: tuple[str, ...], new_failed: bool,
                    rounds: int, max_rounds: int) -> bool:
    """Whether interleaved rounds may stop: the new version failed requests, ``max_rounds`` are spent, or
    after ``rounds`` a metric misses beyond the noise or every metric meets its threshold (anything else is
    within the noise: one more round)."""
    outcomes = {v.outcome for v in verdicts.values()}
    return new_failed or done >= max_rounds or (done >= rounds and (
        "misses" in outcomes or (len(verdicts) == len(metrics) and outcomes == {"meets"})))


def overall_verdict(verdicts: dict[str, Verdict], metrics: tuple[str, ...], new_failed: bool,
                    block_inconclusive: bool) -> tuple[str, bool]:
    """(``pass`` / ``fail`` / ``inconclusive``, whether it blocks): a miss beyond the noise or failed requests
    of the new version fail; a metric without a verdict or within the noise is inconclusive, which blocks only
    with ``block_inconclusive``."""
    outcomes = {verdict.outcome for verdict in verdicts.values()}
    missing = [metric for metric in metrics if metric not in verdicts]
    verdict = ("fail" if "misses" in outcomes or new_failed else
               "inconclusive" if missing or "within_noise" in outcomes else "pass")
    return verdict, verdict == "fail" or (verdict == "inconclusive" and block_inconclusive)


def spread_words(verdict: Verdict) -> str:
    """How much the rounds varied, in words for a summary."""
    pct = verdict.spread_pct
    return ("one round" if not math.isfinite(pct) else f"±{pct:.0f} % between rounds" if pct <= 100
            else f"rounds vary by up to ×{1 + pct / 100:.1f}" if pct <= 900 else "rounds vary by more than ×10")


CAPACITY_SLICES = 4
"""A round's capacity points, cut into this many slices taken in turn (B A B A …): a burst of other work on
the machine then lands on both versions. The round's capacity of a version is over all its slices."""


def _capacity_pair(url: str, names: dict[str, str], workloads: dict[str, Workload], order: tuple[str, str],
                   concurrency: int, requests: int, slice_s: float, invalid: list[str],
                   failed: dict[str, list[str]], label: str) -> dict[str, list[float | None]]:
    """Closed-loop capacity (answers per second) of both versions, slice by slice in alternation, each slice
    at least ``requests / CAPACITY_SLICES`` answers and ``slice_s`` seconds; None for a slice that stayed
    invalid (or once a version failed requests)."""
    per_slice = max(10, requests // CAPACITY_SLICES)
    rates: dict[str, list[float | None]] = {side: [] for side in order}
    for part in range(CAPACITY_SLICES):
        for side in order:
            point = None
            if not failed[side]:
                # no warm-up of its own: the open-loop points just warmed the model, and the closed loop's
                # request buffer is sized by count, so a time-based warm-up of a fast model can fill it
                point = _measure_valid(Target(names[side], url), LoadSpec(concurrency=concurrency,
                                                                          requests=per_slice, warmup_s=0.0,
                                                                          min_duration_s=slice_s),
                                       workloads[side], invalid, f"{label} {side} capacity (slice {part + 1})",
                                       failed[side])
            rates[side].append(point.achieved_rps if point is not None and point.achieved_rps > 0 else None)
    return rates


def _overall(rates: list[float | None]) -> float | None:
    """Answers per second over the valid slices (equal request counts: the harmonic mean)."""
    valid = [r for r in rates if r]
    return len(valid) / sum(1 / r for r in valid) if valid else None


def _limits(old_p99: float, old_capacity: float, params: LatencyGate) -> tuple[float, float]:
    p99_limit = max(old_p99 * (1 + params.max_p99_increase_pct / 100), old_p99 + params.min_p99_delta_ms)
    return p99_limit, old_capacity * (1 - params.max_capacity_drop_pct / 100)


def _verdicts(per_round: list[dict[str, dict[str, Any]]], params: LatencyGate) -> dict[str, Verdict]:
    """A verdict per metric from the rounds where both versions gave a valid point (none yet: no verdict)."""
    ratios: dict[str, list[float]] = {"p99": [], "capacity": []}
    for measured in per_round:
        new, old = measured["new"], measured["old"]
        if new["p99_ms"] is not None and old["p99_ms"] is not None:
            ratios["p99"].append(new["p99_ms"] / _limits(old["p99_ms"], 0.0, params)[0])
        if new["capacity_rps"] and old["capacity_rps"]:  # one sample a round: its slices are seconds apart
            ratios["capacity"].append(_limits(0.0, old["capacity_rps"], params)[1] / new["capacity_rps"])
    return {metric: judge(metric, values) for metric, values in ratios.items() if values}


def _latency_result(per_round: list[dict[str, dict[str, Any]]], verdicts: dict[str, Verdict],
                    params: LatencyGate, invalid: list[str], failed: dict[str, list[str]],
                    seconds: float) -> GateResult:
    def values(side: str, key: str) -> list[float]:
        return [float(m[side][key]) for m in per_round if m[side][key] is not None]

    med = {side: {key: statistics.median(values(side, key)) if values(side, key) else None
                  for key in ("p99_ms", "capacity_rps")} for side in ("new", "old")}
    missing = [metric for metric in METRICS if metric not in verdicts]
    verdict, block = overall_verdict(verdicts, METRICS, bool(failed["new"]), params.block_inconclusive)
    details: dict[str, Any] = {
        "verdict": verdict, "rate_rps": params.rate, "requests": params.requests,
        "rounds": len(per_round), "concurrency": params.concurrency, "new": med["new"], "old": med["old"],
        "per_round": per_round, "judged": {metric: v.to_dict() for metric, v in verdicts.items()},
        "thresholds": params.to_dict(), "invalid": invalid, "failed_requests": failed}
    if med["old"]["p99_ms"] is not None and med["old"]["capacity_rps"] is not None:
        p99_limit, floor = _limits(med["old"]["p99_ms"], med["old"]["capacity_rps"], params)
        details.update(p99_limit_ms=round(p99_limit, 3), capacity_floor_rps=round(floor, 1))
    parts = [_describe(metric, med, verdicts[metric], details) for metric in METRICS if metric in verdicts]
    parts += [f"{metric}: no round gave a valid point of both versions ({'; '.join(invalid[:2])})"
              for metric in missing]
    rounds = f"{len(per_round)} round(s) at {params.rate:g} req/s"
    parts += [f"the replaced version failed requests: {failed['old'][0]}"] if failed["old"] else []
    if failed["new"]:
        summary = f"the new version failed requests under load: {failed['new'][0]} ({rounds})"
    elif verdict == "fail":
        summary = f"{'; '.join(p for p in parts if 'beyond' in p)} ({rounds})"
    elif verdict == "inconclusive":
        summary = (f"inconclusive after {rounds}: {'; '.join(parts)}; the difference is within what this machine's "
                   f"noise allows, so it " + ("blocks (block_inconclusive is set)" if block else "does not block"))
    else:
        summary = f"{'; '.join(parts)} ({rounds})"
    return GateResult("latency", not block, summary, details, seconds)


def _describe(metric: str, med: dict[str, dict[str, float | None]], verdict: Verdict, details: dict[str, Any]) -> str:
    spread = spread_words(verdict)
    if metric == "p99":
        new, old, limit = med["new"]["p99_ms"], med["old"]["p99_ms"], details.get("p99_limit_ms")
        figures = f"p99 {new:.2f} ms vs {old:.2f} ms (limit {limit:.2f} ms)" if limit else f"p99 {new:.2f} ms"
    else:
        new, old, limit = med["new"]["capacity_rps"], med["old"]["capacity_rps"], details.get("capacity_floor_rps")
        figures = f"capacity {new:.0f} vs {old:.0f} req/s (floor {limit:.0f} req/s)" if limit else f"capacity {new:.0f}"
    if verdict.outcome == "misses":
        return f"{figures}: beyond the threshold by more than the noise ({spread})"
    return f"{figures}, {spread}"


def _measure_valid(target: Target, spec: LoadSpec, workload: Workload, invalid: list[str], label: str,
                   failed: list[str], attempts: int = 3) -> Measurement | None:
    """A valid point, measured again (a bounded number of times) when the client, not the server, limited
    it (a busy moment on a shared runner); None when no attempt was valid, each reason kept in ``invalid``,
    or when the server failed requests (kept in ``failed``)."""
    for _ in range(attempts):
        point = measure(target, spec, workload)
        if point.errors:  # the server failed requests: not the machine's noise, so not measured again
            sample = f" ({point.error_samples[0][:200]})" if point.error_samples else ""
            failed.append(f"{label}: {point.errors} of {point.requests} requests failed{sample}")
            return None
        if point.valid:
            return point
        invalid.append(f"{label}: {point.invalid_reason}")
    return None
