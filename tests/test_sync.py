"""`trm sync` against a real SeaweedFS on 127.0.0.1: incremental, verified, atomic, resumable, shared cache. (A
folder store where the rule lives above the backends: a different local version, a bad cache blob.)"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
from helpers import run_cli
from seaweed import BUCKET, SeaweedServer
from store_helpers import ROOT, finish, make_version, pseudo_random, pushed_store, tree_digest, trm_process

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.storage.base import blob_key

MB = 1024 * 1024


def _push(capsys, src, location, *extra):
    result = run_cli(capsys, "push", location, "--repo", src, "--env", "prod", "--json", *extra)
    assert result.code == 0, result.err
    return result.json()


def _sync(capsys, location, dst, cache, *extra):
    return run_cli(capsys, "sync", location, "--env", "prod", "--repo", dst, "--cache", cache, "--json", *extra)


def _raw_client():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])


def _raw_key(location: str, key: str) -> str:
    return location[len(f"s3://{BUCKET}/"):] + "/" + key


def test_incremental_sync_downloads_only_what_changed_and_reuses_the_rest(capsys, s3_location, tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    big, small, changed = pseudo_random(3 * MB, 1), b"tokenizer", pseudo_random(MB, 2)
    make_version(src, "m", {"weights.bin": big, "tok/vocab.txt": small})
    _push(capsys, src, s3_location)
    first = _sync(capsys, s3_location, dst, cache)
    assert first.code == 0, first.err
    summary = first.json()
    assert summary["installed"] == ["m/1"] and summary["bytes_downloaded"] == len(big) + len(small)
    assert tree_digest(dst / "m" / "1") == tree_digest(src / "m" / "1")
    assert (dst / "m" / "config.pbtxt").read_text() == (src / "m" / "config.pbtxt").read_text()
    assert LocalRepository(dst).validate() == []

    again = _sync(capsys, s3_location, dst, cache).json()  # nothing changed: one small read, local stats
    assert again["unchanged"] and again["bytes_downloaded"] == 0 and again["remote_reads"] == 1

    make_version(src, "m", {"weights.bin": big, "tok/vocab.txt": changed})
    _push(capsys, src, s3_location, "--model", "m:2")
    second = _sync(capsys, s3_location, dst, cache).json()
    assert second["installed"] == ["m/2"]
    assert second["bytes_downloaded"] == len(changed) and second["bytes_reused"] == len(big)
    assert (dst / "m" / "2" / "weights.bin").stat().st_ino == (dst / "m" / "1" / "weights.bin").stat().st_ino

    other_pod = _sync(capsys, s3_location, tmp_path / "dst2", cache).json()  # a second pod on this node
    assert other_pod["bytes_downloaded"] == 0 and other_pod["bytes_reused"] == len(big) + len(changed)


def test_dry_run_prints_the_plan_and_changes_nothing(capsys, s3_location, tmp_path):
    make_version(tmp_path / "src", "m", {"a.bin": b"a" * 100})
    _push(capsys, tmp_path / "src", s3_location)
    result = _sync(capsys, s3_location, tmp_path / "dst", tmp_path / "cache", "--dry-run")
    assert result.code == 0, result.err
    plan = result.json()["plan"]
    assert plan["models"][0]["action"] == "install" and plan["download_bytes"] == 100
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "corrupt-ranged", "truncated-ranged"])
def test_a_bad_object_in_the_store_is_fetched_again_then_reported_never_installed(capsys, s3_location, tmp_path,
                                                                                   damage, monkeypatch):
    from repo_manager.adapters import transfer

    if damage.endswith("ranged"):  # 64 KiB parts: the 300 kB blob is fetched as ranged parts
        monkeypatch.setattr(transfer, "PART_SIZE", 64 * 1024)
    manifest = make_version(tmp_path / "src", "m", {"w.bin": pseudo_random(300_000, 3)})
    _push(capsys, tmp_path / "src", s3_location)
    digest = manifest.files[0].sha256
    good = pseudo_random(300_000, 3)
    bad = good[:250_000] + b"X" + good[250_001:] if damage.startswith("corrupt") else good[:200_000]
    _raw_client().put_object(Bucket=BUCKET, Key=_raw_key(s3_location, blob_key(digest)), Body=bad)
    result = _sync(capsys, s3_location, tmp_path / "dst", tmp_path / "cache")
    assert result.code == 7, result.err
    assert result.json()["error"]["kind"] == "integrity"
    assert not (tmp_path / "dst" / "m" / "1").exists()
    assert not (tmp_path / "cache" / "blobs" / "sha256" / digest).exists()
    assert list((tmp_path / "cache" / "partial").iterdir()) == []


def _wait_for_parts(cache, count: int, process, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [p for p in (cache / "partial").glob("*/done/*") if not p.name.endswith(".synced")] \
            if (cache / "partial").exists() else []
        if len(done) >= count:
            return
        assert process.poll() is None, f"sync ended before it could be interrupted: {process.stderr.read()}"
        time.sleep(0.01)
    raise AssertionError("no part was downloaded in time")


def test_sync_killed_mid_download_resumes_and_never_shows_a_partial_version(capsys, s3_location, tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(24 * MB, 4)
    make_version(src, "m", {"model.py": b"# old"})
    make_version(src, "m", {"weights.bin": weights, "model.py": b"# new"})
    _push(capsys, src, s3_location, "--model", "m:1")
    assert _sync(capsys, s3_location, dst, cache).code == 0
    _push(capsys, src, s3_location, "--model", "m:2")
    before = tree_digest(dst)
    env = {"TRM_SYNC_PART_SIZE": str(MB)}
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                          "--limit-rate", "12", env=env)
    _wait_for_parts(cache, 4, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert tree_digest(dst) == before  # as it was: no version 2 folder, config untouched
    assert LocalRepository(dst).versions("m") == [1]
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json", env=env))
    assert code == 0, err
    assert summary["installed"] == ["m/2"]
    assert summary["bytes_resumed"] >= 4 * MB
    assert summary["bytes_downloaded"] + summary["bytes_resumed"] == len(weights)  # model.py: already cached
    assert (dst / "m" / "2" / "weights.bin").read_bytes() == weights
    assert LocalRepository(dst).validate() == []


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_sync_stops_downloading_at_once_and_the_next_one_resumes(capsys, s3_location, tmp_path,
                                                                            signum, code):
    """SIGTERM (a pod being deleted) or Ctrl-C mid-download: trm stops downloading within a piece, instead of
    fetching the whole plan before it exits (which can outlast a pod's grace period); nothing is installed
    and what it fetched stays for the next sync to resume."""
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(24 * MB, 50 + signum)
    make_version(src, "m", {"weights.bin": weights, "model.py": b"# m"})
    _push(capsys, src, s3_location)
    env = {"TRM_SYNC_PART_SIZE": str(MB)}
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                          "--limit-rate", "4", env=env,  # 6 s for the whole blob
                          # a shell that started the tests in the background may ignore SIGINT, and so would trm
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_parts(cache, 2, process)
    process.send_signal(signum)
    returncode, _, err = finish(process, timeout=60)
    assert returncode == code, err
    assert not (cache / "blobs" / "sha256" / hashlib.sha256(weights).hexdigest()).exists()  # not finished first
    assert not (dst / "m").exists()
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json", env=env))
    assert code == 0, err
    assert summary["bytes_resumed"] > 0 and summary["bytes_downloaded"] < len(weights)
    assert (dst / "m" / "1" / "weights.bin").read_bytes() == weights


def test_a_stop_event_ends_the_downloads_of_a_running_sync(capsys, s3_location, tmp_path):
    """What the agent does on SIGTERM (its stop event, passed to the sync): the downloads end within a piece
    with ``Cancelled``, nothing is installed, the partial download stays and the next sync resumes it."""
    import threading

    from repo_manager.adapters.transfer import Cancelled
    from repo_manager.core.settings import Settings
    from repo_manager.ops.sync import plan_sync
    from repo_manager.ops.sync.executor import execute

    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(40 * MB, 61)  # above the ranged threshold: parts in a partial folder
    make_version(src, "m", {"weights.bin": weights})
    _push(capsys, src, s3_location)
    settings = Settings(repository=dst, cache_dir=cache)
    store = open_store(s3_location, settings)
    stop, outcome = threading.Event(), []

    def run() -> None:
        try:
            execute(plan_sync(settings, store, env="prod"), store, limit_bytes_per_s=4 * MB, stop=stop)
            outcome.append("finished")
        except Cancelled:
            outcome.append("cancelled")
    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not list(cache.glob("partial/*/done/*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    worker.join(timeout=30)
    assert not worker.is_alive() and outcome == ["cancelled"]
    assert not (cache / "blobs" / "sha256" / hashlib.sha256(weights).hexdigest()).exists()
    assert not (dst / "m").exists()
    resumed = _sync(capsys, s3_location, dst, cache)
    assert resumed.code == 0 and resumed.json()["bytes_resumed"] > 0, resumed.err
    assert (dst / "m" / "1" / "weights.bin").read_bytes() == weights


def test_what_a_killed_sync_left_is_cleared_by_the_next_one(capsys, s3_location, tmp_path):
    """A sync SIGKILLed while it assembled a version leaves its staging folder (hard links that keep cache
    blobs from being collected): the next sync that installs the model removes it (its owner is gone); a
    running writer's stays. (A small download writes an anonymous file: a kill leaves nothing of it.)"""
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    small = pseudo_random(20_000, 77)
    make_version(src, "m", {"small.bin": small, "model.py": b"# m"})
    _push(capsys, src, s3_location)
    dead = dst / "m" / ".trm-tmp-4194399-0123abcd"  # above Linux's largest pid: no such process
    live = dst / "m" / f".trm-tmp-{os.getppid()}-4567ef"  # a running process: a writer still at work
    for folder in (dead, live):
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "small.bin").write_bytes(small[:100])
    result = _sync(capsys, s3_location, dst, cache)
    assert result.code == 0, result.err
    assert not dead.exists() and live.exists()
    assert (dst / "m" / "1" / "small.bin").read_bytes() == small
    assert list((cache / "partial").iterdir()) == []


def _file_size_limit(limit: int):
    """A real refused write for a child process: RLIMIT_FSIZE (writes past it fail with EFBIG, SIGXFSZ
    ignored), what a full disk or a quota does to a sync part-way."""
    import resource

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_node_that_refuses_a_write_is_exit_3_and_the_next_sync_completes(capsys, s3_location, tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(12 * MB, 9)
    make_version(src, "m", {"weights.bin": weights, "model.py": b"# m"})
    _push(capsys, src, s3_location)
    env = {"TRM_SYNC_PART_SIZE": str(MB)}
    refused = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json", env=env,
                          preexec_fn=_file_size_limit(5 * MB))
    code, summary, err = finish(refused)
    assert code == 3, err  # not an internal error: the node's refusal, named, with what to do
    assert err.count("\n") <= 2 and "could not write" in err and "File too large" in err, err
    assert not (dst / "m" / "1").exists()  # nothing half-installed
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json", env=env))
    assert code == 0, err
    assert summary["installed"] == ["m/1"]
    # model.py (3 bytes) is in the cache unless the refused write stopped its download first
    assert summary["bytes_downloaded"] + summary["bytes_resumed"] in (len(weights), len(weights) + 3)
    assert (dst / "m" / "1" / "weights.bin").read_bytes() == weights


def test_the_writer_thread_reports_a_failed_write_and_stops_the_receivers(tmp_path):
    import errno

    from repo_manager.adapters.transfer import UNIT, _Aborted, _StreamHasher

    (tmp_path / "data").write_bytes(b"")
    (tmp_path / "done").mkdir()
    fd = os.open(tmp_path / "data", os.O_RDONLY)  # every write fails (EBADF), like a disk that went away
    try:
        hasher = _StreamHasher(fd, 2 * UNIT, [2 * UNIT], [0], tmp_path / "done")
        hasher.feed(0, bytes(UNIT))
        hasher.thread.join(10)
        assert not hasher.thread.is_alive()
        with pytest.raises(_Aborted):  # a receiver stops at its next unit (and reports nothing itself)
            hasher.feed(0, bytes(UNIT))
        with pytest.raises(OSError) as caught:
            hasher.finish()
        assert caught.value.errno == errno.EBADF
        assert not (tmp_path / "done" / "0").exists()  # nothing marked as written
    finally:
        os.close(fd)


def test_two_syncs_on_one_node_share_the_cache_without_downloading_twice(capsys, s3_location, tmp_path):
    files = {f"shard-{i}.bin": pseudo_random(3 * MB, 10 + i) for i in range(3)}
    files.update({f"small/{i}.txt": f"file {i}".encode() for i in range(20)})
    make_version(tmp_path / "src", "m", files)
    _push(capsys, tmp_path / "src", s3_location)
    cache = tmp_path / "cache"
    pods = [trm_process("sync", s3_location, "--env", "prod", "--repo", tmp_path / f"pod{i}", "--cache", cache,
                        "--json", "--limit-rate", "15") for i in range(2)]
    results = [finish(p) for p in pods]
    for code, _, err in results:
        assert code == 0, err
    total = sum(len(d) for d in files.values())
    assert sum(summary["bytes_downloaded"] for _, summary, _ in results) == total
    for i in range(2):
        assert tree_digest(tmp_path / f"pod{i}" / "m" / "1") == tree_digest(tmp_path / "src" / "m" / "1")


@pytest.mark.parametrize("payload, what", [
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "members": ["x"], '
     b'"files": [{"path": "x.txt", "size": 3, "sha256": "%s"}]}', "members that are not a mapping"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "members": {"../x": 1}, '
     b'"files": [{"path": "x.txt", "size": 3, "sha256": "%s"}]}', "a member name leaving the repository"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "source": "x", '
     b'"files": [{"path": "x.txt", "size": 3, "sha256": "%s"}]}', "a source that is not a mapping"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "files": {"a": 1}}',
     "files that are not a list"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "files": '
     b'[{"path": "../../outside.txt", "size": 3, "sha256": "%s"}]}', "path leaving the version folder"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "files": '
     b'[{"path": "/etc/outside.txt", "size": 3, "sha256": "%s"}]}', "absolute path"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"other\\"", "files": '
     b'[{"path": "x.txt", "size": 3, "sha256": "%s"}]}', "config naming another model"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "not { a config", "files": '
     b'[{"path": "x.txt", "size": 3, "sha256": "%s"}]}', "config Triton cannot parse"),
    (b'{"schema": "trm.manifest/1", "model": "m", "version": 1, "config": "name: \\"m\\"", "files": '
     b'[{"path": "x.txt", "size": 30, "sha256": "%s"}]}', "size that does not match the blob"),
])
def test_hostile_manifests_are_refused_and_nothing_is_written(capsys, s3_location, tmp_path, payload, what):
    import hashlib

    store = open_store(s3_location)
    blob = tmp_path / "blob"
    blob.write_bytes(b"abc")
    digest = hashlib.sha256(b"abc").hexdigest()
    store.put_blob(digest, blob, 3)
    store.put_object("models/m/versions/1.json", payload.replace(b"%s", digest.encode()), if_absent=True)
    store.put_object("envs/prod.json", b'{"schema": "trm.env/1", "env": "prod", "models": {"m": 1}}',
                     if_absent=True)
    dst = tmp_path / "area" / "dst"
    result = _sync(capsys, s3_location, dst, tmp_path / "area" / "cache")
    assert result.code == 7, f"{what}: {result.err}"
    assert not (tmp_path / "area" / "outside.txt").exists() and not (tmp_path / "outside.txt").exists()
    assert not (dst / "m" / "1").exists()


def test_hostile_environment_pointer_is_refused(capsys, s3_location, tmp_path):
    store = open_store(s3_location)
    store.put_object("envs/prod.json", b'{"schema": "trm.env/1", "env": "prod", "models": {"../../etc": 1}}',
                     if_absent=True)
    result = _sync(capsys, s3_location, tmp_path / "dst", tmp_path / "cache")
    assert result.code == 7 and "bad entry" in result.err
    assert not (tmp_path / "dst").exists()


def test_endpoint_going_down_mid_sync_fails_clearly_and_leaves_the_repository_intact(capsys, tmp_path, monkeypatch):
    with SeaweedServer(tmp_path / "weed") as server:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        location = f"s3://{BUCKET}/down"
        src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
        make_version(src, "m", {"model.py": b"# v1"})
        make_version(src, "m", {"weights.bin": pseudo_random(16 * MB, 5)})
        _push(capsys, src, location, "--model", "m:1")
        assert _sync(capsys, location, dst, cache).code == 0
        _push(capsys, src, location, "--model", "m:2")
        before = tree_digest(dst)
        process = trm_process("sync", location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                              "--limit-rate", "8", env={"TRM_SYNC_PART_SIZE": str(MB)})
        _wait_for_parts(cache, 2, process)
        server.stop(kill=True)
        code, summary, err = finish(process)
    assert code == 7, err
    assert "not reachable" in err and "Traceback" not in err
    assert server.env["AWS_SECRET_ACCESS_KEY"] not in err + str(summary)
    assert tree_digest(dst) == before
    assert LocalRepository(dst).versions("m") == [1] and LocalRepository(dst).validate() == []


@pytest.mark.parametrize("ranged", [False, True])
def test_concurrent_fetches_stay_correct_when_file_locks_do_not_work(s3_location, tmp_path, monkeypatch, ranged):
    """Mock of a failure that cannot be produced for real here: flock silently succeeding for everyone,
    as on some network filesystems. Correctness must come from unique files, hashes and link()."""
    import fcntl
    import threading

    from repo_manager.adapters import transfer
    from repo_manager.adapters.cache import BlobCache

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)
    if ranged:  # 1 MiB parts: the 5 MB blob goes through partial folders, adoption and markers
        monkeypatch.setattr(transfer, "PART_SIZE", MB)
    data = pseudo_random(5 * MB, 9)
    manifest = make_version(tmp_path / "src", "m", {"w.bin": data})
    open_store(s3_location).put_blob(manifest.files[0].sha256, tmp_path / "src" / "m" / "1" / "w.bin", len(data))
    cache, errors, barrier = BlobCache(tmp_path / "cache"), [], threading.Barrier(4)

    def fetch() -> None:
        barrier.wait()
        try:
            with ThreadPoolExecutor(4) as parts:
                BlobCache(cache.root).fetch(open_store(s3_location), manifest.files[0].sha256, len(data),
                                            parts_pool=parts)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)
    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert cache.path(manifest.files[0].sha256).read_bytes() == data
    assert list((cache.root / "partial").iterdir()) == []


def test_cache_collection_keeps_blobs_another_pod_still_links(capsys, tmp_path):
    store = str(tmp_path / "store")  # the embedded default: a folder store
    src, cache = tmp_path / "src", tmp_path / "cache"
    make_version(src, "m", {"old.bin": b"old weights"})
    _push(capsys, src, store)
    for pod in ("pod1", "pod2"):
        assert _sync(capsys, store, tmp_path / pod, cache).code == 0
    make_version(src, "m", {"new.bin": b"new weights"})
    _push(capsys, src, store, "--model", "m:2")
    pruned = _sync(capsys, store, tmp_path / "pod1", cache, "--prune").json()
    assert pruned["pruned"] == ["m/1"] and pruned["gc_removed"] == 0  # pod2 still links version 1's blob
    assert (tmp_path / "pod2" / "m" / "1" / "old.bin").read_bytes() == b"old weights"
    assert _sync(capsys, store, tmp_path / "pod2", cache, "--prune").json()["gc_removed"] == 1


# ------------------------------------------------------------------------------- engines and the node
# An engine fingerprint no real GPU has (compute capability 1.0): this node cannot run it whether or not it
# has a GPU, so the refusal is real on every machine the suite runs on.
ALIEN_FINGERPRINT = {"compute_capability": "1.0", "gpu_name": "a GPU no node has", "tensorrt_llm_version": "0.12.0",
                     "tensorrt_version": "10.3.0", "cuda_version": "12.0"}


def _publish_engine(tmp_path, repo_root):
    import llm_fixtures as fx

    from repo_manager.core.settings import Settings
    from repo_manager.ops.llm.node import NodeFacts
    from repo_manager.ops.publish import publish_model
    from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions

    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, fingerprint=ALIEN_FINGERPRINT)
    publish_model(Settings(repository=repo_root), checkpoint, "llm", fmt="tensorrt-llm",
                  node=NodeFacts(probe="none (test)"), trtllm=TrtllmOptions(engine_dir=engine, gpu_memory_gib=24))


def test_sync_refuses_an_engine_this_node_cannot_run_and_still_syncs_other_models(capsys, s3_location, tmp_path):
    from repo_manager.core.settings import Settings
    from repo_manager.ops.llm.node import GpuFacts, NodeFacts
    from repo_manager.ops.sync import sync

    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    _publish_engine(tmp_path, src)
    make_version(src, "plain", {"model.py": b"# no engine"})
    _push(capsys, src, s3_location)

    result = _sync(capsys, s3_location, dst, cache)
    assert result.code == 11, result.err
    assert "llm_tensorrt_llm version 1 cannot run on this node" in result.err
    assert "Traceback" not in result.err
    assert not dst.exists() or not any(dst.rglob("trm-manifest.json"))  # refused before anything changed
    assert json.loads(result.out)["error"]["kind"] == "compatibility"

    # a model without an engine syncs on the same node
    result = _sync(capsys, s3_location, dst, cache, "--model", "plain")
    assert result.code == 0, result.err
    assert LocalRepository(dst).versions("plain") == [1]

    # a node that matches the fingerprint gets the whole layout
    node = NodeFacts(gpus=(GpuFacts("a GPU no node has", 80 * 1024**3, "1.0"),), driver_version="999",
                     driver_cuda_version="12.0", probe="recorded")
    synced = sync(Settings(repository=dst, cache_dir=cache), open_store(s3_location), env="prod", node=node)
    assert "llm_tensorrt_llm/1" in synced.installed
    assert LocalRepository(dst).versions("llm_tensorrt_llm") == [1]


def test_a_cache_or_repository_that_cannot_be_created_is_a_clear_input_error(capsys, tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    make_version(src, "m", {"model.py": b"# v1"})
    _push(capsys, src, store)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for extra in (["--repo", tmp_path / "dst", "--cache", blocker / "cache"],
                  ["--repo", blocker / "repo", "--cache", tmp_path / "cache"]):
        result = run_cli(capsys, "sync", store, "--env", "prod", *extra)
        assert result.code == 3, result.err
        assert "internal error" not in result.err and str(blocker) in result.err
    assert not (tmp_path / "dst").exists()


def test_synced_engine_config_points_at_the_engine_where_this_node_installed_it(capsys, tmp_path):
    from repo_manager.core import config as cfg
    from repo_manager.core.settings import Settings
    from repo_manager.ops.llm.node import GpuFacts, NodeFacts
    from repo_manager.ops.sync import sync

    src, dst, store = tmp_path / "src", tmp_path / "node" / "repo", tmp_path / "store"
    _publish_engine(tmp_path, src)
    _push(capsys, src, store)
    node = NodeFacts(gpus=(GpuFacts("a GPU no node has", 80 * 1024**3, "1.0"),), driver_version="999",
                     driver_cuda_version="12.0", probe="recorded")
    settings = Settings(repository=dst, cache_dir=tmp_path / "cache")
    assert "llm_tensorrt_llm/1" in sync(settings, open_store(str(store)), env="prod", node=node).installed
    config = cfg.read_config(dst / "llm_tensorrt_llm" / "config.pbtxt")
    assert config.parameters["gpt_model_path"].string_value == str((dst / "llm_tensorrt_llm" / "1").resolve())
    assert LocalRepository(dst).validate() == []
    assert sync(settings, open_store(str(store)), env="prod", node=node).unchanged


def test_a_bad_environment_name_on_the_command_line_is_bad_input(capsys, tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    make_version(src, "m", {"model.py": b"# v1"})
    for command in (["push", store, "--repo", src, "--env", "../prod"],
                    ["sync", store, "--env", "../prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c"]):
        result = run_cli(capsys, *command)
        assert result.code == 3 and "environment name '../prod' is not allowed" in result.err, result.err
    assert not (store / "envs").exists() and not (tmp_path / "dst").exists()
    # the same name inside a store's pointer is hostile store content (exit 7)
    open_store(str(store)).put_object("envs/prod.json", b'{"schema": "trm.env/1", "env": "../x", "models": {}}',
                                      if_absent=True)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c")
    assert result.code == 7, result.err


HEAVY_MODULES = ("boto3", "botocore", "urllib3", "rich", "numpy", "onnx", "google.protobuf", "tritonclient", "grpc")


def test_unchanged_sync_is_one_conditional_read_with_light_imports(capsys, s3_location, tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    make_version(src, "a", {"model.py": b"# a", "w.bin": pseudo_random(100_000, 1)})
    make_version(src, "b", {"model.py": b"# b"})
    _push(capsys, src, s3_location)
    assert _sync(capsys, s3_location, dst, cache).code == 0
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json")
    code, summary, err = finish(process)
    assert code == 0, err
    assert summary["unchanged"] and summary["remote_reads"] == 1 and summary["bytes_downloaded"] == 0
    import subprocess
    import sys

    traced = subprocess.run([sys.executable, "-X", "importtime", "-m", "repo_manager", "sync", s3_location, "--env",
                             "prod", "--repo", str(dst), "--cache", str(cache), "--json"], capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert traced.returncode == 0, traced.stderr
    assert json.loads(traced.stdout)["remote_reads"] == 1
    imported = {line.rsplit("|", 1)[-1].strip() for line in traced.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m.split(".")[0] in HEAVY_MODULES or m == "google.protobuf"}
    # a file gone from the repository: the no-op path notices (local stats) and the full sync repairs it
    (dst / "a" / "1" / "w.bin").unlink()
    repaired = _sync(capsys, s3_location, dst, cache).json()
    assert not repaired["unchanged"] and repaired["bytes_downloaded"] == 0  # from the node cache
    assert (dst / "a" / "1" / "w.bin").read_bytes() == pseudo_random(100_000, 1)
    # the environment moved: the conditional read sees a new tag and the full sync installs the version
    make_version(src, "b", {"model.py": b"# b2"})
    _push(capsys, src, s3_location, "--model", "b:2")
    moved = _sync(capsys, s3_location, dst, cache).json()
    assert moved["installed"] == ["b/2"]
    assert _sync(capsys, s3_location, dst, cache).json()["remote_reads"] == 1


def _kept_bytes(cache, part_size: int, size: int) -> tuple[int, list[int]]:
    """Bytes a killed sync kept in its partial download, from its progress records (and per part)."""
    folders = list((cache / "partial").glob("*/done"))
    assert len(folders) == 1
    lengths = [min(part_size, size - i * part_size) for i in range((size + part_size - 1) // part_size)]
    kept = [min((folders[0] / str(i)).stat().st_size * MB if (folders[0] / str(i)).exists() else 0, n)
            for i, n in enumerate(lengths)]
    return sum(kept), kept


@pytest.mark.parametrize("corrupt", [False, True])
def test_killed_sync_resumes_each_part_from_its_length_and_still_verifies_the_whole_file(capsys, s3_location,
                                                                                       tmp_path, corrupt):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(20 * MB, 5)
    make_version(src, "m", {"weights.bin": weights})
    _push(capsys, src, s3_location)
    part_size = 8 * MB
    env = {"TRM_SYNC_PART_SIZE": str(part_size)}
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                          "--limit-rate", "4", env=env)
    deadline = time.monotonic() + 60
    while not (cache / "partial").exists() or sum(p.stat().st_size for p in (cache / "partial").glob("*/done/*")) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "sync ended before it could be killed"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    kept, per_part = _kept_bytes(cache, part_size, len(weights))
    assert any(0 < n < part_size for n in per_part)  # killed inside a part: only byte-level resume keeps it
    assert not (dst / "m" / "1").exists()
    if corrupt:  # a kept byte changed on disk: the whole-file sha256 catches it, the blob is fetched again
        data = next((cache / "partial").glob("*/data"))
        os.chmod(data, 0o644)
        with open(data, "r+b") as handle:
            handle.seek(per_part.index(next(n for n in per_part if n)) * part_size)
            first = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([first[0] ^ 0xFF]))
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json", env=env))
    assert code == 0, err
    assert summary["bytes_resumed"] == (0 if corrupt else kept)  # corrupt: the kept bytes were thrown away
    expected = len(weights) - kept + (len(weights) if corrupt else 0)  # corrupt: the second try from scratch
    assert summary["bytes_downloaded"] == expected
    assert (dst / "m" / "1" / "weights.bin").read_bytes() == weights
    assert not list((cache / "partial").iterdir())


# ------------------------------------------------------------------ the node cache is a trust boundary
def _poison(path, data: bytes) -> None:
    """What a process with write access to the node cache can do: rewrite a read-only blob in place."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as handle:
        handle.write(data)
    os.chmod(path, 0o444)


@pytest.mark.parametrize("mount, damage", [("same-filesystem", "rewritten"), ("other-filesystem", "rewritten"),
                                           ("same-filesystem", "symlink"), ("other-filesystem", "directory")])
def test_a_cached_blob_rewritten_in_place_is_fetched_again_never_installed(capsys, s3_location, tmp_path, mount,
                                                                          damage):
    src, cache = tmp_path / "src", tmp_path / "cache"
    good = b"def execute(requests):\n    return []\n"
    evil = b"import os; os.system('id')  # pwned\n".ljust(len(good), b" ")
    manifest = make_version(src, "m", {"model.py": good, "w.bin": pseudo_random(3 * MB, 7)})
    _push(capsys, src, s3_location)
    assert _sync(capsys, s3_location, tmp_path / "pod-a", cache).code == 0
    digest = next(f.sha256 for f in manifest.files if f.path == "model.py")
    blob = cache / "blobs" / "sha256" / digest
    os.unlink(tmp_path / "pod-a" / "m" / "1" / "model.py")  # pod A's copy out of the way (hard links: one inode)
    if damage == "rewritten":
        _poison(blob, evil)
    else:  # the blob's name taken by a link to a file of the same size, or by a folder
        blob.unlink()
        if damage == "symlink":
            (tmp_path / "evil.py").write_bytes(evil)
            blob.symlink_to(tmp_path / "evil.py")
        else:
            (blob / "model.py").mkdir(parents=True)
    # a second pod on the node; "other-filesystem": its repository on another mount (the Kubernetes layout)
    other = "/dev/shm" if mount == "other-filesystem" else tmp_path
    import tempfile

    with tempfile.TemporaryDirectory(dir=other) as pod_b:
        result = _sync(capsys, s3_location, pod_b, cache)
        assert result.code == 0, result.err
        summary = result.json()
        assert summary["installed"] == ["m/1"]
        assert summary["bytes_downloaded"] == len(good)  # the corrupt entry was fetched again from the store
        assert (Path(pod_b) / "m" / "1" / "model.py").read_bytes() == good
        assert LocalRepository(pod_b).validate() == []
    assert blob.read_bytes() == good  # the cache holds the store's bytes again


@pytest.mark.parametrize("mount", ["same-filesystem", "other-filesystem"])
def test_a_new_version_takes_shared_files_from_the_pods_own_copies_or_checks_them(capsys, s3_location, tmp_path,
                                                                                  mount):
    """Two mounts (the Kubernetes layout): a file the pod's repository already holds (a copy it checked) is
    hard-linked from there, so a poisoned cache entry is never even read. One filesystem: the repository's
    files are the cache's inodes, so the blob is checked and fetched again."""
    import tempfile

    src, cache = tmp_path / "src", tmp_path / "cache"
    big = pseudo_random(2 * MB, 11)
    make_version(src, "m", {"w.bin": big, "model.py": b"# v1"})
    manifest = make_version(src, "m", {"w.bin": big, "model.py": b"# v2"})
    _push(capsys, src, s3_location, "--model", "m:1")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if mount == "other-filesystem" else tmp_path) as pod:
        assert _sync(capsys, s3_location, pod, cache).code == 0
        digest = next(f.sha256 for f in manifest.files if f.path == "w.bin")
        if mount == "same-filesystem":  # pod's v1 file is the cache's inode: keep it out of the poisoning
            os.unlink(Path(pod) / "m" / "1" / "w.bin")
            os.link(cache / "blobs" / "sha256" / digest, Path(pod) / "m" / "1" / "w.bin")
            os.unlink(cache / "blobs" / "sha256" / digest)
            (cache / "blobs" / "sha256" / digest).write_bytes(big)
        _poison(cache / "blobs" / "sha256" / digest, b"X" * 64)
        _push(capsys, src, s3_location, "--model", "m:2")
        result = _sync(capsys, s3_location, pod, cache)
        assert result.code == 0 and result.json()["installed"] == ["m/2"], result.err
        assert (Path(pod) / "m" / "2" / "w.bin").read_bytes() == big
        fetched = result.json()["bytes_downloaded"]
        if mount == "other-filesystem":
            assert fetched == len(b"# v2")  # w.bin: linked from the pod's own checked copy of version 1
            assert (Path(pod) / "m" / "2" / "w.bin").stat().st_ino == (Path(pod) / "m" / "1" / "w.bin").stat().st_ino
        else:
            assert fetched == len(b"# v2") + len(big)  # the poisoned entry was fetched again
        assert LocalRepository(pod).validate() == []


def test_a_blob_that_keeps_changing_in_the_cache_fails_the_sync_naming_it(capsys, s3_location, tmp_path,
                                                                         monkeypatch):
    from repo_manager.adapters import cache as cache_module

    src, cache = tmp_path / "src", tmp_path / "cache"
    good = b"print('good')\n"
    manifest = make_version(src, "m", {"model.py": good})
    _push(capsys, src, s3_location)
    digest = manifest.files[0].sha256
    fetch = cache_module.BlobCache.fetch

    def fetch_then_poisoned(self, store, blob, size, **kwargs):
        # SIMULATED: a process on the node that rewrites the blob right after each download (a race that
        # cannot be timed for real); the fetch itself is real, from SeaweedFS
        got = fetch(self, store, blob, size, **kwargs)
        _poison(self.path(blob), b"print('evil')\n")
        return got
    monkeypatch.setattr(cache_module.BlobCache, "fetch", fetch_then_poisoned)
    result = _sync(capsys, s3_location, tmp_path / "dst", cache)
    assert result.code == 7, result.err
    assert f"blob {digest} in the node cache" in result.err and "changed again" in result.err
    assert not (tmp_path / "dst" / "m" / "1").exists()
    assert not list((tmp_path / "dst" / "m").glob(".trm-tmp-*")) if (tmp_path / "dst" / "m").exists() else True


def test_a_partial_download_changed_on_disk_while_it_downloads_is_never_installed(s3_location, tmp_path,
                                                                                  monkeypatch, capsys):
    """The download's sha256 is of the bytes received; a process on the node that writes into the partial
    file meanwhile (a real write, timed from the progress callback) is caught as the blob enters the
    version: the cache entry is evicted and fetched again."""
    from repo_manager.adapters import transfer
    from repo_manager.core.settings import Settings
    from repo_manager.ops.sync import sync
    from repo_manager.ops.sync.result import SyncProgress

    monkeypatch.setattr(transfer, "PART_SIZE", 64 * 1024)  # 16 ranged parts in a partial folder
    good = pseudo_random(MB, 9)
    make_version(tmp_path / "src", "m", {"w.bin": good})
    _push(capsys, tmp_path / "src", s3_location)
    cache = tmp_path / "cache"

    class Tamper(SyncProgress):
        done = False

        def advance(self, nbytes: int) -> None:
            if self.done:
                return
            marks = list(cache.glob("partial/*/done/0"))
            if marks and marks[0].stat().st_size:  # part 0 is written: overwrite its first bytes on disk
                with open(marks[0].parent.parent / "data", "r+b") as handle:
                    handle.write(b"import os  # not what the store holds")
                self.done = True
    settings = Settings(repository=tmp_path / "dst", cache_dir=cache)
    tamper = Tamper()
    result = sync(settings, open_store(s3_location, settings), env="prod", progress=tamper)
    assert tamper.done and result.installed == ("m/1",)
    assert (tmp_path / "dst" / "m" / "1" / "w.bin").read_bytes() == good
    assert result.bytes_downloaded == 2 * len(good)  # the tampered entry was fetched again


def test_an_edited_manifest_in_the_node_cache_is_never_believed(capsys, s3_location, tmp_path):
    from repo_manager.core.manifest import MANIFEST_NAME, Manifest
    from repo_manager.ops.sync.noop import store_id

    src, cache = tmp_path / "src", tmp_path / "cache"
    make_version(src, "m", {"model.py": b"# m"})
    _push(capsys, src, s3_location)
    assert _sync(capsys, s3_location, tmp_path / "pod-a", cache).code == 0
    stored = open_store(s3_location).get_manifest("m", 1)
    forged = json.loads(stored.to_json())
    forged["verification"] = {"passed": True, "reference": "onnxruntime 1.20", "samples": 64}
    forged["config"] = stored.config + "max_batch_size: 64\n"
    forged_bytes = json.dumps(forged).encode()
    # where trm used to keep manifests it had read (and believed them): planted for every pod of the node
    planted = cache / "manifests" / store_id(open_store(s3_location)) / "m" / "1.json"
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(forged_bytes)
    result = _sync(capsys, s3_location, tmp_path / "pod-b", cache)
    assert result.code == 0, result.err
    installed = Manifest.from_json((tmp_path / "pod-b" / "m" / "1" / MANIFEST_NAME).read_bytes(), "installed")
    assert installed == stored
    assert "max_batch_size" not in (tmp_path / "pod-b" / "m" / "config.pbtxt").read_text()
    listed = run_cli(capsys, "list", "--repo", tmp_path / "pod-b", "--json")
    assert listed.code == 0 and listed.json()["models"][0]["verification"]["verified"] is False
    # a repository that already holds a forged manifest (same files and config) gets the store's back
    (tmp_path / "pod-a" / "m" / "1" / MANIFEST_NAME).write_bytes(
        json.dumps({**json.loads(stored.to_json()), "verification": forged["verification"]}).encode())
    repaired = _sync(capsys, s3_location, tmp_path / "pod-a", cache)
    assert repaired.code == 0 and repaired.json()["installed"] == ["m/1"], repaired.err
    assert Manifest.from_json((tmp_path / "pod-a" / "m" / "1" / MANIFEST_NAME).read_bytes(), "a") == stored


# ------------------------------------------------------------------------ resume keeps what was received
def test_after_a_crash_of_the_machine_only_parts_made_durable_are_kept(capsys, s3_location, tmp_path):
    """SIMULATED reboot: a test cannot crash the machine, so the partial folder's boot id is changed after a
    real SIGKILL; the next sync must then keep only the parts that were fdatasynced before their
    ``.synced`` marker was made (the per-unit records are only true while the machine runs)."""
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    weights = pseudo_random(24 * MB, 21)
    make_version(src, "m", {"weights.bin": weights})
    _push(capsys, src, s3_location)
    part = 2 * MB  # 12 parts of 2 units each, 8 at a time
    env = {"TRM_SYNC_PART_SIZE": str(part)}
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                          "--limit-rate", "6", env=env)
    deadline = time.monotonic() + 60
    while len(list(cache.glob("partial/*/done/*.synced"))) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "sync ended before it could be killed"
        time.sleep(0.01)
    process.kill()
    process.communicate()
    (folder,) = (cache / "partial").iterdir()
    synced = len(list(folder.glob("done/*.synced")))
    recorded = sum((folder / "done" / str(i)).stat().st_size for i in range(12) if (folder / "done" / str(i)).exists())
    assert recorded > synced * 2  # units of parts in progress were recorded too: what a crash may have lost
    (folder / "boot").write_text("another-boot")
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json", env=env))
    assert code == 0, err
    assert summary["bytes_resumed"] == synced * part and summary["bytes_downloaded"] == len(weights) - synced * part
    assert (dst / "m" / "1" / "weights.bin").read_bytes() == weights
    assert list((cache / "partial").iterdir()) == []


def _received(pid: int) -> int:
    """Bytes the process has read from its open TCP connections, measured outside trm (``ss``: the kernel's
    count of bytes received on each of its sockets, less those still queued in it, unread)."""
    import subprocess

    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    lines = subprocess.run(["ss", "-tieH"], capture_output=True, text=True, check=True).stdout.splitlines()
    total = 0
    for line, info in zip(lines, lines[1:]):
        if " ino:" in line and line.split(" ino:")[1].split()[0] in sockets and "bytes_received:" in info:
            queued = int(line.split()[1])  # Recv-Q
            total += int(info.split("bytes_received:")[1].split()[0]) - queued
    return total


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_sync_killed_after_most_of_a_large_model_arrived_fetches_again_only_what_was_in_flight(
        capsys, s3_location, tmp_path):
    import shutil

    from repo_manager.adapters.transfer import PART_WORKERS, QUEUED_UNITS, UNIT

    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    size = 160 * MB  # 10 ranged parts of 16 MiB, 8 at a time
    manifest = make_version(src, "m", {"weights.bin": os.urandom(size)})
    _push(capsys, src, s3_location)
    shutil.rmtree(src)
    process = trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json",
                          "--limit-rate", "40")
    try:
        deadline = time.monotonic() + 120
        while not (cache / "partial").is_dir() or not any((cache / "partial").glob("*/done")):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.005)
        while _received(process.pid) < 0.7 * size:
            assert process.poll() is None and time.monotonic() < deadline, "sync ended before it could be killed"
            time.sleep(0.02)
        process.send_signal(signal.SIGSTOP)  # freeze it, count what it received, then kill it
        while not _stopped(process.pid):
            time.sleep(0.001)
        received = _received(process.pid)
    finally:
        process.kill()
        process.communicate()
    assert not (dst / "m" / "1").exists()
    code, summary, err = finish(trm_process("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache,
                                            "--json"))
    assert code == 0, err
    # in flight at the kill: per part the unit being received and one waiting for the rate limit, plus the
    # units queued for the writer (2 MiB of slack: the pointer, the manifest, HTTP headers)
    bound = PART_WORKERS * 2 * UNIT + QUEUED_UNITS * UNIT + 2 * MB
    fetched_again = summary["bytes_downloaded"] - (size - received)
    print(f"received {received / MB:.1f} MiB before the kill, fetched again {fetched_again / MB:.1f} MiB")
    assert fetched_again <= bound and summary["bytes_downloaded"], (fetched_again / MB, received / MB, summary)
    assert summary["bytes_resumed"] + summary["bytes_downloaded"] == size
    with open(dst / "m" / "1" / "weights.bin", "rb") as handle:
        assert hashlib.file_digest(handle, "sha256").hexdigest() == manifest.files[0].sha256
    assert list((cache / "partial").iterdir()) == []  # nothing left behind
    assert not list((dst / "m").glob(".trm-tmp-*"))
    shutil.rmtree(cache)
    shutil.rmtree(dst)
    _raw_client().delete_object(Bucket=BUCKET, Key=_raw_key(s3_location, blob_key(manifest.files[0].sha256)))


# ------------------------------------------------------------- a different local version, a bad cache blob, no bucket
def test_sync_refuses_a_different_local_version_with_exit_3(capsys, tmp_path):
    store = pushed_store(tmp_path)
    repo = tmp_path / "repo"
    make_version(repo, "base", {"model.py": b"# another version 1"})
    before = tree_digest(repo)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", repo, "--cache", tmp_path / "c")
    assert result.code == 3, result.err
    assert "different version 1" in result.err and tree_digest(repo) == before


def test_a_cache_blob_of_the_wrong_size_is_replaced_not_reused(capsys, tmp_path):
    """A repository file edited in place writes through its hard link into the cache: the next sync that
    needs the blob finds it the wrong size, fetches it again and replaces it (it used to keep the bad one,
    as if another writer had installed it)."""
    import hashlib

    store = pushed_store(tmp_path)
    cache = tmp_path / "cache"
    assert run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "a", "--cache", cache).code == 0
    blob = cache / "blobs" / "sha256" / hashlib.sha256(b"# v1").hexdigest()
    os.chmod(blob, 0o644)
    blob.write_bytes(b"X")  # what an in-place edit of a/base/1/model.py did
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "b", "--cache", cache)
    assert result.code == 0, result.err
    assert (tmp_path / "b" / "base" / "1" / "model.py").read_bytes() == b"# v1"
    assert blob.read_bytes() == b"# v1" and LocalRepository(tmp_path / "b").validate() == []


def test_sync_against_a_missing_bucket_names_the_bucket(capsys, s3_env, tmp_path):
    location = "s3://trm-no-such-bucket-for-tests/prefix"
    result = run_cli(capsys, "sync", location, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 4, result.err
    assert "bucket trm-no-such-bucket-for-tests does not exist" in result.err
    assert "environment" not in result.err
    promote = run_cli(capsys, "promote", "m", "--version", "1", "--to", "prod", "--store", location,
                      "--gates", "checksums", "--create-env")
    assert promote.code == 4 and "bucket" in promote.err and "gate" not in promote.err, promote.err
