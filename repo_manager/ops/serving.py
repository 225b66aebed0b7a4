"""Serving operations: load a repository's models on Triton, run the embedded server, send requests."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from repo_manager.adapters import metrics
from repo_manager.adapters.process import stopping
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.restricted import key_from
from repo_manager.adapters.triton.server import Endpoints, TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, ModelLoadError, NotFoundError, TrmError
from repo_manager.core.settings import Settings


def version_config(repo: LocalRepository, model: str, version: int) -> cfg.ModelConfig:
    """The config a version was validated with, pinned to that version (for the load API)."""
    manifest = repo.manifest(model, version)
    config = cfg.parse_config(repo.installed_config(manifest), f"manifest of {model}/{version}")
    config.version_policy.specific.versions[:] = [version]
    return config


def dependencies(repo: LocalRepository, model: str, version: int) -> list[tuple[str, int]]:
    """Ensemble members (recursively), deepest first, with the versions the ensemble pins."""
    found: list[tuple[str, int]] = []
    for member, member_version in repo.manifest(model, version).members.items():
        found += dependencies(repo, member, member_version) + [(member, member_version)]
    return found


def load_version(client: TritonClient, repo: LocalRepository, model: str, version: int | None = None) -> int:
    """Load exactly ``version`` (default: the latest complete one) of ``model`` and its members."""
    version = repo.latest(model) if version is None else version
    members = dependencies(repo, model, version)
    for member, member_version in members:
        with metrics.timed_load(member, member_version):
            client.load(member, version_config(repo, member, member_version))
    try:
        with metrics.timed_load(model, version):
            client.load(model, version_config(repo, model, version))
    except ModelLoadError:
        if not members:
            raise
        # Loading an ensemble makes Triton re-poll its members from the repository folder, at the folder's
        # config.pbtxt (the newest version): an older ensemble version then misses the member versions it
        # pins. Loading the pinned members again makes Triton retry the ensemble, which now finds them.
        for member, member_version in members:
            client.load(member, version_config(repo, member, member_version))
        if not client.is_model_ready(model, version):
            raise
    return version


def top_level_models(repo: LocalRepository) -> list[str]:
    """Models that are not members of another model's latest version (those load with their ensemble)."""
    models = [m for m in repo.models() if repo.versions(m)]
    members = {name for m in models for name, _ in dependencies(repo, m, repo.latest(m))}
    return [m for m in models if m not in members]


@dataclass(frozen=True)
class ServeInfo:
    endpoints: Endpoints
    models: dict[str, int]
    pid: int
    log: str

    def to_dict(self) -> dict[str, Any]:
        return {"endpoints": self.endpoints.to_dict(), "models": self.models, "pid": self.pid,
                "log": self.log}



@contextmanager
def embedded_server(settings: Settings, models: list[str] | None = None, *, http_port: int | None = None,
                    grpc_port: int | None = None, metrics_port: int | None = None,
                    versions: Mapping[str, int] | None = None) -> Iterator[ServeInfo]:
    """Start tritonserver on the repository and load ``models`` (default: all) at their latest version, or
    at the one ``versions`` names. An error raised inside names "the embedded server", not its address:
    the server is gone by the time anyone reads it."""
    repo = LocalRepository(settings.repository)
    if not repo.root.is_dir():
        raise NotFoundError(f"repository {repo.root} does not exist", hint="publish a model first")
    wanted = list(models) if models else top_level_models(repo)
    chosen = {model: (versions or {}).get(model) for model in wanted}
    for model, version in chosen.items():
        check_version_exists(repo, model, version)  # a clear error before the server starts
    server = TritonServer(repo.root, binary=settings.tritonserver, address=settings.bind_address,
                          http_port=settings.http_port if http_port is None else http_port,
                          grpc_port=settings.grpc_port if grpc_port is None else grpc_port,
                          metrics_port=settings.metrics_port if metrics_port is None else metrics_port,
                          start_timeout_s=settings.server_start_timeout_s, api_key=key_from(settings))
    with server:
        try:
            # a load returns when the model is ready (up to the client's LOAD_TIMEOUT_S: a vLLM engine takes
            # minutes to start on CPU)
            with TritonClient(server.url, api_key=server.api_key) as client:
                loaded = {model: load_version(client, repo, model, version) for model, version in chosen.items()}
            yield ServeInfo(server.endpoints, loaded, server.pid or 0, str(server.log_path))
        except TrmError as exc:
            _without_address(exc, server.url)
            raise


def check_version_exists(repo: LocalRepository, model: str, version: int | None) -> int:
    """``version`` (default: the latest complete one) of ``model``; NotFoundError naming the versions there are."""
    if version is None:
        return repo.latest(model)
    versions = repo.versions(model)
    if version not in versions:
        raise NotFoundError(f"model {model!r} has no version {version} in {repo.root}", model=model,
                            version=version, hint="its versions: " + (", ".join(map(str, versions)) or
                                                                      "none (publish one first)"))
    return version


def _without_address(exc: TrmError, url: str) -> None:
    """Replace the embedded server's address in ``exc`` by what it was: the address stops existing when the
    server stops, before the error is printed."""
    if url and url in exc.message:
        message = exc.message.replace(f"Triton at {url}", "the embedded Triton")
        for before in (" at ", " on "):
            message = message.replace(f"{before}{url}", " on the embedded Triton")
        exc.message = message.replace(url, "the embedded Triton")
        exc.args = (exc.message,)
    if exc.url == url:
        exc.url = "embedded Triton (stopped)"


def wait_for_signal(ready: Callable[[], None] | None = None) -> int:
    """Block until SIGINT, SIGTERM or SIGHUP; returns the signal number."""
    received: list[int] = []
    event = threading.Event()

    def handler(signum, _frame) -> None:
        received.append(signum)
        stopping()
        event.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        if ready:
            ready()
        while not event.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return received[0]


def text_inputs(config: cfg.ModelConfig, texts: list[str]) -> dict[str, np.ndarray]:
    """Requests for a text model: the config's one STRING input gets one text per batch item."""
    strings = [t for t in config.input if t.data_type == cfg.mc.TYPE_STRING]
    if len(strings) != 1 or len(config.input) != 1:
        raise InputError(f"model {config.name} does not take a single text input", hint="use --input NAME=FILE.npy")
    tensor = strings[0]
    data = np.array([t.encode() for t in texts], dtype=np.object_)
    dims = [d if d > 0 else 1 for d in tensor.dims]
    if config.max_batch_size > 0:
        return {tensor.name: data.reshape([len(texts)] + dims)}
    return {tensor.name: data.reshape(dims if len(texts) == 1 else [len(texts)] + dims[1:])}


def model_config_for(settings: Settings, client: TritonClient, model: str) -> cfg.ModelConfig:
    """The served config when the server has the model, else the repository's."""
    try:
        return client.model_config(model)
    except NotFoundError:
        return LocalRepository(settings.repository).config(model)

