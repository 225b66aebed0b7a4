"""Helpers for tests: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from repo_manager.cli import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def run_cli(capsys, *args: str) -> Result:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return Result(int(exit_info.value.code or 0), captured.out, captured.err)


class FixedAnswers:
    """An HTTP server on 127.0.0.1 answering GET PATH with ``documents[PATH]`` (404 for any other path; the
    mapping may change while it runs). For answers a real server would never give: a stand-in, named as such
    where a test uses it."""

    def __init__(self, documents: dict[str, bytes]) -> None:
        import http.server
        import threading

        self.documents = documents
        answers = self.documents

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = answers.get(self.path.split("?")[0])
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> FixedAnswers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
