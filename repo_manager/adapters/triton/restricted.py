"""Triton's restricted APIs: the control groups only trm may call, and the key that unlocks them.

A Triton started with ``--http-restricted-api=GROUPS:HEADER=KEY`` (and ``--grpc-restricted-protocol``, the
same for gRPC) answers a call of those groups only when the request carries ``HEADER: KEY`` (gRPC:
``triton-grpc-protocol-HEADER``); anything else is refused (HTTP 403; gRPC UNAVAILABLE with "This
protocol is restricted"). Health, metadata, model config and inference stay open: what an inference
client needs, and none of them writes anything.

The key is one per deployment, not per call: the CLI reads it from the settings (``$TRM_TRITON_API_KEY``)
and makes it the process's key for the command (``process_key``); every ``TritonClient`` sends it on the
restricted calls and every ``TritonServer`` trm starts requires it. Code that starts servers or clients
of its own (tests) passes an ``ApiKey`` explicitly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from repo_manager.core import redact
from repo_manager.core.settings import Settings

RESTRICTED_APIS = ("model-repository", "shared-memory", "statistics", "trace", "logging")
"""Load/unload/index (a load with file overrides runs posted code), shared-memory registration (maps
any /dev/shm key, the Python backend's included), statistics, and the trace and log settings."""

OPEN_APIS = ("health", "metadata", "model-config", "inference")
GRPC_PREFIX = "triton-grpc-protocol-"
"""Triton 2.51 looks for the gRPC key under this prefix + the header name (measured: see the tests)."""


@dataclass(frozen=True)
class ApiKey:
    header: str
    value: str = field(repr=False)

    def http_headers(self) -> dict[str, str]:
        return {self.header: self.value}

    def grpc_headers(self) -> dict[str, str]:
        return {GRPC_PREFIX + self.header: self.value}

    def server_args(self) -> list[str]:
        """tritonserver's flags restricting ``RESTRICTED_APIS`` to this key (the key is on its command line:
        anyone who can read that process's arguments can read it; see docs/fleet.md)."""
        spec = f"{','.join(RESTRICTED_APIS)}:{self.header}={self.value}"
        return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]


def key_from(settings: Settings) -> ApiKey | None:
    return ApiKey(settings.triton_api_header, settings.triton_api_key) if settings.triton_api_key else None


_process_key: ApiKey | None = None


def current() -> ApiKey | None:
    """The key of the running command (None: no restriction configured)."""
    return _process_key


@contextmanager
def process_key(settings: Settings) -> Iterator[ApiKey | None]:
    """Make the settings' key the process's key while the block runs (the CLI wraps each command)."""
    global _process_key
    previous, _process_key = _process_key, key_from(settings)
    if _process_key is not None:
        redact.add_secret(_process_key.value)
    try:
        yield _process_key
    finally:
        _process_key = previous


def is_restricted_refusal(message: str) -> bool:
    """Triton's answer to a restricted call without the right key (HTTP and gRPC say it alike)."""
    return bool(re.search(r"This (API|protocol) is restricted", message))
