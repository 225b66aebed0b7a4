"""Triton's control APIs restricted to trm: on a real tritonserver started by `trm serve` with
$TRM_TRITON_API_KEY, an unauthenticated client is refused every call that changes what is served (HTTP and
gRPC: load with posted code, unload, index, shared memory, statistics, trace, logging) while health,
metadata, model config and inference keep working; trm with the key still rolls out and its agent still
follows a promotion. The key is never shown. (The deployment passes the same flags: tests/test_deploy.py.)
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import rollout_models as rm
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from agent_helpers import AgentProcess
from helpers import run_cli
from tritonclient.utils import InferenceServerException

from repo_manager.adapters.loadgen.measure import LoadSpec, Target, measure
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton import restricted
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.restricted import ApiKey
from repo_manager.adapters.triton.server import free_ports
from repo_manager.core.errors import ConfigError, ServerError
from repo_manager.core.redact import redact
from repo_manager.core.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
KEY = "k3y-only-the-agent-knows-0123456789abcdef"
EVIL_PY = b"import os\nos.system('touch /tmp/trm-restricted-api-pwned')\n"


def raw(url: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None,
        method: str = "POST") -> tuple[int, str]:
    """One request as any client in the cluster could send it (no trm code on the way)."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Serve:
    """`trm serve` as a subprocess, as a user starts it."""

    def __init__(self, repo: Path, log: Path, env: dict[str, str]) -> None:
        self.ports = free_ports(3)
        self.url = f"http://127.0.0.1:{self.ports[0]}"
        self.grpc = f"127.0.0.1:{self.ports[1]}"
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "repo_manager", "serve", "--repo", str(repo), "--http-port",
                 str(self.ports[0]), "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2])],
                env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=out, stderr=subprocess.STDOUT)

    def wait_serving(self, model: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with TritonClient(self.url, timeout_s=2) as client:
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self.log.read_text()
                if client.is_ready() and client.is_model_ready(model):
                    return
                time.sleep(0.2)
        raise AssertionError(f"{model} not ready: {self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def answer_tag(url: str, model: str) -> int:
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        tensor = httpclient.InferInput("X", [1, rm.FEATURES], "FP32")
        tensor.set_data_from_numpy(np.ones((1, rm.FEATURES), np.float32))
        return int(client.infer(model, [tensor]).as_numpy("TAG").ravel()[0])  # no key: inference is open
    finally:
        client.close()


def test_unauthenticated_control_is_refused_while_inference_works_and_trm_with_the_key_rolls_out_and_follows(
        capsys, monkeypatch, tmp_path):
    repo, store_dir = tmp_path / "repo", tmp_path / "store"
    assert rm.tagged(repo, "m", 1) == 1 and rm.tagged(repo, "m", 2) == 2
    serve = Serve(repo, tmp_path / "serve.log", {"TRM_TRITON_API_KEY": KEY})
    agent = None
    try:
        serve.wait_serving("m")
        url = serve.url
        # ---- any client without the key: nothing that changes what is served, nothing that reads memory
        evil = {"parameters": {"config": json.dumps({"name": "evil", "backend": "python"}),
                               "file:1/model.py": base64.b64encode(EVIL_PY).decode()}}
        refused = [raw(url, "/v2/repository/models/evil/load", evil),
                   raw(url, "/v2/repository/models/evil/load", evil, {"triton-api-key": "not-the-key"}),
                   raw(url, "/v2/repository/models/m/unload"),
                   raw(url, "/v2/repository/index"),
                   raw(url, "/v2/systemsharedmemory/region/x/register", {"key": "/anything", "offset": 0,
                                                                          "byte_size": 64}),
                   raw(url, "/v2/models/m/stats", method="GET"),
                   raw(url, "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
                   raw(url, "/v2/logging", {"log_verbose_level": 1})]
        for code, body in refused:
            assert code == 403 and "restricted" in body, (code, body)
        grpc = grpcclient.InferenceServerClient(serve.grpc)
        try:
            for call in (lambda: grpc.load_model("evil", config=json.dumps({"name": "evil", "backend": "python"}),
                                                 files={"file:1/model.py": EVIL_PY}),
                         lambda: grpc.unload_model("m"), grpc.get_model_repository_index,
                         lambda: grpc.load_model("m", headers={"triton-api-key": KEY})):  # HTTP's header name
                with pytest.raises(InferenceServerException, match="restricted"):
                    call()
            assert grpc.is_server_ready() and grpc.is_model_ready("m")
        finally:
            grpc.close()
        assert not Path("/tmp/trm-restricted-api-pwned").exists()
        # ---- ... while health, metadata, config and inference answer it
        assert raw(url, "/v2/health/ready", method="GET")[0] == 200
        assert raw(url, "/v2/models/m", method="GET")[0] == 200
        assert raw(url, "/v2/models/m/config", method="GET")[0] == 200
        assert answer_tag(url, "m") == 2
        with TritonClient(url, api_key=ApiKey("triton-api-key", KEY)) as client:  # what is loaded: unchanged
            assert client.loaded_versions("m") == [2]
            assert "evil" not in {entry["name"] for entry in client.repository_index()}
        # ---- trm without the key: a one-line refusal naming the setting, exit 6
        with TritonClient(url) as client, pytest.raises(ServerError, match="restricted and trm sent no key") as info:
            client.load("m")
        assert "TRM_TRITON_API_KEY" in info.value.hint
        result = run_cli(capsys, "rollout", "m", "--version", "1", "--url", url, "--grpc-url", serve.grpc,
                         "--repo", repo)
        assert result.code == 6 and "restricted" in result.err and KEY not in result.err + result.out, result.err
        # ---- trm with the key: a rollout (over gRPC) ...
        monkeypatch.setenv("TRM_TRITON_API_KEY", KEY)
        result = run_cli(capsys, "rollout", "m", "--version", "1", "--url", url, "--grpc-url", serve.grpc,
                         "--repo", repo, "--json")
        assert result.code == 0, result.err
        assert answer_tag(url, "m") == 1 and KEY not in result.out + result.err
        # ... a measurement (it reads statistics, a restricted group) ...
        with restricted.process_key(load_settings(env={"TRM_TRITON_API_KEY": KEY})):
            point = measure(Target("m", url), LoadSpec(concurrency=2, requests=60, warmup_s=0.0))
        assert point.errors == 0 and point.server is not None, point
        # ... and the agent following a promotion (its key from the environment, as the manifests give it)
        store = open_store(str(store_dir))
        assert run_cli(capsys, "push", store_dir, "--repo", repo, "--json").code == 0
        store.update_env("production", {"m": 2})
        server = SimpleNamespace(url=url, endpoints=SimpleNamespace(grpc=serve.grpc))  # the one `trm serve` runs
        agent = AgentProcess(str(store_dir), "production", server, repo, tmp_path / "cache", pod="pod-a",
                             log_dir=tmp_path)
        monkeypatch.setenv("TRM_TRITON_API_KEY", KEY)  # inherited by the agent process
        agent.start()
        agent.wait_serving({"m": 2})
        assert answer_tag(url, "m") == 2
        assert KEY not in agent.log_tail(500) + json.dumps(agent.status())
    finally:
        if agent is not None:
            agent.stop()
        serve.stop()
    output = serve.log.read_text()
    assert "restricted to $TRM_TRITON_API_KEY: model-repository, shared-memory" in output and KEY not in output


def test_the_key_is_never_shown_and_stays_out_of_settings_files(capsys, monkeypatch, tmp_path):
    settings = load_settings(env={"TRM_TRITON_API_KEY": KEY})
    assert settings.triton_api_key == KEY and settings.triton_api_header == "triton-api-key"
    assert KEY not in repr(settings) and settings.to_dict()["triton_api_key"] == "***"
    with restricted.process_key(settings) as key:
        assert restricted.current() is key and KEY not in repr(key)
        assert redact(f"flag --http-restricted-api=model-repository:triton-api-key={KEY}") \
            == "flag --http-restricted-api=model-repository:triton-api-key=***"
        assert key.server_args()[1].startswith("--grpc-restricted-protocol=model-repository,shared-memory,")
    assert restricted.current() is None
    config = tmp_path / "trm.yaml"
    config.write_text(f"triton_api_key: {KEY}\n")
    with pytest.raises(ConfigError, match="a secret does not belong in a settings file") as info:
        load_settings(config, env={})
    assert KEY not in str(info.value)
    for bad in ("short", "has space in it 0123456789", "x" * 600, "semi:colon=equals-0123456789"):
        with pytest.raises(ConfigError) as info:
            Settings(triton_api_key=bad)
        assert bad not in info.value.message
    with pytest.raises(ConfigError, match="lower-case header name"):
        Settings(triton_api_key=KEY, triton_api_header="X-Key")
    monkeypatch.setenv("TRM_TRITON_API_KEY", "a key with spaces 0123456789")
    result = run_cli(capsys, "list")
    assert result.code == 3 and len(result.err.strip().splitlines()) <= 2, result.err
    assert "TRM_TRITON_API_KEY" in result.err and "spaces" not in result.err
