"""Overload on a real tritonserver: the load generator counts queue-policy rejections apart from errors.

The cost model (20 ms per execution, batches of at most 2: about 90 requests/s) gets a queue policy that
rejects requests queued longer than 60 ms (two priority levels, the same policy on each: they must load
on a real Triton); 300 requests/s overload it, 15 requests/s do not.
"""

from __future__ import annotations

import numpy as np
import pytest
from cost_model import cost_config, cost_repository

from repo_manager.adapters.loadgen import BackgroundLoad, LoadSpec, Phase, Target, Workload, measure, run_schedule
from repo_manager.adapters.loadgen.schedule import GIVE_UP_LAG_S, UNSENT
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.ops.tuning import Candidate

SLO_MS = 200.0


@pytest.fixture(scope="module")
def shedding_server(tmp_path_factory):
    root = cost_repository(tmp_path_factory.mktemp("overload"), "slow", fixed_ms=20.0, per_item_ms=0.5,
                           max_batch_size=2, dynamic_batching=True)
    policy = Candidate(2, 1, True, 0, (), "test").with_queue_policy(60_000, priority_levels=2)
    config = policy.apply(cost_config("slow", fixed_ms=20.0, per_item_ms=0.5, max_batch_size=2))
    # the overload tests abandon thousands of queued requests: the stop need not wait for them to be answered
    with TritonServer(root, drain_timeout_s=1.0) as server, TritonClient(server.url) as client:
        client.load("slow", config)
        yield server, config


def test_rejections_by_the_queue_policy_are_counted_apart_from_errors(shedding_server):
    server, config = shedding_server
    target = Target("slow", server.url)
    workload = Workload.from_config(config)
    trace = run_schedule(target, [Phase(300, 1.5), Phase(15, 2.0)], workload)
    spike, after = trace.phase_stats(0, SLO_MS), trace.phase_stats(1, SLO_MS)
    assert spike.rejected > 0 and spike.errors == 0 and spike.answered > 0
    assert spike.rejected + spike.answered == spike.requests
    assert spike.rejection_p99_ms is not None and spike.rejected_fraction > 0
    # the load dropped: the queue drained and the server answered again (on a busy shared machine a
    # starved Python stub may still shed the odd request, so no "zero rejections" here)
    assert after.errors == 0 and after.answered > after.rejected
    assert after.rejected_fraction < spike.rejected_fraction
    point = measure(target, LoadSpec(rate=300, requests=300, warmup_s=0.2, max_in_flight=10_000), workload)
    assert point.rejected > 0 and point.errors == 0 and point.error_samples == ()
    assert point.accepted_p99_ms < float("inf") and point.p99_ms == float("inf")  # rejected: never an answer


def test_a_run_the_client_cannot_drive_stops_sending_and_says_so(shedding_server):
    """100,000 requests/s for 3 s is more than this client can send: the run gives up once 2 s behind
    (instead of sending 300,000 requests late), and the phases it could not drive are invalid, with the
    unsent requests counted, never taken for answers, rejections or errors."""
    server, config = shedding_server
    # of the ~12,000 requests such a flood sends, a few went unanswered until the client's timeout in some runs (6, 22
    # and 87, in three runs of seven here, at the default 60 s; no listen-queue overflow was counted): 5 s, as the
    # policy search's own runs allow at least, so that they fail as errors in seconds
    trace = run_schedule(Target("slow", server.url), [Phase(100_000, 3.0), Phase(15, 1.0)],
                         Workload.from_config(config), timeout_s=5.0)
    spike, after = trace.phase_stats(0, SLO_MS), trace.phase_stats(1, SLO_MS)
    assert not spike.valid and spike.unsent > 0 and spike.requests + spike.unsent == 300_000
    assert spike.answered + spike.rejected + spike.errors == spike.requests
    assert not after.valid and (after.requests, after.unsent) == (0, 15) and trace.recovery(1, SLO_MS) is None
    # it stopped sending at the bound, and for good: nothing went out later than GIVE_UP_LAG_S behind its schedule,
    # and every request after the first unsent one stayed unsent (how long the answers to what went out take is
    # the server's and the network's business, so the run's length is not asserted)
    sent = trace.outcome != UNSENT
    assert trace.lag_ms[sent].max() <= GIVE_UP_LAG_S * 1000
    first_unsent = int(np.argmin(sent))
    assert not sent[first_unsent:].any() and sent[:first_unsent].all()


def test_background_load_marks_rejections_so_checks_do_not_take_them_for_wrong_answers(shedding_server):
    server, _ = shedding_server
    with BackgroundLoad(server.url, "slow", clients=24) as load:
        load.wait_for(150)
    summary = load.summary()
    assert summary.rejected > 0 and summary.failed == summary.rejected  # every failure was a rejection
    assert all(r.rejected and "timeout" in r.error for r in load.records if not r.ok)


def test_a_queue_policy_round_trips_through_the_config_schema():
    candidate = Candidate(8, 2, True, 500, (8,), "x").with_queue_policy(12_000, 32, priority_levels=3)
    config = candidate.apply(cost_config("m", fixed_ms=1.0, per_item_ms=1.0))
    db = config.dynamic_batching
    assert db.default_queue_policy.timeout_action == db.default_queue_policy.REJECT
    assert db.default_queue_policy.default_timeout_microseconds == 12_000
    assert db.default_queue_policy.allow_timeout_override and db.default_queue_policy.max_queue_size == 32
    assert db.priority_levels == 3 and db.default_priority_level == 3 and set(db.priority_queue_policy) == {1, 2, 3}
    assert Candidate.from_config(config).key == candidate.key == "b8-i2-d500-p8-q12000-m32-P3"
    assert candidate.without_queue_policy().key == "b8-i2-d500-p8"


def _search_on(exec_ms: dict[int, float], batching: Candidate, slo_ms: float, headroom_rps: float = 100.0):
    """A policy search over a measured-looking profile: only its plan (timeouts, structures) is used here."""
    from repo_manager.ops.tuning.candidates import Profile
    from repo_manager.ops.tuning.overload import PolicySearch

    profile = Profile(exec_ms, 1.0, max(exec_ms))
    return PolicySearch(None, profile, batching, 300.0, slo_ms, 2.0, 80.0, headroom_rps)  # type: ignore[arg-type]


def test_the_first_queue_timeout_covers_the_batch_in_flight():
    """Triton checks a queue timeout only when an instance is free (after the batch in flight): a timeout
    shorter than one full batch sheds normal traffic. 10 ms + 2 ms/item at max batch 4 (18 ms) under 60 ms:
    0.7 x 60 - 18 - 1 = 23 ms is within [1.2 x 18, 0.9 x 60 - 18 - 1]; under 45 ms the same formula gives
    12.5 ms, shorter than a batch, so the first try is 21.6 ms instead."""
    exec_ms = {1: 12.0, 2: 14.0, 4: 18.0, 8: 26.0}
    search = _search_on(exec_ms, Candidate(4, 1), 60.0)
    assert search.first_timeout_ms() == pytest.approx(23.0)
    tight = _search_on(exec_ms, Candidate(4, 1), 45.0)
    low, high = tight.timeout_range_ms(Candidate(4, 1))
    assert (low, high) == (pytest.approx(21.6), pytest.approx(21.5))  # (empty by a hair: a smaller batch fits)
    assert tight.first_timeout_ms() >= 1.2 * 18.0
    # a queue delay holds a request back before the batcher takes it: the timeout covers it too
    assert search.timeout_range_ms(Candidate(4, 1, True, 3000))[0] == pytest.approx(24.6)


def test_the_policy_search_tries_simpler_structures_where_the_chosen_one_cannot_hold_a_timeout():
    """3 ms + 3 ms/item, max batch 8 (27 ms), 2 instances and a delay, under 50 ms: no timeout both covers
    a batch in flight (>= 32 ms) and leaves an accepted request its own batch (<= 17 ms), so the search
    plans the same without the delay, a smaller max batch whose range is not empty, and one instance."""
    exec_ms = {1: 6.0, 2: 9.0, 4: 15.0, 8: 27.0}
    search = _search_on(exec_ms, Candidate(8, 2, True, 8330), 50.0, headroom_rps=180.0)
    planned = [c.key for c in search.structures()]
    assert planned[:3] == ["b8-i2-d8330", "b8-i2-d0", "b4-i2-d0"] and planned[3].startswith("b4-i1")
    fits = [key for key, c in zip(planned, search.structures()) if search._range_fits(c)]
    assert fits and all(not key.startswith("b8") for key in fits)
