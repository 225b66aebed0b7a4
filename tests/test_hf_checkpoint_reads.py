"""A Hugging Face checkpoint's files are listed inside it: the download cache's links into ``blobs/`` are
followed (only into that cache repository, only to regular files), any other link is refused naming it, and a
file or folder that cannot be read is an error naming it, never left out of the record in silence."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import hf_checkpoints as hf
import pytest
from unreadable import hide, trm_unprivileged

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.paths import SourceReadError
from repo_manager.ops.publish.huggingface.checkpoint import inspect_checkpoint

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    folder = hf.tiny_bert(tmp_path_factory.mktemp("plain") / "tiny")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.json").write_text("{}\n")
    return folder


def cached(plain: Path, hub: Path) -> Path:
    """``plain`` laid out as huggingface_hub's download cache lays it out: every file of
    ``models--org--tiny/snapshots/REV/`` is a relative link to its content in ``models--org--tiny/blobs/``."""
    repository = hub / "models--org--tiny"
    snapshot = repository / "snapshots" / REVISION
    (repository / "blobs").mkdir(parents=True)
    for path in sorted(plain.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = repository / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(plain)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_a_cached_checkpoint_lists_the_same_files_as_the_plain_folder(plain, tmp_path):
    snapshot = cached(plain, tmp_path / "hub")
    files = inspect_checkpoint(snapshot).files
    assert files == inspect_checkpoint(plain).files
    assert "extra/notes.json" in files and "config.json" in files


@pytest.mark.parametrize("case", ["file_outside", "folder_outside", "folder_inside", "other_cache_repository"])
def test_a_link_that_leaves_the_checkpoint_is_refused_naming_it(plain, tmp_path, case):
    """A link out of the cache repository (to a file or a folder), a link to a folder, and a link into a
    neighbouring cache repository are refused: the file outside was hashed into the record and the folders
    were passed over in silence."""
    snapshot = cached(plain, tmp_path / "hub")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text('{"token": "hf_x"}\n')
    link = snapshot / "added.json"
    if case == "file_outside":
        link.symlink_to(outside / "secret.json")
    elif case == "folder_outside":
        link = snapshot / "added"
        link.symlink_to(outside)
    elif case == "folder_inside":
        link = snapshot / "added"
        link.symlink_to("extra")
    else:
        neighbour = tmp_path / "hub" / "models--org--other" / "blobs"
        neighbour.mkdir(parents=True)
        (neighbour / "abc").write_text("{}\n")
        link.symlink_to(os.path.relpath(neighbour / "abc", snapshot))
    with pytest.raises(SourceReadError) as caught:
        inspect_checkpoint(snapshot)
    assert caught.value.path == link and str(link) in caught.value.message
    assert "\n" not in caught.value.message


def test_a_link_inside_a_plain_checkpoint_folder_is_followed(plain, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    for path in plain.iterdir():
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.json").symlink_to("../config.json")
    assert "extra/notes.json" in inspect_checkpoint(folder).files


@pytest.mark.parametrize("hidden", ["extra", "blob"])
def test_an_unreadable_folder_or_blob_of_a_cached_checkpoint_fails_the_publish_naming_it(plain, tmp_path, hidden):
    """No mock: trm runs where the kernel refuses the reads (tests/unreadable.py). The unreadable folder was
    left out of the record in silence (exit 0), the unreadable blob an internal error."""
    snapshot = cached(plain, tmp_path / "hub")
    named = snapshot / "extra" if hidden == "extra" else snapshot / "extra" / "notes.json"
    target = named if hidden == "extra" else (named.parent / os.readlink(named)).resolve()
    hide(target)
    repo = tmp_path / "repo"
    code, _, err = trm_unprivileged("publish", "model", snapshot, "--name", "tiny", "--repo", repo, "--no-verify")
    target.chmod(0o755)
    assert code == 3, err
    assert err.splitlines()[0].startswith(f"error: {named} cannot be read (permission denied"), err
    assert len(err.strip().splitlines()) <= 2
    assert LocalRepository(repo).versions("tiny") == []
