"""`trm tune-batching` and `--check`: the operations behind the command.

``tune_batching`` serves the model (the embedded server on the repository, or ``--url``), profiles it,
runs the search (``search.Search``) with candidates applied through the load API, and always restores
the config the model was served with. With ``write`` the choice becomes a new version: the same files
(linked or copied from the tuned version) and the chosen config, committed through
``publish.core.commit_staged`` (schema writer, manifest last, atomic rename) with the tuning record
(SLO, every measurement, evidence and environment) in its manifest.

``check_batching`` re-measures the served config at the low and peak rates and compares the
environment (Triton version, hardware, model checksum) with the tuning record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repo_manager.adapters.loadgen import Target
from repo_manager.adapters.process import run_command
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, NotFoundError, UsageError
from repo_manager.core.manifest import Manifest, now_iso
from repo_manager.core.settings import Settings
from repo_manager.ops.publish.core import Staged, commit_staged
from repo_manager.ops.serving import load_version, version_config
from repo_manager.ops.tuning.candidates import Candidate
from repo_manager.ops.tuning.overload import OverloadOutcome, PolicySearch, try_cost_s
from repo_manager.ops.tuning.prober import (
    MAX_NORMAL_REJECT,
    MAX_POINT_S,
    Point,
    Prober,
    Progress,
    config_cost_s,
    point_cost_s,
    profile_cost_s,
    rejected_share,
)
from repo_manager.ops.tuning.report import write_report
from repo_manager.ops.tuning.search import ALWAYS_MEASURED, Outcome, Search


def quiet(message: str, used: float, budget: float) -> None:
    pass


MAX_OVERLOAD_FACTOR = 100.0
"""An overload beyond this multiple of capacity is no tuning question (and no client could offer it)."""


DEFAULT_BUDGET_S = 300.0


@dataclass(frozen=True)
class TuneRequest:
    model: str
    p99_ms: float
    low_rps: float
    peak_rps: float
    headroom: float = 1.2
    budget_s: float = DEFAULT_BUDGET_S
    write: bool = False
    report_dir: Path | None = None
    requests: int = 1000
    """Requests per measured point (fewer at low rates: at most ``max_point_s`` seconds of traffic)."""
    max_point_s: float = MAX_POINT_S
    warmup_s: float = 1.0
    """Traffic at each point's rate before it is measured (the new config's first batches, connections)."""
    max_batch_limit: int = 64
    """The largest batch size profiled (and so the largest max_batch_size considered)."""
    overload_factor: float = 2.0
    """The queue policy must keep the SLO for accepted requests at this multiple of the measured
    capacity (0: choose no queue policy)."""
    priority_levels: int = 0
    fast_rejection: bool = False
    """Also try ``max_queue_size`` on top of the held queue timeout (``overload.PolicySearch``)."""
    overload_s: float = 3.0
    """Seconds of overload per queue-policy try (then ``recover_s`` at the peak rate)."""
    recover_s: float = 2.0
    require_overload_policy: bool = False
    """Without a queue policy shown to hold under the overload, write nothing and fail (by default the
    batching choice is written, recorded as having no queue policy)."""

    def check(self) -> None:
        if not self.p99_ms > 0:
            raise UsageError(f"--p99-ms must be positive, not {self.p99_ms}")
        if not 0 < self.low_rps <= self.peak_rps:
            raise UsageError(f"need 0 < --low-rps <= --peak-rps (got {self.low_rps} and {self.peak_rps})")
        if self.headroom < 1:
            raise UsageError(f"--headroom must be at least 1, not {self.headroom}")
        if not self.budget_s > 0:
            raise UsageError(f"--budget must be positive, not {self.budget_s}")
        if self.overload_factor != 0 and not 1 < self.overload_factor <= MAX_OVERLOAD_FACTOR:
            raise UsageError(f"--overload-factor must be above 1 and at most {MAX_OVERLOAD_FACTOR:g} (or 0: no "
                             f"queue policy), not {self.overload_factor}")
        if self.priority_levels < 0:
            raise UsageError(f"--priority-levels must be 0 or more, not {self.priority_levels}")
        check_measure_arguments(requests=self.requests)
        minimum = self.minimum_budget_s()
        if self.budget_s < minimum:
            rates = "/".join(f"{r:g}" for r in self.rates())
            raise UsageError(
                f"--budget {self.budget_s:g} s is less than the measurements every run makes take here: about "
                f"{minimum:.0f} s (the profile, then {ALWAYS_MEASURED} configs at {rates} requests/s"
                + (", one queue-policy try" if self.overload_factor else "") + ")",
                hint=f"give --budget {5 * math.ceil(minimum / 5):g} or more, or fewer --requests")

    def rates(self) -> tuple[float, float, float]:
        """The measured levels: low, peak, peak x headroom."""
        return self.low_rps, self.peak_rps, self.peak_rps * self.headroom

    def point_s(self, rate: float) -> float:
        return point_cost_s(rate, requests=self.requests, max_point_s=self.max_point_s, warmup_s=self.warmup_s)

    def minimum_budget_s(self) -> float:
        """What every run measures, whatever its budget (``search``: steps 1-2 for the current config, plain
        batching and the top structure; the first queue-policy try): a budget below it could only be
        overrun, so it is refused before anything starts."""
        configs = ALWAYS_MEASURED * config_cost_s(self.point_s, self.rates())
        policy = try_cost_s(self.overload_s, self.recover_s, self.point_s(self.rates()[-1])) \
            if self.overload_factor else 0.0
        return profile_cost_s(self.max_batch_limit) + configs + policy

    def check_target(self, settings: Settings) -> None:
        """Everything that can be refused before a server starts: the arguments and the --write target."""
        self.check()
        if self.write and self.model not in LocalRepository(settings.repository).models():
            raise NotFoundError(f"--write needs {self.model} in the repository {settings.repository}",
                                hint="pass --repo with the repository the model was published to", model=self.model)


def check_measure_arguments(*, p99_ms: float | None = None, low_rps: float | None = None,
                            peak_rps: float | None = None, requests: int = 1000) -> None:
    """The SLO and load arguments that are given must make sense (``--check`` takes the rest from the record)."""
    if p99_ms is not None and not p99_ms > 0:
        raise UsageError(f"--p99-ms must be positive, not {p99_ms}")
    for flag, value in (("--low-rps", low_rps), ("--peak-rps", peak_rps)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} must be positive, not {value}")
    if low_rps is not None and peak_rps is not None and low_rps > peak_rps:
        raise UsageError(f"need 0 < --low-rps <= --peak-rps (got {low_rps} and {peak_rps})")
    if requests < 1:
        raise UsageError(f"--requests must be at least 1, not {requests}")


@dataclass(frozen=True)
class Served:
    client: TritonClient
    version: int | None
    base: cfg.ModelConfig
    """The config the candidates are applied to: the version's validated config when the repository has it."""
    original: cfg.ModelConfig
    """What the server served before tuning; restored afterwards."""
    manifest: Manifest | None


@dataclass(frozen=True)
class TuneResult:
    model: str
    version: int | None
    server: str
    slo: dict[str, float]
    environment: dict[str, Any]
    outcome: Outcome
    seconds: float
    written_version: int | None = None
    report_files: tuple[str, ...] = ()
    overload: OverloadOutcome | None = None
    """The queue-policy choice under overload (None: ``overload_factor`` 0, or no batching choice)."""

    require_overload_policy: bool = False

    @property
    def chosen(self) -> Candidate | None:
        """The whole choice: the batching settings, with the queue policy when one was shown to hold (None:
        no batching met the SLO, or a policy was required and none held)."""
        if self.overload is not None and self.overload.chosen is not None:
            return self.overload.chosen
        if self.require_overload_policy and self.overload is not None:
            return None
        if self.overload is not None and self.overload.fallback is not None:
            return self.overload.fallback
        return self.outcome.chosen

    @property
    def status(self) -> str:
        """What happened, in one word: ``chosen`` (batching, and the queue policy when one was asked for and
        held), ``chosen-with-closest-queue-policy`` (no queue policy held or the overload could not be driven:
        see ``overload.outcome``; the closest policy tried keeps normal traffic and is written),
        ``chosen-without-queue-policy`` (that, and no policy tried keeps normal traffic),
        ``queue-policy-required`` (either, with ``--require-overload-policy``: nothing chosen),
        ``no-candidate`` (no batching met the SLO)."""
        if self.outcome.chosen is None:
            return "no-candidate"
        if self.overload is None or self.overload.chosen is not None:
            return "chosen"
        if self.require_overload_policy:
            return "queue-policy-required"
        return "chosen-with-closest-queue-policy" if self.overload.fallback else "chosen-without-queue-policy"

    def record(self) -> dict[str, Any]:
        """The tuning record stored in a written version's manifest (and the JSON report)."""
        o = self.outcome
        return {
            "tool": "trm tune-batching", "created_at": now_iso(), "model": self.model, "status": self.status,
            "tuned_from_version": self.version, "server": self.server, "slo": self.slo,
            "environment": self.environment, "search_seconds": round(self.seconds, 1),
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "batching": o.chosen.to_dict() if o.chosen else None,
            "closest": o.closest.to_dict() if o.closest else None,
            "overload": self.overload.to_dict() if self.overload else None,
            "evidence": o.evidence, "noise": round(o.noise, 4), "notes": list(o.notes),
            "profile": o.profile.to_dict(), "candidates": [e.to_dict() for e in o.evaluations],
            "pruned": [p.to_dict() for p in o.pruned], "points": [p.to_dict() for p in o.points],
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.record(), "written_version": self.written_version, "report_files": list(self.report_files)}


# ---------------------------------------------------------------------------------------- serving

@contextmanager
def served_model(settings: Settings, model: str, *, timeout_s: float = 60.0) -> Iterator[Served]:
    """The model on a server: ``settings.triton_url`` if set, else the embedded server on the repository.
    ``timeout_s``: per request to the server, loads included (an LLM engine's start takes minutes)."""
    repo = LocalRepository(settings.repository)
    if settings.triton_url:
        with TritonClient(settings.triton_url, timeout_s=timeout_s) as client:
            client.require_ready()
            served = client.model_config(model)
            versions = client.loaded_versions(model)
            version = versions[-1] if versions else None
            manifest = None
            if version is not None and version in repo.versions(model):
                manifest = repo.manifest(model, version)
            base = version_config(repo, model, version) if manifest and version else served
            yield Served(client, version, base, served, manifest)
        return
    version = repo.latest(model)
    with TritonServer(repo.root, binary=settings.tritonserver,
                      start_timeout_s=settings.server_start_timeout_s) as server, \
            TritonClient(server.url, timeout_s=timeout_s) as client:
        load_version(client, repo, model, version)
        config = version_config(repo, model, version)
        yield Served(client, version, config, config, repo.manifest(model, version))


def environment(client: TritonClient, manifest: Manifest | None) -> dict[str, Any]:
    """What a measurement depends on besides the config: server, hardware, the model's exact files."""
    checksum = None
    if manifest is not None:
        listing = "\n".join(f"{f.path} {f.sha256}" for f in sorted(manifest.files, key=lambda f: f.path))
        checksum = hashlib.sha256(listing.encode()).hexdigest()
    return {"triton_version": str(client.server_metadata().get("version", "unknown")),
            "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "gpus": _gpus(), "machine": platform.machine(),
            "model_checksum": checksum}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = run_command(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], timeout_s=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    out = done.stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------- tuning

POLICY_TRIES_RESERVED = 4
"""Queue-policy tries the batching search leaves budget for (at most a third of the budget, at least one)."""


def policy_reserve_s(request: TuneRequest, prober: Prober) -> float:
    """Budget the batching search leaves for the queue-policy search: ``POLICY_TRIES_RESERVED`` policy tries
    (overload, recovery, normal traffic), at most a third of the budget but at least one try. The policy
    search stops trying when the budget is spent (its first try is always made), so ``--budget`` bounds the
    whole run to within about one try."""
    if not request.overload_factor:
        return 0.0
    one_try = try_cost_s(request.overload_s, request.recover_s, request.point_s(request.rates()[-1]))
    return min(POLICY_TRIES_RESERVED * one_try, max(one_try, request.budget_s / 3))


def tune_batching(settings: Settings, request: TuneRequest, progress: Progress = quiet) -> TuneResult:
    """Measure candidates and choose one; with ``request.write`` publish it as a new version."""
    request.check_target(settings)
    started = time.monotonic()
    with served_model(settings, request.model) as served:
        if served.base.max_batch_size <= 0:
            raise InputError(f"{request.model} has max_batch_size 0 (no batch axis): there is nothing to batch",
                             model=request.model)
        env = environment(served.client, served.manifest)
        target = Target(request.model, served.client.url)
        prober = Prober(served.client, target, served.base, request.p99_ms, request.budget_s,
                        requests=request.requests, max_point_s=request.max_point_s, warmup_s=request.warmup_s,
                        progress=progress)
        current = Candidate.from_config(served.base)
        try:
            profile = prober.profile(current, request.max_batch_limit)
            with prober.holding_back(policy_reserve_s(request, prober)):
                outcome = Search(prober, profile, current, request.p99_ms, request.low_rps, request.peak_rps,
                                 request.headroom).run()
            overload = None
            if outcome.chosen is not None and request.overload_factor:
                evaluation = outcome.evaluation(outcome.chosen.key)
                capacity = evaluation.capacity_rps or request.peak_rps * request.headroom
                overload = PolicySearch(prober, profile, outcome.chosen, capacity, request.p99_ms,
                                        request.overload_factor, request.peak_rps, request.peak_rps * request.headroom,
                                        priority_levels=request.priority_levels, overload_s=request.overload_s,
                                        fast_rejection=request.fast_rejection,
                                        recover_s=request.recover_s,
                                        capacity_note=evaluation.capacity_note,
                                        fallback=not request.require_overload_policy,
                                        capacities={e.candidate.key: e.capacity_rps for e in outcome.evaluations
                                                    if e.capacity_rps is not None},
                                        missed={e.candidate.key: e.missed_rps for e in outcome.evaluations
                                                if e.missed_rps is not None},
                                        climbed={e.candidate.key: e.climbed_rps for e in outcome.evaluations
                                                 if e.climbed_rps is not None}).run()
        finally:
            progress("restoring the served config", prober.used_s, request.budget_s)
            prober.restore(served.original)
        slo = {"p99_ms": request.p99_ms, "low_rps": request.low_rps, "peak_rps": request.peak_rps,
               "headroom": request.headroom, "headroom_rps": request.peak_rps * request.headroom,
               "overload_factor": request.overload_factor,
               "require_overload_policy": request.require_overload_policy}
        result = TuneResult(request.model, served.version, served.client.url, slo, env, outcome,
                            time.monotonic() - started, overload=overload,
                            require_overload_policy=request.require_overload_policy)
    if request.write and result.chosen is not None:
        version = write_tuned_version(LocalRepository(settings.repository), result)
        result = dataclasses.replace(result, written_version=version)
    if request.report_dir is not None:
        files = write_report(Path(request.report_dir), result.to_dict(), list(outcome.points), overload)
        result = dataclasses.replace(result, report_files=files)
    return result


def write_tuned_version(repo: LocalRepository, result: TuneResult) -> int:
    """A new version: the tuned version's files, the chosen config, the tuning record."""
    assert result.chosen is not None
    source_version = result.version if result.version in repo.versions(result.model) else repo.latest(result.model)
    manifest = repo.manifest(result.model, source_version)
    config = result.chosen.apply(cfg.parse_config(manifest.config, f"manifest of {result.model}/{source_version}"))
    verification = {"passed": True, "method": "trm tune-batching", "server": result.server,
                    "requests": sum(p.measurement.requests for p in result.outcome.points
                                    if p.candidate == result.chosen.key and p.measurement)}
    return write_version_from(repo, result.model, source_version, config, result.record(), verification,
                              model_checksum=result.environment.get("model_checksum"))


def write_version_from(repo: LocalRepository, model: str, source_version: int, config: cfg.ModelConfig,
                       record: dict[str, Any], verification: dict[str, Any], *, model_checksum: str | None,
                       rewrite: dict[str, Callable[[int], bytes]] | None = None) -> int:
    """A new version of ``model``: ``source_version``'s files (hard links), ``config`` and the tuning
    ``record``, committed through ``publish.core.commit_staged``. ``rewrite`` maps a file's path to what it
    holds in the new version, given the version number (a vLLM model.json names its version folder)."""
    source_dir = repo.version_dir(model, source_version)
    manifest = repo.manifest(model, source_version)
    config = cfg.ModelConfig.FromString(config.SerializeToString())
    config.ClearField("version_policy")
    rewrite = rewrite or {}
    with repo.staging(model) as staging:
        for entry in manifest.files:
            if entry.path in rewrite:
                continue
            target = staging / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            try:  # versions are immutable, so sharing the bytes with a hard link is safe and free
                os.link(source_dir / entry.path, target)
            except OSError:
                shutil.copyfile(source_dir / entry.path, target)

        def before_commit(version: int) -> None:  # new files, never written through a link to the source's
            for path, content in rewrite.items():
                (staging / path).parent.mkdir(parents=True, exist_ok=True)
                cfg.atomic_write_bytes(staging / path, content(version))

        before_commit(repo.next_version(model))
        source = {"kind": "tuning", "from_version": source_version, "model_checksum": model_checksum}
        # an adopted model's label and data files stay with it
        staged = Staged(model, staging, config, source, tuning=record, labels=dict(manifest.labels),
                        data=dict(manifest.data), before_commit=before_commit if rewrite else None)
        version, _ = commit_staged(repo, staged, verification)
    return version


# ---------------------------------------------------------------------------------------- checking

@dataclass(frozen=True)
class CheckResult:
    model: str
    version: int | None
    slo: dict[str, float]
    points: tuple[Point, ...]
    environment: dict[str, Any]
    changes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Environment fields that differ from the tuning record: name -> {"tuned": ..., "now": ...}."""

    @property
    def passed(self) -> bool:
        return all(p.meets_slo for p in self.points) and not self.changes

    def failures(self) -> list[str]:
        """Why the check failed, one line per point that missed and per environment change."""
        def reason(point: Point) -> str:
            m = point.measurement
            if m is not None and m.valid and m.requests and (share := rejected_share(m)) > MAX_NORMAL_REJECT:
                slo = self.slo["p99_ms"]
                return (f"the queue policy rejected {share:.2%} of requests (at most {MAX_NORMAL_REJECT:.1%}; "
                        f"answered p99 {m.accepted_p99_ms:.1f} ms" + (f" > {slo:g} ms)" if m.accepted_p99_ms > slo
                                                                       else ")"))
            if point.p99_ms > self.slo["p99_ms"]:
                return f"p99 {point.p99_ms:.1f} ms > {self.slo['p99_ms']:g} ms"
            return f"not measurable ({point.note or 'errors'})"

        return ([f"{p.level} {p.rate:g}/s {reason(p)}" for p in self.points if not p.meets_slo]
                + [f"{k} changed ({v['tuned']} -> {v['now']})" for k, v in self.changes.items()])

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "passed": self.passed, "slo": self.slo,
                "points": [p.to_dict() for p in self.points], "environment": self.environment,
                "environment_changes": self.changes, "failures": self.failures()}


def check_batching(settings: Settings, model: str, *, p99_ms: float | None = None, low_rps: float | None = None,
                   peak_rps: float | None = None, requests: int = 1000, progress: Progress = quiet) -> CheckResult:
    """Re-measure the served config at low and peak; compare the environment with the tuning record."""
    check_measure_arguments(p99_ms=p99_ms, low_rps=low_rps, peak_rps=peak_rps, requests=requests)
    with served_model(settings, model) as served:
        record = (served.manifest.tuning if served.manifest else None) or {}
        slo = {**record.get("slo", {})}
        for key, value in (("p99_ms", p99_ms), ("low_rps", low_rps), ("peak_rps", peak_rps)):
            if value is not None:
                slo[key] = value
        missing = [k for k in ("p99_ms", "low_rps", "peak_rps") if k not in slo]
        if missing:
            raise InputError(f"{model} version {served.version} has no tuning record to check against",
                             hint="run `trm tune-batching --write` first, or give --p99-ms, --low-rps and --peak-rps")
        env = environment(served.client, served.manifest)
        tuned_env = record.get("environment", {})
        changes = {k: {"tuned": tuned_env[k], "now": env.get(k)} for k in ("triton_version", "cpu", "gpus",
                                                                             "model_checksum")
                   if k in tuned_env and tuned_env[k] != env.get(k)}
        prober = Prober(served.client, Target(model, served.client.url), served.base, slo["p99_ms"], 1e9,
                        requests=requests, progress=progress)
        current = Candidate.from_config(served.original)
        prober.loaded = current.key  # measure what is served, as it is served
        points = tuple(prober.point(current, level, slo[f"{level}_rps"]) for level in ("low", "peak"))
    return CheckResult(model, served.version, {k: slo[k] for k in ("p99_ms", "low_rps", "peak_rps")}, points,
                       env, changes)
