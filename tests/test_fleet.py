"""A fleet on this machine: three real Triton servers, each with its own repository and its own
`trm agent`, on two simulated nodes (the two servers of node ``a`` share one node cache), following
``production`` in a real S3 store (SeaweedFS) under continuous load from clients that count every
failure. One test walks the whole story (the fleet takes a while to start):

1. promote staging -> production: every server answers with the new version, no request fails, the
   second server on node ``a`` downloads 0 blob bytes;
2. a broken version (it cannot load) is promoted: every agent refuses it, no request fails, /status
   says why;
3. an agent SIGKILLed mid-rollout comes back and converges, still without a failed request; old
   version folders are pruned from every repository, and SIGTERM stops every agent with exit 0.

Timings are printed, not asserted (bench/bench_fleet.py measures them).
"""

from __future__ import annotations

import time

import numpy as np
import rollout_models as rm
from agent_helpers import Fleet
from helpers import run_cli

from repo_manager.adapters.loadgen import BackgroundLoad, Workload
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton.client import TritonClient

WORKLOAD = Workload(({"X": np.ones((1, rm.FEATURES), np.float32)},))


def tag(outputs) -> str:
    return f"v{int(outputs['TAG'].ravel()[0])}"


def release(capsys, src, location, version, **behaviour) -> None:
    """Publish version ``version`` of ``m``, push it and point staging at it."""
    assert rm.tagged(src, "m", version, delay=0.002, **behaviour) == version
    pushed = run_cli(capsys, "push", location, "--repo", src, "--model", f"m:{version}")
    assert pushed.code == 0, pushed.err
    open_store(location).update_env("staging", {"m": version})


def promote(capsys, location) -> float:
    """`trm promote m --from staging --to production` (checksums only: the agents are what is tested,
    and the broken version must get through). Returns when the pointer moved (monotonic time)."""
    result = run_cli(capsys, "promote", "m", "--from", "staging", "--to", "production", "--store", location,
                     "--gates", "checksums")
    assert result.code == 0, result.err
    return time.monotonic()


def blob_bytes(location: str, version: int) -> int:
    return open_store(location).get_manifest("m", version).total_size


def version_folders(repo) -> list[str]:
    return sorted(p.name for p in (repo / "m").iterdir() if p.name.isdigit())


def kill_mid_rollout(fleet: Fleet, pod: str) -> list[str]:
    """SIGKILL the agent of ``pod`` once its server holds more than v2 (a pre-check model under a
    temporary name, or v4 beside v2): the middle of the rollout. Returns what the server held."""
    deadline = time.monotonic() + 60
    with TritonClient(fleet.servers[pod].url) as client:
        while time.monotonic() < deadline:
            held = sorted(f"{e['name']}:{e.get('version')}" for e in client.repository_index()
                          if e.get("state") == "READY")
            if held != ["m:2"]:
                break
            time.sleep(0.02)
    fleet.agents[pod].kill()
    return held


def test_fleet_promotes_refuses_and_recovers_with_zero_failed_requests(capsys, s3_location, tmp_path):
    src = tmp_path / "src"
    release(capsys, src, s3_location, 1)
    open_store(s3_location).update_env("production", {"m": 1})
    fleet = Fleet(tmp_path / "fleet", s3_location, "production", {"a": 2, "b": 1}, interval=0.5)
    try:
        fleet.start()
        fleet.wait_serving({"m": 1})
        loads = {pod: BackgroundLoad(server.url, "m", clients=2, workload=WORKLOAD, check=tag)
                 for pod, server in fleet.servers.items()}
        for load in loads.values():
            load.__enter__()
        try:
            for load in loads.values():
                load.wait_for(20)
            # 1. promote: every server follows
            before = {pod: agent.status()["sync"]["bytes_downloaded"] for pod, agent in fleet.agents.items()}
            release(capsys, src, s3_location, 2)
            moved = promote(capsys, s3_location)
            fleet.wait_serving({"m": 2})
            print(f"\npromote -> all {len(fleet.agents)} servers serving v2: {time.monotonic() - moved:.2f} s "
                  f"(interval 0.5 s + jitter)")
            for pod, server in fleet.servers.items():
                with TritonClient(server.url) as client:
                    assert tag(client.infer("m", {"X": np.ones((1, rm.FEATURES), np.float32)})) == "v2", pod
            downloaded = {pod: agent.status()["sync"]["bytes_downloaded"] - before[pod]
                          for pod, agent in fleet.agents.items()}
            print(f"blob bytes downloaded per server for v2: {downloaded}")
            size = blob_bytes(s3_location, 2)
            # node a: its two servers share the cache, so v2's blobs came down once, for both
            assert sorted([downloaded["a-pod1"], downloaded["a-pod2"]]) == [0, size], downloaded
            assert downloaded["b-pod1"] == size
            metrics = fleet.agents["a-pod1"].metrics()
            assert metrics['trm_serving_version{model="m"}'] == 2

            # 2. a broken version: refused everywhere, v2 keeps answering
            release(capsys, src, s3_location, 3, fail_load=True)
            promote(capsys, s3_location)
            for agent in fleet.agents.values():
                status = agent.wait(lambda s: s["state"] == "degraded", what="refusal")
                assert status["served"] == {"m": 2} and status["wanted"] == {"m": 3} and status["ready"]
                assert "failed to load m" in status["degraded_reason"] or "m" in status["degraded_reason"]
                assert agent.get("/readyz")[0] == 200
                assert status["last_rollout"]["outcome"] == "refused"
            metrics = fleet.agents["b-pod1"].metrics()
            assert metrics['trm_agent_degraded{env="production",pod="b-pod1"}'] == 1
            assert metrics['trm_agent_rollouts_total{env="production",outcome="refused",pod="b-pod1"}'] == 1
            assert metrics['trm_operations_total{model="",operation="sync",outcome="ok"}'] >= 2  # v3 synced too
            assert 'trm_operation_last_success_timestamp_seconds{model="",operation="pointer_read"}' in metrics
            reads = fleet.agents["b-pod1"].status()["pointer"]["unchanged"]
            fleet.agents["b-pod1"].wait(lambda s: s["pointer"]["unchanged"] > reads + 2, what="conditional reads")
            assert fleet.agents["b-pod1"].status()["rollouts"]["refused"] == 1  # no retry while the pointer stays

            # waves: an environment that requires this one is refused the version its agents refused
            (tmp_path / "configs").mkdir()
            (tmp_path / "configs" / "trm.yaml").write_text(
                "environments: {production: {}, next-wave: {requires: production}}\n")
            held = run_cli(capsys, "promote", "m", "--version", "3", "--to", "next-wave", "--store", s3_location,
                           "--gates", "checksums")
            assert held.code == 9 and "refused m version 3" in held.err, held.err
            (tmp_path / "configs" / "trm.yaml").unlink()

            # 3. an agent killed mid-rollout restarts and converges
            release(capsys, src, s3_location, 4)
            promote(capsys, s3_location)
            left = kill_mid_rollout(fleet, "a-pod1")
            print(f"a-pod1 killed mid-rollout with the server holding {left}")
            fleet.agents["a-pod1"] = fleet.new_agent("a", "a-pod1").start()
            fleet.wait_serving({"m": 4})
            for load in loads.values():
                load.wait_for(load.count() + 20)
        finally:
            for load in loads.values():
                load.stop()
        for pod, load in loads.items():
            summary = load.summary()
            print(f"{pod}: {summary.requests} requests, {summary.failed} failed, answers {summary.label_counts}")
            assert summary.failed == 0, (pod, summary.errors)
            assert "v3" not in summary.label_counts and summary.stale == 0
        for pod, server in fleet.servers.items():
            with TritonClient(server.url) as client:
                loaded = {(e["name"], e.get("version")) for e in client.repository_index() if e.get("state") == "READY"}
                # pre-check models are loaded with file overrides: only the statistics list them
                loaded |= {(e["name"], e.get("version")) for e in client.statistics()}
            assert loaded == {("m", "4")}, (pod, loaded)  # no pre-check leftovers, no old version
            assert LocalRepository(fleet.repo(pod)).validate() == []  # no partial version
            deadline = time.monotonic() + 60  # a hang detector
            while version_folders(fleet.repo(pod)) != ["4"] and time.monotonic() < deadline:
                time.sleep(0.2)  # pruned once v2 is unloaded
            assert version_folders(fleet.repo(pod)) == ["4"], pod
        for agent in fleet.agents.values():
            assert agent.stop() == 0, agent.log_tail()  # SIGTERM: a clean exit
    finally:
        fleet.stop()
