"""Arguments no command could act on are refused before anything starts or is written: a one-line error
naming the option, exit 2 (usage) or 3 (bad input), never 1: version numbers and selections, ports, tensor specs
and sizes, GPU memory and node facts, Prometheus durations and selectors, the agent's intervals and pod name.
No server is started.
"""

from __future__ import annotations

import pytest
from helpers import run_cli
from store_helpers import make_version, outside_folder, pushed_store


@pytest.mark.parametrize("selection", ["base:", "base:٣", "base:0", "base:-1", "base:1x"])
def test_a_version_selection_must_be_a_plain_positive_number(capsys, tmp_path, selection):
    store = pushed_store(tmp_path)
    result = run_cli(capsys, "push", store, "--repo", tmp_path / "src", "--model", selection)
    assert result.code == 2 and "must be a positive number" in result.err, result.err


@pytest.mark.parametrize("ports, message", [(("--http-port", "9000", "--grpc-port", "9000"), "are both 9000"),
                                            (("--http-port", "70000"), "70000 is not in the range"),
                                            (("--trm-metrics-port", "-1"), "-1 is not in the range")])
def test_serve_refuses_ports_it_cannot_use_before_starting_anything(capsys, tmp_path, ports, message):
    (tmp_path / "repo").mkdir()
    result = run_cli(capsys, "serve", "--repo", tmp_path / "repo", *ports)
    assert result.code == 2 and message in result.err, result.err


@pytest.mark.parametrize("args, message", [
    (("--input", "X:FP32:-5"), "each dim is -1"), (("--input", "X:FP32:0"), "each dim is -1"),
    (("--input", "X:FP32:99999999999999999999"), "each dim is -1"), (("--input", "X Y:FP32:4"), "no spaces"),
    (("--input", "X:FP32:4", "--input", "X:FP32:4"), "named twice"), (("--input", "Y:FP32:4"), "named twice"),
    (("--input", "X:FP32:4", "--max-batch-size", "1000000000000"), "not in the range"),
    (("--input", "X:FP32:4", "--instances", "100000000000000000000"), "not in the range"),
    (("--input", "X:FP32:4", "--max-batch-size", "-1"), "not in the range")])
def test_publish_refuses_tensor_specs_and_numbers_triton_cannot_take(capsys, tmp_path, args, message):
    source = tmp_path / "s"
    source.mkdir()
    (source / "model.py").write_text("import triton_python_backend_utils as pb_utils\n")
    result = run_cli(capsys, "publish", "model", source, "--name", "m", "--repo", tmp_path / "r", "--output",
                     "Y:FP32:4", "--no-verify", *args)
    assert result.code in (2, 3) and message in result.err, result.err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").rglob("config.pbtxt"))


def test_plan_and_doctor_refuse_absurd_numbers_and_facts(capsys, tmp_path):
    import json

    huge = run_cli(capsys, "plan", tmp_path, "--gpu-memory", "1e308")
    assert huge.code == 2 and "--gpu-memory" in huge.err, huge.err
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 0, "vocab_size": 100}))
    zero = run_cli(capsys, "plan", checkpoint, "--gpu-memory", "80")
    assert zero.code == 3 and "head_dim" in zero.err, zero.err
    facts = tmp_path / "facts.json"
    for text, message in (('{"gpus": [], "framework_cuda": "x"}', "framework_cuda"),
                          ('{"gpus": [{"name": null, "memory_bytes": "80GB", "compute_capability": 9.0}]}',
                           "gpus[0]"), ("[" * 100_000, "nested too deeply"), ("{", "not valid JSON")):
        facts.write_text(text)
        result = run_cli(capsys, "doctor", "--repo", tmp_path, "--node-facts", facts, "--json")
        assert result.code == 3 and message in result.err and result.json()["error"]["exit_code"] == 3, result.err


def test_observe_rules_refuses_durations_selectors_and_outputs_prometheus_would_not_take(capsys, tmp_path):
    make_version(tmp_path / "repo", "base", {"model.py": b"# v1"})
    elsewhere = outside_folder(tmp_path)
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    common = ("observe", "rules", "--repo", tmp_path / "repo")
    for args, code, message in ((("--queue-for", "1x"), 2, "not a Prometheus duration"),
                                (("--rate-window", ""), 2, "not a Prometheus duration"),
                                (("--versions-for", "-1m"), 2, "not a Prometheus duration"),
                                (("--selector", 'job="triton'), 2, "not a list of label matchers"),
                                (("--selector", 'job="a"}) or vector(1) #'), 2, "not a list of label matchers"),
                                (("--out", tmp_path / "linked"), 3, "symbolic link"),
                                (("--out", "/proc/nope"), 3, "cannot create")):
        result = run_cli(capsys, *common, *(("--out", tmp_path / "o") if "--out" not in args else ()), *args)
        assert result.code == code and message in result.err, (args, result.err)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]
    ok = run_cli(capsys, *common, "--out", tmp_path / "o", "--selector", 'job="triton",namespace=~"prod.*"')
    assert ok.code == 0, ok.err


@pytest.mark.parametrize("args", [("--interval", "inf"), ("--interval", "nan"), ("--backoff", "inf"),
                                  ("--drain-timeout", "nan"), ("--max-unavailable", "100000000000000000000"),
                                  ("--pod-name", "../x")])
def test_agent_refuses_absurd_options_before_starting(capsys, tmp_path, args):
    result = run_cli(capsys, "agent", tmp_path / "store", "--env", "prod", "--repo", tmp_path / "r",
                     "--url", "http://127.0.0.1:9", *args)
    assert result.code == 2 and args[0] in result.err, result.err


@pytest.mark.parametrize("version", ["0", "-1", "100000000000000000000"])
def test_infer_refuses_a_version_that_cannot_exist(capsys, tmp_path, version):
    result = run_cli(capsys, "infer", "m", "--version", version, "--url", "http://127.0.0.1:9", "--text", "x")
    assert result.code == 2 and "--version" in result.err, result.err
