"""The one Triton client wrapper (HTTP/REST, KServe v2 protocol plus Triton's repository extension).

Every call to a Triton server in trm goes through ``TritonClient``, which turns transport failures and
server refusals into ``ServerError`` / ``ModelLoadError`` with the server URL in the message. The calls of
Triton's restricted groups (repository index, load, unload, statistics) carry the restricted-API key
(``restricted.ApiKey``: the one given, else the command's); health, metadata, config and inference never do.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from repo_manager.adapters.triton import restricted
from repo_manager.adapters.triton.restricted import ApiKey
from repo_manager.core import config as cfg
from repo_manager.core.errors import ModelLoadError, NotFoundError, ServerError


def normalize_url(url: str) -> str:
    """``http://host:port`` -> ``host:port`` (what tritonclient.http expects)."""
    for prefix in ("http://", "https://"):
        if url.startswith(prefix):
            url = url[len(prefix):]
    return url.rstrip("/")


# What a broken connection raises: OSError and its kin, and http.client's exceptions (geventhttpclient's
# HTTPConnectionClosed when the server closes a keep-alive connection under a request) — a server problem
# (exit 6), never an internal error.
_TRANSPORT_ERRORS = (ConnectionError, OSError, http.client.HTTPException)

LOAD_TIMEOUT_S = 1800.0
"""How long a load may take before the client gives up on it. Triton answers a load when the model is ready
or failed: a vLLM engine takes minutes to start on CPU, and on a busy node even a small ONNX model's Python
stub has taken over a minute (a verification load that the 60 s call timeout cut short was reported as an
unreachable server). Every other call keeps the client's ``timeout_s``."""


class TritonClient:
    """``grpc_url`` (``host:port``), when given, carries model control (load, unload): Triton's HTTP
    frontend runs a load on one of its worker threads until the load completes, stalling the HTTP
    requests whose connections that thread serves (measured on 2.51: some clients wait the whole load,
    1.5-2 s for a small Python model); its gRPC frontend handles model control apart from inference."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, concurrency: int = 1,
                 grpc_url: str | None = None, api_key: ApiKey | None = None,
                 load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.url = url if url.startswith("http") else f"http://{url}"
        self.api_key = api_key or restricted.current()
        self.timeout_s, self.load_timeout_s = timeout_s, max(load_timeout_s, timeout_s)
        self._client = httpclient.InferenceServerClient(
            normalize_url(url), connection_timeout=timeout_s, network_timeout=timeout_s,
            concurrency=concurrency)
        self.grpc_url = grpc_url.removeprefix("grpc://") if grpc_url else None
        self._grpc: Any = None

    def close(self) -> None:
        self._client.close()
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def _restricted_headers(self, grpc: bool = False) -> dict[str, str] | None:
        if self.api_key is None:
            return None
        return self.api_key.grpc_headers() if grpc else self.api_key.http_headers()

    def _control_headers(self) -> dict[str, str] | None:
        return self._restricted_headers(grpc=self.grpc_url is not None)

    def _control(self) -> Any:
        """The client that loads and unloads: gRPC when its address is known, else HTTP."""
        if self.grpc_url is None:
            return self._client
        if self._grpc is None:
            import tritonclient.grpc as grpcclient  # noqa: PLC0415 - only when a gRPC address is given

            self._grpc = grpcclient.InferenceServerClient(self.grpc_url)
        return self._grpc

    def __enter__(self) -> TritonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- helpers
    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InferenceServerException as exc:
            self._raise_if_restricted(what, exc)
            raise ServerError(f"Triton at {self.url} refused {what}: {exc.message()}", url=self.url) from exc
        except _TRANSPORT_ERRORS as exc:
            raise ServerError(f"Triton at {self.url} is not reachable ({what}): {exc}",
                              hint="start one with `trm serve`, or pass --url of a running server",
                              url=self.url) from exc

    def _raise_if_restricted(self, what: str, exc: InferenceServerException) -> None:
        """A call refused for want of the restricted-API key: the setting, not the server or the model."""
        if not restricted.is_restricted_refusal(exc.message() or str(exc)):
            return
        given = "the key trm sent is not the server's" if self.api_key else "trm sent no key"
        raise ServerError(f"Triton at {self.url} refused {what}: that API is restricted and {given}",
                          hint="set $TRM_TRITON_API_KEY (and triton_api_header) to the key the server was "
                               "started with", url=self.url) from exc

    # ------------------------------------------------------------------------------------ health
    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready())
        except Exception:  # noqa: BLE001 - any failure means "not ready yet"
            return False

    def require_ready(self) -> None:
        if not self.is_ready():
            raise ServerError(f"Triton at {self.url} is not reachable or not ready",
                              hint="start one with `trm serve`, or pass --url of a running server",
                              url=self.url)

    def server_metadata(self) -> dict[str, Any]:
        return self._call("server metadata", self._client.get_server_metadata)

    def is_model_ready(self, name: str, version: int | None = None) -> bool:
        try:
            return bool(self._client.is_model_ready(name, str(version) if version else ""))
        except InferenceServerException:
            return False
        except _TRANSPORT_ERRORS as exc:
            raise ServerError(f"Triton at {self.url} is not reachable: {exc}", url=self.url) from exc

    # -------------------------------------------------------------------------------- repository
    def repository_index(self) -> list[dict[str, Any]]:
        return self._call("the repository index", self._client.get_model_repository_index,
                          headers=self._restricted_headers())

    def loaded_versions(self, name: str) -> list[int]:
        """Versions of ``name`` that are READY on the server."""
        return sorted(int(entry["version"]) for entry in self.repository_index()
                      if entry.get("name") == name and entry.get("state") == "READY" and entry.get("version"))

    def wait_unloaded(self, going: Callable[[dict[str, Any]], bool], timeout_s: float,
                      poll_s: float = 0.2) -> list[dict[str, Any]]:
        """Poll the repository index until no entry for which ``going`` holds is READY or UNLOADING (Triton
        unloads a version once every request of it is released), for at most ``timeout_s``. The entries
        still there: empty when all are gone. A server that does not answer is ``ServerError``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = [e for e in self.repository_index() if going(e) and e.get("state") in ("READY", "UNLOADING")]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(poll_s)

    def load(self, name: str, config: cfg.ModelConfig | None = None,
             files: Mapping[str, bytes] | None = None) -> None:
        """Load (or reload) ``name``, optionally with a config override and file overrides.

        ``files`` maps paths inside the model folder (``"1/model.onnx"``) to their bytes.
        """
        config_json = cfg.config_to_json(config) if config is not None else None
        overrides = {f"file:{path}": data for path, data in (files or {}).items()} or None
        control = self._control()
        deadline: dict[str, Any] = {"client_timeout": self.load_timeout_s} if control is self._grpc else {}
        if control is self._client:  # an HTTP load answers when the load is done: its reads wait that long
            control = httpclient.InferenceServerClient(normalize_url(self.url), connection_timeout=self.timeout_s,
                                                       network_timeout=self.load_timeout_s)
        try:
            control.load_model(name, headers=self._control_headers(), config=config_json, files=overrides, **deadline)
        except InferenceServerException as exc:
            self._raise_if_restricted(f"the load of {name}", exc)
            if str(exc.status() or "") == "StatusCode.DEADLINE_EXCEEDED":
                raise self._load_timed_out(name) from exc
            if _unreachable(exc):
                raise ServerError(f"Triton at {self.url} is not reachable (load {name}): {_first_line(exc)}",
                                  url=self.url) from exc
            raise ModelLoadError(f"Triton at {self.url} failed to load {name}: {_first_line(exc)}",
                                 model=name, url=self.url) from exc
        except TimeoutError as exc:
            raise self._load_timed_out(name) from exc
        except _TRANSPORT_ERRORS as exc:
            raise ServerError(f"Triton at {self.url} is not reachable (load {name}): {exc}",
                              url=self.url) from exc
        finally:
            if control is not self._client and control is not self._grpc:
                control.close()  # one connection per HTTP load, closed: an idle keep-alive one is not kept

    def _load_timed_out(self, name: str) -> ServerError:
        return ServerError(f"Triton at {self.url} did not finish the load of {name} within "
                           f"{self.load_timeout_s:.0f} s", url=self.url, model=name,
                           hint="the server may still be loading it: its log says what the model is doing")

    def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        self._call(f"unload of {name}", self._control().unload_model, name, headers=self._control_headers(),
                   unload_dependents=unload_dependents)

    def model_config(self, name: str, version: int | None = None) -> cfg.ModelConfig:
        try:
            data = self._client.get_model_config(name, str(version) if version else "")
        except InferenceServerException as exc:
            raise NotFoundError(f"model {name} is not loaded on {self.url}: {exc.message()}",
                                model=name, url=self.url) from exc
        except _TRANSPORT_ERRORS as exc:
            raise ServerError(f"Triton at {self.url} is not reachable: {exc}", url=self.url) from exc
        return cfg.config_from_json(data)

    def statistics(self, name: str = "", version: int | None = None) -> list[dict[str, Any]]:
        data = self._call("statistics", self._client.get_inference_statistics, name,
                          str(version) if version else "", headers=self._restricted_headers())
        return list(data.get("model_stats", []))

    # ------------------------------------------------------------------------------------ infer
    def infer(self, name: str, inputs: Mapping[str, np.ndarray], *, version: int | None = None,
              outputs: list[str] | None = None, classes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """``classes``: output -> K, answered through Triton's classification extension (the top K as
        "score:index:label" strings); the other ``outputs`` as tensors. Default: every output, as tensors."""
        wanted = list(outputs or []) + [o for o in (classes or {}) if o not in (outputs or [])]
        requested = [httpclient.InferRequestedOutput(o, binary_data=True, class_count=(classes or {}).get(o, 0))
                     for o in wanted] or None
        request = build_inputs(inputs)
        try:
            result = self._client.infer(name, request, model_version=str(version) if version else "",
                                        outputs=requested)
        except InferenceServerException as exc:
            raise ServerError(f"inference on {name} at {self.url} failed: {_first_line(exc)}",
                              model=name, url=self.url) from exc
        except _TRANSPORT_ERRORS as exc:
            raise ServerError(f"Triton at {self.url} is not reachable (infer {name}): {exc}",
                              url=self.url) from exc
        try:
            response = result.get_response()
            return {out["name"]: result.as_numpy(out["name"]) for out in response.get("outputs", [])}
        except (ValueError, TypeError, KeyError) as exc:  # an answer whose tensors do not parse
            raise ServerError(f"inference on {name} at {self.url} returned a malformed answer: {exc}",
                              model=name, url=self.url) from exc


def build_inputs(inputs: Mapping[str, np.ndarray], module: Any = httpclient) -> list[Any]:
    """``InferInput`` objects of ``module`` (``tritonclient.http`` or ``tritonclient.grpc``), binary data."""
    request = []
    for name, array in inputs.items():
        array = np.asarray(array)
        dtype = "BYTES" if array.dtype.kind in ("O", "S", "U") else np_to_triton_dtype(array.dtype)
        if array.dtype.kind == "U":
            array = np.char.encode(array, "utf-8").astype(np.object_)
        tensor = module.InferInput(name, list(array.shape), dtype)
        if module is httpclient:
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        request.append(tensor)
    return request


def _unreachable(exc: InferenceServerException) -> bool:
    """A gRPC transport failure (the server is gone), as opposed to the server refusing the call."""
    return str(exc.status() or "") in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def _first_line(exc: InferenceServerException) -> str:
    message = exc.message() or str(exc)
    try:  # Triton sometimes wraps JSON in the message
        message = json.loads(message).get("error", message)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(message).split())[:500]
