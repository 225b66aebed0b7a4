"""`trm promote` and `trm history` on real stores (a folder, a real SeaweedFS) and a real Triton.

Every blocked promotion is checked the same way: exit 9 (or 8 for a lost race) and production's pointer,
its tag and its history exactly as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import numpy as np
import onnx_models as om
import pytest
import yaml
from helpers import run_cli
from onnx import TensorProto, helper, numpy_helper
from seaweed import BUCKET
from store_helpers import finish, make_version, trm_process

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import blob_key, open_store
from repo_manager.core import config as cfg
from repo_manager.core.errors import ConflictError, GateError, NotFoundError
from repo_manager.core.settings import Settings
from repo_manager.ops.promote import PromotionRequest, promote, read_history
from repo_manager.ops.publish import publish_model
from repo_manager.ops.push import push

# short points and wide margins: on a shared, loaded 2-core machine two identical models measured one after
# the other differed by 3.5x in p99 (17 vs 60 ms) and 2.7x in capacity; the slower version in the latency
# test is >10x slower in capacity, far outside these margins
FAST_LATENCY = {"rate": 40, "requests": 80, "rounds": 1, "concurrency": 2, "max_p99_increase_pct": 300,
                "min_p99_delta_ms": 50, "max_capacity_drop_pct": 75, "arrivals": "constant", "max_lag_ms": 50,
                "capacity_slice_s": 0.1}


def heavy(path: Path, width: int = 1024, layers: int = 200) -> Path:
    """Same inputs and outputs as ``om.linear`` (X[batch,4] -> Y[batch,3]) but ~400 MFLOP per row: a
    version that really is slower. One shared weight keeps the file at 4 MB."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["X", "W_IN"], ["H0"])]
    for i in range(layers):
        nodes += [helper.make_node("MatMul", [f"H{i}", "W"], [f"M{i}"]),
                  helper.make_node("Tanh", [f"M{i}"], [f"H{i + 1}"])]
    nodes.append(helper.make_node("MatMul", [f"H{layers}", "W_OUT"], ["Y"]))
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[0]), name)
               for name, shape in (("W_IN", (4, width)), ("W", (width, width)), ("W_OUT", (width, 3)))]
    graph = helper.make_graph(nodes, "heavy", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 3])], weights)
    return om._save(graph, path)


def make_settings(tmp_path: Path, triton, store: str, **extra) -> Settings:
    """The settings for API calls, and the same gate settings in configs/trm.yaml for CLI calls (the
    tests run in tmp_path)."""
    (tmp_path / "configs").mkdir(exist_ok=True)
    environments = extra.pop("environments", {"staging": {}, "production": {}})
    (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump({"gates": {"latency": FAST_LATENCY},
                                                                   "environments": environments}))
    return Settings(repository=tmp_path / "repo", triton_url=triton.url, store=store,
                    gates={"latency": FAST_LATENCY}, environments=environments, **extra)


def publish(settings: Settings, source: Path, name: str = "lin", **options) -> int:
    """Publish ``source`` locally (unverified: the promotion gates are what is tested) and push it."""
    result = publish_model(settings, source, name, options=cfg.ConfigOptions(**options), verify_model=False)
    push(open_store(settings.store, settings), LocalRepository(settings.repository), [(name, result.version)])
    return result.version


def point(settings: Settings, env: str, version: int, name: str = "lin", **request):
    return promote(settings, PromotionRequest(name, env, version=version, gates=("checksums",), **request))


def snapshot(settings: Settings, env: str = "production", store: str | None = None):
    """Everything a blocked promotion must leave alone: the pointer (with its tag) and the history."""
    target = open_store(store or settings.store, settings)
    try:
        pointer = target.get_env(env)
    except NotFoundError:
        return None, []
    return (pointer.models, pointer.etag), [r.id for r in read_history(settings, env, store=store).records]


@pytest.fixture
def folder_settings(tmp_path, triton) -> Settings:
    return make_settings(tmp_path, triton, str(tmp_path / "store"))


@pytest.fixture
def staged(folder_settings, tmp_path):
    """lin v1 in production and staging."""
    v1 = publish(folder_settings, om.linear(tmp_path / "v1.onnx", seed=0))
    point(folder_settings, "production", v1)
    point(folder_settings, "staging", v1)
    return folder_settings


def test_config_only_version_passes_every_auto_gate_and_is_recorded(staged, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.setenv("GITHUB_SHA", "abc123")
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=4)  # same file, new config
    point(staged, "staging", v2)
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store", staged.store,
                     "--url", staged.triton_url, "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["plan"]["config_only"] is True
    assert [g["gate"] for g in data["gates"]] == ["checksums", "load", "latency", "agreement"]
    assert all(g["passed"] and not g["skipped"] for g in data["gates"])
    assert data["env_models"] == {"lin": v2}
    record = data["record"]
    assert (record["from_version"], record["to_version"], record["source_env"]) == (1, v2, "staging")
    assert record["pipeline"]["github_run_id"] == "4242" and record["pipeline"]["github_sha"] == "abc123"
    assert open_store(staged.store, staged).get_env("production").models == {"lin": v2}


def _broken_onnx_version(settings: Settings) -> int:
    """A version whose files match its manifest (checksums pass) but that Triton cannot load."""
    config = LocalRepository(settings.repository).manifest("lin", 1).config
    manifest = make_version(settings.repository, "lin", {"model.onnx": b"this is not an onnx graph"}, config)
    push(open_store(settings.store, settings), LocalRepository(settings.repository), [("lin", manifest.version)])
    return manifest.version


@pytest.mark.parametrize("gate", ["load", "latency", "agreement", "eval"])
def test_a_failing_gate_blocks_the_promotion_and_leaves_production_exactly_as_it_was(staged, tmp_path, capsys, gate):
    if gate == "load":
        version = _broken_onnx_version(staged)
    elif gate == "latency":
        # a stand-in whose cost is a sleep of 50 ms a request: at most 20 answers/s whatever the machine does,
        # against the linear model's hundreds (the floor is a quarter of those); three rounds show it
        version = cost_version(staged, tmp_path, 50.0)
        (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump(
            {"gates": {"latency": FAST_LATENCY | {"rounds": 3, "requests": 40, "max_lag_ms": 1000}},
             "environments": staged.environments}))
    else:  # different weights: answers differ, and the eval command below scores it too low
        version = publish(staged, om.linear(tmp_path / "other.onnx", seed=7))
    point(staged, "staging", version)
    before = snapshot(staged)
    extra = ["--eval-cmd", "echo '{\"score\": 0.42}'", "--eval-threshold", "0.9"] if gate == "eval" else []
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store", staged.store,
                     "--url", staged.triton_url, "--gates", f"checksums,{gate}", "--json", *extra)
    assert result.code == 9, result.err
    data = result.json()
    failed = [g for g in data["gates"] if not g["passed"]]
    assert [g["gate"] for g in failed] == [gate], data["gates"]
    assert data["error"]["kind"] == "gate" and data["moved"] is False
    assert snapshot(staged) == before
    if gate == "eval":
        assert failed[0]["details"]["score"] == 0.42
    if gate == "latency":
        print("latency gate:", failed[0]["summary"])  # the measured figures, for -s runs
        assert "capacity" in failed[0]["summary"]


def test_eval_gate_passes_when_the_score_reaches_the_threshold(staged, tmp_path):
    version = publish(staged, om.linear(tmp_path / "other.onnx", seed=7))
    point(staged, "staging", version)
    # the command sees the loaded version's name and the server: it asks Triton itself
    command = ('python -c "import os,urllib.request; urllib.request.urlopen(os.environ[\'TRM_EVAL_URL\'] + '
               '\'/v2/models/\' + os.environ[\'TRM_EVAL_MODEL\'] + \'/ready\'); print(0.95)"')
    result = promote(staged, PromotionRequest("lin", "production", from_env="staging", gates=("checksums", "eval"),
                                              eval_command=command, eval_threshold=0.9))
    assert result.gates[-1].details["score"] == 0.95
    assert open_store(staged.store, staged).get_env("production").models == {"lin": version}


def test_rollback_walks_back_through_the_history_and_is_recorded(staged, tmp_path, capsys):
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    v3 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=4)
    point(staged, "production", v2)
    point(staged, "production", v3)
    for expected in (v2, 1):
        result = run_cli(capsys, "promote", "lin", "--rollback", "--to", "production", "--store", staged.store,
                         "--json")
        assert result.code == 0, result.err
        assert result.json()["env_models"] == {"lin": expected}
    result = run_cli(capsys, "promote", "lin", "--rollback", "--to", "production", "--store", staged.store, "--json")
    assert result.code == 4 and "no earlier version" in result.err
    history = run_cli(capsys, "history", "production", "lin", "--store", staged.store, "--json").json()["records"]
    moves = [(r["action"], r["from_version"], r["to_version"]) for r in history]
    assert moves == [("promote", None, 1), ("promote", 1, v2), ("promote", v2, v3), ("rollback", v3, v2),
                     ("rollback", v2, 1)]
    assert [r["id"] for r in history] == sorted(r["id"] for r in history)


def test_history_is_complete_in_order_and_separate_per_environment(staged, tmp_path, capsys):
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    other = publish(staged, om.linear(tmp_path / "o.onnx", seed=3), name="other")
    point(staged, "staging", v2)
    point(staged, "production", other, name="other")
    promote(staged, PromotionRequest("lin", "production", from_env="staging", gates=("checksums",)))
    assert open_store(staged.store, staged).get_env("production").models == {"lin": v2, "other": other}
    records = read_history(staged, "production").records
    assert [(r.model, r.from_version, r.to_version) for r in records] == [("lin", None, 1), ("other", None, other),
                                                                          ("lin", 1, v2)]
    assert all(r.gates and r.gates[0]["gate"] == "checksums" and r.gates[0]["passed"] for r in records)
    assert [r.at for r in records] == sorted(r.at for r in records)
    staging = read_history(staged, "staging", "lin")
    assert [(r.from_version, r.to_version) for r in staging.records] == [(None, 1), (1, v2)]
    text = run_cli(capsys, "history", "production", "--store", staged.store)
    assert text.code == 0 and len(text.out.strip().splitlines()) == 3
    assert read_history(staged, "production").unrecorded == {}
    # a pointer moved outside `trm promote` (push --env) is flagged, not silently trusted
    push(open_store(staged.store, staged), LocalRepository(staged.repository), [("lin", 1)], env="production")
    assert read_history(staged, "production").unrecorded == {"lin": {"serving": 1, "last_recorded": v2}}
    text = run_cli(capsys, "history", "production", "--store", staged.store)
    assert "moved outside `trm promote`" in text.out


def test_promoting_a_version_the_source_does_not_serve_is_refused(staged, capsys):
    before = snapshot(staged)
    result = run_cli(capsys, "promote", "lin", "--version", "9", "--from", "staging", "--to", "production",
                     "--store", staged.store, "--json")
    assert result.code == 3 and "serves lin version 1, not 9" in result.err
    assert snapshot(staged) == before


def test_an_earlier_version_that_passed_through_the_source_environment_can_be_promoted(staged, tmp_path):
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    v3 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=4)
    point(staged, "staging", v2)
    point(staged, "staging", v3)
    result = promote(staged, PromotionRequest("lin", "production", version=v2, from_env="staging",
                                              gates=("checksums",)))
    assert result.moved and result.env_models == {"lin": v2}


# ------------------------------------------------------------------------------------------ S3 stores
def _raw_client():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])


@pytest.fixture
def s3_staged(s3_location, tmp_path, triton) -> Settings:
    settings = make_settings(tmp_path, triton, s3_location)
    v1 = publish(settings, om.linear(tmp_path / "v1.onnx", seed=0))
    point(settings, "production", v1)
    point(settings, "staging", v1)
    return settings


def test_a_version_whose_blob_was_corrupted_in_the_store_is_refused(s3_staged, tmp_path, capsys):
    version = publish(s3_staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    point(s3_staged, "staging", version)
    entry = LocalRepository(s3_staged.repository).manifest("lin", version).files[0]
    good = (s3_staged.repository / "lin" / str(version) / entry.path).read_bytes()
    key = s3_staged.store[len(f"s3://{BUCKET}/"):] + "/" + blob_key(entry.sha256)
    _raw_client().put_object(Bucket=BUCKET, Key=key, Body=good[:-8] + b"CORRUPT!")  # same size, other bytes
    before = snapshot(s3_staged)
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store", s3_staged.store,
                     "--url", s3_staged.triton_url, "--json")
    assert result.code == 9, result.err
    gate = result.json()["gates"][0]
    assert gate["gate"] == "checksums" and not gate["passed"] and "does not match" in gate["summary"]
    assert snapshot(s3_staged) == before


def test_two_concurrent_promotions_exactly_one_wins_and_the_other_changes_nothing(s3_staged, tmp_path):
    versions = [publish(s3_staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=n) for n in (2, 4)]
    before_history = snapshot(s3_staged)[1]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # the eval gate of each promotion waits until both have planned (read production's pointer): a real race
    wait = (f"touch {barrier}/$TRM_EVAL_VERSION; for i in $(seq 300); do [ $(ls {barrier} | wc -l) -ge 2 ] && "
            "break; sleep 0.1; done; echo 1")
    processes = [trm_process("promote", "lin", "--version", str(v), "--to", "production", "--store", s3_staged.store,
                             "--url", s3_staged.triton_url, "--gates", "checksums,eval", "--eval-cmd", wait,
                             "--eval-threshold", "1", "--json") for v in versions]
    outcomes = [finish(p) for p in processes]
    codes = sorted(code for code, _, _ in outcomes)
    assert codes == [0, 8], [err for _, _, err in outcomes]
    winner = next(data for code, data, _ in outcomes if code == 0)["plan"]["version"]
    loser = next(err for code, _, err in outcomes if code == 8)
    assert "another promotion won" in loser
    assert open_store(s3_staged.store, s3_staged).get_env("production").models == {"lin": winner}
    records = read_history(s3_staged, "production").records
    assert [r.id for r in records[:-1]] == before_history
    assert (records[-1].from_version, records[-1].to_version) == (1, winner)


def test_promotion_across_two_buckets_copies_blobs_and_manifest_then_swaps(s3_staged, tmp_path, capsys):
    prod_bucket = f"trm-prod-{uuid.uuid4().hex[:8]}"
    _raw_client().create_bucket(Bucket=prod_bucket)
    prod = f"s3://{prod_bucket}/models"
    environments = {"staging": {}, "production": {"store": prod}}
    settings = Settings(repository=s3_staged.repository, triton_url=s3_staged.triton_url, store=s3_staged.store,
                        environments=environments, gates={"latency": FAST_LATENCY})
    (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump(  # the same, for the CLI
        {"store": s3_staged.store, "environments": environments, "gates": {"latency": FAST_LATENCY}}))
    point(settings, "production", 1, store=s3_staged.store, to_store=prod, from_env=None)
    v2 = publish(settings, heavy(tmp_path / "big.onnx", layers=1), max_batch_size=2)
    point(settings, "staging", v2, to_store=s3_staged.store)
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--gates", "checksums,load",
                     "--url", settings.triton_url, "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["plan"]["cross_store"] and data["plan"]["target_store"] == prod
    assert data["blobs_copied"] == 1 and data["bytes_copied"] > 4_000_000
    assert data["blobs_copied_server_side"] == 1  # two buckets behind one endpoint: CopyObject, no download
    target = open_store(prod, settings)
    assert target.get_env("production").models == {"lin": v2}
    assert target.get_manifest("lin", v2) == open_store(s3_staged.store, settings).get_manifest("lin", v2)
    entry = target.get_manifest("lin", v2).files[0]
    assert b"".join(target.read_blob(entry.sha256)) == \
        (settings.repository / "lin" / str(v2) / entry.path).read_bytes()
    # the history lives with production, in its own bucket
    assert [r.to_version for r in read_history(settings, "production").records] == [1, v2]
    # the staging bucket's own "production" pointer (from the fixture) was not the one moved
    assert open_store(s3_staged.store, settings).get_env("production").models == {"lin": 1}


def test_promotion_from_a_folder_store_into_an_s3_bucket_uploads_the_verified_blobs(folder_settings, s3_location,
                                                                                   tmp_path):
    v1 = publish(folder_settings, om.linear(tmp_path / "v1.onnx", seed=0))
    point(folder_settings, "staging", v1)
    result = promote(folder_settings, PromotionRequest("lin", "production", from_env="staging",
                                                       to_store=s3_location, gates=("checksums",)))
    assert result.blobs_copied == 1 and result.blobs_copied_server_side == 0 and result.moved
    assert open_store(s3_location, folder_settings).get_env("production").models == {"lin": v1}


def test_gate_and_conflict_errors_are_typed_for_api_users(staged, tmp_path):
    version = _broken_onnx_version(staged)
    with pytest.raises(GateError) as info:
        promote(staged, PromotionRequest("lin", "production", version=version, gates=("checksums", "load")))
    assert info.value.report.result.moved is False
    assert issubclass(ConflictError, Exception) and ConflictError.exit_code == 8


def test_a_corrupt_copy_already_in_the_target_store_blocks_a_cross_store_promotion(folder_settings, tmp_path):
    prod = str(tmp_path / "prod-store")
    v1 = publish(folder_settings, om.linear(tmp_path / "v1.onnx", seed=0))
    point(folder_settings, "staging", v1)
    entry = LocalRepository(folder_settings.repository).manifest("lin", v1).files[0]
    good = (folder_settings.repository / "lin" / str(v1) / entry.path).read_bytes()
    planted = Path(prod) / blob_key(entry.sha256)
    planted.parent.mkdir(parents=True)
    planted.write_bytes(good[:-8] + b"CORRUPT!")  # same name and size: only a download can tell
    with pytest.raises(GateError) as info:
        promote(folder_settings, PromotionRequest("lin", "production", from_env="staging", to_store=prod,
                                                  gates=("checksums",)))
    gates = info.value.report.result.gates
    assert [(r.name, r.passed) for r in gates] == [("checksums", True), ("copy", False)]
    with pytest.raises(NotFoundError):
        open_store(prod, folder_settings).get_env("production")


def test_dry_run_prints_the_plan_and_changes_nothing(staged, tmp_path, capsys):
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    point(staged, "staging", v2)
    before = snapshot(staged)
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store", staged.store,
                     "--dry-run", "--json")
    assert result.code == 0, result.err
    plan = result.json()["plan"]
    assert (plan["version"], plan["replaces"], plan["config_only"]) == (v2, 1, True)
    assert plan["gates"] == ["checksums", "load", "latency", "agreement"]
    assert snapshot(staged) == before


def test_promoting_the_version_already_served_does_nothing_with_or_without_dry_run(staged, capsys):
    """A re-run pipeline job: the plan says nothing to do, the result says what the target serves, and neither
    run moves the pointer or writes a record."""
    before = snapshot(staged)
    for extra in (["--dry-run"], []):
        result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store",
                         staged.store, *extra, "--json")
        assert result.code == 0, (extra, result.err)
        data = result.json()
        assert (data["moved"], data["gates"], data["record"], data["env_models"]) == (False, [], None, {"lin": 1})
        assert (data["plan"]["version"], data["plan"]["replaces"]) == (1, 1), extra
        assert "already serves lin version 1; nothing to do" in result.err, extra
    assert snapshot(staged) == before


@pytest.mark.parametrize("damage", ["manifest", "missing blob"])
def test_a_damaged_version_in_a_folder_store_is_refused_by_the_checksums_gate(staged, tmp_path, capsys, damage):
    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    point(staged, "staging", v2)
    store = Path(staged.store)
    if damage == "manifest":
        (store / "models" / "lin" / "versions" / f"{v2}.json").write_text('{"schema": "trm.manifest/1", "model"')
    else:  # v2 shares v1's file: remove it and production's own version is damaged too, as in a bad cleanup
        entry = LocalRepository(staged.repository).manifest("lin", v2).files[0]
        (store / blob_key(entry.sha256)).unlink()
    before = snapshot(staged)
    result = run_cli(capsys, "promote", "lin", "--from", "staging", "--to", "production", "--store", staged.store,
                     "--url", staged.triton_url, "--json")
    assert result.code == 9, result.err
    assert [(g["gate"], g["passed"]) for g in result.json()["gates"]] == [("checksums", False)]
    assert snapshot(staged) == before


def test_production_is_refused_ahead_of_its_canary_when_configured(staged, tmp_path, capsys):
    """Waves: `production: {requires: production-canary}` (exit 9 naming the canary, nothing moved);
    once the canary serves the version, production may follow; a rollback is never held back."""
    (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump({
        "gates": {"latency": FAST_LATENCY},
        "environments": {"production-canary": {}, "production": {"requires": "production-canary"}}}))
    v2 = publish(staged, om.linear(tmp_path / "v2.onnx", seed=2))
    point(staged, "staging", v2)
    before = snapshot(staged)
    args = ("promote", "lin", "--from", "staging", "--store", staged.store, "--gates", "checksums")
    refused = run_cli(capsys, *args, "--to", "production")
    assert refused.code == 9, refused.err
    assert "production-canary" in refused.err and f"version {v2}" in refused.err
    assert snapshot(staged) == before
    assert run_cli(capsys, *args, "--to", "production-canary").code == 0
    assert run_cli(capsys, *args, "--to", "production").code == 0
    assert open_store(staged.store).get_env("production").models == {"lin": v2}
    back = run_cli(capsys, "promote", "lin", "--rollback", "--to", "production", "--store", staged.store)
    assert back.code == 0, back.err

    (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump({"environments": {
        "production": {"requires": {"env": "production-canary", "soak_s": 3600}}}}))
    soaking = run_cli(capsys, *args, "--to", "production")
    assert soaking.code == 9 and "3600 s" in soaking.err, soaking.err


# the latency gate's own thresholds (25 % p99, 15 % capacity): what a team keeps on; short points, lag allowed
# (the CPU hog below makes the client late too)
BUSY_LATENCY = {"rate": 20, "requests": 60, "rounds": 3, "max_rounds": 6, "concurrency": 2, "arrivals": "constant",
                "max_lag_ms": 100}


@contextlib.contextmanager
def cpu_hog(seconds: float = 240.0):
    """A busy loop in another process for at most ``seconds``, stopped on leaving: a busy CI runner."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    hog = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


def cost_version(settings: Settings, tmp_path: Path, fixed_ms: float, name: str = "lin") -> int:
    """A version of ``name`` that is a sleep of ``fixed_ms`` a request (tests/cost_model.py: one instance, no
    batching), published and pushed: a stand-in whose cost the test sets, whatever else runs on the machine."""
    from cost_model import write_cost_model

    source = write_cost_model(tmp_path / f"cost-{uuid.uuid4().hex[:6]}", name, fixed_ms=fixed_ms, per_item_ms=0.0,
                              max_batch_size=0)
    return publish(settings, source, name)


def test_the_latency_gate_passes_an_identical_version_and_blocks_a_2x_slower_one_beside_a_cpu_hog(
        folder_settings, tmp_path):
    """The gate's decision on stand-ins whose cost is a sleep (20 ms a request, or 40 ms: half the capacity,
    twice the latency), beside a busy loop: the difference is set by the test, far outside what the hog adds
    to both versions, so the verdict does not depend on this machine's speed. Every round is recorded, and the
    verdict is the one its own record gives. (How close a difference the gate can tell apart on a given machine
    is measured in bench/bench_promote.py, not asserted here.)"""
    from repo_manager.core.environments import LatencyGate
    from repo_manager.ops.promote.latency import METRICS, _verdicts, overall_verdict

    # (40 requests a point: the stand-ins' p99 is their sleep plus what the hog adds, the same to both versions)
    settings = dataclasses.replace(folder_settings, gates={"latency": BUSY_LATENCY | {"requests": 40}})
    v1 = cost_version(settings, tmp_path, 20.0)
    point(settings, "production", v1)
    twin, slower = cost_version(settings, tmp_path, 20.0), cost_version(settings, tmp_path, 40.0)
    gates = ("checksums", "latency")
    with cpu_hog():
        point(settings, "staging", twin)
        same = promote(settings, PromotionRequest("lin", "production", from_env="staging", gates=gates))
        [_, latency] = same.gates
        print("identical beside a CPU hog:", latency.summary)
        # (its p99 may vary between rounds beside the hog more than the threshold: then inconclusive, never blocked)
        assert same.moved and latency.passed and latency.details["verdict"] in ("pass", "inconclusive"), latency.summary
        assert len(latency.details["per_round"]) == latency.details["rounds"] >= 3
        assert {"spread_pct", "ratios", "interval"} <= set(latency.details["judged"]["capacity"])
        point(settings, "staging", slower)
        before = snapshot(settings)
        with pytest.raises(GateError) as refused:
            promote(settings, PromotionRequest("lin", "production", from_env="staging", gates=gates))
        print("2x slower beside a CPU hog:", refused.value.message)
        assert snapshot(settings) == before
    [_, latency] = refused.value.report.result.gates
    assert latency.details["verdict"] == "fail" and "beyond the threshold" in latency.summary
    for result in (same.gates[1], latency):  # the verdict is what the recorded rounds give
        recorded = _verdicts(result.details["per_round"], LatencyGate(**result.details["thresholds"]))
        assert overall_verdict(recorded, METRICS, False, False)[0] == result.details["verdict"]


def test_the_latency_verdict_calls_a_difference_within_the_rounds_spread_inconclusive():
    """The decision on measured rounds: below the threshold passes; a clear, steady miss blocks once three
    rounds show it; a miss smaller than the rounds vary is within noise, and two rounds never block."""
    from repo_manager.ops.promote.latency import judge

    assert judge("capacity", [0.86, 0.83, 0.88]).outcome == "meets"
    assert judge("capacity", [1.7, 1.65, 1.8]).outcome == "misses"
    assert judge("capacity", [1.7, 1.8]).outcome == "within_noise"
    noisy = judge("capacity", [0.7, 1.5, 1.1])
    assert noisy.outcome == "within_noise" and noisy.low < 1 < noisy.high and noisy.spread_pct > 20
    # one wild round widens the interval, but six rounds out of six missing is no coin toss
    assert judge("capacity", [1.6, 1.7, 1.5, 1.8, 1.6, 9.0]).outcome == "misses"
    assert judge("capacity", [1.6, 1.7, 1.5, 1.8, 0.3]).outcome == "within_noise"  # one round meets it well


def test_an_ensemble_is_promoted_through_the_load_gate(folder_settings, tmp_path, capsys):
    """An ensemble's members load from the server's own repository folder, which file overrides cannot fill:
    the gates run it on an embedded server with a scratch repository (even with --url), the record names that
    server as such, and production moves."""
    import rollout_models as rm

    store = folder_settings.store
    src = tmp_path / "src"
    first = rm.ensemble(src, 1)
    assert run_cli(capsys, "push", store, "--repo", src, "--model", f"pipe:{first}", "--env", "production",
                   "--create-env").code == 0
    second = rm.ensemble(src, 2)
    assert run_cli(capsys, "push", store, "--repo", src, "--model", f"pipe:{second}", "--env", "staging",
                   "--create-env").code == 0
    result = run_cli(capsys, "--json", "promote", "pipe", "--from", "staging", "--to", "production", "--store",
                     store, "--url", folder_settings.triton_url, "--gates", "checksums,load")
    assert result.code == 0, result.err
    data = result.json()
    assert [g["gate"] for g in data["gates"]] == ["checksums", "load"]
    assert all(g["passed"] for g in data["gates"]), data["gates"]
    assert "on the embedded Triton" in data["gates"][1]["summary"]
    assert "127.0.0.1" not in json.dumps(data["gates"])
    assert open_store(store, folder_settings).get_env("production").models == {"pipe": second}


def test_a_manifest_the_store_refuses_to_read_is_a_store_error_before_any_plan(staged, tmp_path):
    """Access denied on the candidate's manifest (a real EACCES: a folder store's file at mode 000, read by
    trm without root's override) is the store's error, exit 7 naming it, when the promotion is planned: a dry
    run does not print a plan (with the gates of a version whose files nobody read) and exit 0, and a real
    one does not start the gates. Nothing changes."""
    from unreadable import hide, trm_unprivileged

    v2 = publish(staged, om.linear(tmp_path / "v1.onnx", seed=0), max_batch_size=2)
    point(staged, "staging", v2)
    manifest = Path(staged.store) / "models" / "lin" / "versions" / f"{v2}.json"
    before = snapshot(staged)
    hide(manifest)
    try:
        for extra in (["--dry-run"], []):
            code, _, err = trm_unprivileged("promote", "lin", "--from", "staging", "--to", "production", "--store",
                                            staged.store, "--url", staged.triton_url, *extra)
            assert code == 7, (extra, err)
            assert f"{v2}.json" in err and "checksums:" not in err, (extra, err)
    finally:
        manifest.chmod(0o644)
    assert snapshot(staged) == before


def test_the_llm_latency_verdict_passes_noisy_equal_rounds_and_blocks_a_steady_drop_in_tokens_per_s():
    """The LLM latency gate's judgement of measured rounds (promote/llm.py over promote/latency.py's rules):
    equal versions whose rounds vary pass or stay inconclusive, never fail; a version steadily at half the
    output tokens/s fails once three rounds show it, and the summary names the metric and the figures."""
    from repo_manager.core.environments import LLMLatencyGate
    from repo_manager.ops.promote.llm import judge_rounds

    def rounds(pairs):
        return [{"new": {"ttft_p99_ms": n[0], "tokens_per_s": n[1]}, "old": {"ttft_p99_ms": o[0], "tokens_per_s": o[1]}}
                for n, o in pairs]

    noisy = rounds([((80, 300), (60, 420)), ((50, 410), (90, 280)), ((70, 350), (65, 360))])
    verdict = judge_rounds(noisy, LLMLatencyGate())
    assert verdict.passed and verdict.details["verdict"] in ("pass", "inconclusive"), verdict.summary
    slow = rounds([((60, 200), (60, 400)), ((62, 190), (61, 410)), ((59, 205), (60, 395))])
    verdict = judge_rounds(slow, LLMLatencyGate())
    assert not verdict.passed and verdict.details["verdict"] == "fail"
    assert "output 200 vs 400 tokens/s" in verdict.summary and "beyond the threshold" in verdict.summary
