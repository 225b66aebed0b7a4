"""Promotion gates of an LLM version (a streaming vLLM model: ``backend: "vllm"``, decoupled, ``max_batch_size: 0``).

A request/response gate cannot judge such a model: Triton refuses plain inference for a decoupled model, and
what users feel is time to first token and tokens per second of streams, not one answer's latency. Engine
starts take from seconds (a tiny model on CPU) to minutes, so each version is loaded **once** for all its
gates (``LoadedLLMs``), not once per gate or per round as the other gates do.

* ``load`` — the version loads under a temporary name and one streamed request (``repo_manager.adapters.loadgen.llm``)
  generates: tokens counted by the server, and the stream's final response.
* ``agreement`` — the same prompts (the sample file, or ``PROMPTS``), generated greedily (temperature 0,
  ``AGREEMENT_TOKENS`` tokens, ``ignore_eos``) by both versions, must give the same token ids (from the
  ``logprobs`` output; the text when a backend gives none). The first prompt that differs is named. It is
  chosen for a version whose checkpoint files are the replaced version's (``same_checkpoint``: only the config
  or the engine arguments in ``model.json`` changed); for new weights ``auto`` records it as skipped with the
  reason (outputs of other weights are expected to differ: ``eval`` judges them), and ``--gates agreement``
  compares them strictly anyway (a re-saved or converted checkpoint that must generate the same).
* ``latency`` — TTFT p99 of streams at the gate's rate (open loop) and output tokens/s of ``concurrency``
  streams (closed loop), both versions in interleaved rounds, judged by ``promote.latency``'s noise rules.
* ``eval`` — as for any model (``gates.run_eval``), on the versions loaded here.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, LLMResult, run_llm
from repo_manager.adapters.loadgen.measure import Target
from repo_manager.adapters.triton.client import LOAD_TIMEOUT_S, TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.environments import LLMLatencyGate
from repo_manager.core.errors import InputError, TrmError
from repo_manager.core.manifest import Manifest
from repo_manager.core.progress import Progress
from repo_manager.ops.llm.generate import generate
from repo_manager.ops.llm.vllm import ENGINE_ARGS_FILE
from repo_manager.ops.promote.gates import FetchedVersion, GateResult, skipped
from repo_manager.ops.promote.latency import Verdict, judge, overall_verdict, rounds_finished, spread_words
from repo_manager.ops.rollout.checks import SMOKE_PROMPT, SMOKE_TOKENS, generates
from repo_manager.ops.verify import LoadedCandidates

AGREEMENT_TOKENS = 16
"""Tokens generated per prompt by the agreement gate (exactly this many: ``ignore_eos``)."""
PROMPTS = ("Hello", "The quick brown fox jumps over the lazy dog.", "Zürich, Tōkyō et São Paulo: naïve café",
           "東京は日本の首都です。", "def main():\n    return", "Once upon a time, in a land far away,")
"""The agreement gate's prompts without a sample file: short and long, accents, CJK, code."""
METRICS = ("ttft_p99", "tokens_per_s")


def is_llm(config: cfg.ModelConfig) -> bool:
    """A streaming generation model (vLLM's interface), gated by this module."""
    return generates(config)


def _checkpoint_files(manifest: Manifest) -> dict[str, tuple[str, int]]:
    return {f.path: (f.sha256, f.size) for f in manifest.files if f.path != ENGINE_ARGS_FILE}


def same_checkpoint(new: Manifest, old: Manifest) -> bool:
    """Every file but the engine arguments (``model.json``, which also names the version's own folder) is the
    replaced version's: the same weights and tokenizer, only the config or engine arguments changed."""
    return _checkpoint_files(new) == _checkpoint_files(old) and new.members == old.members


def weights_changed_reason(new: Manifest, old: Manifest) -> str:
    """Why ``auto`` skips the agreement gate of a version with other checkpoint files."""
    a, b = _checkpoint_files(new), _checkpoint_files(old)
    changed = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
    named = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"the checkpoint changed ({named} differ from version {old.version}): greedy outputs of other weights "
            "are expected to differ, so they are not compared (name the gate in --gates to compare them anyway; "
            "an eval command judges new weights)")


def read_prompts(sample: Path | None) -> list[str]:
    """Prompts from a sample file (a JSON list of strings, ``{"prompts": [...]}``, or plain text with one prompt
    a line), or ``PROMPTS``."""
    if sample is None:
        return list(PROMPTS)
    try:
        text = Path(sample).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"sample file {sample} cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError:
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise InputError(f"sample file {sample} holds no prompts",
                         hint='for an LLM: a JSON list of prompts, {"prompts": [...]}, or one prompt a line')
    return prompts


# ---------------------------------------------------------------------------------------------- running
class LoadedLLMs:
    """Each version loaded once, under its own temporary name, for every gate of one promotion; unloaded at the
    end. ``name(side)`` loads on first use (``new`` or ``old``) and raises the load's TrmError (the same one
    again for a later gate: a load that failed is not tried twice)."""

    def __init__(self, client: TritonClient, versions: dict[str, FetchedVersion | None],
                 repository: Path | None) -> None:
        self.versions, self.repository = versions, repository
        self._stack = ExitStack()
        # an engine start takes minutes for a large model: every call of this client (loads, the gates'
        # generations on a busy engine) waits as long as `trm serve`'s loads do
        self.client = self._stack.enter_context(TritonClient(client.url, timeout_s=LOAD_TIMEOUT_S,
                                                             grpc_url=client.grpc_url, api_key=client.api_key))
        self._names: dict[str, str] = {}
        self._errors: dict[str, TrmError] = {}
        self.load_s: dict[str, float] = {}

    def __enter__(self) -> LoadedLLMs:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start(self, sides: list[str]) -> None:
        """Load ``sides`` one after the other (two vLLM engines loaded at once in one server were seen never to
        turn ready here); a failure is kept for ``name``."""
        for side in sides:
            if side in self._names or side in self._errors:
                continue
            version = self.versions[side]
            assert version is not None
            started = time.monotonic()
            try:
                handle = LoadedCandidates(self.client, list(version.candidates), self.repository)
                handle.__enter__()
            except TrmError as exc:
                self._errors[side] = exc
                continue
            self._stack.push(handle.__exit__)
            self._names[side] = handle.names[version.manifest.model]
            self.load_s[side] = round(time.monotonic() - started, 2)

    def name(self, side: str) -> str:
        if side not in self._names and side not in self._errors:
            self.start([side])
        if side in self._errors:
            raise self._errors[side]
        return self._names[side]


def run_llm_gates(client: TritonClient, gates: list[str], new: FetchedVersion, old: FetchedVersion | None,
                  skip: dict[str, str], params: LLMLatencyGate, sample: Path | None, progress: Progress,
                  run_eval: Callable[[list[str]], GateResult], repository: Path | None = None) -> list[GateResult]:
    """The server gates of an LLM version, in order, on versions loaded once."""
    results: list[GateResult] = []
    with LoadedLLMs(client, {"new": new, "old": old}, repository) as llms:
        compares = old is not None and any(g in ("latency", "agreement", "eval") and g not in skip for g in gates)
        progress(f"starting the engine of {new.manifest.model}/{new.manifest.version}"
                 + (f" and of the replaced version {old.manifest.version}" if compares else ""))
        llms.start(["new", "old"] if compares else ["new"])
        for gate in gates:
            if gate in skip:
                results.append(skipped(gate, skip[gate]))
                continue
            if gate == "quality":  # item 2 of the precision issue: an LLM's figures need its engine's log-probs
                results.append(skipped(gate, "the quality gate compares text services (embedding, rerank and "
                                             "classify); an LLM version is judged by agreement and eval"))
                continue
            if gate != "load" and gate != "eval" and old is None:
                results.append(skipped(gate, "the target environment serves no earlier version to compare with"))
                continue
            progress(f"{gate}: {new.manifest.model}/{new.manifest.version} on {client.url}")
            started = time.monotonic()
            try:
                new_name = llms.name("new")
            except TrmError as exc:
                results.append(GateResult(gate, False, f"the new version did not load on {client.url}: "
                                          f"{exc.message}", {"server": client.url}, time.monotonic() - started))
                continue
            try:
                old_name = llms.name("old") if gate != "load" and old is not None else None
            except TrmError as exc:
                results.append(GateResult(gate, False, f"the replaced version {old.manifest.version} did not load on "
                                          f"{client.url}, so nothing can be compared with it: {exc.message}",
                                          {"server": client.url}, time.monotonic() - started))
                continue
            if gate == "load":
                result = load_gate(client.url, new_name, llms.load_s.get("new"))
            elif gate == "agreement":
                result = agreement_gate(client.url, new_name, old_name, new, old, sample)
            elif gate == "latency":
                result = latency_gate(client.url, {"new": new_name, "old": old_name}, params, progress)
            else:
                result = run_eval([new_name] + ([old_name] if old_name else []))
            results.append(GateResult(result.name, result.passed, result.summary, result.details,
                                      time.monotonic() - started, result.skipped))
    return results


def _stream(url: str, name: str, load: LLMLoad) -> LLMResult:
    return run_llm(Target(name, url, protocol="http"), load)


def load_gate(url: str, name: str, load_s: float | None) -> GateResult:
    """One streamed request of SMOKE_TOKENS tokens: it must complete (its final response), with tokens the
    server counts."""
    started = time.monotonic()
    result = _stream(url, name, LLMLoad(concurrency=1, requests=1, input_tokens=Lengths(len(SMOKE_PROMPT.split())),
                                        output_tokens=Lengths(SMOKE_TOKENS), timeout_s=300.0))
    details: dict[str, Any] = {"server": url, "engine_load_s": load_s, "stream": result.to_dict()}
    tokens = int(result.output_token_counts.sum()) if len(result.output_token_counts) else 0
    if result.completed != 1 or tokens < 1:
        why = (result.error_samples[0] if result.error_samples else
               "the stream ended without its final response" if result.broken else "it generated no tokens")
        return GateResult("load", False, f"loaded but did not generate on {url}: {why}", details,
                          time.monotonic() - started)
    ttft = result.ttft_ms.p50 if result.ttft_ms else None
    return GateResult("load", True, f"loaded (engine started in {load_s:g} s) and streamed {tokens} token(s) to its "
                      f"final response on {url}" + (f", first token after {ttft:.0f} ms" if ttft else ""), details,
                      time.monotonic() - started)


def _short(prompt: str) -> str:
    flat = " ".join(prompt.split())
    return f"“{flat[:40]}…”" if len(flat) > 40 else f"“{flat}”"


def agreement_gate(url: str, new_name: str, old_name: str, new: FetchedVersion, old: FetchedVersion,
                   sample: Path | None) -> GateResult:
    """Greedy generations of every prompt by both versions: equal token ids, or the first prompt that differs."""
    started = time.monotonic()
    prompts = read_prompts(sample)
    parameters = {"temperature": 0.0, "max_tokens": AGREEMENT_TOKENS, "ignore_eos": True, "logprobs": 0}
    source = str(sample) if sample else "the built-in prompts"
    details: dict[str, Any] = {"prompts": len(prompts), "source": source, "max_tokens": AGREEMENT_TOKENS,
                               "same_checkpoint": same_checkpoint(new.manifest, old.manifest)}
    was = old.manifest.version
    for number, prompt in enumerate(prompts, 1):
        try:
            want = generate(url, old_name, prompt, parameters)
        except TrmError as exc:
            return GateResult("agreement", False, f"the replaced version {was} did not answer prompt {number}: "
                              f"{exc.message}", details, time.monotonic() - started)
        try:
            got = generate(url, new_name, prompt, parameters)
        except TrmError as exc:
            return GateResult("agreement", False, f"the new version did not answer prompt {number} "
                              f"{_short(prompt)}: {exc.message}", details, time.monotonic() - started)
        by_ids = bool(want.token_ids or got.token_ids)
        if (got.token_ids != want.token_ids) if by_ids else (got.text != want.text):
            at = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                      min(len(got.token_ids), len(want.token_ids))) if by_ids else None
            where = f"from token {at + 1} on" if at is not None else "in its text"
            details.update(first_difference={"prompt_number": number, "prompt": prompt, "token": at,
                                             "new_token_ids": got.token_ids, "old_token_ids": want.token_ids,
                                             "new_text": got.text, "old_text": want.text})
            return GateResult("agreement", False, f"greedy output differs from version {was} for prompt {number} of "
                              f"{len(prompts)} {_short(prompt)} {where}: “{got.text[:60]}” where version {was} "
                              f"generated “{want.text[:60]}”", details, time.monotonic() - started)
    details["compared"] = "token ids" if by_ids else "text"
    return GateResult("agreement", True, f"{len(prompts)} prompt(s) from {source} generated the same "
                      f"{AGREEMENT_TOKENS} greedy tokens as version {was}", details, time.monotonic() - started)


# ---------------------------------------------------------------------------------------------- latency
def _limits(old_ttft: float, old_tps: float, params: LLMLatencyGate) -> tuple[float, float]:
    limit = max(old_ttft * (1 + params.max_ttft_p99_increase_pct / 100), old_ttft + params.min_ttft_p99_delta_ms)
    return limit, old_tps * (1 - params.max_tokens_per_s_drop_pct / 100)


def _point(url: str, name: str, load: LLMLoad, max_lag_ms: float, label: str, invalid: list[str],
           failed: list[str], attempts: int = 3) -> LLMResult | None:
    """A valid point, measured again (a bounded number of times) when the client sent late (a busy moment of
    a shared machine); None when no attempt was valid or when the server failed or broke streams."""
    for _ in range(attempts):
        result = _stream(url, name, load)
        if result.failed or result.broken:
            sample = f" ({result.error_samples[0][:200]})" if result.error_samples else ""
            failed.append(f"{label}: {result.failed} failed and {result.broken} broken of {result.requests} "
                          f"streams{sample}")
            return None
        if load.rate is None or result.send_lag_p95_ms <= max_lag_ms:
            return result
        invalid.append(f"{label}: streams were sent {result.send_lag_p95_ms:.0f} ms late (p95; the client, not "
                       f"the server, limited the point)")
    return None


def latency_gate(url: str, names: dict[str, str], params: LLMLatencyGate, progress: Progress) -> GateResult:
    """TTFT p99 (open loop at ``rate``) and output tokens/s (closed loop at ``concurrency``), both versions in
    interleaved rounds (new old, old new, …); blocks only on a difference beyond the rounds' own spread."""
    started = time.monotonic()
    rate, requests = params.rate, params.requests
    rounds, concurrency = max(1, params.rounds), max(1, params.concurrency)
    max_rounds = max(rounds, params.max_rounds)
    lengths = {"input_tokens": Lengths(params.input_tokens), "output_tokens": Lengths(params.output_tokens)}
    per_round: list[dict[str, dict[str, Any]]] = []
    invalid: list[str] = []
    failed: dict[str, list[str]] = {"new": [], "old": []}
    verdicts: dict[str, Verdict] = {}
    while True:
        index = len(per_round)
        order = ("new", "old") if index % 2 == 0 else ("old", "new")
        measured: dict[str, dict[str, Any]] = {"new": {}, "old": {}}
        # TTFT points A B, then throughput points B A: a machine getting busier during the round favours neither
        for side in order:
            progress(f"latency round {index + 1} (of {rounds} to {max_rounds}): {side} version, TTFT p99 at "
                     f"{rate:g} streams/s")
            point = None if failed[side] else _point(
                url, names[side], LLMLoad(rate=rate, arrivals=params.arrivals, requests=requests, seed=index,
                                          **lengths), params.max_lag_ms, f"round {index + 1} {side} TTFT",
                invalid, failed[side])
            measured[side]["ttft_p99_ms"] = point.ttft_ms.p99 if point is not None and point.ttft_ms else None
        for side in reversed(order):
            progress(f"latency round {index + 1}: {side} version, output tokens/s of {concurrency} streams")
            point = None if failed[side] else _point(
                url, names[side], LLMLoad(concurrency=concurrency, requests=requests, seed=index, **lengths),
                params.max_lag_ms, f"round {index + 1} {side} throughput", invalid, failed[side])
            measured[side]["tokens_per_s"] = point.output_token_throughput if point is not None else None
        per_round.append(measured)
        verdicts = _verdicts(per_round, params)
        if rounds_finished(len(per_round), verdicts, METRICS, bool(failed["new"]), rounds, max_rounds):
            break
    return _result(per_round, verdicts, params, invalid, failed, time.monotonic() - started)


def judge_rounds(per_round: list[dict[str, dict[str, Any]]], params: LLMLatencyGate) -> GateResult:
    """The gate's result from measured rounds (``{"new": {"ttft_p99_ms", "tokens_per_s"}, "old": {...}}`` each)."""
    return _result(per_round, _verdicts(per_round, params), params, [], {"new": [], "old": []}, 0.0)


def _verdicts(per_round: list[dict[str, dict[str, Any]]], params: LLMLatencyGate) -> dict[str, Verdict]:
    ratios: dict[str, list[float]] = {metric: [] for metric in METRICS}
    for measured in per_round:
        new, old = measured["new"], measured["old"]
        if new["ttft_p99_ms"] is not None and old["ttft_p99_ms"] is not None:
            ratios["ttft_p99"].append(new["ttft_p99_ms"] / _limits(old["ttft_p99_ms"], 0.0, params)[0])
        if new["tokens_per_s"] and old["tokens_per_s"]:
            ratios["tokens_per_s"].append(_limits(0.0, old["tokens_per_s"], params)[1] / new["tokens_per_s"])
    return {metric: judge(metric, values) for metric, values in ratios.items() if values}


def _result(per_round: list[dict[str, dict[str, Any]]], verdicts: dict[str, Verdict], params: LLMLatencyGate,
            invalid: list[str], failed: dict[str, list[str]], seconds: float) -> GateResult:
    def median(side: str, key: str) -> float | None:
        values = [float(m[side][key]) for m in per_round if m[side][key] is not None]
        return round(statistics.median(values), 3) if values else None

    med = {side: {key: median(side, key) for key in ("ttft_p99_ms", "tokens_per_s")} for side in ("new", "old")}
    verdict, block = overall_verdict(verdicts, METRICS, bool(failed["new"]), params.block_inconclusive)
    details: dict[str, Any] = {
        "verdict": verdict, "rate_rps": params.rate, "concurrency": params.concurrency,
        "requests": params.requests, "input_tokens": params.input_tokens, "output_tokens": params.output_tokens,
        "rounds": len(per_round), "new": med["new"], "old": med["old"], "per_round": per_round,
        "judged": {m: v.to_dict() for m, v in verdicts.items()},
        "thresholds": params.to_dict(), "invalid": invalid, "failed_requests": failed,
        "token_counts": "as the server reports them (num_output_tokens)"}
    parts = []
    for metric in METRICS:
        if metric not in verdicts:
            parts.append(f"{metric.replace('_', ' ')}: no round gave a valid point of both versions "
                         f"({'; '.join(invalid[:2]) or 'no stream completed'})")
            continue
        new, old = med["new"], med["old"]
        if metric == "ttft_p99" and old["ttft_p99_ms"] is not None and new["ttft_p99_ms"] is not None:
            limit = _limits(old["ttft_p99_ms"], 0.0, params)[0]
            details["ttft_p99_limit_ms"] = round(limit, 3)
            figures = f"TTFT p99 {new['ttft_p99_ms']:.1f} ms vs {old['ttft_p99_ms']:.1f} ms (limit {limit:.1f} ms)"
        elif old["tokens_per_s"] is not None and new["tokens_per_s"] is not None:
            floor = _limits(0.0, old["tokens_per_s"], params)[1]
            details["tokens_per_s_floor"] = round(floor, 3)
            figures = (f"output {new['tokens_per_s']:.0f} vs {old['tokens_per_s']:.0f} tokens/s "
                       f"(floor {floor:.0f})")
        else:
            figures = metric.replace("_", " ")
        beyond = verdicts[metric].outcome == "misses"
        parts.append(f"{figures}: beyond the threshold by more than the noise ({spread_words(verdicts[metric])})"
                     if beyond else f"{figures}, {spread_words(verdicts[metric])}")
    where = (f"{len(per_round)} round(s): {params.rate:g} streams/s and {params.concurrency} "
             f"in flight, {params.output_tokens} tokens each")
    parts += [f"the replaced version failed streams: {failed['old'][0]}"] if failed["old"] else []
    if failed["new"]:
        summary = f"the new version failed streams under load: {failed['new'][0]} ({where})"
    elif verdict == "fail":
        summary = f"{'; '.join(p for p in parts if 'beyond' in p)} ({where})"
    elif verdict == "inconclusive":
        summary = (f"inconclusive after {where}: {'; '.join(parts)}; the difference is within what this machine's "
                   "noise allows, so it " + ("blocks (block_inconclusive is set)" if block else "does not block"))
    else:
        summary = f"{'; '.join(parts)} ({where})"
    return GateResult("latency", not block, summary, details, seconds)
