"""`trm tune-batching` against real tritonservers and the cost model (behaviour only, no timing asserts).

The model starts with the seed's failure in miniature: a 50 ms queue delay and a preferred batch of 4,
so at low traffic requests wait for batches that rarely fill and the current config misses the SLO.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx_models as om
import pytest
from cost_model import write_cost_model
from helpers import run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer, free_ports
from repo_manager.core import config as cfg
from repo_manager.core.config import atomic_write_bytes
from repo_manager.core.manifest import MANIFEST_NAME, Manifest
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model
from repo_manager.ops.serving import load_version
from repo_manager.ops.tuning import Candidate, TuneRequest, tune_batching
from repo_manager.ops.tuning.prober import MAX_NORMAL_REJECT, REPEATED

# A 20 ms model under a 150 ms SLO: on Triton 2.51 a queue timeout of a few ms rejected requests at low
# traffic too (they wait past it when the batcher is not woken), so a 2 ms model's timeout could not be tuned
# reliably on 2 cores; the queue policy is measured where its timeout is long against such stalls.
SLO_MS = 150.0
RATES = ("--low-rps", "50", "--peak-rps", "100")
FAST = ("--requests", "150", "--budget", "51")  # the least these rates allow (TuneRequest.minimum_budget_s)
OVERLOAD_FACTORS = (2.0, 1.5)  # the default, then what a busy machine's client can offer (the `tuned` fixture)


def publish_seed_model(settings: Settings, tmp_path, name: str = "ranker") -> None:
    source = write_cost_model(tmp_path / f"src-{name}", name=name, fixed_ms=20.0, per_item_ms=0.5, max_batch_size=4,
                              dynamic_batching=True, delay_us=300_000, preferred=(4,))
    publish_model(settings, source, name)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, triton):
    """One tuning run with --write and a report, shared by the tests that inspect its results. On a busy
    shared machine the client may fail to drive 2 x capacity (the overload step's outcome is then
    "not-measurable", a statement about this machine, not about the queue policy; measured: the 578/s of
    2 x 289/s went out with a p95 lag of 37 ms on a quiet machine, and in one CI run two tries in a row
    were not driven): one more run decides, with the remedy the outcome names, a lower --overload-factor."""
    for factor in OVERLOAD_FACTORS:
        tmp = tmp_path_factory.mktemp("tuned")
        settings = Settings(repository=tmp / "repo", triton_url=triton.url)
        publish_seed_model(settings, tmp)
        embedded = Settings(repository=tmp / "repo")  # tuning on an embedded server on the repository
        request = TuneRequest("ranker", SLO_MS, 50, 100, budget_s=46, write=True, requests=150, warmup_s=0.5,
                              max_batch_limit=16, report_dir=tmp / "report", overload_factor=factor)
        result = tune_batching(embedded, request)
        if result.overload is not None and result.overload.outcome == "policy-held":
            break  # else not driven, or no policy held in one disturbed run (CI twice): one more run decides
    return embedded, result


def test_chosen_config_met_the_slo_at_every_level_in_the_tuners_own_measurements(tuned):
    _, result = tuned
    chosen = result.outcome.chosen  # the batching settings, before the queue policy
    assert chosen is not None
    chosen_points = [p for p in result.outcome.points if p.candidate == chosen.key and p.level not in REPEATED]
    levels = {p.level for p in chosen_points}
    assert {"low", "peak", "headroom"} <= levels
    for point in chosen_points:
        if point.level in ("low", "peak", "headroom"):
            assert point.meets_slo and point.measurement.valid and point.measurement.p99_ms <= SLO_MS
            assert point.measurement.errors == 0
    # the seed's config (300 ms delay waiting for a batch of 4) cannot meet a 150 ms p99 at 50 requests/s
    current = next(e for e in result.outcome.evaluations if e.candidate.origin == "current")
    assert not current.eligible and chosen.key != current.candidate.key
    assert chosen.delay_us < 300_000


def test_written_version_has_the_same_files_the_chosen_config_and_its_tuning_record(tuned):
    settings, result = tuned
    repo = LocalRepository(settings.repository)
    why = [p.note for p in result.overload.points] + list(result.overload.notes) if result.overload else \
        result.outcome.notes
    assert result.written_version == 2 and repo.versions("ranker") == [1, 2], why
    old, new = repo.manifest("ranker", 1), repo.manifest("ranker", 2)
    assert [(f.path, f.sha256) for f in new.files] == [(f.path, f.sha256) for f in old.files]
    config = cfg.parse_config(new.config)
    assert Candidate.from_config(config).key == result.chosen.key
    assert not config.HasField("version_policy")
    assert (repo.model_dir("ranker") / "config.pbtxt").read_text() == new.config
    tuning = new.tuning
    assert tuning["slo"]["p99_ms"] == SLO_MS and tuning["chosen"]["key"] == result.chosen.key
    assert tuning["environment"]["triton_version"] and tuning["environment"]["model_checksum"]
    assert {e["key"] for e in tuning["candidates"]} >= {result.outcome.chosen.key}
    assert tuning["points"] and all("p99_ms" in p for p in tuning["points"] if p["note"][:10] != "did not lo")
    # (version 1 may show a __pycache__ that the Python backend's stub wrote while the embedded server
    # served it from the repository: a known issue of serving Python models in place, not of tuning)
    assert [p for p in repo.validate() if p.version == 2] == []
    # the written version loads on a real server with the tuned config and answers
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        assert load_version(client, repo, "ranker") == 2
        served = client.model_config("ranker")
        assert served.max_batch_size == result.chosen.max_batch_size
        assert client.infer("ranker", {"INPUT0": np.ones((1, 4), np.float32)})["OUTPUT0"].shape == (1, 4)


def test_report_folder_has_table_json_and_plot(tuned):
    _, result = tuned
    folder = {f.rsplit("/", 1)[-1]: f for f in result.report_files}
    assert set(folder) == {"tuning.json", "tuning.md", "p99_vs_throughput.png", "overload.png"}
    data = json.loads(Path(folder["tuning.json"]).read_text())
    assert data["chosen"]["key"] == result.chosen.key and data["written_version"] == 2
    assert {"low", "peak", "headroom"} <= {p["level"] for p in data["points"]}
    text = Path(folder["tuning.md"]).read_text()
    assert "**Chosen:**" in text and "| candidate | level | offered/s" in text and result.chosen.key in text
    assert Path(folder["p99_vs_throughput.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Overload" in text and "No candidate met the SLO" not in text
    # the outcome the run measured, as the record has it (whether a policy holds on this machine in this run, or
    # the client could drive the overload at all, is measured, not asserted: PolicySearch's decisions are tested
    # on profiles in tests/test_overload.py)
    assert f"Outcome: **{result.overload.outcome}**" in text
    from repo_manager.ops.tuning.overload import HELD, NOT_MEASURABLE

    expected = {HELD: "**Overload point**", NOT_MEASURABLE: "**The overload could not be driven from this client**"}
    assert expected.get(result.overload.outcome, "**No queue policy kept the SLO under overload.**") in text
    # every try's row carries the capacity it was relative to and the rate it offered
    rows = [line for line in text.splitlines() if line.startswith("| b") and "-q" in line.split("|")[1]]
    assert rows and all(line.split("|")[3].strip() == f"{result.overload.rate:.0f}" for line in rows)
    assert Path(folder["overload.png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_written_version_carries_a_queue_policy_measured_under_an_overload_of_its_capacity(tuned):
    settings, result = tuned
    overload = result.overload
    assert overload is not None and overload.factor in OVERLOAD_FACTORS
    assert overload.rate == round(overload.factor * overload.capacity_rps, 1)
    config = cfg.parse_config(LocalRepository(settings.repository).manifest("ranker", 2).config)
    if overload.outcome != "policy-held":  # measured so in this run: the closest policy or none, and says why
        assert overload.outcome in ("no-policy-held", "not-measurable") and overload.chosen_point is None
        written = Candidate.from_config(config)
        if overload.fallback is not None:
            assert result.status == "chosen-with-closest-queue-policy" and written.key == overload.fallback.key
        else:
            assert result.status == "chosen-without-queue-policy" and not written.has_queue_policy
        return
    point = overload.chosen_point
    assert overload.chosen == result.chosen and result.status == "chosen"
    assert point.meets and point.overload.errors == 0 and point.overload.accepted_p99_ms <= SLO_MS
    assert point.recover_s is not None
    policy = config.dynamic_batching.default_queue_policy
    assert policy.timeout_action == policy.REJECT and 0 < policy.default_timeout_microseconds < SLO_MS * 1000
    assert policy.allow_timeout_override
    record = LocalRepository(settings.repository).manifest("ranker", 2).tuning["overload"]
    assert record["overload_point"]["accepted_p99_ms"] <= SLO_MS
    assert {"rejected_fraction", "rejection_p99_ms", "goodput_rps", "time_to_recover_s"} <= set(
        record["overload_point"])


def test_check_remeasures_the_recorded_levels_reports_its_verdict_and_fails_when_the_slo_is_tightened(tuned, capsys):
    """`--check` measures the tuned version again at the recorded rates and says whether it still meets its SLO.
    Whether it does under a generous 2 s bound is this machine's business (the tuned config rejects what waits past
    its queue timeout, and in a point of 150 requests one rejection is more than the 0.2 % a policy may shed: beside
    a CPU hog it did not), so that verdict is checked against the check's own points, not asserted; an SLO no
    machine meets fails, exit 9."""
    settings, _ = tuned
    repo = ("--repo", str(settings.repository))
    ok = run_cli(capsys, "-q", "tune-batching", "ranker", *repo, "--check", "--p99-ms", "2000", "--requests",
                 "150", "--json")
    assert ok.code in (0, 9), ok.err
    data = ok.json()
    assert [p["level"] for p in data["points"]] == ["low", "peak"] and [p["rate"] for p in data["points"]] == [50, 100]
    assert data["environment_changes"] == {} and data["slo"]["p99_ms"] == 2000
    assert data["passed"] == all(p["meets_slo"] for p in data["points"]) == (ok.code == 0)
    if ok.code == 9:  # the level that missed is named, with the figures
        missed = next(p for p in data["points"] if not p["meets_slo"])
        assert f"{missed['level']} {missed['rate']:g}/s" in ok.err, ok.err
        assert any(reason in ok.err for reason in ("> 2000 ms", "the queue policy rejected", "not measurable")), ok.err
    tight = run_cli(capsys, "-q", "tune-batching", "ranker", *repo, "--check", "--p99-ms", "0.2", "--requests", "150")
    assert tight.code == 9 and "no longer meets its tuning" in tight.err and "> 0.2 ms" in tight.err, tight.err


def test_check_fails_when_the_environment_changed_since_tuning(tuned, tmp_path, capsys):
    settings, _ = tuned
    copy = tmp_path / "repo"
    shutil.copytree(settings.repository, copy)
    path = copy / "ranker" / "2" / MANIFEST_NAME
    manifest = Manifest.from_json(path.read_bytes())
    tuning = {**manifest.tuning, "environment": {**manifest.tuning["environment"], "triton_version": "1.0.0"}}
    atomic_write_bytes(path, Manifest(**{**manifest.__dict__, "tuning": tuning}).to_json())
    result = run_cli(capsys, "-q", "tune-batching", "ranker", "--repo", str(copy), "--check", "--p99-ms", "2000",
                     "--requests", "150")
    assert result.code == 9 and "triton_version changed (1.0.0 ->" in result.err


def test_impossible_slo_exits_9_names_the_closest_writes_nothing_and_restores_the_served_config(
        triton, tmp_path, capsys):
    settings = Settings(repository=tmp_path / "repo", triton_url=triton.url)
    publish_seed_model(settings, tmp_path, "strict")
    repo = LocalRepository(settings.repository)
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:  # a server that serves the repo
        load_version(client, repo, "strict")
        before = client.model_config("strict")
        result = run_cli(capsys, "-q", "tune-batching", "strict", "--url", server.url, "--repo", str(repo.root),
                         "--p99-ms", "0.3", *RATES, *FAST, "--write", "--json")
        after = client.model_config("strict")
    assert result.code == 9, result.err
    assert "no candidate met p99 <= 0.3 ms" in result.err and "closest:" in result.err
    data = result.json()
    assert data["chosen"] is None and data["closest"] and data["written_version"] is None
    assert repo.versions("strict") == [1]
    assert cfg.config_to_text(after) == cfg.config_to_text(before)


def test_a_required_queue_policy_that_cannot_be_measured_exits_9_names_what_was_tried_and_writes_nothing(
        triton, tmp_path, capsys):
    """The batching passes, but the overload asked for (100 x capacity) is more than any client on this
    machine can offer, so no policy can be shown to hold. With --require-overload-policy: exit 9, the
    policies tried and why named, nothing written."""
    settings = Settings(repository=tmp_path / "repo", triton_url=triton.url)
    publish_seed_model(settings, tmp_path, "spiky")
    repo = LocalRepository(settings.repository)
    result = run_cli(capsys, "-q", "tune-batching", "spiky", "--repo", str(repo.root), "--p99-ms", str(SLO_MS),
                     *RATES, *FAST, "--overload-factor", "100", "--require-overload-policy", "--write", "--json")
    assert result.code == 9, result.err
    assert "could not be driven from this client" in result.err and "100 x capacity" in result.err
    assert "tried: max_batch" in result.err and "--require-overload-policy" in result.err
    assert len(result.err.strip().splitlines()) <= 2  # one line, and a hint
    data = result.json()
    assert data["status"] == "queue-policy-required" and data["chosen"] is None and data["written_version"] is None
    assert data["batching"] is not None  # the batching met the SLO: only the required policy is missing
    assert data["overload"]["outcome"] == "not-measurable" and data["overload"]["tried"]
    # the client gave up once far behind instead of sending 100 x capacity late for a minute
    driven = [p for p in data["overload"]["points"] if not (p["predicted_miss"] or p["predicted_shed"])]  # (not those
    # the mechanism rules out)
    assert driven and all(p["overload"]["unsent"] > 0 and not p["overload"]["valid"] for p in driven)
    assert repo.versions("spiky") == [1]


def _tune_written(capsys, root: Path, model: str, *args: str):
    """`trm tune-batching --write --report` on an embedded server; the result, its JSON and the record."""
    for _ in range(2):
        result = run_cli(capsys, "-q", "tune-batching", model, "--repo", str(root), "--write", "--report",
                         str(root.parent / "report"), "--json", *args)
        # a busy shared machine can make every candidate miss the SLO in one run (exit 9, nothing written,
        # not the behaviour under test): one more run decides
        if "no candidate met" not in result.err:
            break
    assert result.code == 0, result.err
    data = result.json()
    return result, data, LocalRepository(root).manifest(model, data["written_version"])


def _assert_written_as_recorded(result, data, manifest) -> None:
    """Whatever the overload step found, the batching choice is written; the config carries a queue policy
    exactly when one was shown to hold, and a missing one is a warning with the reason, not a failure."""
    assert data["batching"] is not None and data["written_version"] == 2
    config = cfg.parse_config(manifest.config)
    written = Candidate.from_config(config)
    overload = data["overload"]
    assert manifest.tuning["status"] == data["status"]
    assert manifest.tuning["overload"]["outcome"] == overload["outcome"]
    if overload["outcome"] == "policy-held":
        assert data["status"] == "chosen" and written.has_queue_policy and written.key == data["chosen"]["key"]
    elif overload["fallback"]:  # none held: the closest policy tried that keeps normal traffic is written
        assert overload["outcome"] in ("no-policy-held", "not-measurable")
        assert data["status"] == "chosen-with-closest-queue-policy"
        assert written.has_queue_policy and written.key == overload["fallback"]["key"] == data["chosen"]["key"]
        assert "warning: " in result.err and overload["fallback_summary"] in result.err
    else:
        assert overload["outcome"] in ("no-policy-held", "not-measurable")
        assert data["status"] == "chosen-without-queue-policy"
        assert written.key == data["batching"]["key"] and not written.has_queue_policy
        assert "warning: " in result.err and overload["summary"] in result.err
    # what the written policy costs near capacity: estimated from the batching's own ladder where it climbed, and
    # measured with the policy at that capacity and down that ladder where it sheds there
    # (or, for a policy on a simpler structure the batching search did not climb, up to the choice's capacity)
    shed, carried = overload["capacity_shed"], overload["carried_with_policy_rps"]
    text = overload["summary"] + (overload["fallback_summary"] or "")
    headroom, against = data["slo"]["headroom_rps"], overload["batching_capacity_rps"]
    if against is not None:
        assert written.has_queue_policy and written.without_queue_policy().key != data["batching"]["key"]
        assert ("may carry less" in text) == (carried is None)
        if carried is not None:
            assert headroom <= carried <= against and ("size replicas by" in text) == (carried < against)
    elif shed is None:
        assert carried is None and "size replicas" not in text and "may shed up to" not in text
    else:
        assert written.has_queue_policy and 0.0 <= shed["shed_about"] <= 1.0 and shed["rate_rps"] > headroom
        assert shed["rate_rps"] in [c["capacity_rps"] for c in data["candidates"]]
        if carried is None:  # the time budget left no point for it: the estimate is said where it passes a burst
            assert ("may shed up to" in text) == (shed["shed_about"] > MAX_NORMAL_REJECT)
        else:
            assert headroom <= carried <= shed["rate_rps"]
            assert ("size replicas by" in text) == (carried < shed["rate_rps"])
    report = (Path(data["report_files"][0]).parent / "tuning.md").read_text()
    assert "No candidate met the SLO" not in report  # the headline says what happened
    assert f"**Batching:** `{data['batching']['key']}` met the SLO at every level" in report


def test_a_sub_millisecond_model_is_tuned_and_written(tmp_path, triton, capsys):
    """y = X W + b in ONNX (well under a millisecond a request): the profile is sized by time, so a fast
    model is measured over many requests instead of none."""
    settings = Settings(repository=tmp_path / "repo", triton_url=triton.url)
    publish_model(settings, om.linear(tmp_path / "affine.onnx"), "affine")
    result, data, manifest = _tune_written(capsys, settings.repository, "affine", "--p99-ms", "20", "--low-rps",
                                           "100", "--peak-rps", "200", "--requests", "300", "--budget", "75")
    profile = data["profile"]["exec_ms_by_batch"]
    assert "1" in profile and all(ms < 20 for ms in profile.values())
    _assert_written_as_recorded(result, data, manifest)


def test_a_3_plus_3_ms_per_item_model_under_a_50_ms_slo_gets_its_batching_written(tmp_path, capsys):
    """3 ms + 3 ms per item: a full batch of 8 takes 27 ms, so under a 50 ms SLO a queue timeout must
    cover the batch in flight and still leave the accepted request's own batch: the policy search says
    which structures it tried; the batching choice is written either way."""
    source = write_cost_model(tmp_path / "src", name="mid", fixed_ms=3.0, per_item_ms=3.0, max_batch_size=32)
    publish_model(Settings(repository=tmp_path / "repo"), source, "mid", verify_model=False)
    result, data, manifest = _tune_written(capsys, tmp_path / "repo", "mid", "--p99-ms", "50", "--low-rps", "40",
                                           "--peak-rps", "150", "--requests", "300", "--budget", "110")
    _assert_written_as_recorded(result, data, manifest)
    assert data["overload"]["points"] and data["overload"]["tried"]
    if data["overload"]["outcome"] != "policy-held":  # the record lists every policy tried, with its reason
        assert all(p["note"] for p in data["overload"]["points"])


def test_the_batching_choice_is_written_when_the_overload_cannot_be_driven(tmp_path, capsys):
    """6 ms + 0.75 ms per item under p99 60 ms: capacity is many hundreds per second, and 20 x that is more
    than any client on this machine sends. That is "not measurable here", not a failure of the batching
    choice: it is written, with the overload step's outcome in the record and a warning. (The SLO leaves
    every structure room: under 25 ms a busy minute of this machine made every candidate miss in two runs
    in a row, which is not the behaviour under test.)"""
    source = write_cost_model(tmp_path / "src", name="quick", fixed_ms=6.0, per_item_ms=0.75, max_batch_size=32)
    publish_model(Settings(repository=tmp_path / "repo"), source, "quick", verify_model=False)
    result, data, manifest = _tune_written(capsys, tmp_path / "repo", "quick", "--p99-ms", "60", "--low-rps", "50",
                                           "--peak-rps", "250", "--requests", "300", "--budget", "80",
                                           "--overload-factor", "20")
    _assert_written_as_recorded(result, data, manifest)
    points = data["overload"]["points"]
    if any(p["overload"]["requests"] or p["overload"]["unsent"] for p in points):
        assert data["overload"]["outcome"] == "not-measurable"
        assert "could not be driven from this client" in result.err
    else:  # every policy on the choice was ruled out by the mechanism or shed normal traffic: nothing driven
        assert data["overload"]["outcome"] == "no-policy-held" and any(p["predicted_miss"] for p in points)
        assert "none was driven into it" in result.err
    assert data["status"] in ("chosen-with-closest-queue-policy", "chosen-without-queue-policy")


@pytest.mark.parametrize("factor", ["1", "0.5", "nan", "inf", "101", "-2"])
def test_absurd_overload_factors_are_refused(tmp_path, capsys, factor):
    result = run_cli(capsys, "tune-batching", "m", "--repo", tmp_path / "repo", "--p99-ms", "40",
                     *RATES, "--overload-factor", factor)
    assert result.code == 2 and "--overload-factor" in result.err, result.err


def test_down_server_and_unknown_model_are_clear_errors(tmp_path, capsys):
    port = free_ports(1)[0]
    down = run_cli(capsys, "-q", "tune-batching", "m", "--url", f"http://127.0.0.1:{port}", "--p99-ms", "10", *RATES)
    assert down.code == 6 and "not reachable" in down.err
    (tmp_path / "repo").mkdir()
    unknown = run_cli(capsys, "-q", "tune-batching", "nope", "--repo", str(tmp_path / "repo"), "--p99-ms", "10", *RATES)
    assert unknown.code == 4 and "nope" in unknown.err
    usage = run_cli(capsys, "-q", "tune-batching", "m", "--repo", str(tmp_path / "repo"), "--p99-ms", "10")
    assert usage.code == 2 and "--low-rps" in usage.err
    bad = run_cli(capsys, "-q", "tune-batching", "m", "--repo", str(tmp_path / "repo"), "--p99-ms", "10",
                  "--low-rps", "50", "--peak-rps", "10")
    assert bad.code == 2
    factor = run_cli(capsys, "-q", "tune-batching", "m", "--repo", str(tmp_path / "repo"), "--p99-ms", "10", *RATES,
                     "--overload-factor", "0.5")
    assert factor.code == 2 and "--overload-factor" in factor.err
