"""`trm rollout` against real tritonserver processes under continuous load from several clients.

Every model here is a tiny Python-backend model whose answers carry the version that computed them
(tests/rollout_models.py), so each request of the background load says which version served it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import rollout_models as rm
from helpers import run_cli

from repo_manager.adapters.loadgen import BackgroundLoad, Workload
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.ops.rollout.plan import served_versions
from repo_manager.ops.rollout.record import read_records
from repo_manager.ops.serving import load_version

CLIENTS = 4
WORKLOAD = Workload(({"X": np.ones((1, rm.FEATURES), np.float32)},))


def tag(outputs) -> str:
    return f"v{int(outputs['TAG'].ravel()[0])}"


def switched(summary, old: str, new: str) -> bool:
    """Answers went from ``old`` to ``new`` once: only those two labels, and no request sent after the
    first ``new`` answer arrived was answered by ``old`` (exact even when clients interleave)."""
    return (set(summary.label_counts) == {old, new} and summary.labels[0] == old
            and summary.labels[-1] == new and summary.stale == 0)


def pipe_tag(outputs) -> str:
    pre, post = int(outputs["PRE_TAG"].ravel()[0]), int(outputs["POST_TAG"].ravel()[0])
    return f"v{pre}" if pre == post else f"mixed {pre}/{post}"


@pytest.fixture
def repo_root(tmp_path):
    return tmp_path / "repo"


def start(repo_root, model: str, version: int) -> TritonServer:
    server = TritonServer(repo_root).start()
    with TritonClient(server.url) as client:
        load_version(client, LocalRepository(repo_root), model, version)
    return server


def at(*servers: TritonServer) -> list:
    """--url and --grpc-url for each server: model control over gRPC (the recommended setup)."""
    args: list = []
    for server in servers:
        args += ["--url", server.url, "--grpc-url", server.endpoints.grpc]
    return args


def rollout(capsys, repo_root, *args):
    return run_cli(capsys, "--json", "-q", "rollout", *args, "--repo", repo_root)


def test_v1_to_v2_switches_answers_with_zero_failed_requests(capsys, repo_root):
    rm.tagged(repo_root, "m", 1, delay=0.005)
    server = start(repo_root, "m", 1)
    try:
        # v2 changes the config too (batch size, two instances): still no failed request.
        rm.tagged(repo_root, "m", 2, delay=0.005, max_batch_size=4, instances=2)
        with BackgroundLoad(server.url, "m", clients=CLIENTS, workload=WORKLOAD, check=tag) as load:
            load.wait_for(40)
            result = rollout(capsys, repo_root, "m", "--version", 2, *at(server))
            start_count = load.count()
            load.wait_for(start_count + 40)
        summary = load.summary()
        assert result.code == 0, result.err
        assert summary.failed == 0, summary.errors
        assert switched(summary, "v1", "v2")
        assert summary.versions[0] == 1 and summary.versions[-1] == 2
        data = result.json()
        assert data["outcome"] == "done"
        [srv] = data["servers"]
        assert srv["before"] == {"m": [1]} and srv["after"] == {"m": [2]}
        # Triton's counters of v1 vanish with v1; sampled per step, the clients' requests are all counted
        assert srv["requests"] > 0 and srv["errors"] == 0, json.dumps(srv, indent=1)
        steps = [s["step"] for s in srv["steps"]]
        assert steps[0].startswith("pre-check") and "load m 1/2" in steps and "drop m -> 2" in steps
        assert all(s["started_at"].endswith("Z") for s in srv["steps"])
        [loaded] = srv["loads"]  # the one version this server did not hold, timed (the drop loads nothing)
        assert (loaded["model"], loaded["version"]) == ("m", 2) and loaded["seconds"] > 0, srv["loads"]
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (2,)}
        [record] = read_records(repo_root)
        assert record["url"] == server.url and record["after"] == {"m": [2]}
        assert record["loads"] == srv["loads"]
        with TritonClient(server.url) as client:  # the record beside the models is invisible to Triton
            assert {e["name"] for e in client.repository_index()} == {"m"}
        status = run_cli(capsys, "--json", "status", "--repo", repo_root)
        [entry] = status.json()["servers"]
        assert entry["models"] == {"m": [2]} and entry["up_to_date"] == {"m": True}

        with BackgroundLoad(server.url, "m", clients=CLIENTS, workload=WORKLOAD, check=tag) as load:
            load.wait_for(20)
            back = rollout(capsys, repo_root, "m", "--to-previous", "--url", server.url)
            load.wait_for(load.count() + 20)
        assert back.code == 0, back.err
        assert back.json()["version"] == 1
        assert load.summary().failed == 0 and switched(load.summary(), "v2", "v1")
    finally:
        server.stop()


def test_keep_previous_serves_clients_pinned_to_v1_throughout(capsys, repo_root):
    rm.tagged(repo_root, "m", 1, delay=0.005)
    server = start(repo_root, "m", 1)
    try:
        rm.tagged(repo_root, "m", 2, delay=0.005)
        with BackgroundLoad(server.url, "m", clients=2, workload=WORKLOAD, version=1, check=tag) as pinned, \
                BackgroundLoad(server.url, "m", clients=2, workload=WORKLOAD, check=tag) as free:
            pinned.wait_for(20)
            result = rollout(capsys, repo_root, "m", "--version", 2, "--url", server.url, "--keep-previous")
            pinned.wait_for(pinned.count() + 20)
            free.wait_for(free.count() + 20)
        assert result.code == 0, result.err
        assert pinned.summary().failed == 0 and pinned.summary().labels == ("v1",)
        assert free.summary().failed == 0 and switched(free.summary(), "v1", "v2")
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (1, 2)}
    finally:
        server.stop()


def test_ensemble_rollout_answers_all_old_or_all_new(capsys, tmp_path, repo_root):
    rm.ensemble(repo_root, 1)
    server = start(repo_root, "pipe", 1)
    try:
        rm.ensemble(repo_root, 2)
        with BackgroundLoad(server.url, "pipe", clients=CLIENTS, workload=WORKLOAD, check=pipe_tag) as load:
            load.wait_for(30)
            result = rollout(capsys, repo_root, "pipe", "--version", 2, *at(server))
            load.wait_for(load.count() + 30)
        summary = load.summary()
        assert result.code == 0, result.err
        assert summary.failed == 0, summary.errors
        assert switched(summary, "v1", "v2"), summary.label_counts  # never "mixed"
        with TritonClient(server.url) as client:
            assert served_versions(client, ["pipe", "pre", "post"]) == {"pipe": (2,), "pre": (2,), "post": (2,)}
        steps = [s["step"] for s in result.json()["servers"][0]["steps"]]
        assert steps.index("load pre 1/2") < steps.index("load pipe 2") < steps.index("drop pre -> 2")

        # A v3 pipeline that answers wrongly, without the pre-check: it goes live, fails the smoke check
        # and the whole pipeline is switched back, still without a failed or mixed answer.
        rm.ensemble(repo_root, 3, factor=3.0)
        with BackgroundLoad(server.url, "pipe", clients=CLIENTS, workload=WORKLOAD, check=pipe_tag) as load:
            load.wait_for(30)
            bad = rollout(capsys, repo_root, "pipe", "--version", 3, *at(server), "--no-precheck",
                          "--smoke", _smoke_file(tmp_path))
            load.wait_for(load.count() + 30)
        assert bad.code == 10 and bad.json()["error"]["reason"] == "smoke_failed"
        summary = load.summary()
        assert summary.failed == 0, summary.errors
        assert set(summary.label_counts) <= {"v2", "v3"} and summary.labels[-1] == "v2"
        with TritonClient(server.url) as client:
            assert served_versions(client, ["pipe", "pre", "post"]) == {"pipe": (2,), "pre": (2,), "post": (2,)}
    finally:
        server.stop()


def _smoke_file(tmp_path):
    """Requests with positive inputs and the answers every good version gives (Y = 2 X)."""
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps({"cases": [{"inputs": {"X": [[1, 2, 3, 4]]}, "outputs": {"Y": [[2, 4, 6, 8]]}}]}))
    return path


@pytest.mark.parametrize("precheck", ["--precheck", "--no-precheck"])
@pytest.mark.parametrize("broken, reason", [({"fail_load": True}, "load_failed"),
                                            ({"factor": 3.0}, "smoke_failed")])
def test_bad_v3_is_rolled_back_and_v2_keeps_serving(capsys, tmp_path, repo_root, broken, reason, precheck):
    rm.tagged(repo_root, "m", 1)
    rm.tagged(repo_root, "m", 2, delay=0.005)
    server = start(repo_root, "m", 2)
    try:
        rm.tagged(repo_root, "m", 3, **broken)
        with BackgroundLoad(server.url, "m", clients=CLIENTS, workload=WORKLOAD, check=tag) as load:
            load.wait_for(30)
            result = rollout(capsys, repo_root, "m", "--version", 3, *at(server),
                             "--smoke", _smoke_file(tmp_path), precheck)
            load.wait_for(load.count() + 30)
        summary = load.summary()
        assert result.code == 10, result.err
        data = result.json()
        # the pre-check refuses before the live model is touched: nothing changed, nothing rolled back
        outcome = "refused" if precheck == "--precheck" else "rolled_back"
        assert data["error"]["reason"] == reason and data["outcome"] == outcome
        assert [s["outcome"] for s in data["servers"]] == [outcome]
        assert summary.failed == 0, summary.errors
        assert summary.labels[-1] == "v2"
        if precheck == "--precheck":  # caught before the live model was touched: nobody saw v3
            assert summary.labels == ("v2",)
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (2,)}
        assert read_records(repo_root)[-1]["server_outcome"] == outcome
        assert read_records(repo_root)[-1]["rollout_outcome"] == outcome
    finally:
        server.stop()


def _mixed_workload():
    """Half the requests have negative inputs: good versions answer them, the v3 below refuses them."""
    ones = np.ones((1, rm.FEATURES), np.float32)
    return Workload(({"X": ones}, {"X": -ones}))


def test_canary_breach_rolls_back_the_canary_and_leaves_the_other_server_untouched(capsys, tmp_path,
                                                                                   repo_root):
    rm.tagged(repo_root, "m", 1)
    rm.tagged(repo_root, "m", 2)
    first, second = start(repo_root, "m", 2), start(repo_root, "m", 2)
    try:
        rm.tagged(repo_root, "m", 3, fail_negative=True)  # passes the smoke check, fails real traffic
        with BackgroundLoad(first.url, "m", clients=2, workload=_mixed_workload(), check=tag) as load:
            load.wait_for(20)
            result = rollout(capsys, repo_root, "m", "--version", 3, *at(first, second), "--canary", 1,
                             "--soak", 2, "--smoke", _smoke_file(tmp_path))
            load.wait_for(load.count() + 20)
        assert result.code == 10, result.err
        data = result.json()
        assert data["error"]["reason"] == "threshold_breached"
        assert "error rate" in data["error"]["message"]
        canary, other = data["servers"]
        # Triton counts an error a Python model returns as a success: trm's own probes see it.
        assert canary["outcome"] == "rolled_back" and canary["soak"]["probe_failures"] > 0
        assert other["outcome"] == "not_started" and other["steps"] == []
        assert load.summary().labels[-1] == "v2"  # the canary serves v2 again
        for server in (first, second):
            with TritonClient(server.url) as client:
                assert served_versions(client, ["m"]) == {"m": (2,)}
    finally:
        first.stop()
        second.stop()


def test_server_dying_mid_rollout_gives_a_clear_error_and_a_consistent_other_server(repo_root):
    import os
    import signal

    from repo_manager.core.errors import ServerError
    from repo_manager.core.settings import Settings
    from repo_manager.ops.rollout import RolloutOptions, plan_rollout, run_rollout

    rm.tagged(repo_root, "m", 1)
    first, second = start(repo_root, "m", 1), start(repo_root, "m", 1)
    try:
        rm.tagged(repo_root, "m", 2)
        settings = Settings(repository=repo_root)
        plan = plan_rollout(settings, "m", 2, [first.url, second.url], RolloutOptions(),
                            grpc_urls=[first.endpoints.grpc, second.endpoints.grpc])

        def progress(message: str) -> None:  # the second server dies once the first is done
            if first.url in message and "drop m -> 2" in message:
                os.killpg(second.pid, signal.SIGKILL)

        with BackgroundLoad(first.url, "m", clients=2, workload=WORKLOAD, check=tag) as load:
            load.wait_for(20)
            with pytest.raises(ServerError) as failure:
                run_rollout(settings, plan, progress)
            load.wait_for(load.count() + 20)
        assert second.url in failure.value.message and first.url in failure.value.message
        assert failure.value.exit_code == 6
        result = failure.value.report.result
        assert [s.outcome for s in result.servers] == ["done", "failed"]
        assert load.summary().failed == 0 and switched(load.summary(), "v1", "v2")
        with TritonClient(first.url) as client:
            assert served_versions(client, ["m"]) == {"m": (2,)}
        records = read_records(repo_root)
        assert [(r["url"], r["server_outcome"]) for r in records] == [(first.url, "done"), (second.url, "failed")]
        status = {s.url: s for s in __import__("repo_manager.ops.rollout", fromlist=["x"]).server_status(
            repo_root, [])}
        assert status[first.url].models == {"m": [2]} and not status[second.url].reachable
    finally:
        first.stop()
        second.stop()


def test_drain_strategy_runs_the_operator_commands_around_a_one_copy_swap(capsys, tmp_path, repo_root):
    rm.tagged(repo_root, "m", 1)
    server = start(repo_root, "m", 1)
    try:
        rm.tagged(repo_root, "m", 2)
        journal = tmp_path / "journal.txt"
        common = ["m", "--version", 2, "--url", server.url, "--memory-budget", "10",
                  "--drain-cmd", f"echo drain $TRM_SERVER_URL >> {journal}",
                  "--restore-cmd", f"echo restore $TRM_VERSION >> {journal}"]
        plan = rollout(capsys, repo_root, *common, "--dry-run")
        assert plan.code == 0, plan.err
        [planned] = plan.json()["plan"]["servers"]
        assert planned["strategy"] == "drain" and "memory budget" in planned["reason"]
        assert not journal.exists()  # a dry run changes nothing
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (1,)}

        result = rollout(capsys, repo_root, *common)
        assert result.code == 0, result.err
        steps = [s["step"] for s in result.json()["servers"][0]["steps"]]
        assert steps.index("drain command") < steps.index("unload m 1") < steps.index("load m 2") \
            < steps.index("restore command")
        assert journal.read_text().split("\n")[:2] == [f"drain {server.url}", "restore 2"]
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (2,)}

        missing = rollout(capsys, repo_root, "m", "--version", 1, "--url", server.url, "--no-side-by-side")
        assert missing.code == 2 and "--drain-cmd" in missing.err

        # The same decision from the settings file (the tests run in tmp_path: configs/trm.yaml is read).
        (tmp_path / "configs").mkdir()
        (tmp_path / "configs" / "trm.yaml").write_text("rollout:\n  single_copy_models: [m]\n")
        planned = rollout(capsys, repo_root, "m", "--version", 1, "--url", server.url, "--dry-run",
                          "--drain-cmd", "true", "--restore-cmd", "true")
        assert planned.code == 0, planned.err
        assert planned.json()["plan"]["servers"][0]["strategy"] == "drain"
    finally:
        server.stop()


def test_bad_usage_and_unreachable_servers_change_nothing(capsys, repo_root):
    from repo_manager.adapters.triton.server import free_ports

    rm.tagged(repo_root, "m", 1)
    [port] = free_ports(1)
    nowhere = f"http://127.0.0.1:{port}"
    store = rollout(capsys, repo_root, "m", "--to-previous", "--url", nowhere, "--from", str(repo_root / "s"))
    assert store.code == 2 and "--from STORE needs --version N" in store.err
    both = rollout(capsys, repo_root, "m", "--version", 1, "--to-previous", "--url", nowhere)
    assert both.code == 2 and "either --version N or --to-previous" in both.err
    down = rollout(capsys, repo_root, "m", "--version", 1, "--url", nowhere)
    assert down.code == 6 and nowhere in down.err
    missing = rollout(capsys, repo_root, "m", "--version", 7, "--url", nowhere)
    assert missing.code == 4 and "no version 7" in missing.err
    assert read_records(repo_root) == []  # nothing was attempted, nothing recorded
    status = run_cli(capsys, "status", "--url", nowhere, "--repo", repo_root)
    assert status.code == 6 and "UNREACHABLE" in status.out and "1 of 1 server(s) did not answer" in status.err
    machine = run_cli(capsys, "--json", "status", "--url", nowhere, "--repo", repo_root)
    assert machine.code == 6 and machine.json()["servers"][0]["reachable"] is False


BAD_SMOKE = [([{"inputs": {"X": "abc"}}], "X is not TYPE_FP32 values"),
             ([{"inputs": {"X": 5}, "outputs": {"Y": "x"}}], "shape"), ([{"inputs": "x"}], "must map tensor names"),
             ([{"inputs": {"X": [[1, 2, 3]]}}], "takes [-1, 4]"), ([5], "a case is a mapping"),
             ([{"inputs": {"Z": [[1, 2, 3, 4]]}}], "no input tensor 'Z'"),
             ([{"inputs": {"X": [[1, 2, 3, 4]]}, "outputs": {"X": [[1]]}}], "no output tensor 'X'"),
             ("x", "non-empty list")]


def test_a_smoke_file_that_cannot_be_used_is_bad_input_before_anything_changes(capsys, tmp_path, repo_root):
    rm.tagged(repo_root, "m", 1)
    server = start(repo_root, "m", 1)
    try:
        rm.tagged(repo_root, "m", 2)
        smoke = tmp_path / "smoke.json"
        for cases, message in BAD_SMOKE:
            smoke.write_text(json.dumps({"cases": cases}))
            for dry_run in (("--dry-run",), ()):
                result = rollout(capsys, repo_root, "m", "--version", 2, *at(server), "--smoke", smoke, *dry_run)
                assert result.code == 3 and message in result.err, (cases, result.err)
        with TritonClient(server.url) as client:
            assert served_versions(client, ["m"]) == {"m": (1,)}
        assert read_records(repo_root) == []
    finally:
        server.stop()


def test_changed_outputs_switch_in_one_reload_without_failed_requests(capsys, repo_root):
    rm.tagged(repo_root, "m", 1, delay=0.005)
    server = start(repo_root, "m", 1)
    try:
        # v2 renames output Y to Z: v1 cannot run under v2's config, so no side-by-side phase.
        rm.tagged(repo_root, "m", 2, delay=0.005, output_name="Z")
        with BackgroundLoad(server.url, "m", clients=CLIENTS, workload=WORKLOAD, check=tag) as load:
            load.wait_for(30)
            result = rollout(capsys, repo_root, "m", "--version", 2, *at(server))
            load.wait_for(load.count() + 30)
        assert result.code == 0, result.err
        [srv] = result.json()["servers"]
        assert srv["strategy"] == "switch"
        assert [s["step"] for s in srv["steps"]][1:3] == ["load m 2", "smoke m 2"]
        summary = load.summary()
        assert summary.failed == 0, summary.errors
        assert switched(summary, "v1", "v2")
    finally:
        server.stop()


def test_rollout_from_a_store_installs_the_version_and_its_members_first(capsys, tmp_path):
    """--from STORE: the server's repository gets the version (an ensemble: with its pinned members) from
    the store, then the rollout proceeds as usual, with zero failed requests. A dry run plans the install
    (what would be fetched) and the rollout over it, and writes nothing."""
    from repo_manager.adapters.storage import open_store
    from repo_manager.core.settings import Settings
    from repo_manager.ops.push import push
    from repo_manager.ops.sync import sync_versions

    publisher, node, store_dir = tmp_path / "publisher", tmp_path / "node", tmp_path / "store"
    rm.ensemble(publisher, 1)
    rm.ensemble(publisher, 2)
    store = open_store(str(store_dir))
    push(store, LocalRepository(publisher), [])
    sync_versions(Settings(repository=node), store, {"pipe": 1})
    assert LocalRepository(node).versions("pipe") == [1]
    server = start(node, "pipe", 1)
    try:
        dry = rollout(capsys, node, "pipe", "--version", 2, "--from", store_dir, *at(server), "--dry-run")
        assert dry.code == 0, dry.err
        install = dry.json()["plan"]["install"]
        assert {(v["model"], v["version"], v["action"]) for v in install["versions"]} >= {("pipe", 2, "install")}
        assert install["fetch_bytes"] > 0
        assert LocalRepository(node).versions("pipe") == [1], "a dry run installed the version"
        with BackgroundLoad(server.url, "pipe", clients=CLIENTS, workload=WORKLOAD, check=pipe_tag) as load:
            load.wait_for(30)
            result = rollout(capsys, node, "pipe", "--version", 2, "--from", store_dir, *at(server))
            load.wait_for(load.count() + 30)
        assert result.code == 0, result.err
        summary = load.summary()
        assert summary.failed == 0 and set(summary.label_counts) <= {"v1", "v2"}
        assert summary.labels[-1] == "v2"
        repo = LocalRepository(node)
        assert repo.versions("pipe") == [1, 2]
        assert all(repo.versions(m) == [1, 2] for m in repo.manifest("pipe", 2).members)
    finally:
        server.stop()
