"""The append-only audit trail of an environment, kept in the store beside its pointer.

Each promotion or rollback is one immutable object::

    history/<env>/<UTC time, ns>-<uuid>.json

created with If-None-Match (``Store.put_object(if_absent=True)``, the primitive that also claims
version numbers), so an append can never overwrite an earlier record, and two appends at the same
instant get different names. Records sort by name, i.e. by time. The objects live outside ``envs/``
because the folder store keeps ``envs/`` as a compare-and-swap revision series, and history entries are
not a pointer: they are write-once documents like manifests.

A record says what moved (model, from and to version), where (store, source environment and store),
when, by whom (the CI run and commit when the usual CI variables are present, else the user and host)
and every gate's result.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from repo_manager.adapters.storage import Store
from repo_manager.core import documents
from repo_manager.core.environments import check_env_name
from repo_manager.core.errors import InputError, IntegrityError
from repo_manager.core.manifest import check_model_name, check_version, now_iso
from repo_manager.core.redact import redact_data

HISTORY_SCHEMA = "trm.history/1"
CI_VARIABLES = ("GITHUB_RUN_ID", "GITHUB_RUN_ATTEMPT", "GITHUB_SHA", "GITHUB_REF", "GITHUB_REPOSITORY",
                "GITHUB_WORKFLOW", "GITHUB_ACTOR", "CI_PIPELINE_ID", "CI_JOB_ID", "CI_COMMIT_SHA",
                "CI_PROJECT_PATH", "GITLAB_USER_LOGIN", "BUILD_ID", "BUILD_URL", "GIT_COMMIT",
                "BUILDKITE_BUILD_ID", "BUILDKITE_COMMIT", "CIRCLE_BUILD_NUM", "CIRCLE_SHA1")


def history_prefix(env: str) -> str:
    return f"history/{check_env_name(env)}/"


def pipeline_context(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Who ran this: the CI run and commit variables that are set, plus user and host."""
    environ = dict(os.environ) if environ is None else environ
    found = {key.lower(): environ[key] for key in CI_VARIABLES if environ.get(key)}
    found["user"] = environ.get("USER") or environ.get("USERNAME") or _login()
    found["host"] = socket.gethostname()
    return found


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        return f"uid {os.getuid()}"


@dataclass(frozen=True)
class HistoryRecord:
    env: str
    model: str
    action: str
    """``promote`` or ``rollback``."""
    from_version: int | None
    to_version: int
    store: str
    source_env: str | None = None
    source_store: str | None = None
    gates: tuple[dict[str, Any], ...] = ()
    pipeline: dict[str, str] = field(default_factory=dict)
    at: str = ""
    id: str = ""
    pointer_tag: str = ""
    """The store's tag of the pointer this move wrote."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gates"] = list(self.gates)
        return {"schema": HISTORY_SCHEMA, **data}

    @classmethod
    def from_json(cls, payload: bytes, origin: str) -> HistoryRecord:
        data = documents.parse(payload, origin, limit=documents.MAX_POINTER_BYTES)
        try:
            if not isinstance(data, dict) or data.pop("schema", None) != HISTORY_SCHEMA:
                raise ValueError("schema")
            gates = data.get("gates") or ()
            if not isinstance(gates, list) or not all(isinstance(g, dict) for g in gates):
                raise TypeError("gates is not a list of mappings")
            record = cls(**{**data, "gates": tuple(gates)})
            check_env_name(record.env)
            check_model_name(record.model)
            for name in ("action", "store", "at", "id", "pointer_tag"):
                if not isinstance(getattr(record, name), str):
                    raise TypeError(f"{name} is not a string")
            for name in ("source_env", "source_store"):
                if getattr(record, name) is not None and not isinstance(getattr(record, name), str):
                    raise TypeError(f"{name} is not a string")
            check_version(record.to_version)
            if record.from_version is not None:
                check_version(record.from_version)
            if not isinstance(record.pipeline, dict):
                raise TypeError("pipeline is not a mapping")
        except (ValueError, TypeError, InputError) as exc:
            raise IntegrityError(f"{origin} is not a trm history record "
                                 f"({getattr(exc, 'message', exc)!s:.200})") from exc
        return record


def append(store: Store, record: HistoryRecord) -> HistoryRecord:
    """Write ``record`` as a new object (never over an existing one); returns it with its id and time."""
    stamp = time.time_ns()
    record_id = f"{stamp:020d}-{uuid.uuid4().hex[:12]}"
    final = HistoryRecord(**{**asdict(record), "gates": record.gates, "id": record_id, "at": record.at or now_iso()})
    # a record is kept for ever and read by anyone with access to the store: no URL credentials in it
    document = redact_data(json.loads(json.dumps(final.to_dict(), default=str)))
    payload = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
    store.put_object(history_prefix(record.env) + f"{record_id}.json", payload, if_absent=True)
    return final


def read(store: Store, env: str, model: str | None = None) -> list[HistoryRecord]:
    """Every record of ``env`` (of ``model`` only, if given), oldest first."""
    prefix = history_prefix(env)
    records = []
    for name in store.list_names(prefix):
        if not name.endswith(".json"):
            continue
        payload, _ = store.get_object(prefix + name)
        record = HistoryRecord.from_json(payload, f"{store.location}/{prefix}{name}")
        if model is None or record.model == model:
            records.append(record)
    return sorted(records, key=lambda r: r.id)


def previous_version(records: list[HistoryRecord], model: str, current: int) -> int | None:
    """The version ``model`` served before ``current`` arrived: the ``from_version`` of the latest
    promotion to ``current``. Rollbacks are skipped, so rolling back twice walks further back (v3 -> v2
    -> v1), like popping a stack, instead of toggling between two versions."""
    for record in reversed(records):
        if record.model == model and record.action == "promote" and record.to_version == current:
            return record.from_version
    return None
