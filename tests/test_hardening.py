"""Hostile and careless input, each case from issue 13: nothing written outside its target, no secret in any
output, a one-line error with a documented exit code (never 1), never a different version replaced.

Most cases use a folder store (the rules live above the backends); the missing-bucket case uses the real
SeaweedFS server.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import make_version, python_config, tree_digest

from repo_manager.errors import InputError
from repo_manager.manifest import Manifest
from repo_manager.repository import LocalRepository
from repo_manager.storage import open_store

KEY, SECRET = "AKIAHARDENINGEXAMPLE", "hardSecret/K7MDENG/bPxRfiCYzEXAMPLE"


def _store_with(tmp_path: Path, model: str = "base", files: dict[str, bytes] | None = None, env: str = "prod") -> str:
    store = str(tmp_path / "store")
    make_version(tmp_path / "src", model, files or {"model.py": b"# v1"})
    result = run_cli_plain("push", store, "--repo", tmp_path / "src", "--env", env)
    assert result == 0
    return store


def run_cli_plain(*args) -> int:
    from repo_manager.cli import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return int(exit_info.value.code or 0)


def _elsewhere(tmp_path: Path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    return folder


# ------------------------------------------------------------------------------------ 1. path safety
def test_sync_never_installs_through_a_symlinked_model_folder(capsys, tmp_path):
    store = _store_with(tmp_path)
    elsewhere = _elsewhere(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "base").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "cache")
    assert result.code == 3, result.err
    assert "symbolic link" in result.err and str(repo / "base") in result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_sync_never_writes_through_a_symlink_inside_the_cache(capsys, tmp_path):
    store = _store_with(tmp_path)
    elsewhere = _elsewhere(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "blobs").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", cache)
    assert result.code == 3, result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_export_never_writes_through_a_symlinked_destination_folder(capsys, tmp_path):
    store = _store_with(tmp_path)
    elsewhere = _elsewhere(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "base").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "export", store, dest)
    assert result.code == 3, result.err
    assert "symbolic link" in result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_validate_fix_never_deletes_through_a_symlinked_model_folder(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "real", {"model.py": b"# v1"})
    elsewhere = _elsewhere(tmp_path)
    (elsewhere / ".trm-tmp-999999999-abc").mkdir()
    (elsewhere / ".trm-tmp-999999999-abc" / "data").write_text("not trm's")
    (repo / "linked").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "validate", repo, "--fix")
    assert result.code == 3, result.err
    assert "symbolic link out of the repository" in result.out
    assert (elsewhere / ".trm-tmp-999999999-abc" / "data").read_text() == "not trm's"


@pytest.mark.parametrize("name", ["a\nb.txt", "tab\there", "del\x7f", "back\\slash"])
def test_store_file_names_are_limited_to_a_portable_set(capsys, tmp_path, name):
    store = _store_with(tmp_path)
    manifest = open_store(store).get_manifest("base", 1)
    data = manifest.to_dict()
    data["files"][0]["path"] = name
    store_path = Path(store) / "models" / "base" / "versions" / "1.json"
    store_path.chmod(0o644)
    store_path.write_bytes(Manifest.from_dict(manifest.to_dict()).to_json().replace(
        b'"model.py"', __import__("json").dumps(name).encode()))
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", tmp_path / "c")
    assert result.code == 7, result.err
    assert not (tmp_path / "repo" / "base" / "1").exists()


# ------------------------------------------------------------------------------------- 2. credentials
@pytest.mark.parametrize("secret", [SECRET, "plainsecret42"])
def test_a_store_url_with_credentials_is_refused_and_never_printed(capsys, tmp_path, secret):
    location = f"s3://{KEY}:{secret}@bucket/prefix"
    commands = [
        ["sync", location, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"],
        ["push", location, "--repo", tmp_path / "r"],
        ["export", location, tmp_path / "out"],
        ["export", tmp_path / "store", location],
        ["promote", "m", "--version", "1", "--to", "prod", "--store", location],
        ["history", "prod", "--store", location],
    ]
    for args in commands:
        for flags in (["--json"], ["--verbose"]):
            result = run_cli(capsys, *flags, *args)
            assert result.code == 2, (args, result.err)
            assert "carries credentials" in result.err
            for text in (KEY, secret, secret.split("/")[0]):
                assert text not in result.out and text not in result.err, (args, flags, result.err)
    assert not list(tmp_path.iterdir())


def test_urls_with_credentials_are_refused_in_every_setting_and_never_printed(capsys, tmp_path, monkeypatch):
    store = _store_with(tmp_path)
    url = f"http://{KEY}:{SECRET}@127.0.0.1:9"
    sync = ["sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"]
    for extra in (["--prune", "--url", url], ["--endpoint-url", url]):
        for flags in (["--json"], ["--verbose"]):
            result = run_cli(capsys, *flags, *sync, *extra)
            assert result.code == 2, result.err
            assert KEY not in result.out + result.err and "hardSecret" not in result.out + result.err
    monkeypatch.setenv("TRM_STORE", f"s3://{KEY}:{SECRET}@bucket")
    result = run_cli(capsys, "--verbose", "list", "--repo", tmp_path / "r")
    assert result.code == 2 and KEY not in result.out + result.err and "hardSecret" not in result.err


def test_history_records_and_printed_text_carry_no_url_credentials(capsys, tmp_path, monkeypatch):
    """CI systems put tokens into URLs (BUILD_URL=https://user:token@ci/…): the record keeps the URL,
    redacted; the one redaction point also covers every line printed."""
    from repo_manager.redact import redact

    store = _store_with(tmp_path, env="staging")
    monkeypatch.setenv("BUILD_URL", f"https://{KEY}:{SECRET}@ci.example/job/7")
    result = run_cli(capsys, "promote", "base", "--version", "1", "--to", "production", "--store", store,
                     "--gates", "checksums", "--create-env", "--json")
    assert result.code == 0, result.err
    stored = b"".join(p.read_bytes() for p in (Path(store) / "history").rglob("*.json"))
    for text in (result.out, stored.decode()):
        assert KEY not in text and "hardSecret" not in text and "***@ci.example/job/7" in text
    assert redact(f"x s3://{KEY}:{SECRET}@bucket/p y") == "x s3://***@bucket/p y"


# ---------------------------------------------------------------------------- 3. never replace a version
def test_export_refuses_a_different_version_and_leaves_an_identical_one_alone(capsys, tmp_path):
    store = _store_with(tmp_path)
    dest = tmp_path / "dest"
    assert run_cli(capsys, "export", store, dest).code == 0
    before = tree_digest(dest)
    again = run_cli(capsys, "export", store, dest, "--json")
    assert again.code == 0 and again.json()["files"] == 0 and tree_digest(dest) == before
    (dest / "base" / "1" / "model.py").write_bytes(b"# someone else's version 1")
    clash = run_cli(capsys, "export", store, dest)
    assert clash.code == 3, clash.err
    assert "different version 1" in clash.err and str(dest / "base" / "1") in clash.err
    assert (dest / "base" / "1" / "model.py").read_bytes() == b"# someone else's version 1"


def test_an_interrupted_export_is_completed_not_refused(capsys, tmp_path):
    store = _store_with(tmp_path, files={"model.py": b"# v1", "weights/w.bin": b"w" * 1000})
    dest = tmp_path / "dest"
    assert run_cli(capsys, "export", store, dest).code == 0
    (dest / "base" / "1" / "weights" / "w.bin").unlink()  # as if killed before the last file
    result = run_cli(capsys, "export", store, dest, "--json")
    assert result.code == 0 and result.json()["files"] == 1, result.err
    assert (dest / "base" / "1" / "weights" / "w.bin").read_bytes() == b"w" * 1000


def test_exported_files_follow_the_umask(capsys, tmp_path):
    store = _store_with(tmp_path)
    old = os.umask(0o022)
    try:
        assert run_cli(capsys, "export", store, tmp_path / "dest").code == 0
    finally:
        os.umask(old)
    for path in (tmp_path / "dest" / "base" / "1" / "model.py", tmp_path / "dest" / "base" / "config.pbtxt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_sync_refuses_a_different_local_version_with_exit_3(capsys, tmp_path):
    store = _store_with(tmp_path)
    repo = tmp_path / "repo"
    make_version(repo, "base", {"model.py": b"# another version 1"})
    before = tree_digest(repo)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "c")
    assert result.code == 3, result.err
    assert "different version 1" in result.err and tree_digest(repo) == before


# ----------------------------------------------------------------------------- 4. store documents
def _put_raw(store: str, key: str, payload: bytes) -> None:
    path = Path(store) / key
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.chmod(0o644)
    path.write_bytes(payload)


def test_a_manifest_nested_twenty_million_deep_is_refused_not_a_recursion_error(capsys, tmp_path):
    store = _store_with(tmp_path)
    _put_raw(store, "models/base/versions/1.json", b"[" * 20_000_000)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 7, result.err
    assert "internal error" not in result.err


def test_a_pointer_nested_deep_or_oversized_is_refused(capsys, tmp_path):
    store = _store_with(tmp_path)
    revs = sorted((Path(store) / "envs" / "prod.json.revs").iterdir())
    for payload in (b'{"schema": "trm.env/1", "models": ' + b"[" * 500_000, b" " * (2 * 1024 * 1024)):
        revs[-1].chmod(0o644)
        revs[-1].write_bytes(payload)
        result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache",
                         tmp_path / "c")
        assert result.code == 7, result.err


def test_a_manifest_claiming_a_petabyte_file_is_refused_before_any_allocation(capsys, tmp_path):
    store = _store_with(tmp_path)
    manifest = open_store(store).get_manifest("base", 1).to_dict()
    manifest["files"][0]["size"] = 2 ** 50
    _put_raw(store, "models/base/versions/1.json", __import__("json").dumps(manifest).encode())
    for args in (["sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"],
                 ["export", store, tmp_path / "out"]):
        result = run_cli(capsys, *args)
        assert result.code == 7, result.err
        assert "invalid size" in result.err
    assert not (tmp_path / "c" / "partial").exists() or not list((tmp_path / "c" / "partial").iterdir())


# --------------------------------------------------------------------------------- 5. version folders
def test_only_canonical_version_folders_are_versions(capsys, tmp_path):
    repo = tmp_path / "repo"
    manifest = make_version(repo, "m", {"model.py": b"# v1"})
    for name in ("01", "1.0", " 1", "+1"):
        (repo / "m" / name).mkdir()
        (repo / "m" / name / "trm-manifest.json").write_bytes(manifest.to_json())
    assert LocalRepository(repo).versions("m") == [1]
    listed = run_cli(capsys, "list", "--repo", repo, "--json")
    assert listed.code == 0 and listed.json()["models"][0]["versions"] == [1]
    result = run_cli(capsys, "validate", repo, "--json")
    assert result.code == 3
    problems = result.json()["problems"]
    for name in ("01", "1.0", " 1", "+1"):
        assert any(repr(name) in p for p in problems), (name, problems)
    assert any("Triton would load it as version 1" in p for p in problems)


def test_a_lost_and_found_folder_is_skipped_with_a_note(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "m", {"model.py": b"# v1"})
    (repo / "lost+found").mkdir()
    listed = run_cli(capsys, "list", "--repo", repo, "--json")
    assert listed.code == 0 and [r["model"] for r in listed.json()["models"]] == ["m"]
    result = run_cli(capsys, "validate", repo, "--json")
    assert result.code == 0, result.out
    assert any("lost+found" in n for n in result.json()["notes"])


def test_model_names_differing_only_in_case_are_refused(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "base", {"model.py": b"# v1"})
    with pytest.raises(InputError, match="differs only in case"):
        make_version(repo, "BASE", {"model.py": b"# v1"})
    # sync: the store serves BASE, the node already has base
    store = _store_with(tmp_path, model="BASE")
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "c")
    assert result.code == 3 and "only in case" in result.err, result.err
    assert not (repo / "BASE").exists()
    # validate: two folders that already collide
    (repo / "Base").mkdir()
    (repo / "Base" / "config.pbtxt").write_text(python_config("Base"))
    report = run_cli(capsys, "validate", repo, "--json")
    assert report.code == 3 and any("differ only in case" in p for p in report.json()["problems"])


# --------------------------------------------------------------------------------- 6. promotion errors
def test_promotion_to_an_undeclared_environment_is_refused_with_a_suggestion(capsys, tmp_path):
    store = _store_with(tmp_path, env="production")
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
    store = _store_with(tmp_path, env="production")
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


def test_sync_against_a_missing_bucket_names_the_bucket(capsys, s3_env, tmp_path):
    location = "s3://trm-no-such-bucket-for-tests/prefix"
    result = run_cli(capsys, "sync", location, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 4, result.err
    assert "bucket trm-no-such-bucket-for-tests does not exist" in result.err
    assert "environment" not in result.err
    promote = run_cli(capsys, "promote", "m", "--version", "1", "--to", "prod", "--store", location,
                      "--gates", "checksums", "--create-env")
    assert promote.code == 4 and "bucket" in promote.err and "gate" not in promote.err, promote.err


def test_server_urls_with_credentials_are_refused_by_rollout_and_status(capsys, tmp_path):
    for args in (["rollout", "m", "--version", "1", "--url", f"http://{KEY}:{SECRET}@127.0.0.1:9"],
                 ["rollout", "m", "--version", "1", "--url", "http://127.0.0.1:9", "--grpc-url",
                  f"{KEY}:{SECRET}@127.0.0.1:10"],
                 ["status", "--url", f"http://{KEY}:{SECRET}@127.0.0.1:9"]):
        result = run_cli(capsys, "--json", *args, "--repo", tmp_path / "repo")
        assert result.code == 2, (args, result.err)
        assert KEY not in result.out + result.err and "hardSecret" not in result.out + result.err


def test_a_link_planted_in_the_cache_is_never_written_through(capsys, tmp_path):
    """A partial download folder and a lock file that are symbolic links: the download goes elsewhere in the
    cache, never through them."""
    import hashlib

    big = b"x" * (40 * 1024 * 1024)  # above the ranged threshold: the partial-folder path
    store = _store_with(tmp_path, files={"w.bin": big})
    elsewhere = _elsewhere(tmp_path)
    digest = hashlib.sha256(big).hexdigest()
    cache = tmp_path / "cache"
    (cache / "partial").mkdir(parents=True)
    (cache / "locks").mkdir()
    (cache / "partial" / f"{digest}.planted").mkdir()
    (cache / "partial" / f"{digest}.planted" / "done").mkdir()
    (cache / "partial" / f"{digest}.planted" / "data").symlink_to(elsewhere / "stolen")
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", cache)
    assert result.code == 0, result.err
    assert (tmp_path / "repo" / "base" / "1" / "w.bin").read_bytes() == big
    (cache / "locks" / digest).unlink(missing_ok=True)
    (cache / "locks" / digest).symlink_to(elsewhere / "lock")
    (cache / "blobs" / "sha256" / digest).unlink()
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo2", "--cache", cache)
    assert result.code == 3 and "symbolic link" in result.err, result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_a_model_folder_with_a_bad_name_is_still_a_problem(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "m", {"model.py": b"# v1"})
    (repo / "bad name").mkdir()
    (repo / "bad name" / "config.pbtxt").write_text(python_config("m"))
    result = run_cli(capsys, "validate", repo, "--json")
    assert result.code == 3 and any("bad name" in p for p in result.json()["problems"])


def test_export_to_s3_leaves_an_identical_version_alone_and_refuses_a_different_one(capsys, s3_location, tmp_path):
    store = _store_with(tmp_path)
    assert run_cli(capsys, "export", store, s3_location).code == 0
    again = run_cli(capsys, "export", store, s3_location, "--json")
    assert again.code == 0 and again.json()["files"] == 0, again.err
    open_store(s3_location)._put_bytes("base/1/model.py", b"# someone else's version 1")
    clash = run_cli(capsys, "export", store, s3_location)
    assert clash.code == 3 and "different version 1" in clash.err, clash.err


def test_the_sync_record_is_never_written_through_a_link_planted_in_the_cache(capsys, tmp_path):
    """<cache>/state (what the quick path reads) as a symbolic link: the sync completes and writes nothing
    through it (the record is best effort: without it the next sync plans in full)."""
    store = _store_with(tmp_path)
    elsewhere = _elsewhere(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "state").symlink_to(elsewhere, target_is_directory=True)
    for _ in range(2):
        result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", cache)
        assert result.code == 0, result.err
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["precious"]
    assert (tmp_path / "repo" / "base" / "1" / "model.py").read_bytes() == b"# v1"


@pytest.mark.parametrize("kind", ["folder", "fifo", "link"])
def test_a_store_object_that_is_not_a_regular_file_is_a_store_error(capsys, tmp_path, kind):
    """A folder store's blob replaced by a folder, a FIFO (a read would block forever) or a link to a file
    outside the store: sync and export refuse it (exit 7) and install nothing."""
    import hashlib

    data = b"# weights\n" * 1000
    store = _store_with(tmp_path, files={"w.bin": data})
    blob = Path(store) / "blobs" / "sha256" / hashlib.sha256(data).hexdigest()
    blob.unlink()
    if kind == "folder":
        blob.mkdir()
    elif kind == "fifo":
        os.mkfifo(blob)
    else:
        (tmp_path / "outside.bin").write_bytes(data)  # even the right bytes: not through a link
        blob.symlink_to(tmp_path / "outside.bin")
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", tmp_path / "c",
                     "--json")
    assert result.code == 7, result.err
    assert result.json()["error"]["kind"] == "integrity" and not (tmp_path / "repo" / "base").exists()
    exported = run_cli(capsys, "export", store, tmp_path / "plain")
    assert exported.code == 7 and "not a" in exported.err, exported.err


def test_a_mistyped_environment_in_sync_names_the_close_ones(capsys, tmp_path):
    store = _store_with(tmp_path, env="production")
    result = run_cli(capsys, "sync", store, "--env", "prodution", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 4 and "did you mean production" in result.err, result.err


def test_text_from_hostile_content_is_printed_safely(capsys, tmp_path):
    """A lone surrogate (a valid JSON escape Python cannot encode) and a terminal escape in a manifest's
    config reach validate's report: printed as escapes, never an internal error."""
    import json

    repo = tmp_path / "repo"
    make_version(repo, "m", {"x.txt": b"abc"})
    path = repo / "m" / "1" / "trm-manifest.json"
    data = json.loads(path.read_bytes())
    data["config"] = "\ud800\x1b[2J name"
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    result = run_cli(capsys, "validate", repo)
    assert result.code == 3, result.err
    assert "\\ud800" in result.out and "\x1b" not in result.out


def test_a_manifest_claiming_more_than_the_disk_holds_is_refused_before_downloading(capsys, tmp_path):
    import json

    store = _store_with(tmp_path)
    manifest = open_store(store).get_manifest("base", 1).to_dict()
    manifest["files"][0]["size"] = 4 * 1024 ** 4  # within S3's limit, beyond this test disk
    _put_raw(store, "models/base/versions/1.json", json.dumps(manifest).encode())
    for args in (["sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"],
                 ["export", store, tmp_path / "out"]):
        result = run_cli(capsys, *args)
        assert result.code == 3 and "free" in result.err, result.err
    assert not list((tmp_path / "c" / "partial").iterdir())


def test_publishing_never_writes_through_a_symlinked_model_folder(tmp_path):
    """Every version trm writes (publish, tune --write, sync) is staged by LocalRepository.stage: the rule
    holds there too."""
    from repo_manager.paths import UnsafePathError

    elsewhere = _elsewhere(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "base").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        make_version(repo, "base", {"model.py": b"# v1"})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_a_push_to_an_environment_named_like_an_existing_one_is_refused_as_a_typo(capsys, tmp_path):
    """`--env prd` beside `prod`, `STAGING` beside `staging`: refused before anything is uploaded (nodes watching
    the intended environment would never see the versions); `--create-env` creates it when meant."""
    store = _store_with(tmp_path, env="prod")
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


@pytest.mark.parametrize("location", ["s3:/bucket/p", "s3:bucket", " ", " store"])
def test_a_mistyped_store_url_is_not_taken_for_a_folder(capsys, tmp_path, monkeypatch, location):
    make_version(tmp_path / "src", "base", {"model.py": b"# v1"})
    monkeypatch.chdir(tmp_path)
    result = run_cli(capsys, "push", location, "--repo", tmp_path / "src")
    assert result.code == 2 and "neither s3://bucket/prefix nor a plain folder" in result.err, result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("selection", ["base:", "base:٣", "base:0", "base:-1", "base:1x"])
def test_a_version_selection_must_be_a_plain_positive_number(capsys, tmp_path, selection):
    store = _store_with(tmp_path)
    result = run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--model", selection)
    assert result.code == 2 and "must be a positive number" in result.err, result.err


def test_a_version_file_replaced_by_a_link_is_a_problem_and_is_never_pushed(capsys, tmp_path):
    """The same bytes through a symbolic link to a file outside the repository: validate names it, push
    refuses to read through it (exit 3) and uploads nothing."""
    repo = tmp_path / "src"
    make_version(repo, "base", {"model.py": b"# v1"})
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"# v1")
    (repo / "base" / "1" / "model.py").unlink()
    (repo / "base" / "1" / "model.py").symlink_to(outside)
    problems = run_cli(capsys, "validate", repo, "--json")
    assert "model.py is a symbolic link" in problems.out, problems.out
    result = run_cli(capsys, "push", tmp_path / "store", "--repo", repo, "--env", "prod")
    assert result.code == 3 and "symbolic link" in result.err, result.err
    assert not any(p.is_file() for p in (tmp_path / "store").rglob("*"))


def test_a_fifo_in_a_source_or_a_version_is_refused_never_read(capsys, tmp_path):
    """Reading a FIFO blocks forever: publish refuses the source (exit 3) at once; validate reports one in a
    version folder."""
    source = tmp_path / "s"
    source.mkdir()
    (source / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    os.mkfifo(source / "pipe")
    result = run_cli(capsys, "publish", "model", source, "--name", "x", "--repo", tmp_path / "r",
                     "--input", "X:FP32:4", "--output", "Y:FP32:4", "--no-verify")
    assert result.code == 3 and "not a regular file" in result.err, result.err
    make_version(tmp_path / "repo", "base", {"model.py": b"# v1"})
    os.mkfifo(tmp_path / "repo" / "base" / "1" / "pipe")
    problems = run_cli(capsys, "validate", tmp_path / "repo", "--json")
    assert "pipe is not in the manifest" in problems.out, problems.out


_PASSWORD = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="@\n\r"), min_size=1,
                    max_size=30).filter(lambda p: not (any(c in p for c in '"/') and any(c.isspace() for c in p)))
# (a password with a space and a '/' or '"' in it is not told from a path or the end of a JSON string: such a URL
# is invalid anyway, and refused where trm reads one)


@settings(max_examples=300, deadline=None)
@given(password=_PASSWORD, scheme=st.sampled_from(["http", "https", "s3", "grpc"]))
def test_no_password_survives_redaction_whatever_it_holds(password, scheme):
    """A URL's password may hold quotes, '<', '/', spaces, any letter: none of it reaches output, in a line,
    in JSON, or quoted in an error message."""
    import json

    from repo_manager.redact import printable, redact, redact_data

    secret = f"Zx{password}Qz"
    url = f"{scheme}://user:{secret}@host.example:9/x"
    for text in (f"error: cannot reach {url} (refused)", f"'{url}'", f"<{url}>", json.dumps({"url": url}, indent=2),
                 json.dumps({"a": "x", "url": url, "owner": "me@corp"})):
        for shown in (redact(text), printable(text)):
            assert "Zx" not in shown and "Qz" not in shown, (text, shown)
    assert "Zx" not in json.dumps(redact_data({"store": url, "nested": [url]}))


def test_export_into_the_store_itself_is_refused(capsys, tmp_path):
    store = _store_with(tmp_path)
    before = tree_digest(Path(store))
    for dest in (store, Path(store) / "plain", tmp_path):
        result = run_cli(capsys, "export", store, dest)
        assert result.code == 2 and "one holds the other" in result.err, (dest, result.err)
    assert tree_digest(Path(store)) == before


def test_a_cache_blob_of_the_wrong_size_is_replaced_not_reused(capsys, tmp_path):
    """A repository file edited in place writes through its hard link into the cache: the next sync that
    needs the blob finds it the wrong size, fetches it again and replaces it (it used to keep the bad one,
    as if another writer had installed it)."""
    import hashlib

    store = _store_with(tmp_path)
    cache = tmp_path / "cache"
    assert run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "a", "--cache", cache).code == 0
    blob = cache / "blobs" / "sha256" / hashlib.sha256(b"# v1").hexdigest()
    os.chmod(blob, 0o644)
    blob.write_bytes(b"X")  # what an in-place edit of a/base/1/model.py did
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "b", "--cache", cache)
    assert result.code == 0, result.err
    assert (tmp_path / "b" / "base" / "1" / "model.py").read_bytes() == b"# v1"
    assert blob.read_bytes() == b"# v1" and LocalRepository(tmp_path / "b").validate() == []


@pytest.mark.parametrize("data", ['"QUJDé"', "[]", '""', "0", '{"warmup/x": 5}', '{"warmup/x": "!!"}'])
def test_a_manifest_with_malformed_data_files_is_refused_as_corrupt(capsys, tmp_path, data):
    import json

    store = _store_with(tmp_path)
    [manifest] = list((Path(store) / "models" / "base").rglob("1.json"))
    document = json.loads(manifest.read_text())
    document["data"] = json.loads(data) if data != '"QUJDé"' else {"warmup/input0.raw": "QUJDé"}
    manifest.write_text(json.dumps(document))
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 7 and "data" in result.err, result.err


@pytest.mark.parametrize("ports, message", [(("--http-port", "9000", "--grpc-port", "9000"), "are both 9000"),
                                            (("--http-port", "70000"), "70000 is not in the range"),
                                            (("--trm-metrics-port", "-1"), "-1 is not in the range")])
def test_serve_refuses_ports_it_cannot_use_before_starting_anything(capsys, tmp_path, ports, message):
    (tmp_path / "repo").mkdir()
    result = run_cli(capsys, "serve", "--repo", tmp_path / "repo", *ports)
    assert result.code == 2 and message in result.err, result.err


# ------------------------------------------------------------------ a second sweep: numbers, specs, files
@pytest.mark.parametrize("args, message", [
    (("--input", "X:FP32:-5"), "each dim is -1"), (("--input", "X:FP32:0"), "each dim is -1"),
    (("--input", "X:FP32:99999999999999999999"), "each dim is -1"), (("--input", "X Y:FP32:4"), "no spaces"),
    (("--input", "X:FP32:4", "--input", "X:FP32:4"), "named twice"), (("--input", "Y:FP32:4"), "named twice"),
    (("--input", "X:FP32:4", "--max-batch-size", "1000000000000"), "not in the range"),
    (("--input", "X:FP32:4", "--instances", "100000000000000000000"), "not in the range"),
    (("--input", "X:FP32:4", "--max-batch-size", "-1"), "not in the range")])
def test_publish_refuses_tensor_specs_and_numbers_triton_cannot_take(capsys, tmp_path, args, message):
    source = tmp_path / "s"
    source.mkdir()
    (source / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    result = run_cli(capsys, "publish", "model", source, "--name", "m", "--repo", tmp_path / "r", "--output",
                     "Y:FP32:4", "--no-verify", *args)
    assert result.code in (2, 3) and message in result.err, result.err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").rglob("config.pbtxt"))


def test_plan_and_doctor_refuse_absurd_numbers_and_facts(capsys, tmp_path):
    import json

    huge = run_cli(capsys, "plan", tmp_path, "--gpu-memory", "1e308")
    assert huge.code == 2 and "--gpu-memory" in huge.err, huge.err
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 0, "vocab_size": 100}))
    zero = run_cli(capsys, "plan", checkpoint, "--gpu-memory", "80")
    assert zero.code == 3 and "head_dim" in zero.err, zero.err
    facts = tmp_path / "facts.json"
    for text, message in (('{"gpus": [], "framework_cuda": "x"}', "framework_cuda"),
                          ('{"gpus": [{"name": null, "memory_bytes": "80GB", "compute_capability": 9.0}]}',
                           "gpus[0]"), ("[" * 100_000, "nested too deeply"), ("{", "not valid JSON")):
        facts.write_text(text)
        result = run_cli(capsys, "doctor", "--repo", tmp_path, "--node-facts", facts, "--json")
        assert result.code == 3 and message in result.err and result.json()["error"]["exit_code"] == 3, result.err


def test_observe_rules_refuses_durations_selectors_and_outputs_prometheus_would_not_take(capsys, tmp_path):
    make_version(tmp_path / "repo", "base", {"model.py": b"# v1"})
    elsewhere = _elsewhere(tmp_path)
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    common = ("observe", "rules", "--repo", tmp_path / "repo")
    for args, code, message in ((("--queue-for", "1x"), 2, "not a Prometheus duration"),
                                (("--rate-window", ""), 2, "not a Prometheus duration"),
                                (("--versions-for", "-1m"), 2, "not a Prometheus duration"),
                                (("--selector", 'job="triton'), 2, "not a list of label matchers"),
                                (("--selector", 'job="a"}) or vector(1) #'), 2, "not a list of label matchers"),
                                (("--out", tmp_path / "linked"), 3, "symbolic link"),
                                (("--out", "/proc/nope"), 3, "cannot create")):
        result = run_cli(capsys, *common, *(("--out", tmp_path / "o") if "--out" not in args else ()), *args)
        assert result.code == code and message in result.err, (args, result.err)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]
    ok = run_cli(capsys, *common, "--out", tmp_path / "o", "--selector", 'job="triton",namespace=~"prod.*"')
    assert ok.code == 0, ok.err


@pytest.mark.parametrize("args", [("--interval", "inf"), ("--interval", "nan"), ("--backoff", "inf"),
                                  ("--drain-timeout", "nan"), ("--max-unavailable", "100000000000000000000"),
                                  ("--pod-name", "../x")])
def test_agent_refuses_absurd_options_before_starting(capsys, tmp_path, args):
    result = run_cli(capsys, "agent", tmp_path / "store", "--env", "prod", "--repo", tmp_path / "r",
                     "--url", "http://127.0.0.1:9", *args)
    assert result.code == 2 and args[0] in result.err, result.err


def test_an_internal_error_is_still_json_with_json(capsys, tmp_path, monkeypatch):
    """Mock, named as such: a bug cannot be produced for real. Whatever raises, --json prints JSON (exit 1)."""
    import json

    import repo_manager.push

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(repo_manager.push, "push", broken)
    make_version(tmp_path / "src", "base", {"model.py": b"# v1"})
    result = run_cli(capsys, "--json", "push", tmp_path / "store", "--repo", tmp_path / "src")
    assert result.code == 1 and json.loads(result.out)["error"]["kind"] == "internal", result.out


@pytest.mark.parametrize("version", ["0", "-1", "100000000000000000000"])
def test_infer_refuses_a_version_that_cannot_exist(capsys, tmp_path, version):
    result = run_cli(capsys, "infer", "m", "--version", version, "--url", "http://127.0.0.1:9", "--text", "x")
    assert result.code == 2 and "--version" in result.err, result.err
