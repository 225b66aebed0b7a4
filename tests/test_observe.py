"""`trm observe rules`: the generated rules pass promtool, their unit tests, and fire on a real Prometheus.

The last test runs an embedded Triton and a real Prometheus (Debian's ``prometheus`` package, installed by
scripts/setup.sh) scraping it every second; an overload the test creates (closed-loop clients far beyond
what a batch-of-1 model with 40 ms executions can serve) makes the queue alert fire, and it clears when
the load stops.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from cost_model import write_cost_model
from helpers import run_cli

from repo_manager.adapters.loadgen import BackgroundLoad
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer, free_ports
from repo_manager.core.config import atomic_write_bytes
from repo_manager.core.manifest import MANIFEST_NAME, Manifest
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model
from repo_manager.ops.serving import load_version

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(not (PROMTOOL and PROMETHEUS),
                                      reason="Debian's prometheus package is not installed (scripts/setup.sh)")


def tuned_repo(root: Path, settings: Settings, tmp: Path, slo_ms: float = 80.0) -> LocalRepository:
    """A repository with model `ranker` whose manifest carries a tuning record (SLO ``slo_ms``)."""
    source = write_cost_model(tmp / "src", name="ranker", fixed_ms=40.0, per_item_ms=0.0, max_batch_size=1,
                              dynamic_batching=True)
    publish_model(settings, source, "ranker", verify_model=False)
    path = root / "ranker" / "1" / MANIFEST_NAME
    manifest = Manifest.from_json(path.read_bytes())
    tuning = {"slo": {"p99_ms": slo_ms, "low_rps": 5, "peak_rps": 10}}
    atomic_write_bytes(path, Manifest(**{**manifest.__dict__, "tuning": tuning}).to_json())
    return LocalRepository(root)


@pytest.fixture
def rules_dir(tmp_path, capsys):
    settings = Settings(repository=tmp_path / "repo")
    tuned_repo(settings.repository, settings, tmp_path)
    out = tmp_path / "obs"
    result = run_cli(capsys, "observe", "rules", "--repo", settings.repository, "--out", out, "--queue-for", "2s",
                     "--evaluation-interval", "1", "--samples", "2", "--json")
    assert result.code == 0, result.err
    return out, result.json(), settings


def render(annotation: str, value: str) -> str:
    for template in ('{{ $value | printf "%.1f" }}', '{{ $value | printf "%.2f" }}',
                     "{{ $value | humanizePercentage }}", "{{ $value }}"):
        annotation = annotation.replace(template, value)
    return annotation


@needs_prometheus
def test_rules_carry_the_tuned_slo_pass_promtool_and_their_unit_tests(rules_dir):
    out, data, _ = rules_dir
    assert data["models"][0]["p99_slo_ms"] == 80.0 and data["models"][0]["slo_source"] == "tuning record"
    assert {"TrmQueueBacklog", "TrmLatencyAboveSLO", "TrmRequestsRejected", "TrmModelNotReady",
            "TrmVersionsDiffer"} <= set(data["alerts"])
    rules_path = out / "trm-rules.yml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = {r["alert"]: r for r in yaml.safe_load(rules_path.read_text())["groups"][0]["rules"]}

    def expect(alert: str, value: str, at: str) -> dict:
        rule = rules[alert]
        return {"eval_time": at, "alertname": alert, "exp_alerts": [
            {"exp_labels": rule["labels"], "exp_annotations": {k: render(v, value)
                                                               for k, v in rule["annotations"].items()}}]}

    base = 'model="ranker",instance="a:8002",job="triton"'
    tests = {"rule_files": [str(rules_path)], "evaluation_interval": "1s", "tests": [{
        "interval": "1s",
        "input_series": [
            {"series": f'nv_inference_pending_request_count{{{base},version="1"}}', "values": "0 0 6x148"},
            {"series": f'nv_inference_request_summary_us{{{base},version="1",quantile="0.99"}}',
             "values": "20000 20000 150000x148"},
            {"series": f'nv_inference_request_success{{{base},version="1"}}', "values": "0+10x150"},
            {"series": f'nv_inference_request_failure{{{base},version="1",reason="REJECTED"}}', "values": "0+10x150"},
            {"series": f'nv_inference_request_failure{{{base},version="1",reason="BACKEND"}}', "values": "0x150"},
            {"series": 'up{instance="a:8002",job="triton"}', "values": "1x150"},
            {"series": 'up{instance="b:8002",job="triton"}', "values": "1x150"},
        ],
        "alert_rule_test": [
            {"eval_time": "1s", "alertname": "TrmQueueBacklog", "exp_alerts": []},
            expect("TrmQueueBacklog", "6.0", "6s"),
            expect("TrmLatencyAboveSLO", "150.0", "6s"),
            {"eval_time": "6s", "alertname": "TrmInferenceFailures", "exp_alerts": []},
            {"eval_time": "6s", "alertname": "TrmVersionsDiffer", "exp_alerts": []},
            expect("TrmRequestsRejected", "50%", "90s"),
            expect("TrmModelNotReady", "1", "90s"),  # b is up and does not serve ranker
        ]}]}
    test_file = out / "trm-rules.test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    unit = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    board = json.loads((out / "trm-dashboard.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert titles[:3] == ["Queue depth per replica", "Pending batch ratio", "Utilisation slope"]
    assert any("Latency" in t for t in titles) and any("batch size" in t for t in titles)


@needs_prometheus
def test_agent_rules_fire_on_a_refusing_a_lagging_and_a_cut_off_pod(tmp_path):
    """The ``trm-agents`` group on the agents' own series (names checked against a live agent in
    tests/test_agent.py): pod a refuses v3 and lags; pod b is converged but has lost the store."""
    from repo_manager.ops.observe.rules import ModelWatch, Thresholds, write_artifacts

    written = write_artifacts(tmp_path, [ModelWatch("m", 3)], Thresholds(versions_for="2m", pointer_stale_s=600),
                              "production")
    assert {"TrmAgentDegraded", "TrmAgentBehind", "TrmAgentPointerStale"} <= set(written.alerts)
    rules_path = tmp_path / "trm-rules.yml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    a, b = 'instance="a:8090",job="agent"', 'instance="b:8090",job="agent"'
    pa, pb = f'{a},env="production",pod="a"', f'{b},env="production",pod="b"'
    labels = {"source": "trm-agent", "env": "production", "severity": "warning"}
    series = [(f"trm_agent_ready{{{pa}}}", "1x100"), (f"trm_agent_ready{{{pb}}}", "1x100"),
              (f"trm_agent_degraded{{{pa}}}", "0 1x99"), (f"trm_agent_degraded{{{pb}}}", "0x100"),
              (f'trm_agent_wanted_version{{{pa},model="m"}}', "3x100"),
              (f'trm_agent_wanted_version{{{pb},model="m"}}', "3x100"),
              (f'trm_serving_version{{{a},model="m"}}', "2x100"), (f'trm_serving_version{{{b},model="m"}}', "3x100"),
              # a read the pointer a moment ago at every sample; b last at t=0
              (f'trm_operation_last_success_timestamp_seconds{{{a},operation="pointer_read",model=""}}', "0+60x100"),
              (f'trm_operation_last_success_timestamp_seconds{{{b},operation="pointer_read",model=""}}', "0x100")]
    tests = {"rule_files": [str(rules_path)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "TrmAgentPointerStale", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "TrmAgentDegraded", "exp_alerts": [{
                "exp_labels": {**labels, **dict(x.split("=") for x in pa.replace('"', "").split(","))},
                "exp_annotations": {"summary": "a refuses the version production names",
                                    "description": "The agent keeps serving the last good version; its /status "
                                                   "says why (degraded_reason)."}}]},
            {"eval_time": "5m", "alertname": "TrmAgentBehind", "exp_alerts": [{
                "exp_labels": {**labels, **dict(x.split("=") for x in pa.replace('"', "").split(",")), "model": "m"},
                "exp_annotations": {"summary": "a does not serve m version 3",
                                    "description": "Longer than 2m: the pod's rollout is stuck or refused."}}]},
            {"eval_time": "15m", "alertname": "TrmAgentPointerStale", "exp_alerts": [{
                "exp_labels": {**labels, **dict(x.split("=") for x in pb.replace('"', "").split(",")),
                               "operation": "pointer_read"},
                "exp_annotations": {"summary": "b: no pointer read for more than 600s",
                                    "description": "The agent cannot read its environment from the store: it "
                                                   "keeps serving what it has and will not follow a promotion."}}]},
        ]}]}
    test_file = tmp_path / "agents.test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    unit = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_rules_without_models_or_with_a_bad_threshold_are_usage_errors(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    empty = run_cli(capsys, "observe", "rules", "--repo", tmp_path / "repo", "--out", tmp_path / "o")
    assert empty.code == 2 and "no models" in empty.err and not (tmp_path / "o").exists()
    missing = run_cli(capsys, "observe", "rules", "--repo", tmp_path / "repo", "--model", "nope")
    assert missing.code == 4


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _queue_alert(prom: str) -> str | None:
    alerts = _get(f"{prom}/api/v1/alerts")["data"]["alerts"]
    return next((a["state"] for a in alerts if a["labels"]["alertname"] == "TrmQueueBacklog"), None)


def _wait(predicate, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:g} s; prometheus log:\n{log.read_text()[-2000:]}")


@contextmanager
def scraping_prometheus(server: TritonServer, rules: Path, folder: Path) -> Iterator[tuple[str, Path]]:
    """A real Prometheus evaluating ``rules`` every second over ``server``'s metrics, once it scrapes them:
    its URL and its log. Stopped (terminate, then kill) on the way out."""
    metrics = server.endpoints.metrics.removeprefix("http://").removesuffix("/metrics")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
              "scrape_configs": [{"job_name": "triton", "static_configs": [{"targets": [metrics]}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_ports(1)[0]
    log = folder / "prometheus.log"
    with open(log, "wb") as sink:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={folder / 'tsdb'}",
                                       f"--web.listen-address=127.0.0.1:{port}"],
                                      stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    prom = f"http://127.0.0.1:{port}"
    try:
        def scraping() -> bool:
            try:
                targets = _get(f"{prom}/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return False
            return any(t["health"] == "up" for t in targets)

        _wait(scraping, 30, "prometheus did not scrape Triton", log)
        yield prom, log
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()


@needs_prometheus
def test_queue_alert_fires_under_overload_and_clears_on_a_real_prometheus_and_top_shows_the_queue(
        rules_dir, tmp_path, capsys):
    out, _, settings = rules_dir
    repo = LocalRepository(settings.repository)
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "ranker")
        with scraping_prometheus(server, out / "trm-rules.yml", tmp_path) as (prom, log):
            assert _queue_alert(prom) is None
            # 12 clients against one 40 ms execution at a time: about 11 requests always queued
            with BackgroundLoad(server.url, "ranker", clients=12) as load:
                load.wait_for(20)  # requests are flowing before top samples
                top = run_cli(capsys, "top", server.url, "--metrics-port", server.ports["metrics"], "--interval",
                              "2", "--json")
                _wait(lambda: _queue_alert(prom) == "firing", 40, "TrmQueueBacklog did not fire", log)
            _wait(lambda: _queue_alert(prom) is None, 30, "TrmQueueBacklog did not clear", log)
            assert top.code == 0, top.err
            row = next(r for r in top.json()["rows"] if r["model"] == "ranker")
            assert row["version"] == "1" and row["rate_rps"] > 0 and row["pending"] >= 1
            assert row["p50_ms"] is not None and row["p99_ms"] >= row["p50_ms"]  # the launcher's summaries
            assert row["queue_ms"] > 0 and row["compute_ms"] > 0 and row["mean_batch"] == 1.0
            assert set(row["batch_sizes"]) == {"1"} or set(row["batch_sizes"]) == {1}
            assert row["failed_rps"] == 0 and row["rejected_rps"] == 0


def test_top_on_a_server_with_metrics_disabled_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    with TritonServer(tmp_path / "repo", extra_args=["--allow-metrics=false"]) as server:
        result = run_cli(capsys, "top", server.url, "--metrics-port", server.ports["metrics"], "--once")
    assert result.code == 6
    first = result.err.strip().splitlines()[0]
    assert "no metrics at" in first and "metrics disabled" in first


def test_serve_exports_trms_own_metrics_for_prometheus(rules_dir):
    import os
    import signal
    import sys

    _, _, settings = rules_dir
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "repo_manager", "--json", "serve", "--repo",
                             str(settings.repository),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--trm-metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        text = ""
        while True:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            text += line
            try:
                info = json.loads(text)
                break
            except json.JSONDecodeError:
                continue
        with urllib.request.urlopen(info["trm_metrics"], timeout=5) as response:
            exported = response.read().decode()
        assert 'trm_serving_version{model="ranker"} 1.0' in exported
        assert 'trm_operations_total{model="",operation="serve_start",outcome="ok"} 1.0' in exported
        assert "trm_operation_seconds_bucket" in exported and "trm_build_info" in exported
        [load] = [line for line in exported.splitlines() if line.startswith("trm_model_load_duration_seconds{")]
        assert load.startswith('trm_model_load_duration_seconds{model="ranker",version="1"} ') and \
            float(load.rsplit(" ", 1)[1]) > 0, load  # how long serve's load of it took (Triton exports none)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_rules_for_an_environment_take_its_versions_and_their_tuning_records(rules_dir, tmp_path, capsys):
    _, _, settings = rules_dir
    store = tmp_path / "store"
    pushed = run_cli(capsys, "push", store, "--repo", settings.repository, "--env", "production")
    assert pushed.code == 0, pushed.err
    result = run_cli(capsys, "observe", "rules", "production", "--store", store, "--out", tmp_path / "env", "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["env"] == "production" and data["models"][0]["version"] == 1
    assert data["models"][0]["p99_slo_ms"] == 80.0 and "TrmVersionNotInEnv" in data["alerts"]
    rules = yaml.safe_load((tmp_path / "env" / "trm-rules.yml").read_text())["groups"][0]["rules"]
    pinned = next(r for r in rules if r["alert"] == "TrmVersionNotInEnv")
    assert 'version!="1"' in pinned["expr"] and pinned["labels"]["env"] == "production"
    unknown = run_cli(capsys, "observe", "rules", "staging", "--store", store, "--out", tmp_path / "none")
    assert unknown.code == 4 and not (tmp_path / "none").exists()


def test_shipped_alert_and_dashboard_texts_explain_themselves(tmp_path, capsys):
    """No history an operator cannot know ("the seed's cascade"): each threshold says what it means and why."""
    from store_helpers import make_version

    make_version(tmp_path / "repo", "ranker", {"model.py": b"# stand-in\n"})
    result = run_cli(capsys, "observe", "rules", "--repo", tmp_path / "repo", "--out", tmp_path / "obs",
                     "--p99-ms", "50")
    assert result.code == 0, result.err
    rules = (tmp_path / "obs" / "trm-rules.yml").read_text()
    dashboard = json.loads((tmp_path / "obs" / "trm-dashboard.json").read_text())
    texts = [rules] + [p["description"] for p in dashboard["panels"]] + [p["title"] for p in dashboard["panels"]]
    assert not [t for t in texts if "seed" in t.lower()]
    backlog = next(r for g in yaml.safe_load(rules)["groups"] for r in g["rules"] if r["alert"] == "TrmQueueBacklog")
    assert "queues grow first and p99 follows" in backlog["annotations"]["description"]
    queue_panel = next(p for p in dashboard["panels"] if p["title"] == "Queue depth per replica")
    assert "threshold" in queue_panel["description"] and "add replicas" in queue_panel["description"]


def test_top_hides_temporary_verification_models_and_shows_labels_as_text():
    """Two scrapes of Triton's metrics text (as its /metrics answers it): a model trm loads for a moment to
    verify a version is not a row; a label with escape sequences is shown, never sent to the terminal."""
    from repo_manager.ops.observe.top import Scrape, Server, View, between, parse_metrics, render

    def scrape(at: float, count: int) -> Scrape:
        text = "\n".join(f'nv_inference_request_success{{model="{m}",version="1"}} {count}'
                         for m in ("ranker", "trm-verify-0a1b2c3d-ranker", "evil\x1b]0;title\x07[/ml]"))
        return Scrape(Server("http://h:8002/metrics"), at, *parse_metrics(text))

    rows = between(scrape(0.0, 0), scrape(1.0, 10))
    assert sorted(r.model for r in rows) == ["evil\x1b]0;title\x07[/ml]", "ranker"]
    shown = render(View(tuple(rows), 1.0, ()))
    assert "trm-verify" not in shown and "\x1b" not in shown and "\x07" not in shown
    assert "evil\\x1b]0;t" in shown and "ranker" in shown
