"""LLM load: streamed generation requests, measured the way genai-perf / AIPerf measure them.

``run_llm(target, LLMLoad(rate=4, requests=200, input_tokens=Lengths(128), output_tokens=Lengths(64)))``
sends streaming requests to a Triton LLM model over gRPC (one bidirectional ``ModelStreamInfer`` stream
per request, decoupled responses) or HTTP (``POST /v2/models/NAME/generate_stream``, server-sent events),
open loop (Poisson or constant arrivals at a rate, each request sent on time as its own task) or closed
loop (a concurrency), and records per request: time to first token (TTFT), end-to-end latency, the
token counts **the server reports** and how the stream ended. ``LLMResult`` sums it up with the
definitions of genai-perf / AIPerf (docs/llm.md, "LLM load: definitions").

The request is the official vLLM backend's (``VLLM``): ``text_input``, ``stream``, ``sampling_parameters``
(JSON), ``exclude_input_in_output``, ``return_num_input_tokens``, ``return_num_output_tokens``; another
backend's interface (the TensorRT-LLM ensemble) is another ``LLMInterface`` with the same measurement.

A stream is **complete** when its final response arrived without an error, **broken** when it had
started (at least one response) and then ended with an error or without a final response (truncated),
**failed** when the request got an error and no response at all (refused, unknown model, timeout).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc

from repo_manager.adapters.loadgen.measure import Target, arrival_offsets, check_arrivals
from repo_manager.adapters.loadgen.transport import PROTOCOLS, error_text
from repo_manager.adapters.triton.client import normalize_url
from repo_manager.core.errors import UsageError

COMPLETE, BROKEN, FAILED = "complete", "broken", "failed"
WORDS = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
         "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you",
         "were", "her", "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if",
         "so", "no", "will", "more", "can", "what", "out", "up", "about", "who", "some", "time", "them",
         "into", "only", "then", "its", "also", "two", "than")
"""The default vocabulary: common English words, each one token in the usual BPE tokenizers."""


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: ``mean`` tokens, normally spread by ``stddev`` (0: fixed), at least
    ``minimum`` (genai-perf's ``--synthetic-input-tokens-mean/-stddev``, ``--output-tokens-mean/-stddev``)."""

    mean: int
    stddev: float = 0.0
    minimum: int = 1

    def __post_init__(self) -> None:
        if self.mean < 1 or self.stddev < 0 or self.minimum < 1:
            raise UsageError(f"a token length needs a mean of at least 1 and a stddev of at least 0, "
                             f"not mean {self.mean}, stddev {self.stddev}")

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if not self.stddev:
            return np.full(count, max(self.mean, self.minimum), dtype=np.int64)
        drawn = np.rint(rng.normal(self.mean, self.stddev, size=count)).astype(np.int64)
        return np.maximum(drawn, self.minimum)


@dataclass(frozen=True)
class LLMLoad:
    """One LLM load run. Give ``rate`` (open loop, requests/s) or ``concurrency`` (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None
    arrivals: str = "poisson"
    requests: int = 100
    """Measured requests, after ``warmup_requests`` that are sent first and left out of every figure."""
    warmup_requests: int = 0
    input_tokens: Lengths = Lengths(128)
    """Prompt length in tokens: a prompt of n tokens has ``round(n / tokens_per_word)`` words of ``vocabulary``;
    the server's own count is what every figure reports."""
    tokens_per_word: float = 1.0
    """Tokens the model's tokenizer makes of one word of ``vocabulary`` (``calibrate`` asks the server; a
    common word is one token in the usual BPE vocabularies, and several in a small or character-level one)."""
    output_tokens: Lengths = Lengths(64)
    """``max_tokens`` per request; with ``ignore_eos`` in ``sampling`` the engine generates exactly that."""
    vocabulary: tuple[str, ...] = WORDS
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0, "ignore_eos": True})
    """Further sampling parameters (vLLM ``SamplingParams`` fields); ``max_tokens`` comes from ``output_tokens``."""
    server_token_counts: bool = True
    """Ask the server for ``num_input_tokens`` / ``num_output_tokens`` (vllm_backend r24.12 and later);
    False for an older backend: output tokens are then counted as responses (one token each)."""
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    timeout_s: float = 300.0
    """Per request: a stream still open after this long is cut and counted broken (or failed)."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_arrivals("an LLM load", self.rate, self.concurrency, self.arrivals)
        if self.requests < 1 or self.warmup_requests < 0:
            raise UsageError("an LLM load needs at least one measured request")
        if not self.vocabulary:
            raise UsageError("the prompt vocabulary is empty")
        if not (math.isfinite(self.tokens_per_word) and self.tokens_per_word > 0):
            raise UsageError(f"tokens per word must be a positive number, not {self.tokens_per_word}")

    @property
    def mode(self) -> str:
        return self.arrivals if self.rate is not None else "closed"


@dataclass(frozen=True)
class LLMRequest:
    prompt: str
    max_tokens: int


class LLMInterface:
    """How one generation request maps onto a model's inputs, and its outputs back (here: vLLM's)."""

    name = "vllm"
    shape: tuple[int, ...] = (1,)
    """Every input's shape over gRPC (vLLM: ``max_batch_size: 0``, dims ``[1]``); the generate endpoint
    takes plain JSON values and Triton shapes them."""

    def tensors(self, request: LLMRequest, load: LLMLoad) -> list[tuple[str, str, Any]]:
        """``(input name, Triton datatype, value)`` for each input of one streaming request."""
        sampling = json.dumps({**load.sampling, "max_tokens": request.max_tokens})
        tensors = [("text_input", "BYTES", request.prompt), ("stream", "BOOL", True),
                   ("sampling_parameters", "BYTES", sampling), ("exclude_input_in_output", "BOOL", True)]
        if load.server_token_counts:
            tensors += [("return_num_input_tokens", "BOOL", True), ("return_num_output_tokens", "BOOL", True)]
        return tensors

    text_output = "text_output"
    num_input_tokens = "num_input_tokens"
    num_output_tokens = "num_output_tokens"
    """Per response: the tokens **of that response** (vllm_backend docs/additional_outputs.md), so a
    stream's output length is their sum."""


VLLM = LLMInterface()


@dataclass
class _Stream:
    """What one stream did; times from ``time.perf_counter``."""

    sent: float = math.nan
    due: float = math.nan
    """Open loop: when the schedule wanted it sent."""
    first: float = math.nan
    done: float = math.nan
    """When the stream ended: its final response, or the error that ended it."""
    responses: int = 0
    """Responses that carried output (an empty final response is not one)."""
    output_tokens: int = 0
    server_counts: bool = False
    input_tokens: int | None = None
    final: bool = False
    error: str | None = None
    version: int | None = None

    def take(self, now: float, text: str | None, out_tokens: int | None, in_tokens: int | None,
             version: str | None) -> None:
        if out_tokens is not None:
            self.server_counts = True
            self.output_tokens += out_tokens
        if text or out_tokens:
            self.responses += 1
            if math.isnan(self.first):
                self.first = now
        if in_tokens is not None:
            self.input_tokens = in_tokens
        if version:
            self.version = int(version)

    @property
    def outcome(self) -> str:
        if self.final and self.error is None:
            return COMPLETE
        return BROKEN if self.responses else FAILED


CONTENTS = {"BYTES": "bytes_contents", "BOOL": "bool_contents", "INT32": "int_contents",
            "UINT32": "uint_contents", "INT64": "int64_contents", "FP32": "fp32_contents"}
"""Where a value of each datatype goes in a gRPC request's ``InferTensorContents``."""


def _scalar(result: InferResult, name: str) -> Any:
    array = result.as_numpy(name)
    return None if array is None or not array.size else array.reshape(-1)[0]


class _GrpcSender:
    """One gRPC channel; each request opens its own bidirectional stream and closes its sending side."""

    def __init__(self, target: Target, interface: LLMInterface, load: LLMLoad) -> None:
        self._channel = grpc.aio.insecure_channel(normalize_url(target.send_url))
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._target, self._interface, self._load = target, interface, load

    def _request(self, request: LLMRequest) -> service_pb2.ModelInferRequest:
        message = service_pb2.ModelInferRequest(model_name=self._target.model,
                                                model_version=str(self._target.version or ""))
        for name, datatype, value in self._interface.tensors(request, self._load):
            tensor = message.inputs.add(name=name, datatype=datatype, shape=list(self._interface.shape))
            contents = getattr(tensor.contents, CONTENTS[datatype])
            contents.append(value.encode() if datatype == "BYTES" else value)
        # a final response with no outputs still arrives, flagged: how a complete stream is told apart
        message.parameters["triton_enable_empty_final_response"].bool_param = True
        return message

    async def stream(self, request: LLMRequest, record: _Stream) -> None:
        message = self._request(request)

        async def requests():
            yield message

        names = self._interface
        record.sent = time.perf_counter()
        call = self._stub.ModelStreamInfer(requests(), timeout=self._load.timeout_s)
        ended = False  # the request's last response (final, or an error) arrived
        try:
            # read to the stream's end, which the server closes once the request is done: Triton 2.51 never
            # finished unloading a model whose streams were cancelled right after their final responses
            # (measured: a rollout's replaced vLLM engine stayed loaded), so the call is cancelled only when
            # it ends some other way (a timeout, a broken connection)
            async for response in call:
                if ended:
                    continue
                now = time.perf_counter()
                if response.error_message:
                    record.error, ended = response.error_message, True
                    continue
                infer = response.infer_response
                result = InferResult(infer)
                out = _scalar(result, names.num_output_tokens)
                text = _scalar(result, names.text_output)
                in_tokens = _scalar(result, names.num_input_tokens)
                record.take(now, text.decode(errors="replace") if isinstance(text, bytes) else text,
                            None if out is None else int(out), None if in_tokens is None else int(in_tokens),
                            infer.model_version)
                if infer.parameters["triton_final_response"].bool_param:
                    record.final, record.done, ended = True, now, True
            if not ended:
                record.error = "the stream ended without a final response"
        finally:
            call.cancel()  # a no-op once the server has closed the stream

    async def close(self) -> None:
        await self._channel.close()


class _HttpSender:
    """Triton's generate extension: one ``generate_stream`` POST per request, read as server-sent events.

    The generate endpoint has no final flag: Triton ends the event stream after the final response, so a
    stream that ends cleanly is complete and one cut off (the connection closed mid-stream) is not.
    """

    def __init__(self, target: Target, interface: LLMInterface, load: LLMLoad, connections: int) -> None:
        version = f"/versions/{target.version}" if target.version else ""
        self._url = f"{target.url.rstrip('/')}/v2/models/{target.model}{version}/generate_stream"
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                              timeout=aiohttp.ClientTimeout(total=load.timeout_s))
        self._interface, self._load = interface, load

    async def stream(self, request: LLMRequest, record: _Stream) -> None:
        body = {name: value for name, _, value in self._interface.tensors(request, self._load)}
        names = self._interface
        record.sent = time.perf_counter()
        async with self._session.post(self._url, json=body) as response:
            if response.status != 200:
                record.error = _http_error(response.status, await response.text())
                return
            now = time.perf_counter()
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[5:])
                if "error" in event:
                    record.error = str(event["error"])
                    return
                out, in_tokens = event.get(names.num_output_tokens), event.get(names.num_input_tokens)
                record.take(now, event.get(names.text_output), None if out is None else int(_first(out)),
                            None if in_tokens is None else int(_first(in_tokens)), event.get("model_version"))
            record.final, record.done = True, now  # the last event's time: the final response's

    async def close(self) -> None:
        await self._session.close()


def _http_error(status: int, text: str) -> str:
    """Triton's error message from a refused generate request (plain JSON, or one server-sent event)."""
    body = text.strip().removeprefix("data:").strip()
    try:
        message = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        message = " ".join(body.split())[:200]
    return f"HTTP {status}: {message}"


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


@dataclass(frozen=True)
class Distribution:
    """Percentiles as genai-perf computes them (numpy's linear interpolation), and the mean."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Distribution | None:
        values = values[~np.isnan(values)]
        if not len(values):
            return None
        p50, p90, p99 = (round(float(v), 3) for v in np.percentile(values, [50, 90, 99]))
        return cls(len(values), round(float(values.mean()), 3), p50, p90, p99,
                   round(float(values.min()), 3), round(float(values.max()), 3))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class LLMResult:
    """What a run measured. Times in ms, throughputs per second of the measurement window."""

    mode: str
    protocol: str
    interface: str
    offered_rps: float | None
    concurrency: int | None
    requests: int
    """Measured requests sent."""
    completed: int
    broken: int
    """Streams that started and then ended with an error or without a final response."""
    failed: int
    """Requests answered with an error and no output at all."""
    short: int
    """Complete streams with fewer output tokens than asked (only counted when ``ignore_eos`` is set)."""
    error_samples: tuple[str, ...]
    token_counts: str
    """``server``: output tokens as the server's ``num_output_tokens`` say; ``responses``: counted as one
    token per response with output (the fallback when the server does not report them)."""
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    goodput: float | None
    """Completed requests per second that met every SLO given (TTFT and/or ITL); None without an SLO."""
    ttft_slo_ms: float | None
    itl_slo_ms: float | None
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    latency_ms: Distribution | None
    input_tokens: Distribution | None
    output_tokens: Distribution | None
    versions: dict[int, int]
    """Model version that answered -> completed requests."""
    send_lag_p95_ms: float = 0.0
    """Open loop: how late the client sent (95th percentile); tens of ms mean the client, not the server,
    limited the run."""
    outcomes: tuple[str, ...] = field(repr=False, compare=False, default=())
    """Per measured request in send order: ``complete``, ``broken`` or ``failed`` (not in ``to_dict``)."""
    ttft: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    itl: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    latency: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    output_token_counts: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    """Per measured request in send order (not in ``to_dict``): times in ms, NaN unless complete; output
    tokens received whatever the outcome (how far a broken stream got)."""
    sent_at: np.ndarray = field(repr=False, compare=False, default_factory=lambda: np.zeros(0))
    """Per measured request in send order (not in ``to_dict``): when it was sent, ``time.perf_counter()``."""
    answered_by: tuple[int | None, ...] = field(repr=False, compare=False, default=())
    """Per measured request in send order (not in ``to_dict``): the model version that answered, if any."""

    def to_dict(self) -> dict[str, Any]:
        skip = {"outcomes", "ttft", "itl", "latency", "output_token_counts", "sent_at", "answered_by"}
        data: dict[str, Any] = {}
        for key in self.__dataclass_fields__:
            if key in skip:
                continue
            value = getattr(self, key)
            data[key] = value.to_dict() if isinstance(value, Distribution) else value
        data["error_samples"] = list(self.error_samples)
        data["versions"] = {str(k): v for k, v in self.versions.items()}
        return data


def make_requests(load: LLMLoad, count: int) -> list[LLMRequest]:
    """``count`` prompts of ``load.input_tokens`` tokens (words drawn from the vocabulary, as many as make
    that many tokens at ``load.tokens_per_word``), with their max_tokens."""
    rng = np.random.default_rng(load.seed)
    words = np.array(load.vocabulary, dtype=object)
    inputs, outputs = load.input_tokens.sample(rng, count), load.output_tokens.sample(rng, count)
    return [LLMRequest(" ".join(rng.choice(words, size=max(1, round(int(n) / load.tokens_per_word)))), int(m))
            for n, m in zip(inputs, outputs)]


CALIBRATION_WORDS = (64, 16, 4)
"""Words in the prompt ``calibrate`` sends, the next when the model refused the last (a short context): many
enough that the tokens a tokenizer adds once (a BOS) hardly count."""


def calibrate(target: Target, load: LLMLoad, *, interface: LLMInterface = VLLM) -> LLMLoad:
    """``load`` with ``tokens_per_word`` as the model's tokenizer makes them, measured by one request (one
    token generated) whose prompt's length the server reports. Unchanged when the server reports no count
    (an older backend) or refuses every probe: the run's own figures then show the server's counts."""
    for words in CALIBRATION_WORDS:
        probe = LLMLoad(concurrency=1, requests=1, input_tokens=Lengths(words), output_tokens=Lengths(1),
                        vocabulary=load.vocabulary, sampling=load.sampling, server_token_counts=True,
                        timeout_s=load.timeout_s, seed=load.seed)
        result = run_llm(target, probe, interface=interface)
        if result.completed:
            counted = result.input_tokens.mean if result.input_tokens else None
            return replace(load, tokens_per_word=counted / words) if counted else load
    return load


def run_llm(target: Target, load: LLMLoad, *, interface: LLMInterface = VLLM,
            requests: list[LLMRequest] | None = None) -> LLMResult:
    """Send ``load`` to ``target`` (blocks; runs its own event loop). ``requests`` replace the generated
    prompts (cycled), e.g. a sample of real ones."""
    if target.protocol not in PROTOCOLS:
        raise UsageError(f"protocol {target.protocol!r} is not one of {', '.join(PROTOCOLS)}")
    total = load.warmup_requests + load.requests
    prepared = requests or make_requests(load, total)
    return asyncio.run(_run(target, load, interface, [prepared[i % len(prepared)] for i in range(total)]))


async def _run(target: Target, load: LLMLoad, interface: LLMInterface, requests: list[LLMRequest]) -> LLMResult:
    records = [_Stream() for _ in requests]
    connections = load.concurrency or 0  # open loop: no client-side cap on streams in flight (0: none)
    sender: Any = (_GrpcSender(target, interface, load) if target.protocol == "grpc"
                   else _HttpSender(target, interface, load, connections))

    async def one(index: int) -> None:
        record = records[index]
        try:
            await sender.stream(requests[index], record)
        except grpc.aio.AioRpcError as exc:
            record.error = f"gRPC {exc.code().name}: {exc.details()}"
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, none stops the run
            record.error = error_text(exc)
        finally:
            if math.isnan(record.done):
                record.done = time.perf_counter()

    try:
        if load.rate is not None:
            schedule = arrival_offsets(load.rate, len(requests), load.arrivals, load.seed)
            start, tasks = time.perf_counter() + 0.01, []
            for index, offset in enumerate(schedule):
                records[index].due = start + offset
                await asyncio.sleep(max(start + offset - time.perf_counter(), 0.0))
                tasks.append(asyncio.ensure_future(one(index)))
            await asyncio.gather(*tasks)
        else:
            state = {"next": 0}

            async def worker() -> None:
                while state["next"] < len(requests):
                    index = state["next"]
                    state["next"] += 1
                    await one(index)

            await asyncio.gather(*(worker() for _ in range(load.concurrency or 1)))
    finally:
        await sender.close()
    return summarize(target, load, interface, records[load.warmup_requests:], requests[load.warmup_requests:])


def summarize(target: Target, load: LLMLoad, interface: LLMInterface, records: list[_Stream],
              requests: list[LLMRequest]) -> LLMResult:
    """The genai-perf / AIPerf figures of the measured streams (docs/llm.md, "LLM load: definitions")."""
    outcomes = tuple(r.outcome for r in records)
    complete = np.array([o == COMPLETE for o in outcomes], dtype=bool)
    sent = np.array([r.sent for r in records])
    done = np.array([r.done for r in records])
    first = np.array([r.first for r in records])
    server = all(r.server_counts for r, ok in zip(records, complete) if ok) and bool(complete.any())
    tokens = np.array([(r.output_tokens if r.server_counts else r.responses) for r in records], dtype=float)
    in_tokens = np.array([np.nan if r.input_tokens is None else r.input_tokens for r in records], dtype=float)
    nan = np.full(len(records), np.nan)
    latency = np.where(complete, (done - sent) * 1000.0, nan)
    ttft = np.where(complete, (first - sent) * 1000.0, nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        itl = np.where(complete & (tokens > 1), (latency - ttft) / (tokens - 1), nan)
    window = float(np.nanmax(done) - np.nanmin(sent)) if len(records) else 0.0
    good = complete.copy()
    if load.ttft_slo_ms is not None:
        good &= ttft <= load.ttft_slo_ms
    if load.itl_slo_ms is not None:
        good &= np.isnan(itl) | (itl <= load.itl_slo_ms)  # a one-token answer has no ITL to miss
    has_slo = load.ttft_slo_ms is not None or load.itl_slo_ms is not None

    def per_s(count: float) -> float:
        return round(count / window, 3) if window > 0 else 0.0

    asked = np.array([r.max_tokens for r in requests], dtype=float)
    short = int((complete & (tokens < asked)).sum()) if load.sampling.get("ignore_eos") else 0
    errors = Counter(r.error for r in records if r.error)
    lags = np.array([(r.sent - r.due) * 1000.0 for r in records if not math.isnan(r.due)])
    versions = Counter(r.version for r, ok in zip(records, complete) if ok and r.version is not None)
    return LLMResult(
        mode=load.mode, protocol=target.protocol, interface=interface.name, offered_rps=load.rate,
        concurrency=load.concurrency, requests=len(records), completed=int(complete.sum()),
        broken=outcomes.count(BROKEN), failed=outcomes.count(FAILED), short=short,
        error_samples=tuple(text for text, _ in errors.most_common(3)),
        token_counts="server" if server else "responses", duration_s=round(window, 3),
        request_throughput=per_s(int(complete.sum())),
        output_token_throughput=per_s(float(tokens[complete].sum())),
        goodput=per_s(int(good.sum())) if has_slo else None, ttft_slo_ms=load.ttft_slo_ms,
        itl_slo_ms=load.itl_slo_ms, ttft_ms=Distribution.of(ttft), itl_ms=Distribution.of(itl),
        latency_ms=Distribution.of(latency), input_tokens=Distribution.of(np.where(complete, in_tokens, nan)),
        output_tokens=Distribution.of(np.where(complete, tokens, nan)), versions=dict(sorted(versions.items())),
        send_lag_p95_ms=round(float(np.percentile(lags, 95)), 3) if len(lags) else 0.0,
        outcomes=outcomes, ttft=ttft, itl=itl, latency=latency, output_token_counts=tokens, sent_at=sent,
        answered_by=tuple(r.version for r in records))
