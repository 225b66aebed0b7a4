"""Publish failures after staging began leave nothing behind; ONNX sources onnxruntime cannot run are
bad input (exit 3) naming the operator; external-data ONNX models publish from any working directory; a
source folder with a file or folder that cannot be read is refused naming it, never published without it."""

from __future__ import annotations

import os

import numpy as np
import onnx_models as om
import onnxruntime as ort
import pytest
from helpers import run_cli
from unreadable import hide, trm_unprivileged

from repo_manager.publish.core import Staged, run_publish
from repo_manager.repository import STAGING_PREFIX, LocalRepository
from repo_manager.settings import Settings
from repo_manager.triton.client import TritonClient
from repo_manager.triton.server import TritonServer


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
