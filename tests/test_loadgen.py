"""The load generator against a real tritonserver running the cost model (behaviour, never timing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cost_model import cost_config, cost_repository

from repo_manager.adapters.loadgen import BackgroundLoad, LoadSpec, Target, Workload, arrival_offsets, measure
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.errors import InputError, UsageError

MODEL = "cost"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = cost_repository(tmp_path_factory.mktemp("loadgen-repo"), MODEL, versions=2,
                           fixed_ms=1.0, per_item_ms=0.2, max_batch_size=8)
    with TritonServer(root) as triton:
        yield triton


def load(server, version: int = 1, **changes) -> None:
    """(Re)load the cost model at ``version`` with config changes, through the load API."""
    config = cost_config(MODEL, **{"fixed_ms": 1.0, "per_item_ms": 0.2, "max_batch_size": 8, **changes})
    config.version_policy.specific.versions[:] = [version]
    with TritonClient(server.url) as client:
        client.load(MODEL, config)


def target(server, protocol: str = "http") -> Target:
    return Target(MODEL, server.url, protocol=protocol, grpc_url=server.endpoints.grpc)


def measured(target_: Target, spec: LoadSpec):
    """A point, measured again once if the client fell behind (a stall of the shared 2-core machine; the
    tuner's prober does the same). The second point must be valid: the tests that use it allow a send lag of
    100 ms (p95), far above a quiet machine's but within a busy one's; lag detection has its own test."""
    point = measure(target_, spec)
    return point if point.valid else measure(target_, spec)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_open_loop_point_measures_every_request_and_reads_server_statistics(server, protocol):
    load(server)
    point = measured(target(server, protocol), LoadSpec(rate=150, requests=600, warmup_s=0.5, max_lag_ms=100))
    assert point.valid, point.invalid_reason
    assert point.requests == 600 and point.errors == 0 and point.protocol == protocol
    assert 0 < point.p50_ms <= point.p90_ms <= point.p99_ms <= point.max_ms
    assert len(point.window_p99_ms) == 3
    # Triton saw (at least) the measured requests; without dynamic batching every execution is batch 1
    assert point.server.requests >= 600 and point.server.failed == 0
    assert set(point.server.batch_histogram) == {1} and point.server.mean_batch == 1.0
    assert point.server.compute_ms > 0 and point.to_dict()["server"]["batch_histogram"]["1"] >= 600


def test_queue_delay_makes_triton_form_larger_batches_and_stats_show_the_queueing(server):
    load(server, dynamic_batching=True)
    config_delay = cost_config(MODEL, fixed_ms=1.0, per_item_ms=0.2, max_batch_size=8, dynamic_batching=True)
    config_delay.dynamic_batching.max_queue_delay_microseconds = 30_000
    config_delay.version_policy.specific.versions[:] = [1]
    with TritonClient(server.url) as client:
        client.load(MODEL, config_delay)
    point = measured(target(server), LoadSpec(rate=150, requests=450, warmup_s=0.5, arrivals="constant",
                                              max_lag_ms=100))
    assert point.valid and point.errors == 0
    assert point.server.mean_batch > 1.5 and max(point.server.batch_histogram) > 1
    assert point.server.queue_ms > point.server.compute_ms  # most of the time was spent waiting for a batch
    assert sum(size * n for size, n in point.server.batch_histogram.items()) >= 450


def test_closed_loop_measures_exactly_the_requested_count(server):
    load(server)
    point = measure(target(server), LoadSpec(concurrency=3, requests=300, warmup_s=0.3))
    assert point.mode == "closed" and point.valid and point.offered_rps is None
    assert point.requests == 300 and point.errors == 0 and point.achieved_rps > 0


def test_closed_loop_warm_up_is_by_time_however_many_requests_a_fast_model_answers_in_it(server):
    """A 1 ms model answers hundreds of requests in a second of warm-up, more than the few the point
    measures: the record grows with the warm-up instead of having room for a fixed number (it had 4 x
    requests + 64 per client, so the warm-up used them all and nothing was measured), and with
    ``min_duration_s`` the point measures for at least that long too."""
    load(server)
    point = measure(target(server), LoadSpec(concurrency=1, requests=10, warmup_s=1.0, min_duration_s=0.5))
    assert point.valid, point.invalid_reason
    assert point.requests >= 10 and point.duration_s >= 0.5 and point.errors == 0
    # Triton counts a request after sending its answer: the statistics read right after the last answer may
    # lack that one (concurrency 1: at most one)
    assert point.server.requests >= point.requests - 1


def test_point_is_invalid_when_the_client_cannot_keep_the_offered_rate(server):
    load(server, dynamic_batching=True)
    # no Python client sends 50,000 requests/s on this machine: the point must not be reported as valid
    point = measure(target(server), LoadSpec(rate=50_000, requests=3000, warmup_s=0.0, max_in_flight=100_000))
    assert not point.valid and "client fell behind" in point.invalid_reason


def test_server_that_cannot_keep_up_saturates_the_point_instead_of_queueing_forever(server):
    load(server, fixed_ms=20.0, max_batch_size=1)  # at most ~50 answers/s
    point = measure(target(server), LoadSpec(rate=400, requests=2000, warmup_s=0.0, max_in_flight=20))
    assert point.saturated and point.valid
    assert point.requests < 2000 and point.errors == 0


def test_requests_that_fail_are_counted_as_errors_with_their_message(server, tmp_path):
    load(server)
    sample = tmp_path / "bad.npz"
    np.savez(sample, INPUT0=np.ones((1, 7), np.float32))  # the model takes 4 values per item
    point = measure(target(server), LoadSpec(rate=100, requests=100, warmup_s=0.0), Workload.from_file(sample))
    assert point.errors == point.requests == 100
    assert point.p99_ms == float("inf") and point.error_samples and "INPUT0" in point.error_samples[0]


def test_sample_file_must_hold_every_input(server, tmp_path):
    sample = tmp_path / "wrong.npz"
    np.savez(sample, OTHER=np.ones((1, 4), np.float32))
    with TritonClient(server.url) as client:
        config = client.model_config(MODEL)
    with pytest.raises(InputError, match="INPUT0"):
        Workload.from_file(sample, config)
    with pytest.raises(InputError, match="does not exist"):
        Workload.from_file(tmp_path / "missing.npz")


def test_arrival_schedules():
    constant = arrival_offsets(100.0, 50, "constant")
    assert np.allclose(np.diff(constant), 0.01)
    poisson = arrival_offsets(100.0, 20_000, "poisson", seed=1)
    assert poisson[0] == 0 and np.all(np.diff(poisson) >= 0)
    gaps = np.diff(poisson)
    assert abs(gaps.mean() - 0.01) < 0.001 and gaps.std() > 0.005  # exponential gaps: std ≈ mean
    with pytest.raises(UsageError):
        LoadSpec(rate=10, concurrency=2)
    with pytest.raises(UsageError):
        LoadSpec(rate=10, arrivals="bursty")


def test_background_load_records_a_clean_switch_from_version_1_to_2(server):
    load(server, version=1)

    def label(outputs) -> str:
        ratio = outputs["OUTPUT0"] / workload.samples[0]["INPUT0"]
        versions = {int(round(float(r))) - 1 for r in np.ravel(ratio)}
        return f"v{versions.pop()}" if len(versions) == 1 else "mixed"

    with TritonClient(server.url) as client:
        workload = Workload(tuple([Workload.from_config(client.model_config(MODEL)).samples[0]]), ("OUTPUT0",))
    with BackgroundLoad(server.url, MODEL, clients=3, workload=workload, check=label) as traffic:
        traffic.wait_for(30)
        load(server, version=2)  # Triton loads 2, routes new requests to it, then unloads 1
        seen = traffic.count()
        traffic.wait_for(seen + 30)
    summary = traffic.summary()
    assert summary.failed == 0, summary.errors
    # by start time, requests sent within a millisecond of the switch may interleave; none sent after a
    # v2 answer arrived may get v1, and none is a mix
    assert summary.stale == 0 and set(summary.labels) == {"v1", "v2"} and summary.labels[0] == "v1"
    assert summary.labels[-1] == "v2" and summary.versions[0] == 1 and summary.versions[-1] == 2
    assert summary.label_counts["v1"] >= 30 and summary.label_counts["v2"] >= 30
    records = traffic.records
    assert all(r.ok and r.latency_s > 0 and r.label in ("v1", "v2") for r in records)
    assert [r.started_at for r in records] == sorted(r.started_at for r in records)


def test_background_load_records_failures_and_grpc_versions(server):
    load(server, version=1)
    with BackgroundLoad(server.url, MODEL, clients=2, protocol="grpc", grpc_url=server.endpoints.grpc,
                        keep_outputs=True) as traffic:
        traffic.wait_for(10)
        with TritonClient(server.url) as client:
            client.unload(MODEL)
        traffic.wait_for(traffic.count() + 10)
    summary = traffic.summary()
    assert summary.failed >= 10 and summary.errors and summary.versions == (1,)
    ok = [r for r in traffic.records if r.ok]
    assert ok and ok[0].outputs is not None and "OUTPUT0" in ok[0].outputs
    assert all(r.error for r in traffic.records if not r.ok)
    load(server)  # leave the model loaded for the other tests
    assert dataclasses.asdict(summary)["failed"] == summary.failed
