"""The local Triton model repository, with trm's versions.

Layout (what Triton reads, plus trm's manifest in each version)::

    <root>/<model>/config.pbtxt
    <root>/<model>/<N>/<files>
    <root>/<model>/<N>/trm-manifest.json

Writing a version: ``stage()`` gives a temporary folder *inside the model folder* (same filesystem;
Triton ignores non-numeric folders), the caller fills it, then ``commit()`` writes the manifest last and
renames the folder to ``<N>``. The rename is the commit point: a crash before it leaves only a
``.trm-tmp-*`` folder that readers ignore and ``clean_staging()`` removes. config.pbtxt follows the
newest version's manifest; ``commit()`` replaces it atomically right after the rename, and
``repair_config()`` brings it back in line if a crash fell between the two.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from repo_manager.core import config as cfg
from repo_manager.core import paths
from repo_manager.core.errors import ConflictError, InputError, IntegrityError, NotFoundError
from repo_manager.core.localized import (
    MAX_BYTES,
    can_localize,
    entry_digest,
    install_file,
    is_installed,
    localized_paths,
    model_path,
    recorded_bytes,
)
from repo_manager.core.manifest import (
    BYTECODE_CACHE,
    MANIFEST_NAME,
    MAX_VERSION,
    FileEntry,
    Manifest,
    check_label_path,
    check_model_name,
    read_manifest,
)

STAGING_PREFIX = ".trm-tmp-"
CONFIG_NAME = "config.pbtxt"
_CANONICAL_VERSION = re.compile(r"^[1-9][0-9]{0,18}$")
# what Triton's std::stoll reads as a number: leading whitespace, a sign, then a digit (anything may follow)
_TRITON_NUMBER = re.compile(r"^[ \t\n\v\f\r]*[+-]?([0-9]+)")


def version_of(name: str) -> int | None:
    """The version a folder name stands for: canonical decimal names only ('1', '12'), never '01', '1.0',
    ' 1' or non-ASCII digits."""
    if _CANONICAL_VERSION.match(name) and int(name) <= MAX_VERSION:
        return int(name)
    return None


def non_canonical_version(name: str) -> str | None:
    """Why a folder name that is not a trm version would still be mistaken for one, or None.

    Triton (model_lifecycle.cc, VersionsToLoad) skips names with a leading zero and reads the others with
    std::stoll, which accepts leading spaces, a sign and trailing characters: ' 1', '+1' and '1.0' are all
    version 1 to Triton, beside a real '1'."""
    if version_of(name) is not None:
        return None
    if len(name) > 1 and name.startswith("0") and name.isdigit():
        return "has a leading zero: Triton ignores it, trm does not count it as a version"
    match = _TRITON_NUMBER.match(name)
    if name == "0":
        return "version 0: Triton would load it, trm versions start at 1"
    if match:
        number = int(match.group(1))
        if number > MAX_VERSION:
            return "is a number too large for Triton (int64)"
        return f"is not a canonical version number, but Triton would load it as version {number}"
    if name.isdigit():  # non-ASCII digits
        return "is made of non-ASCII digits: not a version"
    return None


@dataclass(frozen=True)
class Problem:
    model: str
    version: int | None
    message: str

    def __str__(self) -> str:
        where = self.model if self.version is None else f"{self.model}/{self.version}"
        return f"{where}: {self.message}"


class LocalRepository:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._staged: list[Path] = []

    # ------------------------------------------------------------------------------------ reading
    def model_dir(self, model: str) -> Path:
        return self.root / check_model_name(model)

    def version_dir(self, model: str, version: int) -> Path:
        return self.model_dir(model) / str(version)

    def models(self) -> list[str]:
        return self.scan()[0]

    def scan(self) -> tuple[list[str], list[str]]:
        """(models, notes): every folder holding a model, and a note for each folder skipped (a name Triton
        and trm cannot serve such as ``lost+found``, a folder that cannot be read)."""
        if not self.root.is_dir():
            return [], []
        models, notes = [], []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".") or not p.is_dir():
                continue
            try:
                check_model_name(p.name)
            except InputError:
                if not _has_config(p):  # a model with a bad name is a problem validate reports, not a note
                    notes.append(f"{p.name}: not a model folder, skipped")
                continue
            try:
                if (p / CONFIG_NAME).exists() or self.versions(p.name):
                    models.append(p.name)
            except OSError as exc:
                notes.append(f"{p.name}: cannot be read ({exc.strerror}), skipped")
        return models, notes

    def case_twins(self, model: str) -> list[str]:
        """Other model folders whose names differ from ``model`` only in case: they collide on a
        case-insensitive filesystem or bucket, and Triton would serve two models for one name there."""
        if not self.root.is_dir():
            return []
        folded = check_model_name(model).casefold()
        try:
            return sorted(p.name for p in self.root.iterdir()
                          if p.name != model and p.name.casefold() == folded and p.is_dir())
        except OSError:
            return []

    def check_no_case_twin(self, model: str) -> None:
        twins = self.case_twins(model)
        if twins:
            raise InputError(f"model {model} differs only in case from {', '.join(twins)} in {self.root}",
                             hint="model names must differ in more than case (they collide on "
                                  "case-insensitive filesystems and buckets); choose another name",
                             model=model)

    def _numeric_dirs(self, model: str) -> list[int]:
        folder = self.model_dir(model)
        if not folder.is_dir():
            return []
        return sorted(v for v in (version_of(p.name) for p in folder.iterdir() if p.is_dir()) if v is not None)

    def versions(self, model: str) -> list[int]:
        """Complete versions only: those whose manifest exists."""
        return [v for v in self._numeric_dirs(model)
                if (self.version_dir(model, v) / MANIFEST_NAME).is_file()]

    def latest(self, model: str) -> int:
        versions = self.versions(model)
        if not versions:
            raise NotFoundError(f"model {model!r} has no published version in {self.root}",
                                hint="publish one with `trm publish model`", model=model)
        return versions[-1]

    def manifest(self, model: str, version: int | None = None) -> Manifest:
        version = self.latest(model) if version is None else version
        folder = self.version_dir(model, version)
        if not (folder / MANIFEST_NAME).is_file():
            raise NotFoundError(f"model {model!r} has no version {version} in {self.root}",
                                model=model, version=version)
        return read_manifest(folder)

    def config(self, model: str) -> cfg.ModelConfig:
        path = self.model_dir(model) / CONFIG_NAME
        if not path.exists():
            raise NotFoundError(f"model {model!r} not found in {self.root}", model=model,
                                hint="`trm list` shows the models")
        return cfg.read_config(path)

    def installed_config(self, manifest: Manifest) -> str:
        """The config.pbtxt text this repository serves ``manifest`` with: the config it was validated
        with, except that a TensorRT-LLM engine's ``gpt_model_path`` (the backend wants an absolute path,
        recorded by the publisher on its own disk) names the version folder in this repository."""
        text = manifest.config
        if "gpt_model_path" not in text:
            return text
        from repo_manager.core.localized import localize_gpt_model_path  # noqa: PLC0415 - LLM versions only

        config = cfg.parse_config(text, f"config of {manifest.model}/{manifest.version}")
        localized = localize_gpt_model_path(config, self.version_dir(manifest.model, manifest.version))
        if localized == config:
            return text  # published into this repository: keep the exact validated text
        return cfg.config_to_text(localized)

    def model_files_differ(self, manifest: Manifest) -> bool:
        """True when a model-folder file the manifest carries (a label file, warm-up data) is missing or
        different beside config.pbtxt."""
        folder = self.model_dir(manifest.model)
        for path, content in manifest.model_files.items():
            try:  # a link anywhere on the way (``labels/sub -> /elsewhere``) differs: Triton would read through it
                if paths.read_inside(folder, path, len(content)) != content:
                    return True
            except (OSError, paths.SourceReadError):
                return True
        return False

    def install_model_files(self, manifest: Manifest) -> bool:
        """Write, atomically, the model-folder files the manifest carries beside config.pbtxt (Triton reads
        ``label_filename`` and ``warmup/<input_data_file>`` from the model folder, and fails the load when one
        is missing). True if any changed."""
        if not self.model_files_differ(manifest):
            return False
        folder = self.model_dir(manifest.model)
        for path, content in manifest.model_files.items():
            check_label_path(path)
            target = paths.check_within(self.root, folder / path)  # no link anywhere on the way
            if not target.is_file() or target.read_bytes() != content:
                paths.make_dirs(self.root, target.parent)
                cfg.atomic_write_bytes(target, content)
        return True

    def next_version(self, model: str) -> int:
        """Highest version folder present (complete or not) + 1, so a number is never reused."""
        numbers = self._numeric_dirs(model)
        return (numbers[-1] + 1) if numbers else 1

    # ------------------------------------------------------------------------------------ writing
    def stage(self, model: str) -> Path:
        """A fresh temporary folder for a new version of ``model``, on the repository's filesystem."""
        folder = self.model_dir(model)
        self.check_no_case_twin(model)
        # the owner's pid in the name: `validate --fix` leaves the folders of running writers alone
        staging = folder / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        try:
            paths.make_dirs(self.root, folder)
            staging.mkdir()
        except OSError as exc:
            raise InputError(f"cannot write a version into {folder}: {exc.strerror}",
                             hint="pass a writable folder to --repo") from exc
        self._staged.append(staging)
        return staging

    @contextmanager
    def staging(self, model: str) -> Iterator[Path]:
        """``with repo.staging(model) as folder:`` a fresh staging folder (``stage``) that does not outlive
        the block: committed inside it (renamed into a version), or removed on the way out, after an error
        or a signal's exit too. Whatever stands at its path by then (a link or file an exchange left) is
        removed, never followed."""
        with self.staging_scope():
            yield self.stage(model)

    @contextmanager
    def staging_scope(self) -> Iterator[None]:
        """``with repo.staging_scope():`` for a step that stages several folders and commits them later (a
        publish: a converter stages an ensemble's members, verification runs, then each is committed). No
        folder ``stage`` gives inside the block outlives it: what is not committed by the end is removed,
        after an error or a signal's exit too, as ``staging`` does for one folder."""
        before = set(self._staged)
        try:
            yield
        finally:
            for folder in [s for s in self._staged if s not in before]:
                self._release(folder)

    def _release(self, folder: Path) -> None:
        """Forget a staging folder: removed unless committed (renamed away); a link or file standing at its
        path is unlinked, never followed."""
        if folder.is_symlink() or folder.is_file():
            folder.unlink(missing_ok=True)
        if folder.is_dir():
            self.discard(folder)
        elif folder in self._staged:
            self._staged.remove(folder)

    def discard(self, staging: Path) -> None:
        """Remove a staging folder; drop the model folder too if it holds nothing else."""
        if staging in self._staged:
            self._staged.remove(staging)
        shutil.rmtree(staging, ignore_errors=True)
        model_dir = staging.parent
        try:
            if model_dir.is_dir() and not any(model_dir.iterdir()):
                model_dir.rmdir()
        except OSError:
            pass

    def commit(self, staging: Path, manifest: Manifest, *, update_config: bool = True) -> Path:
        """Write the manifest (last), rename the staged folder to its version, then install its config.

        Raises ConflictError if another writer took that version number first; the staged folder is
        left in place so that the caller can retry with the next number.
        """
        model = manifest.model
        if staging.parent != self.model_dir(model):
            raise InputError(f"{staging} is not a staging folder of model {model}")
        paths.check_within(self.root, self.version_dir(model, manifest.version))
        block_bytecode_cache(staging)
        cfg.atomic_write_bytes(staging / MANIFEST_NAME, manifest.to_json())
        _fsync_dir(staging)
        target = self.version_dir(model, manifest.version)
        try:
            # os.rename onto an existing non-empty folder fails, but onto an empty one it succeeds:
            # refuse any existing target first; the rename itself settles a race on a non-empty one.
            if target.exists():
                raise FileExistsError(errno.EEXIST, "exists", str(target))
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise ConflictError(f"version {manifest.version} of {model} was taken by another writer",
                                    model=model, version=manifest.version) from exc
            raise InputError(f"cannot write version {manifest.version} of {model} into {self.root}: "
                             f"{exc.strerror or exc}", hint="pass a writable folder to --repo",
                             model=model, version=manifest.version) from exc
        _fsync_dir(target.parent)
        if update_config:
            self.repair_config(model)
        return target

    def repair_config(self, model: str) -> bool:
        """Make config.pbtxt equal to the newest version's validated config. True if it changed.

        Two publishers committing N and N+1 at once may each write "their" newest config; whoever wrote
        looks again afterwards and rewrites when a newer version appeared meanwhile, so the last write to
        land is always the newest version's config.
        """
        changed = False
        path = paths.check_within(self.root, self.model_dir(model) / CONFIG_NAME)
        for _ in range(10):
            versions = self.versions(model)
            if not versions:
                return changed
            newest = read_manifest(self.version_dir(model, versions[-1]))
            changed = self.install_model_files(newest) or changed
            wanted = self.installed_config(newest)
            if path.exists() and path.read_text() == wanted:
                return changed
            # the exact validated text (an adopted version keeps its author's), checked through the schema
            cfg.parse_config(wanted, f"manifest of {model}/{versions[-1]}")
            cfg.atomic_write_bytes(path, wanted.encode())
            changed = True
            if self.versions(model)[-1] == versions[-1]:
                return changed
        return changed

    def clean_staging(self, model: str | None = None, *, ours: bool = False) -> list[Path]:
        """Remove leftover staging folders (from a crash). Returns what was removed.

        ``ours``: also folders named with this process's own pid, for a caller that has written
        nothing yet: a process restarted in a container gets the pid its killed predecessor had (often
        1), so that predecessor's folders would otherwise look like a running writer's forever.
        """
        removed = []
        if not self.root.is_dir():
            return removed
        mine = f"{STAGING_PREFIX}{os.getpid()}-"
        for name in [model] if model else [p.name for p in self.root.iterdir() if p.is_dir()]:
            folder = self.root / name
            if folder.is_symlink() or not folder.is_dir():
                continue  # never delete through a link: what it points to is not this repository's
            for child in folder.iterdir():
                if child.name.startswith(STAGING_PREFIX) and (
                        not _owner_running(child.name) or (ours and child.name.startswith(mine))):
                    paths.remove_tree(self.root, child)
                    removed.append(child)
            if removed and not any(folder.iterdir()):
                folder.rmdir()  # a first publish that never committed: leave no empty model folder
        return removed

    # --------------------------------------------------------------------------------- validation
    def validate(self) -> list[Problem]:
        """Every problem in the repository: layout, config schema, manifests, checksums."""
        problems: list[Problem] = []
        if not self.root.is_dir():
            return [Problem(str(self.root), None, "repository folder does not exist")]
        models, _ = self.scan()
        checked = set(models) | self._unservable(models)
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if model_dir.name not in checked:
                continue  # lost+found and the like: a note from scan(), not a problem
            try:
                problems.extend(self._validate_model(model_dir))
            except OSError as exc:  # e.g. a folder of another user's, mode 0700
                problems.append(Problem(model_dir.name, None, f"cannot be read ({exc.strerror})"))
        folded: dict[str, list[str]] = {}
        for name in models:
            folded.setdefault(name.casefold(), []).append(name)
        for names in folded.values():
            if len(names) > 1:
                problems.append(Problem(names[0], None, f"models {', '.join(names)} differ only in case: they "
                                                        "collide on a case-insensitive filesystem or bucket"))
        return problems

    def _unservable(self, models: list[str]) -> set[str]:
        """Folders that hold no model but look like one (a valid name, or a config.pbtxt): reported."""
        names = set()
        for p in self.root.iterdir():
            if p.name.startswith(".") or p.name in models or not p.is_dir():
                continue
            try:
                check_model_name(p.name)
            except InputError:
                if not _has_config(p):
                    continue
            names.add(p.name)
        return names

    def _validate_model(self, model_dir: Path) -> list[Problem]:
        name = model_dir.name
        problems: list[Problem] = []
        try:
            check_model_name(name)
        except InputError as exc:
            return [Problem(name, None, exc.message)]
        config_path = model_dir / CONFIG_NAME
        if model_dir.is_symlink() and not model_dir.resolve().is_relative_to(self.root.resolve()):
            problems.append(Problem(name, None, f"the model folder is a symbolic link out of the repository "
                                                f"(to {os.readlink(model_dir)}); trm never writes through it"))
        if not config_path.exists():
            if self.versions(name):
                problems.append(Problem(name, None, "config.pbtxt is missing (interrupted publish; "
                                                    "`trm validate --fix` rewrites it from the latest manifest)"))
            elif not any(c.name.startswith(STAGING_PREFIX) for c in model_dir.iterdir()):
                problems.append(Problem(name, None, "no config.pbtxt and no versions: not a model"))
        else:
            try:
                config = cfg.read_config(config_path)
                if config.name and config.name != name:
                    problems.append(Problem(name, None, f"config.pbtxt names the model {config.name!r}"))
            except InputError as exc:
                problems.append(Problem(name, None, exc.message))
        for child in sorted(model_dir.iterdir()):
            if child.name.startswith(STAGING_PREFIX):
                problems.append(Problem(name, None, f"leftover staging folder {child.name} (interrupted "
                                                    "publish; `trm validate --fix` removes it)"))
            elif child.is_dir() and version_of(child.name) is not None:
                problems.extend(self._validate_version(name, int(child.name), child))
            elif child.is_dir() and non_canonical_version(child.name):
                problems.append(Problem(name, None, f"folder {child.name!r} {non_canonical_version(child.name)}"
                                                    "; rename or remove it"))
        versions = self.versions(name)
        if versions and config_path.exists():
            try:
                newest = read_manifest(model_dir / str(versions[-1]))
                if self.installed_config(newest) != config_path.read_text():
                    problems.append(Problem(name, None, f"config.pbtxt differs from the config version "
                                                        f"{versions[-1]} was validated with"))
                if self.model_files_differ(newest):
                    problems.append(Problem(name, None, f"a label or data file is missing or differs from what "
                                                        f"version {versions[-1]} carries (`trm validate --fix` "
                                                        "rewrites it)"))
            except IntegrityError:
                pass  # reported by the version check
        return problems

    def _validate_version(self, model: str, version: int, folder: Path) -> list[Problem]:
        if not (folder / MANIFEST_NAME).is_file():
            return [Problem(model, version, "no manifest: incomplete version, ignored by trm")]
        try:
            manifest = read_manifest(folder)
        except IntegrityError as exc:
            return [Problem(model, version, exc.message)]
        problems = []
        if manifest.model != model or manifest.version != version:
            problems.append(Problem(model, version, f"manifest is for {manifest.model}/{manifest.version}"))
        try:
            cfg.parse_config(manifest.config, "manifest config")
        except InputError as exc:
            problems.append(Problem(model, version, exc.message))
        listed = {f.path for f in manifest.files}
        try:
            present = _present_files(folder)
        except OSError as exc:
            return problems + [Problem(model, version, f"cannot read files: {exc}")]
        for extra in sorted(present - listed):
            problems.append(Problem(model, version, f"file {extra} is not in the manifest"))
        localized = localized_paths(manifest.config)
        for entry in manifest.files:
            path = folder / entry.path
            if path.is_symlink():
                problems.append(Problem(model, version, f"file {entry.path} is a symbolic link (a version holds its "
                                                        "own files)"))
            elif path.exists() and not path.is_file():
                problems.append(Problem(model, version, f"file {entry.path} is not a regular file"))
            elif not path.is_file():
                problems.append(Problem(model, version, f"file {entry.path} is missing"))
            else:
                problems.extend(self._check_file(manifest, folder, entry, localized))
        return problems

    def _check_file(self, manifest: Manifest, folder: Path, entry: FileEntry,
                    localized: frozenset[str]) -> list[Problem]:
        where = (manifest.model, manifest.version)
        try:
            digest, size = entry_digest(manifest.config, folder, entry)
        except paths.SourceReadError as exc:
            return [Problem(*where, f"file {entry.path}: {exc.message}")]
        if size != entry.size:
            return [Problem(*where, f"file {entry.path} has size {size}, manifest says {entry.size}")]
        if digest != entry.sha256:
            return [Problem(*where, f"file {entry.path} does not match its sha256")]
        named = model_path(paths.read_inside(folder, entry.path, entry.size + MAX_BYTES)) \
            if entry.path in localized else None
        if named is not None and named != str(folder.resolve()):
            fix = ("`trm validate --fix` rewrites it" if can_localize(folder, entry) else
                   "it was recorded naming its publisher's folder: publish the version again to serve it here")
            return [Problem(*where, f"file {entry.path} names the folder {named}, not this version's folder "
                                    f"(the engine would load that one); {fix}")]
        return []

    def localize(self, model: str) -> list[str]:
        """Rewrite every installed file of ``model`` that names another folder than its version's (a
        version folder copied from another repository root) and whose recorded form allows it. Returns the
        files rewritten."""
        done = []
        for version in self.versions(model):
            folder = self.version_dir(model, version)
            try:
                manifest = read_manifest(folder)
            except IntegrityError:
                continue
            for entry in manifest.files:
                if entry.path in localized_paths(manifest.config) and can_localize(folder, entry) \
                        and not is_installed(folder, entry):
                    install_file(folder / entry.path, folder, recorded_bytes(folder, entry))
                    done.append(f"{model}/{version}/{entry.path}")
        return done


def _has_config(folder: Path) -> bool:
    try:
        return (folder / CONFIG_NAME).is_file()
    except OSError:
        return False


def _owner_running(name: str) -> bool:
    """True when a staging folder's name carries the pid of a process that is still running here (a
    publish or sync still writing it). Folders from other hosts sharing the repository, or named before
    pids were recorded, count as leftovers."""
    pid = name[len(STAGING_PREFIX):].split("-", 1)[0]
    if not pid.isdigit() or len(pid) > 9:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def block_bytecode_cache(version: Path) -> None:
    """An empty file named ``__pycache__`` in every folder of ``version`` that holds a ``.py`` file, unless that
    name exists: Python then writes no bytecode there (it cannot make the folder, and carries on).

    Triton reloads a model whose folder changed since it was loaded, and a Python model's stub writes
    ``__pycache__/model.cpython-3XX.pyc`` into its version folder while it loads: the next load of the model, or
    of an ensemble that has it as a member, then reloads it for nothing. Measured on the agent's first
    convergence of an encoder ensemble: the tokenizer was started twice, and the second start once aborted
    tritonserver (``boost::interprocess::lock_exception``, SIGABRT). Not content: manifests and checks skip it."""
    for folder in sorted({p.parent for p in version.rglob("*.py")
                          if p.is_file() and not p.is_symlink() and BYTECODE_CACHE not in p.parts}):
        blocker = folder / BYTECODE_CACHE
        if not blocker.exists() and not blocker.is_symlink():
            blocker.write_bytes(b"")


def _present_files(folder: Path) -> set[str]:
    # __pycache__ is what a Python backend writes next to model.py when the server lets it: not content.
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if (p.is_symlink() or not p.is_dir()) and p.name != MANIFEST_NAME and BYTECODE_CACHE not in p.parts}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
