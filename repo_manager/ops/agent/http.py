"""The agent's HTTP endpoint: /healthz, /readyz, /status, /metrics, read-only, one request per connection.

It runs on an asyncio loop in a daemon thread, so an idle or slow connection costs a socket and a few
hundred bytes, never a thread, and the kubelet's probe is answered while thousands of connections sit
open (the test sends 3,000 half-open ones). Bounds that keep it so:

- a connection must deliver its whole request head within ``HEAD_TIMEOUT_S`` and in at most
  ``MAX_HEAD_BYTES``, and take its answer within ``WRITE_TIMEOUT_S``; otherwise it is closed;
- at most ``MAX_CONNECTIONS`` sockets are open at once, counted from accept until the kernel has freed
  them: one beyond that closes the oldest connection still sending its request, and is set up only once
  that socket is closed (a fresh probe, which sends its request at once, always gets in); when every slot
  is answering, the new one is closed at once. Connections are accepted one at a time by trm's own loop,
  so the process holds at most ``MAX_CONNECTIONS`` + 1 of them (the one waiting for a slot); the rest
  wait in the kernel's listen queue;
- a peer that resets or goes away mid-answer is simply closed: nothing is logged per connection.

Handlers only read the agent's status snapshot (a copy under a short lock), so a scrape never waits for
a rollout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from repo_manager.adapters import metrics
from repo_manager.core.errors import UsageError
from repo_manager.ops.agent.metrics import render

if TYPE_CHECKING:
    from repo_manager.ops.agent.core import Agent

DEFAULT_HOST = "127.0.0.1"
HEAD_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192
MAX_CONNECTIONS = 256
LISTEN_BACKLOG = 1024
ACCEPT_RETRY_S = 0.1
"""After an accept the kernel refused (out of file descriptors): the pause before the next."""
ENDPOINTS = b"endpoints: /healthz /readyz /status /metrics\n"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


def parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r} is not HOST:PORT",
                         hint="e.g. 127.0.0.1:8090 (0.0.0.0:8090 where the kubelet probes the pod's address)")
    return host.strip("[]") or DEFAULT_HOST, int(port)


class AgentHTTP:
    def __init__(self, agent: Agent, listen: str, *, max_connections: int = MAX_CONNECTIONS,
                 head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
        host, port = parse_listen(listen)
        self.agent = agent
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        try:  # bound here, so a taken port is an error of `trm agent` itself, before anything starts
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise UsageError(f"cannot listen on {listen}: {exc.strerror}", hint="pick another --listen") from exc
        self._loop = asyncio.new_event_loop()
        self._acceptor: asyncio.Task | None = None
        self._open: OrderedDict[asyncio.StreamWriter, bool] = OrderedDict()
        """Connections set up, oldest first; the value: True once the request head is in (answering)."""
        self._sockets = 0
        """Accepted sockets the kernel has not freed yet (set up or not): never more than max_connections."""
        self._setting_up = 0
        """Of those, the ones accepted whose connection is not set up yet (not in ``_open``)."""
        self._freed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.evicted = 0
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trm-agent-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self.thread.start()
        self._started.wait(10)

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            self.thread.join(10)
        self._socket.close()

    async def _shutdown(self) -> None:
        """End every open connection (quietly: its task sees the reset and returns), stop accepting, stop.
        Connections accepted meanwhile are closed on arrival; the listening socket closes last."""
        self._closing = True
        deadline, quiet_rounds = self._loop.time() + WRITE_TIMEOUT_S, 0
        while self._loop.time() < deadline and quiet_rounds < 3:
            await asyncio.sleep(0.02)  # connections accepted just before the stop are set up meanwhile
            if not self._tasks:
                quiet_rounds += 1
                continue
            quiet_rounds = 0
            for writer in list(self._open):
                writer.transport.abort()  # (not task.cancel(): asyncio's stream callback would log each one)
            await asyncio.wait(list(self._tasks), timeout=0.5)
        if self._acceptor is not None:
            self._acceptor.cancel()
            await asyncio.wait([self._acceptor], timeout=1.0)
        self._loop.stop()

    # ------------------------------------------------------------------------------------ the loop
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._socket.setblocking(False)
        self._acceptor = self._loop.create_task(self._accept_loop())
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _accept_loop(self) -> None:
        """Accept one connection at a time, each only once a socket slot is free (see the module's doc)."""
        while True:
            try:
                sock, _ = await self._loop.sock_accept(self._socket)
            except OSError:  # out of file descriptors, or a connection reset while queued: the next one
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if self._closing or not await self._free_a_slot():
                sock.close()
                continue
            self._sockets += 1
            self._setting_up += 1
            task = self._loop.create_task(self._connection(sock))
            self._tasks.add(task)

    async def _free_a_slot(self) -> bool:
        """Make room for one more socket: close the oldest connection still sending its request and wait until
        the kernel has freed it. False when every connection is being answered (the new one is refused)."""
        while self._sockets >= self.max_connections:
            oldest_reading = next((w for w, answering in self._open.items() if not answering), None)
            if oldest_reading is None:
                if self._setting_up:  # accepted a moment ago, not set up yet: evictable once they are
                    await asyncio.sleep(0)
                    continue
                return False
            self._open.pop(oldest_reading)
            self.evicted += 1
            self._freed.clear()
            oldest_reading.transport.abort()
            await self._freed.wait()
        return True

    async def _connection(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_HEAD_BYTES)
                self._open[writer] = False
            finally:
                self._setting_up -= 1
            if self._closing:
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout_s)
            except asyncio.LimitOverrunError:
                code, body, kind, head_only = 431, b"request head too large\n", "text/plain", False
            else:
                self._open[writer] = True
                try:
                    code, body, kind, head_only = self._answer(head)
                except Exception:  # noqa: BLE001 - a bug answers 500; the endpoint keeps serving
                    code, body, kind, head_only = 500, b"internal error\n", "text/plain", False
            writer.write(_response(code, body, kind, head_only))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # a slow, silent or vanished peer: closed below, nothing worth a log line
        finally:
            await self._close(sock, writer)
            self._tasks.discard(task)

    async def _close(self, sock: socket.socket, writer: asyncio.StreamWriter | None) -> None:
        """Close one connection and count its socket as freed once the kernel has it back."""
        try:
            if writer is None:
                sock.close()
            else:
                self._open.pop(writer, None)
                writer.close()
                await writer.wait_closed()  # resolves once the transport has closed the socket
        except (ConnectionError, OSError):
            pass  # reset by the peer: closed all the same
        finally:
            self._sockets -= 1
            self._freed.set()

    def _answer(self, head: bytes) -> tuple[int, bytes, str, bool]:
        """(status, body, content type, HEAD) for one request head."""
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, b"not an HTTP/1.x request\n", "text/plain", False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, b"this endpoint is read-only: GET or HEAD\n", "text/plain", False
        path = target.split("?", 1)[0].rstrip("/") or "/"
        head_only = method == "HEAD"
        if path == "/healthz":
            return 200, b"ok\n", "text/plain", head_only
        status = self.agent.status()
        if path == "/readyz":
            ready = status["ready"]
            text = "ready\n" if ready else f"not ready: {status['state']}: {status['reason'] or ''}\n"
            return (200 if ready else 503), text.encode(), "text/plain", head_only
        if path == "/status":
            return 200, (json.dumps(status, indent=2, sort_keys=True) + "\n").encode(), "application/json", head_only
        if path == "/metrics":
            return 200, render(status), metrics.CONTENT_TYPE, head_only
        return 404, ENDPOINTS, "text/plain", head_only


def _response(code: int, body: bytes, content_type: str, head_only: bool) -> bytes:
    head = (f"HTTP/1.1 {code} {REASONS[code]}\r\nServer: trm-agent\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head if head_only else head + body
