"""`trm agent` beside one real tritonserver, following an environment in a real store.

The models are tiny Python-backend models whose answers carry their version (tests/rollout_models.py),
so the background clients see which version answered every request.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import rollout_models as rm
from agent_helpers import AgentProcess
from helpers import run_cli

from repo_manager.agent.lease import DrainLease
from repo_manager.loadgen import BackgroundLoad, Workload
from repo_manager.storage import open_store
from repo_manager.triton.server import TritonServer

WORKLOAD = Workload(({"X": np.ones((1, rm.FEATURES), np.float32)},))


def tag(outputs) -> str:
    return f"v{int(outputs['TAG'].ravel()[0])}"


def publish(capsys, src, location, model, version, env="production", **behaviour):
    assert rm.tagged(src, model, version, **behaviour) == version
    result = run_cli(capsys, "push", location, "--repo", src, "--model", f"{model}:{version}", "--json")
    assert result.code == 0, result.err
    if env:
        open_store(location).update_env(env, {model: version})


@pytest.fixture(params=["folder", "s3"])
def location(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_location")


def test_conditional_pointer_read_and_drain_lease(location):
    store = open_store(location)
    first = store.update_env("production", {"m": 1})
    assert store.get_env_if_changed("production", first.etag) is None
    assert store.get_env_if_changed("production", None).models == {"m": 1}
    store.update_env("production", {"m": 2})
    moved = store.get_env_if_changed("production", first.etag)
    assert moved is not None and moved.models == {"m": 2} and moved.etag != first.etag

    a, b = DrainLease(store, "production", "a", 1), DrainLease(store, "production", "b", 1)
    assert a.try_acquire() and a.try_acquire()  # taking a held slot again renews it
    assert not b.try_acquire() and a.holders() == ["a"]
    a.release()
    assert b.try_acquire() and b.holders() == ["b"]
    two = DrainLease(store, "production", "c", 2)
    assert two.try_acquire() and sorted(two.holders()) == ["b", "c"]
    stale = DrainLease(store, "canary", "dead", 1, ttl_s=0.05)
    assert stale.try_acquire()
    time.sleep(0.1)  # a pod killed while holding a slot frees it after the TTL
    assert DrainLease(store, "canary", "alive", 1).try_acquire()


def test_agent_starts_follows_refuses_and_stops_cleanly(capsys, s3_location, tmp_path):
    src, node = tmp_path / "src", tmp_path / "node"
    (node / "repo").mkdir(parents=True)
    publish(capsys, src, s3_location, "m", 1, delay=0.005)
    with TritonServer(node / "repo") as server:
        agent = AgentProcess(s3_location, "production", server, node / "repo", node / "cache", pod="solo",
                             log_dir=tmp_path).start()
        try:
            status = agent.wait_serving({"m": 1})
            assert agent.get("/readyz")[0] == 200 and agent.get("/healthz")[0] == 200
            assert status["last_rollout"]["outcome"] == "done" and status["sync"]["bytes_downloaded"] > 0
            with BackgroundLoad(server.url, "m", clients=3, workload=WORKLOAD, check=tag) as load:
                load.wait_for(30)
                publish(capsys, src, s3_location, "m", 2, delay=0.005)
                agent.wait_serving({"m": 2})
                load.wait_for(load.count() + 30)
                # a version that cannot load: refused, v2 keeps answering, ready, /status says why
                publish(capsys, src, s3_location, "m", 3, fail_load=True)
                status = agent.wait(lambda s: s["state"] == "degraded", what="degraded")
                load.wait_for(load.count() + 30)
            summary = load.summary()
            assert summary.failed == 0, summary.errors
            assert set(summary.label_counts) == {"v1", "v2"} and summary.stale == 0
            assert status["served"] == {"m": 2} and status["wanted"] == {"m": 3} and status["ready"]
            assert "m" in status["degraded_reason"] and status["refused"]["models"] == {"m": 3}
            assert status["last_rollout"]["outcome"] == "refused"
            assert agent.get("/readyz")[0] == 200
            metrics = agent.metrics()
            assert metrics['trm_agent_served_version{env="production",pod="solo",model="m"}'] == 2
            assert metrics['trm_agent_degraded{env="production",pod="solo"}'] == 1
            assert metrics['trm_agent_rollouts_total{env="production",pod="solo",outcome="refused"}'] == 1
            assert 'trm_agent_pointer_age_seconds{env="production",pod="solo"}' in metrics
            unchanged = status["pointer"]["unchanged"]
            agent.wait(lambda s: s["pointer"]["unchanged"] > unchanged + 2, what="more conditional reads")
            assert agent.status()["rollouts"].get("refused") == 1  # not retried while the pointer stays

            publish(capsys, src, s3_location, "m", 4, delay=0.005)  # the pointer moves on: converges again
            status = agent.wait_serving({"m": 4})
            assert status["degraded_reason"] is None
            def versions() -> list[str]:
                return sorted(p.name for p in (node / "repo" / "m").iterdir() if p.name.isdigit())
            deadline = time.monotonic() + 20
            while versions() != ["4"] and time.monotonic() < deadline:  # pruned once v2 is unloaded
                time.sleep(0.2)
            assert versions() == ["4"]
        finally:
            code = agent.stop()
        assert code == 0, agent.log_tail()
        assert "stopped" in agent.log_tail()
