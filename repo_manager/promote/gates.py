"""Promotion gates: real checks of a stored version before an environment points at it.

Every gate returns a ``GateResult`` (recorded in the history) and never changes a store. A gate that
is not met raises nothing itself: ``run_gates`` collects the results and ``core`` refuses the move
with ``GateError``. Failures of the infrastructure (store unreachable, Triton down) are not gate
results: they propagate with their own exit codes.

* ``checksums`` — the manifest parses (schema, hostile-input checks), its config is a valid Triton config
  and every blob downloads with the size and sha256 the manifest names (``sync.cache.BlobCache``, the same
  verified fetch `trm sync` uses). It is always run first: the others load the files it fetched.
* ``load`` — the version loads on a real Triton (embedded, or ``--url``) through the load API under a
  temporary name and answers requests generated from its config (``publish.verify``).
* ``latency`` — the version and the one it replaces, loaded side by side, measured in interleaved
  rounds with the load generator: p99 at the spec's rate (open loop) and capacity (closed loop), judged
  round by round against the spread the rounds show (``judge``): a difference within that noise is measured
  again, up to ``max_rounds``, and then called inconclusive rather than a failure.
* ``agreement`` — both answer the sample file (or generated inputs) with the same outputs, within the
  dtype's tolerance (``publish.verify.compare``): for config-only changes.
* ``eval`` — a user command scores the loaded version; the score must reach the threshold.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager import config as cfg
from repo_manager.errors import IntegrityError, NotFoundError, UsageError, VerificationError
from repo_manager.inputs import generate_inputs, verification_samples
from repo_manager.loadgen import LoadSpec, Measurement, Target, Workload, measure
from repo_manager.manifest import Manifest
from repo_manager.process import run_command
from repo_manager.progress import Progress
from repo_manager.publish.verify import Candidate, LoadedCandidates, compare, verify
from repo_manager.storage import Store
from repo_manager.sync.cache import BlobCache
from repo_manager.sync.plan import check_manifest_config
from repo_manager.triton.client import TritonClient


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"gate": self.name, "passed": self.passed, "skipped": self.skipped, "summary": self.summary,
                "details": self.details, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class FetchedVersion:
    """A stored version (and its ensemble members) whose every blob was downloaded and verified."""

    manifest: Manifest
    candidates: tuple[Candidate, ...]
    """Members first, the version itself last (the order ``LoadedCandidates`` loads in)."""
    manifests: tuple[Manifest, ...]
    """The manifests of ``candidates``, in the same order (what a copy to another store writes)."""

    @property
    def config(self) -> cfg.ModelConfig:
        return self.candidates[-1].config


def fetch_version(store: Store, cache: BlobCache, model: str, version: int) -> FetchedVersion:
    """Download and verify ``model``/``version`` and its members. IntegrityError / NotFoundError when the
    store holds something else than the manifest promises."""
    manifest = store.get_manifest(model, version)
    config = check_manifest_config(manifest)
    candidates: list[Candidate] = []
    manifests: list[Manifest] = []
    for member, member_version in manifest.members.items():
        fetched = fetch_version(store, cache, member, member_version)
        for candidate, member_manifest in zip(fetched.candidates, fetched.manifests):
            if candidate.name not in {x.name for x in candidates}:
                candidates.append(candidate)
                manifests.append(member_manifest)
    for entry in manifest.files:
        cache.fetch(store, entry.sha256, entry.size)
    files = {entry.path: cache.path(entry.sha256) for entry in manifest.files}
    candidates.append(Candidate(model, config, files, manifest.model_files))
    manifests.append(manifest)
    return FetchedVersion(manifest, tuple(candidates), tuple(manifests))


def checksums_gate(store: Store, cache: BlobCache, model: str,
                   version: int) -> tuple[GateResult, FetchedVersion | None]:
    started = time.monotonic()
    try:
        fetched = fetch_version(store, cache, model, version)
    except (IntegrityError, NotFoundError) as exc:
        return GateResult("checksums", False, f"{model}/{version} in {store.location} is not intact: {exc.message}",
                          {"store": store.location}, time.monotonic() - started), None
    files = sum(len(c.files) for c in fetched.candidates)
    size = sum(e.size for e in fetched.manifest.files)
    return GateResult("checksums", True, f"manifest, config and {files} blob(s) verified ({size} bytes)",
                      {"store": store.location, "files": files, "bytes": size}, time.monotonic() - started), fetched


def load_gate(client: TritonClient, version: FetchedVersion, repository: Path | None = None) -> GateResult:
    started = time.monotonic()
    samples = verification_samples(version.config)
    try:
        report = verify(client, list(version.candidates), version.manifest.model, samples, None,
                        repository=repository)
    except VerificationError as exc:
        return GateResult("load", False, f"did not load and answer on {client.url}: {exc.message}",
                          {"server": client.url}, time.monotonic() - started)
    return GateResult("load", True, f"loaded and answered {report.samples} request(s) on {client.url}",
                      report.to_dict(), time.monotonic() - started)


@contextmanager
def loaded(client: TritonClient, *versions: FetchedVersion, repository: Path | None = None) -> Iterator[list[str]]:
    """Load each version under its own temporary name; yields the names of the entry models. ``repository``:
    the server's own repository folder, where the versions are written (an ensemble's members must be there:
    see ``publish.verify.LoadedCandidates``); None: sent as file overrides."""
    with ExitStack() as stack:
        names = []
        for version in versions:
            handle = stack.enter_context(LoadedCandidates(client, list(version.candidates), repository))
            names.append(handle.names[version.manifest.model])
        yield names


def _workload(config: cfg.ModelConfig, sample: Path | None) -> Workload:
    return Workload.from_file(sample, config) if sample else Workload.from_config(config)


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Student's t, 97.5 % one-sided, by degrees of freedom (beyond 10: 2.2, a little wide of the true value)."""
MIN_SAMPLES_TO_BLOCK = 3
"""A difference is called beyond the noise only from at least this many paired measurements: two cannot show
a spread."""


@dataclass(frozen=True)
class Verdict:
    """One metric of the latency gate, judged from paired measurements (p99: one pair a round; capacity: one
    pair per slice): ``ratios[k]`` is how far the new version is from its threshold in pair k (its p99 over the
    p99 limit, or the capacity floor over its capacity; above 1 misses it). ``estimate`` is their geometric
    mean, ``low``..``high`` its 95 % interval from the spread between pairs (the machine's own noise,
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


def latency_gate(client: TritonClient, new: FetchedVersion, old: FetchedVersion, params: dict[str, Any],
                 sample: Path | None, progress: Progress, repository: Path | None = None) -> GateResult:
    """Side by side, in interleaved rounds (new old, old new, …) so a busy moment of a shared machine hits both;
    each round pairs the two versions' p99 and capacity. Blocks only on a difference beyond the spread the
    rounds themselves show; within it, measures more rounds, up to ``max_rounds``, and then says it could not
    tell (inconclusive: not blocked unless ``block_inconclusive``)."""
    started = time.monotonic()
    rate, requests = float(params["rate"]), int(params["requests"])
    rounds, concurrency = max(1, int(params["rounds"])), max(1, int(params["concurrency"]))
    max_rounds = max(rounds, int(params.get("max_rounds", rounds)))
    per_round: list[dict[str, dict[str, Any]]] = []
    invalid: list[str] = []
    failed: dict[str, list[str]] = {"new": [], "old": []}
    with loaded(client, new, old, repository=repository) as (new_name, old_name):
        names = {"new": new_name, "old": old_name}
        workloads = {"new": _workload(new.config, sample), "old": _workload(old.config, sample)}
        while True:
            index = len(per_round)
            first, second = ("new", "old") if index % 2 == 0 else ("old", "new")
            measured: dict[str, dict[str, Any]] = {"new": {}, "old": {}}
            # A B for p99, then B A for capacity: the two points of a pair run back to back, and a machine
            # getting busier (or quieter) during the round favours neither version
            for side in (first, second):
                progress(f"latency round {index + 1} (of {rounds} to {max_rounds}): {side} version, p99 at "
                         f"{rate:g} req/s")
                point = _measure_valid(Target(names[side], client.url), LoadSpec(
                    rate=rate, requests=requests, warmup_s=0.5, seed=index, max_lag_ms=float(params["max_lag_ms"]),
                    arrivals=str(params["arrivals"])), workloads[side], invalid, f"round {index + 1} {side} p99",
                    failed[side])
                measured[side]["p99_ms"] = point.p99_ms if point is not None else None
            progress(f"latency round {index + 1} (of {rounds} to {max_rounds}): capacity, "
                     f"{CAPACITY_SLICES} slices of each version in turn")
            slices = _capacity_pair(client.url, names, workloads, (second, first), concurrency, requests,
                                    invalid, failed, f"round {index + 1}")
            for side in ("new", "old"):
                measured[side]["capacity_rps"] = _overall(slices[side])
                measured[side]["capacity_slices_rps"] = slices[side]
            per_round.append(measured)
            verdicts = _verdicts(per_round, params)
            outcomes = {v.outcome for v in verdicts.values()}
            # never a verdict from fewer than ``rounds`` rounds: the samples of one round are seconds apart
            done = bool(failed["new"]) or len(per_round) >= max_rounds or (len(per_round) >= rounds and (
                "misses" in outcomes or (len(verdicts) == 2 and outcomes == {"meets"})))
            if done:
                break
    return _latency_result(per_round, verdicts, params, invalid, failed, time.monotonic() - started)


CAPACITY_SLICES = 4
"""A round's capacity points, cut into this many slices taken in turn (B A B A …): a burst of other work on
the machine then lands on both versions, and each adjacent pair of slices is one sample of the ratio."""


def _capacity_pair(url: str, names: dict[str, str], workloads: dict[str, Workload], order: tuple[str, str],
                   concurrency: int, requests: int, invalid: list[str], failed: dict[str, list[str]],
                   label: str) -> dict[str, list[float | None]]:
    """Closed-loop capacity (answers per second) of both versions, slice by slice in alternation; None for a
    slice that stayed invalid (or once a version failed requests)."""
    per_slice = max(10, requests // CAPACITY_SLICES)
    rates: dict[str, list[float | None]] = {side: [] for side in order}
    for part in range(CAPACITY_SLICES):
        for side in order:
            point = None
            if not failed[side]:
                # no warm-up of its own: the open-loop points just warmed the model, and the closed loop's
                # request buffer is sized by count, so a time-based warm-up of a fast model can fill it
                point = _measure_valid(Target(names[side], url), LoadSpec(concurrency=concurrency,
                                                                          requests=per_slice, warmup_s=0.0),
                                       workloads[side], invalid, f"{label} {side} capacity (slice {part + 1})",
                                       failed[side])
            rates[side].append(point.achieved_rps if point is not None and point.achieved_rps > 0 else None)
    return rates


def _overall(rates: list[float | None]) -> float | None:
    """Answers per second over the valid slices (equal request counts: the harmonic mean)."""
    valid = [r for r in rates if r]
    return len(valid) / sum(1 / r for r in valid) if valid else None


def _limits(old_p99: float, old_capacity: float, params: dict[str, Any]) -> tuple[float, float]:
    p99_limit = max(old_p99 * (1 + params["max_p99_increase_pct"] / 100), old_p99 + params["min_p99_delta_ms"])
    return p99_limit, old_capacity * (1 - params["max_capacity_drop_pct"] / 100)


def _verdicts(per_round: list[dict[str, dict[str, Any]]], params: dict[str, Any]) -> dict[str, Verdict]:
    """A verdict per metric from the rounds where both versions gave a valid point (none yet: no verdict)."""
    ratios: dict[str, list[float]] = {"p99": [], "capacity": []}
    for measured in per_round:
        new, old = measured["new"], measured["old"]
        if new["p99_ms"] is not None and old["p99_ms"] is not None:
            ratios["p99"].append(new["p99_ms"] / _limits(old["p99_ms"], 0.0, params)[0])
        for new_rps, old_rps in zip(new["capacity_slices_rps"], old["capacity_slices_rps"]):
            if new_rps and old_rps:  # adjacent slices: one sample each
                ratios["capacity"].append(_limits(0.0, old_rps, params)[1] / new_rps)
    return {metric: judge(metric, values) for metric, values in ratios.items() if values}


def _latency_result(per_round: list[dict[str, dict[str, Any]]], verdicts: dict[str, Verdict],
                    params: dict[str, Any], invalid: list[str], failed: dict[str, list[str]],
                    seconds: float) -> GateResult:
    def values(side: str, key: str) -> list[float]:
        return [float(m[side][key]) for m in per_round if m[side][key] is not None]

    med = {side: {key: statistics.median(values(side, key)) if values(side, key) else None
                  for key in ("p99_ms", "capacity_rps")} for side in ("new", "old")}
    outcomes = {metric: verdict.outcome for metric, verdict in verdicts.items()}
    missing = [metric for metric in ("p99", "capacity") if metric not in verdicts]
    verdict = ("fail" if "misses" in outcomes.values() or failed["new"] else
               "inconclusive" if missing or "within_noise" in outcomes.values() else "pass")
    block = verdict == "fail" or (verdict == "inconclusive" and bool(params.get("block_inconclusive", 0)))
    details: dict[str, Any] = {
        "verdict": verdict, "rate_rps": float(params["rate"]), "requests": int(params["requests"]),
        "rounds": len(per_round), "concurrency": int(params["concurrency"]), "new": med["new"], "old": med["old"],
        "per_round": per_round, "judged": {metric: v.to_dict() for metric, v in verdicts.items()},
        "thresholds": dict(params), "invalid": invalid, "failed_requests": failed}
    if med["old"]["p99_ms"] is not None and med["old"]["capacity_rps"] is not None:
        p99_limit, floor = _limits(med["old"]["p99_ms"], med["old"]["capacity_rps"], params)
        details.update(p99_limit_ms=round(p99_limit, 3), capacity_floor_rps=round(floor, 1))
    parts = [_describe(metric, med, verdicts[metric], details) for metric in ("p99", "capacity") if metric in verdicts]
    parts += [f"{metric}: no round gave a valid point of both versions ({'; '.join(invalid[:2])})"
              for metric in missing]
    rounds = f"{len(per_round)} round(s) at {float(params['rate']):g} req/s"
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
    pct = verdict.spread_pct
    spread = ("one round" if not math.isfinite(pct) else f"±{pct:.0f} % between paired measurements" if pct <= 100
              else f"paired measurements vary by up to ×{1 + pct / 100:.1f}")
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


def _agreement_samples(config: cfg.ModelConfig, sample: Path | None) -> list[dict[str, np.ndarray]]:
    if sample:
        return list(Workload.from_file(sample, config).samples)
    return [generate_inputs(config, batch_size=1, seed=seed) for seed in range(4)]


def agreement_gate(client: TritonClient, new: FetchedVersion, old: FetchedVersion, sample: Path | None,
                   repository: Path | None = None) -> GateResult:
    started = time.monotonic()
    samples = _agreement_samples(old.config, sample)
    worst: dict[str, float] = {}
    with loaded(client, new, old, repository=repository) as (new_name, old_name):
        for request in samples:
            want = client.infer(old_name, request)
            got = client.infer(new_name, request)
            for name, expected in want.items():
                if name not in got:
                    return GateResult("agreement", False, f"output {name} is missing from the new version's answer",
                                      {"worst_abs_diff": worst}, time.monotonic() - started)
                try:
                    worst[name] = max(worst.get(name, 0.0), compare(name, got[name], expected))
                except VerificationError as exc:
                    return GateResult("agreement", False, f"outputs differ from version {old.manifest.version}: "
                                      f"{exc.message}", {"worst_abs_diff": worst, "samples": len(samples)},
                                      time.monotonic() - started)
    source = str(sample) if sample else "generated inputs"
    return GateResult("agreement", True, f"{len(samples)} request(s) from {source} answered like version "
                      f"{old.manifest.version}", {"worst_abs_diff": worst, "samples": len(samples), "source": source},
                      time.monotonic() - started)


def parse_score(stdout: str) -> float:
    """The last non-empty line: a number, or JSON with a ``score``."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("it printed nothing")
    last = lines[-1]
    try:
        return float(last)
    except ValueError:
        data = json.loads(last)
        return float(data["score"])


def eval_gate(client: TritonClient, new: FetchedVersion, old: FetchedVersion | None, command: str,
              threshold: float, timeout_s: float = 1800.0, repository: Path | None = None) -> GateResult:
    """Run ``command`` (a shell command line from the user's configs or options) with the loaded version's
    name and server in its environment; its score must be at least ``threshold``."""
    started = time.monotonic()
    if not command.strip():
        raise UsageError("the eval gate needs a command", hint="pass --eval-cmd or set eval.command in the spec")
    versions = (new, old) if old else (new,)
    with loaded(client, *versions, repository=repository) as names:
        env = dict(os.environ, TRM_EVAL_URL=client.url, TRM_EVAL_MODEL=names[0],
                   TRM_EVAL_NAME=new.manifest.model, TRM_EVAL_VERSION=str(new.manifest.version))
        if old:
            env.update(TRM_EVAL_BASELINE_MODEL=names[1], TRM_EVAL_BASELINE_VERSION=str(old.manifest.version))
        try:
            done = run_command(command, env=env, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            return GateResult("eval", False, f"evaluation command timed out after {timeout_s:g} s",
                              {"command": command}, time.monotonic() - started)
    details: dict[str, Any] = {"command": command, "threshold": threshold, "exit_code": done.returncode,
                               "stderr_tail": done.stderr[-500:]}
    if done.returncode != 0:
        return GateResult("eval", False, f"evaluation command exited with {done.returncode}", details,
                          time.monotonic() - started)
    try:
        score = parse_score(done.stdout)
    except (ValueError, KeyError, TypeError) as exc:
        return GateResult("eval", False, f"evaluation command gave no score ({exc}); print a number or "
                          '{"score": X} on its last line', details, time.monotonic() - started)
    details["score"] = score
    passed = score >= threshold
    return GateResult("eval", passed, f"score {score:g} {'>=' if passed else '<'} threshold {threshold:g}",
                      details, time.monotonic() - started)


def skipped(name: str, reason: str) -> GateResult:
    return GateResult(name, True, f"skipped: {reason}", skipped=True)
