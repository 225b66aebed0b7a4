"""`trm promote` of a vLLM model: the LLM gates (load, agreement, latency) on a real tritonserver with vLLM's CPU
engine.

Real parts only: three published versions of random-weight Llamas (tests/llm_checkpoints.py) in a folder store,
trm's vllm backend on an embedded tritonserver started once for the module. Version 2 changes only the engine
arguments of version 1 (``max_num_seqs``: same checkpoint files); version 3 has other weights (another seed).
Every promotion loads each version it compares once: four engine starts in the module, the least that two
comparisons take. No timing asserts: the latency gate must not fail two versions that cost the same.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers import run_cli
from llm_checkpoints import causal_lm

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.core.settings import Settings
from repo_manager.ops.promote import PromotionRequest, promote, read_history
from repo_manager.ops.push import push

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (scripts/setup.sh installs it)")]

LLM_LATENCY = {"rate": 4, "requests": 4, "concurrency": 2, "input_tokens": 8, "output_tokens": 8, "rounds": 1,
               "max_rounds": 3, "arrivals": "constant", "max_lag_ms": 5000, "max_ttft_p99_increase_pct": 50,
               "min_ttft_p99_delta_ms": 600_000, "max_tokens_per_s_drop_pct": 99}
"""Short points (a few 8-token streams) on a shared 2-core machine. The versions compared differ in max_num_seqs
(4 and 2), so on a busy machine their latencies may truly differ: the thresholds are ones only a hang can miss
(TTFT 10 minutes more, 99 % fewer tokens/s, sends up to 5 s late), since what these tests show is the gate run
end to end on a real engine; its verdicts are tested on recorded rounds (tests/test_promote.py)."""


def _trm(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "repo_manager", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(settings, server): versions 1-3 of ``tiny`` pushed to a folder store, a tritonserver for the gates."""
    from repo_manager.adapters.triton.server import TritonServer

    registry = tmp_path_factory.mktemp("engines")
    old = os.environ.get("TRM_VLLM_ENGINE_REGISTRY")
    os.environ["TRM_VLLM_ENGINE_REGISTRY"] = str(registry)
    try:
        base = tmp_path_factory.mktemp("llm")
        same = causal_lm(base / "seed0", max_position_embeddings=128)
        other = causal_lm(base / "seed1", max_position_embeddings=128, seed=1)
        repo = tmp_path_factory.mktemp("repo")
        for version, (checkpoint, seqs) in enumerate(((same, 4), (same, 2), (other, 4)), 1):
            result = _trm("--json", "publish", "model", checkpoint, "--name", "tiny", "--format", "vllm", "--repo",
                          repo, "--max-num-seqs", seqs, "--no-verify", env=dict(os.environ))
            assert result.returncode == 0, result.stderr[-3000:]
            assert json.loads(result.stdout)["version"] == version
        location = str(tmp_path_factory.mktemp("store") / "store")
        settings = Settings(repository=repo, store=location, environments={"staging": {}, "production": {}},
                            gates={"llm_latency": LLM_LATENCY})
        push(open_store(location, settings), LocalRepository(repo), [("tiny", v) for v in (1, 2, 3)])
        with TritonServer(tmp_path_factory.mktemp("scratch")) as server:
            yield dataclasses.replace(settings, triton_url=server.url)
    finally:
        if old is None:
            os.environ.pop("TRM_VLLM_ENGINE_REGISTRY", None)
        else:
            os.environ["TRM_VLLM_ENGINE_REGISTRY"] = old


@pytest.fixture
def staged(store, tmp_path):
    """Production serves version 1; configs/trm.yaml (read by the CLI in tmp_path) has the module's gates."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(yaml.safe_dump({"gates": store.gates,
                                                                   "environments": store.environments}))
    point(store, "production", 1)
    return store


def point(settings: Settings, env: str, version: int):
    """Move ``env`` to ``version`` with the checksums gate alone (no engine)."""
    promote(settings, PromotionRequest("tiny", env, version=version, gates=("checksums",)))


def snapshot(settings: Settings):
    pointer = open_store(settings.store, settings).get_env("production")
    return (pointer.models, pointer.etag), [r.id for r in read_history(settings, "production").records]


def _promote(capsys, settings: Settings, *extra: str):
    return run_cli(capsys, "--json", "promote", "tiny", "--from", "staging", "--to", "production", "--store",
                   settings.store, "--url", settings.triton_url, *extra)


def test_a_config_only_llm_version_generates_agrees_and_keeps_its_latency_and_moves(staged, capsys):
    point(staged, "staging", 2)
    result = _promote(capsys, staged)
    assert result.code == 0, result.err
    data = result.json()
    assert data["plan"]["config_only"] is True and data["plan"]["skip"] == {}  # only model.json differs
    gates = {g["gate"]: g for g in data["gates"]}
    assert list(gates) == ["checksums", "load", "latency", "agreement"]
    assert all(g["passed"] and not g["skipped"] for g in data["gates"]), data["gates"]
    stream = gates["load"]["details"]["stream"]
    assert stream["completed"] == 1 and stream["token_counts"] == "server" and stream["output_tokens"]["max"] >= 1
    agreement = gates["agreement"]["details"]
    assert agreement["compared"] == "token ids" and agreement["prompts"] >= 4
    latency = gates["latency"]
    print("latency gate, equal versions:", latency["summary"])
    assert latency["details"]["verdict"] in ("pass", "inconclusive")  # never a failure on noise
    assert set(latency["details"]["judged"]) == {"ttft_p99", "tokens_per_s"}
    assert latency["details"]["new"]["tokens_per_s"] > 0 and latency["details"]["old"]["ttft_p99_ms"] > 0
    assert open_store(staged.store, staged).get_env("production").models == {"tiny": 2}
    assert read_history(staged, "production").records[-1].gates[2]["gate"] == "latency"


def test_auto_gates_of_an_llm_with_other_weights_record_agreement_as_skipped_with_the_reason(staged, capsys):
    point(staged, "staging", 3)
    result = _promote(capsys, staged, "--dry-run")
    assert result.code == 0, result.err
    plan = result.json()
    plan = plan.get("plan", plan)
    assert plan["config_only"] is False and "agreement" in plan["gates"]
    assert "model.safetensors" in plan["skip"]["agreement"] and "expected to differ" in plan["skip"]["agreement"]


def test_an_llm_version_with_other_weights_named_for_agreement_is_blocked_at_the_first_differing_prompt(
        staged, capsys):
    point(staged, "staging", 3)
    before = snapshot(staged)
    result = _promote(capsys, staged, "--gates", "checksums,agreement")
    assert result.code == 9, result.err
    data = result.json()
    [failed] = [g for g in data["gates"] if not g["passed"]]
    assert failed["gate"] == "agreement" and data["moved"] is False
    assert "greedy output differs from version 1 for prompt 1 of" in failed["summary"]
    assert "“Hello”" in failed["summary"], failed["summary"]
    first = failed["details"]["first_difference"]
    assert first["prompt"] == "Hello" and first["new_token_ids"] != first["old_token_ids"]
    assert "agreement" in data["error"]["message"]
    assert snapshot(staged) == before
