"""What one agent loaded, kept on disk beside its repository so that a restarted agent knows it.

``<repo>/.trm-agent.json`` (a dot name: trm and Triton ignore it as a model)::

    {"schema": "trm.agent-record/1", "agent_id": "3f2a9c1b", "env": "production",
     "good": {"m": 4}, "loaded": ["m", "pre", "post"]}

* ``agent_id``: a random id drawn the first time, so that two agents with the same pod name (two pods
  sharing a host name) hold distinct drain slots and write distinct reports; a restarted agent keeps it;
* ``good``: the last good set, the versions this server served and answered with when the agent last
  converged or refused a change: readiness is judged on it (``state.is_ready``);
* ``loaded``: every model the agent loaded or took over for the environment (ensemble members included):
  when the environment drops one, the agent unloads it, also after a restart. Models loaded by anyone
  else are never in it, so they are left alone.

Written atomically (``paths.replace_file``) whenever it changes; read totally: anything unreadable or
malformed is ignored with a note (a fresh record), never a crash.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from repo_manager.core.paths import replace_file

RECORD_NAME = ".trm-agent.json"
SCHEMA = "trm.agent-record/1"
MAX_BYTES = 1 << 20
_ID = re.compile(r"[0-9a-f]{8,32}")


@dataclass(frozen=True)
class AgentRecord:
    agent_id: str
    good: Mapping[str, int] = field(default_factory=dict)
    loaded: frozenset[str] = frozenset()

    def to_json(self, env: str) -> bytes:
        return (json.dumps({"schema": SCHEMA, "agent_id": self.agent_id, "env": env, "good": dict(self.good),
                            "loaded": sorted(self.loaded)}, indent=1, sort_keys=True) + "\n").encode()


def fresh() -> AgentRecord:
    return AgentRecord(secrets.token_hex(4))


def read_record(path: Path) -> tuple[AgentRecord, str | None]:
    """The record at ``path`` and a note when it could not be used (then a fresh record)."""
    try:
        with open(path, "rb") as handle:
            payload = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return fresh(), None
    except OSError as exc:
        return fresh(), f"could not read {path} ({exc.strerror or exc}); starting a new record"
    try:
        return _parse(payload), None
    except ValueError as exc:
        return fresh(), f"ignored {path}: {exc}; starting a new record"


def _parse(payload: bytes) -> AgentRecord:
    if len(payload) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError("not JSON") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} document")
    agent_id, good, loaded = data.get("agent_id"), data.get("good"), data.get("loaded")
    if not isinstance(agent_id, str) or not _ID.fullmatch(agent_id):
        raise ValueError("agent_id is not 8 to 32 hexadecimal digits")
    if not isinstance(good, dict) or not all(
            isinstance(m, str) and type(v) is int and 0 < v < 2**63 for m, v in good.items()):
        raise ValueError("good is not a map of model names to versions")
    if not isinstance(loaded, list) or not all(isinstance(m, str) for m in loaded):
        raise ValueError("loaded is not a list of model names")
    return AgentRecord(agent_id, dict(good), frozenset(loaded))


def write_record(path: Path, record: AgentRecord, env: str) -> None:
    replace_file(path, [record.to_json(env)])
