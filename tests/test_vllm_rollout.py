"""`trm rollout` of a vLLM model under a load of concurrent long streams: none fails, none breaks.

Real parts only: two published versions of a random-weight Llama (tests/llm_checkpoints.py), trm's vllm
backend with vLLM's CPU engine on the embedded tritonserver, the LLM load generator streaming over gRPC in a
background thread while `trm rollout` loads version 2 beside version 1 and unloads version 1. Streams sent
before the rollout began must finish on version 1, streams sent after it ended must come from version 2.
Two engines side by side on a shared 2-core machine are slow: few streams, a tiny model, no timing asserts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime

import numpy as np
import pytest
from llm_checkpoints import causal_lm

from repo_manager.loadgen.llm import Lengths, LLMLoad, LLMResult, run_llm
from repo_manager.loadgen.measure import Target

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (scripts/setup.sh installs it)")]

LOAD = LLMLoad(concurrency=3, requests=6, input_tokens=Lengths(6), output_tokens=Lengths(96), timeout_s=600)
"""One batch of the background load: 3 long streams in flight at a time (96 tokens of a 128-token context)."""


def _trm(*args, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repo_manager", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """A registry of engines for this module alone (the launcher reads TRM_VLLM_ENGINE_REGISTRY)."""
    folder = tmp_path_factory.mktemp("engines")
    old = os.environ.get("TRM_VLLM_ENGINE_REGISTRY")
    os.environ["TRM_VLLM_ENGINE_REGISTRY"] = str(folder)
    yield dict(os.environ)
    if old is None:
        os.environ.pop("TRM_VLLM_ENGINE_REGISTRY", None)
    else:
        os.environ["TRM_VLLM_ENGINE_REGISTRY"] = old


@pytest.fixture(scope="module")
def repo(tmp_path_factory, env):
    checkpoint = causal_lm(tmp_path_factory.mktemp("llm") / "tiny-llama", max_position_embeddings=128)
    root = tmp_path_factory.mktemp("repo")
    for version in (1, 2):  # the generation itself is verified in test_vllm.py; here two versions suffice
        result = _trm("--json", "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo",
                      root, "--max-num-seqs", "4", "--no-verify", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads(result.stdout)["version"] == version
    return root


class _Streams(threading.Thread):
    """Batches of LOAD, back to back, until stopped; every batch's result is kept."""

    def __init__(self, target: Target) -> None:
        super().__init__(daemon=True)
        self.target, self.stop, self.results = target, threading.Event(), []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.results.append(run_llm(self.target, LOAD))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _p99(values: list[float]) -> float:
    return round(float(np.nanpercentile(values, 99)), 1) if values else float("nan")


def test_rollout_under_long_streams_breaks_none_and_drains_the_old_version(repo, env):
    from repo_manager.repository import LocalRepository
    from repo_manager.serving import load_version
    from repo_manager.triton.client import TritonClient
    from repo_manager.triton.server import TritonServer

    with TritonServer(repo) as server:
        with TritonClient(server.url, timeout_s=1800) as client:
            load_version(client, LocalRepository(repo), "tiny", 1)
        streams = _Streams(Target("tiny", server.url, protocol="grpc", grpc_url=server.endpoints.grpc))
        streams.start()
        while not streams.results and streams.error is None:  # one batch of steady state first
            time.sleep(0.5)
        began, wall = time.perf_counter(), time.time()
        result = _trm("--json", "rollout", "tiny", "--version", 2, "--url", server.url, "--grpc-url",
                      server.endpoints.grpc, "--repo", repo, "--no-precheck", env=env)
        ended = time.perf_counter()
        after = len(streams.results)
        while len(streams.results) < after + 1 and streams.error is None and streams.is_alive():
            time.sleep(0.5)  # one whole batch sent after the rollout ended
        streams.stop.set()
        streams.join(timeout=600)
        assert streams.error is None, streams.error
        assert result.returncode == 0, result.stderr[-3000:]
        steps = {s["step"].split()[0]: s for s in json.loads(result.stdout)["servers"][0]["steps"]}
        with TritonClient(server.url) as client:
            index = {(m["name"], m.get("version")): m.get("state") for m in client.repository_index()}
    batches: list[LLMResult] = streams.results
    sent = np.concatenate([b.sent_at for b in batches])
    versions = [v for b in batches for v in b.answered_by]
    outcomes = [o for b in batches for o in b.outcomes]
    ttft = np.concatenate([b.ttft for b in batches])
    done = sent + np.concatenate([b.latency for b in batches]) / 1000.0
    # the unload of version 1 (Triton's reload with version 2 alone), on this process's clock
    def at(step: str) -> float:  # when a step of the rollout started, on this process's clock
        return began + datetime.fromisoformat(steps[step]["started_at"].replace("Z", "+00:00")).timestamp() - wall

    ready, drop = at("smoke"), at("drop")  # version 2 answers from its load on; version 1 is unloaded at drop
    timings = {name: step["seconds"] for name, step in steps.items()}
    print(f"\nrollout: {ended - began:.1f} s, {len(outcomes)} streams; steps {timings}")
    steady = [t for t, s in zip(ttft, sent) if s < began or s > ended]
    switch = [t for t, s in zip(ttft, sent) if began <= s <= ended]
    print(f"TTFT p99 steady {_p99(steady)} ms ({len(steady)} streams), during the switch {_p99(switch)} ms "
          f"({len(switch)} streams); versions {dict(zip(*np.unique([str(v) for v in versions], return_counts=True)))}")
    assert sum(b.failed for b in batches) == 0 and sum(b.broken for b in batches) == 0, \
        [e for b in batches for e in b.error_samples]
    assert set(outcomes) == {"complete"} and sum(b.short for b in batches) == 0
    before = [v for v, s in zip(versions, sent) if s < began]
    later = [v for v, s in zip(versions, sent) if s > ended]
    assert before and set(before) == {1}  # streams in flight when the switch began finished on version 1
    assert later and set(later) == {2}
    assert switch  # streams were sent while both engines were loading and switching
    overlap = [v for v, s, d in zip(versions, sent, done) if s < ready < d]
    dropped = [v for v, s, d in zip(versions, sent, done) if s < drop < d]
    near = [t for t, s in zip(ttft, sent) if ready - 2 <= s <= ready + 2]
    print(f"in flight when version 2 took over: {len(overlap)} streams, answered by {overlap}; at the unload of "
          f"version 1: {dropped}; TTFT p99 of the streams sent within 2 s of the takeover {_p99(near)} ms "
          f"({len(near)} streams)")
    # once version 2 is loaded (its smoke check begins) every new stream goes to it; those already running on
    # version 1 finish there (none broke, above). Whether one is still running at that instant is timing.
    assert {v for v, s in zip(versions, sent) if s > ready} <= {2}
    assert index.get(("tiny", "2")) == "READY" and index.get(("tiny", "1")) != "READY"
