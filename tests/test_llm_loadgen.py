"""The LLM load generator against a real tritonserver streaming from a model with a known token pace.

The model (tests/stream_model.py) speaks the official vLLM backend's interface and sleeps ``FIRST_MS``
before its first token and ``NEXT_MS`` before each next one, so TTFT >= FIRST_MS and latency >=
FIRST_MS + (tokens - 1) * NEXT_MS hold by construction; upper bounds only detect a hang (a shared 2-core
machine), and the definitions (TTFT, ITL, goodput) are checked on recorded streams.
"""

from __future__ import annotations

import json
import math

import pytest
from stream_model import stream_repository

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, LLMRequest, make_requests, run_llm
from repo_manager.adapters.loadgen.measure import Target
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.errors import UsageError

MODEL = "llm"
FIRST_MS, NEXT_MS, TOKENS = 40.0, 10.0, 8
CRASHING = {"grpc": "llm_crash_grpc", "http": "llm_crash_http"}
"""One copy of the model per protocol whose process a test kills mid-stream (it stays dead)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-repo")
    for name in (MODEL, *CRASHING.values()):
        stream_repository(root, name, first_ms=FIRST_MS, next_ms=NEXT_MS)
    # a stream on a model whose process was killed never ends: the stop need not wait for it
    with TritonServer(root, models=[MODEL, *CRASHING.values()], drain_timeout_s=1.0) as triton:
        yield triton


def target(server, protocol: str) -> Target:
    return Target(MODEL, server.url, protocol=protocol, grpc_url=server.endpoints.grpc)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_closed_loop_streams_report_ttft_itl_and_the_servers_token_counts(server, protocol):
    load = LLMLoad(concurrency=2, requests=6, warmup_requests=1, input_tokens=Lengths(5),
                   output_tokens=Lengths(TOKENS), ttft_slo_ms=FIRST_MS / 2, itl_slo_ms=10_000)
    result = run_llm(target(server, protocol), load)
    assert (result.requests, result.completed, result.broken, result.failed) == (6, 6, 0, 0)
    assert result.token_counts == "server" and result.short == 0 and result.versions == {1: 6}
    # the stand-in reports one token per response and the prompt's words as input tokens
    assert result.output_tokens.min == result.output_tokens.max == TOKENS
    assert result.input_tokens.min == result.input_tokens.max == 5
    assert result.ttft_ms.min >= FIRST_MS and result.ttft_ms.p50 < FIRST_MS + 10_000  # (a hang detector)
    assert result.latency_ms.min >= FIRST_MS + (TOKENS - 1) * NEXT_MS
    # a first token read late by a busy client shortens that stream's ITL (the rest arrive in a burst): only
    # the upper end is asserted, as a hang detector; ITL's definition is tested on recorded streams
    assert 0 <= result.itl_ms.p50 < NEXT_MS + 10_000
    assert result.ttft_ms.p50 <= result.ttft_ms.p90 <= result.ttft_ms.p99 <= result.ttft_ms.max
    # a request takes at least FIRST_MS + (TOKENS - 1) * NEXT_MS: 2 streams at a time bound the throughput
    least_s = (FIRST_MS + (TOKENS - 1) * NEXT_MS) / 1000
    assert 0 < result.request_throughput <= 2 / least_s
    assert result.output_token_throughput == pytest.approx(result.request_throughput * TOKENS, rel=1e-3)
    # a TTFT SLO of half the stand-in's first-token sleep: no stream can meet it, whatever the machine does
    assert result.goodput == 0.0
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ttft_ms"]["p99"] == result.ttft_ms.p99 and data["broken"] == 0 and data["versions"] == {"1": 6}


def test_goodput_counts_the_streams_within_both_slos(server):
    load = LLMLoad(concurrency=2, requests=4, input_tokens=Lengths(3), output_tokens=Lengths(4),
                   ttft_slo_ms=10_000, itl_slo_ms=10_000)
    result = run_llm(target(server, "grpc"), load)
    assert result.completed == 4 and result.goodput == result.request_throughput > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_open_loop_counts_a_stream_that_errors_mid_way_as_broken(server, protocol):
    requests = [LLMRequest("fine prompt", 4), LLMRequest("bad FAIL_AT_2 prompt", 6)]
    load = LLMLoad(rate=20, requests=4, output_tokens=Lengths(4))
    result = run_llm(target(server, protocol), load, requests=requests)
    assert result.outcomes == ("complete", "broken", "complete", "broken")
    assert (result.completed, result.broken, result.failed) == (2, 2, 0)
    assert any("engine failed after 2 tokens" in text for text in result.error_samples)
    assert result.output_tokens.count == 2 and result.output_tokens.max == 4  # only complete streams count
    assert list(result.output_token_counts) == [4, 2, 4, 2]  # and how far each broken one got
    assert result.send_lag_p95_ms >= 0  # measured (its size is this machine's speed, not the behaviour)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_stream_whose_model_process_dies_mid_way_is_broken(server, protocol):
    load = LLMLoad(concurrency=1, requests=1, timeout_s=8)
    result = run_llm(Target(CRASHING[protocol], server.url, protocol=protocol, grpc_url=server.endpoints.grpc),
                     load, requests=[LLMRequest("prompt EXIT_AT_2", 6)])
    assert result.outcomes == ("broken",) and result.completed == 0
    # Triton's python backend either reports its dead stub or never answers again: the stream is then
    # still open at the client's deadline, with two tokens and no final response: broken all the same
    assert result.output_token_counts[0] == 2
    assert any(text in result.error_samples[0] for text in ("not healthy", "DEADLINE_EXCEEDED", "Timeout"))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_requests_to_a_missing_model_fail_without_a_stream(server, protocol):
    load = LLMLoad(concurrency=1, requests=2)
    result = run_llm(Target("no_such_model", server.url, protocol=protocol, grpc_url=server.endpoints.grpc), load)
    assert (result.completed, result.broken, result.failed) == (0, 0, 2)
    assert "no_such_model" in result.error_samples[0]
    assert result.ttft_ms is None and result.output_token_throughput == 0.0


def test_without_server_counts_output_tokens_are_counted_as_responses(server):
    load = LLMLoad(concurrency=1, requests=2, input_tokens=Lengths(3), output_tokens=Lengths(5),
                   server_token_counts=False)
    result = run_llm(target(server, "http"), load)
    assert result.token_counts == "responses" and result.output_tokens.max == 5 and result.input_tokens is None


def test_prompt_and_output_lengths_follow_the_distribution():
    load = LLMLoad(rate=1, input_tokens=Lengths(50, stddev=10), output_tokens=Lengths(20, stddev=5, minimum=8),
                   vocabulary=("alpha", "beta"), seed=3)
    requests = make_requests(load, 400)
    words = [len(r.prompt.split()) for r in requests]
    outs = [r.max_tokens for r in requests]
    assert 45 < sum(words) / len(words) < 55 and len(set(words)) > 10
    assert min(outs) >= 8 and 18 < sum(outs) / len(outs) < 23
    assert set(" ".join(r.prompt for r in requests).split()) == {"alpha", "beta"}
    assert {r.max_tokens for r in make_requests(LLMLoad(rate=1, output_tokens=Lengths(7)), 20)} == {7}


def test_a_load_needs_a_rate_or_a_concurrency():
    with pytest.raises(UsageError):
        LLMLoad()
    with pytest.raises(UsageError):
        LLMLoad(rate=1, concurrency=2)
    with pytest.raises(UsageError):
        Lengths(0)
    with pytest.raises(UsageError, match="protocol"):
        run_llm(Target(MODEL, "http://127.0.0.1:1", protocol="websocket"), LLMLoad(concurrency=1))


def test_grpc_streams_end_so_that_the_model_can_still_be_unloaded(tmp_path):
    """Each gRPC stream is read to its end after the final response. Triton 2.51 never finished unloading a
    decoupled model whose streams the client had cancelled right after their final responses (measured here:
    still UNLOADING 20 s after the unload, the replaced vLLM engine of a rollout alive minutes later; the load
    generator did that until now). After 30 streams the model unloads at once."""
    import time

    from repo_manager.adapters.triton.client import TritonClient

    root = stream_repository(tmp_path / "repo", first_ms=5.0, next_ms=2.0)
    with TritonServer(root, models=[MODEL], drain_timeout_s=1.0) as triton, TritonClient(triton.url) as client:
        result = run_llm(Target(MODEL, triton.url, protocol="grpc", grpc_url=triton.endpoints.grpc),
                         LLMLoad(concurrency=3, requests=30, input_tokens=Lengths(6), output_tokens=Lengths(8)))
        assert set(result.outcomes) == {"complete"}
        client.unload(MODEL)
        deadline = time.monotonic() + 60  # a hang detector: the unload takes a second or two
        while time.monotonic() < deadline:
            states = {e.get("state") for e in client.repository_index() if e["name"] == MODEL}
            if not states & {"READY", "UNLOADING"}:
                break
            time.sleep(0.2)
        assert not states & {"READY", "UNLOADING"}, states


def test_ttft_itl_goodput_and_throughput_follow_genai_perfs_definitions_on_recorded_streams():
    """summarize() on streams whose times are given (no server, no clock): TTFT = first - sent, ITL =
    (latency - TTFT) / (output tokens - 1), goodput counts complete streams within both SLOs, a one-token
    answer has no ITL to miss, a stream cut after a token is broken and one without any is failed."""
    from repo_manager.adapters.loadgen.llm import VLLM, _Stream, make_requests, summarize

    def stream(sent, first, done, tokens, final=True, error=None):
        return _Stream(sent=sent, first=first, done=done, responses=tokens, output_tokens=tokens, server_counts=True,
                       input_tokens=4, final=final, error=error, version=1)

    records = [stream(0.0, 0.100, 0.190, 10),   # TTFT 100 ms, ITL 10 ms: within both SLOs
               stream(0.0, 0.300, 0.390, 10),   # TTFT 300 ms: misses the TTFT SLO
               stream(0.1, 0.150, 0.150, 1),    # one token: TTFT 50 ms, no ITL
               stream(0.2, 0.250, 1.000, 4),    # ITL 250 ms: misses the ITL SLO
               stream(0.2, 0.300, 0.500, 3, final=False, error="cut"),  # broken after tokens
               stream(0.3, math.nan, 0.400, 0, final=False, error="refused")]  # failed before any
    load = LLMLoad(concurrency=2, requests=6, input_tokens=Lengths(4), output_tokens=Lengths(10),
                   ttft_slo_ms=200, itl_slo_ms=50)
    result = summarize(Target(MODEL, "http://127.0.0.1:9"), load, VLLM, records, make_requests(load, 6))
    assert (result.completed, result.broken, result.failed) == (4, 1, 1)
    assert result.ttft.tolist()[:4] == pytest.approx([100.0, 300.0, 50.0, 50.0])
    assert result.itl[:4][[0, 1, 3]].tolist() == pytest.approx([10.0, 10.0, 250.0]) and math.isnan(result.itl[2])
    assert result.duration_s == pytest.approx(1.0)  # first send to last end
    assert result.goodput == pytest.approx(2.0)  # the first and the one-token stream, over one second
    assert result.output_token_throughput == pytest.approx(25.0) and result.request_throughput == pytest.approx(4.0)
