"""LLM models in `trm top` and `trm observe rules`: the engine's queue, KV cache, tokens/s, TTFT and ITL.

The metric values come from a stand-in for the vLLM engine (tests/vllm_metrics_model.py: the real engine is
not in the shared venv): a decoupled Python model on the real embedded tritonserver that runs one request at
a time and reports vLLM's metric families through ``pb_utils.MetricFamily``, as trm's vLLM backend does.
The rules pass promtool and their unit tests, and fire on a real Prometheus scraping that server under a
load that keeps requests waiting; `trm top` reads the same server.
"""

from __future__ import annotations

import math
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from helpers import run_cli
from test_observe import PROMTOOL, _get, _wait, needs_prometheus, render, scraping_prometheus
from vllm_metrics_model import write_engine_stand_in

from repo_manager.adapters.loadgen.llm import Lengths, LLMLoad, run_llm
from repo_manager.adapters.loadgen.measure import Target
from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.config import atomic_write_bytes
from repo_manager.core.manifest import MANIFEST_NAME, Manifest
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model
from repo_manager.ops.serving import load_version

FIRST_MS, NEXT_MS, TOKENS = 20.0, 20.0, 12
"""One request runs ~0.24 s; with one slot and four clients three requests always wait."""


def llm_repo(tmp: Path, tuning: dict | None) -> Settings:
    settings = Settings(repository=tmp / "repo")
    source = write_engine_stand_in(tmp / "src", "chat", first_ms=FIRST_MS, next_ms=NEXT_MS, slots=1)
    publish_model(settings, source, "chat", verify_model=False)
    if tuning is not None:
        path = settings.repository / "chat" / "1" / MANIFEST_NAME
        manifest = Manifest.from_json(path.read_bytes())
        atomic_write_bytes(path, Manifest(**{**manifest.__dict__, "tuning": tuning}).to_json())
    return settings


@pytest.fixture
def llm_rules(tmp_path, capsys):
    settings = llm_repo(tmp_path, {"slo": {"ttft_p99_ms": 100, "itl_p99_ms": 5}})
    out = tmp_path / "obs"
    result = run_cli(capsys, "observe", "rules", "--repo", settings.repository, "--out", out, "--waiting-for",
                     "2s", "--evaluation-interval", "1", "--samples", "2", "--rate-window", "10s", "--json")
    assert result.code == 0, result.err
    return out, result.json(), settings


def rules_of(out: Path) -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load((out / "trm-rules.yml").read_text())["groups"] for r in g["rules"]}


@needs_prometheus
def test_llm_rules_carry_the_tuned_ttft_and_itl_slos_and_pass_promtool_and_their_unit_tests(llm_rules):
    out, data, _ = llm_rules
    (model,) = data["models"]
    assert model["llm"] is True and model["ttft_p99_slo_ms"] == 100 and model["itl_p99_slo_ms"] == 5
    assert model["llm_slo_source"] == "ttft: tuning record, itl: tuning record"
    assert {"TrmLlmRequestsWaiting", "TrmTtftAboveSLO", "TrmItlAboveSLO"} <= set(data["alerts"])
    rules_path = out / "trm-rules.yml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = rules_of(out)

    def expect(alert: str, value: str, at: str, labels: dict | None = None) -> dict:
        rule = rules[alert]
        return {"eval_time": at, "alertname": alert, "exp_alerts": [
            {"exp_labels": {**rule["labels"], **(labels or {})},
             "exp_annotations": {k: render(v, value) for k, v in rule["annotations"].items()}}]}

    a, b = 'model="chat",version="1",instance="a:8002",job="triton"', 'model="chat",version="1",instance="b:8002"'
    series = [
        # two replicas: a has one request waiting from t=10s, b none; then both two (2 per replica)
        (f"vllm:num_requests_waiting{{{a}}}", "0x9 1x30 2x30"),
        (f'vllm:num_requests_waiting{{{b},job="triton"}}', "0x39 2x30"),
    ]
    # TTFT: every request within 50 ms until 30 s, then every request over 0.5 s (above the 100 ms SLO);
    # ITL: 10 tokens/s all at or below 4 ms (under the 5 ms SLO) throughout
    for le, before, after in (("0.05", "0+10x30", "300+0x39"), ("0.1", "0+10x30", "300+0x39"),
                              ("0.5", "0+10x30", "300+0x39"), ("1", "0+10x30", "300+10x39"),
                              ("+Inf", "0+10x30", "300+10x39")):
        series.append((f'vllm:time_to_first_token_seconds_bucket{{{a},le="{le}"}}', f"{before} {after}"))
    for le, values in (("0.001", "0x70"), ("0.004", "0+10x70"), ("+Inf", "0+10x70")):
        series.append((f'vllm:time_per_output_token_seconds_bucket{{{a},le="{le}"}}', values))
    tests = {"rule_files": [str(rules_path)], "evaluation_interval": "1s", "tests": [{
        "interval": "1s", "input_series": [{"series": k, "values": v} for k, v in series],
        "alert_rule_test": [
            {"eval_time": "9s", "alertname": "TrmLlmRequestsWaiting", "exp_alerts": []},
            # one waiting on one of two replicas: 0.5 per replica, above 0 for 2 s
            expect("TrmLlmRequestsWaiting", "0.5", "13s"),
            expect("TrmLlmRequestsWaiting", "2.0", "45s"),
            {"eval_time": "25s", "alertname": "TrmTtftAboveSLO", "exp_alerts": []},
            # p99 of the last 10 s, all in the (0.5, 1] bucket: 0.5 + 0.99 * 0.5 s
            expect("TrmTtftAboveSLO", "995.0", "50s"),
            {"eval_time": "50s", "alertname": "TrmItlAboveSLO", "exp_alerts": []},
        ]}]}
    test_file = out / "llm.test.yml"
    test_file.write_text(yaml.safe_dump(tests, sort_keys=False))
    unit = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    waiting = rules["TrmLlmRequestsWaiting"]["annotations"]["description"]
    assert "One request waiting per replica is the signal to add a replica" in waiting
    assert "seed" not in (out / "trm-rules.yml").read_text().lower()
    import json

    board = json.loads((out / "trm-dashboard.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert {"LLM requests waiting per replica", "LLM KV-cache use", "LLM output tokens per second",
            "LLM time to first token p50 / p99 (ms)", "LLM inter-token latency p50 / p99 (ms)"} <= set(titles)
    assert not [p for p in board["panels"] if "seed" in (p["title"] + p["description"]).lower()]


def test_llm_slos_from_options_override_the_record_and_bad_ones_are_refused(tmp_path, capsys):
    settings = llm_repo(tmp_path, None)
    bare = run_cli(capsys, "observe", "rules", "--repo", settings.repository, "--out", tmp_path / "a", "--json")
    assert bare.code == 0, bare.err
    assert "TrmLlmRequestsWaiting" in bare.json()["alerts"] and "TrmTtftAboveSLO" not in bare.json()["alerts"]
    assert any("no TTFT p99 SLO" in n and "--ttft-p99-ms" in n for n in bare.json()["notes"])
    given = run_cli(capsys, "observe", "rules", "--repo", settings.repository, "--out", tmp_path / "b", "--json",
                    "--ttft-p99-ms", "250", "--itl-p99-ms", "30", "--p99-ms", "100")
    assert given.code == 0, given.err
    (model,) = given.json()["models"]
    assert (model["ttft_p99_slo_ms"], model["itl_p99_slo_ms"]) == (250, 30)
    assert model["llm_slo_source"] == "ttft: --ttft-p99-ms, itl: --itl-p99-ms"
    assert "> 250" in rules_of(tmp_path / "b")["TrmTtftAboveSLO"]["expr"]
    # Triton's request summary of a decoupled model is not a stream's latency: no p99 rule on it
    assert "TrmLatencyAboveSLO" not in given.json()["alerts"]
    for flag, value in (("--ttft-p99-ms", "nan"), ("--itl-p99-ms", "inf"), ("--ttft-p99-ms", "0"),
                        ("--itl-p99-ms", "-5"), ("--waiting-per-replica", "-1"), ("--waiting-for", "soon")):
        bad = run_cli(capsys, "observe", "rules", "--repo", settings.repository, "--out", tmp_path / "c",
                      flag, value)
        assert bad.code == 2, (flag, value, bad.err)
        assert len(bad.err.strip().splitlines()) <= 2 and not (tmp_path / "c").exists()
    # a tuning record with a non-finite SLO is stored data gone bad: refused (exit 7), nothing written
    broken = llm_repo(tmp_path / "broken", {"slo": {"ttft_p99_ms": float("nan")}})
    refused = run_cli(capsys, "observe", "rules", "--repo", broken.repository, "--out", tmp_path / "d")
    assert refused.code == 7 and "ttft_p99_ms" in refused.err and not (tmp_path / "d").exists()


def _alert_state(prom: str, name: str) -> str | None:
    alerts = _get(f"{prom}/api/v1/alerts")["data"]["alerts"]
    return next((a["state"] for a in alerts if a["labels"]["alertname"] == name), None)


@needs_prometheus
def test_waiting_and_ttft_alerts_fire_on_a_real_prometheus_and_top_shows_the_engine(llm_rules, tmp_path, capsys):
    out, _, settings = llm_rules
    repo = LocalRepository(settings.repository)
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "chat")
        with scraping_prometheus(server, out / "trm-rules.yml", tmp_path) as (prom, log):
            assert _alert_state(prom, "TrmLlmRequestsWaiting") is None
            # four closed-loop streams against one slot: three requests wait all the time, and each one's
            # time to first token is the queue's (about 3 x 0.24 s, above the 100 ms SLO); 240 requests ~60 s, so
            # the load outlasts the waits below on a busy machine too
            load = LLMLoad(concurrency=4, requests=240, input_tokens=Lengths(5), output_tokens=Lengths(TOKENS))
            target = Target("chat", server.url, protocol="grpc", grpc_url=server.endpoints.grpc)
            results: list = []
            sender = threading.Thread(target=lambda: results.append(run_llm(target, load)), daemon=True)
            sender.start()
            _wait(lambda: _alert_state(prom, "TrmLlmRequestsWaiting") == "firing", 50,
                  "TrmLlmRequestsWaiting did not fire", log)
            top = run_cli(capsys, "top", server.url, "--metrics-port", server.ports["metrics"], "--interval", "2",
                          "--json")
            text = run_cli(capsys, "top", server.url, "--metrics-port", server.ports["metrics"], "--once")
            # tokens 20 ms apart (sleeps: never less) against an ITL SLO of 5 ms
            for alert in ("TrmTtftAboveSLO", "TrmItlAboveSLO"):
                _wait(lambda alert=alert: _alert_state(prom, alert) == "firing", 50, f"{alert} did not fire", log)
            sender.join(300)
            assert results and results[0].completed == 240, results
            _wait(lambda: _alert_state(prom, "TrmLlmRequestsWaiting") is None, 60,
                  "TrmLlmRequestsWaiting did not clear", log)
    assert top.code == 0, top.err
    (row,) = [r for r in top.json()["llm"] if r["model"] == "chat"]
    assert row["version"] == "1" and row["running"] == 1 and row["waiting"] >= 1 and row["kv_cache_pct"] == 100.0
    # one slot emits one token every NEXT_MS (plus the first after FIRST_MS): at most 1000 / NEXT_MS tokens/s; the
    # rate is over top's own interval, which a slow scrape shortens, so the bound only catches a wrong counter
    assert 0 < row["output_tokens_s"] <= 1000 / NEXT_MS * 5
    assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > FIRST_MS
    assert NEXT_MS * 0.5 <= row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert text.code == 0, text.err
    assert "LLM model" in text.out and "TTFT p99" in text.out and "chat" in text.out


def test_top_reads_the_engine_series_and_estimates_quantiles_from_bucket_deltas():
    """Two scrapes of the text Triton serves for custom metric families: the quantiles are those of the
    observations between the scrapes only (all older ones were fast), labels are shown as text."""
    from repo_manager.ops.observe.top import Scrape, Server, View, llm_between, parse_llm, parse_metrics
    from repo_manager.ops.observe.top import render as render_top

    def scrape(at: float, tokens: int, fast: int, slow: int) -> Scrape:
        labels = 'model="chat\x1b[2J",version="3"'
        text = "\n".join([
            f"vllm:generation_tokens_total{{{labels}}} {tokens}",
            f"vllm:num_requests_running{{{labels}}} 4", f"vllm:num_requests_waiting{{{labels}}} 2",
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.875",
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} {fast}',
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="1"}} {fast + slow}',
            f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {fast + slow}',
            f"vllm:time_to_first_token_seconds_count{{{labels}}} {fast + slow}"])
        return Scrape(Server("http://h:8002/metrics"), at, *parse_metrics(text), llm=parse_llm(text))

    (row,) = llm_between(scrape(0.0, 1000, 500, 0), scrape(2.0, 1400, 500, 100))
    assert (row.running, row.waiting, row.kv_cache_pct, row.output_tokens_s) == (4, 2, 87.5, 200.0)
    assert row.ttft_p50_ms == pytest.approx(550.0) and row.ttft_p99_ms == pytest.approx(991.0)
    assert row.itl_p50_ms is None and row.itl_p99_ms is None  # no histogram: no figure, not zero
    shown = render_top(View((), 2.0, (), llm=(row,)))
    assert "\x1b" not in shown and "chat\\x1b[2J" in shown and "87.5" in shown


def test_the_series_of_two_engines_of_one_version_add_up():
    """During a reload (or with two instances) two engines of one version report, each under its own ``engine``
    label: their requests add up (a rollout's drain waits for both), the fuller KV cache is the one shown,
    counters and histogram buckets add up."""
    from repo_manager.ops.observe.top import parse_llm

    lines = []
    for engine, running, waiting, kv, tokens, fast in (("101", 3, 1, 0.5, 40, 7), ("202", 1, 0, 0.75, 2, 1)):
        labels = f'model="chat",version="1",engine="{engine}"'
        lines += [f"vllm:num_requests_running{{{labels}}} {running}",
                  f"vllm:num_requests_waiting{{{labels}}} {waiting}", f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
                  f"vllm:generation_tokens_total{{{labels}}} {tokens}",
                  f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {fast}']
    lines.append('vllm:num_requests_running{model="chat",version="2",engine="303"} 5')
    found = parse_llm("\n".join(lines))
    assert found[("chat", "1")].gauges == {"running": 4.0, "waiting": 1.0, "kv_cache": 0.75}
    assert found[("chat", "1")].counters == {"generation_tokens": 42.0}
    assert found[("chat", "1")].buckets == {"ttft": {math.inf: 8.0}}
    assert found[("chat", "2")].gauges == {"running": 5.0}
