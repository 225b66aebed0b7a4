"""Verification: load a staged version on a real Triton server and compare its answers with a reference.

The staged files are sent through Triton's load API (config override + file overrides) under a
temporary, unique model name, so verification never touches the target repository, never replaces a
model the server is serving, and works the same on the embedded server and on ``--url``. Several models
(an ensemble and its members) are loaded together with their names mapped to temporary ones.

Ensembles are the exception: when Triton loads an ensemble it polls every member from its repository
folders, even a member already loaded through the load API, so an ensemble cannot be loaded from file
overrides alone. Their candidates are written (hard links where possible) into the repository of a
server that trm starts for the purpose (``repository=``), still under temporary names, and loaded
from there.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from repo_manager.adapters.repository import block_bytecode_cache
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.core import config as cfg
from repo_manager.core.errors import ModelLoadError, TrmError, VerificationError
from repo_manager.core.localized import install_file, localized_paths, stored_form

Reference = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
Check = Callable[[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]], dict[str, Any]]
"""(sample, Triton's answer, the reference's answer) -> a record for the manifest; raises
VerificationError when they disagree. Replaces the element-wise comparison where a format has a better
criterion (cosine similarity of embeddings, say)."""


@dataclass(frozen=True)
class Candidate:
    """A model to load for verification: its config and its version folder's files."""

    name: str
    config: cfg.ModelConfig
    files: Mapping[str, Path]
    """relative path inside the version folder -> file on disk."""
    model_files: Mapping[str, bytes] = field(default_factory=dict)
    """Files the config makes Triton read from the model folder (label files, warm-up data): path there ->
    bytes. Triton fails a load without them."""


@dataclass
class Tolerance:
    atol: float = 1e-4
    rtol: float = 1e-3

    @classmethod
    def for_dtype(cls, dtype: np.dtype) -> Tolerance:
        if dtype == np.float16:
            return cls(atol=2e-2, rtol=1e-2)
        if dtype.kind in ("i", "u", "b", "O", "S", "U"):
            return cls(atol=0.0, rtol=0.0)
        return cls()


@dataclass
class VerificationReport:
    server: str
    samples: int = 0
    outputs_checked: int = 0
    worst: dict[str, float] = field(default_factory=dict)
    """output name -> worst absolute difference seen."""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server, "samples": self.samples, "outputs_checked": self.outputs_checked,
                "worst_abs_diff": self.worst, "seconds": round(self.seconds, 3), "passed": True,
                **self.extra}


def temporary_names(names: list[str]) -> dict[str, str]:
    token = uuid.uuid4().hex[:8]
    return {name: f"trm-verify-{token}-{name}"[:120] for name in names}


def _renamed(config: cfg.ModelConfig, names: dict[str, str]) -> cfg.ModelConfig:
    copy = cfg.ModelConfig()
    copy.CopyFrom(config)
    copy.name = names[config.name]
    for step in copy.ensemble_scheduling.step:
        if step.model_name in names:
            step.model_name = names[step.model_name]
            step.model_version = -1
    copy.ClearField("version_policy")
    return copy


class LoadedCandidates:
    """Context manager: load candidates under temporary names (members before ensembles), unload after.

    With ``repository`` (the server's own model repository folder) the candidates are written there and
    loaded by name; otherwise they are sent as file overrides.

    A load that Triton failed because a Python stub was declared unhealthy (``STUB_DECLARED_UNHEALTHY``: a
    stub stalled by its host for a second during its initialize or warm-up, or one that died there) is made
    once more: a stalled stub's model loads then, a dying one fails again, and that failure is the error.
    ``reloaded_after`` keeps the first failure.
    """

    def __init__(self, client: TritonClient, candidates: list[Candidate], repository: Path | None = None) -> None:
        self.client = client
        self.candidates = candidates
        self.repository = repository
        self.names = temporary_names([c.name for c in candidates])
        self._loaded: list[str] = []
        self.reloaded_after: list[str] = []

    def __enter__(self) -> LoadedCandidates:
        try:
            for candidate in sorted(self.candidates, key=lambda c: c.config.HasField("ensemble_scheduling")):
                temp = self.names[candidate.name]
                config = _renamed(candidate.config, self.names)
                if self.repository is not None:
                    write_candidate(self.repository / temp, config, candidate.files, candidate.model_files)
                    self._load(temp)
                else:
                    files = {f"1/{rel}": Path(path).read_bytes() for rel, path in candidate.files.items()}
                    files.update(candidate.model_files)
                    self._load(temp, config, files or None)
                self._loaded.append(temp)
        except BaseException:  # not a staging folder: __exit__ never runs when __enter__ fails, so unload here
            self.__exit__(None, None, None)
            raise
        return self

    def _load(self, name: str, config: cfg.ModelConfig | None = None, files: dict[str, bytes] | None = None) -> None:
        try:
            self.client.load(name, config, files)
        except ModelLoadError as exc:
            if not STUB_DECLARED_UNHEALTHY.search(exc.message):
                raise
            self.reloaded_after.append(exc.message)
            try:
                self.client.load(name, config, files)
            except ModelLoadError as again:
                raise ModelLoadError(f"{again.message} (the same happened on a first try)" if
                                     STUB_DECLARED_UNHEALTHY.search(again.message) else
                                     f"{again.message} (on a second try: the first failed with {exc.message})",
                                     hint=again.hint, **again.facts) from again

    def __exit__(self, *exc: object) -> None:
        for temp in reversed(self._loaded):
            try:
                self.client.unload(temp)
            except TrmError:
                pass
        self._loaded.clear()


def write_candidate(folder: Path, config: cfg.ModelConfig, files: Mapping[str, Path],
                    model_files: Mapping[str, bytes] | None = None) -> None:
    """``folder``/config.pbtxt and ``folder``/1/<files>: hard links to the staged files, copies across filesystems;
    model-folder files (label files, warm-up data) beside config.pbtxt."""
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    for path, content in (model_files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(content)
    localized = localized_paths(cfg.config_to_text(config))
    for rel, source in files.items():
        target = version / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        if rel in localized:  # a vLLM model.json names this candidate's folder (a new file, not the link)
            install_file(target, version, stored_form(target.read_bytes()))
    block_bytecode_cache(version)  # else the ensemble's load starts a Python member a second time
    cfg.write_config(folder / "config.pbtxt", config)


def compare(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """Worst absolute difference; raises VerificationError when outside tolerance or shapes differ."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise VerificationError(f"output {name}: Triton returned shape {list(got.shape)}, "
                                f"the reference {list(want.shape)}")
    if want.dtype.kind in ("O", "S", "U"):
        if not np.array_equal(got.astype(np.object_), want.astype(np.object_)):
            raise VerificationError(f"output {name}: strings differ from the reference")
        return 0.0
    if got.size == 0:
        return 0.0
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    worst = float(np.nanmax(diff))
    tol = Tolerance.for_dtype(want.dtype)
    if not np.allclose(got.astype(np.float64), want.astype(np.float64), atol=tol.atol, rtol=tol.rtol,
                       equal_nan=True):
        raise VerificationError(f"output {name} differs from the reference: worst absolute difference "
                                f"{worst:.3g} (tolerance atol={tol.atol:g}, rtol={tol.rtol:g})", worst=worst)
    return worst


T = TypeVar("T")

STUB_DECLARED_UNHEALTHY = re.compile(r"Stub process '[^']*' is not healthy")
"""Triton's python backend fails a request with this when the stub has not answered within 1 s and its health
thread (which marks it alive every 300 ms) has not run in that second either: a stub that died, or one that was
stalled, as a host that pauses the process for a second stalls it. Which of the two only a second try tells."""


def verify(client: TritonClient, candidates: list[Candidate], entry: str,
           samples: list[dict[str, np.ndarray]], reference: Reference | None,
           check: Check | None = None, repository: Path | None = None) -> VerificationReport:
    """Load ``candidates``, send ``samples`` to ``entry`` and compare with ``reference``.

    With ``check`` (and a reference), each answer is judged by ``check`` instead of element-wise, and
    its records go into the report under ``cases``. ``repository``: see ``LoadedCandidates``.

    Without a reference (a Python-backend model) the answers are checked against the config: every
    declared output present, with the declared type and the request's batch size.

    A request that Triton failed because a Python stub was declared unhealthy is not a verdict on the
    model: the candidates are unloaded and the whole verification runs once more on freshly loaded ones
    (a stub that was stalled answers then; one that dies dies again, and that failure is the error).
    The report says so under ``reloaded_after``. (A load that failed that way was already made once more by
    ``LoadedCandidates``: its failure is final here.)
    """
    started = time.monotonic()
    report, first = once_more_if_a_stub_stalled(
        lambda: _verify_once(client, candidates, entry, samples, reference, check, repository))
    if first is not None:
        report.extra["reloaded_after"] = first
    report.seconds = time.monotonic() - started
    return report


def once_more_if_a_stub_stalled(attempt: Callable[[], T]) -> tuple[T, str | None]:
    """``attempt()`` (which loads candidates and sends them requests); when a request failed because a Python
    stub was declared unhealthy (``STUB_DECLARED_UNHEALTHY``: stalled by its host, or dead), the whole attempt
    once more on freshly loaded candidates. Returns (its result, the first failure's message or None). A load
    that failed that way is not tried again here: ``LoadedCandidates`` already made it twice."""
    try:
        return attempt(), None
    except VerificationError as exc:
        if not STUB_DECLARED_UNHEALTHY.search(exc.message) or isinstance(exc.__cause__, ModelLoadError):
            raise
        first = exc.message
    try:
        return attempt(), first
    except VerificationError as again:
        before = ("the same happened before trm reloaded the model and tried again"
                  if STUB_DECLARED_UNHEALTHY.search(again.message) else
                  f"on a second try: trm had reloaded the model after {first}")
        raise VerificationError(f"{again.message} ({before})", hint=again.hint, report=again.report,
                                **again.facts) from again


def _verify_once(client: TritonClient, candidates: list[Candidate], entry: str,
                 samples: list[dict[str, np.ndarray]], reference: Reference | None,
                 check: Check | None, repository: Path | None) -> VerificationReport:
    report = VerificationReport(server=client.url)
    by_name = {c.name: c for c in candidates}
    entry_config = by_name[entry].config
    try:
        with LoadedCandidates(client, candidates, repository) as loaded:
            if loaded.reloaded_after:
                report.extra["reloaded_after"] = loaded.reloaded_after[0]
            for sample in samples:
                answer = client.infer(loaded.names[entry], sample)
                report.samples += 1
                expected = reference(sample) if reference else None
                if check is not None and expected is not None:
                    report.extra.setdefault("cases", []).append(check(sample, answer, expected))
                    report.outputs_checked += len(entry_config.output)
                    continue
                for out in entry_config.output:
                    if out.name not in answer:
                        raise VerificationError(f"output {out.name} missing from Triton's answer")
                    got = answer[out.name]
                    if expected is not None:
                        worst = compare(out.name, got, expected[out.name])
                        report.worst[out.name] = max(report.worst.get(out.name, 0.0), worst)
                    else:
                        check_against_config(entry_config, out, got, sample)
                    report.outputs_checked += 1
    except VerificationError:
        raise
    except TrmError as exc:
        raise VerificationError(f"verification on {client.url} failed: {exc.message}") from exc
    return report


def check_against_config(config: cfg.ModelConfig, out, got: np.ndarray, sample) -> None:
    want_type = cfg.dtype_name(out.data_type)
    got_type = "STRING" if got.dtype.kind in ("O", "S", "U") else cfg.dtype_name(cfg.from_numpy_dtype(got.dtype))
    if want_type != got_type:
        raise VerificationError(f"output {out.name}: config says {want_type}, the model returned {got_type}")
    dims = list(out.dims)
    shape = list(got.shape)
    if config.max_batch_size > 0:
        batch = len(next(iter(sample.values())))
        if not shape or shape[0] != batch:
            raise VerificationError(f"output {out.name}: batch of {batch} gave shape {shape}")
        shape = shape[1:]
    if len(shape) != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, shape)):
        raise VerificationError(f"output {out.name}: shape {shape} does not match config dims {dims}")
