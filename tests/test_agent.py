"""`trm agent`: the store primitives it relies on (conditional pointer read, drain lease, agent reports)
on both stores, and the drain-swap path with two real tritonservers. The whole story of a fleet (start,
follow, refuse, SIGKILL, prune, SIGTERM) is tests/test_fleet.py.

The models are tiny Python-backend models whose answers carry their version (tests/rollout_models.py).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import rollout_models as rm
from helpers import run_cli

from repo_manager.adapters.loadgen import Workload
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.ops.agent.lease import DrainLease

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
    store.put_report("production", "pod-1", b'{"a": 1}')
    store.put_report("production", "pod-1", b'{"a": 2}')  # each pod replaces its own report
    store.put_report("production", "pod-2", b'{"b": 1}')
    assert store.get_reports("production") == {"pod-1": b'{"a": 2}', "pod-2": b'{"b": 1}'}
    assert store.get_reports("staging") == {}
    stale = DrainLease(store, "canary", "dead", 1, ttl_s=0.5)
    assert stale.try_acquire()
    alive = DrainLease(store, "canary", "alive", 1)
    assert not alive.try_acquire()
    time.sleep(0.6)  # a pod killed while holding a slot frees it once seen unrenewed for its TTL
    assert alive.try_acquire() and alive.holders() == ["alive"]


def write_holders(store, env: str, text: str) -> None:
    current = store.get_lease(env)
    payload = '{"schema": "trm.lease/1", "holders": {' + text + "}}"
    store.put_lease(env, payload.encode(), current[1] if current else None)


def test_drain_lease_ignores_hostile_expiries_tolerates_skew_and_keeps_agents_apart(location):
    """A holder entry with ``Infinity``, ``NaN``, a string or a date years ahead never blocks a drain;
    a holder whose clock is a minute behind (its ``expires`` already looks past) still holds its slot
    while it renews; one that stops renewing loses it after its TTL on the reader's clock; two agents
    with the same pod name hold two distinct slots; the heartbeat keeps a slot past its TTL."""
    import threading

    store = open_store(location)
    for expires in ("Infinity", "NaN", "-Infinity", '"soon"', "1e300", str(time.time() + 10**7), "true"):
        write_holders(store, "production", f'"ghost": {{"expires": {expires}, "ttl_s": 60}}')
        taker = DrainLease(store, "production", "taker", 1)
        assert taker.try_acquire(), expires
        assert taker.holders() == ["taker"], expires
        taker.release()
    write_holders(store, "production", '"x": 1, "y": {"expires": []}')  # malformed entries: no holder
    assert DrainLease(store, "production", "taker", 1).try_acquire()
    DrainLease(store, "production", "taker", 1).release()

    # a pod whose clock is 60 s behind: its fresh entry looks expired by this clock (a TTL of 3 s: this test's
    # own renewals, 0.4 s apart, stay far inside it even when a busy machine stalls the test for a second)
    write_holders(store, "skew", f'"behind": {{"pod": "behind", "expires": {time.time() - 60 + 3}, "ttl_s": 3}}')
    other = DrainLease(store, "skew", "other", 1)
    assert not other.try_acquire() and other.holders() == ["behind"]
    for _ in range(3):  # it renews: it keeps its slot
        time.sleep(0.4)
        write_holders(store, "skew", f'"behind": {{"pod": "behind", "expires": {time.time() - 60 + 3}, "ttl_s": 3}}')
        assert not other.try_acquire()
    time.sleep(3.2)  # it stopped renewing: gone once this pod saw it unchanged for its TTL
    assert other.try_acquire()
    other.release()

    # the same pod name twice (two pods sharing a host name): two keys, two slots
    first = DrainLease(store, "twins", "web-1a2b3c4d", 1, pod="web")
    second = DrainLease(store, "twins", "web-5e6f7a8b", 1, pod="web")
    assert first.try_acquire() and not second.try_acquire()

    # the heartbeat keeps a slot for a body longer than the TTL
    # (a TTL of 4 s, renewed every third of it: a stall of a second on a busy machine does not lose it)
    held = DrainLease(store, "beat", "long-load", 1, ttl_s=4.0)
    waiter = DrainLease(store, "beat", "waiter", 1)
    lost: list[str] = []
    assert held.acquire(threading.Event())
    with held.held(lost.append):
        deadline = time.monotonic() + 8.5  # over two TTLs
        while time.monotonic() < deadline:
            assert not waiter.try_acquire()
            time.sleep(0.1)
    assert lost == [] and waiter.try_acquire()  # freed at the end of the body


def test_drain_swap_keeps_at_most_one_pod_out_of_rotation_and_fails_no_request(capsys, tmp_path):
    """--no-side-by-side: each agent takes its pod out of rotation (readiness false), waits for its
    in-flight requests, swaps, comes back; the drain lease in the store lets one pod at a time do it.
    The clients play the load balancer: they send only to pods whose /readyz says ready. The new version
    loads for longer than the lease's TTL (the heartbeat keeps the slot), the two agents share a host
    name (each still holds its own slot and writes its own report), and neither server ever holds two
    copies of the model (no pre-check beside the old version on this path)."""
    from agent_helpers import Fleet, LoadedCopies, slow_loading

    location = str(tmp_path / "store")
    src = tmp_path / "src"
    publish(capsys, src, location, "m", 1, delay=0.002)
    fleet = Fleet(tmp_path / "fleet", location, "production", {"a": 2}, interval=0.3, hostname="web",
                  extra=("--no-side-by-side", "--max-unavailable", "1", "--lease-ttl", "3"))
    try:
        fleet.start()
        fleet.wait_serving({"m": 1})
        balancer = ReadyBalancer(fleet)
        copies = [LoadedCopies(server.url, "m") for server in fleet.servers.values()]
        with balancer, copies[0], copies[1]:
            time.sleep(1.0)
            assert slow_loading(src, "m", 2, 7.5, delay=0.002) == 2  # loads for 2.5 TTLs
            pushed = run_cli(capsys, "push", location, "--repo", src, "--model", "m:2", "--json")
            assert pushed.code == 0, pushed.err
            open_store(location).update_env("production", {"m": 2})
            fleet.wait_serving({"m": 2})
            time.sleep(0.5)
        assert balancer.failed == [], balancer.failed[:3]
        assert balancer.answers.get("v1") and balancer.answers.get("v2")
        assert balancer.most_unready == 1, balancer.unready_samples  # one pod at a time, and both did drain
        assert [c.most for c in copies] == [1, 1], [c.seen for c in copies]
        statuses = [agent.status() for agent in fleet.agents.values()]
        assert {s["pod"] for s in statuses} == {"web"} and len({s["agent"] for s in statuses}) == 2
        assert sorted(open_store(location).get_reports("production")) == sorted(s["agent"] for s in statuses)
        for agent in fleet.agents.values():  # each one drained (its log, whatever a retry did after)
            assert "draining: out of rotation to swap m" in agent.log_tail(200), agent.log_tail(40)
        agent, server = fleet.agents["a-pod1"], fleet.servers["a-pod1"]
        scraped = agent.metrics()
        assert scraped['trm_serving_version{model="m"}'] == 2
        prefix = 'trm_operations_total{model="m",operation="rollout",outcome="'
        rollouts = {key[len(prefix):-2]: value for key, value in scraped.items() if key.startswith(prefix)}
        # v1 (a load) and v2, each "ok" and each one sync and one finished rollout; on a loaded host a rollout that
        # a transient error interrupted after the swap is counted under that error, and the next pass (a sync,
        # then v2 found served) counts "skipped": the counts agree with each other whichever happened
        done = scraped['trm_agent_rollouts_total{env="production",outcome="done",pod="web"}']
        errors = sum(value for outcome, value in rollouts.items() if outcome not in ("ok", "skipped"))
        assert rollouts.get("ok", 0) >= 1 and rollouts.get("skipped", 0) <= errors, (rollouts, agent.log_tail(60))
        assert rollouts.get("ok", 0) + rollouts.get("skipped", 0) == done >= 1, (rollouts, done)
        assert rollouts.get("ok", 0) == 2 or errors, (rollouts, agent.log_tail(60))
        assert scraped['trm_operations_total{model="",operation="sync",outcome="ok"}'] == sum(rollouts.values())
        assert scraped['trm_operations_total{model="",operation="pointer_read",outcome="unchanged"}'] > 0
        assert scraped['trm_sync_bytes_total{source="downloaded"}'] + scraped['trm_sync_bytes_total{source="cache"}']
        assert_rule_metrics_exist(scraped, server.endpoints.metrics)
        top = run_cli(capsys, "top", server.url, "--metrics-port", server.ports["metrics"], "--agent", agent.base,
                      "--agent", "http://127.0.0.1:9", "--interval", "0.2", "--json")
        assert top.code == 0, top.err
        (shown,) = top.json()["agents"]
        assert (shown["pod"], shown["state"], shown["served"], shown["wanted"]) == ("web", "ready", {"m": 2},
                                                                                   {"m": 2})
        assert shown["last_rollout"].startswith("done") and shown["pointer_age_s"] is not None
        assert any("no agent status at http://127.0.0.1:9" in p for p in top.json()["problems"])
        assert any(r["model"] == "m" for r in top.json()["rows"])
    finally:
        fleet.stop()


def assert_rule_metrics_exist(agent_samples: dict[str, float], triton_metrics_url: str) -> None:
    """Every series name `trm observe rules` refers to is one a live agent exports (with samples), or one
    the agent's Triton exports."""
    import re
    import urllib.request

    from repo_manager.ops.observe.rules import ModelWatch, Thresholds, rule_file

    rules = rule_file([ModelWatch("m", 2, p99_ms=50.0)], Thresholds(), "production")
    exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    names = set(re.findall(r"\b(?:trm|nv)_[a-z0-9_]+", re.sub(r'"[^"]*"', '""', exprs)))
    trm = {n for n in names if n.startswith("trm_")}
    assert {"trm_agent_degraded", "trm_serving_version", "trm_operation_last_success_timestamp_seconds"} <= trm
    exported = {key.split("{")[0] for key in agent_samples}
    assert trm <= exported, trm - exported
    with urllib.request.urlopen(triton_metrics_url, timeout=5) as response:
        triton = {line.split()[2] for line in response.read().decode().splitlines() if line.startswith("# TYPE")}
    assert names - trm <= triton, (names - trm) - triton


class ReadyBalancer:
    """Client threads that send each request to a random pod whose agent reports ready (as a Service
    does with readiness probes), plus a sampler that records how many pods were unready at once."""

    def __init__(self, fleet, clients: int = 3) -> None:
        import threading

        self.fleet, self.clients = fleet, clients
        self.ready: set[str] = set(fleet.agents)
        self.failed: list[str] = []
        self.answers: dict[str, int] = {}
        self.most_unready = 0
        self.unready_samples: list[tuple[str, ...]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._probe, daemon=True)] + [
            threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _readyz(self, agent) -> bool:
        """As a kubelet sees it: a probe that cannot be read (a busy agent past the probe's timeout) is not ready."""
        try:
            return agent.get("/readyz")[0] == 200
        except OSError:
            return False

    def _probe(self) -> None:
        while not self.stop.is_set():
            ready = {pod for pod, agent in self.fleet.agents.items() if self._readyz(agent)}
            unready = tuple(sorted(set(self.fleet.agents) - ready))
            self.most_unready = max(self.most_unready, len(unready))
            if unready and (not self.unready_samples or self.unready_samples[-1] != unready):
                self.unready_samples.append(unready)
            self.ready = ready
            time.sleep(0.05)

    def _client(self) -> None:
        import random

        from repo_manager.adapters.triton.client import TritonClient
        from repo_manager.core.errors import TrmError

        clients = {pod: TritonClient(server.url) for pod, server in self.fleet.servers.items()}
        while not self.stop.is_set():
            choices = sorted(self.ready)
            if not choices:
                time.sleep(0.01)
                continue
            pod = random.choice(choices)
            try:
                answer = tag(clients[pod].infer("m", {"X": np.ones((1, rm.FEATURES), np.float32)}))
                self.answers[answer] = self.answers.get(answer, 0) + 1
            except TrmError as exc:
                self.failed.append(f"{pod}: {exc.message}")
        for client in clients.values():
            client.close()

    def __enter__(self) -> ReadyBalancer:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def test_a_change_that_fails_on_one_model_moves_no_model(capsys, tmp_path):
    """An environment of two models whose change moves both, and the second one fails to load: the set
    is refused before the first one switches (every model is pre-checked first), so no client ever gets
    an answer from the refused set; /status says why; no request fails. A restarted agent also removes
    the staging folders a sync SIGKILLed mid-way left in its repository and unloads the pre-check model
    an agent SIGKILLed mid-pre-check left loaded."""
    import subprocess

    from agent_helpers import Fleet

    from repo_manager.adapters.loadgen import BackgroundLoad
    from repo_manager.adapters.repository import STAGING_PREFIX, LocalRepository

    location, src = str(tmp_path / "store"), tmp_path / "src"
    for model in ("a", "b"):
        publish(capsys, src, location, model, 1, env=None)
    store = open_store(location)
    store.update_env("production", {"a": 1, "b": 1})
    fleet = Fleet(tmp_path / "fleet", location, "production", {"n": 1}, interval=0.2)
    # what a sync SIGKILLed mid-way leaves: a staging folder named with its (now dead) pid
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = fleet.repo("n-pod1") / "a" / f"{STAGING_PREFIX}{dead.pid}-killed-sync"
    leftover.mkdir(parents=True)
    (leftover / "model.py").write_text("half")
    try:
        fleet.start()
        agent = fleet.agents["n-pod1"]
        agent.wait_serving({"a": 1, "b": 1})
        assert not leftover.exists() and LocalRepository(fleet.repo("n-pod1")).validate() == []
        url = fleet.servers["n-pod1"].url
        with BackgroundLoad(url, "a", clients=1, workload=WORKLOAD, check=tag) as load_a, \
                BackgroundLoad(url, "b", clients=1, workload=WORKLOAD, check=tag) as load_b:
            load_a.wait_for(10)
            publish(capsys, src, location, "a", 2, env=None)
            publish(capsys, src, location, "b", 2, env=None, fail_load=True)
            store.update_env("production", {"a": 2, "b": 2})  # "a" would move first (sorted); "b" fails
            status = agent.wait(lambda s: s["state"] == "degraded", what="refusal")
            load_b.wait_for(load_b.count() + 10)
        assert status["served"] == {"a": 1, "b": 1}, status
        assert status["ready"] and "b" in status["degraded_reason"]
        assert status["last_rollout"]["models"] == []  # every model pre-checked before any moved
        for load in (load_a, load_b):
            summary = load.summary()
            assert summary.failed == 0, summary.errors
            assert set(summary.label_counts) == {"v1"}, summary.label_counts  # no answer from the refused set
        with TritonClient(url) as client:
            loaded = {(e["name"], e.get("version")) for e in client.repository_index() if e.get("state") == "READY"}
        assert loaded == {("a", "1"), ("b", "1")}, loaded  # no pre-check leftover, a back at 1
        # an agent SIGKILLed during a pre-check leaves its temporary model loaded (with file overrides,
        # so only Triton's statistics list it, not the repository index): the next agent unloads it
        agent.kill()
        repo = LocalRepository(fleet.repo("n-pod1"))
        manifest = repo.manifest("a", 1)
        config = cfg.parse_config(manifest.config)
        config.name = "trm-verify-0123abcd-a"
        with TritonClient(url) as client:
            client.load(config.name, config, {f"1/{f.path}": (repo.version_dir("a", 1) / f.path).read_bytes()
                                              for f in manifest.files})
            assert config.name in {e["name"] for e in client.statistics()}
            agent = fleet.agents["n-pod1"] = fleet.new_agent("n", "n-pod1").start()
            agent.wait(lambda s: s["state"] == "degraded", what="refusal again")
            assert not [e["name"] for e in client.statistics() if e["name"].startswith("trm-verify-")]
        # the pointer moves to a good set: both follow
        publish(capsys, src, location, "b", 3, env=None)
        store.update_env("production", {"a": 2, "b": 3})
        agent.wait_serving({"a": 2, "b": 3})
        assert agent.stop() == 0
    finally:
        fleet.stop()


def test_a_set_refused_for_a_file_missing_from_the_store_is_tried_again_once_the_file_is_back(capsys, tmp_path):
    """The pointer names a version one of whose blobs is missing from the store (a push cut short, a
    copy still under way): the sync refuses it and the server keeps serving; once the file is back,
    under the same pointer, the agent converges on its own after the backoff (no new promotion)."""
    from agent_helpers import Fleet

    location, src = str(tmp_path / "store"), tmp_path / "src"
    publish(capsys, src, location, "a", 1)
    fleet = Fleet(tmp_path / "fleet", location, "production", {"n": 1}, interval=0.2)
    try:
        fleet.start()
        agent = fleet.agents["n-pod1"]
        agent.wait_serving({"a": 1})
        publish(capsys, src, location, "a", 2, env=None)
        store = open_store(location)
        old = {f.sha256 for f in store.get_manifest("a", 1).files}
        [new] = [f.sha256 for f in store.get_manifest("a", 2).files if f.sha256 not in old]
        blob = tmp_path / "store" / "blobs" / "sha256" / new
        kept = blob.read_bytes()
        blob.unlink()
        store.update_env("production", {"a": 2})
        status = agent.wait(lambda s: s["state"] == "degraded", what="refusal")
        assert status["served"] == {"a": 1} and status["ready"] and "sync" in status["degraded_reason"]
        assert status["refused"]["stage"] == "store"
        blob.write_bytes(kept)
        status = agent.wait_serving({"a": 2}, timeout=60)
        assert status["rollouts"]["refused"] >= 1 and status["pointer"]["changed"] == 2  # the pointer stayed
        assert agent.stop() == 0
    finally:
        fleet.stop()


def set_env(store, models: dict[str, int], env: str = "production") -> None:
    """Point ``env`` at exactly ``models`` (``update_env`` only adds or moves models)."""
    from repo_manager.adapters.storage import EnvPointer

    store.put_env(EnvPointer(env, models, "", store.get_env(env).etag))


def push(capsys, src, location, *models: str) -> None:
    result = run_cli(capsys, "push", location, "--repo", src, *(a for m in models for a in ("--model", m)), "--json")
    assert result.code == 0, result.err


def test_a_model_added_to_the_environment_never_takes_the_pod_out_of_rotation(capsys, tmp_path):
    """Readiness comes from the last good set: while a model the environment adds loads for seconds (a
    large one), is refused because it does not load, is the case twin ``M`` of ``m``, or is an ensemble
    whose members the environment names at other versions than it pins, /readyz stays 200 and ``m``
    keeps answering; /status and /metrics say syncing, rolling out or degraded, and why."""
    from agent_helpers import Fleet, ReadyWatch, slow_loading

    from repo_manager.adapters.loadgen import BackgroundLoad

    location, src = str(tmp_path / "store"), tmp_path / "src"
    publish(capsys, src, location, "m", 1)
    store = open_store(location)
    fleet = Fleet(tmp_path / "fleet", location, "production", {"n": 1}, interval=0.2)
    try:
        fleet.start()
        agent = fleet.agents["n-pod1"]
        agent.wait_serving({"m": 1})
        url = fleet.servers["n-pod1"].url
        with BackgroundLoad(url, "m", clients=1, workload=WORKLOAD, check=tag) as load, ReadyWatch(agent) as watch:
            load.wait_for(10)
            # a large model: it loads for seconds while the pod stays in rotation
            assert slow_loading(src, "big", 1, 4.0) == 1
            push(capsys, src, location, "big:1")
            store.update_env("production", {"big": 1})
            agent.wait_serving({"m": 1, "big": 1})
            assert {"syncing", "rolling_out"} & watch.states, watch.states
            # how long the load took, which Triton does not export: at least the 4 s its initialize() sleeps
            loaded = agent.metrics()
            assert 4.0 <= loaded['trm_model_load_duration_seconds{model="big",version="1"}'] < 900, loaded
            assert loaded['trm_model_load_duration_seconds{model="m",version="1"}'] > 0
            # a new model that cannot load
            publish(capsys, src, location, "bad", 1, env=None, fail_load=True)
            store.update_env("production", {"bad": 1})
            status = agent.wait(lambda s: s["state"] == "degraded", what="refusal of bad")
            assert status["ready"] and "bad" in status["degraded_reason"], status
            assert status["last_good"] == {"m": 1, "big": 1} and status["served"]["bad"] is None
            scraped = agent.metrics()
            labels = 'env="production",pod="n-pod1"'
            assert scraped[f"trm_agent_ready{{{labels}}}"] == 1 and scraped[f"trm_agent_degraded{{{labels}}}"] == 1
            assert scraped[f'trm_agent_state{{{labels},state="degraded"}}'] == 1
            assert scraped[f"trm_agent_pending_models{{{labels}}}"] == 1
            # the case twin M of m (its own source repository: one repository cannot hold both)
            assert rm.tagged(tmp_path / "src-twin", "M", 1) == 1
            push(capsys, tmp_path / "src-twin", location, "M:1")
            set_env(store, {"m": 1, "big": 1, "M": 1})
            # the reason stays while the next pass syncs again: wait for the pass that ends degraded
            status = agent.wait(lambda s: s["state"] == "degraded" and "only in case" in (s["degraded_reason"] or ""),
                                what="refusal of M")
            assert status["ready"], status
            # an ensemble whose member the environment names at another version than the ensemble pins
            ens = tmp_path / "src-ens"
            assert rm.ensemble(ens, 1) == 1 and rm.tagged(ens, "pre", 2) == 2
            push(capsys, ens, location, "pipe:1", "pre:2")
            set_env(store, {"m": 1, "big": 1, "pipe": 1, "pre": 2})
            status = agent.wait(lambda s: s["state"] == "degraded"
                                and "pins pre version 1" in (s["degraded_reason"] or ""), what="refusal of pipe")
            assert status["ready"], status
            load.wait_for(load.count() + 10)
        assert watch.unready == [], watch.unready[:5]
        summary = load.summary()
        assert summary.failed == 0 and set(summary.label_counts) == {"v1"}, (summary.errors, summary.label_counts)
        assert agent.stop() == 0
    finally:
        fleet.stop()


def test_models_dropped_from_the_environment_are_unloaded_also_after_a_restart(capsys, tmp_path):
    """A model the environment drops is unloaded even when nothing else moves; dropped while the agent
    was away (SIGKILLed), the restarted agent unloads it, from the record it keeps in the repository; a
    corrupt record is ignored with a note in the log, and the agent carries on."""
    import json

    from agent_helpers import Fleet

    location, src = str(tmp_path / "store"), tmp_path / "src"
    for model in ("a", "b", "c"):
        publish(capsys, src, location, model, 1, env=None)
    store = open_store(location)
    store.update_env("production", {"a": 1, "b": 1, "c": 1})
    fleet = Fleet(tmp_path / "fleet", location, "production", {"n": 1}, interval=0.2)

    def loaded() -> set[str]:
        with TritonClient(fleet.servers["n-pod1"].url) as client:
            return {e["name"] for e in client.repository_index() if e.get("state") == "READY"}

    def wait_loaded(models: set[str]) -> None:
        deadline = time.monotonic() + 60
        while loaded() != models and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded() == models

    try:
        fleet.start()
        agent = fleet.agents["n-pod1"]
        agent.wait_serving({"a": 1, "b": 1, "c": 1})
        # nothing else moves: b is dropped
        set_env(store, {"a": 1, "c": 1})
        wait_loaded({"a", "c"})
        agent.wait(lambda s: s["last_good"] == {"a": 1, "c": 1} and s["ready"], what="b dropped")
        from repo_manager.ops.agent.record import RECORD_NAME

        record = fleet.repo("n-pod1") / RECORD_NAME
        written = json.loads(record.read_text())
        assert written["good"] == {"a": 1, "c": 1} and set(written["loaded"]) == {"a", "c"}
        with TritonClient(fleet.servers["n-pod1"].url) as client:  # Triton does not take it for a model
            assert RECORD_NAME not in {e["name"] for e in client.repository_index()}
        first_id = agent.status()["agent"]
        # c is dropped while the agent is away
        agent.kill()
        set_env(store, {"a": 1})
        agent = fleet.agents["n-pod1"] = fleet.new_agent("n", "n-pod1").start()
        wait_loaded({"a"})
        status = agent.wait_serving({"a": 1})
        assert status["agent"] == first_id  # a restarted agent keeps its identity
        # a corrupt record: a note, a fresh record, no crash
        agent.kill()
        record.write_text('{"schema": "trm.agent-record/1", "agent_id": [1e999]')
        agent = fleet.agents["n-pod1"] = fleet.new_agent("n", "n-pod1").start()
        status = agent.wait_serving({"a": 1})
        assert status["agent"] != first_id and f"ignored {record}" in agent.log_tail(60)
        assert json.loads(record.read_text())["agent_id"] == status["agent"].rpartition("-")[2]
        assert agent.stop() == 0
    finally:
        fleet.stop()


def _json_values():
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)


def test_the_agent_record_and_lease_objects_are_read_totally(tmp_path):
    """Whatever the record file or a lease object holds (any JSON, NaN and Infinity included, or no JSON
    at all, or a folder where the file should be), reading it never raises: a bad record is a note and
    a fresh record, a bad lease entry counts as no holder."""
    import json

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from repo_manager.ops.agent.lease import parse_holders
    from repo_manager.ops.agent.record import SCHEMA, AgentRecord, read_record, write_record

    path = tmp_path / "record.json"
    good = AgentRecord("0123abcd", {"m": 3}, frozenset({"m", "pre"}))
    write_record(path, good, "production")
    assert read_record(path) == (good, None)
    path.unlink()
    assert read_record(path)[1] is None  # no record yet: a fresh one, no note
    path.mkdir()
    record, note = read_record(path)
    assert note and str(path) in note and record.agent_id != good.agent_id
    path.rmdir()

    @settings(max_examples=150, deadline=None)
    @given(_json_values(), st.binary(max_size=40))
    def check(value, junk):
        for payload in (json.dumps(value).encode(), junk,
                        json.dumps({"schema": SCHEMA, "agent_id": "0123abcd", "good": value, "loaded": value}).encode(),
                        json.dumps({"holders": value}).encode(), json.dumps({"holders": {"k": value}}).encode()):
            path.write_bytes(payload)
            record, note = read_record(path)
            assert isinstance(record.agent_id, str) and (note is None) == (record == read_record(path)[0])
            for holder in parse_holders(payload, 1.7e9).values():
                assert holder.expires == holder.expires and holder.expires < 1.7e9 + 1000  # finite, bounded

    check()


def test_readiness_comes_from_the_last_good_set_and_ensembles_keep_their_members(tmp_path):
    """The agent's decisions on a real node repository (no server): a model the environment adds is not
    required for readiness, a model it dropped is not either, a fresh pod is ready only once it has a good
    set; an ensemble's members stay loaded while the environment names the ensemble (also when its new
    version is refused and the old one still serves); a member named at another version than pinned is a
    reason to refuse."""
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.ops.agent import state

    assert rm.ensemble(tmp_path, 1) == 1 and rm.ensemble(tmp_path, 2) == 2 and rm.tagged(tmp_path, "m", 1) == 1
    repo = LocalRepository(tmp_path)
    served, verified = {"m": 1, "pipe": 1}, {"m": 1, "pipe": 1}
    assert state.is_ready({"m": 1, "pipe": 1, "new": 1}, {"m": 1, "pipe": 1}, served, verified)
    assert not state.is_ready({"m": 1, "pipe": 1}, {}, served, verified)  # a fresh pod: not yet
    assert not state.is_ready({"m": 1}, {"m": 1}, {"m": None}, {})  # a good model gone: out of rotation
    assert state.is_ready({"pipe": 1}, {"m": 1, "pipe": 1}, served, verified)  # m dropped: not required
    assert state.good_now({"m": 2, "pipe": 1, "new": 1}, {"m": 1, "pipe": 1, "new": None},
                          {"m": 1, "pipe": 1}) == {"m": 1, "pipe": 1}
    assert state.keep_loaded(repo, {"pipe": 2}, {"pipe": 1}, {"pipe": 1}) == {"pipe", "pre", "post"}
    assert state.keep_loaded(repo, {"m": 1}, {"pipe": 1}, {"m": 1}) == {"m"}
    assert state.keep_loaded(repo, {"pipe": 9}, {}, {"pipe": None}) == {"pipe"}  # not installed: no members
    assert state.pin_conflict(repo, {"pipe": 2, "pre": 2, "post": 2}) is None
    assert state.pin_conflict(repo, {"pipe": 2, "pre": 1}) == ("the environment names pre version 1, but pipe "
                                                               "version 2 pins pre version 2")


def test_a_set_refused_for_a_stub_declared_unhealthy_is_tried_again_after_its_backoff_while_the_pointer_stays(
        monkeypatch):
    """A stub Triton declared unhealthy during a rollout (its host stalled it: seen in CI at load average 4, a
    smoke request to the new version failed that way and the agent stayed degraded) is no verdict on the
    version: like files missing from the store, the set is tried again once its backoff has passed, while the
    pointer stays; a version that failed on the server otherwise waits for the pointer to move. (No server:
    the backoff's clock is the test's.)"""
    from repo_manager.ops.agent import core, state

    reason = ("rollout of a 2 on http://127.0.0.1:58647: smoke request to a version 2 failed: inference on a at "
              "http://127.0.0.1:58647 failed: Stub process 'a_0_0' is not healthy. (rolled back)")
    assert core.STUB_DECLARED_UNHEALTHY.search(reason)  # the agent's refusal names that stage "host"
    clock = [100.0]
    monkeypatch.setattr(state.time, "monotonic", lambda: clock[0])
    for stage, retried in (("host", True), ("store", True), ("rollout", False), ("sync", False)):
        backoff = state.Backoff(first_s=0.5, max_s=10.0)
        backoff.refuse("a=2", {"models": {"a": 2}, "etag": "2", "reason": reason, "stage": stage})
        assert backoff.holds("a=2", "2")  # within its backoff: refused
        clock[0] += 0.6
        assert backoff.holds("a=2", "2") is not retried, stage
        assert not backoff.holds("a=2", "3")  # the pointer moved: tried again whatever the stage


def test_drain_swap_of_a_streaming_llm_waits_for_the_streams_on_the_old_version(capsys, tmp_path):
    """A streaming LLM on the drain-swap path: its Triton request counters stand still while its streams run,
    so the agent waits on its engine's running/waiting gauges (at --metrics-url) before the swap. The engine is
    the stand-in of tests/vllm_metrics_model.py (a decoupled Python model with vLLM's interface and gauges);
    two streams are in flight when the pointer moves, held before their last token until the agent says it is
    waiting for them (a file the test writes: no stream length races the agent's sync)."""
    import threading

    from agent_helpers import AgentProcess
    from vllm_metrics_model import write_engine_stand_in

    from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, run_llm
    from repo_manager.adapters.loadgen.measure import Target
    from repo_manager.adapters.triton.server import TritonServer
    from repo_manager.core.settings import Settings
    from repo_manager.ops.publish import publish_model

    src, location, hold = tmp_path / "src", str(tmp_path / "store"), tmp_path / "streams-may-end"
    settings = Settings(repository=src)
    for _ in (1, 2):
        publish_model(settings, write_engine_stand_in(tmp_path / "engine", "chat", first_ms=20, next_ms=100, slots=2,
                                                      hold=hold), "chat", verify_model=False)
    pushed = run_cli(capsys, "push", location, "--repo", src, "--model", "chat", "--json")
    assert pushed.code == 0, pushed.err
    open_store(location).update_env("production", {"chat": 1})
    node = tmp_path / "node"
    node.mkdir()
    with TritonServer(node) as server:
        agent = AgentProcess(location, "production", server, node, tmp_path / "cache", pod="llm", log_dir=tmp_path,
                             extra=("--no-side-by-side", "--metrics-url", server.endpoints.metrics)).start()
        try:
            agent.wait_serving({"chat": 1})
            results = []
            load = LLMLoad(concurrency=2, requests=2, input_tokens=Lengths(4), output_tokens=Lengths(20),
                           timeout_s=300)
            streams = threading.Thread(target=lambda: results.append(run_llm(Target("chat", server.url), load)))
            streams.start()
            # both streams running on version 1, as the engine stand-in's own gauge says
            deadline = time.monotonic() + 60  # a hang detector
            while _running_streams(server.endpoints.metrics, "chat", "1") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _running_streams(server.endpoints.metrics, "chat", "1") == 2
            open_store(location).update_env("production", {"chat": 2})
            deadline = time.monotonic() + 180  # a hang detector: the agent's poll, sync and drain slot
            while "waiting for streams in flight" not in agent.log_tail(200) and time.monotonic() < deadline:
                time.sleep(0.2)
            hold.touch()  # the agent read its gauges: the streams may end now
            agent.wait_serving({"chat": 2}, timeout=120)
            streams.join(timeout=120)
            log = agent.log_tail(200)
        finally:
            hold.touch()  # (a failure above leaves no stream held)
            agent.stop()
    (result,) = results
    assert result.failed == 0 and result.broken == 0 and set(result.outcomes) == {"complete"}, result.error_samples
    assert set(result.answered_by) == {1}
    waiting = [line for line in log.splitlines() if "waiting for streams in flight" in line]
    assert waiting and "2 in flight" in waiting[-1], log
    waited = [line for line in log.splitlines() if "waited for streams in flight" in line]
    assert waited and "2 stream(s) in flight finished" in waited[-1], log


def _running_streams(metrics_url: str, model: str, version: str) -> float:
    """``vllm:num_requests_running`` of one model version, its engines together, from the server's /metrics (0 when
    not there yet)."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{") and f'model="{model}"' in line
               and f'version="{version}"' in line)
