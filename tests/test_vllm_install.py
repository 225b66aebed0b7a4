"""A vLLM version installed in another repository root names that root's folder in model.json, and stays intact.

The official vllm backend passes model.json's ``model`` to vLLM as given (no relative path: vllm_backend #7587),
so every install (sync, the agent's and `trm rollout --from`'s install step, export into a folder, a copied
folder repaired by `validate --fix`) must write the folder the server sees, while the manifest's checksums
keep meaning something. Real parts: SeaweedFS for the store, the trm CLI in process; no engine starts here
(published with --no-verify; tests/test_vllm.py serves a synced root through the embedded server).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli

from repo_manager.adapters.storage import open_store
from repo_manager.core.localized import PLACEHOLDER
from repo_manager.core.manifest import read_manifest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="the test checkpoint is built with transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from llm_checkpoints import causal_lm

    return causal_lm(tmp_path_factory.mktemp("llm") / "tiny-llama", max_position_embeddings=128)


def _args(path: Path) -> dict:
    return json.loads(path.read_text())


def _publish(capsys, checkpoint: Path, repo: Path) -> None:
    result = run_cli(capsys, "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo", repo,
                     "--no-verify", "--json")
    assert result.code == 0, result.err


def _validate(capsys, repo: Path, *extra: str):
    return run_cli(capsys, "validate", repo, "--json", *extra)


@pytest.fixture
def synced(capsys, checkpoint, s3_location, tmp_path):
    """Published into root A, pushed to S3 with env prod, synced into root B."""
    a, b = tmp_path / "a", tmp_path / "b"
    _publish(capsys, checkpoint, a)
    pushed = run_cli(capsys, "push", s3_location, "--repo", a, "--env", "prod", "--json")
    assert pushed.code == 0, pushed.err
    result = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", b, "--cache", tmp_path / "cache", "--json")
    assert result.code == 0, result.err
    assert result.json()["installed"] == ["tiny/1"]
    return a, b


def test_the_store_holds_model_json_with_a_placeholder_and_the_manifest_its_sha256(synced, s3_location):
    a, _ = synced
    published = (a / "tiny" / "1" / "model.json").read_bytes()
    assert _args(a / "tiny" / "1" / "model.json")["model"] == str((a / "tiny" / "1").resolve())
    entry = next(e for e in read_manifest(a / "tiny" / "1").files if e.path == "model.json")
    store = open_store(s3_location)
    blob = b"".join(store.read_blob(entry.sha256))
    assert hashlib.sha256(blob).hexdigest() == entry.sha256 and len(blob) == entry.size
    assert json.loads(blob) == {**json.loads(published), "model": PLACEHOLDER}
    assert str(a) not in blob.decode()


def test_a_version_synced_into_another_root_names_that_root_and_validates(synced, capsys, s3_location, tmp_path):
    a, b = synced
    installed = b / "tiny" / "1" / "model.json"
    assert _args(installed)["model"] == str((b / "tiny" / "1").resolve())
    assert {k: v for k, v in _args(installed).items() if k != "model"} == \
        {k: v for k, v in _args(a / "tiny" / "1" / "model.json").items() if k != "model"}
    assert installed.stat().st_nlink == 1  # a file of its own, not a hard link to the cache's blob
    report = _validate(capsys, b)
    assert report.code == 0 and report.json()["problems"] == [], report.out
    assert _validate(capsys, a).code == 0
    pushed = run_cli(capsys, "push", s3_location, "--repo", b, "--json")
    assert pushed.code == 0, pushed.err
    assert [v["already_present"] for v in pushed.json()["versions"]] == [True]
    again = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", b, "--cache", tmp_path / "cache", "--json")
    assert again.code == 0 and again.json()["installed"] == []


def test_a_forged_model_json_is_detected_and_the_next_sync_reinstalls_it(synced, capsys, s3_location, tmp_path):
    _, b = synced
    installed = b / "tiny" / "1" / "model.json"
    good = installed.read_bytes()
    assert _args(installed)["dtype"] == "float32"
    forged = good.replace(b'"float32"', b'"float16"')  # same size, trm's own format, the right folder: still caught
    installed.write_bytes(forged)
    report = _validate(capsys, b)
    assert report.code == 3
    assert report.json()["problems"] == ["tiny/1: file model.json does not match its sha256"]
    installed.write_text(json.dumps({**_args(installed), "max_num_seqs": 1000}, indent=2) + "\n")
    result = run_cli(capsys, "sync", s3_location, "--env", "prod", "--repo", b, "--cache", tmp_path / "cache", "--json")
    assert result.code == 0 and result.json()["installed"] == ["tiny/1"], result.err
    assert installed.read_bytes() == good


def test_a_version_folder_copied_to_another_root_is_reported_and_fixed(synced, capsys, tmp_path):
    _, b = synced
    copy = tmp_path / "copy"
    shutil.copytree(b, copy)
    report = _validate(capsys, copy)
    assert report.code == 3
    [problem] = report.json()["problems"]
    assert problem.startswith(f"tiny/1: file model.json names the folder {(b / 'tiny' / '1').resolve()}, not this "
                              "version's folder") and "`trm validate --fix` rewrites it" in problem
    fixed = _validate(capsys, copy, "--fix")
    assert fixed.code == 0, fixed.out
    assert fixed.json()["fixed"] == ["rewrote tiny/1/model.json to name its own version folder"]
    assert _args(copy / "tiny" / "1" / "model.json")["model"] == str((copy / "tiny" / "1").resolve())


def test_export_into_a_folder_writes_model_json_naming_that_folder(synced, capsys, s3_location, tmp_path):
    dest = tmp_path / "export"
    result = run_cli(capsys, "export", s3_location, dest, "--env", "prod", "--json")
    assert result.code == 0, result.err
    assert _args(dest / "tiny" / "1" / "model.json")["model"] == str((dest / "tiny" / "1").resolve())
    again = run_cli(capsys, "export", s3_location, dest, "--env", "prod", "--json")  # already there: not "different"
    assert again.code == 0 and again.json()["files"] == 0, again.err


def test_the_agents_install_step_names_its_own_root(synced, s3_location, tmp_path, s3_env):
    """`trm agent` and `trm rollout --from STORE` install through ``sync_versions`` before they roll out."""
    from repo_manager.core.settings import Settings
    from repo_manager.ops.sync import sync_versions

    pod = tmp_path / "pod"
    settings = Settings(repository=pod, cache_dir=tmp_path / "pod-cache")
    result = sync_versions(settings, open_store(s3_location), {"tiny": 1})
    assert result.installed == ("tiny/1",)
    assert _args(pod / "tiny" / "1" / "model.json")["model"] == str((pod / "tiny" / "1").resolve())
    from repo_manager.adapters.repository import LocalRepository

    assert LocalRepository(pod).validate() == []


def test_a_version_recorded_before_the_placeholder_is_installed_as_published_and_reported(
        capsys, checkpoint, tmp_path):
    """An older manifest hashed model.json as its publisher wrote it (its absolute folder): it is still read and
    checked byte for byte; elsewhere it is installed unchanged and `trm validate` says to publish it again."""
    from repo_manager.core.localized import localized_paths
    from repo_manager.core.manifest import MANIFEST_NAME, FileEntry

    a, b, store = tmp_path / "a", tmp_path / "b", tmp_path / "store"
    _publish(capsys, checkpoint, a)
    folder = a / "tiny" / "1"
    manifest = read_manifest(folder)
    assert localized_paths(manifest.config) == {"model.json"}
    raw = (folder / "model.json").read_bytes()
    old = [FileEntry(e.path, len(raw), hashlib.sha256(raw).hexdigest()) if e.path == "model.json" else e
           for e in manifest.files]
    import dataclasses

    (folder / MANIFEST_NAME).write_bytes(dataclasses.replace(manifest, files=tuple(old)).to_json())
    assert _validate(capsys, a).code == 0
    assert run_cli(capsys, "push", store, "--repo", a, "--env", "prod").code == 0
    assert run_cli(capsys, "sync", store, "--env", "prod", "--repo", b, "--cache", tmp_path / "cache").code == 0
    assert (b / "tiny" / "1" / "model.json").read_bytes() == raw
    report = _validate(capsys, b)
    assert report.code == 3
    [problem] = report.json()["problems"]
    assert f"names the folder {folder.resolve()}, not this version's folder" in problem
    assert "publish the version again" in problem


def test_publish_into_a_store_that_took_the_number_renumbers_and_names_the_new_folder(synced, capsys, checkpoint,
                                                                                        s3_location, tmp_path):
    """The store already holds tiny/1 (from root A): a publish from root C with --store takes number 2, and its
    local folder, renumbered to 2, has a model.json naming that folder."""
    c = tmp_path / "c"
    result = run_cli(capsys, "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo", c,
                     "--no-verify", "--store", s3_location, "--json")
    assert result.code == 0, result.err
    assert not (c / "tiny" / "1").exists()
    assert _args(c / "tiny" / "2" / "model.json")["model"] == str((c / "tiny" / "2").resolve())
    assert _validate(capsys, c).code == 0


def test_show_and_diff_print_the_engine_arguments_the_plan_and_the_generation_cases(capsys, checkpoint, tmp_path,
                                                                                     monkeypatch):
    """`trm show` of a vLLM version: its engine arguments (model.json's, less the folder), the memory plan that
    chose them and its verification's generation cases; `trm diff`: the engine arguments that changed."""
    repo = tmp_path / "repo"
    _publish(capsys, checkpoint, repo)  # max_model_len 128, the checkpoint's
    second = run_cli(capsys, "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo", repo,
                     "--no-verify", "--max-model-len", 64, "--json")
    assert second.code == 0, second.err
    # a verification record in the form verify_generation writes (no engine runs here: tests/test_vllm.py
    # publishes verified where vLLM is installed)
    path = repo / "tiny" / "2" / "trm-manifest.json"
    data = json.loads(path.read_text())
    data["verification"] = {
        "passed": True, "criterion": "equal token ids (greedy, float32)", "samples": 3,
        "cases": [{"case": "short (non-streamed)", "prompt_tokens": 2, "tokens": 8, "responses": 1, "equal": True},
                  {"case": "near max_model_len (streamed)", "prompt_tokens": 55, "tokens": 8, "responses": 8,
                   "equal": True, "prompt_text_in_output": 1},
                  {"case": "prompt longer than max_model_len", "refused": "the prompt is too long"},
                  {"case": ["not a name"], "prompt_tokens": "x"}]}  # a malformed case: left out, not fatal
    path.write_text(json.dumps(data))

    shown = run_cli(capsys, "show", "tiny", "--repo", repo, "--json")
    assert shown.code == 0, shown.err
    info = shown.json()
    installed = _args(repo / "tiny" / "2" / "model.json")
    assert {"model": installed["model"], **info["engine"]["engine_args"]} == installed
    assert info["engine"]["engine_args"]["max_model_len"] == 64 and info["engine"]["device"] == "cpu"
    assert info["engine"]["reason"] == data["source"]["plan"]["memory"]["reason"]
    assert [row["case"] for row in info["generation_cases"]] == [c["case"] for c in data["verification"]["cases"][:3]]
    assert info["generation_cases"][1]["result"] == "prompt tail in text: 1 chars"
    monkeypatch.setenv("COLUMNS", "160")  # a table's cells on one line each
    text = run_cli(capsys, "show", "tiny", "--repo", repo).out
    for expected in ("engine arguments of version 2", "max_model_len", "memory plan (cpu)", "kv_cache_memory_bytes",
                     "near max_model_len (streamed)", "refused: the prompt is too long", "token ids equal"):
        assert expected in text, expected

    diff = run_cli(capsys, "diff", "tiny", 1, 2, "--repo", repo, "--json").json()
    assert {"field": "max_model_len", "a": 128, "b": 64} in diff["engine"]
    assert not [c for c in diff["source"] if c["field"].startswith("plan.engine_args.")]  # said once, under engine
    diff_text = run_cli(capsys, "diff", "tiny", 1, 2, "--repo", repo).out
    assert "engine arguments (model.json):\n  kv_cache_memory_bytes: " in diff_text
    assert "  max_model_len: 128 -> 64" in diff_text
