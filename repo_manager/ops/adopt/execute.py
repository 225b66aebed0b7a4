"""Carry out an adoption plan: verify what the embedded server can run, then write manifests (last).

In place, adoption only adds ``trm-manifest.json`` to version folders: each is written into a staging
folder of the model (a name Triton and trm readers ignore) and hard-linked into the version folder, which
refuses an existing file, so a kill leaves either no manifest or a complete one and never replaces one.
With a target, each version is copied through the repository's own stage → commit path.

Verification happens for every version before the first manifest is written: a refused version leaves
the repository as it was (unless ``skip_broken``, which adopts the rest and reports the refusals).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repo_manager.adapters.loadgen.inputs import verification_samples
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.connect import triton_client
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, TrmError, VerificationError
from repo_manager.core.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    encode_data,
    now_iso,
    package_versions,
    scan_files,
    sha256_file,
)
from repo_manager.core.paths import walk_inside
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.adopt.plan import NOT_CONTENT, AdoptPlan, ModelPlan, VersionPlan, model_file
from repo_manager.ops.verify import Candidate, verify


@dataclass(frozen=True)
class AdoptedVersion:
    model: str
    version: int
    verified: bool
    detail: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AdoptResult:
    plan: AdoptPlan
    adopted: tuple[AdoptedVersion, ...]
    refused: tuple[str, ...]
    seconds: float
    present: int = 0
    verification: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"source": str(self.plan.source), "target": str(self.plan.target) if self.plan.target else None,
                "adopted": [a.to_dict() for a in self.adopted], "already_adopted": self.present,
                "refused": list(self.refused), "seconds": round(self.seconds, 3), "plan": self.plan.to_dict()}


def execute_adoption(plan: AdoptPlan, settings: Settings, *, verify_models: bool = True,
                     skip_broken: bool = False, progress: Progress = quiet) -> AdoptResult:
    started = time.monotonic()
    refused = plan.problems()
    if refused and not skip_broken:
        raise InputError(_listing(f"{len(refused)} problem(s) in {plan.source}, nothing adopted", refused),
                         hint="fix them, or pass --skip-broken to adopt the rest")
    work = [(m, v) for m in plan.models for v in m.to_adopt()]
    entries = {(m.name, v.version): _entries(m.folder / str(v.version)) for m, v in work}
    for model, version in work:  # what the plan measured, measured again on the files as they are now
        _manifest(model, version, entries[(model.name, version.version)], {}).writable_json()
    records: dict[tuple[str, int], dict[str, Any]] = {}
    for model, version in work:
        if not verify_models:
            records[(model.name, version.version)] = {"passed": False, "skipped": True, "reason": "--no-verify"}
        elif model.backend != "ensemble" and not model.runnable:
            records[(model.name, version.version)] = {
                "passed": False, "skipped": True,
                "reason": f"backend {model.backend} cannot run on the embedded server (it runs python and "
                          "onnxruntime models on CPU): adopted unverified"}
        elif model.backend == "onnxruntime" and _onnx_directory(model, version):
            records[(model.name, version.version)] = {
                "passed": False, "skipped": True,
                "reason": "an ONNX model directory (model.onnx/ with external data): the embedded server's "
                          "onnxruntime backend loads single files only: adopted unverified"}
    runnable = [(m, v) for m, v in work if (m.name, v.version) not in records and m.backend != "ensemble"]
    if runnable:
        progress(f"verifying {len(runnable)} version(s) on Triton")
        with triton_client(settings) as client:
            for model, version in runnable:
                records[(model.name, version.version)] = _verify_one(client, model, version, progress)
    by_name = {m.name: m for m in plan.models}
    for model, version in work:
        if (model.name, version.version) not in records:
            records[(model.name, version.version)] = _verify_ensemble(settings, model, version, by_name, records,
                                                                      progress)
    failed = [f"{m}/{v}: {r['reason']}" for (m, v), r in records.items() if r.get("failed")]
    if failed and not skip_broken:
        raise VerificationError(_listing(f"{len(failed)} version(s) did not answer on Triton, nothing adopted",
                                         failed), hint="fix the model, or pass --skip-broken to adopt the rest")
    adopted: list[AdoptedVersion] = []
    writer = LocalRepository(plan.target if plan.target is not None else plan.source)
    for name in sorted({m.name for m, _ in work}):
        writer.clean_staging(name)  # what a killed adopt left (folders of running writers are kept)
    for model, version in work:
        record = records[(model.name, version.version)]
        if record.get("failed"):
            continue
        record.pop("failed", None)
        path = _write(plan, model, version, entries[(model.name, version.version)], record)
        verified = bool(record.get("passed"))
        detail = record.get("reference") or record.get("reason") or ""
        adopted.append(AdoptedVersion(model.name, version.version, verified, detail, str(path)))
        progress(f"adopted {model.name} version {version.version}" + ("" if verified else " (unverified)"))
    if plan.target is not None:
        for name in sorted({a.model for a in adopted}):
            LocalRepository(plan.target).repair_config(name)
    present = sum(1 for m in plan.models if not m.refused for v in m.versions if v.action == "present")
    return AdoptResult(plan, tuple(adopted), tuple(refused + failed), time.monotonic() - started, present)


def _listing(head: str, problems: list[str]) -> str:
    """One line that says what happened, then every problem on a line of its own (none left to --dry-run)."""
    return head + ":\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------- verification

def _check_config(model: ModelPlan) -> cfg.ModelConfig:
    """The config as Triton would load it here: GPU instance groups become CPU ones, since the embedded
    server has no GPU (recorded in the verification record)."""
    config = cfg.parse_config(model.config_text)
    config.name = model.name
    for group in config.instance_group:
        if group.kind in (cfg.mc.ModelInstanceGroup.KIND_GPU, cfg.mc.ModelInstanceGroup.KIND_AUTO):
            group.kind = cfg.mc.ModelInstanceGroup.KIND_CPU
            del group.gpus[:]
    return config


def _onnx_directory(model: ModelPlan, version: VersionPlan) -> bool:
    return (model.folder / str(version.version) / (model_file(cfg.parse_config(model.config_text))
                                                   or "model.onnx")).is_dir()


def _verify_one(client, model: ModelPlan, version: VersionPlan, progress: Progress) -> dict[str, Any]:
    folder = model.folder / str(version.version)
    config = _check_config(model)
    files = {rel: folder / rel for rel in _entries_paths(folder)}
    reference = None
    record: dict[str, Any] = {}
    if model.backend == "onnxruntime":
        import onnxruntime  # noqa: PLC0415 - the ONNX runtime only to run a model

        from repo_manager.ops.publish.onnx import onnx_reference  # noqa: PLC0415 - onnxruntime, only here

        path = folder / (model_file(config) or "model.onnx")
        try:
            reference = onnx_reference(path)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types for a file it cannot load
            progress(f"{model.name}/{version.version} failed: onnxruntime cannot load {path}")
            return {"passed": False, "failed": True,
                    "reason": f"onnxruntime cannot load {path}: {str(exc).splitlines()[0][:300]}"}
        record = {"reference": "onnxruntime", "reference_version": onnxruntime.__version__}
    else:
        record = {"reference": "config", "checked": "every declared output present with its type and shape"}
    try:
        report = verify(client, [Candidate(model.name, config, files, model.model_files)], model.name,
                        verification_samples(config), reference)
    except TrmError as exc:
        progress(f"{model.name}/{version.version} failed: {exc.message}")
        return {"passed": False, "failed": True, "reason": exc.message}
    return {**report.to_dict(), **record, "instance_groups": "checked on CPU"}


def _verify_ensemble(settings: Settings, model: ModelPlan, version: VersionPlan, plans: dict[str, ModelPlan],
                     records: dict[tuple[str, int], dict[str, Any]], progress: Progress) -> dict[str, Any]:
    pins = model.members.get(version.version, {})
    for member, member_version in pins.items():
        plan = plans.get(member)
        member_record = records.get((member, member_version))
        if plan is None or not plan.runnable:
            return {"passed": False, "skipped": True,
                    "reason": f"member {member} cannot run on the embedded server: adopted unverified"}
        if member_record is not None and not member_record.get("passed"):
            return {"passed": False, "skipped": True, "reason": f"member {member}/{member_version} is unverified"}
    candidates = [Candidate(model.name, _check_config(model), {}, model.model_files)]
    for member, member_version in pins.items():
        folder = plans[member].folder / str(member_version)
        candidates.append(Candidate(member, _check_config(plans[member]),
                                    {rel: folder / rel for rel in _entries_paths(folder)},
                                    plans[member].model_files))
    progress(f"verifying ensemble {model.name}/{version.version} on an embedded server")
    # an ensemble loads its members from the server's repository folder: a scratch one, outside the source
    with tempfile.TemporaryDirectory(prefix="trm-adopt-") as scratch:
        embedded = dataclasses.replace(settings, triton_url=None)
        try:
            with triton_client(embedded, repository=Path(scratch)) as client:
                report = verify(client, candidates, model.name, verification_samples(candidates[0].config),
                                None, repository=Path(scratch))
        except TrmError as exc:
            return {"passed": False, "failed": True, "reason": exc.message}
    return {**report.to_dict(), "reference": "config", "members": pins}


# ------------------------------------------------------------------------------------------- writing

def _entries_paths(folder: Path) -> list[str]:
    return [rel for rel in walk_inside(folder, skip_folders=NOT_CONTENT) if rel != MANIFEST_NAME]


def _entries(folder: Path) -> tuple[FileEntry, ...]:
    return tuple(entry.check() for entry in scan_files(folder))


def _manifest(model: ModelPlan, version: VersionPlan, files: tuple[FileEntry, ...],
              verification: dict[str, Any]) -> Manifest:
    folder = model.folder / str(version.version)
    source = {"kind": "adopted", "path": str(folder.resolve()),
              "config_sha256": hashlib.sha256(model.config_text.encode()).hexdigest()}
    return Manifest(model=model.name, version=version.version, files=files, config=model.config_text,
                    source=source, environment=package_versions("tritonclient", "onnxruntime"),
                    verification=verification, members=dict(model.members.get(version.version, {})),
                    labels=dict(model.labels), data=encode_data(model.data), created_at=now_iso())


def _write(plan: AdoptPlan, model: ModelPlan, version: VersionPlan, files: tuple[FileEntry, ...],
           verification: dict[str, Any]) -> Path:
    manifest = _manifest(model, version, files, verification)
    manifest.writable_json()  # one trm could not read back is refused before anything is written
    source = model.folder / str(version.version)
    if plan.target is None:
        return _add_manifest(LocalRepository(plan.source), source, manifest)
    target = LocalRepository(plan.target)
    with target.staging(model.name) as staging:
        for entry in files:
            destination = staging / entry.path
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / entry.path, destination)
            if sha256_file(destination) != entry.sha256:
                raise InputError(f"{source / entry.path} changed while it was being adopted")
        return target.commit(staging, manifest, update_config=False)


def _add_manifest(repo: LocalRepository, folder: Path, manifest: Manifest) -> Path:
    """Write the manifest beside the files it describes without ever exposing a partial one: written in a
    staging folder of the model, then hard-linked into place (a link never replaces an existing file)."""
    with repo.staging(manifest.model) as staging:
        cfg.atomic_write_bytes(staging / MANIFEST_NAME, manifest.to_json())  # (checked by _write)
        try:
            os.link(staging / MANIFEST_NAME, folder / MANIFEST_NAME)
        except FileExistsError as exc:
            raise InputError(f"{folder / MANIFEST_NAME} appeared while adopting (another adopt?)",
                             hint="run `trm adopt` again: versions adopted meanwhile are left alone") from exc
        except OSError:  # no hard links on this filesystem: a rename, refusing an existing file first
            if (folder / MANIFEST_NAME).exists():
                raise InputError(f"{folder / MANIFEST_NAME} appeared while adopting") from None
            os.rename(staging / MANIFEST_NAME, folder / MANIFEST_NAME)
    return folder
