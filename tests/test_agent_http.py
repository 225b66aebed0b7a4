"""The agent's HTTP endpoint under a slowloris, on loopback: a real `trm agent` beside a real tritonserver
while this test holds thousands of half-open connections to it, keeps opening more, and resets others
mid-answer. The endpoint must keep answering the kubelet's probe, hold a bounded number of sockets, close
the silent ones itself, log no traceback per connection, and the agent must keep following its pointer.

Timings are measured and printed (run with -s to see them), asserted only against generous bounds.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

import rollout_models as rm
from agent_helpers import AgentProcess
from helpers import run_cli

from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.settings import Settings
from repo_manager.ops.agent import Agent, AgentOptions
from repo_manager.ops.agent.http import HEAD_TIMEOUT_S, MAX_CONNECTIONS, AgentHTTP, parse_listen

HALF_OPEN = 3000
PARTIAL = b"GET /readyz HTTP/1.1\r\nHost: agent\r\nX-Slow: "


def half_open(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that start a request and never finish it (some send nothing at all)."""
    sockets = []
    for i in range(count):
        sock = socket.socket()
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
            if i % 4:
                sock.send(PARTIAL)
        except OSError:
            sock.close()
            continue
        sockets.append(sock)
    return sockets


def probe(port: int, path: str = "/readyz") -> tuple[int, float]:
    """(status code, seconds) of one request on a fresh connection, as the kubelet sends it."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), time.perf_counter() - started


def reset_mid_answer(port: int, count: int) -> None:
    """Clients that ask for /status and reset the connection at once (RST, not FIN)."""
    for _ in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: agent\r\n\r\n")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def accepted_sockets(pid: int, port: int) -> int:
    """The connections to ``port`` that process ``pid`` holds a descriptor of (what it accepted and has not
    closed): the kernel's own count, whatever else the process has open. Connections still in the listen
    queue have no descriptor and are not counted."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":  # 0A: the listening socket
                inodes.add(fields[9])
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        held += target.startswith("socket:[") and target[8:-1] in inodes
    return held


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0.01)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_the_endpoint_is_read_only_bounded_and_stops_quietly(tmp_path, capfd):
    """A real Agent (folder store, not started: its status is `starting`) behind a small AgentHTTP."""
    agent = Agent(AgentOptions(store=str(tmp_path / "store"), env="production", repository=tmp_path / "repo",
                               cache=tmp_path / "cache", url="http://127.0.0.1:9"), Settings())
    # a head timeout of 3 s: the 40 connections below are all opened well within it, so the cap (not the
    # timeout) is what closes the oldest ones, even on a busy machine
    http = AgentHTTP(agent, "127.0.0.1:0", max_connections=8, head_timeout_s=3.0)
    http.start()
    port = int(http.address.rsplit(":", 1)[1])
    try:
        assert probe(port)[0] == 503 and probe(port, "/healthz")[0] == 200  # (not converged: not ready)

        def raw(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(data)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            return answer

        assert raw(b"POST /readyz HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}").startswith(b"HTTP/1.1 405")
        assert raw(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 431")
        assert raw(b"\x16\x03\x01 hello\r\n\r\n").startswith(b"HTTP/1.1 400")
        head = raw(b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")
        held = half_open(port, 40)  # five times the cap: the oldest unfinished ones make room
        assert probe(port, "/healthz")[0] == 200 and http.evicted >= 30 and http.open_connections <= 8
        # exactly bounded, as the kernel counts this process's accepted sockets: the cap, plus one waiting for a slot
        assert accepted_sockets(os.getpid(), port) <= 8 + 1
        deadline = time.monotonic() + 60  # past the head timeout the server closes the rest itself (a hang detector)
        while not all(closed_by_peer(sock) for sock in held) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(closed_by_peer(sock) for sock in held)
        held = half_open(port, 8)
    finally:
        http.stop()
    assert all(closed_by_peer(sock) for sock in held)
    for sock in held:
        sock.close()
    out, err = capfd.readouterr()
    assert out == err == "", err  # nothing per connection, also at the stop


def test_a_fresh_agent_reports_its_documented_status_as_plain_json(tmp_path):
    """/status of an agent that has not ticked yet (no server needed): the documented keys in their order,
    plain JSON values (the state a string, no Python objects), and the state gauges cover every state."""
    from repo_manager.ops.agent.metrics import STATES

    agent = Agent(AgentOptions(store=str(tmp_path / "store"), env="production", repository=tmp_path / "repo",
                               cache=tmp_path / "cache", url="http://127.0.0.1:9"), Settings())
    status = agent.status()
    assert list(status) == ["pod", "agent", "env", "store", "server", "state", "reason", "ready", "draining",
                            "degraded_reason", "wanted", "served", "last_good", "refused", "last_rollout",
                            "rollouts", "pointer", "sync", "lease_holders", "started_at", "options"]
    assert json.loads(json.dumps(status)) == status
    assert type(status["state"]) is str and status["state"] == "starting" and status["state"] in STATES
    assert (status["reason"], status["ready"], status["draining"]) == ("not converged yet", False, False)
    assert (status["wanted"], status["served"], status["last_good"], status["rollouts"]) == ({}, {}, {}, {})
    assert status["sync"] == {"bytes_downloaded": 0, "bytes_reused": 0, "syncs": 0, "last": None}
    assert status["refused"] is status["last_rollout"] is status["degraded_reason"] is None
    assert status["lease_holders"] == []
    assert STATES == ("starting", "waiting", "syncing", "rolling_out", "draining", "waiting_for_slot", "ready",
                      "degraded", "error")


def test_listen_defaults_to_loopback():
    assert parse_listen(":8090") == ("127.0.0.1", 8090)
    from repo_manager.cli.commands.agent import agent_command

    listen = next(p for p in agent_command.params if p.name == "listen")
    assert listen.default == "127.0.0.1:8090"
    head = next(p for p in agent_command.params if p.name == "head_timeout")  # a setting, as the drain graces are
    assert head.default == HEAD_TIMEOUT_S


def test_slowloris_leaves_readyz_answering_bounded_sockets_no_tracebacks_and_the_agent_following(capsys, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, HALF_OPEN * 3)), hard))
    src, node, store_dir = tmp_path / "src", tmp_path / "node", tmp_path / "store"
    node.mkdir()
    assert rm.tagged(src, "m", 1) == 1 and rm.tagged(src, "m", 2) == 2
    assert run_cli(capsys, "push", store_dir, "--repo", src, "--json").code == 0
    store = open_store(str(store_dir))
    store.update_env("production", {"m": 1})
    held: list[socket.socket] = []
    with TritonServer(node) as server:
        agent = AgentProcess(str(store_dir), "production", server, node, tmp_path / "cache", pod="pod-a",
                             log_dir=tmp_path).start()
        try:
            agent.wait_serving({"m": 1})
            quiet = [probe(agent.port)[1] for _ in range(20)]
            baseline_fds = open_fds(agent.process.pid)
            held = half_open(agent.port, HALF_OPEN)
            assert len(held) > HALF_OPEN // 2, "the test could not open its connections"
            # more keep coming while the probes run, and some clients reset mid-answer
            stop = threading.Event()

            def churn() -> None:
                while not stop.is_set() and len(held) < HALF_OPEN * 2:  # (bounded: this process's files)
                    for sock in half_open(agent.port, 50):
                        held.append(sock)
                    reset_mid_answer(agent.port, 5)

            churner = threading.Thread(target=churn, daemon=True)
            churner.start()
            try:
                probes, counted = [], []
                for _ in range(40):
                    probes.append(probe(agent.port))
                    counted.append(accepted_sockets(agent.process.pid, agent.port))
                peak_fds = open_fds(agent.process.pid)
            finally:
                stop.set()
                churner.join(30)
            assert {code for code, _ in probes} == {200}, probes
            seconds = sorted(s for _, s in probes)
            print(f"\n/readyz on loopback: quiet median {statistics.median(quiet) * 1000:.1f} ms; under "
                  f"{len(held)} half-open connections: median {statistics.median(seconds) * 1000:.1f} ms, "
                  f"p95 {seconds[int(len(seconds) * 0.95)] * 1000:.1f} ms, max {seconds[-1] * 1000:.1f} ms; "
                  f"agent fds {baseline_fds} -> {peak_fds}, accepted sockets at most {max(counted)} (cap "
                  f"{MAX_CONNECTIONS})")
            # (a probe not answered within its 10 s socket timeout fails above: the hang detector; times are printed)
            # the cap holds exactly: the agent's accepted sockets, as the kernel counts them, at 40 moments of the churn
            assert max(counted) <= MAX_CONNECTIONS + 1, ("the connection cap did not hold", counted)
            # the agent keeps following its pointer while the connections are still held
            store.update_env("production", {"m": 2})
            agent.wait_serving({"m": 2})
            # silent connections are closed by the agent itself (head timeout), not left to the client
            deadline = time.monotonic() + HEAD_TIMEOUT_S + 30
            sample = held[-200:]
            while time.monotonic() < deadline and not all(closed_by_peer(s) for s in sample):
                time.sleep(0.5)
            assert all(closed_by_peer(s) for s in sample), "half-open connections left open"
            assert probe(agent.port, "/status")[0] == 200
            held += half_open(agent.port, 100)
            assert agent.stop() == 0  # with connections open: a clean stop, no line per connection either
        finally:
            agent.stop()
            for sock in held:
                sock.close()
    log = agent.log_tail(100_000)
    assert "Traceback" not in log and "Exception" not in log and "Task" not in log, log[-3000:]
