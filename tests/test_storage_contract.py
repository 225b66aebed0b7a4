"""One contract, every store: the folder store and S3 (a real SeaweedFS on 127.0.0.1) behave the same."""

from __future__ import annotations

import hashlib
import threading

import pytest

from repo_manager.adapters.storage import EnvPointer, open_store
from repo_manager.adapters.storage import s3 as s3_module
from repo_manager.adapters.storage.base import blob_key
from repo_manager.core.errors import ConflictError, IntegrityError, NotFoundError
from repo_manager.core.manifest import FileEntry, Manifest
from repo_manager.core.settings import Settings

CONFIG = 'name: "m"\nbackend: "python"\n'


@pytest.fixture(params=["folder", "s3"])
def store(request, tmp_path):
    if request.param == "folder":
        return open_store(str(tmp_path / "store"))
    location = request.getfixturevalue("s3_location")
    return open_store(location, Settings())


def _blob(tmp_path, data: bytes):
    path = tmp_path / f"blob-{hashlib.sha256(data).hexdigest()[:8]}"
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def _manifest(model="m", version=1, data=b"weights", note=""):
    entry = FileEntry("model.bin", len(data), hashlib.sha256(data).hexdigest())
    return Manifest(model=model, version=version, files=(entry,), config=CONFIG, source={"note": note})


def _race(write, writers: int = 6) -> list[int]:
    """Run ``write(i)`` in ``writers`` threads released at once; the indexes that did not conflict."""
    winners, barrier = [], threading.Barrier(writers)

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            write(i)
            winners.append(i)
        except ConflictError:
            pass
    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return winners


def test_blob_round_trip_and_ranges(store, tmp_path):
    data = bytes(range(256)) * 1000
    path, digest = _blob(tmp_path, data)
    assert not store.has_blob(digest)
    assert store.put_blob(digest, path, len(data)) is True
    assert store.put_blob(digest, path, len(data)) is False  # already there: not uploaded twice
    assert store.has_blob(digest) and store.blob_size(digest) == len(data)
    assert b"".join(store.read_blob(digest)) == data
    assert b"".join(store.read_blob(digest, 1000, 5000)) == data[1000:6000]


def test_blob_whose_content_does_not_match_its_digest_is_refused(store, tmp_path):
    path, _ = _blob(tmp_path, b"real content")
    wrong = hashlib.sha256(b"other content").hexdigest()
    with pytest.raises(IntegrityError):
        store.put_blob(wrong, path, path.stat().st_size)
    assert not store.has_blob(wrong)


def test_missing_objects_raise_not_found(store):
    with pytest.raises(NotFoundError):
        store.get_manifest("m", 1)
    with pytest.raises(NotFoundError):
        store.get_env("production")
    with pytest.raises(NotFoundError):
        store.blob_size("0" * 64)
    assert store.list_versions("m") == []


def test_a_version_number_is_claimed_once(store):
    store.put_manifest(_manifest(note="first"))
    with pytest.raises(ConflictError):
        store.put_manifest(_manifest(note="second"))
    assert store.get_manifest("m", 1).source == {"note": "first"}
    store.put_manifest(_manifest(version=2))
    assert store.list_versions("m") == [1, 2]
    assert store.list_models() == ["m"]


def test_racing_writers_for_one_version_have_exactly_one_winner(store):
    winners = _race(lambda i: store.put_manifest(_manifest(version=7, note=str(i))))
    assert len(winners) == 1
    assert store.get_manifest("m", 7).source == {"note": str(winners[0])}


def test_environment_pointer_is_compare_and_swap(store):
    first = store.put_env(EnvPointer("staging", {"m": 1}))
    with pytest.raises(ConflictError):  # creating it again: it exists
        store.put_env(EnvPointer("staging", {"m": 9}))
    current = store.get_env("staging")
    assert current.models == {"m": 1} and current.etag == first
    store.put_env(current.with_models({"m": 2}))
    with pytest.raises(ConflictError):  # a writer holding the old tag loses
        store.put_env(current.with_models({"m": 3}))
    assert store.get_env("staging").models == {"m": 2}
    assert store.update_env("staging", {"other": 4}).models == {"m": 2, "other": 4}


def test_environments_are_listed_by_name(store):
    assert store.list_envs() == []
    for env in ("staging", "production"):
        store.put_env(EnvPointer(env, {"m": 1}))
    store.update_env("staging", {"m": 2})  # a second revision is still one environment
    assert store.list_envs() == ["production", "staging"]


def test_racing_environment_writers_have_exactly_one_winner(store):
    store.put_env(EnvPointer("prod", {"m": 1}))
    current = store.get_env("prod")
    winners = _race(lambda i: store.put_env(current.with_models({"m": 10 + i})))
    assert len(winners) == 1
    assert store.get_env("prod").models == {"m": 10 + winners[0]}


@pytest.mark.parametrize("payload", [
    b"not json",
    b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "", "files": '
    b'[{"path": "../../etc/passwd", "size": 1, "sha256": "' + b"a" * 64 + b'"}]}',
    b'{"schema": "trm.manifest/1", "model": "other", "version": 1, "config": "", "files": []}',
])
def test_hostile_manifests_are_refused(store, payload):
    store.put_object("models/m/versions/1.json", payload, if_absent=True)
    with pytest.raises(IntegrityError):
        store.get_manifest("m", 1)


def test_hostile_environment_pointer_is_refused(store):
    store.put_object("envs/prod.json", b'{"schema": "trm.env/1", "env": "prod", "models": {"../x": 1}}',
                     if_absent=True)
    with pytest.raises(IntegrityError):
        store.get_env("prod")


def test_multipart_upload_round_trip(store, tmp_path, monkeypatch):
    # small thresholds so a multipart upload happens without a large file
    monkeypatch.setattr(s3_module, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3_module, "PART_SIZE", 5 * 1024 * 1024)
    data = hashlib.sha256(b"seed").digest() * (12 * 1024 * 1024 // 32 + 7)
    path, digest = _blob(tmp_path, data)
    assert store.put_blob(digest, path, len(data))
    assert store.blob_size(digest) == len(data)
    got = hashlib.sha256(b"".join(store.read_blob(digest))).hexdigest()
    assert got == digest
    assert blob_key(digest).endswith(digest)


def test_conditional_read_of_a_pointer_returns_nothing_while_its_tag_is_unchanged(store):
    tag = store.put_env(EnvPointer("prod", {"m": 1}))
    assert store.get_env_if_changed("prod", tag) is None  # S3: one GET answered 304, no body
    changed = store.update_env("prod", {"m": 2})
    pointer = store.get_env_if_changed("prod", tag)
    assert pointer is not None and pointer.models == {"m": 2} and pointer.etag == changed.etag != tag
    pointer = store.get_env_if_changed("prod", None)
    assert pointer is not None and pointer.models == {"m": 2}
    with pytest.raises(NotFoundError):
        store.get_env_if_changed("absent", tag)


def test_sigv4_signer_matches_botocore():
    """The stdlib signer of the sync read path signs exactly as botocore does (with and without a
    session token)."""
    import calendar
    import time

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from repo_manager.adapters.storage.sigv4 import Keys, Signer

    url = "http://127.0.0.1:8333/bucket/some%20dir/blobs/sha256/a~b_c.json"
    for token in (None, "session-token"):
        request = AWSRequest(method="GET", url=url, headers={})
        S3SigV4Auth(Credentials("AKID", "secret/key+x", token), "s3", "eu-west-1").add_auth(request)
        now = calendar.timegm(time.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
        ours = Signer("eu-west-1").get_headers(url, Keys("AKID", "secret/key+x", token), now=now)
        assert ours["Authorization"] == request.headers["Authorization"]


@pytest.mark.parametrize("source_kind", ["folder", "s3"])
def test_a_blob_is_copied_from_another_store_part_by_part_and_checked(store, source_kind, tmp_path, monkeypatch,
                                                                       request):
    """``copy_blob``: between any two stores (server-side only inside one S3 endpoint), else streamed through
    this machine one part at a time: a multipart upload of several parts arrives whole, and a source whose
    bytes do not match the digest creates nothing."""
    from repo_manager.adapters.storage import open_store

    monkeypatch.setattr(s3_module, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3_module, "PART_SIZE", 5 * 1024 * 1024)
    source = (open_store(str(tmp_path / "source")) if source_kind == "folder"
              else open_store(request.getfixturevalue("s3_location") + "-source"))
    data = hashlib.sha256(b"copy").digest() * (12 * 1024 * 1024 // 32 + 3)
    path, digest = _blob(tmp_path, data)
    source.put_blob(digest, path, len(data))
    server_side = store.copy_blob(source, digest, len(data))
    assert server_side == (source_kind == "s3" and store.location.startswith("s3://"))
    assert hashlib.sha256(b"".join(store.read_blob(digest))).hexdigest() == digest
    wrong = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(IntegrityError):
        store.put_stream(blob_key(wrong), iter([data[:1024]]), 1024, wrong)
    assert not store.has_blob(wrong)



def test_a_blob_copied_with_a_local_copy_is_uploaded_from_it_and_checked(store, tmp_path):
    """``copy_blob(..., local=PATH)`` (promote: the node cache holds the bytes it verified): where the service
    cannot copy, the blob is uploaded from the local file, the source is not read again; a local file that no
    longer matches the digest creates nothing."""
    from repo_manager.adapters.storage import open_store

    source = open_store(str(tmp_path / "source"))  # a folder: never a server-side copy; it lacks the blob
    data = b"verified bytes " * 1000
    path, digest = _blob(tmp_path, data)
    assert store.copy_blob(source, digest, len(data), local=path) is False
    assert b"".join(store.read_blob(digest)) == data
    changed = tmp_path / "changed"
    changed.write_bytes(b"x" * len(data))
    wrong = hashlib.sha256(b"y" * len(data)).hexdigest()
    with pytest.raises(IntegrityError):
        store.copy_blob(source, wrong, len(data), local=changed)
    assert not store.has_blob(wrong)
