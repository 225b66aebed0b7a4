"""The vLLM engine search (``tuning.llm.fast_search``) on recorded points: which settings it measures, in which
order, and so how many engine starts a run costs. No engine: a stand-in prober answers from the recorded
figures and counts a start whenever the setting changes, as ``LLMProber`` does."""

from __future__ import annotations

import pytest

from repo_manager.ops.tuning.llm import EngineCandidate, LLMPoint, LLMTuneRequest, choose, fast_search


class Recorded:
    def __init__(self, request: LLMTuneRequest, goodput: dict[tuple[int, str], float], served: EngineCandidate):
        self.request, self.goodput = request, goodput
        self.loaded, self.loads = served.key, 0
        self.points: list[LLMPoint] = []

    def point(self, candidate: EngineCandidate, level: str) -> LLMPoint:
        done = next((p for p in self.points if p.candidate == candidate.key and p.level == level), None)
        if done is not None:
            return done
        if self.loaded != candidate.key:
            self.loads, self.loaded = self.loads + 1, candidate.key
        goodput = self.goodput[(candidate.max_num_seqs, level)]
        point = LLMPoint(candidate.key, level, 2.0, True, 1.0, "",
                         {"goodput_rps": goodput, "request_throughput_rps": goodput, "failed": 0, "broken": 0,
                          "ttft_p99_ms": 100.0, "itl_p99_ms": 10.0})
        self.points.append(point)
        return point


@pytest.mark.parametrize(("smaller_goodput", "low_on", "starts"), [
    (1.95, 4, 1),   # within the tie of the served setting's 2.0: the smaller one is preferred and is loaded already
    (1.70, 8, 2),   # clearly below: the low rate goes back to the served setting, one more start
])
def test_the_served_setting_is_measured_first_and_the_low_rate_follows_the_preferred_one(
        smaller_goodput, low_on, starts):
    request = LLMTuneRequest("tiny", ttft_p99_ms=20000, itl_p99_ms=2000, low_rps=1, peak_rps=2, seqs=(4, 8),
                             tokens=(2048,))
    candidates = request.candidates(None)
    served = EngineCandidate(8, 2048)
    prober = Recorded(request, {(8, "peak"): 2.0, (4, "peak"): smaller_goodput, (8, "low"): 1.0, (4, "low"): 1.0},
                      served)
    fast_search(prober, candidates, 2048)  # type: ignore[arg-type]
    order = [(p.candidate, p.level) for p in prober.points]
    assert order[0] == (served.key, "peak")  # the bisection's upper middle: the served one, without a start
    assert order[-1] == (EngineCandidate(low_on, 2048).key, "low")
    assert prober.loads == starts
    assert choose(prober.points, candidates) == EngineCandidate(low_on, 2048)
