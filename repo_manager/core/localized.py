"""Version files that name the folder they are installed in: a vLLM version's ``model.json``.

The official vLLM backend passes model.json's ``model`` to vLLM as it is, and vLLM does not resolve a
relative path against the version folder (vllm_backend #7587), so the file must name the absolute folder
the server sees, which differs in every repository root a version is installed in. The manifest and the
store therefore hold it in its *stored form*, ``model`` set to ``PLACEHOLDER``, and record the size and
sha256 of that form; whatever installs a version (publish, sync and so the agent and `trm rollout
--from`, export into a folder, a renumbered local version, a verification candidate) writes the
localized bytes, a file of its own and never a hard link to a blob.

Everything that checks a version's files against its manifest reads such a file through
``recorded_bytes``, byte for byte except ``model``: other keys changed, reordered or reformatted do not
match. A version recorded before this form existed (``model`` hashed as its publisher wrote it) still
matches where its bytes are unchanged; it is installed unchanged, and `trm validate` reports that its
model.json names another folder than its own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repo_manager.core import paths
from repo_manager.core.errors import IntegrityError
from repo_manager.core.manifest import FileEntry, scan_files, sha256_inside

if TYPE_CHECKING:
    from repo_manager.core import config as cfg

ENGINE_ARGS_FILE = "model.json"
PLACEHOLDER = "<version folder>"
"""What ``model`` holds in the stored form: not a path, so a model.json read from the store as it is
fails to load instead of loading some other folder."""
MAX_BYTES = 1 << 20
"""Longest model.json read as JSON (trm writes a few hundred bytes); a longer one is compared as it is."""


def localized_paths(config_text: str) -> frozenset[str]:
    """The files of a version validated with ``config_text`` that are stored in their stored form."""
    if "vllm" not in config_text:  # the cheap test first: most configs are never parsed here
        return frozenset()
    from repo_manager.core import config as cfg  # noqa: PLC0415 - the config parser only for a vLLM config
    from repo_manager.core.errors import InputError  # noqa: PLC0415 - only for a vLLM config

    try:
        backend = cfg.parse_config(config_text).backend
    except InputError:
        return frozenset()  # a config that does not parse is reported by whoever reads it as a config
    return frozenset({ENGINE_ARGS_FILE}) if backend == "vllm" else frozenset()


def engine_args_bytes(args: dict[str, Any]) -> bytes:
    """model.json as trm writes it (the only serialization ``stored_form`` accepts)."""
    return (json.dumps(args, indent=2) + "\n").encode()


def _parsed(data: bytes) -> dict[str, Any] | None:
    if len(data) > MAX_BYTES:
        return None
    try:
        args = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(args, dict) or not isinstance(args.get("model"), str) or engine_args_bytes(args) != data:
        return None  # not what trm writes: compared (and installed) byte for byte
    return args


def stored_form(data: bytes) -> bytes:
    """``data`` with ``model`` set to ``PLACEHOLDER``; bytes trm did not write that way, unchanged."""
    args = _parsed(data)
    return data if args is None else engine_args_bytes({**args, "model": PLACEHOLDER})


def installed_form(stored: bytes, version_dir: Path) -> bytes:
    """The stored form with ``model`` naming ``version_dir`` (absolute, as the server sees it); anything
    else (a file recorded before the stored form existed) unchanged."""
    args = _parsed(stored)
    if args is None or args["model"] != PLACEHOLDER:
        return stored
    return engine_args_bytes({**args, "model": str(Path(version_dir).resolve())})


def model_path(data: bytes) -> str | None:
    """The folder an installed model.json names (None: not a model.json trm reads)."""
    args = _parsed(data)
    return None if args is None else args["model"]


def _matches(data: bytes, entry: FileEntry) -> bool:
    return len(data) == entry.size and hashlib.sha256(data).hexdigest() == entry.sha256


def _recorded(data: bytes, entry: FileEntry) -> bytes:
    return data if _matches(data, entry) else stored_form(data)


def recorded_bytes(folder: Path, entry: FileEntry) -> bytes:
    """``folder``/``entry.path`` in the form the manifest records: the bytes as they are when they match
    (a version recorded before the stored form, or one installed unlocalized), else their stored form.
    Whether they match ``entry`` is the caller's check."""
    return _recorded(paths.read_inside(folder, entry.path, max(MAX_BYTES, entry.size)), entry)


def recorded_entries(folder: Path, config_text: str) -> tuple[FileEntry, ...]:
    """The manifest entries of a version folder being written with ``config_text``: localized files
    recorded in their stored form."""
    localized = localized_paths(config_text)
    entries = scan_files(folder)
    if not localized:
        return entries
    recorded = []
    for entry in entries:
        if entry.path in localized:
            data = stored_form(paths.read_inside(folder, entry.path, max(MAX_BYTES, entry.size)))
            entry = FileEntry(entry.path, len(data), hashlib.sha256(data).hexdigest())
        recorded.append(entry)
    return tuple(recorded)


def entry_digest(config_text: str, folder: Path, entry: FileEntry) -> tuple[str, int]:
    """(sha256, size) of ``folder``/``entry.path`` as a manifest validated with ``config_text`` records it:
    the one comparison of an installed file with its manifest entry."""
    if entry.path not in localized_paths(config_text):
        return sha256_inside(folder, entry.path)
    data = recorded_bytes(folder, entry)
    return hashlib.sha256(data).hexdigest(), len(data)


def checked_stored_bytes(folder: Path, entry: FileEntry) -> bytes:
    """What goes into a store for a localized file: its recorded form, IntegrityError unless it matches."""
    data = recorded_bytes(folder, entry)
    if not _matches(data, entry):
        raise IntegrityError(f"{folder / entry.path} no longer matches its manifest (sha256 {entry.sha256}, "
                             f"model aside)", hint="`trm validate` lists what differs from the manifest",
                             path=str(folder / entry.path))
    return data


def is_installed(folder: Path, entry: FileEntry) -> bool:
    """True when ``folder``/``entry.path`` matches ``entry`` and is what installing it into ``folder`` writes:
    a model.json in its stored form, or naming another folder, is not installed there."""
    try:
        data = paths.read_inside(folder, entry.path, max(MAX_BYTES, entry.size))
    except (OSError, paths.SourceReadError):
        return False
    recorded = _recorded(data, entry)
    return _matches(recorded, entry) and installed_form(recorded, folder) == data


def can_localize(folder: Path, entry: FileEntry) -> bool:
    """True when ``folder``/``entry.path`` matches ``entry`` in the stored form (so it can be installed
    anywhere), False for a file recorded naming one folder (before the stored form existed) or changed."""
    try:
        recorded = recorded_bytes(folder, entry)
    except (OSError, paths.SourceReadError):
        return False
    return _matches(recorded, entry) and model_path(recorded) == PLACEHOLDER


def install_file(path: Path, version_dir: Path, stored: bytes | None = None) -> None:
    """Replace ``path`` (a placed, checked blob in its stored form, or ``stored`` when given) by the bytes
    installed in ``version_dir``, as a new file: the blob it may be a hard link to is never written."""
    if path.stat().st_size > MAX_BYTES:
        return  # not a model.json trm writes: installed as recorded
    current = path.read_bytes()
    wanted = installed_form(current if stored is None else stored, version_dir)
    if wanted != current:
        paths.replace_file(path, (wanted,))


def localize_gpt_model_path(config: cfg.ModelConfig, version_dir: str | Path) -> cfg.ModelConfig:
    """A copy of a tensorrt_llm config whose gpt_model_path is ``version_dir`` (absolute).

    The backend needs an absolute engine path. ``trm publish`` writes the path of the version in the
    repository it publishes to; whoever installs the version elsewhere (sync to another root, a load with
    a config override) calls this with the installed version folder.
    """
    from repo_manager.core import config as cfg  # noqa: PLC0415 - the config parser only where a path is localized

    localized = cfg.ModelConfig()
    localized.CopyFrom(config)
    if config.backend == "tensorrtllm":
        localized.parameters["gpt_model_path"].string_value = str(Path(version_dir).resolve())
    return localized
