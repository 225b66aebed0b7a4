"""`trm push` and `trm publish --store`: complete local versions into a store.

Order is what makes a version safe to read at any moment: every blob first (content-addressed, so only
the ones the store lacks, in parallel), then the manifest (created with If-None-Match, which claims the
version number), then, if asked, the environment pointer (compare-and-swap). A reader that finds a
manifest finds all its blobs; a crash leaves at most unreferenced blobs.

Two publishers racing for one number: exactly one manifest create succeeds. ``push`` reports the
loser's conflict clearly (a local version number is an identity; it is not renamed behind the user's
back), while ``publish_to_store`` — a version that was just created — takes the next free number in the
store and renumbers the local folder to match.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from repo_manager.adapters.repository import STAGING_PREFIX, LocalRepository
from repo_manager.adapters.storage import Store
from repo_manager.core.environments import check_env_name
from repo_manager.core.errors import ConflictError, InputError, NotFoundError, UsageError
from repo_manager.core.localized import checked_stored_bytes, install_file, localized_paths, recorded_bytes
from repo_manager.core.manifest import FileEntry, Manifest, check_model_name
from repo_manager.core.progress import Progress, quiet

UPLOAD_WORKERS = 8




@dataclass(frozen=True)
class PushedVersion:
    model: str
    version: int
    blobs_uploaded: int
    bytes_uploaded: int
    already_present: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PushResult:
    store: str
    versions: tuple[PushedVersion, ...]
    env: str | None
    env_models: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def bytes_uploaded(self) -> int:
        return sum(v.bytes_uploaded for v in self.versions)

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "versions": [v.to_dict() for v in self.versions], "env": self.env,
                "env_models": self.env_models, "bytes_uploaded": self.bytes_uploaded,
                "seconds": round(self.seconds, 3)}


def parse_selection(text: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME:VERSION``."""
    name, sep, version = text.partition(":")
    if sep and not (re.fullmatch(r"[0-9]{1,18}", version) and int(version) > 0):  # ASCII digits: not '٣'
        raise UsageError(f"{text!r}: the version after ':' must be a positive number", hint="write NAME:VERSION")
    return check_model_name(name), int(version) if version else None


def select_versions(repo: LocalRepository, selections: list[tuple[str, int | None]]) -> list[tuple[str, int]]:
    """(model, version) pairs to push: NAME:V that version, NAME all its versions, nothing given: all."""
    chosen: list[tuple[str, int]] = []
    for model, version in selections or [(m, None) for m in repo.models()]:
        if version is not None:
            repo.manifest(model, version)  # NotFoundError when absent
            chosen.append((model, version))
        else:
            versions = repo.versions(model)
            if not versions:
                raise NotFoundError(f"model {model!r} has no complete version in {repo.root}", model=model)
            chosen += [(model, v) for v in versions]
    if not chosen:
        raise NotFoundError(f"nothing to push: {repo.root} has no published versions",
                            hint="publish one with `trm publish model`")
    return chosen


def with_members(store: Store, repo: LocalRepository, chosen: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``chosen`` with every ensemble's pinned members (and theirs) added, each once, members before the
    ensembles that pin them: a reader that finds an ensemble's manifest in the store finds its members. A
    member only the store holds is left to it; one in neither is a NotFoundError."""
    ordered: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()

    def visit(item: tuple[str, int], path: tuple[tuple[str, int], ...]) -> None:
        if item in path:
            raise UsageError(f"ensemble {item[0]} version {item[1]} names itself among its members",
                             model=item[0], version=item[1])
        if item in seen:
            return
        seen.add(item)
        if path and item[1] not in repo.versions(item[0]):
            try:
                store.get_manifest(*item)
            except NotFoundError:
                raise NotFoundError(f"ensemble {path[-1][0]} version {path[-1][1]} pins {item[0]} version "
                                    f"{item[1]}, which is neither in {repo.root} nor in {store.location}",
                                    model=item[0], version=item[1]) from None
            return
        for member in sorted(repo.manifest(*item).members.items()):
            visit(member, (*path, item))
        ordered.append(item)

    for item in chosen:
        visit(item, ())
    return ordered


def upload_blobs(store: Store, repo: LocalRepository, manifest: Manifest) -> tuple[int, int]:
    """Upload the version's files the store lacks; (count, bytes) uploaded."""
    folder = repo.version_dir(manifest.model, manifest.version)
    unique = {entry.sha256: entry for entry in manifest.files}
    for entry in manifest.files:  # what is pushed is the version's own files: never read through a link
        path = folder / entry.path
        if path.is_symlink() or not path.is_file():
            raise InputError(f"{path} is {'a symbolic link' if path.is_symlink() else 'not a regular file'}; a "
                             "version holds its own files", hint="`trm validate` lists what differs from the "
                             "manifest", model=manifest.model, version=manifest.version)

    localized = localized_paths(manifest.config)

    def send(entry: FileEntry) -> int | None:
        """The bytes uploaded; None when the store already held the blob."""
        if entry.path in localized:  # its stored form, which the manifest records: not the local folder's path
            uploaded = store.put_blob_bytes(entry.sha256, checked_stored_bytes(folder, entry))
        else:
            uploaded = store.put_blob(entry.sha256, folder / entry.path, entry.size)
        return entry.size if uploaded else None

    with ThreadPoolExecutor(UPLOAD_WORKERS) as pool:
        sent = [n for n in pool.map(send, unique.values()) if n is not None]
    return len(sent), sum(sent)


def _same_version(a: Manifest, b: Manifest) -> bool:
    return a.files == b.files and a.config == b.config and a.members == b.members and \
        a.model_files == b.model_files


def push_version(store: Store, repo: LocalRepository, model: str, version: int) -> PushedVersion:
    manifest = repo.manifest(model, version)
    try:
        existing = store.get_manifest(model, version)
    except NotFoundError:
        existing = None
    if existing is not None:
        if not _same_version(existing, manifest):
            raise _different(store, model, version)
        return PushedVersion(model, version, 0, 0, already_present=True)
    count, size = upload_blobs(store, repo, manifest)
    try:
        store.put_manifest(manifest)
    except ConflictError as exc:  # another writer claimed the number between our read and our create
        if not _same_version(store.get_manifest(model, version), manifest):
            raise _different(store, model, version) from exc
    return PushedVersion(model, version, count, size, already_present=False)


def check_not_a_typo(store: Store, env: str) -> None:
    """A push may create an environment, but not one whose name is close to one the store has (``prd``
    beside ``prod``, ``STAGING`` beside ``staging``): nodes watching the intended one would never see the
    versions. Refused before anything is uploaded; ``create_env`` says the new name is meant."""

    known = store.list_envs()
    if env in known:
        return

    def numbered(name: str) -> str:  # staging2 beside staging, eu-west-2 beside eu-west-1: meant, not typos
        return re.sub(r"[0-9]+", "", name)
    close = [k for k in known if k.lower() == env.lower()] or [
        k for k in difflib.get_close_matches(env, known, n=3, cutoff=0.75) if numbered(k) != numbered(env)]
    if close:
        raise UsageError(f"environment {env!r} does not exist in {store.location}; did you mean "
                         f"{' or '.join(close)}?", hint=f"to create {env} as a new environment, add --create-env",
                         env=env)


def _different(store: Store, model: str, version: int) -> ConflictError:
    return ConflictError(f"{store.location} already holds a different version {version} of {model}",
                         hint="publish a new version (versions are immutable), or push to another store",
                         model=model, version=version)


def push(store: Store, repo: LocalRepository, selections: list[tuple[str, int | None]], *,
         env: str | None = None, create_env: bool = False, progress: Progress = quiet) -> PushResult:
    started = time.monotonic()
    if env is not None:
        check_env_name(env)
        if not create_env:
            check_not_a_typo(store, env)
    pushed = []
    chosen = select_versions(repo, selections)
    for model, version in with_members(store, repo, chosen):
        result = push_version(store, repo, model, version)
        member = "" if (model, version) in chosen else " (ensemble member)"
        progress(f"{model}/{version}{member}: " + ("already in the store" if result.already_present else
                 f"{result.blobs_uploaded} blobs, {result.bytes_uploaded} bytes uploaded"))
        pushed.append(result)
    env_models: dict[str, int] = {}
    if env is not None:  # the chosen models: an ensemble's members come with it when a node syncs it
        newest: dict[str, int] = {}
        for model, version in chosen:
            newest[model] = max(newest.get(model, 0), version)
        env_models = store.update_env(env, newest).models
        progress(f"environment {env} now serves " + ", ".join(f"{m} version {v}" for m, v in sorted(newest.items())))
    return PushResult(store.location, tuple(pushed), env, env_models, time.monotonic() - started)


def publish_to_store(store: Store, repo: LocalRepository, model: str, version: int, *, env: str | None = None,
                     retries: int = 5) -> PushResult:
    """Put a just-committed local version into the store, taking the next free number if another
    publisher claimed ``version`` first (the local folder is renumbered to match)."""
    started = time.monotonic()
    manifest = repo.manifest(model, version)
    count, size = upload_blobs(store, repo, manifest)
    for _ in range(retries):
        try:
            store.put_manifest(manifest)
            break
        except ConflictError:
            if manifest.members or _is_member(repo, model):
                raise  # ensembles pin member numbers: renumbering would break them; fail clearly
            taken = max([*store.list_versions(model), manifest.version])
            number = max(taken + 1, repo.next_version(model))
            manifest = _renumber_local(repo, manifest, number)
    else:
        raise ConflictError(f"could not claim a version number for {model} in {store.location} after {retries} "
                            "tries", model=model)
    pushed = PushedVersion(model, manifest.version, count, size, already_present=False)
    env_models = store.update_env(env, {model: manifest.version}).models if env else {}
    return PushResult(store.location, (pushed,), env, env_models, time.monotonic() - started)


def _is_member(repo: LocalRepository, model: str) -> bool:
    for other in repo.models():
        versions = repo.versions(other)
        if versions and model in repo.manifest(other, versions[-1]).members:
            return True
    return False


def _renumber_local(repo: LocalRepository, manifest: Manifest, number: int) -> Manifest:
    """Give local ``model/<old>`` the number ``number``: its files are hard-linked into a staging folder
    that is committed as ``<number>`` (Triton never sees a version folder with a wrong manifest), and
    only then is ``<old>`` renamed aside and deleted. A crash at any point leaves the version complete
    under one number or both, never only in a staging folder (which `trm validate --fix` deletes)."""
    folder = repo.version_dir(manifest.model, manifest.version)
    localized = localized_paths(manifest.config)
    with repo.staging(manifest.model) as staging:
        for entry in manifest.files:
            (staging / entry.path).parent.mkdir(parents=True, exist_ok=True)
            os.link(folder / entry.path, staging / entry.path)
        renumbered = dataclasses.replace(manifest, version=number)
        while True:
            for entry in (e for e in manifest.files if e.path in localized):  # name the new number's folder
                install_file(staging / entry.path, repo.version_dir(manifest.model, renumbered.version),
                             recorded_bytes(folder, entry))
            try:
                repo.commit(staging, renumbered)
                break
            except ConflictError:  # a local publisher took it meanwhile
                renumbered = dataclasses.replace(renumbered, version=repo.next_version(manifest.model))
    aside = folder.parent / f"{STAGING_PREFIX}renumbered-{uuid.uuid4().hex}"
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return renumbered


@dataclass(frozen=True)
class StoredVersion:
    store: str
    model: str
    version: int
    path: str


def store_published(store: Store, repo: LocalRepository, model: str, version: int,
                    members: dict[str, int] | None = None) -> StoredVersion:
    """`trm publish --store`: ensemble members as they are (a clash fails clearly), then the version."""
    for member, member_version in (members or {}).items():
        push_version(store, repo, member, member_version)
    final = publish_to_store(store, repo, model, version).versions[0].version
    return StoredVersion(store.location, model, final, str(repo.version_dir(model, final)))
