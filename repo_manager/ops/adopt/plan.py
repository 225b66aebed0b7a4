"""Read an existing Triton model repository and decide, without writing anything, what adoption would do.

A team's hand-made repository becomes trm versions only where nothing is ambiguous. Each model folder is
read the way Triton reads it (config.pbtxt through the ModelConfig schema, version folders, the backend's
default model file) and each version gets one verdict:

- ``adopt``: a manifest will be written for it (in place) or it will be copied as a trm version (``--into``);
- ``present``: it already carries a manifest that agrees with what adopting it now would record: its files,
  its config byte for byte, its label and data files, a verification it could have had (adopting twice
  changes nothing; a planted or stale manifest is refused, never replaced);
- ``refused``: with the reason, the file and, for a config, the line.

Everything is read inside the repository (``paths.read_inside`` / ``walk_inside``): a link anywhere on a
path, an unreadable file or folder and a name a manifest cannot record are refusals naming the path, and
each version's manifest is measured against what trm reads back, so the dry run and the real run agree.

Anything that Triton would ignore or that trm does not carry (stray files, non-version folders) is a note.
The plan is a value: ``--dry-run`` prints it, ``execute`` carries out exactly this plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from repo_manager.adapters.repository import CONFIG_NAME, STAGING_PREFIX, LocalRepository
from repo_manager.core import config as cfg
from repo_manager.core.errors import InputError, IntegrityError, RefusedError
from repo_manager.core.localized import entry_digest, localized_paths
from repo_manager.core.manifest import (
    BYTECODE_CACHE,
    MANIFEST_NAME,
    MANIFEST_RESERVE_BYTES,
    MAX_CONFIG_BYTES,
    MAX_DATA_BYTES,
    MAX_LABEL_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    check_label_path,
    check_model_name,
    encode_data,
    files_and_folders,
    read_manifest,
)
from repo_manager.core.paths import SourceReadError, read_inside, walk_inside

# Triton's platform names -> the backend that runs them.
PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
    "ensemble": "ensemble",
}
# The file (or folder) Triton looks for in a version folder when the config names none.
DEFAULT_MODEL_FILES = {
    "onnxruntime": "model.onnx",
    "python": "model.py",
    "tensorrt": "model.plan",
    "pytorch": "model.pt",
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
    "openvino": "model.xml",
}
# What the embedded server (CPU tritonserver from nvidia-pytriton) can load and answer.
RUNNABLE_BACKENDS = {"onnxruntime", "python"}
_TEMPLATE = re.compile(r"\$\{[^}]*\}|\{\{[^}]*\}\}")
_VERSION = re.compile(r"^[1-9][0-9]{0,17}$")
_SKIPPED_FOLDERS = {"lost+found", "__pycache__"}
# Model-level folders Triton reads itself (model_lifecycle.cc skips them as versions): data for model_warmup,
# sequence-batching initial states, and the alternative configs of --model-config-name.
_TRITON_FOLDERS = {"warmup": "model_warmup data", "initial_state": "sequence initial-state data",
                   "configs": "alternative configs (--model-config-name)"}
# What a model file is called when it sits beside config.pbtxt, where Triton never looks for one.
_MODEL_SUFFIXES = {".onnx", ".plan", ".engine", ".pt", ".pth", ".graphdef", ".savedmodel", ".xml", ".bin"}
NOT_CONTENT = frozenset({BYTECODE_CACHE})
"""What a Python backend writes beside model.py when the server lets it: not part of a version."""


@dataclass(frozen=True)
class VersionPlan:
    version: int
    action: str
    """``adopt``, ``present`` or ``refused``."""
    reason: str | None = None
    """Why it is refused (None when it is not)."""
    files: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"version": self.version, "action": self.action, "files": self.files,
                                "bytes": self.bytes}
        if self.reason:
            data["reason"] = self.reason
        return data


@dataclass(frozen=True)
class ModelPlan:
    name: str
    folder: Path
    backend: str = ""
    config_text: str = ""
    versions: tuple[VersionPlan, ...] = ()
    refused: str | None = None
    """Why the whole model is refused (its config, its name); None when it is not."""
    notes: tuple[str, ...] = ()
    members: dict[int, dict[str, int]] = field(default_factory=dict)
    """For an ensemble: version -> {member: member version it pins}."""
    labels: dict[str, str] = field(default_factory=dict)
    """Label files its outputs name (``label_filename``, in the model folder): path -> text. Every
    version's manifest carries them, so that push and sync install them beside config.pbtxt."""
    data: dict[str, bytes] = field(default_factory=dict)
    """Data files its config makes Triton read from the model folder (``warmup/<input_data_file>``,
    ``initial_state/<data_file>``): path -> bytes, carried the same way."""

    @property
    def model_files(self) -> dict[str, bytes]:
        return _model_files(self.labels, self.data)

    @property
    def runnable(self) -> bool:
        return self.backend in RUNNABLE_BACKENDS

    def to_adopt(self) -> list[VersionPlan]:
        return [] if self.refused else [v for v in self.versions if v.action == "adopt"]

    def problems(self) -> list[str]:
        if self.refused:
            return [f"{self.name}: {self.refused}"]
        return [f"{self.name}/{v.version}: {v.reason}" for v in self.versions if v.action == "refused"]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self.name, "backend": self.backend,
                                "versions": [v.to_dict() for v in self.versions], "notes": list(self.notes)}
        if self.refused:
            data["refused"] = self.refused
        if self.members:
            data["members"] = {str(k): v for k, v in self.members.items()}
        if self.labels:
            data["labels"] = sorted(self.labels)
        if self.data:
            data["data_files"] = sorted(self.data)
        return data


@dataclass(frozen=True)
class AdoptPlan:
    source: Path
    target: Path | None
    """None: adopt in place (only manifests are added)."""
    models: tuple[ModelPlan, ...]
    notes: tuple[str, ...] = ()

    @property
    def in_place(self) -> bool:
        return self.target is None

    def problems(self) -> list[str]:
        return [p for m in self.models for p in m.problems()]

    def to_dict(self) -> dict[str, Any]:
        counts = {"adopt": 0, "present": 0, "refused": 0}
        for model in self.models:
            for version in model.versions:
                counts["refused" if model.refused else version.action] += 1
            if model.refused and not model.versions:
                counts["refused"] += 1  # refused before its versions were read: still one refusal
        return {"source": str(self.source), "target": str(self.target) if self.target else None,
                "in_place": self.in_place, "models": [m.to_dict() for m in self.models],
                "counts": counts, "problems": self.problems(), "notes": list(self.notes)}


# ------------------------------------------------------------------------------------------ planning

def plan_adoption(source: str | Path, target: str | Path | None = None) -> AdoptPlan:
    """Read ``source`` (a Triton model repository) and decide what adopting it would do. Writes nothing."""
    root = Path(source)
    if not root.is_dir():
        raise InputError(f"{root} is not a folder", hint="pass the model repository Triton is started with")
    target_path = Path(target) if target is not None else None
    if target_path is not None:
        _check_target(root, target_path)
    notes: list[str] = []
    folders: list[Path] = []
    refused_links: list[ModelPlan] = []
    for child in _children(root):
        if child.name.startswith(".") or child.name in _SKIPPED_FOLDERS:
            if child.name in _SKIPPED_FOLDERS:
                notes.append(f"{child.name}: not a model folder, skipped")
            continue
        if child.is_symlink() and child.is_dir():
            # Triton follows the link and serves the model: refused, not passed over in silence
            refused_links.append(ModelPlan(child.name, child, refused=f"{child}: a symbolic link to a model "
                                           "folder (Triton serves it; trm adopts real folders only)"))
        elif child.is_symlink():
            notes.append(f"{child.name}: a symbolic link at the repository root, not adopted")
        elif child.is_dir():
            folders.append(child)
        else:
            notes.append(f"{child.name}: a file at the repository root, ignored by Triton")
    plans = {folder.name: _plan_model(folder, target_path) for folder in folders}
    plans.update({plan.name: plan for plan in refused_links})
    lowered: dict[str, str] = {}
    for name in sorted(plans):
        other = lowered.setdefault(name.lower(), name)
        if other != name:
            for clash in (name, other):
                plans[clash] = _refuse(plans[clash], f"models {other!r} and {name!r} differ only in case: "
                                                     "they collide on a case-insensitive filesystem")
    for name, plan in plans.items():
        if plan.backend == "ensemble" and not plan.refused:
            plans[name] = _plan_ensemble(plan, plans, target_path)
    # members before ensembles, so that execution commits what an ensemble pins first
    ordered = sorted(plans.values(), key=lambda m: (m.backend == "ensemble", m.name))
    return AdoptPlan(source=root, target=target_path, models=tuple(ordered), notes=tuple(notes))


def _children(folder: Path) -> list[Path]:
    """The entries of ``folder``, sorted; one that cannot be listed is an error naming it, never empty."""
    try:
        return [folder / name for name in sorted(os.listdir(folder))]
    except OSError as exc:
        why = "permission denied" if isinstance(exc, PermissionError) else exc.strerror
        raise SourceReadError(f"{folder} cannot be read ({why})", path=folder, reason="unreadable",
                              hint="give the user running trm read access to the whole repository") from exc


def _check_target(root: Path, target: Path) -> None:
    resolved_root, resolved_target = root.resolve(), target.resolve()
    if resolved_target == resolved_root or resolved_target.is_relative_to(resolved_root) \
            or resolved_root.is_relative_to(resolved_target):
        raise InputError(f"--into {target} overlaps the repository {root}",
                         hint="adopt in place (no --into) or name a separate folder")
    if target.exists() and not target.is_dir():
        raise InputError(f"--into {target} is not a folder")


def _refuse(plan: ModelPlan, reason: str) -> ModelPlan:
    return dataclasses.replace(plan, refused=plan.refused or reason)


def _plan_model(folder: Path, target: Path | None) -> ModelPlan:
    name = folder.name
    try:
        check_model_name(name)
    except InputError as exc:
        return ModelPlan(name, folder, refused=exc.message)
    config_path = folder / CONFIG_NAME
    try:
        text = read_inside(folder, CONFIG_NAME, MAX_CONFIG_BYTES).decode()
    except SourceReadError as exc:
        why = {"link": "a symbolic link (a model must hold its own config)", "special": "not a regular file",
               "missing": "no config.pbtxt (Triton's auto-complete configs are not adopted: write one)",
               "too_large": f"larger than {MAX_CONFIG_BYTES >> 20} MiB, more than a manifest records"}
        return ModelPlan(name, folder, refused=f"{config_path}: {why.get(exc.reason, exc.message)}")
    except UnicodeDecodeError:
        return ModelPlan(name, folder, refused=f"{config_path}: not UTF-8 text")
    try:
        config = _parse(config_path, text)
    except RefusedError as exc:
        return ModelPlan(name, folder, refused=exc.message)
    backend = backend_of(config)
    if config.name and config.name != name:
        return ModelPlan(name, folder, backend, text,
                         refused=f"{config_path}: names the model {config.name!r}, its folder is {name!r} "
                                 "(Triton refuses to load it)")
    if not backend:
        return ModelPlan(name, folder, backend, text, refused=f"{config_path}: names no backend or platform")
    notes: list[str] = []
    try:
        labels = _labels(folder, config)
        data = _model_level_data(folder, config)
    except RefusedError as exc:
        return ModelPlan(name, folder, backend, text, refused=exc.message)
    clash = sorted((set(labels) & set(data)) | set(files_and_folders([*labels, *data])))
    if clash:  # (a manifest holding both could not be read back)
        return ModelPlan(name, folder, backend, text, refused=f"{folder / CONFIG_NAME}: {clash[0]} is named both "
                         "as a label file and as warm-up data, or as a file and a folder")
    carried = _model_files(labels, data)
    label_roots = {path.split("/")[0] for path in carried}
    # every version's manifest carries the config, label and data files: refused here if they alone do not fit
    base_size = len(Manifest(name, 1, (), text, labels=labels, data=encode_data(data)).to_json())
    if base_size > MAX_MANIFEST_BYTES - MANIFEST_RESERVE_BYTES:
        return ModelPlan(name, folder, backend, text, refused=f"{config_path}: its config, label and data files "
                         f"take {base_size / 2**20:.1f} MiB in a manifest (as JSON), more than the "
                         f"{(MAX_MANIFEST_BYTES - MANIFEST_RESERVE_BYTES) >> 20} MiB trm records and reads back")
    try:
        children = _children(folder)
    except SourceReadError as exc:
        return ModelPlan(name, folder, backend, text, refused=exc.message)
    # the config every version's manifest must record: config.pbtxt's text, unless trm keeps the folder
    served = None if _kept_by_trm(children, text) else text
    versions: list[VersionPlan] = []
    for child in children:
        if child.name == CONFIG_NAME or child.name.startswith(STAGING_PREFIX):
            continue
        if child.name in label_roots:
            continue
        if child.name in _TRITON_FOLDERS:
            notes.append(f"{child.name}: read by Triton ({_TRITON_FOLDERS[child.name]}); trm does not carry it")
        elif child.is_symlink() and (_VERSION.match(child.name) or child.name[:1].isdigit()):
            versions.append(VersionPlan(_loose_number(child.name), "refused", f"{child}: a symbolic link "
                                        "(Triton follows it; a trm version must be a real folder)"))
        elif child.is_dir() and not child.is_symlink() and _VERSION.match(child.name):
            versions.append(_plan_version(name, int(child.name), child, config, text, served, target, carried,
                                          base_size))
        elif child.is_dir() and not child.is_symlink() and (child.name[:1].isdigit() or child.name[:1] in " +-"):
            number = _loose_number(child.name)
            versions.append(VersionPlan(number, "refused", f"version folder {child.name!r} is not a canonical "
                                        "version number" + (f" (rename it to {number})" if number else
                                                            " (trm versions start at 1)")))
        elif _looks_like_model_file(child, config):
            notes.append(f"{child.name}: a model file outside any version folder: Triton ignores it and trm does "
                         f"not carry it (to serve it, move it into a version folder, e.g. 1/{child.name})")
        else:
            notes.append(f"{child.name}: ignored by Triton (not config.pbtxt or a version folder), not carried by "
                         "trm")
    if not versions:
        notes.append("no version folder: nothing to adopt")
    return ModelPlan(name, folder, backend, text, tuple(versions), notes=tuple(notes), labels=labels, data=data)


def _kept_by_trm(children: list[Path], text: str) -> bool:
    """Whether trm keeps this model folder: its newest version was published or tuned by trm (not adopted)
    and config.pbtxt is that version's config, which is what trm writes there. Older versions then record
    configs and label files of their own (what they were published or tuned with): not a disagreement. In a
    hand-made or adopted folder every manifest must record config.pbtxt and the label files it holds."""
    numbered = sorted((int(c.name), c) for c in children if _VERSION.match(c.name) and c.is_dir()
                      and not c.is_symlink())
    for number, child in reversed(numbered):
        if not os.path.lexists(child / MANIFEST_NAME):
            continue
        try:
            manifest = read_manifest(child)
        except (IntegrityError, OSError):
            return False
        return manifest.version == number and manifest.config == text and manifest.source.get("kind") != "adopted"
    return False


def _looks_like_model_file(child: Path, config: cfg.ModelConfig) -> bool:
    return child.name == model_file(config) or child.name == "model.py" or child.suffix in _MODEL_SUFFIXES


def _model_files(labels: dict[str, str], data: dict[str, bytes]) -> dict[str, bytes]:
    """What a version's manifest will carry beside config.pbtxt (``Manifest.model_files``): path -> bytes."""
    return {**{path: text.encode() for path, text in labels.items()}, **data}


def _labels(folder: Path, config: cfg.ModelConfig) -> dict[str, str]:
    """The label files the outputs name, read the way Triton reads them (from the model folder, which they
    may not leave); ``RefusedError`` says why the model is refused: Triton fails the load when one is missing."""
    labels: dict[str, str] = {}
    for output in config.output:
        path = output.label_filename
        if not path or path in labels:
            continue
        where = f"{folder / CONFIG_NAME}: output {output.name!r} label_filename {path!r}"
        try:
            check_label_path(path)
        except IntegrityError:
            raise RefusedError(f"{where}: trm carries label files in the model folder only (not outside it, not "
                               "in a version folder, not config.pbtxt)") from None
        data = _read_model_file(folder, path, where, MAX_LABEL_BYTES)
        try:
            labels[path] = data.decode()
        except UnicodeDecodeError:
            raise RefusedError(f"{where}: {folder / path} is not UTF-8 text") from None
        if sum(len(text) for text in labels.values()) > MAX_LABEL_BYTES:  # (what the manifest reader allows)
            raise RefusedError(f"{folder / CONFIG_NAME}: the label files are larger than {MAX_LABEL_BYTES >> 20} "
                               "MiB in all, more than trm carries in a manifest")
    return labels


def _read_model_file(folder: Path, path: str, where: str, limit: int) -> bytes:
    """A regular file of the model folder, read without following a link anywhere on its way (a linked
    folder ``labels/sub -> /elsewhere`` is refused like a linked file), at most ``limit`` bytes; or
    ``RefusedError`` saying why not."""
    try:
        return read_inside(folder, path, limit)
    except SourceReadError as exc:
        why = {"missing": f"{folder / path} does not exist (Triton fails to load the model)",
               "special": f"{folder / path} is not a regular file"}.get(exc.reason, exc.message)
        raise RefusedError(f"{where}: {why}") from None


def _model_level_data(folder: Path, config: cfg.ModelConfig) -> dict[str, bytes]:
    """The data files the config makes Triton read from the model folder (``model_warmup`` inputs from
    ``warmup/``, sequence initial states from ``initial_state/``: Triton joins the name to that folder),
    read to be carried in every version's manifest; ``RefusedError`` says why the model is refused: a file
    that is missing, a link, outside its folder, or more than ``MAX_DATA_BYTES`` in all, and a parameter
    that reads the model folder (trm cannot tell which files it needs)."""
    wanted: list[tuple[str, str]] = []
    for warmup in config.model_warmup:
        for name, tensor in warmup.inputs.items():
            if tensor.input_data_file:
                wanted.append((f"warmup/{tensor.input_data_file}",
                               f"model_warmup {warmup.name!r} input {name!r} input_data_file"))
    for state in config.sequence_batching.state:
        for initial in state.initial_state:
            if initial.data_file:
                wanted.append((f"initial_state/{initial.data_file}", f"initial_state {initial.name!r} data_file"))
    data: dict[str, bytes] = {}
    for path, what in wanted:
        where = f"{folder / CONFIG_NAME}: {what} {path.split('/', 1)[1]!r}"
        try:
            check_label_path(path)
        except IntegrityError:
            raise RefusedError(f"{where}: names a file outside {path.split('/')[0]}/ of the model folder") from None
        if path in data:
            continue
        data[path] = _read_model_file(folder, path, where, MAX_DATA_BYTES)
        if sum(len(c) for c in data.values()) > MAX_DATA_BYTES:
            raise RefusedError(f"{folder / CONFIG_NAME}: the warm-up and initial-state data files are larger than "
                               f"{MAX_DATA_BYTES >> 20} MiB in all, more than trm carries in a manifest")
    for key, parameter in config.parameters.items():
        # the python backend's EXECUTION_ENV_PATH (and any backend parameter) may name a model-folder file
        for found in re.finditer(r"\$\$TRITON_MODEL_DIRECTORY/([^\s\"']+)", parameter.string_value):
            if not found.group(1).split("/")[0].isdigit():
                raise RefusedError(f"{folder / CONFIG_NAME}: parameter {key!r} reads {found.group(1)} from the "
                                   "model folder, which trm does not carry (move it into the version folder)")
    return data


def _loose_number(name: str) -> int:
    digits = re.match(r"\s*[+-]?(\d{1,18})(?!\d)", name)
    return int(digits.group(1)) if digits else 0


def _parse(path: Path, text: str) -> cfg.ModelConfig:
    """config.pbtxt read as Triton reads it; ``RefusedError`` naming the line when it cannot be."""
    for number, line in enumerate(text.splitlines(), 1):
        found = _TEMPLATE.search(line)
        if found and not line.lstrip().startswith("#"):
            raise RefusedError(f"{path}:{number}: template placeholder {found.group(0)} was never filled in")
    config = cfg.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line = exc.GetLine() if hasattr(exc, "GetLine") else None
        message = str(exc).split(" : ", 1)[-1]
        where = f"{path}:{line}" if line else str(path)
        raise RefusedError(f"{where}: not a valid Triton model config ({message})") from None
    return config


def backend_of(config: cfg.ModelConfig) -> str:
    return config.backend or PLATFORM_BACKENDS.get(config.platform, config.platform)


def model_file(config: cfg.ModelConfig) -> str | None:
    if config.default_model_filename:
        return config.default_model_filename
    if config.platform in DEFAULT_MODEL_FILES:
        return DEFAULT_MODEL_FILES[config.platform]
    return DEFAULT_MODEL_FILES.get(backend_of(config))


def _plan_version(model: str, version: int, folder: Path, config: cfg.ModelConfig, text: str, served: str | None,
                  target: Path | None, carried: dict[str, bytes], base_size: int) -> VersionPlan:
    """``text``: the model's config.pbtxt; ``served``: the config an existing manifest must record (None
    when trm keeps the model folder, see ``_kept_by_trm``)."""
    backend = backend_of(config)
    try:
        files = _files(folder)
    except SourceReadError as exc:
        return VersionPlan(version, "refused", exc.message)
    has_manifest = files.pop(MANIFEST_NAME, None) is not None
    size = sum(s for s in files.values())
    expected = model_file(config)
    if backend != "ensemble" and expected and expected not in files \
            and not any(path.startswith(f"{expected}/") for path in files):
        return VersionPlan(version, "refused", f"{folder}: no model file {expected} (what Triton loads for "
                                               f"backend {backend})", len(files), size)
    if backend != "ensemble" and not files:
        return VersionPlan(version, "refused", f"{folder}: empty version folder", 0, 0)
    projected = base_size + _files_json_size(files)
    if projected > MAX_MANIFEST_BYTES - MANIFEST_RESERVE_BYTES:
        return VersionPlan(version, "refused", f"{folder}: its manifest would take {projected / 2**20:.1f} MiB "
                           f"({len(files)} files), more than the {(MAX_MANIFEST_BYTES - MANIFEST_RESERVE_BYTES) >> 20} "
                           "MiB trm records and reads back (pack the files into fewer)", len(files), size)
    manifest_path = folder / MANIFEST_NAME
    if has_manifest:
        try:
            manifest = read_manifest(folder)
        except IntegrityError as exc:
            return VersionPlan(version, "refused", f"{manifest_path}: {exc.message}", len(files), size)
        except OSError as exc:
            return VersionPlan(version, "refused", f"{manifest_path} cannot be read ({exc.strerror})", len(files),
                               size)
        problem = _disagreement(manifest, model, version, folder, files, served, carried, backend)
        if problem is not None:
            return VersionPlan(version, "refused", f"{manifest_path} {problem}: adopt refuses it rather than "
                               "replace it (remove it to adopt the version again)", len(files), size)
        if target is None:
            return VersionPlan(version, "present", None, len(files), size)
    if target is not None:
        existing = LocalRepository(target).version_dir(model, version)
        if existing.exists():
            try:
                theirs = read_manifest(existing)
            except (IntegrityError, OSError):
                theirs = None
            if theirs is not None and _disagreement(theirs, model, version, folder, files, text, carried,
                                                    backend) is None:
                return VersionPlan(version, "present", None, len(files), size)
            return VersionPlan(version, "refused", f"{existing} already holds a different version {version} "
                                                   f"of {model}", len(files), size)
    return VersionPlan(version, "adopt", None, len(files), size)


def _files(folder: Path) -> dict[str, int]:
    """relative path -> size of every regular file, read inside the folder (``paths.walk_inside``: links,
    special files, unreadable files and folders and unrecordable names are refused, naming the path);
    Python's __pycache__ is not content. The manifest is listed too, when there is one."""
    return walk_inside(folder, skip_folders=NOT_CONTENT)


def _files_json_size(files: dict[str, int]) -> int:
    """How many bytes ``files`` add to a manifest (``Manifest.to_json``: the list sits at the same depth)."""
    entries = [{"path": path, "sha256": "0" * 64, "size": size} for path, size in files.items()]
    return len(json.dumps({"files": entries}, indent=2, sort_keys=True)) - len(json.dumps({"files": []}, indent=2))


def _disagreement(manifest: Manifest, model: str, version: int, folder: Path, files: dict[str, int],
                  config: str | None, carried: dict[str, bytes], backend: str) -> str | None:
    """Why an existing manifest is not what adopting this version would record now (None when it is): its
    files (sizes and sha256), its config (byte for byte, as adopt records it), its label and data files,
    and a verification it could not have had. A manifest found in a repository is a claim, not a proof."""
    if manifest.model != model or manifest.version != version or not _matches(manifest, folder, files):
        return "does not match the files beside it (`trm validate` shows how)"
    if config is not None and manifest.config != config:
        return "records another config than the model's config.pbtxt (Triton serves the version with that one)"
    if config is not None and manifest.model_files != carried:
        return "carries other label or data files than the model folder holds now"
    record, source = manifest.verification, manifest.source
    if not isinstance(record.get("passed"), bool) and record.get("skipped") is not True:
        return "records no verification result"  # (neither a result nor a verification skipped, as publish records)
    if source.get("kind") == "adopted" and \
            source.get("config_sha256") != hashlib.sha256(manifest.config.encode()).hexdigest():
        return "says adopt wrote it, but its source record does not match its config"
    if record.get("passed") is True:
        if source.get("kind") == "adopted" and backend not in RUNNABLE_BACKENDS and backend != "ensemble":
            return f"says the version was verified, but adopt cannot run backend {backend} to verify it"
        if not all(key in record for key in ("server", "samples", "outputs_checked")):
            return "says the version was verified but holds no verification report"
    return None


def _matches(manifest: Manifest, folder: Path, files: dict[str, int]) -> bool:
    listed = {f.path: f for f in manifest.files}
    if set(listed) != set(files):
        return False
    localized = localized_paths(manifest.config)  # a vLLM model.json: installed with another size than recorded
    return all((p in localized or files[p] == f.size) and entry_digest(manifest.config, folder, f) == (f.sha256, f.size)
               for p, f in listed.items())


# ----------------------------------------------------------------------------------------- ensembles

def _plan_ensemble(plan: ModelPlan, plans: dict[str, ModelPlan], target: Path | None) -> ModelPlan:
    """Members exist, their tensors are wired consistently, and each version pins the members it finds."""
    config = cfg.parse_config(plan.config_text, str(plan.folder / CONFIG_NAME))
    produced = {t.name for t in config.input}
    member_configs: dict[str, cfg.ModelConfig] = {}
    member_versions: dict[str, list[int]] = {}
    for step in config.ensemble_scheduling.step:
        member = step.model_name
        if member in member_configs:
            continue
        if member in plans and plans[member].config_text and not plans[member].refused:
            member_configs[member] = cfg.parse_config(plans[member].config_text)
            member_versions[member] = sorted(v.version for v in plans[member].versions
                                             if v.action in ("adopt", "present"))
        elif target is not None and (target / member / CONFIG_NAME).is_file():
            repo = LocalRepository(target)
            member_configs[member] = repo.config(member)
            member_versions[member] = repo.versions(member)
        else:
            why = plans[member].refused if member in plans and plans[member].refused else "not in the repository"
            return _refuse(plan, f"ensemble step model {member!r} cannot be adopted: {why}")
    for step in config.ensemble_scheduling.step:
        member = member_configs[step.model_name]
        inputs = {t.name for t in member.input}
        outputs = {t.name for t in member.output}
        for key, value in step.input_map.items():
            if key not in inputs:
                return _refuse(plan, f"step {step.model_name}: {key!r} is not an input of {step.model_name}")
            if value not in produced:
                return _refuse(plan, f"step {step.model_name}: tensor {value!r} is neither an ensemble input "
                                     "nor an earlier step's output")
        for key, value in step.output_map.items():
            if key not in outputs:
                return _refuse(plan, f"step {step.model_name}: {key!r} is not an output of {step.model_name}")
            produced.add(value)
    for out in config.output:
        if out.name not in produced:
            return _refuse(plan, f"ensemble output {out.name!r} is produced by no step")
    pins: dict[str, int] = {}
    for step in config.ensemble_scheduling.step:
        available = member_versions[step.model_name]
        policy = member_configs[step.model_name].version_policy
        if step.model_version <= 0 and policy.HasField("specific"):
            # -1 is the newest version Triton serves, and a specific policy serves only the versions it lists
            available = sorted(set(available) & set(policy.specific.versions))
        wanted = step.model_version if step.model_version > 0 else (available[-1] if available else 0)
        if wanted not in available:
            asked = step.model_version if step.model_version > 0 else "latest"
            return _refuse(plan, f"step {step.model_name}: version {asked} is not an adoptable version of it")
        pins[step.model_name] = wanted
    notes = plan.notes
    if not all(plans[m].runnable for m in pins if m in plans):
        notes = (*notes, "a member's backend cannot run on the embedded server: the ensemble is adopted unverified")
    return dataclasses.replace(plan, notes=notes, members={v.version: dict(pins) for v in plan.versions})
