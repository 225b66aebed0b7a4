"""`trm doctor` and ``check_engine_compatible``: may this node run these engines?

The probe runs for real on this machine (no GPU: doctor must fail, exit 11). The decisions for nodes we
cannot be on — another GPU architecture, an old driver, another TensorRT, less memory, fewer GPUs — are
tested by giving the decision function those nodes' facts as data (``NodeFacts``); this is testing a
pure decision on recorded facts, not mocking a failure. Engines are published from engine folders in
TensorRT-LLM's documented config.json format (tests/llm_fixtures.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import llm_fixtures as fx
import pytest
from helpers import run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.errors import CompatibilityError
from repo_manager.core.settings import Settings
from repo_manager.ops.llm.doctor import check_engine_compatible, diagnose
from repo_manager.ops.llm.node import GpuFacts, NodeFacts, probe_node
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.tensorrt_llm import TrtllmOptions

GIB = 1024**3
FINGERPRINT = {"compute_capability": "9.0", "gpu_name": "NVIDIA H200", "tensorrt_llm_version": "0.12.0",
               "tensorrt_version": "10.3.0", "cuda_version": "12.5"}
H200 = GpuFacts("NVIDIA H200", 143771 * 1024**2, "9.0")
H200_NODE = NodeFacts(gpus=(H200,), driver_version="555.42.06", driver_cuda_version="12.5",
                      tensorrt_version="10.3.0", tensorrt_llm_version="0.12.0", probe="recorded")


@pytest.fixture
def repo(tmp_path) -> LocalRepository:
    """Llama 3.1 8B's shape (the published config) with an engine for max_seq_len 65536 on H200s, tp 1,
    and a tiny tp-2 engine."""
    checkpoint = fx.llama_checkpoint(tmp_path / "ckpt")
    llama8 = json.loads((Path(__file__).parent / "data" / "llm" / "llama-3.1-8b.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(llama8))
    engine = fx.engine_dir(tmp_path / "engine", checkpoint, max_batch_size=8, max_input_len=8192,
                           max_seq_len=65536, fingerprint=FINGERPRINT)
    settings = Settings(repository=tmp_path / "repo")
    publish_model(settings, checkpoint, "llama", fmt="tensorrt-llm", node=H200_NODE,
                  trtllm=TrtllmOptions(engine_dir=engine))
    tiny = fx.llama_checkpoint(tmp_path / "tiny")
    publish_model(settings, tiny, "tiny", fmt="tensorrt-llm", node=H200_NODE, trtllm=TrtllmOptions(
        engine_dir=fx.engine_dir(tmp_path / "tiny-engine", tiny, tp=2, fingerprint=FINGERPRINT), gpu_memory_gib=80))
    return LocalRepository(tmp_path / "repo")


def _failures(manifest, node):
    with pytest.raises(CompatibilityError) as info:
        check_engine_compatible(manifest, node)
    return info.value.message


def test_matching_node_passes_and_records_every_check(repo):
    node = replace(H200_NODE, gpus=(H200, replace(H200, index=1)))
    findings = check_engine_compatible(repo.manifest("llama_tensorrt_llm"), node)
    assert {f.check: f.status for f in findings} == {
        "gpu_count": "ok", "compute_capability": "ok", "tensorrt": "ok", "tensorrt_llm": "ok",
        "driver_cuda": "ok", "memory": "ok"}
    assert check_engine_compatible(repo.manifest("tiny_tensorrt_llm"), node)
    # members without an engine have nothing to check
    assert check_engine_compatible(repo.manifest("llama_preprocessing"), NodeFacts()) == []


def test_engine_for_another_gpu_architecture_is_refused(repo):
    l4 = replace(H200_NODE, gpus=(GpuFacts("NVIDIA L4", 23034 * 1024**2, "8.9"),))
    message = _failures(repo.manifest("llama_tensorrt_llm"), l4)
    assert "compute capability 9.0 (NVIDIA H200), node GPU NVIDIA L4 is 8.9" in message


def test_driver_too_old_for_the_engines_cuda_is_refused(repo):
    old = replace(H200_NODE, driver_version="520.61.05", driver_cuda_version="11.8")
    message = _failures(repo.manifest("llama_tensorrt_llm"), old)
    assert "needs CUDA 12.5, driver 520.61.05 supports only CUDA 11.8" in message


def test_other_tensorrt_version_is_refused_and_an_absent_one_is_unknown(repo):
    message = _failures(repo.manifest("llama_tensorrt_llm"), replace(H200_NODE, tensorrt_version="10.1.0"))
    assert "engine built with TensorRT 10.3.0, node has 10.1.0" in message
    findings = check_engine_compatible(repo.manifest("llama_tensorrt_llm"),
                                       replace(H200_NODE, tensorrt_version=None, tensorrt_llm_version=None))
    assert {f.check: f.status for f in findings}["tensorrt_llm"] == "unknown"


def test_memory_plan_that_does_not_fit_the_nodes_gpu_is_refused(repo):
    small = replace(H200_NODE, gpus=(GpuFacts("NVIDIA GeForce RTX 4090", 24564 * 1024**2, "9.0"),))
    message = _failures(repo.manifest("llama_tensorrt_llm"), small)
    assert "memory: does not fit the node's 24.0 GiB GPU" in message and "max_seq_len 65,536" in message


def test_engine_for_more_gpus_than_the_node_has_is_refused(repo):
    assert "built for 2 GPUs (tp × pp), the node has 1" in _failures(repo.manifest("tiny_tensorrt_llm"), H200_NODE)


def test_node_without_gpu_is_refused_for_real_on_this_machine(repo, capsys):
    node = probe_node()
    if node.gpus:
        pytest.skip("this machine has a GPU")
    assert "no GPU visible" in _failures(repo.manifest("llama_tensorrt_llm"), node)
    result = run_cli(capsys, "doctor", "--repo", repo.root, "--json")
    assert result.code == 11
    data = result.json()
    assert not data["ok"] and data["findings"][0]["check"] == "gpu" and "no GPU visible" in result.err


def test_framework_built_for_newer_cuda_than_the_driver_fails_the_node():
    """A PyTorch wheel for CUDA 12 on a driver that supports CUDA 11 silently runs on CPU."""
    node = replace(H200_NODE, driver_cuda_version="11.8", framework_cuda={"torch": "12.4"})
    report = diagnose(node)
    assert not report.ok
    assert "torch (built for CUDA 12.4) needs CUDA 12.4" in report.failures[0].message


def test_doctor_cli_judges_recorded_node_facts_and_names_each_mismatch(repo, tmp_path, capsys):
    facts = tmp_path / "node.json"
    facts.write_text(json.dumps(replace(H200_NODE, gpus=(H200, replace(H200, index=1))).to_dict()))
    ok = run_cli(capsys, "doctor", "--repo", repo.root, "--node-facts", facts)
    assert ok.code == 0 and ok.out.rstrip().endswith("ok")
    assert "[ok] llama_tensorrt_llm/1: compute_capability" in ok.out
    l4 = replace(H200_NODE, gpus=(GpuFacts("NVIDIA L4", 23034 * 1024**2, "8.9"),), driver_cuda_version="12.2")
    facts.write_text(json.dumps(l4.to_dict()))
    bad = run_cli(capsys, "doctor", "--repo", repo.root, "--node-facts", facts, "--json")
    assert bad.code == 11
    failed = {(f["subject"], f["check"]) for f in bad.json()["findings"] if f["status"] == "fail"}
    assert {("llama_tensorrt_llm/1", "compute_capability"), ("llama_tensorrt_llm/1", "driver_cuda"),
            ("llama_tensorrt_llm/1", "memory"), ("tiny_tensorrt_llm/1", "gpu_count")} <= failed
    assert "is 8.9" in bad.err and "supports only CUDA 12.2" in bad.err
    facts.write_text("[1, 2]")
    assert run_cli(capsys, "doctor", "--node-facts", facts).code == 3


def test_node_facts_round_trip_through_doctor_json():
    node = replace(H200_NODE, framework_cuda={"torch": "12.4"})
    assert NodeFacts.from_dict(json.loads(json.dumps(node.to_dict()))) == node


def test_a_cpu_node_without_engines_passes_and_each_failure_is_printed_once(repo, tmp_path, capsys):
    """No GPU is a legitimate CPU node (ONNX, Python, vLLM's CPU build): doctor passes unless an engine needs a
    GPU or --require-gpu says the node must have one. A failure is listed once, not again in the error."""
    cpu = replace(H200_NODE, gpus=(), probe="none (nvidia-smi not found)", driver_version=None,
                  driver_cuda_version=None)
    facts = tmp_path / "cpu.json"
    facts.write_text(json.dumps(cpu.to_dict()))
    empty = tmp_path / "empty"
    empty.mkdir()
    fine = run_cli(capsys, "doctor", "--repo", empty, "--node-facts", facts)
    assert fine.code == 0 and "a CPU node" in fine.out and fine.out.rstrip().endswith("ok"), fine.out + fine.err
    strict = run_cli(capsys, "doctor", "--repo", empty, "--node-facts", facts, "--require-gpu")
    assert strict.code == 11 and "--require-gpu" in strict.out
    engines = run_cli(capsys, "doctor", "--repo", repo.root, "--node-facts", facts)
    assert engines.code == 11
    both = engines.out + engines.err
    assert both.count("no GPU visible (nvidia-smi not found); the engine needs") == 2  # one line per engine
    assert "check(s) failed" in engines.err
