"""The agent's HTTP endpoint (stdlib ``http.server`` in a daemon thread): /healthz, /readyz, /status,
/metrics. Handlers only read the agent's status snapshot, so a scrape never waits for a rollout."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from repo_manager import metrics
from repo_manager.agent.metrics import render
from repo_manager.errors import UsageError

if TYPE_CHECKING:
    from repo_manager.agent.core import Agent


def parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r} is not HOST:PORT", hint="e.g. 0.0.0.0:8090")
    return host or "0.0.0.0", int(port)


class AgentHTTP:
    def __init__(self, agent: Agent, listen: str) -> None:
        host, port = parse_listen(listen)
        handler = type("Handler", (_Handler,), {"agent": agent})
        try:
            self.server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise UsageError(f"cannot listen on {listen}: {exc.strerror}", hint="pick another --listen") from exc
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="trm-agent-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    agent: Agent
    server_version = "trm-agent"

    def log_message(self, *args: object) -> None:
        pass  # probes every few seconds would drown the agent's own log

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        status = self.agent.status()
        if path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ready = status["ready"]
            text = "ready\n" if ready else f"not ready: {status['state']}: {status['reason'] or ''}\n"
            self._send(200 if ready else 503, text.encode(), "text/plain")
        elif path == "/status":
            self._send(200, (json.dumps(status, indent=2, sort_keys=True) + "\n").encode(), "application/json")
        elif path == "/metrics":
            self._send(200, render(status), metrics.CONTENT_TYPE)
        else:
            self._send(404, b"endpoints: /healthz /readyz /status /metrics\n", "text/plain")

    do_HEAD = do_GET
