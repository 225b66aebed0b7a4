"""Triton's HTTP generate extension for a vLLM model: ``POST /v2/models/NAME/generate`` (one JSON answer) and
``generate_stream`` (server-sent events, one per engine output).

The request names the model's inputs as JSON keys (``text_input``, ``stream``, ``sampling_parameters`` as a
JSON string, the ``return_*`` flags); each answer holds its outputs by name. An error answer (HTTP 4xx/5xx,
or an ``error`` event in a stream) raises ``GenerateError`` with the server's message.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from repo_manager.core.errors import ServerError


class GenerateError(ServerError):
    """The model answered a generate request with an error (a bad request, a prompt too long)."""

    kind = "generate"


def _flat(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """vLLM's log-probability of each generated token (with ``logprobs`` in the sampling parameters)."""
    num_input_tokens: int | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    chunks: int = 0
    ttft_s: float | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        rate = (self.num_output_tokens / (self.seconds - self.ttft_s)
                if self.ttft_s is not None and self.seconds > self.ttft_s and self.num_output_tokens > 1 else None)
        return {"text": self.text, "num_input_tokens": self.num_input_tokens,
                "num_output_tokens": self.num_output_tokens, "finish_reason": self.finish_reason,
                "responses": self.chunks, "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
                "seconds": round(self.seconds, 4),
                "tokens_per_s": None if rate is None else round(rate, 2)}

    def add(self, answer: dict[str, Any], started: float) -> str:
        """Fold one answer in; returns its new text."""
        text = _flat(answer.get("text_output", ""))
        text = text if isinstance(text, str) else ""
        self.text += text
        self.chunks += 1
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - started
        logprobs = _flat(answer.get("logprobs"))
        if isinstance(logprobs, str) and logprobs != "null":
            for entry in json.loads(logprobs):
                token, detail = next(iter(entry.items()))
                self.token_ids.append(int(token))
                if isinstance(detail, dict) and isinstance(detail.get("logprob"), (int, float)):
                    self.logprobs.append(float(detail["logprob"]))
        if answer.get("num_input_tokens") is not None:
            self.num_input_tokens = int(_flat(answer["num_input_tokens"]))
        if answer.get("num_output_tokens") is not None:
            self.num_output_tokens += int(_flat(answer["num_output_tokens"]))
        reason = _flat(answer.get("finish_reason"))
        if isinstance(reason, str) and reason != "None":
            self.finish_reason = reason
        return text


def request_body(text: str, parameters: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    return {"text_input": text, "stream": stream, "sampling_parameters": json.dumps(parameters),
            "exclude_input_in_output": True, "return_logprobs": "logprobs" in parameters,
            "return_num_input_tokens": True, "return_num_output_tokens": True, "return_finish_reason": True}


def generate_stream(url: str, model: str, text: str, parameters: dict[str, Any], *, stream: bool = True,
                    version: int | None = None, timeout_s: float = 300.0) -> Iterator[dict[str, Any]]:
    """The answers to one request: one per engine output with ``stream``, else exactly one."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 8000, timeout=timeout_s)
    path = (f"/v2/models/{urllib.parse.quote(model)}" + (f"/versions/{version}" if version else "")
            + f"/{'generate_stream' if stream else 'generate'}")
    try:
        try:
            connection.request("POST", path, body=json.dumps(request_body(text, parameters, stream=stream)),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
        except OSError as exc:
            raise ServerError(f"cannot reach Triton at {url}: {exc}", hint="is the server running?") from exc
        if response.status >= 400:
            raise GenerateError(_error_text(response.read()), status=response.status)
        if not stream:
            yield _answer(response.read())
            return
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            yield _answer(line[5:].strip().encode())
    finally:
        connection.close()


def _error_text(body: bytes) -> str:
    try:
        data = json.loads(body)
        return str(data.get("error") or data) if isinstance(data, dict) else str(data)
    except ValueError:
        return body.decode("utf-8", errors="replace").strip() or "no answer"


def _answer(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ServerError(f"Triton answered a generate request with something other than JSON: {body[:200]!r}"
                          ) from exc
    if isinstance(data, dict) and "error" in data:
        raise GenerateError(str(data["error"]))
    if not isinstance(data, dict):
        raise ServerError("Triton answered a generate request with something other than a JSON object")
    return data


def generate(url: str, model: str, text: str, parameters: dict[str, Any], *, stream: bool = True,
             version: int | None = None, on_text=None, timeout_s: float = 300.0) -> Generation:
    """One whole generation; ``on_text(new_text)`` is called as each answer arrives."""
    result = Generation()
    started = time.monotonic()
    for answer in generate_stream(url, model, text, parameters, stream=stream, version=version,
                                  timeout_s=timeout_s):
        new = result.add(answer, started)
        if on_text is not None and new:
            on_text(new)
    result.seconds = time.monotonic() - started
    return result
