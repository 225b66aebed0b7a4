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
  rounds and judged against the noise the rounds show (``repo_manager.ops.promote.latency``).
* ``agreement`` — both answer the sample file (or generated inputs) with the same outputs, within the
  dtype's tolerance (``publish.verify.compare``): for config-only changes.
* ``quality`` — a text service's version against the one it replaces on the user's own items (the JSON lines
  of ``--eval-data``): embeddings' cosine and retrieval agreement, rankings' agreement, labels' agreement,
  judged by the quality thresholds (``ops/publish/huggingface/quality.py``): for a change of precision.
* ``eval`` — a user command scores the loaded version; the score must reach the threshold.

An LLM version (a streaming vLLM model) has its own load, agreement and latency gates, with each version
loaded once for all of them: ``repo_manager.ops.promote.llm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.adapters.cache import BlobCache
from repo_manager.adapters.loadgen import Workload
from repo_manager.adapters.loadgen.inputs import generate_inputs, verification_samples
from repo_manager.adapters.process import run_command
from repo_manager.adapters.storage import Store
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import ConfigError, IntegrityError, NotFoundError, UsageError, VerificationError
from repo_manager.core.manifest import Manifest
from repo_manager.ops.sync.plan import check_manifest_config
from repo_manager.ops.verify import Candidate, LoadedCandidates, compare, verify


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


def workload_for(config: cfg.ModelConfig, sample: Path | None) -> Workload:
    return Workload.from_file(sample, config) if sample else Workload.from_config(config)


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


@dataclass(frozen=True)
class QualityCheck:
    """The quality gate's inputs, read and checked before any server starts (``quality_check``)."""

    task: str
    data: Any
    """The items (``ops/publish/huggingface/quality.EvalData``)."""
    thresholds: dict[str, float]
    labels: list[str]


def _task(version: FetchedVersion) -> str | None:
    source = version.manifest.source
    task = source.get("task") if isinstance(source, dict) else None
    return task if isinstance(task, str) else None


def _labels(version: FetchedVersion, label_file: str) -> list[str]:
    text = version.manifest.labels.get(label_file) or ""
    return [line for line in text.split("\n") if line]  # label_file writes one label and "\n" each


def quality_check(new: FetchedVersion, old: FetchedVersion | None, data: Path | None, origin: str,
                  thresholds: Mapping[str, Any] | None, settings_origin: str) -> QualityCheck | GateResult:
    """The quality gate's inputs, or its result when it cannot run: skipped for a version that is not a text
    service or replaces none; failed when the replaced version is another kind of service or labels its
    classes otherwise. UsageError without ``data`` (from ``origin``), InputError for bad data, ConfigError for
    bad thresholds in the settings file: all before a server starts."""
    from repo_manager.ops.publish.huggingface import LABEL_FILE, quality  # noqa: PLC0415 - a text service's modules only for this gate

    task = _task(new)
    if task not in quality.THRESHOLDS:
        return skipped("quality", f"{new.manifest.model} version {new.manifest.version} is not a text service "
                                  "(the gate compares Hugging Face embedding, rerank and classify services)")
    if old is None:
        return skipped("quality", "the target environment serves no earlier version to compare with")
    if _task(old) != task:
        return GateResult("quality", False, f"version {new.manifest.version} is a {task} service and the replaced "
                          f"version {old.manifest.version} is not", {"tasks": [task, _task(old)]})
    labels = _labels(new, LABEL_FILE)
    if labels != _labels(old, LABEL_FILE):
        return GateResult("quality", False, f"version {new.manifest.version} and the replaced version "
                          f"{old.manifest.version} label their classes differently: their answers do not compare",
                          {"labels": {"new": labels[:20], "old": _labels(old, LABEL_FILE)[:20]}})
    if data is None:
        raise UsageError("the quality gate needs a JSON-lines file of your own items",
                         hint="pass --quality-data FILE, or set quality_data in configs/models/NAME.yaml")
    items = quality.read_eval_data(data, task, origin)
    task_settings = (thresholds or {}).get(task)
    if task_settings is not None and not isinstance(task_settings, Mapping):
        raise ConfigError(f"{settings_origin}: quality.{task} must be a mapping of thresholds")
    limits = quality.check_thresholds(task, task_settings, f"{settings_origin} quality.{task}", ConfigError)
    return QualityCheck(task, items, limits, labels)


def quality_gate(client: TritonClient, new: FetchedVersion, old: FetchedVersion, check: QualityCheck,
                 repository: Path | None = None) -> GateResult:
    """A text service's new version against the version it replaces, on the user's own items (the JSON lines
    of ``trm publish model --eval-data``): both loaded, every item answered by both, the replaced version's
    answers the reference, judged by the quality thresholds (``settings.quality`` over the defaults). The
    figures come from one deterministic pass over the same items: there is no noise for rounds to average."""
    from repo_manager.ops.publish.huggingface import OUTPUTS, quality  # noqa: PLC0415 - a text service's modules only for this gate
    from repo_manager.ops.publish.huggingface.verify import to_sample  # noqa: PLC0415 - as above

    started = time.monotonic()
    items, task = check.data, check.task
    batch = max(1, min(quality.BATCH, *(v.config.max_batch_size or 1 for v in (new, old))))
    answers: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    with loaded(client, new, old, repository=repository) as names:
        for start in range(0, len(items.items), batch):
            request = to_sample(items.items[start:start + batch], task)
            for name, answered in zip(names, answers):
                answered.append(np.asarray(client.infer(name, request)[OUTPUTS[task]], dtype=np.float64))
    served, expected = (np.concatenate(a).reshape(len(items.items), -1) for a in answers)
    precisions = [v.manifest.source.get("precision") if isinstance(v.manifest.source, dict) else None
                  for v in (new, old)]
    details: dict[str, Any] = {"data": items.record(), "thresholds": check.thresholds, "task": task,
                               "reference": f"version {old.manifest.version}",
                               "precision": {"new": precisions[0], "old": precisions[1]}}
    if served.shape != expected.shape:
        return GateResult("quality", False, f"answers of another shape than version {old.manifest.version}'s: "
                          f"{served.shape[1]} values an item against {expected.shape[1]}", details,
                          time.monotonic() - started)
    figures = quality.drift_figures(task, served, expected, items, check.labels)
    misses = quality.judge(figures, check.thresholds)
    details["figures"] = figures
    name = items.path.name
    if misses:
        return GateResult("quality", False, f"drifts from version {old.manifest.version} on {name}: "
                          + "; ".join(misses), details, time.monotonic() - started)
    shown = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in figures.items())
    return GateResult("quality", True, f"{len(items.items)} items of {name} answered like version "
                      f"{old.manifest.version}: {shown}", details, time.monotonic() - started)


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
    if not command.strip():
        raise UsageError("the eval gate needs a command", hint="pass --eval-cmd or set eval.command in the spec")
    versions = (new, old) if old else (new,)
    with loaded(client, *versions, repository=repository) as names:
        return run_eval(client.url, names, new, old, command, threshold, timeout_s)


def run_eval(url: str, names: list[str], new: FetchedVersion, old: FetchedVersion | None, command: str,
             threshold: float, timeout_s: float = 1800.0) -> GateResult:
    """The eval gate on versions already loaded under ``names`` (the new one first, then the replaced one)."""
    started = time.monotonic()
    env = dict(os.environ, TRM_EVAL_URL=url, TRM_EVAL_MODEL=names[0],
               TRM_EVAL_NAME=new.manifest.model, TRM_EVAL_VERSION=str(new.manifest.version))
    if old and len(names) > 1:
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
