"""Publish failures after staging began leave nothing behind; ONNX sources onnxruntime cannot run are
bad input (exit 3) naming the operator; external-data ONNX models publish from any working directory; a
source folder with a file or folder that cannot be read is refused naming it, never published without it; external
data is read inside the model's folder (a link on the way refused, an unreadable file named)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx_models as om
import onnxruntime as ort
import pytest
from helpers import run_cli
from unreadable import hide, python_unprivileged, trm_unprivileged

from repo_manager.adapters.repository import STAGING_PREFIX, LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core import config as cfg
from repo_manager.core.settings import Settings
from repo_manager.ops.publish.core import Staged, run_publish


def leftovers(repo_root) -> list[str]:
    return [str(p.relative_to(repo_root)) for p in repo_root.rglob(f"{STAGING_PREFIX}*")] if repo_root.exists() else []


def test_unknown_operator_is_bad_input_naming_it_and_leaves_no_staging(capsys, tmp_path, triton):
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", om.custom_operator(tmp_path / "c.onnx"), "--name", "custom",
                     "--repo", repo, "--url", triton.url)
    assert result.code == 3, result.err
    assert "Frobnicate" in result.err and "com.example.trm" in result.err
    assert len(result.err.strip().splitlines()) <= 3  # one error line (and a hint), no traceback
    assert leftovers(repo) == [] and not (repo / "custom").exists()


def test_any_failure_after_staging_began_removes_every_staging_folder(tmp_path):
    """A converter that stages several folders and then fails (not even a TrmError) leaves none."""
    settings = Settings(repository=tmp_path / "repo")

    def build(repo, name: str) -> list[Staged]:
        (repo.stage(f"{name}_a") / "model.py").write_text("# half written\n")
        repo.stage(name)
        raise RuntimeError("converter crashed")

    with pytest.raises(RuntimeError):
        run_publish(settings, "m", build, verify_model=False)
    assert leftovers(settings.repository) == []
    assert LocalRepository(settings.repository).models() == []


def test_a_publish_removes_a_staging_folder_it_did_not_commit_and_one_an_interrupt_left(tmp_path):
    """``repo.staging_scope()``: a folder the converter staged and never handed on goes once the publish
    succeeds, and an interrupt (a BaseException, not an Exception) in the converter leaves none."""
    settings = Settings(repository=tmp_path / "repo")
    config = cfg.build_config("m", "python", [cfg.TensorSpec("X", "FP32", (2,))], [cfg.TensorSpec("Y", "FP32", (2,))],
                              True, cfg.ConfigOptions(max_batch_size=4, instance_count=1, warmup=False))

    def build(repo, name: str) -> list[Staged]:
        (repo.stage(f"{name}_scratch") / "notes.txt").write_text("never returned\n")
        staging = repo.stage(name)
        (staging / "model.py").write_text("# a model\n")
        return [Staged(name, staging, config, {"kind": "test"})]

    result = run_publish(settings, "m", build, verify_model=False)
    assert result.version == 1 and (settings.repository / "m" / "1" / "model.py").is_file()
    assert leftovers(settings.repository) == [] and LocalRepository(settings.repository).models() == ["m"]

    def interrupted(repo, name: str) -> list[Staged]:
        repo.stage(name)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_publish(settings, "m", interrupted, verify_model=False)
    assert leftovers(settings.repository) == [] and LocalRepository(settings.repository).versions("m") == [1]


def test_external_data_model_publishes_from_another_directory(capsys, tmp_path, triton, monkeypatch):
    source = om.external_data(tmp_path / "src" / "model.onnx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", os.path.relpath(source, elsewhere), "--name", "ext",
                     "--repo", repo, "--url", triton.url)
    assert result.code == 0, result.err
    version = repo / "ext" / "1"
    assert (version / "weights.bin").read_bytes() == (source.parent / "weights.bin").read_bytes()
    # the version is self-contained: it serves with the source folder gone
    (source.parent / "weights.bin").rename(tmp_path / "moved.bin")
    x = np.ones((2, 32), np.float32)
    with TritonServer(repo, models=["ext"]) as server, TritonClient(server.url) as client:
        served = client.infer("ext", {"X": x})["Y"]
    (tmp_path / "moved.bin").rename(source.parent / "weights.bin")
    expected = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)


def test_external_data_missing_is_bad_input_and_leaves_no_staging(capsys, tmp_path, triton):
    source = om.external_data(tmp_path / "src" / "model.onnx")
    (source.parent / "weights.bin").unlink()
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", source, "--name", "ext", "--repo", repo, "--url", triton.url)
    assert result.code == 3 and "weights.bin" in result.err, result.err
    assert leftovers(repo) == []


def test_external_data_outside_the_model_folder_is_refused(capsys, tmp_path, triton):
    source = om.external_data(tmp_path / "src" / "model.onnx", location="../outside.bin")
    result = run_cli(capsys, "publish", "model", source, "--name", "ext", "--repo", tmp_path / "repo",
                     "--url", triton.url)
    assert result.code == 3 and "outside" in result.err, result.err
    assert leftovers(tmp_path / "repo") == []


@pytest.mark.parametrize("hidden", ["lib", "lib/helper.py", "tokenizer.json"])
def test_an_unreadable_file_or_folder_in_a_source_fails_the_publish_naming_it(tmp_path, hidden):
    """No mock: trm runs where the kernel refuses the reads (tests/unreadable.py). `publish --no-verify`
    of a Python model folder with an unreadable subfolder or file is exit 3 naming it, one line, and no
    version: rglob passed over the folder in silence and published the version without it (exit 0)."""
    source = tmp_path / "src"
    (source / "lib").mkdir(parents=True)
    (source / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    (source / "lib" / "helper.py").write_text("HELP = 1\n")
    (source / "tokenizer.json").write_text("{}\n")
    hide(source / hidden)
    repo = tmp_path / "repo"
    code, _, err = trm_unprivileged("publish", "model", source, "--name", "m", "--repo", repo,
                                    "--input", "X:FP32:4", "--output", "Y:FP32:4", "--no-verify")
    (source / hidden).chmod(0o755)
    assert code == 3, err
    assert err.splitlines()[0] == f"error: {source / hidden} cannot be read (permission denied)", err
    assert LocalRepository(repo).versions("m") == [] and leftovers(repo) == []


def _external_data_in(folder, location: str):
    """An external-data model in ``folder`` whose data file lives at ``folder/location``."""
    source = om.external_data(folder / "model.onnx", location=location)
    if location != "weights.bin":
        (folder / location).parent.mkdir(parents=True, exist_ok=True)
        (folder / "weights.bin").rename(folder / location)
    return source


@pytest.mark.parametrize("case", ["folder_link_inside", "folder_link_outside", "file_link_inside"])
def test_external_data_reached_through_a_link_is_refused_naming_the_link(tmp_path, case):
    """A symbolic link anywhere on the way to an external-data file is refused (exit 3, one line naming the
    link), never followed: the folder link that stays inside the model's folder was published (exit 0)."""
    source = _external_data_in(tmp_path / "src", "data/weights.bin")
    data = tmp_path / "src" / "data"
    if case == "folder_link_inside":
        data.rename(tmp_path / "src" / "real")
        data.symlink_to("real")
        link = data
    elif case == "folder_link_outside":
        data.rename(tmp_path / "elsewhere")
        data.symlink_to(tmp_path / "elsewhere")
        link = data
    else:
        (data / "weights.bin").rename(tmp_path / "src" / "kept.bin")
        (data / "weights.bin").symlink_to("../kept.bin")
        link = data / "weights.bin"
    repo = tmp_path / "repo"
    code, _, err = trm_unprivileged("publish", "model", source, "--name", "ext", "--repo", repo, "--no-verify")
    assert code == 3, err
    first = err.splitlines()[0]
    assert first.startswith("error: ") and f"{link} is a symbolic link" in first, err
    assert len(err.strip().splitlines()) <= 2  # one error line and a hint, no traceback
    assert LocalRepository(repo).versions("ext") == [] and leftovers(repo) == []


@pytest.mark.parametrize("hidden", ["data", "data/weights.bin"])
def test_unreadable_external_data_is_an_error_naming_it(tmp_path, hidden):
    """No mock (tests/unreadable.py): an external-data file or its folder that cannot be read is exit 3
    naming it; it was `onnxruntime cannot load …: 13` (file) and an internal error, exit 1 (folder)."""
    source = _external_data_in(tmp_path / "src", "data/weights.bin")
    hide(tmp_path / "src" / hidden)
    repo = tmp_path / "repo"
    code, _, err = trm_unprivileged("publish", "model", source, "--name", "ext", "--repo", repo, "--no-verify")
    (tmp_path / "src" / hidden).chmod(0o755)
    assert code == 3, err
    assert err.splitlines()[0].endswith(f"{tmp_path / 'src' / hidden} cannot be read (permission denied)"), err
    assert LocalRepository(repo).versions("ext") == [] and leftovers(repo) == []


def test_a_commit_the_filesystem_refuses_is_not_blamed_on_another_writer(tmp_path):
    """The kernel refuses the rename (EACCES on a read-only model folder, for real): that is bad input naming
    the cause, not "taken by another writer" (exit 8, "retry"), which would send a caller retrying forever."""
    code = f"""
import json, sys
from pathlib import Path
from repo_manager.core.errors import TrmError
from repo_manager.core.manifest import Manifest
from repo_manager.adapters.repository import LocalRepository
repo = LocalRepository(Path({str(tmp_path / "repo")!r}))
staging = repo.stage("m")
(staging / "model.onnx").write_bytes(b"x")
repo.model_dir("m").chmod(0o555)
manifest = Manifest(model="m", version=1, config='name: "m"', files={{}})
try:
    repo.commit(staging, manifest)
except TrmError as exc:
    print(json.dumps([type(exc).__name__, exc.exit_code, exc.message]))
"""
    done = python_unprivileged(code)
    assert done.returncode == 0, done.stderr
    kind, code_, message = json.loads(done.stdout)
    assert (kind, code_) == ("InputError", 3)
    assert "Permission denied" in message and "another writer" not in message
