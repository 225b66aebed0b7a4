"""The one Triton client wrapper turns a connection the server closes under a request into ServerError
(exit 6), never an internal error: geventhttpclient raises http.client's HTTPConnectionClosed there, which is
no OSError (seen under load: `trm publish` exited 1 while verifying)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core.errors import ServerError


@pytest.fixture
def closing_server():
    """A real loopback listener that reads each request and closes the connection without an answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    listener.close()


def test_a_connection_closed_under_a_request_is_a_server_error(closing_server):
    with TritonClient(closing_server, timeout_s=5) as client:
        for call in (lambda: client.infer("m", {"X": np.ones((1, 4), np.float32)}),
                     lambda: client.load("m"), lambda: client.unload("m"), lambda: client.model_config("m"),
                     client.server_metadata, client.repository_index):
            with pytest.raises(ServerError) as info:
                call()
            assert closing_server in info.value.message
        assert client.is_ready() is False
