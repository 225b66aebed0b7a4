"""What a rollout checks: the smoke check of a new version and the soak watch of a changed server.

Smoke check: requests built from the config (``repo_manager.adapters.loadgen.inputs``) whose answers must have every
declared output with the declared type and shape, or, with ``--smoke FILE``, requests whose answers must
equal the expected outputs in the file (same tolerances as publish verification). The same check runs
twice: under a temporary model name before the live model is touched (``precheck``, through
``publish.verify``), and with versioned requests to the new version once it is loaded beside the old.

Soak: for ``--soak`` seconds after a server changed, trm sends a light stream of its own probe requests
(through the shared load generator) and reads Triton's statistics for the model: the error rate is the
share of failed requests among everything the server answered (all clients' traffic, not only the
probes), the p99 is the probes' p99, compared with the probes' p99 measured just before the change.

Smoke file (JSON)::

    {"cases": [{"inputs": {"X": [[1, 2, 3, 4]]}, "outputs": {"Y": [[2, 4, 6, 8]]}}]}

Data types come from the model's config; ``outputs`` may list only some outputs, or be left out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.adapters.loadgen import BackgroundLoad, StatsSnapshot, Workload
from repo_manager.adapters.loadgen.inputs import verification_samples
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, TrmError, VerificationError
from repo_manager.core.manifest import MANIFEST_NAME
from repo_manager.ops.llm.generate import generate
from repo_manager.ops.verify import (
    Candidate,
    LoadedCandidates,
    check_against_config,  # the check publish uses
    compare,
    once_more_if_a_stub_stalled,
)

# Below this, a p99 difference is timer noise on a busy host, not a regression.
P99_SLACK_MS = 5.0


@dataclass(frozen=True)
class SmokeCase:
    inputs: dict[str, np.ndarray]
    expected: dict[str, np.ndarray] | None = None


def smoke_cases(config: cfg.ModelConfig, smoke_file: Path | None) -> list[SmokeCase]:
    if smoke_file is None:
        return [SmokeCase(sample) for sample in verification_samples(config)]
    try:
        data = json.loads(Path(smoke_file).read_text())
        raw_cases = data["cases"]
        if not isinstance(raw_cases, list) or not raw_cases:
            raise TypeError("'cases' must be a non-empty list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"smoke file {smoke_file} is not usable: {exc}",
                         hint='expected {"cases": [{"inputs": {...}, "outputs": {...}}]}') from exc
    tensors = {t.name: t for t in list(config.input) + list(config.output)}
    inputs = {t.name for t in config.input}
    cases = []
    for number, case in enumerate(raw_cases, 1):
        where = f"smoke file {smoke_file}, case {number}"
        if not isinstance(case, dict) or not case.get("inputs"):
            raise InputError(f"{where}: a case is a mapping with 'inputs' (and optionally 'outputs')",
                             hint='expected {"cases": [{"inputs": {...}, "outputs": {...}}]}')
        arrays: dict[str, dict[str, np.ndarray]] = {}
        for kind in ("inputs", "outputs"):
            arrays[kind] = {}
            given = case.get(kind)
            if not isinstance(given if given is not None else {}, dict):
                raise InputError(f"{where}: '{kind}' must map tensor names to values",
                                 hint='expected {"cases": [{"inputs": {...}, "outputs": {...}}]}')
            for name, value in (given or {}).items():
                if name not in tensors or (kind == "inputs") != (name in inputs):
                    raise InputError(f"{where}: {config.name} has no {kind[:-1]} tensor {name!r}",
                                     hint=f"tensors: {', '.join(tensors)}")
                tensor = tensors[name]
                dtype = np.object_ if tensor.data_type == cfg.mc.TYPE_STRING else cfg.numpy_dtype(tensor.data_type)
                try:
                    array = np.asarray(value, dtype=dtype)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise InputError(f"{where}: {name} is not {cfg.mc.DataType.Name(tensor.data_type)} values "
                                     f"({str(exc)[:100]})") from None
                dims = ([-1] if config.max_batch_size > 0 else []) + list(tensor.dims)
                if kind == "inputs" and (array.ndim != len(dims) or
                                         any(d != -1 and d != n for d, n in zip(dims, array.shape))):
                    raise InputError(f"{where}: {name} has shape {list(array.shape)}, {config.name} takes {dims}"
                                     + (" (the first axis is the batch)" if config.max_batch_size > 0 else ""))
                arrays[kind][name] = array
        cases.append(SmokeCase(arrays["inputs"], arrays["outputs"] or None))
    return cases


def check_answer(config: cfg.ModelConfig, case: SmokeCase, answer: dict[str, np.ndarray]) -> None:
    """VerificationError unless ``answer`` is what ``case`` expects (or what the config declares)."""
    for out in config.output:
        if out.name not in answer:
            raise VerificationError(f"output {out.name} missing from Triton's answer")
        if case.expected is not None and out.name in case.expected:
            compare(out.name, answer[out.name], case.expected[out.name])
        else:
            check_against_config(config, out, answer[out.name], case.inputs)


SMOKE_PROMPT, SMOKE_TOKENS = "Hello", 4
"""A streaming LLM (vLLM's interface) is smoke-checked with one generation of this many tokens."""


def generates(config: cfg.ModelConfig) -> bool:
    """A decoupled model with a ``text_input`` (vLLM's interface): Triton refuses plain HTTP inference for it,
    so it is checked with a streamed generation instead."""
    return (config.model_transaction_policy.decoupled
            and any(t.name == "text_input" for t in config.input))


def smoke_generation(client: TritonClient, model: str, version: int | None, what: str) -> int:
    """One streamed generation of SMOKE_TOKENS tokens from ``model`` (``version``, when given)."""

    try:
        result = generate(client.url, model, SMOKE_PROMPT,
                          {"max_tokens": SMOKE_TOKENS, "temperature": 0, "ignore_eos": True}, version=version)
    except TrmError as exc:
        raise VerificationError(f"smoke generation by {what} failed: {exc.message}", model=model,
                                version=version) from exc
    if result.num_output_tokens < 1 and not result.text:
        raise VerificationError(f"smoke generation by {what} produced no tokens", model=model, version=version)
    return 1


def smoke_live(client: TritonClient, model: str, version: int, config: cfg.ModelConfig,
               cases: list[SmokeCase]) -> int:
    """Versioned requests to the freshly loaded version; returns how many passed."""
    if generates(config):
        return smoke_generation(client, model, version, f"{model} version {version}")
    for case in cases:
        try:
            answer = client.infer(model, case.inputs, version=version)
        except TrmError as exc:
            raise VerificationError(f"smoke request to {model} version {version} failed: {exc.message}",
                                    model=model, version=version) from exc
        check_answer(config, case, answer)
    return len(cases)


def precheck(client: TritonClient, repo: LocalRepository, names: list[tuple[str, int]], entry: str,
             cases: list[SmokeCase]) -> int:
    """Load the target set under temporary names (``publish.verify``) and smoke-check it there.

    An ensemble alone in ``names`` keeps its steps pinned to the real member versions, which must be
    loaded already.

    ModelLoadError when it does not load; VerificationError when it answers wrongly (a request failed because a
    stub was declared unhealthy: once more on freshly loaded candidates first, as ``verify`` does). Returns the
    number of requests checked.
    """
    candidates = []
    for name, version in names:
        manifest = repo.manifest(name, version)
        folder = repo.version_dir(name, version)
        files = {f.path: folder / f.path for f in manifest.files}
        # An ensemble has no files, but a load with file overrides needs at least one to create the
        # version folder (without any, Triton looks for the temporary name in its repository and fails).
        files = files or {MANIFEST_NAME: folder / MANIFEST_NAME}
        candidates.append(Candidate(name, cfg.parse_config(manifest.config, f"manifest of {name}/{version}"),
                                    files, manifest.model_files))
    entry_config = next(c.config for c in candidates if c.name == entry)

    def attempt() -> int:
        with LoadedCandidates(client, candidates) as loaded:
            if generates(entry_config):
                return smoke_generation(client, loaded.names[entry], None, f"{entry} (pre-check)")
            for case in cases:
                try:
                    answer = client.infer(loaded.names[entry], case.inputs)
                except TrmError as exc:
                    raise VerificationError(f"smoke request to {entry} (pre-check) failed: {exc.message}") from exc
                check_answer(entry_config, case, answer)
        return len(cases)

    # a request failed by a stub its host stalled is no verdict on the set: loaded afresh and checked once more
    return once_more_if_a_stub_stalled(attempt)[0]


# ------------------------------------------------------------------------------------------ soak
@dataclass(frozen=True)
class Watch:
    """What one server did during a watch window."""

    seconds: float
    requests: int
    """Requests the server answered for the model (all clients), from Triton's statistics."""
    failed: int
    probes: int
    probe_failures: int
    p99_ms: float | None

    @property
    def error_rate(self) -> float:
        total = self.requests + self.probe_failures
        return (self.failed + self.probe_failures) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "requests": self.requests, "failed": self.failed,
                "probes": self.probes, "probe_failures": self.probe_failures,
                "error_rate": round(self.error_rate, 5),
                "p99_ms": None if self.p99_ms is None else round(self.p99_ms, 3)}


def watch(url: str, model: str, seconds: float, workload: Workload | None = None) -> Watch:
    """Probe ``model`` on ``url`` for ``seconds`` and read Triton's counters around it."""
    with TritonClient(url, timeout_s=10.0) as client:
        before = StatsSnapshot.read(client, model)
        started = time.monotonic()
        with BackgroundLoad(url, model, clients=1, interval_s=0.02, workload=workload,
                            timeout_s=10.0) as probes:
            time.sleep(seconds)
        after = StatsSnapshot.read(client, model)
    records = probes.records
    latencies = [r.latency_s * 1000 for r in records if r.ok]
    p99 = float(np.percentile(latencies, 99)) if latencies else None
    return Watch(seconds=time.monotonic() - started,
                 requests=max(0, after.success - before.success) + max(0, after.fail - before.fail),
                 failed=max(0, after.fail - before.fail), probes=len(records),
                 probe_failures=sum(not r.ok for r in records), p99_ms=p99)


def breach(baseline: Watch | None, soak: Watch, max_error_rate: float, max_p99_increase: float) -> str | None:
    """Why the soak window breaks a threshold, or None when it does not."""
    if soak.error_rate > max_error_rate:
        return (f"error rate {soak.error_rate:.2%} over the limit {max_error_rate:.2%} "
                f"({soak.failed + soak.probe_failures} failed)")
    if baseline is not None and baseline.p99_ms is not None and soak.p99_ms is not None:
        limit = baseline.p99_ms * (1 + max_p99_increase) + P99_SLACK_MS
        if soak.p99_ms > limit:
            return (f"p99 {soak.p99_ms:.1f} ms over the limit {limit:.1f} ms "
                    f"(before: {baseline.p99_ms:.1f} ms, --max-p99-increase {max_p99_increase:g})")
    return None
