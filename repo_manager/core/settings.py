"""The one settings object.

Precedence, lowest to highest:

1. built-in defaults (below),
2. the YAML settings file: ``--config FILE``, else ``$TRM_CONFIG``, else ``configs/trm.yaml`` in the
   current directory when it exists,
3. environment variables ``TRM_<KEY>`` (``TRM_REPOSITORY``, ``TRM_STORE``, ``TRM_TRITONSERVER`` …),
4. command-line options.

Commands receive a ``Settings`` and never read the environment or files for settings themselves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from repo_manager.core import defaults
from repo_manager.core.errors import ConfigError, UsageError
from repo_manager.core.redact import check_no_userinfo

DEFAULT_CONFIG = Path(defaults.CONFIG_FILE)


@dataclass(frozen=True)
class Settings:
    repository: Path = Path(defaults.REPOSITORY)
    """The local Triton model repository."""
    store: str | None = None
    """Remote store: ``s3://bucket/prefix`` or a folder. None: no store."""
    s3_endpoint_url: str | None = None
    """For S3-compatible stores (MinIO, SeaweedFS). Credentials come from the standard AWS chain."""
    tritonserver: str | None = None
    """Path of the tritonserver binary; None: $PATH, then the one bundled with nvidia-pytriton."""
    triton_url: str | None = None
    """A running Triton server (HTTP, e.g. http://127.0.0.1:8000). None: trm starts an embedded one."""
    triton_api_key: str | None = field(default=None, repr=False)
    """The key of Triton's restricted APIs (model repository, shared memory, statistics, trace, logging):
    sent by trm's clients, required by the servers trm starts. Only from ``$TRM_TRITON_API_KEY`` (a
    Secret), never from a settings file; never shown. None: no restriction."""
    triton_api_header: str = "triton-api-key"
    """The header that carries it (gRPC: ``triton-grpc-protocol-`` + this name)."""
    bind_address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    server_start_timeout_s: float = 120.0
    cache_dir: Path | None = None
    """Node-local content-addressed cache for sync; None: <repository>/../.trm-cache."""
    sync_part_size: int | None = None
    """Bytes per ranged request when sync fetches a large blob (1 MiB to 1 GiB, whole MiB; None: 16 MiB):
    larger parts cut the requests on fast links (``TRM_SYNC_PART_SIZE``)."""
    environments: dict[str, Any] = field(default_factory=dict)
    """Named environments (staging, production, …) and the store each lives in."""
    gates: dict[str, Any] = field(default_factory=dict)
    """Promotion gate defaults."""
    quality: dict[str, Any] = field(default_factory=dict)
    """The quality gate's thresholds by task, over its defaults: ``{embedding: {min_mean_cosine: 0.99}}``
    (names and ranges in ``ops/publish/huggingface/quality.py``; ``--quality-threshold`` goes over these)."""
    trtllm_builder: str | None = None
    """TensorRT-LLM engine build command prefix taking trtllm-build's options (e.g. ``docker run --gpus all
    -v /models:/models nvcr.io/nvidia/tensorrt-llm/release:<tag> trtllm-build``); None: trm's default."""
    rollout: dict[str, Any] = field(default_factory=dict)
    """Rollout defaults: ``memory_budget`` (bytes or "24GiB": old + new versions above it make a server use
    the drain strategy) and ``single_copy_models`` (models never loaded twice on one server)."""
    source: str = "defaults"
    """Where the settings file came from, for `trm config`-style reporting."""

    def __post_init__(self) -> None:
        # every source (file, TRM_* variable, option) passes here: credentials only from the AWS chain
        for name in ("store", "s3_endpoint_url", "triton_url"):
            value = getattr(self, name)
            if isinstance(value, str):
                option = {"store": "STORE", "s3_endpoint_url": "--endpoint-url", "triton_url": "--url"}[name]
                check_no_userinfo(value, f"setting {name} (or {option})")
        if isinstance(self.triton_url, str) and "://" in self.triton_url:
            check_server_url(self.triton_url, "setting triton_url")
        check_api_key(self.triton_api_key, self.triton_api_header)

    def replace(self, **changes: Any) -> Settings:
        """A copy with the given fields changed; None values are ignored (an option that was not given)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        for key in ("repository", "cache_dir"):
            if key in changes:
                changes[key] = Path(changes[key])
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        shown = {f.name: (str(v) if isinstance(v, Path) else v) for f in dataclasses.fields(self)
                 for v in [getattr(self, f.name)]}
        if self.triton_api_key:
            shown["triton_api_key"] = "***"
        return shown


_API_KEY = re.compile(r"[A-Za-z0-9._~+/-]{16,512}")
_API_HEADER = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def check_api_key(key: str | None, header: str) -> None:
    """The restricted-API key and its header, in the characters Triton's flag and HTTP/gRPC headers carry
    unchanged. The message never repeats the key."""
    if not _API_HEADER.fullmatch(header):
        raise ConfigError(f"setting triton_api_header {header[:80]!r} is not a lower-case header name",
                         hint="letters a-z, digits and '-', e.g. triton-api-key")
    if key is not None and not _API_KEY.fullmatch(key):
        raise ConfigError(f"$TRM_TRITON_API_KEY ({len(key)} characters) is not a usable key: it needs 16 to 512 "
                         "letters, digits or . _ ~ + / -", hint="make one with `openssl rand -hex 32`")


def check_server_url(url: str, origin: str, *, schemes: tuple[str, ...] = ("http", "https")) -> str:
    """A server address (``http://HOST:PORT``, or ``HOST:PORT`` read as the first scheme): no credentials,
    no whitespace or control characters, a known scheme, a host, a port from 1 to 65535. Anything else is
    a one-line UsageError (exit 2) naming where it came from, before any connection is tried."""
    full = url if "://" in url else f"{schemes[0]}://{url}"
    check_no_userinfo(full, origin)
    shown = repr(url[:200])
    problem = ""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        problem = "it holds a space or a control character"
    else:
        try:
            parts = urlsplit(full)
            port = parts.port
            if parts.scheme.lower() not in schemes:
                problem = f"its scheme is not {' or '.join(schemes)}"
            elif not parts.hostname:
                problem = "it names no host"
            elif port == 0:
                problem = "port 0 is not a port to connect to"
        except ValueError as exc:
            problem = str(exc)[:100]
    if problem:
        raise UsageError(f"the URL {shown} from {origin} is malformed: {problem}",
                         hint=f"write {schemes[0]}://HOST:PORT")
    return url


_FIELDS = {f.name: f for f in dataclasses.fields(Settings) if f.name != "source"}  # source: trm's own record
_INT_FIELDS = {"http_port", "grpc_port", "metrics_port"}
_FLOAT_FIELDS = {"server_start_timeout_s"}
_SIZE_FIELDS = {"sync_part_size"}
_MIB = 1024 * 1024
_MAPPING_FIELDS = {"environments", "gates", "rollout", "quality"}


def _coerce(key: str, value: Any, origin: str) -> Any:
    """A setting's value from a file (YAML types) or a ``TRM_*`` variable (text), checked for its type and
    range: a wrong one is a one-line ConfigError naming the setting, never a crash where it is used."""

    def bad(why: str) -> ConfigError:
        shown = value if isinstance(value, (str, int, float, bool)) else type(value).__name__
        return ConfigError(f"{origin}: setting '{key}' has an invalid value {shown!r}: it {why}"[:300])

    if key in _INT_FIELDS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 8000.0
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("must be a port number")
        try:
            port = int(value)
        except ValueError:
            raise bad("must be a port number") from None
        if not 0 <= port <= 65535:
            raise bad("must be a port number from 0 (any free one) to 65535")
        return port
    if key in _SIZE_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad("must be a number of bytes")
        try:
            size = int(value)
        except ValueError:
            raise bad("must be a number of bytes") from None
        if not (_MIB <= size <= 1024 * _MIB and size % _MIB == 0):
            raise bad("must be a whole number of MiB (1048576 bytes) from 1 MiB to 1 GiB")
        return size
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad("must be a number of seconds")
        try:
            number = float(value)
        except ValueError:
            raise bad("must be a number of seconds") from None
        if not (math.isfinite(number) and number > 0):
            raise bad("must be a positive number of seconds")
        return number
    if key in _MAPPING_FIELDS:
        if isinstance(value, str):  # a TRM_* variable: JSON

            try:
                value = json.loads(value)
            except ValueError:
                raise bad("must be a mapping (in a variable: a JSON object)") from None
        if not isinstance(value, dict):
            raise bad("must be a mapping")
        if key == "environments":
            for name, entry in value.items():  # (an entry without a value: the default store)
                store = entry.get("store") if isinstance(entry, dict) else entry
                if not isinstance(entry, (dict, str, type(None))) or (store is not None and not isinstance(store, str)):
                    raise ConfigError(f"{origin}: environments.{name} must be a store location or a mapping "
                                      "with a 'store' location"[:300])
                if store:
                    check_no_userinfo(store, f"{origin} (environments.{name}.store)")
        return value
    if not isinstance(value, str):  # every other setting is text: a path, a URL, a command, an address
        raise bad("must be text")
    if key in ("repository", "cache_dir"):
        return Path(value)
    return value


def load_settings(config_file: str | Path | None = None, env: dict[str, str] | None = None) -> Settings:
    """Build the settings from defaults, the YAML file and ``TRM_*`` environment variables."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    config_variable = defaults.env_variable("config")
    path = Path(config_file) if config_file else (Path(env[config_variable]) if env.get(config_variable) else None)
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    source = "defaults"
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"settings file {path} does not exist", hint="pass an existing file to --config")
        import yaml  # noqa: PLC0415 - only with a settings file: `trm --help` reads none

        try:
            data = yaml.safe_load(path.read_text()) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"settings file {path} is not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"settings file {path} is not valid YAML: {exc}".splitlines()[0]) from exc
        if not isinstance(data, dict):
            raise ConfigError(f"settings file {path} must hold a mapping of settings")
        if data.get("triton_api_key") is not None:
            raise ConfigError(f"settings file {path} holds triton_api_key: a secret does not belong in a settings "
                              "file", hint="remove it and set $TRM_TRITON_API_KEY (on Kubernetes: from a Secret)")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"settings file {path}: unknown setting(s) {', '.join(unknown)}",
                              hint=f"known settings: {', '.join(sorted(_FIELDS))}")
        base = path.parent.parent if path.parent.name == "configs" else path.parent
        for key, value in data.items():
            if value is None:
                continue
            value = _coerce(key, value, str(path))
            if key in ("repository", "cache_dir") and not value.is_absolute():
                value = base / value
            values[key] = value
        source = str(path)
    for key in _FIELDS:
        env_value = env.get(defaults.env_variable(key))
        if env_value:
            values[key] = _coerce(key, env_value, f"${defaults.env_variable(key)}")
    values["source"] = source
    return Settings(**values)
