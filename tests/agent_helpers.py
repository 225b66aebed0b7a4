"""`trm agent` as a real subprocess beside a real tritonserver, for tests/test_agent.py, test_fleet.py
and bench/bench_fleet.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from repo_manager.adapters.triton.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parent.parent


class AgentProcess:
    def __init__(self, store: str, env: str, server: TritonServer, repo: Path, cache: Path, *, pod: str,
                 interval: float = 0.3, log_dir: Path, extra: tuple[str, ...] = (),
                 hostname: str | None = None) -> None:
        """``hostname``: no --pod-name, $HOSTNAME set to it (the agent's default name), as two pods that
        share a host name get."""
        self.store, self.env, self.server, self.repo, self.cache, self.pod = store, env, server, repo, cache, pod
        self.interval, self.extra, self.hostname = interval, extra, hostname
        self.port = free_ports(1)[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"agent-{pod}.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        args = [sys.executable, "-m", "repo_manager", "agent", self.store, "--env", self.env,
                "--repo", str(self.repo), "--cache", str(self.cache), "--url", self.server.url,
                "--grpc-url", self.server.endpoints.grpc, "--listen", f"127.0.0.1:{self.port}",
                "--interval", str(self.interval), "--backoff", "0.5", "--drain-grace", "0.3", *self.extra]
        env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH") or str(ROOT))
        if self.hostname:
            env["HOSTNAME"] = self.hostname
        else:
            args += ["--pod-name", self.pod]
        log = open(self.log_path, "a")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(args, env=env, stdout=log, stderr=log)
        log.close()
        return self

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def status(self) -> dict[str, Any]:
        return json.loads(self.get("/status")[1])

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value for every sample line."""
        samples = {}
        for line in self.get("/metrics")[1].splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def wait(self, predicate, timeout: float = 90.0, what: str = "condition") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"agent {self.pod} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent {self.pod}: no {what} within {timeout} s; last status "
                             f"{json.dumps(last, indent=1)}\n{self.log_tail()}")

    def wait_serving(self, models: dict[str, int], timeout: float = 90.0) -> dict[str, Any]:
        return self.wait(lambda s: s["ready"] and s["served"] == models and s["state"] == "ready", timeout,
                         f"ready on {models}")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(text[-lines:])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


class Fleet:
    """Triton servers, each with its own repository and a `trm agent`, on simulated nodes: servers
    listed under one node share that node's cache folder (like pods sharing a hostPath volume)."""

    def __init__(self, root: Path, store: str, env: str, nodes: dict[str, int], *, interval: float = 0.3,
                 extra: tuple[str, ...] = (), hostname: str | None = None) -> None:
        self.root, self.store, self.env, self.interval, self.extra = root, store, env, interval, extra
        self.hostname = hostname
        self.layout = [(node, f"{node}-pod{i}") for node, count in nodes.items() for i in range(1, count + 1)]
        self.servers: dict[str, TritonServer] = {}
        self.agents: dict[str, AgentProcess] = {}

    def repo(self, pod: str) -> Path:
        return self.root / pod / "repo"

    def start(self) -> Fleet:
        from concurrent.futures import ThreadPoolExecutor

        for _, pod in self.layout:
            self.repo(pod).mkdir(parents=True, exist_ok=True)
        servers = {pod: TritonServer(self.repo(pod)) for _, pod in self.layout}
        try:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda s: s.start(), servers.values()))
        finally:
            self.servers = servers
        for node, pod in self.layout:
            self.agents[pod] = self.new_agent(node, pod).start()
        return self

    def new_agent(self, node: str, pod: str) -> AgentProcess:
        return AgentProcess(self.store, self.env, self.servers[pod], self.repo(pod), self.root / node / "cache",
                            pod=pod, interval=self.interval, log_dir=self.root, extra=self.extra,
                            hostname=self.hostname)

    def wait_serving(self, models: dict[str, int], timeout: float = 120.0) -> None:
        for agent in self.agents.values():
            agent.wait_serving(models, timeout)

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for server in self.servers.values():
            if server.process is not None:
                server.stop()


def slow_loading(repo_root: Path, name: str, tag: int, load_s: float, **behaviour) -> int:
    """Publish the next version of ``name`` (tests/rollout_models.py's tagged model) whose load takes
    ``load_s`` seconds: a large model, as far as the agent can tell."""
    import rollout_models as rm

    from repo_manager.core.settings import Settings
    from repo_manager.ops.publish.core import run_publish

    def build(repo, _name: str) -> list:
        staged = rm._stage_python(repo, name, tag, **behaviour)
        path = staged.folder / "model.py"
        path.write_text(path.read_text().replace(
            "    def initialize(self, args):\n", f"    def initialize(self, args):\n        time.sleep({load_s})\n"))
        return [staged]

    return run_publish(Settings(repository=repo_root), name, build, verify_model=False).version


class LoadedCopies:
    """A thread that samples, every few milliseconds, how many copies of ``model`` one server holds: its
    loaded versions plus pre-check copies under temporary names (Triton's statistics list both)."""

    def __init__(self, url: str, model: str) -> None:
        import threading

        self.url, self.model = url, model
        self.most = 0
        self.seen: list[list[str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        from repo_manager.adapters.triton.client import TritonClient
        from repo_manager.core.errors import TrmError

        with TritonClient(self.url, timeout_s=10.0) as client:
            while not self.stop.is_set():
                try:
                    copies = sorted(f"{e['name']}:{e.get('version')}" for e in client.statistics()
                                    if e.get("name") == self.model or e.get("name", "").endswith(f"-{self.model}"))
                except TrmError:
                    copies = []
                if len(copies) > self.most:
                    self.most = len(copies)
                    self.seen.append(copies)
                time.sleep(0.02)

    def __enter__(self) -> LoadedCopies:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


class ReadyWatch:
    """A thread that asks an agent's /readyz and /status every few milliseconds: every answer that was
    not 200, and every state seen."""

    def __init__(self, agent: AgentProcess) -> None:
        import threading

        self.agent = agent
        self.unready: list[str] = []
        self.states: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                code, text = self.agent.get("/readyz")
                if code != 200:
                    self.unready.append(text.strip())
                self.states.add(self.agent.status()["state"])
            except (OSError, ValueError) as exc:
                self.unready.append(f"no answer: {exc}")
            time.sleep(0.05)

    def __enter__(self) -> ReadyWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
