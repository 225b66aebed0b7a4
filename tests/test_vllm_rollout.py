"""`trm rollout` and `trm agent` move a vLLM model under a load of concurrent long streams: none fails,
none breaks.

Real parts only: published versions of a random-weight Llama (tests/llm_checkpoints.py), trm's vllm
backend with vLLM's CPU engine on one embedded tritonserver for the module, the LLM load generator
streaming over gRPC in a background thread while `trm rollout` loads version 2 beside version 1 and
unloads version 1; then a `trm agent` following a folder store over the same server and repository moves
it to version 3 when the environment's pointer moves. Streams sent before a switch began must finish on
the old version, streams sent after it ended must come from the new one, and the old version is unloaded
only once its engine reports no stream in flight. Engines side by side on a shared 2-core machine are
slow: few streams, a tiny model, no timing asserts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from llm_checkpoints import causal_lm

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, LLMResult, run_llm
from repo_manager.adapters.loadgen.measure import Target
from repo_manager.adapters.triton.client import TritonClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
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


def _sent_after(streams: _Streams, moment: float) -> bool:
    """A finished batch all of whose streams were sent after ``moment`` (this process's perf_counter): the batch
    running at ``moment`` may have sent its streams before it."""
    return any(len(b.sent_at) and float(b.sent_at.min()) > moment for b in list(streams.results))


def _p99(values: list[float]) -> float:
    return round(float(np.nanpercentile(values, 99)), 1) if values else float("nan")


@pytest.fixture(scope="module")
def server(repo):
    from repo_manager.adapters.triton.server import TritonServer

    with TritonServer(repo) as server:
        yield server


def _stream_on(server) -> _Streams:
    return _Streams(Target("tiny", server.url, protocol="grpc", grpc_url=server.endpoints.grpc))


def test_rollout_under_long_streams_breaks_none_and_drains_the_old_version(repo, env, server):
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.ops.serving import load_version

    with TritonClient(server.url, timeout_s=1800) as client:
        load_version(client, LocalRepository(repo), "tiny", 1)
    registry = Path(env["TRM_VLLM_ENGINE_REGISTRY"])  # the module's, which the server was started with
    old_segments = [s for p in registry.glob("*.json") for s in json.loads(p.read_text())["segments"]]
    streams = _stream_on(server)
    streams.start()
    while not streams.results and streams.error is None:  # one batch of steady state first
        time.sleep(0.5)
    began, wall = time.perf_counter(), time.time()
    result = _trm("--json", "rollout", "tiny", "--version", 2, "--url", server.url, "--grpc-url",
                  server.endpoints.grpc, "--metrics-url", server.endpoints.metrics, "--repo", repo,
                  "--no-precheck", env=env)
    ended = time.perf_counter()
    while not _sent_after(streams, ended) and streams.error is None and streams.is_alive():
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
    # version 1 was unloaded once its engine reported no stream in flight (whether one was still running when
    # version 2 took over is timing; none broke, above)
    assert "in flight finished" in steps["drain"]["detail"], steps["drain"]
    print(f"drain: {steps['drain']['detail']}; streams of version 1 ending after its unload began: "
          f"{sum(1 for v, d in zip(versions, done) if v == 1 and d > drop)}")
    # the replaced engine leaves nothing while the server keeps running: once its stub is gone the server's
    # sweep frees its processes and segments and drops its record (before, they could stay until the server
    # stopped); the one record left is version 2's live engine
    from repo_manager.adapters.engines import has_dead_engine
    from repo_manager.adapters.triton.server import ENGINE_SWEEP_S

    deadline = time.monotonic() + max(300, 3 * ENGINE_SWEEP_S + 30)  # a hang detector: a sweep takes seconds
    while (has_dead_engine(registry) or len(list(registry.glob("*.json"))) != 1) and time.monotonic() < deadline:
        time.sleep(0.5)
    records = [json.loads(p.read_text()) for p in registry.glob("*.json")]
    assert len(records) == 1 and not has_dead_engine(registry), records
    assert old_segments and [s for s in old_segments if Path(s).exists()] == []


STEP = re.compile(r"(\d\d:\d\d:\d\d\.\d{3}) \S+ (.+?): (ok|FAILED) \(([\d.]+) s\)(.*)$")
"""A rollout step in the agent's log (rollout.execute.StepLog): start time (UTC), name, outcome, seconds, detail."""


def _agent_steps(log: str, since: float) -> dict[str, tuple[float, float, str]]:
    """The agent's last rollout steps that started after ``since`` (epoch): first word -> (start, seconds,
    detail), start on the epoch clock."""
    found = {}
    day = datetime.fromtimestamp(since, tz=timezone.utc).strftime("%Y-%m-%d")
    for line in log.splitlines():
        match = STEP.search(line)
        if match and match.group(3) == "ok":
            start = datetime.fromisoformat(f"{day}T{match.group(1)}+00:00").timestamp()
            if start >= since - 1:
                found[match.group(2).split()[0]] = (start, float(match.group(4)), match.group(5).strip())
    return found


def test_agent_promotion_under_long_streams_breaks_none_and_unloads_the_old_version_once_drained(
        repo, env, server, tmp_path):
    """The store's pointer moves from version 2 (what the rollout above left served) to version 3: the
    agent pre-checks version 3 under a temporary name (the streamed smoke check, before any client can
    reach it), loads it beside version 2 (the plan: twice the planned memory fits), waits for version 2's
    streams, then unloads it. Streams run the whole time."""
    from agent_helpers import AgentProcess

    from repo_manager.adapters.storage import open_store

    published = _trm("--json", "publish", "model", json.loads((repo / "tiny" / "2" / "trm-manifest.json")
                                                               .read_text())["source"]["path"],
                     "--name", "tiny", "--format", "vllm", "--repo", repo, "--max-num-seqs", "4", "--no-verify",
                     env=env)
    assert published.returncode == 0 and json.loads(published.stdout)["version"] == 3, published.stderr[-2000:]
    store = str(tmp_path / "store")
    pushed = _trm("push", store, "--repo", repo, "--model", "tiny:2", "--model", "tiny:3", env=env)
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    open_store(store).update_env("production", {"tiny": 2})
    agent = AgentProcess(store, "production", server, repo, tmp_path / "cache", pod="llm", interval=0.3,
                         log_dir=tmp_path, extra=("--metrics-url", server.endpoints.metrics))
    agent.start()
    try:
        agent.wait_serving({"tiny": 2}, timeout=600)  # the served version is smoke-checked: no engine starts
        streams = _stream_on(server)
        streams.start()
        while not streams.results and streams.error is None:  # one batch of steady state first
            time.sleep(0.5)
        began, wall = time.perf_counter(), time.time()
        open_store(store).update_env("production", {"tiny": 3})
        agent.wait_serving({"tiny": 3}, timeout=900)
        ended = time.perf_counter()
        while not _sent_after(streams, ended) and streams.error is None and streams.is_alive():
            time.sleep(0.5)  # one whole batch sent after the agent converged
        streams.stop.set()
        streams.join(timeout=600)
        log = agent.log_path.read_text(errors="replace")
    finally:
        agent.stop()
    assert streams.error is None, streams.error
    steps = _agent_steps(log, wall)
    assert {"pre-check", "load", "smoke", "drain", "drop"} <= set(steps), log[-3000:]
    batches: list[LLMResult] = streams.results
    sent = np.concatenate([b.sent_at for b in batches])
    versions = [v for b in batches for v in b.answered_by]
    outcomes = [o for b in batches for o in b.outcomes]
    ttft = np.concatenate([b.ttft for b in batches])
    done = sent + np.concatenate([b.latency for b in batches]) / 1000.0

    def at(step: str) -> float:  # on this process's clock
        return began + steps[step][0] - wall

    phases = {"steady": [t for t, s in zip(ttft, sent) if s < began or s > ended],
              "pre-check": [t for t, s in zip(ttft, sent) if at("pre-check") <= s < at("load")],
              "load beside": [t for t, s in zip(ttft, sent) if at("load") <= s < at("smoke")],
              "switched": [t for t, s in zip(ttft, sent) if at("smoke") <= s <= ended]}
    print(f"\nagent promotion: {ended - began:.1f} s, {len(outcomes)} streams; steps "
          f"{ {k: v[1] for k, v in steps.items()} }; drain: {steps['drain'][2]}")
    print("TTFT p99 by phase: " + ", ".join(f"{k} {_p99(v)} ms ({len(v)})" for k, v in phases.items()))
    assert sum(b.failed for b in batches) == 0 and sum(b.broken for b in batches) == 0, \
        [e for b in batches for e in b.error_samples]
    assert set(outcomes) == {"complete"} and sum(b.short for b in batches) == 0
    assert {v for v, s in zip(versions, sent) if s < began} == {2}
    assert {v for v, s in zip(versions, sent) if s > at("smoke")} <= {3}  # new requests go to version 3
    assert {v for v, s in zip(versions, sent) if s > ended} == {3}
    assert "in flight finished" in steps["drain"][2], steps["drain"]  # unloaded once its engine was idle
    print(f"streams of version 2 ending after its unload began: "
          f"{sum(1 for v, d in zip(versions, done) if v == 2 and d > at('drop'))}")
    with TritonClient(server.url) as client:
        index = {(m["name"], m.get("version")): m.get("state") for m in client.repository_index()}
    assert index.get(("tiny", "3")) == "READY" and index.get(("tiny", "2")) != "READY"
    assert not any(name.startswith("trm-verify-") and state == "READY" for (name, _), state in index.items())
