"""The no-op path: an unchanged environment costs one conditional read and local stats.

After every successful ``trm sync --env`` the node cache records what that repository now serves
(``<cache>/state/<store-id>/<key>.json``: the pointer's tag, and per model the version, the sha256 of
its ``trm-manifest.json`` and ``config.pbtxt``, and each file's size). The next sync of the same
environment into the same repository first asks the store for the pointer with ``If-None-Match: <tag>``:

* 304 (unchanged) and the repository still holds exactly that (regular files of the recorded sizes, the
  same manifest and config bytes, nothing a symlink): done, nothing else read, nothing written;
* anything else (a new tag, a missing or unreadable record, a file changed or gone, any doubt at all):
  the full planner runs as before, so this path can only skip work, never change an outcome.

The checks are the planner's own for a version it finds ``present`` (size per file, the manifest it was
installed with, the config it serves), so both paths agree on what "unchanged" means.

What it trusts: the record lives in the node cache, which every pod of the node can write, so it is
believed only to skip work. It installs nothing and reads nothing from the cache into the repository;
the repository must still hold exactly what the record says, byte for byte in its manifests and
configs, and those were written by a full sync from manifests it read from the store. A forged record
can at most make this node keep what it already serves until the environment's pointer moves again; a
repository new at every pod start (the Kubernetes layout) always plans in full, and the agent never
comes here. File contents are trusted by size, as the planner does for a present version.

``quick`` is the same check before anything else of trm is imported (`repo_manager/entry.py` calls it for
a plain ``trm sync s3://… --env E``): keys from the environment, one GET signed by ``storage.sigv4`` on a
socket of its own, and the record says which object the pointer is. It answers the result as a dict
(``result_data``: the fields and form of ``try_unchanged``'s ``SyncResult``), or None for the full CLI to
take over. This module and what it imports are light on purpose (no typing, dataclasses, click, protobuf,
urllib3, botocore, rich, not even http.client): it is what an init container runs on every pod start, and
what the user measures against ``s5cmd sync``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time

from repo_manager.ops.sync.result_data import as_dict, unchanged

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (see the module docstring)
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from repo_manager.adapters.storage import Store
    from repo_manager.ops.sync.plan import SyncPlan
    from repo_manager.ops.sync.result import SyncResult

STATE_SCHEMA = "trm.sync-state/4"
"""/2 names the pointer's key, /3 the model-folder files, /4 was recorded by a sync that read every manifest
from the store (earlier ones believed manifests kept in the shared cache): an older record means one full
sync, which also replaces a forged manifest such a sync may have installed."""
MANIFEST_NAME = "trm-manifest.json"  # repository.MANIFEST_NAME, without importing the repository module
CONFIG_NAME = "config.pbtxt"


def store_id(store: Store) -> str:
    """Names a store in the node cache (records of different stores never mix)."""
    return _store_id(store.location, getattr(store, "endpoint_url", None))


def _store_id(location: str, endpoint_url: str | None) -> str:
    return hashlib.sha256(f"{endpoint_url or ''}|{location}".encode()).hexdigest()[:16]


def absolute(path: str | Path) -> str:
    """``str(Path(path).absolute())`` without importing pathlib where the two agree (no ``..`` in it:
    ``a/../b`` is not ``b`` when ``a`` is a symbolic link, and pathlib keeps it; so does this)."""
    text = os.fspath(path)
    if ".." in text.split("/"):
        from pathlib import Path  # noqa: PLC0415 - off the quick sync path

        return str(Path(text).absolute())
    return os.path.normpath(os.path.join(os.getcwd(), text))


def state_path(cache: str | Path, sid: str, env: str, repository: str | Path, selection: tuple[str, ...]) -> str:
    key = json.dumps([absolute(repository), env, sorted(selection)])
    return os.path.join(cache, "state", sid, f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json")


def _sha256(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def record(plan: SyncPlan, store: Store) -> None:
    """Record what the repository serves after ``plan`` was carried out (best effort: a record that
    cannot be written only means the next sync plans in full)."""
    if plan.env is None or plan.pointer_etag is None:
        return
    from pathlib import Path  # noqa: PLC0415 - off the quick sync path

    from repo_manager.adapters.storage import env_key  # noqa: PLC0415 - off the quick sync path
    from repo_manager.core import paths  # noqa: PLC0415 - the planner imported them already
    from repo_manager.core.errors import InputError  # noqa: PLC0415 - off the quick sync path
    from repo_manager.core.localized import localized_paths  # noqa: PLC0415 - off the quick sync path

    repo = Path(plan.repository)
    models: dict[str, Any] = {}
    try:
        for action in plan.models:
            folder = repo / action.model / str(action.version)
            localized = localized_paths(action.manifest.config)  # a vLLM model.json: installed size, not recorded
            files = [[f.path, os.lstat(folder / f.path).st_size if f.path in localized else f.size]
                     for f in action.manifest.files]
            models[action.model] = {
                "version": action.version,
                "manifest_sha256": _sha256(folder / MANIFEST_NAME),
                "config_sha256": _sha256(repo / action.model / CONFIG_NAME),
                "files": files,
                "model_files": {path: hashlib.sha256(content).hexdigest()  # label and warm-up files
                                for path, content in action.manifest.model_files.items()}}
        path = Path(state_path(plan.cache, store_id(store), plan.env, repo, plan.selection))
        paths.make_dirs(Path(plan.cache), path.parent)  # never through a link planted in the cache
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps({"schema": STATE_SCHEMA, "etag": plan.pointer_etag, "env": plan.env,
                                     "pointer": env_key(plan.env), "models": models}))
        os.replace(tmp, path)
    except (OSError, InputError):
        return


def _serves(repo: str | Path, models: dict[str, Any]) -> bool:
    """True if ``repo`` still holds exactly the recorded versions (local stats and two small reads per
    model); any surprise, including a malformed record, is False."""
    try:
        for model, entry in models.items():
            if "/" in model or model in (".", ".."):
                return False
            model_dir = os.path.join(repo, model)
            folder = os.path.join(model_dir, str(int(entry["version"])))
            if not stat.S_ISDIR(os.lstat(model_dir).st_mode) or not stat.S_ISDIR(os.lstat(folder).st_mode):
                return False
            if _sha256(os.path.join(folder, MANIFEST_NAME)) != entry["manifest_sha256"] or \
                    _sha256(os.path.join(model_dir, CONFIG_NAME)) != entry["config_sha256"]:
                return False
            for relative, digest in entry["model_files"].items():  # beside config.pbtxt: Triton needs them
                if relative.startswith("/") or ".." in relative.split("/"):
                    return False
                path = os.path.join(model_dir, relative)
                if not stat.S_ISREG(os.lstat(path).st_mode) or _sha256(path) != digest:
                    return False
            prefix = folder + os.sep
            for relative, size in entry["files"]:
                if relative.startswith("/") or "/../" in f"/{relative}/":  # a record is believed about nothing
                    return False  # outside the repository (it is in the shared cache: see the docstring)
                info = os.lstat(prefix + relative)
                if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                    return False
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False
    return True


def _read_state(path: str, env: str) -> tuple[str, dict[str, Any], str] | None:
    """(the pointer's tag, models, the pointer's key in the store) of a well-formed record, else None."""
    try:
        with open(path, "rb") as handle:
            state = json.loads(handle.read())
        etag, models, pointer = state["etag"], state["models"], state["pointer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if state.get("schema") != STATE_SCHEMA or state.get("env") != env or not isinstance(etag, str) \
            or not isinstance(models, dict) or not models or not isinstance(pointer, str) or not pointer:
        return None
    return etag, models, pointer


def try_unchanged(store: Store, cache: Path, repository: Path, env: str,
                  selection: tuple[str, ...] = ()) -> SyncResult | None:
    """The result of an unchanged sync, or None when the full planner must run."""
    from repo_manager.ops.sync.result import SyncResult  # noqa: PLC0415 - off the quick sync path

    started = time.monotonic()
    found = _read_state(state_path(cache, store_id(store), env, repository, selection), env)
    if found is None:
        return None
    etag, models, _ = found
    pointer = store.get_env_if_changed(env, etag)
    if (pointer is not None and pointer.etag != etag) or not _serves(repository, models):
        # (a service that ignores If-None-Match answers 200 with the same tag: still unchanged)
        return None
    return SyncResult(**unchanged(store.location, env, str(repository), models, time.monotonic() - started))


def quick(location: str, endpoint_url: str | None, cache: str, repository: str, env: str,
          selection: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """``try_unchanged(...).to_dict()`` for an S3 store with keys in the environment, without the store
    classes; None whenever the full path must decide (no record, a moved pointer, keys elsewhere in the
    AWS chain, an error of any kind: the full path retries and reports it)."""
    from repo_manager.adapters.storage import sigv4  # noqa: PLC0415 - off the quick sync path

    started = time.monotonic()
    credentials = sigv4.env_keys()
    if credentials is None or not location.startswith("s3://"):
        return None
    try:
        bucket, prefix = sigv4.parse_s3_url(location)
    except Exception:  # noqa: BLE001 - the full path reports a bad location
        return None
    location = f"s3://{bucket}" + (f"/{prefix}" if prefix else "")  # as S3Store names it
    found = _read_state(state_path(cache, _store_id(location, endpoint_url), env, repository, selection), env)
    if found is None:
        return None
    etag, models, pointer = found
    keys, region = credentials
    try:
        url = sigv4.object_url(sigv4.s3_base_url(bucket, endpoint_url, region),
                               f"{prefix}/{pointer}" if prefix else pointer)
        response = sigv4.get_if_none_match(sigv4.Signer(region), url, keys, etag)
    except (OSError, ValueError):  # unreachable, malformed endpoint …: the full path retries and reports
        return None
    if not (response.status == 304 or (response.status == 200 and response.headers.get("etag") == etag)) \
            or not _serves(repository, models):
        return None
    return as_dict(unchanged(location, env, str(repository), models, time.monotonic() - started))
