"""A mistyped or unknown name is told for what it is, before anything changes: an environment close to an
existing one is refused naming it (`did you mean`; `--create-env` when a new one is meant), an unknown model,
version or store is not found (exit 4), never a failed gate, and a mistyped store URL is never taken for a
folder to create. A folder store; no server is started.
"""

from __future__ import annotations

import pytest
from helpers import run_cli
from store_helpers import make_version, pushed_store

from repo_manager.adapters.storage import open_store


def test_a_mistyped_environment_in_sync_names_the_close_ones(capsys, tmp_path):
    store = pushed_store(tmp_path, env="production")
    result = run_cli(capsys, "sync", store, "--env", "prodution", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 4 and "did you mean production" in result.err, result.err


def test_a_push_to_an_environment_named_like_an_existing_one_is_refused_as_a_typo(capsys, tmp_path):
    """`--env prd` beside `prod`, `STAGING` beside `staging`: refused before anything is uploaded (nodes watching
    the intended environment would never see the versions); `--create-env` creates it when meant."""
    store = pushed_store(tmp_path, env="prod")
    run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--env", "staging")
    make_version(tmp_path / "src", "base", {"model.py": b"# v2"})
    for typo, meant in (("prd", "prod"), ("STAGING", "staging"), ("prodd", "prod"), ("Prod", "prod")):
        result = run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--env", typo, "--json")
        assert result.code == 2 and f"did you mean {meant}" in result.err and "--create-env" in result.err, result.err
    assert sorted(open_store(store).list_envs()) == ["prod", "staging"]
    assert open_store(store).list_versions("base") == [1]  # nothing was uploaded either
    assert run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--env", "canary").code == 0  # not close
    assert run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--env", "staging2").code == 0  # numbered
    assert run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--env", "prd", "--create-env").code == 0
    assert sorted(open_store(store).list_envs()) == ["canary", "prd", "prod", "staging", "staging2"]


def test_promotion_to_an_undeclared_environment_is_refused_with_a_suggestion(capsys, tmp_path):
    store = pushed_store(tmp_path, env="production")
    args = ["promote", "base", "--version", "1", "--store", store, "--gates", "checksums"]
    typo = run_cli(capsys, *args, "--to", "prodution")
    assert typo.code == 4, typo.err
    assert "did you mean production" in typo.err and "--create-env" in typo.err
    assert open_store(store).list_envs() == ["production"]
    created = run_cli(capsys, *args, "--to", "canary", "--create-env")
    assert created.code == 0, created.err
    assert open_store(store).list_envs() == ["canary", "production"]
    history = run_cli(capsys, "history", "prodution", "--store", store)
    assert history.code == 4 and "did you mean production" in history.err


def test_unknown_model_version_and_store_are_not_found_not_a_gate(capsys, tmp_path):
    store = pushed_store(tmp_path, env="production")
    base = ["--to", "production", "--gates", "checksums"]
    for args, words in ((["promote", "nope", "--version", "1", "--store", store], "model nope does not exist"),
                        (["promote", "base", "--version", "7", "--store", store], "has no version 7"),
                        (["promote", "base", "--version", "1", "--store", tmp_path / "missing"],
                         "store folder"),
                        (["promote", "base", "--from", "stagin", "--store", store], "stagin")):
        result = run_cli(capsys, *args, *base)
        assert result.code == 4, (args, result.err)
        assert words in result.err and "gate" not in result.err, result.err
    missing = run_cli(capsys, "sync", tmp_path / "missing", "--env", "production", "--repo", tmp_path / "r",
                      "--cache", tmp_path / "c")
    assert missing.code == 4 and "store folder" in missing.err and "environment" not in missing.err


@pytest.mark.parametrize("location", ["s3:/bucket/p", "s3:bucket", " ", " store"])
def test_a_mistyped_store_url_is_not_taken_for_a_folder(capsys, tmp_path, monkeypatch, location):
    make_version(tmp_path / "src", "base", {"model.py": b"# v1"})
    monkeypatch.chdir(tmp_path)
    result = run_cli(capsys, "push", location, "--repo", tmp_path / "src")
    assert result.code == 2 and "neither s3://bucket/prefix nor a plain folder" in result.err, result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
