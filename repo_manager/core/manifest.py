"""A version's manifest: the record that makes a version complete.

One JSON file, ``trm-manifest.json``, inside the version folder (Triton ignores it). It lists every file
of the version with its size and sha256, where the version came from, the exact config it was validated
with, the verification results and, once tuned, the tuning record. A version folder without a manifest
is not a version: every reader in trm ignores it. The same document is the manifest object in a remote
store (``models/<model>/versions/<N>.json``).
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import json
import math
import platform
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from repo_manager.core import documents
from repo_manager.core.errors import ConfigError, InputError, IntegrityError
from repo_manager.core.paths import check_store_path, open_inside, walk_inside

MANIFEST_NAME = "trm-manifest.json"
SCHEMA = "trm.manifest/1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Triton model names: no path separators; trm also refuses leading dots and '..' (hidden / traversal).
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
CHUNK = 4 * 1024 * 1024


def check_model_name(name: str) -> str:
    if not isinstance(name, str) or not _MODEL_NAME.match(name) or ".." in name:
        raise InputError(f"model name {name!r} is not allowed",
                         hint="use letters, digits, '_', '-' and '.', no path separators and no '..'")
    return name


MAX_VERSION = 2 ** 63 - 1
"""Triton reads version folders as int64 (std::stoll)."""


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise InputError(f"version {version!r} is not a positive integer (at most {MAX_VERSION})")
    return version


def check_relative_path(path: object) -> str:
    """A file path inside a version folder: relative, POSIX, portable names (see ``paths.check_store_path``)."""
    check_store_path(path)
    if path == MANIFEST_NAME:
        raise IntegrityError(f"file path {path!r} is not allowed in a manifest")
    return path  # type: ignore[return-value]


# Model-folder files travel inside the manifest: label files (text, ``labels``) and the data files Triton
# reads from the model folder (``data``, base64: model_warmup inputs, sequence initial states). They are small.
MAX_LABEL_BYTES = 16 * 1024 * 1024
MAX_DATA_BYTES = 8 * 1024 * 1024
MAX_CONFIG_BYTES = 4 * 1024 * 1024
"""Longest config.pbtxt a manifest records (Triton's own example configs are a few KiB)."""
MAX_MANIFEST_BYTES = documents.MAX_DOCUMENT_BYTES
"""Largest manifest trm writes: exactly what every reader accepts (``read_manifest``, a store's reader)."""
MANIFEST_RESERVE_BYTES = 1024 * 1024
"""Room a plan keeps below ``MAX_MANIFEST_BYTES`` for what is recorded after planning (the verification,
the environment, a tuning record), so that a planned manifest still fits when it is written."""


def check_label_path(path: str) -> str:
    """A model-folder file's path (a ``label_filename``, ``warmup/<file>``): relative, and clear of what
    trm owns there (config.pbtxt, version folders, hidden and staging names)."""
    check_relative_path(path)
    first = path.split("/")[0]
    if path == "config.pbtxt" or first.isdigit() or first.startswith("."):
        raise IntegrityError(f"model-folder file path {path!r} is not allowed in a model folder")
    return path


def files_and_folders(paths: list[str]) -> list[str]:
    """The paths that are also a folder of another path (a file may not be both), sorted. Linear in the
    paths' total length: manifests can list thousands of files."""
    folders = {path[:i] for path in paths for i, char in enumerate(path) if char == "/"}
    return sorted(folders.intersection(paths))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def package_versions(*names: str) -> dict[str, str]:
    from importlib import metadata  # noqa: PLC0415 - ~20 ms of imports; only publishing needs it

    found: dict[str, str] = {"python": platform.python_version()}
    for name in ("trm", *names):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str

    def check(self) -> FileEntry:
        check_relative_path(self.path)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or \
                not 0 <= self.size <= documents.MAX_FILE_BYTES:
            raise IntegrityError(f"file {self.path!r} has an invalid size {self.size!r}")
        if not isinstance(self.sha256, str) or not _HEX64.match(self.sha256):
            raise IntegrityError(f"file {self.path!r} has an invalid sha256 {self.sha256!r}")
        return self


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    files: tuple[FileEntry, ...]
    config: str
    """config.pbtxt text the version was validated with."""
    source: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] | None = None
    members: dict[str, int] = field(default_factory=dict)
    """For ensembles: composing model -> the version it was verified with."""
    labels: dict[str, str] = field(default_factory=dict)
    """Label files (``label_filename``) Triton reads from the model folder: path there -> text."""
    data: dict[str, str] = field(default_factory=dict)
    """Data files Triton reads from the model folder (``warmup/<input_data_file>``,
    ``initial_state/<data_file>``): path there -> base64 of the bytes."""
    created_at: str = ""
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        # asdict() without its deep recursion into every FileEntry (~5 ms per 300 files, paid per write)
        data = {name: copy.deepcopy(value) if isinstance(value, dict) else value
                for name, value in self.__dict__.items()}
        data["files"] = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]
        for name in ("labels", "data"):
            if not data[name]:
                del data[name]  # manifests without model-folder files read as they always did
        return data

    @property
    def model_files(self) -> dict[str, bytes]:
        """Every file this version puts in its model folder beside config.pbtxt: path there -> bytes."""
        return {**{path: text.encode() for path, text in self.labels.items()},
                **{path: base64.b64decode(text) for path, text in self.data.items()}}

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    def writable_json(self) -> bytes:
        """``to_json()`` when trm can read it back, else InputError (exit 3) before anything is written: a
        manifest no reader accepts would break `trm list` for the whole repository. Bounded first (config,
        total size: cheap), then parsed back by the reader itself, so writer and reader cannot disagree."""
        origin = f"the manifest of {self.model} version {self.version}"
        if len(self.config.encode()) > MAX_CONFIG_BYTES:
            raise InputError(f"the config of {self.model} version {self.version} is "
                             f"{len(self.config.encode()) / 2**20:.1f} MiB, more than the {MAX_CONFIG_BYTES >> 20} "
                             "MiB a manifest records", hint="shorten config.pbtxt")
        payload = self.to_json()
        if len(payload) > MAX_MANIFEST_BYTES:
            raise InputError(f"{origin} would be {len(payload) / 2**20:.1f} MiB, more than the "
                             f"{MAX_MANIFEST_BYTES >> 20} MiB trm reads back ({len(self.files)} files; label and "
                             f"data files {len(json.dumps([self.labels, self.data])) / 2**20:.1f} MiB as JSON)",
                             hint="fewer files per version (pack them), or smaller label and warm-up files")
        try:
            Manifest.from_json(payload, origin)
        except IntegrityError as exc:
            raise InputError(f"{exc.message} (trm would not read it back)", hint=exc.hint) from exc
        return payload

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "manifest") -> Manifest:
        """Parse and check a manifest, refusing anything hostile (bad names, paths, sizes, hashes)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise IntegrityError(f"{origin} is not a trm manifest (schema {SCHEMA})")
        try:
            model = check_model_name(data["model"])
            version = check_version(data["version"])
            if not isinstance(data["files"], list) or len(data["files"]) > documents.MAX_FILES:
                raise TypeError(f"files is not a list of at most {documents.MAX_FILES} entries")
            files = tuple(FileEntry(f["path"], f["size"], f["sha256"]).check() for f in data["files"])
            config = data["config"]
            if not isinstance(config, str) or len(config) > MAX_CONFIG_BYTES:
                raise TypeError(f"config is not a text of at most {MAX_CONFIG_BYTES >> 20} MiB")
        except IntegrityError as exc:
            raise IntegrityError(f"{origin}: {exc.message}", hint=exc.hint) from exc
        except (KeyError, TypeError, InputError) as exc:
            raise IntegrityError(f"{origin} is malformed: {getattr(exc, 'message', exc)!s:.200}") from exc
        paths = [f.path for f in files]
        if len(set(paths)) != len(paths):
            raise IntegrityError(f"{origin} lists a file twice")
        both = files_and_folders(paths)
        if both:
            raise IntegrityError(f"{origin}: {both[0]!r} is both a file and a folder")
        records = {key: data.get(key) or {} for key in ("members", "source", "environment", "verification")}
        for key, value in records.items():
            if not isinstance(value, dict):
                raise IntegrityError(f"{origin} is malformed: {key} is not a mapping")
        if data.get("tuning") is not None and not isinstance(data["tuning"], dict):
            raise IntegrityError(f"{origin} is malformed: tuning is not a mapping")
        if len(records["members"]) > 1000:
            raise IntegrityError(f"{origin} names more ensemble members than any ensemble has")
        try:
            for member, member_version in records["members"].items():
                check_model_name(member)
                check_version(member_version)
        except InputError as exc:
            raise IntegrityError(f"{origin} names a bad ensemble member: {exc.message}") from exc
        labels = data.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(t, str) for t in labels.values()) \
                or sum(len(t) for t in labels.values()) > MAX_LABEL_BYTES:
            raise IntegrityError(f"{origin} is malformed: labels is not a mapping of path -> text")
        blobs = data.get("data", {})
        try:
            if not isinstance(blobs, dict) or sum(len(base64.b64decode(t, validate=True))
                                                  for t in blobs.values()) > MAX_DATA_BYTES:
                raise TypeError
        except (TypeError, ValueError, binascii.Error):  # (a non-ASCII str is a ValueError)
            raise IntegrityError(f"{origin} is malformed: data is not a mapping of path -> base64 of at most "
                                 f"{MAX_DATA_BYTES >> 20} MiB") from None
        for path in [*labels, *blobs]:
            check_label_path(path)
        kept = [*labels, *blobs]
        if len(set(kept)) != len(kept) or files_and_folders(kept):
            raise IntegrityError(f"{origin} names a model-folder file twice, or as a file and a folder")
        return cls(model=model, version=version, files=files, config=config,
                   source=records["source"], environment=records["environment"],
                   verification=records["verification"], tuning=data.get("tuning"),
                   members=dict(records["members"]), labels=dict(labels), data=dict(blobs),
                   created_at=_created_at(data.get("created_at")))

    @classmethod
    def from_json(cls, payload: bytes | str, origin: str = "manifest") -> Manifest:
        return cls.from_dict(documents.parse(payload, origin), origin)


def _created_at(value: Any) -> str:
    """A manifest's timestamp, as text (display only: anything else than a short text reads as unknown)."""
    return value if isinstance(value, str) and len(value) <= 64 else ""


def encode_data(files: dict[str, bytes]) -> dict[str, str]:
    """``Manifest.data`` for model-folder data files: path -> base64."""
    return {path: base64.b64encode(content).decode() for path, content in files.items()}


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


BYTECODE_CACHE = "__pycache__"
"""Python's bytecode cache: never content (what a Python model's stub writes next to its model.py, or the empty
file of that name that stops it: ``LocalRepository.commit``)."""


def scan_files(folder: Path, *, skip_folders: frozenset[str] = frozenset()) -> tuple[FileEntry, ...]:
    """FileEntry for every regular file under ``folder`` (in path order), except the manifest and Python's
    bytecode cache.

    Read through ``paths.walk_inside`` and ``paths.open_inside``: a symbolic link anywhere, a special file,
    a folder or file that cannot be read, and a name a manifest cannot record are refused (exit 3), so a
    version is never built from less than its folder holds, nor from anything outside it.
    """
    entries = []
    for rel in walk_inside(folder, skip_folders=skip_folders | {BYTECODE_CACHE}):
        if rel == MANIFEST_NAME:
            continue
        digest, size = sha256_inside(folder, rel)
        entries.append(FileEntry(rel, size, digest))
    return tuple(entries)


def sha256_inside(root: Path, relative: str) -> tuple[str, int]:
    """sha256 and size of ``root/relative``, read through ``paths.open_inside`` (no link on the way)."""
    digest, size = hashlib.sha256(), 0
    with open_inside(root, relative) as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def read_manifest(version_dir: Path) -> Manifest:
    path = version_dir / MANIFEST_NAME
    documents.check_size(path.stat().st_size, str(path))
    return Manifest.from_json(path.read_bytes(), str(path))


# ------------------------------------------------------------------------------------ reading the records
# A manifest's verification and tuning records are mappings written by trm's publishers and its tuner, and a
# store may hold anything there. The readers below take only what trm's views and rules use, each value
# checked for its type (numbers finite), texts bounded; anything else is an IntegrityError (exit 7) that names
# the manifest and the field. Unknown fields are left alone: newer writers may add them.

MAX_RECORD_TEXT = 500
"""Longest text taken from a record for display (a reference library's call, a tuning note)."""
MAX_RECORD_ITEMS = 1000
"""Most entries taken from a record's list or mapping (outputs, verification cases, evidence lines)."""


def _origin(manifest: Manifest) -> str:
    return f"manifest of {manifest.model}/{manifest.version}"


def _bad(manifest: Manifest, where: str, wanted: str) -> IntegrityError:
    return IntegrityError(f"{_origin(manifest)}: {where} is not {wanted}",
                          hint="trm did not write this record, or it was changed since; republish the version")


def _number(value: Any, manifest: Manifest, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or positive and not value > 0:
        raise _bad(manifest, where, "a positive finite number" if positive else "a finite number")
    return float(value)


def _integer(value: Any, manifest: Manifest, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VERSION:
        raise _bad(manifest, where, f"an integer from 0 to {MAX_VERSION}")
    return value


def _text(value: Any, manifest: Manifest, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(manifest, where, "a text")
    return value if len(value) <= MAX_RECORD_TEXT else value[:MAX_RECORD_TEXT - 3] + "..."


def _mapping(value: Any, manifest: Manifest, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_RECORD_ITEMS:
        raise _bad(manifest, where, f"a mapping of at most {MAX_RECORD_ITEMS} entries")
    return value


@dataclass(frozen=True)
class VerificationRecord:
    """What the views show of a version's verification record."""

    present: bool
    passed: bool
    skipped: str | None
    """Why verification was skipped (``--no-verify``, no GPU on this node ...); None: it was not."""
    reference: str | None
    """What the version was compared with (a library and its version), as text."""
    samples: int | None
    worst_abs_diff: tuple[tuple[str, float], ...] = ()
    """(output, worst absolute difference) per output."""
    cosines: tuple[tuple[str, float], ...] = ()
    """(case, lowest cosine similarity) per verification case."""


def _reference_text(value: Any, manifest: Manifest) -> str | None:
    """A reference is a text (``onnxruntime``) or, for Hugging Face checkpoints, a mapping with the library
    and its version (and the call that was run): shown as ``library version``."""
    if value is None or isinstance(value, str):
        return None if value is None else _text(value, manifest, "verification.reference")
    record = _mapping(value, manifest, "verification.reference")
    library = _text(record.get("library", "the reference library"), manifest, "verification.reference.library")
    version = record.get("version")
    return f"{library} {_text(version, manifest, 'verification.reference.version')}" if version else library


def read_verification(manifest: Manifest) -> VerificationRecord:
    """The verification record of ``manifest``, typed; IntegrityError for a value of the wrong type."""
    record = _mapping(manifest.verification, manifest, "verification")
    if not record:
        return VerificationRecord(False, False, None, None, None)
    passed = record.get("passed", False)
    if not isinstance(passed, bool):
        raise _bad(manifest, "verification.passed", "true or false")
    skipped = record.get("skipped")
    if skipped is not None and not isinstance(skipped, bool | str):
        raise _bad(manifest, "verification.skipped", "true, false or a reason")
    reason = record.get("reason")
    skipped_text = None
    if skipped:
        skipped_text = (_text(skipped, manifest, "verification.skipped") if isinstance(skipped, str) else
                        _text(reason, manifest, "verification.reason") if reason is not None else "--no-verify")
    samples = record.get("samples")
    worst = _mapping(record.get("worst_abs_diff"), manifest, "verification.worst_abs_diff")
    cases = record.get("cases") or []
    if not isinstance(cases, list) or len(cases) > MAX_RECORD_ITEMS:
        raise _bad(manifest, "verification.cases", f"a list of at most {MAX_RECORD_ITEMS} cases")
    cosines = []
    for i, case in enumerate(cases):
        case = _mapping(case, manifest, f"verification.cases[{i}]")
        if "min_cosine" in case:
            name = _text(case.get("case", f"case {i + 1}"), manifest, f"verification.cases[{i}].case")
            cosines.append((name, _number(case["min_cosine"], manifest, f"verification.cases[{i}].min_cosine")))
    return VerificationRecord(
        True, passed, skipped_text, _reference_text(record.get("reference"), manifest),
        None if samples is None else _integer(samples, manifest, "verification.samples"),
        tuple((_text(k, manifest, "an output name in verification.worst_abs_diff"),
               _number(v, manifest, f"verification.worst_abs_diff[{k!r}]")) for k, v in worst.items()),
        tuple(cosines))


@dataclass(frozen=True)
class TuningRecord:
    """What the views and the alert rules use of a version's tuning record."""

    p99_ms: float | None
    """The latency SLO tuned for (positive, finite)."""
    low_rps: float | None
    peak_rps: float | None
    chosen: dict[str, Any]
    """The chosen settings: max_batch_size, instances, dynamic_batching, max_queue_delay_microseconds,
    preferred_batch_size and the queue policy's default_timeout_microseconds and max_queue_size (where
    recorded); empty when nothing was chosen."""
    tuned_from_version: int | None
    evidence: tuple[tuple[str, str], ...] = ()
    """(setting, why it was chosen)."""
    ttft_p99_ms: float | None = None
    """An LLM version's time-to-first-token SLO (p99, positive, finite), where it was tuned for one."""
    itl_p99_ms: float | None = None
    """An LLM version's inter-token latency SLO (p99, positive, finite)."""

    def summary(self) -> dict[str, Any]:
        """The record's comparable part (for diffs): SLO, chosen settings, tuned-from version."""
        slo = {k: v for k, v in (("p99_ms", self.p99_ms), ("low_rps", self.low_rps),
                                 ("peak_rps", self.peak_rps), ("ttft_p99_ms", self.ttft_p99_ms),
                                 ("itl_p99_ms", self.itl_p99_ms)) if v is not None}
        return {"slo": slo, "chosen": dict(self.chosen), "tuned_from_version": self.tuned_from_version}


_CHOSEN_INTEGERS = ("max_batch_size", "instances", "max_queue_delay_microseconds")
_POLICY_INTEGERS = ("default_timeout_microseconds", "max_queue_size")


def read_tuning(manifest: Manifest) -> TuningRecord | None:
    """The tuning record of ``manifest``, typed (None: the version was not tuned); IntegrityError for a value
    of the wrong type, and for an SLO that is not a positive finite number (an alert on it could never fire,
    or always would)."""
    record = _mapping(manifest.tuning, manifest, "tuning")
    if not record:
        return None
    slo = _mapping(record.get("slo"), manifest, "tuning.slo")
    limits = {key: None if slo.get(key) is None else _number(slo[key], manifest, f"tuning.slo.{key}", positive=True)
              for key in ("p99_ms", "low_rps", "peak_rps", "ttft_p99_ms", "itl_p99_ms")}
    chosen_record = _mapping(record.get("chosen"), manifest, "tuning.chosen")
    chosen: dict[str, Any] = {}
    for key in _CHOSEN_INTEGERS:
        if chosen_record.get(key) is not None:
            chosen[key] = _integer(chosen_record[key], manifest, f"tuning.chosen.{key}")
    if "dynamic_batching" in chosen_record:
        if not isinstance(chosen_record["dynamic_batching"], bool):
            raise _bad(manifest, "tuning.chosen.dynamic_batching", "true or false")
        chosen["dynamic_batching"] = chosen_record["dynamic_batching"]
    preferred = chosen_record.get("preferred_batch_size") or []
    if not isinstance(preferred, list) or len(preferred) > MAX_RECORD_ITEMS:
        raise _bad(manifest, "tuning.chosen.preferred_batch_size", "a list of batch sizes")
    if preferred:
        chosen["preferred_batch_size"] = [_integer(p, manifest, "tuning.chosen.preferred_batch_size[]")
                                          for p in preferred]
    policy = _mapping(chosen_record.get("queue_policy"), manifest, "tuning.chosen.queue_policy")
    for key in _POLICY_INTEGERS:
        if policy.get(key):
            chosen[key] = _integer(policy[key], manifest, f"tuning.chosen.queue_policy.{key}")
    source = record.get("tuned_from_version")
    evidence = _mapping(record.get("evidence"), manifest, "tuning.evidence")
    return TuningRecord(
        limits["p99_ms"], limits["low_rps"], limits["peak_rps"], chosen,
        None if source is None else _integer(source, manifest, "tuning.tuned_from_version"),
        tuple((_text(k, manifest, "a setting in tuning.evidence"), _text(v, manifest, f"tuning.evidence[{k!r}]"))
              for k, v in evidence.items()),
        limits["ttft_p99_ms"], limits["itl_p99_ms"])


def read_config(manifest: Manifest) -> Any:
    """The config (Triton's ModelConfig) ``manifest`` was validated with; IntegrityError (exit 7) when it is
    not a valid config: it is stored data, not a file the user edits."""
    from repo_manager.core import config as cfg  # noqa: PLC0415 - protobuf only for the readers that need it

    try:
        return cfg.parse_config(manifest.config, f"the config in {_origin(manifest)}")
    except ConfigError as exc:
        raise IntegrityError(exc.message.splitlines()[0][:300], hint=exc.hint) from exc
