"""What the load generator sends, and the asynchronous Triton clients it sends it with.

A ``Workload`` is a few prepared requests (cycled round robin): the ``InferInput`` objects are built
once per protocol, so the sending loop spends its CPU on sending, not on serializing numpy arrays.

Why asyncio (tritonclient's ``aio`` clients) and not a thread pool: on the 2-core machine trm is built
on, one event loop kept a Poisson schedule to about 1,000 requests/s over both HTTP and gRPC with a
99th-percentile send lag near 1 ms, and a response that takes long costs nothing but a pending task.
A thread pool needs one thread per request in flight, and the GIL hand-offs between them delay sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as http_aio

from repo_manager.adapters.loadgen.inputs import generate_inputs
from repo_manager.adapters.triton.client import build_inputs, normalize_url
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, UsageError

PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class Workload:
    """The requests to send: one or more input dicts, sent in turn."""

    samples: tuple[dict[str, np.ndarray], ...]
    outputs: tuple[str, ...] = ()
    """Output names to request (binary); empty: whatever the server returns."""

    @classmethod
    def from_config(cls, config: cfg.ModelConfig, *, batch_size: int = 1, variants: int = 8) -> Workload:
        """Random requests that respect ``config`` (``repo_manager.adapters.loadgen.inputs.generate_inputs``)."""
        samples = tuple(generate_inputs(config, batch_size=batch_size, seed=i) for i in range(variants))
        return cls(samples, tuple(o.name for o in config.output))

    @classmethod
    def from_file(cls, path: str | Path, config: cfg.ModelConfig | None = None) -> Workload:
        """One request from a ``.npz`` file whose array names are the model's input names."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"sample file {path} does not exist")
        try:
            with np.load(path, allow_pickle=False) as data:
                sample = {name: data[name] for name in data.files}
        except (ValueError, OSError) as exc:
            raise InputError(f"sample file {path} is not a .npz archive of input arrays: {exc}") from exc
        if config is not None:
            missing = sorted({t.name for t in config.input} - set(sample))
            if missing:
                raise InputError(f"sample file {path} lacks input(s) {', '.join(missing)}",
                                 hint="save one array per model input: np.savez(path, NAME=array, ...)")
        outputs = tuple(o.name for o in config.output) if config is not None else ()
        return cls((sample,), outputs)


class AsyncTriton:
    """One asynchronous client (HTTP or gRPC) with the workload prepared for its protocol.

    ``infer`` returns ``(model_version, outputs)`` and raises whatever the transport raises; the
    callers turn exceptions into per-request error records, not into a failed measurement.
    """

    def __init__(self, protocol: str, url: str, model: str, workload: Workload, *, version: int | None = None,
                 max_connections: int = 256, timeout_s: float = 30.0, keep_outputs: bool = False) -> None:
        if protocol not in PROTOCOLS:
            raise UsageError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        self.protocol = protocol
        self.model = model
        self.version = str(version) if version else ""
        self.keep_outputs = keep_outputs
        self.timeout_s = timeout_s
        module: Any = httpclient if protocol == "http" else grpcclient
        if protocol == "http":
            self._client: Any = http_aio.InferenceServerClient(normalize_url(url), conn_limit=max_connections,
                                                               conn_timeout=timeout_s)
            self._outputs = [module.InferRequestedOutput(o, binary_data=True) for o in workload.outputs] or None
        else:
            self._client = grpc_aio.InferenceServerClient(normalize_url(url))
            self._outputs = [module.InferRequestedOutput(o) for o in workload.outputs] or None
        self._requests = [build_inputs(sample, module) for sample in workload.samples]
        self._next = 0

    async def infer(self) -> tuple[int | None, dict[str, np.ndarray] | None]:
        request = self._requests[self._next % len(self._requests)]
        self._next += 1
        if self.protocol == "http":
            result = await self._client.infer(self.model, request, model_version=self.version,
                                              outputs=self._outputs)
            response = result.get_response()
            version = response.get("model_version")
            names = [o["name"] for o in response.get("outputs", [])]
        else:
            result = await self._client.infer(self.model, request, model_version=self.version,
                                              outputs=self._outputs, client_timeout=self.timeout_s)
            response = result.get_response()
            version = response.model_version
            names = [o.name for o in response.outputs]
        outputs = {name: result.as_numpy(name) for name in names} if self.keep_outputs else None
        return (int(version) if version else None), outputs

    async def close(self) -> None:
        await self._client.close()


REJECTION_MARKERS = ("Request timeout expired", "Exceeds maximum queue size")
"""What Triton 2.x answers when its dynamic batcher's queue policy sheds a request: the queue timeout
(``default_queue_policy { timeout_action: REJECT ... }``) or a full queue (``max_queue_size``)."""


def is_rejection(exc: BaseException) -> bool:
    """True when Triton refused the request by its queue policy (load shedding), not because it failed."""
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    return any(marker in str(message) for marker in REJECTION_MARKERS)


def error_text(exc: BaseException) -> str:
    """One line that names the failure (Triton's message, or the exception type and text)."""
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    return " ".join(f"{type(exc).__name__}: {message}".split())[:300]
