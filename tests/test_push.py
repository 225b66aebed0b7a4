"""`trm push`, `trm publish --store`, `trm export`, and `sync --prune` with a real Triton serving the result."""

from __future__ import annotations

import os
import stat
import time

import numpy as np
import onnx_models as om
import onnxruntime as ort
import pytest
from helpers import run_cli
from seaweed import BUCKET
from store_helpers import finish, make_version, pseudo_random, pushed_store, tree_digest, trm_process

from repo_manager.adapters.loadgen.inputs import generate_inputs
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model


def _cli_ok(capsys, *args):
    result = run_cli(capsys, *args, "--json")
    assert result.code == 0, result.err
    return result.json()


def test_pushed_and_synced_model_is_served_by_triton_and_prune_spares_loaded_versions(capsys, s3_location,
                                                                                       tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    sources = [om.linear(tmp_path / f"v{i}.onnx", seed=i) for i in (1, 2)]
    publish_model(Settings(repository=src), sources[0], "lin", verify_model=False)
    _cli_ok(capsys, "push", s3_location, "--repo", src, "--env", "prod")
    _cli_ok(capsys, "sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache)
    assert LocalRepository(dst).validate() == []
    inputs = {"X": np.arange(8, dtype=np.float32).reshape(2, 4)}
    with TritonServer(dst, models=["lin"]) as server, TritonClient(server.url) as client:
        want = ort.InferenceSession(str(sources[0])).run(None, inputs)[0]
        np.testing.assert_allclose(client.infer("lin", inputs)["Y"], want, rtol=1e-4, atol=1e-4)

        publish_model(Settings(repository=src), sources[1], "lin", verify_model=False)
        _cli_ok(capsys, "push", s3_location, "--repo", src, "--model", "lin:2", "--env", "prod")
        synced = _cli_ok(capsys, "sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--prune",
                         "--url", server.url)
        assert synced["installed"] == ["lin/2"] and synced["kept_loaded"] == ["lin/1"]
        assert LocalRepository(dst).versions("lin") == [1, 2]

        client.load("lin")  # Triton moves to the newest version and unloads version 1
        assert client.loaded_versions("lin") == [2]
        config = LocalRepository(dst).config("lin")
        new_inputs = generate_inputs(config, batch_size=2, seed=3)
        want = ort.InferenceSession(str(sources[1])).run(None, new_inputs)[0]
        np.testing.assert_allclose(client.infer("lin", new_inputs)["Y"], want, rtol=1e-4, atol=1e-4)
        _wait_unloaded(client, "lin", 1)  # UNLOADING counts as loaded: in-flight requests may still use it
        pruned = _cli_ok(capsys, "sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--prune",
                         "--url", server.url)
    assert pruned["pruned"] == ["lin/1"] and LocalRepository(dst).versions("lin") == [2]
    assert pruned["gc_removed"] == 1  # version 1's model.onnx: nothing links to it any more


def _wait_unloaded(client, model, version, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {e["version"]: e.get("state") for e in client.repository_index() if e["name"] == model}
        if states.get(str(version)) not in ("READY", "UNLOADING", "LOADING"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{model}/{version} was not unloaded")


def test_prune_without_a_reachable_server_changes_nothing(capsys, tmp_path):
    store = str(tmp_path / "store")
    make_version(tmp_path / "src", "m", {"a": b"1"})
    _cli_ok(capsys, "push", store, "--repo", tmp_path / "src", "--env", "prod")
    _cli_ok(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c")
    before = tree_digest(tmp_path / "dst")
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "dst", "--prune", "--url",
                     "http://127.0.0.1:1")
    assert result.code == 6 and tree_digest(tmp_path / "dst") == before


def test_prune_never_leaves_the_repository(capsys, tmp_path):
    """The embedded default (a folder store); a version folder that is a symlink to precious data."""
    store = str(tmp_path / "store")
    make_version(tmp_path / "src", "m", {"a": b"1"})
    make_version(tmp_path / "src", "m", {"a": b"2"})
    _cli_ok(capsys, "push", store, "--repo", tmp_path / "src", "--env", "prod")
    dst = tmp_path / "dst"
    _cli_ok(capsys, "sync", store, "--env", "prod", "--repo", dst, "--cache", tmp_path / "c")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep me")
    (dst / "m" / "7").symlink_to(precious, target_is_directory=True)
    result = _cli_ok(capsys, "sync", store, "--env", "prod", "--repo", dst, "--cache", tmp_path / "c", "--prune")
    assert (precious / "data").read_text() == "keep me"
    assert result["pruned"] == [] and (dst / "m" / "7").is_symlink()
    assert LocalRepository(dst).versions("m") == [2]


def test_push_is_idempotent_and_refuses_a_different_version_under_the_same_number(capsys, s3_location, tmp_path):
    make_version(tmp_path / "a", "m", {"w": b"one"})
    first = _cli_ok(capsys, "push", s3_location, "--repo", tmp_path / "a")
    again = _cli_ok(capsys, "push", s3_location, "--repo", tmp_path / "a")
    assert first["versions"][0]["already_present"] is False and again["versions"][0]["already_present"] is True
    make_version(tmp_path / "b", "m", {"w": b"two"})
    clash = run_cli(capsys, "push", s3_location, "--repo", tmp_path / "b", "--json")
    assert clash.code == 8 and "different version 1" in clash.err
    assert open_store(s3_location).get_manifest("m", 1).files[0].size == 3


def test_two_concurrent_publishers_never_take_the_same_version(capsys, s3_location, tmp_path):
    sources = [om.linear(tmp_path / f"s{i}.onnx", seed=i) for i in range(2)]
    publishers = [trm_process("publish", "model", sources[i], "--name", "lin", "--no-verify", "--repo",
                              tmp_path / f"repo{i}", "--store", s3_location, "--json") for i in range(2)]
    results = [finish(p) for p in publishers]
    for code, _, err in results:
        assert code == 0, err
    assert sorted(data["version"] for _, data, _ in results) == [1, 2]
    store = open_store(s3_location)
    assert store.list_versions("lin") == [1, 2]
    for i, (_, data, _) in enumerate(results):
        local = LocalRepository(tmp_path / f"repo{i}")
        assert local.versions("lin") == [data["version"]]
        assert local.manifest("lin").files == store.get_manifest("lin", data["version"]).files
        assert local.validate() == []


def test_export_writes_a_plain_triton_layout_to_a_folder_and_to_s3(capsys, s3_location, tmp_path):
    weights = pseudo_random(100_000, 7)
    make_version(tmp_path / "src", "m", {"model.py": b"# v1", "w/weights.bin": weights})
    make_version(tmp_path / "src", "m", {"model.py": b"# v2", "w/weights.bin": weights})
    for store in (s3_location, str(tmp_path / "folder-store")):
        _cli_ok(capsys, "push", store, "--repo", tmp_path / "src", "--env", "prod")
    out = tmp_path / "plain"
    result = _cli_ok(capsys, "export", s3_location, out)
    assert result["versions"] == 2
    assert (out / "m" / "2" / "model.py").read_bytes() == b"# v2"
    assert (out / "m" / "1" / "w" / "weights.bin").read_bytes() == weights
    assert (out / "m" / "config.pbtxt").read_text() == (tmp_path / "src" / "m" / "config.pbtxt").read_text()
    assert not list(out.rglob("trm-manifest.json"))
    for source, prefix in ((s3_location, "plain-from-s3"), (str(tmp_path / "folder-store"), "plain-from-folder")):
        _cli_ok(capsys, "export", source, f"s3://{BUCKET}/{prefix}", "--env", "prod")
        target = open_store(f"s3://{BUCKET}/{prefix}")
        assert target.get_object("m/2/w/weights.bin")[0] == weights
        assert target.get_object("m/config.pbtxt")[0].decode() == (out / "m" / "config.pbtxt").read_text()


def test_aws_credentials_never_appear_in_errors_even_with_verbose(s3_location, tmp_path):
    """Provoke real failures (refused credentials, an endpoint that is down, credentials written into the
    endpoint URL) with --verbose and --json, and look for the key and the secret in everything printed."""
    import os
    import socket

    import seaweed as sw

    src = tmp_path / "src"
    make_version(src, "m", {"model.py": b"# v1"})
    wrong_key, wrong_secret = "AKIAWRONGKEY7EXAMPLE", "wrongSecret/K7MDENG/bPxRfiCYEXAMPLEKEY"
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    endpoint = os.environ["AWS_ENDPOINT_URL_S3"]
    cases = [
        ({"AWS_ACCESS_KEY_ID": wrong_key, "AWS_SECRET_ACCESS_KEY": wrong_secret},
         ["push", s3_location, "--repo", src]),
        ({"AWS_ACCESS_KEY_ID": wrong_key, "AWS_SECRET_ACCESS_KEY": wrong_secret},
         ["sync", s3_location, "--env", "prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c"]),
        ({"AWS_ACCESS_KEY_ID": wrong_key, "AWS_SECRET_ACCESS_KEY": wrong_secret},
         ["export", s3_location, tmp_path / "out"]),
        ({}, ["push", s3_location, "--repo", src, "--endpoint-url", dead]),
        ({}, ["sync", s3_location, "--env", "prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c",
              "--endpoint-url", dead]),
        # credentials written into the endpoint URL (some tools accept http://KEY:SECRET@host)
        ({}, ["sync", s3_location, "--env", "prod", "--repo", tmp_path / "dst", "--cache", tmp_path / "c",
              "--endpoint-url", dead.replace("http://", f"http://{wrong_key}:{wrong_secret}@")]),
        ({}, ["push", s3_location, "--repo", src, "--endpoint-url",
              endpoint.replace("http://", f"http://{wrong_key}:{wrong_secret}@")]),
    ]
    secrets = [wrong_key, wrong_secret, sw.SECRET_KEY, "wrongSecret"]
    for env, args in cases:
        for flags in (["--verbose"], ["--json"]):
            process = trm_process(*flags, *args, env=env)
            out, err = process.communicate(timeout=120)
            assert process.returncode not in (0, 1), f"{args}: {err}"
            for secret in secrets:
                assert secret not in out and secret not in err, f"{args} {flags} printed a credential:\n{err}"


def test_export_to_a_destination_that_cannot_be_created_is_a_clear_input_error(capsys, tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    make_version(src, "m", {"model.py": b"# v1"})
    assert run_cli(capsys, "push", store, "--repo", src).code == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run_cli(capsys, "export", store, blocker / "out")
    assert result.code == 3, result.err
    assert "internal error" not in result.err and str(blocker) in result.err
    assert blocker.read_text() == "not a folder"


def test_a_publish_killed_while_renumbering_never_loses_the_local_version(tmp_path, monkeypatch):
    """The store already holds version 1 (another publisher), so the new local version 1 is renumbered.
    A crash right at the commit of the new number cannot be produced on cue by a real kill: it is
    simulated by making LocalRepository.commit raise (a named stand-in for SIGKILL at that instruction).
    The version must still be on disk as a complete version, not only in a staging folder that
    `trm validate --fix` deletes."""
    from repo_manager.ops.push import publish_to_store

    store = open_store(str(tmp_path / "store"))
    other = make_version(tmp_path / "other", "m", {"model.py": b"# the other publisher"})
    assert publish_to_store(store, LocalRepository(tmp_path / "other"), "m", 1).versions[0].version == 1
    mine = make_version(tmp_path / "repo", "m", {"model.py": b"# mine", "sub/w.bin": b"w" * 100})
    repo = LocalRepository(tmp_path / "repo")

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("simulated kill during the renumbering commit")

    monkeypatch.setattr(LocalRepository, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        publish_to_store(store, repo, "m", 1)
    monkeypatch.undo()
    assert repo.versions("m") == [1] and repo.manifest("m", 1).files == mine.files
    assert repo.validate() == [] or all("staging" in p.message for p in repo.validate())
    repo.clean_staging("m")  # what `trm validate --fix` does: the version survives it
    assert repo.versions("m") == [1] and repo.validate() == []
    # and the publish, run again, takes the next number in the store and keeps one local copy
    assert publish_to_store(store, repo, "m", 1).versions[0].version == 2
    assert repo.versions("m") == [2] and repo.manifest("m", 2).files == mine.files != other.files
    assert repo.validate() == []


def test_export_of_nothing_is_an_error_not_an_empty_success(capsys, tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    make_version(src, "m", {"model.py": b"# v1"})
    assert run_cli(capsys, "push", store, "--repo", src, "--env", "prod").code == 0
    mistyped = run_cli(capsys, "export", tmp_path / "no-such-store", tmp_path / "out")
    assert mistyped.code == 4 and "nothing to export" in mistyped.err, mistyped.err
    absent = run_cli(capsys, "export", store, tmp_path / "out", "--env", "prod", "--model", "other")
    assert absent.code == 4 and "other" in absent.err, absent.err
    assert not (tmp_path / "out").exists()
    assert run_cli(capsys, "export", store, tmp_path / "out", "--env", "prod", "--model", "m").code == 0
    assert (tmp_path / "out" / "m" / "1" / "model.py").read_bytes() == b"# v1"


def test_pushing_an_ensemble_alone_pushes_its_members_first_and_a_node_serves_it(capsys, tmp_path):
    """`trm push --model pipe:1 --env prod`: the members the ensemble pins go to the store too (before
    it), the pointer names the ensemble, and a node that syncs the pointer serves the whole pipeline."""
    import rollout_models as rm

    src, location = tmp_path / "src", str(tmp_path / "store")
    version = rm.ensemble(src, 1)
    members = LocalRepository(src).manifest("pipe", version).members
    assert set(members) == {"pre", "post"}
    pushed = _cli_ok(capsys, "push", location, "--repo", src, "--model", f"pipe:{version}", "--env", "prod")
    order = [(v["model"], v["version"]) for v in pushed["versions"]]
    assert sorted(order[:2]) == sorted(members.items()) and order[2] == ("pipe", version), order
    store = open_store(location)
    assert store.get_env("prod").models == {"pipe": version}
    for member, member_version in members.items():
        assert store.get_manifest(member, member_version).files
    node = tmp_path / "node"
    synced = _cli_ok(capsys, "sync", location, "--env", "prod", "--repo", node, "--cache", tmp_path / "cache")
    assert set(synced["installed"]) == {f"pipe/{version}", *(f"{m}/{v}" for m, v in members.items())}
    with TritonServer(node) as server, TritonClient(server.url) as client:
        for name in ("pre", "post", "pipe"):
            client.load(name)
        out = client.infer("pipe", {"X": np.ones((1, rm.FEATURES), np.float32)})
        assert out["Y"].tolist() == [[2.0] * rm.FEATURES]
    again = _cli_ok(capsys, "push", location, "--repo", src, "--model", f"pipe:{version}")
    assert all(v["already_present"] for v in again["versions"]) and len(again["versions"]) == 3
    # a member only the store holds is left to it; one in neither is a clear error, and nothing is pushed
    import shutil

    shutil.rmtree(src / "pre")
    kept = _cli_ok(capsys, "push", location, "--repo", src, "--model", f"pipe:{version}")
    assert [v["model"] for v in kept["versions"]] == ["post", "pipe"]
    other = str(tmp_path / "other-store")
    missing = run_cli(capsys, "push", other, "--repo", src, "--model", f"pipe:{version}")
    assert missing.code == 4 and "neither in" in missing.err and "pre version" in missing.err, missing.err
    assert not (tmp_path / "other-store" / "models").exists()


def test_a_version_whose_warmup_data_differs_is_a_different_version(capsys, tmp_path):
    """Two local version 1s that differ only in a model-folder data file are different versions: pushing the
    second where the first is refuses (exit 8) instead of reporting it already there."""
    import base64

    from helpers import run_cli
    from store_helpers import make_version

    from repo_manager.core.manifest import MANIFEST_NAME, Manifest

    for name, sample in (("a", b"\x00\x01"), ("b", b"\x00\x02")):
        make_version(tmp_path / name, "m", {"model.py": b"# m"})
        path = tmp_path / name / "m" / "1" / MANIFEST_NAME
        manifest = Manifest.from_json(path.read_bytes())
        data = {"warmup/x.raw": base64.b64encode(sample).decode()}
        path.write_bytes(Manifest(**{**manifest.__dict__, "data": data}).to_json())
    assert run_cli(capsys, "push", tmp_path / "store", "--repo", tmp_path / "a").code == 0
    result = run_cli(capsys, "push", tmp_path / "store", "--repo", tmp_path / "b")
    assert result.code == 8 and "different version 1" in result.err, result.err


def test_pushing_to_an_environment_that_already_serves_the_version_writes_no_new_pointer(capsys, tmp_path):
    """A re-run of `trm push --env E` with nothing changed leaves the pointer's revision as it was (agents
    watching it are not woken), while a new version still moves it."""
    location = str(tmp_path / "store")
    make_version(tmp_path / "src", "m", {"w": b"one"})
    _cli_ok(capsys, "push", location, "--repo", tmp_path / "src", "--env", "prod", "--create-env")
    before = open_store(location).get_env("prod")
    again = _cli_ok(capsys, "push", location, "--repo", tmp_path / "src", "--env", "prod")
    after = open_store(location).get_env("prod")
    assert again["env_models"] == {"m": 1}
    assert (after.etag, after.updated_at) == (before.etag, before.updated_at)
    make_version(tmp_path / "src", "m", {"w": b"two"})
    moved = _cli_ok(capsys, "push", location, "--repo", tmp_path / "src", "--env", "prod")
    assert moved["env_models"] == {"m": 2} and open_store(location).get_env("prod").etag != before.etag


def test_push_counts_only_the_blobs_it_uploads(capsys, tmp_path):
    """A version whose files the store partly holds (content-addressed) uploads, and reports, only the others:
    an empty file included, a blob the store had not counted."""
    location = str(tmp_path / "store")
    make_version(tmp_path / "src", "m", {"shared": b"same bytes", "empty": b""})
    first = _cli_ok(capsys, "push", location, "--repo", tmp_path / "src")
    assert (first["versions"][0]["blobs_uploaded"], first["bytes_uploaded"]) == (2, 10)
    make_version(tmp_path / "src", "m", {"shared": b"same bytes", "new": b"four"})
    second = _cli_ok(capsys, "push", location, "--repo", tmp_path / "src", "--model", "m:2")
    assert second["versions"][0]["blobs_uploaded"] == 1 and second["bytes_uploaded"] == 4


# ------------------------------------------------------------------------------ export never replaces a version
def test_export_refuses_a_different_version_and_leaves_an_identical_one_alone(capsys, tmp_path):
    store = pushed_store(tmp_path)
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
    store = pushed_store(tmp_path, files={"model.py": b"# v1", "weights/w.bin": b"w" * 1000})
    dest = tmp_path / "dest"
    assert run_cli(capsys, "export", store, dest).code == 0
    (dest / "base" / "1" / "weights" / "w.bin").unlink()  # as if killed before the last file
    result = run_cli(capsys, "export", store, dest, "--json")
    assert result.code == 0 and result.json()["files"] == 1, result.err
    assert (dest / "base" / "1" / "weights" / "w.bin").read_bytes() == b"w" * 1000


def test_exported_files_follow_the_umask(capsys, tmp_path):
    store = pushed_store(tmp_path)
    old = os.umask(0o022)
    try:
        assert run_cli(capsys, "export", store, tmp_path / "dest").code == 0
    finally:
        os.umask(old)
    for path in (tmp_path / "dest" / "base" / "1" / "model.py", tmp_path / "dest" / "base" / "config.pbtxt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_export_to_s3_leaves_an_identical_version_alone_and_refuses_a_different_one(capsys, s3_location, tmp_path):
    store = pushed_store(tmp_path)
    assert run_cli(capsys, "export", store, s3_location).code == 0
    again = run_cli(capsys, "export", store, s3_location, "--json")
    assert again.code == 0 and again.json()["files"] == 0, again.err
    open_store(s3_location).put_object("base/1/model.py", b"# someone else's version 1")
    clash = run_cli(capsys, "export", store, s3_location)
    assert clash.code == 3 and "different version 1" in clash.err, clash.err
