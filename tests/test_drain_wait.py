"""The wait for an LLM version's streams before its unload (repo_manager/ops/rollout/streams.py), against a real
HTTP /metrics endpoint on loopback whose answers the test sets one by one: no server, no engine, no timing."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from repo_manager.ops.rollout.streams import wait_drained


def _gauges(running: int, waiting: int = 0) -> bytes:
    return (f'vllm:num_requests_running{{model="chat",version="1"}} {running}\n'
            f'vllm:num_requests_waiting{{model="chat",version="1"}} {waiting}\n').encode()


@pytest.fixture
def metrics():
    """A /metrics endpoint that answers from a script: bytes (200) or None (a 503, as a failed scrape); the last
    entry repeats. Yields (url, the script, the number of scrapes served)."""
    script: list[bytes | None] = []
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = script[min(served[0], len(script) - 1)]
            served[0] += 1
            self.send_response(200 if body is not None else 503)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", script, served
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_scrape_during_the_drain_does_not_end_it(metrics):
    """Two streams, then scrapes that fail, then the streams end: the wait goes on through the failures and
    ends drained (it ended at the first failure before, and the version was unloaded under its streams)."""
    url, script, served = metrics
    script += [_gauges(2), _gauges(1, 1), None, None, _gauges(1), _gauges(0)]
    drained = wait_drained(url, "chat", (1,), timeout_s=120, poll_s=0.01)
    assert (drained.left, drained.first) == (0, 2) and served[0] >= 6
    assert drained.text.startswith("2 stream(s) in flight finished")


def test_gauges_unreadable_for_the_first_reads_window_do_not_wait_and_say_so(metrics):
    url, script, served = metrics
    script += [None]
    began = []
    drained = wait_drained(url, "chat", (1,), timeout_s=120, poll_s=0.01, first_read_s=0.3, began=began.append)
    assert drained.left is None and "not readable" in drained.text and served[0] >= 2 and began == []


def test_a_first_scrape_that_fails_is_tried_again_and_the_wait_begins_on_the_first_reading(metrics):
    """One slow scrape of a busy node at the start had ended the wait before it began ("not readable"), and
    the version was unloaded under its streams."""
    url, script, _ = metrics
    script += [None, None, _gauges(2), _gauges(1), _gauges(0)]
    began = []
    drained = wait_drained(url, "chat", (1,), timeout_s=120, poll_s=0.01, began=began.append)
    assert began == [2] and (drained.left, drained.first) == (0, 2)
    assert drained.text.startswith("2 stream(s) in flight finished")


def test_streams_that_never_end_are_left_at_the_timeout(metrics):
    url, script, _ = metrics
    script += [_gauges(3)]
    drained = wait_drained(url, "chat", (1,), timeout_s=0.2, poll_s=0.01)
    assert (drained.left, drained.first) == (3, 3) and "still in flight" in drained.text
