"""Paths and names on disk: nothing trm writes, reads or deletes goes through a symbolic link, a FIFO or into a
folder outside its target (sync, its cache, export, validate --fix, publish, push), and the names trm reads from
disk or a store are ones every filesystem and Triton read alike. Each case ends with a one-line error and a
documented exit code (never 1), or is skipped with a note; what stands outside the target is left as it was.

A folder store keeps each case fast (the rules live above the backends); no server is started.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import run_cli
from store_helpers import make_version, outside_folder, pushed_store, python_config, tree_digest

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.core.errors import InputError
from repo_manager.core.manifest import Manifest


# ------------------------------------------------------------------------- links, FIFOs, folders outside
def test_sync_never_installs_through_a_symlinked_model_folder(capsys, tmp_path):
    store = pushed_store(tmp_path)
    elsewhere = outside_folder(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "base").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "cache")
    assert result.code == 3, result.err
    assert "symbolic link" in result.err and str(repo / "base") in result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_sync_never_writes_through_a_symlink_inside_the_cache(capsys, tmp_path):
    store = pushed_store(tmp_path)
    elsewhere = outside_folder(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "blobs").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", cache)
    assert result.code == 3, result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_a_link_planted_in_the_cache_is_never_written_through(capsys, tmp_path):
    """A partial download folder and a lock file that are symbolic links: the download goes elsewhere in the
    cache, never through them."""
    import hashlib

    big = b"x" * (40 * 1024 * 1024)  # above the ranged threshold: the partial-folder path
    store = pushed_store(tmp_path, files={"w.bin": big})
    elsewhere = outside_folder(tmp_path)
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


def test_the_sync_record_is_never_written_through_a_link_planted_in_the_cache(capsys, tmp_path):
    """<cache>/state (what the quick path reads) as a symbolic link: the sync completes and writes nothing
    through it (the record is best effort: without it the next sync plans in full)."""
    store = pushed_store(tmp_path)
    elsewhere = outside_folder(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "state").symlink_to(elsewhere, target_is_directory=True)
    for _ in range(2):
        result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "repo", "--cache", cache)
        assert result.code == 0, result.err
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["precious"]
    assert (tmp_path / "repo" / "base" / "1" / "model.py").read_bytes() == b"# v1"


def test_export_never_writes_through_a_symlinked_destination_folder(capsys, tmp_path):
    store = pushed_store(tmp_path)
    elsewhere = outside_folder(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "base").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "export", store, dest)
    assert result.code == 3, result.err
    assert "symbolic link" in result.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_export_into_the_store_itself_is_refused(capsys, tmp_path):
    store = pushed_store(tmp_path)
    before = tree_digest(Path(store))
    for dest in (store, Path(store) / "plain", tmp_path):
        result = run_cli(capsys, "export", store, dest)
        assert result.code == 2 and "one holds the other" in result.err, (dest, result.err)
    assert tree_digest(Path(store)) == before


def test_validate_fix_never_deletes_through_a_symlinked_model_folder(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "real", {"model.py": b"# v1"})
    elsewhere = outside_folder(tmp_path)
    (elsewhere / ".trm-tmp-999999999-abc").mkdir()
    (elsewhere / ".trm-tmp-999999999-abc" / "data").write_text("not trm's")
    (repo / "linked").symlink_to(elsewhere, target_is_directory=True)
    result = run_cli(capsys, "validate", repo, "--fix")
    assert result.code == 3, result.err
    assert "symbolic link out of the repository" in result.out
    assert (elsewhere / ".trm-tmp-999999999-abc" / "data").read_text() == "not trm's"


def test_publishing_never_writes_through_a_symlinked_model_folder(tmp_path):
    """Every version trm writes (publish, tune --write, sync) is staged by LocalRepository.stage: the rule
    holds there too."""
    from repo_manager.core.paths import UnsafePathError

    elsewhere = outside_folder(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "base").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        make_version(repo, "base", {"model.py": b"# v1"})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


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


@pytest.mark.parametrize("kind", ["folder", "fifo", "link"])
def test_a_store_object_that_is_not_a_regular_file_is_a_store_error(capsys, tmp_path, kind):
    """A folder store's blob replaced by a folder, a FIFO (a read would block forever) or a link to a file
    outside the store: sync and export refuse it (exit 7) and install nothing."""
    import hashlib

    data = b"# weights\n" * 1000
    store = pushed_store(tmp_path, files={"w.bin": data})
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


# ------------------------------------------------------------------------------------------ names on disk
@pytest.mark.parametrize("name", ["a\nb.txt", "tab\there", "del\x7f", "back\\slash"])
def test_store_file_names_are_limited_to_a_portable_set(capsys, tmp_path, name):
    store = pushed_store(tmp_path)
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
    store = pushed_store(tmp_path, model="BASE")
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "c")
    assert result.code == 3 and "only in case" in result.err, result.err
    assert not (repo / "BASE").exists()
    # validate: two folders that already collide
    (repo / "Base").mkdir()
    (repo / "Base" / "config.pbtxt").write_text(python_config("Base"))
    report = run_cli(capsys, "validate", repo, "--json")
    assert report.code == 3 and any("differ only in case" in p for p in report.json()["problems"])


def test_a_model_folder_with_a_bad_name_is_still_a_problem(capsys, tmp_path):
    repo = tmp_path / "repo"
    make_version(repo, "m", {"model.py": b"# v1"})
    (repo / "bad name").mkdir()
    (repo / "bad name" / "config.pbtxt").write_text(python_config("m"))
    result = run_cli(capsys, "validate", repo, "--json")
    assert result.code == 3 and any("bad name" in p for p in result.json()["problems"])
