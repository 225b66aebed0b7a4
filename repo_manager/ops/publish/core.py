"""`trm publish model`: a checkpoint in, a complete, verified, immutable version out.

Steps, for every source format:

1. check the name and the source; derive the config through the schema (``config``);
2. stage the version's files in a temporary folder inside the model folder (``LocalRepository.stage``);
3. verify on a real Triton (``verify``) unless disabled;
4. write the manifest last and rename the folder into place (``LocalRepository.commit``).

Any failure (including Ctrl-C, SIGTERM and SIGHUP) removes every staging folder the publish created, also
those of a converter that failed half-way: the repository keeps no half version.
A converter for a source format returns a ``Staged`` model (or several, for an ensemble).
"""

from __future__ import annotations

import base64
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from repo_manager.adapters.loadgen.inputs import verification_samples
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.connect import triton_client
from repo_manager.core import config as cfg
from repo_manager.core.errors import ConflictError, InputError
from repo_manager.core.localized import recorded_entries
from repo_manager.core.manifest import (
    Manifest,
    check_model_name,
    now_iso,
    package_versions,
    scan_files,
    sha256_file,
)
from repo_manager.core.paths import open_inside
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.verify import Candidate, Check, Reference, verify


@dataclass(frozen=True)
class PublishResult:
    model: str
    version: int
    path: str
    files: int
    bytes: int
    verified: bool
    verification: dict[str, Any]
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    members: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "path": self.path, "files": self.files,
                "bytes": self.bytes, "verified": self.verified, "verification": self.verification,
                "seconds": round(self.seconds, 3), "timings": self.timings, "members": self.members}


@dataclass
class Staged:
    """One model version being built in its staging folder."""

    name: str
    folder: Path
    config: cfg.ModelConfig
    source: dict[str, Any]
    reference: Reference | None = None
    samples: list[dict[str, np.ndarray]] | None = None
    check: Check | None = None
    members: dict[str, int] = field(default_factory=dict)
    environment_packages: tuple[str, ...] = ()
    tuning: dict[str, Any] | None = None
    labels: dict[str, str] = field(default_factory=dict)
    """Label files its config names (path in the model folder -> text), carried in the manifest."""
    data: dict[str, str] = field(default_factory=dict)
    """Data files its config reads from the model folder, as ``Manifest.data`` (path -> base64)."""
    verification_extra: dict[str, Any] = field(default_factory=dict)
    """Facts about the reference (library, version, criterion) that the manifests record with the result."""
    verifier: Callable[[Settings], dict[str, Any]] | None = None
    """A format's own verification (an LLM's generations), replacing the request/answer comparison; returns
    what the manifest records."""
    before_commit: Callable[[int], None] | None = None
    """Called with the version number about to be claimed, before the files are listed (a file that names
    the version folder: a vLLM model.json)."""

    def files(self) -> dict[str, Path]:
        return {e.path: self.folder / e.path for e in scan_files(self.folder)}

    def model_files(self) -> dict[str, bytes]:
        """What verification installs beside config.pbtxt (label files, warm-up data), as ``Manifest.model_files``."""
        return {**{path: text.encode() for path, text in self.labels.items()},
                **{path: base64.b64decode(text) for path, text in self.data.items()}}


def copy_into(staging: Path, source: Path, relative: str) -> None:
    target = staging / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def copy_inside(staging: Path, root: Path, relative: str) -> None:
    """Copy ``root/relative`` into ``staging`` as ``paths.open_inside`` reads it (no link on the way)."""
    target = staging / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    with open_inside(root, relative) as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out)


def source_record(path: Path, kind: str, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"kind": kind, "path": str(path.resolve())}
    if path.is_file():
        record["sha256"] = sha256_file(path)
        record["size"] = path.stat().st_size
    record.update(extra)
    return record


def commit_staged(repo: LocalRepository, staged: Staged, verification: dict[str, Any],
                  *, retries: int = 5) -> tuple[int, Path]:
    """Write the manifest and rename into the next free version; retry on a lost race."""
    config_text = cfg.config_to_text(staged.config)
    files = recorded_entries(staged.folder, config_text)
    for _ in range(retries):
        version = repo.next_version(staged.name)
        if staged.before_commit is not None:
            staged.before_commit(version)
            files = recorded_entries(staged.folder, config_text)
        manifest = Manifest(
            model=staged.name, version=version, files=files, config=config_text,
            source=staged.source,
            environment=package_versions("onnx", "onnxruntime", "tritonclient", "numpy",
                                         *staged.environment_packages),
            verification=verification, tuning=staged.tuning, members=staged.members, labels=staged.labels,
            data=staged.data,
            created_at=now_iso())
        manifest.writable_json()  # a manifest trm could not read back is refused before it is written
        try:
            return version, repo.commit(staged.folder, manifest)
        except ConflictError:
            continue
    raise ConflictError(f"could not claim a version number for {staged.name} after {retries} tries")


def run_publish(settings: Settings, name: str, build: Callable[[LocalRepository, str], list[Staged]],
                *, verify_model: bool = True, progress: Progress = quiet,
                skipped_verification: dict[str, Any] | None = None) -> PublishResult:
    """Build staged models with ``build``, verify them together, commit each (members first).

    ``build`` stages through the repository it is given and returns the staged models; the last one is the
    entry point that verification calls. A folder it staged that is not committed here is removed, when
    ``build`` itself fails half-way too.
    ``skipped_verification`` is what the manifests record when ``verify_model`` is False (why it was skipped).
    """
    check_model_name(name)
    repo = LocalRepository(settings.repository)
    started = time.monotonic()
    timings: dict[str, float] = {}
    if repo.versions(name):
        repo.repair_config(name)  # heal a config.pbtxt left stale by an interrupted earlier publish
    with repo.staging_scope():  # every folder a converter stages, those of one that failed half-way too
        progress(f"preparing {name}")
        t0 = time.monotonic()
        staged = build(repo, name)
        timings["convert"] = round(time.monotonic() - t0, 3)
        entry = staged[-1]
        verification: dict[str, Any] = dict(skipped_verification or {"skipped": True})
        if verify_model:
            t0 = time.monotonic()
            progress("verifying on Triton" + (f" at {settings.triton_url}" if settings.triton_url else
                                              " (embedded server)"))
            if entry.verifier is not None:
                verification = entry.verifier(settings)
            else:
                samples = entry.samples if entry.samples is not None else verification_samples(entry.config)
                candidates = [Candidate(s.name, s.config, s.files(), s.model_files()) for s in staged]
                if any(s.config.HasField("ensemble_scheduling") for s in staged):
                    report = _verify_ensemble(settings, candidates, entry, samples, progress)
                else:
                    with triton_client(settings) as client:
                        report = verify(client, candidates, entry.name, samples, entry.reference, entry.check)
                verification = {**report.to_dict(), **entry.verification_extra}
            timings["verify"] = round(time.monotonic() - t0, 3)
        t0 = time.monotonic()
        committed: dict[str, int] = {}
        result_path = Path()
        for item in staged:
            if item.members:  # pin the member versions just committed
                item.members = {m: committed.get(m, v) for m, v in item.members.items()}
                pin_members(item.config, item.members)
            version, result_path = commit_staged(repo, item, verification)
            committed[item.name] = version
            progress(f"committed {item.name} version {version}")
        timings["write"] = round(time.monotonic() - t0, 3)
    files = scan_files(result_path)
    return PublishResult(model=entry.name, version=committed[entry.name], path=str(result_path),
                         files=len(files), bytes=sum(f.size for f in files), verified=verify_model,
                         verification=verification, seconds=time.monotonic() - started, timings=timings,
                         members={k: v for k, v in committed.items() if k != entry.name})


def _verify_ensemble(settings: Settings, candidates: list[Candidate], entry: Staged,
                     samples: list[dict[str, np.ndarray]], progress: Progress):
    """An ensemble loads its members from the server's repository folder (see ``verify``), so it is
    verified on an embedded server whose repository is a scratch folder, even when --url is given."""
    if settings.triton_url:
        progress("an ensemble is verified on an embedded server (Triton loads its members from its own "
                 "repository folder)")
    with tempfile.TemporaryDirectory(prefix=".trm-verify-", dir=settings.repository) as scratch:
        embedded = dataclasses.replace(settings, triton_url=None)
        with triton_client(embedded, repository=Path(scratch)) as client:
            return verify(client, candidates, entry.name, samples, entry.reference, entry.check,
                          repository=Path(scratch))


def pin_members(config: cfg.ModelConfig, members: dict[str, int]) -> None:
    for step in config.ensemble_scheduling.step:
        if step.model_name in members:
            step.model_version = members[step.model_name]


# ------------------------------------------------------------------------------------ source formats

def detect_format(source: Path) -> str:
    if not source.exists():
        raise InputError(f"source {source} does not exist")
    if source.is_file():
        if source.suffix == ".onnx":
            return "onnx"
        raise InputError(f"source {source} is not an .onnx file or a model folder",
                         hint="publish an .onnx file, a Python-backend folder (model.py) or a "
                              "Hugging Face checkpoint folder (config.json)")
    if (source / "model.py").is_file():
        return "python"
    if (source / "config.json").is_file() or (source / "modules.json").is_file():
        return "huggingface"
    onnx_files = list(source.glob("*.onnx"))
    if len(onnx_files) == 1:
        return "onnx"
    raise InputError(f"cannot tell what {source} holds",
                     hint="expected model.py (Python backend), config.json (Hugging Face) or one .onnx file")
