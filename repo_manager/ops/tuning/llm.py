"""`trm tune-batching` for a vLLM model: ``max_num_seqs`` and ``max_num_batched_tokens`` chosen by measurement.

A vLLM model has no Triton batching (``max_batch_size: 0``): the engine batches inside, bounded by
``max_num_seqs`` (sequences in one step) and ``max_num_batched_tokens`` (tokens in one step: prefill
chunks and decodes together). Its latency is two numbers, time to first token (TTFT) and inter-token
latency (ITL), so the SLO is ``--ttft-p99-ms`` and ``--itl-p99-ms``, and a setting's worth is its
**goodput**: requests per second that met both (genai-perf's definition, ``loadgen.llm``).

Each candidate is applied with Triton's load API: the served config and a ``<version>/model.json`` override
(the engine starts again with those arguments; no file is written). Each point is open-loop Poisson
traffic of ``LLMLoad`` streams at a rate; a candidate **meets** a level when no request failed or broke and
both p99s are within the SLO.

The search (``search="fast"``, the default) uses two facts of an engine under a fixed offered rate:
more sequences only help until the batch holds what arrives (then nothing changes: the batch is not
filled), so "meets at peak" is monotone in ``max_num_seqs`` and a bisection finds the smallest that meets;
``max_num_batched_tokens`` trades TTFT (large prefill chunks) against ITL (small ones interleave prefill
with decodes), so it is moved only in the direction of the SLO that missed. The choice is then measured at
the low rate too. ``search="grid"`` measures every combination at both rates (the reference the bench
compares with: ``bench/bench_tune_llm.py``). The choice, in both: among candidates that meet at low and
peak, the highest peak goodput; within ``TIE`` of it the smaller ``max_num_seqs`` (less KV cache
reserved), then the smaller token budget.

The record, report and ``--write`` are the dynamic batcher's (``core.write_version_from``, ``report``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repo_manager.adapters.loadgen import Target
from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, LLMResult, calibrate, run_llm
from repo_manager.adapters.repository import LocalRepository
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, NotFoundError, ServerError, UsageError
from repo_manager.core.manifest import now_iso
from repo_manager.core.settings import Settings
from repo_manager.ops.llm import vllm as layout
from repo_manager.ops.tuning.core import environment, quiet, served_model, write_version_from
from repo_manager.ops.tuning.prober import Progress

VLLM_DEFAULT_BATCHED_TOKENS = 2048
"""vLLM's ``max_num_batched_tokens`` for a served engine without one (vllm 0.32: CPU and most GPUs; 8192 on
an H100/H200): what a model.json that names none runs with."""
DEFAULT_SEQS = (1, 2, 4, 8, 16, 32)
DEFAULT_TOKENS = (256, 1024, 4096)
CANDIDATE_PARAMETER = "trm_tuning_candidate"
"""A config parameter naming the candidate being measured (only while tuning; no backend reads it)."""
ENGINE_START_TIMEOUT_S = 1800.0
"""How long an engine start (a load through the API) may take: minutes on a busy CPU."""
TIE = 0.05
"""Goodputs within this share of the best are a tie (broken by the smaller setting): short windows of
Poisson arrivals differ by a few percent between identical runs."""
ENOUGH = 0.98
"""A peak point whose goodput is at least this share of its completed rate leaves no room for more
sequences to help: every answered request was within the SLO."""


@dataclass(frozen=True, order=True)
class EngineCandidate:
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def key(self) -> str:
        return f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens}"

    def apply(self, engine_args: dict[str, Any]) -> dict[str, Any]:
        return {**engine_args, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens}

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens}


@dataclass(frozen=True)
class LLMPoint:
    candidate: str
    level: str
    """``low`` or ``peak``."""
    rate: float
    meets_slo: bool
    seconds: float
    """The measurement's wall time (an engine start before it is the prober's ``load_seconds``)."""
    note: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    """What was measured (``measured``): counts, goodput, throughputs, TTFT/ITL percentiles; empty when the
    engine did not start."""

    @property
    def goodput(self) -> float:
        return float(self.figures.get("goodput_rps") or 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "level": self.level, "rate": self.rate, "meets_slo": self.meets_slo,
                "seconds": round(self.seconds, 2), "note": self.note, **self.figures}


def measured(r: LLMResult) -> dict[str, Any]:
    return {"requests": r.requests, "completed": r.completed, "failed": r.failed, "broken": r.broken,
            "goodput_rps": round(r.goodput or 0.0, 3), "request_throughput_rps": round(r.request_throughput, 3),
            "output_token_throughput": round(r.output_token_throughput, 1),
            "ttft_p99_ms": _p99(r.ttft_ms), "itl_p99_ms": _p99(r.itl_ms), "ttft_p50_ms": _p50(r.ttft_ms),
            "itl_p50_ms": _p50(r.itl_ms), "send_lag_p95_ms": round(r.send_lag_p95_ms, 1)}


def _p99(d: Any) -> float | None:
    return round(d.p99, 2) if d is not None else None


def _p50(d: Any) -> float | None:
    return round(d.p50, 2) if d is not None else None


def check_vllm(model: str, backend: str) -> None:
    if backend != "vllm":
        raise InputError(f"{model} is not a vLLM model (backend {backend or 'unknown'}): --ttft-p99-ms and "
                         "--itl-p99-ms tune a vLLM engine", hint="tune a Triton-batched model with --p99-ms",
                         model=model)


@dataclass(frozen=True)
class LLMTuneRequest:
    model: str
    ttft_p99_ms: float
    itl_p99_ms: float
    low_rps: float
    peak_rps: float
    seqs: tuple[int, ...] = DEFAULT_SEQS
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    search: str = "fast"
    requests: int = 100
    """Measured requests per point (after ``warmup_requests``)."""
    warmup_requests: int = 2
    input_tokens: int = 128
    output_tokens: int = 64
    write: bool = False
    report_dir: Path | None = None

    def check(self) -> None:
        for flag, value in (("--ttft-p99-ms", self.ttft_p99_ms), ("--itl-p99-ms", self.itl_p99_ms)):
            if not value > 0:
                raise UsageError(f"{flag} must be positive, not {value}")
        if not 0 < self.low_rps <= self.peak_rps:
            raise UsageError(f"need 0 < --low-rps <= --peak-rps (got {self.low_rps} and {self.peak_rps})")
        if self.search not in ("fast", "grid"):
            raise UsageError(f"--search must be fast or grid, not {self.search}")
        for flag, values in (("--max-num-seqs", self.seqs), ("--max-num-batched-tokens", self.tokens)):
            if not values or any(v < 1 for v in values):
                raise UsageError(f"{flag} needs whole numbers of at least 1")
        if self.requests < 1 or self.warmup_requests < 0:
            raise UsageError(f"--requests must be at least 1, not {self.requests}")
        if self.input_tokens < 1 or self.output_tokens < 2:
            raise UsageError("--input-tokens must be at least 1 and --output-tokens at least 2 (ITL needs two)")

    def check_target(self, settings: Settings) -> None:
        """Everything that can be refused before a server starts."""
        self.check()
        repo = LocalRepository(settings.repository)
        known = self.model in repo.models()
        if self.write and not known:
            raise NotFoundError(f"--write needs {self.model} in the repository {settings.repository}",
                             hint="pass --repo with the repository the model was published to", model=self.model)
        if known and not settings.triton_url:
            check_vllm(self.model, repo.config(self.model).backend)
            versions = repo.versions(self.model)
            if versions:  # the version the embedded server will serve: refused before the engine starts
                path = repo.version_dir(self.model, max(versions)) / layout.ENGINE_ARGS_FILE
                try:
                    self.check_fits(json.loads(path.read_text()).get("max_model_len"))
                except (OSError, ValueError, AttributeError):
                    pass  # the served engine's own arguments are checked once it runs

    def check_fits(self, max_model_len: Any) -> None:
        """Prompt and generation must fit the engine's context, or every request would be refused."""
        if max_model_len and self.input_tokens + self.output_tokens > int(max_model_len):
            raise UsageError(f"prompts of {self.input_tokens} tokens and {self.output_tokens} generated do not "
                             f"fit {self.model}'s max_model_len of {max_model_len} tokens",
                             hint="lower --input-tokens or --output-tokens", model=self.model)


    def candidates(self, max_model_len: int | None) -> list[EngineCandidate]:
        """The grid: every (seqs, tokens) vLLM accepts (tokens >= seqs; a candidate whose budget is below
        max_model_len is fine: vLLM's V1 engine chunks prefills)."""
        return sorted(EngineCandidate(s, t) for s in set(self.seqs) for t in set(self.tokens) if t >= s)

    def slo(self) -> dict[str, Any]:
        return {"ttft_p99_ms": self.ttft_p99_ms, "itl_p99_ms": self.itl_p99_ms, "low_rps": self.low_rps,
                "peak_rps": self.peak_rps, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens}


@dataclass(frozen=True)
class LLMOutcome:
    chosen: EngineCandidate | None
    points: tuple[LLMPoint, ...]
    search: str
    loads: int
    notes: tuple[str, ...] = ()
    load_errors: dict[str, str] = field(default_factory=dict)
    load_seconds: dict[str, float] = field(default_factory=dict)

    def best_peak_goodput(self) -> float:
        return max((p.goodput for p in self.points if p.level == "peak"), default=0.0)

    def point(self, key: str, level: str) -> LLMPoint | None:
        return next((p for p in reversed(self.points) if p.candidate == key and p.level == level), None)


@dataclass(frozen=True)
class LLMTuneResult:
    model: str
    version: int | None
    server: str
    slo: dict[str, Any]
    environment: dict[str, Any]
    current: EngineCandidate
    outcome: LLMOutcome
    seconds: float
    written_version: int | None = None
    report_files: tuple[str, ...] = ()
    prompt: dict[str, Any] = field(default_factory=dict)
    """How the prompts were made: their tokens, the tokenizer's tokens per word (asked of the server) and
    the words that makes."""

    @property
    def chosen(self) -> EngineCandidate | None:
        return self.outcome.chosen

    @property
    def status(self) -> str:
        return "chosen" if self.chosen else "no-candidate"

    def evidence(self) -> dict[str, Any]:
        if self.chosen is None:
            return {}
        peak, low = self.outcome.point(self.chosen.key, "peak"), self.outcome.point(self.chosen.key, "low")
        return {"peak": peak.to_dict() if peak else None, "low": low.to_dict() if low else None,
                "rule": "meets both p99 SLOs at low and peak; highest peak goodput, then the smaller setting"}

    def record(self) -> dict[str, Any]:
        o = self.outcome
        return {"tool": "trm tune-batching", "kind": "vllm", "created_at": now_iso(), "model": self.model,
                "status": self.status, "tuned_from_version": self.version, "server": self.server, "slo": self.slo,
                "environment": self.environment, "search": o.search, "search_seconds": round(self.seconds, 1),
                "engine_loads": o.loads, "prompt": dict(self.prompt), "current": self.current.to_dict(),
                "chosen": self.chosen.to_dict() if self.chosen else None, "evidence": self.evidence(),
                "notes": list(o.notes), "load_errors": dict(o.load_errors),
                "load_seconds": {k: round(v, 1) for k, v in o.load_seconds.items()},
                "points": [p.to_dict() for p in o.points]}

    def to_dict(self) -> dict[str, Any]:
        return {**self.record(), "written_version": self.written_version, "report_files": list(self.report_files)}


# ---------------------------------------------------------------------------------------- measuring

class LLMProber:
    """Loads engine candidates on the server and measures them (each (candidate, level) once)."""

    def __init__(self, client: Any, model: str, version: int, base_config: Any, engine_args: dict[str, Any],
                 request: LLMTuneRequest, progress: Progress, *, served: EngineCandidate | None = None) -> None:
        self.client, self.model, self.version = client, model, version
        self.base_config, self.engine_args, self.request = base_config, engine_args, request
        self.target = Target(model, client.url)
        self.progress = progress
        self.started = time.monotonic()
        self.points: list[LLMPoint] = []
        self.served = served
        self.loaded: str | None = served.key if served else None
        """The candidate the engine runs now (at the start: the served one, measured without a restart)."""
        self.loads = 0
        self.tokens_per_word = 1.0
        """Of the model's tokenizer (``calibrate`` on the served engine): prompts of ``input_tokens`` tokens."""
        self.load_errors: dict[str, str] = {}
        self.load_seconds: dict[str, float] = {}
        """Seconds the engine took to start with each candidate (the search's main cost on CPU)."""

    def say(self, message: str) -> None:
        self.progress(message, time.monotonic() - self.started, 0.0)

    def load(self, candidate: EngineCandidate) -> bool:
        if self.loaded == candidate.key:
            return True
        if candidate.key in self.load_errors:
            return False
        self.say(f"starting the engine with {candidate.key}")
        started = time.monotonic()
        try:
            self.load_engine(candidate)
            self.load_seconds[candidate.key] = time.monotonic() - started
        except ServerError as exc:
            self.load_errors[candidate.key] = exc.message
            self.loaded = None
            return False
        self.loaded = candidate.key
        return True

    def load_engine(self, candidate: EngineCandidate) -> None:
        """Restart the engine with ``candidate``: the served config naming the candidate (Triton reloads a
        model only when its config changed: with the same config and a new model.json alone it answered
        "successfully loaded" and kept the running engine) and the candidate's model.json as a file override."""

        self.loads += 1
        config = cfg.ModelConfig.FromString(self.base_config.SerializeToString())
        config.parameters[CANDIDATE_PARAMETER].string_value = candidate.key
        engine_json = (json.dumps(candidate.apply(self.engine_args)) + "\n").encode()
        self.client.load(self.model, config, files={f"{self.version}/{layout.ENGINE_ARGS_FILE}": engine_json})
        served = self.client.model_config(self.model).parameters.get(CANDIDATE_PARAMETER)
        if served is None or served.string_value != candidate.key:
            raise ServerError(f"{self.model} was not reloaded with {candidate.key} (the server serves "
                              f"{served.string_value if served else 'the config it had'})", model=self.model)

    def point(self, candidate: EngineCandidate, level: str) -> LLMPoint:
        done = next((p for p in self.points if p.candidate == candidate.key and p.level == level), None)
        if done is not None:
            return done
        rate = self.request.low_rps if level == "low" else self.request.peak_rps
        if not self.load(candidate):
            point = LLMPoint(candidate.key, level, rate, False, 0.0,
                             f"the engine did not start: {self.load_errors[candidate.key]}")
            self.points.append(point)
            return point
        self.say(f"measuring {candidate.key} at {rate:g} requests/s ({level})")
        started = time.monotonic()
        r = self.request
        # a stream still open after 4 times what the SLOs allow it is cut (counted broken): a saturated
        # candidate costs bounded time
        timeout_s = 4 * (r.ttft_p99_ms + r.output_tokens * r.itl_p99_ms) / 1000 + 2
        load = LLMLoad(rate=rate, requests=r.requests, warmup_requests=r.warmup_requests,
                       input_tokens=Lengths(r.input_tokens), tokens_per_word=self.tokens_per_word,
                       output_tokens=Lengths(r.output_tokens),
                       ttft_slo_ms=r.ttft_p99_ms, itl_slo_ms=r.itl_p99_ms, timeout_s=timeout_s)
        result = run_llm(self.target, load)
        refused_all(result, self.model)
        meets, note = judge(result, r)
        point = LLMPoint(candidate.key, level, rate, meets, time.monotonic() - started, note, measured(result))
        self.points.append(point)
        return point


REFUSALS = ("HTTP 400", "gRPC INVALID_ARGUMENT")
"""How the model refuses a request as invalid: the same request is refused under every engine setting."""


def refused_all(result: LLMResult, model: str) -> None:
    """Stop the search when the model refused every request as invalid: no setting can change that, and
    measuring the others would only take their engine starts."""
    samples = result.error_samples
    if result.failed == result.requests and samples and all(e.startswith(REFUSALS) for e in samples):
        raise UsageError(f"{model} refused every request of the tuning load: {samples[0][:300]}",
                         hint="change --input-tokens or --output-tokens to what the model accepts", model=model)


def judge(result: LLMResult, request: LLMTuneRequest) -> tuple[bool, str]:
    """(meets both SLOs, why not)."""
    if result.failed or result.broken:
        sample = result.error_samples[0] if result.error_samples else "no final response"
        return False, f"{result.failed} failed, {result.broken} broken ({sample})"
    ttft = result.ttft_ms.p99 if result.ttft_ms else math.inf
    itl = result.itl_ms.p99 if result.itl_ms else math.inf
    misses = [f"TTFT p99 {ttft:.0f} ms > {request.ttft_p99_ms:g}"] if ttft > request.ttft_p99_ms else []
    misses += [f"ITL p99 {itl:.1f} ms > {request.itl_p99_ms:g}"] if itl > request.itl_p99_ms else []
    return not misses, "; ".join(misses)


def _ttft_missed(point: LLMPoint, request: LLMTuneRequest) -> bool:
    f = point.figures
    return f.get("ttft_p99_ms") is None or f["ttft_p99_ms"] > request.ttft_p99_ms or bool(f["failed"] or f["broken"])


def _itl_missed(point: LLMPoint, request: LLMTuneRequest) -> bool:
    return (point.figures.get("itl_p99_ms") or 0.0) > request.itl_p99_ms


# ---------------------------------------------------------------------------------------- searching

def _preferred(goodputs: dict[EngineCandidate, float]) -> EngineCandidate:
    """The highest goodput; within ``TIE`` of it the smaller setting."""
    best = max(goodputs.values())
    return min(c for c, goodput in goodputs.items() if goodput >= best * (1 - TIE))


def choose(points: list[LLMPoint], candidates: list[EngineCandidate]) -> EngineCandidate | None:
    """Among candidates that met at low and peak: the highest peak goodput, ties to the smaller setting."""
    met = {}
    for c in candidates:
        levels = {p.level: p for p in points if p.candidate == c.key}
        if all(levels.get(level) is not None and levels[level].meets_slo for level in ("low", "peak")):
            met[c] = levels["peak"].goodput
    return _preferred(met) if met else None


def grid_search(prober: LLMProber, candidates: list[EngineCandidate]) -> list[str]:
    for c in candidates:
        for level in ("peak", "low"):
            prober.point(c, level)
    return []


def fast_search(prober: LLMProber, candidates: list[EngineCandidate], start_tokens: int) -> list[str]:
    """Bisection over max_num_seqs at the token budget nearest ``start_tokens``, then the token budget moved
    towards the SLO that missed, then the low rate for the best; see the module's docstring."""
    request, notes = prober.request, []
    tokens = sorted({c.max_num_batched_tokens for c in candidates})
    t0 = min(tokens, key=lambda t: (abs(math.log(t / start_tokens)), t))
    seqs = sorted({c.max_num_seqs for c in candidates if c.max_num_batched_tokens == t0})
    by_key = {c.key: c for c in candidates}

    def at(s: int, t: int) -> EngineCandidate | None:
        return by_key.get(EngineCandidate(s, t).key)

    lo, hi, best = 0, len(seqs) - 1, None
    while lo <= hi:  # the smallest seqs that meets at peak
        mid = (lo + hi + 1) // 2  # the upper middle: the served setting is often the largest, measured for free
        point = prober.point(at(seqs[mid], t0), "peak")
        if point.meets_slo:
            best, hi = at(seqs[mid], t0), mid - 1
        elif _itl_missed(point, request) and not _ttft_missed(point, request):
            hi = mid - 1  # more sequences per step only lengthen each step
        else:
            lo = mid + 1
    if best is None:
        measured = [p for p in prober.points if p.level == "peak"]
        top = max(measured, key=lambda p: p.goodput, default=None)
        if top is None:
            return ["nothing could be measured"]
        base = by_key[top.candidate]
        notes.append(f"no max_num_seqs met both SLOs at peak with max_num_batched_tokens {t0}: moving the token "
                     "budget from the best")
        order = tokens[tokens.index(t0) + 1:] if _ttft_missed(top, request) else tokens[:tokens.index(t0)][::-1]
        for t in order:
            candidate = at(base.max_num_seqs, t)
            if candidate is None:
                continue
            point = prober.point(candidate, "peak")
            if point.meets_slo:
                best = candidate
                break
            if point.goodput <= top.goodput:
                break
            top = point
    elif prober.point(best, "peak").goodput < ENOUGH * prober.point(best, "peak").figures["request_throughput_rps"]:
        notes.append("the smallest max_num_seqs that met at peak left requests outside the SLO: "
                     "one larger one measured too")
        index = seqs.index(best.max_num_seqs)
        if index + 1 < len(seqs):
            prober.point(at(seqs[index + 1], t0), "peak")
    # the low rate for the candidates that met at peak, in the order of the choice, until one meets there too
    met = {by_key[p.candidate]: p.goodput for p in prober.points if p.level == "peak" and p.meets_slo}
    while met:
        candidate = _preferred(met)
        if prober.point(candidate, "low").meets_slo:
            break
        del met[candidate]
    return notes


def tune_llm(settings: Settings, request: LLMTuneRequest, progress: Progress = quiet) -> LLMTuneResult:
    """Serve the model (``settings.triton_url`` or the embedded server), search, restore, record, write."""
    from repo_manager.ops.tuning.report import write_llm_report  # noqa: PLC0415 - matplotlib only for a report

    request.check_target(settings)
    started = time.monotonic()
    with served_model(settings, request.model, timeout_s=ENGINE_START_TIMEOUT_S) as served:
        check_vllm(request.model, served.base.backend)
        repo = LocalRepository(settings.repository)
        version = served.version
        if version is None or version not in repo.versions(request.model):
            raise InputError(f"{request.model} version {version} is not in the repository {settings.repository}: "
                             "its engine arguments (model.json) are read from there",
                             hint="pass --repo with the repository the served version came from", model=request.model)
        engine_args = json.loads((repo.version_dir(request.model, version) / layout.ENGINE_ARGS_FILE).read_text())
        current = EngineCandidate(int(engine_args.get("max_num_seqs") or layout.CPU_DEFAULT_MAX_NUM_SEQS),
                                  int(engine_args.get("max_num_batched_tokens") or VLLM_DEFAULT_BATCHED_TOKENS))
        request.check_fits(engine_args.get("max_model_len"))
        env = environment(served.client, served.manifest)
        prober = LLMProber(served.client, request.model, version, served.original, engine_args, request, progress,
                           served=current)
        progress("measuring the tokenizer's tokens per prompt word (one request)", time.monotonic() - started, 0.0)
        prober.tokens_per_word = calibrate(prober.target, LLMLoad(concurrency=1, requests=1)).tokens_per_word
        prompt = {"input_tokens": request.input_tokens, "tokens_per_word": round(prober.tokens_per_word, 3),
                  "words": max(1, round(request.input_tokens / prober.tokens_per_word))}
        candidates = request.candidates(engine_args.get("max_model_len"))
        try:
            if request.search == "grid":
                notes = grid_search(prober, candidates)
            else:
                notes = fast_search(prober, candidates, current.max_num_batched_tokens)
        finally:
            # the embedded server stops on the way out: only a server that goes on serving is restored
            if settings.triton_url and prober.loads:
                progress("restoring the served engine", time.monotonic() - started, 0.0)
                prober.loads += 1
                served.client.load(request.model, served.original)
        outcome = LLMOutcome(choose(prober.points, candidates), tuple(prober.points), request.search,
                             prober.loads, tuple(notes), dict(prober.load_errors), dict(prober.load_seconds))
        result = LLMTuneResult(request.model, version, served.client.url, request.slo(), env, current, outcome,
                               time.monotonic() - started, prompt=prompt)
    if request.write and result.chosen is not None:
        written = write_llm_version(repo, result, engine_args)
        result = dataclasses.replace(result, written_version=written)
    if request.report_dir is not None:
        files = write_llm_report(Path(request.report_dir), result.to_dict())
        result = dataclasses.replace(result, report_files=files)
    return result


def write_llm_version(repo: LocalRepository, result: LLMTuneResult, engine_args: dict[str, Any]) -> int:
    """A new version: the tuned version's files and config, model.json with the chosen engine arguments."""
    assert result.chosen is not None and result.version is not None

    manifest = repo.manifest(result.model, result.version)
    config = cfg.parse_config(manifest.config, f"manifest of {result.model}/{result.version}")
    args = {k: v for k, v in result.chosen.apply(engine_args).items() if k != "model"}
    chosen = result.chosen.key
    verification = {"passed": True, "method": "trm tune-batching (vllm)", "server": result.server,
                    "requests": sum(p.figures.get("requests", 0) for p in result.outcome.points
                                    if p.candidate == chosen)}

    def model_json(version: int) -> bytes:
        return layout.engine_args_json(args, repo.version_dir(result.model, version).resolve())

    return write_version_from(repo, result.model, result.version, config, result.record(), verification,
                              model_checksum=result.environment.get("model_checksum"),
                              rewrite={layout.ENGINE_ARGS_FILE: model_json})
