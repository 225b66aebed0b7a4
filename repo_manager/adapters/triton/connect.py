"""Get a Triton client for an operation: a running server (``--url``) or an embedded one."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.restricted import key_from
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.settings import Settings


@contextmanager
def triton_client(settings: Settings, repository: Path | None = None,
                  models: tuple[str, ...] = ()) -> Iterator[TritonClient]:
    """A ready client. With ``settings.triton_url`` it talks to that server; otherwise it starts an
    embedded server on ``repository`` (an empty scratch folder when None) for the ``with`` block."""
    if settings.triton_url:
        client = TritonClient(settings.triton_url, api_key=key_from(settings))
        try:
            client.require_ready()
            yield client
        finally:
            client.close()
        return
    with tempfile.TemporaryDirectory(prefix="trm-scratch-") as scratch:
        repo = repository if repository is not None else Path(scratch)
        with TritonServer(repo, binary=settings.tritonserver, models=models,
                          start_timeout_s=settings.server_start_timeout_s, api_key=key_from(settings)) as server:
            client = TritonClient(server.url, api_key=server.api_key)
            try:
                yield client
            finally:
                client.close()
