"""The human side of the CLI: help without heavy imports, shell completion, `show`, `list`, `diff`.

Models are published for real (verified on the session's tritonserver) and pushed to a real folder store;
completion runs click's own protocol (`_TRM_COMPLETE=...`) in a subprocess, as a shell does.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import onnx_models as om
import pytest
from helpers import run_cli

from repo_manager.inventory import diff_manifests, diff_text, tuning_summary
from repo_manager.repository import LocalRepository

HEAVY = ("rich", "numpy", "onnx", "onnxruntime", "boto3", "tritonclient", "google.protobuf", "torch", "aiohttp")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                     os.environ.get("PYTHONPATH", "")])}


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={**{k: v for k, v in ENV.items() if not k.startswith("TRM_")}, **env}, timeout=120)


def test_help_of_trm_and_of_every_command_imports_nothing_heavy(tmp_path):
    from repo_manager.cli.commands import COMMANDS  # noqa: PLC0415

    code = (
        "import sys\nfrom repo_manager.cli import main\n"
        "for args in " + repr([["--help"], *[[name, "--help"] for name in COMMANDS], ["publish", "model", "--help"]])
        + ":\n    try:\n        main(args)\n    except SystemExit:\n        pass\n"
        "print([m for m in " + repr(HEAVY) + " if m in sys.modules])\n")
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "Commands:" in out.stdout and "diff" in out.stdout and "Show this message and exit" in out.stdout


def test_short_help_table_agrees_with_the_commands():
    import repo_manager.cli.commands as commands  # noqa: PLC0415
    from repo_manager.cli import cli  # noqa: PLC0415

    for module in set(commands.COMMANDS.values()):
        importlib.import_module(f"repo_manager.cli.commands.{module}")
    assert set(commands.SHORT_HELP) == set(commands.COMMANDS)
    for name in commands.COMMANDS:
        assert commands.SHORT_HELP[name] == cli.commands[name].get_short_help_str(limit=10_000), name


def _complete(cwd: Path, words: str, **env: str) -> list[str]:
    """What click answers a bash asking to complete the last word of ``words``."""
    args = words.split(" ")
    out = subprocess.run([sys.executable, "-m", "repo_manager"], capture_output=True, text=True, cwd=cwd,
                         env={**{k: v for k, v in ENV.items() if not k.startswith("TRM_")}, **env,
                              "_TRM_COMPLETE": "bash_complete", "COMP_WORDS": words,
                              "COMP_CWORD": str(len(args) - 1)}, timeout=120)
    assert out.returncode == 0, out.stderr
    return [line.split(",", 1)[1] for line in out.stdout.splitlines() if line]


def test_shell_completion_scripts_commands_models_and_environments(tmp_path):
    for shell, marker in (("bash", "complete -o nosort -F"), ("zsh", "compdef"), ("fish", "complete --no-files")):
        out = subprocess.run([sys.executable, "-m", "repo_manager"], capture_output=True, text=True, cwd=tmp_path,
                             env={**ENV, "_TRM_COMPLETE": f"{shell}_source"}, timeout=120)
        assert out.returncode == 0 and marker in out.stdout and "_TRM_COMPLETE" in out.stdout, (shell, out.stderr)
    assert _complete(tmp_path, "trm sh") == ["show"]
    assert {"promote", "publish", "push"} <= set(_complete(tmp_path, "trm p"))
    for name in ("alpha", "beta"):  # a model folder as trm writes one (a version with a manifest)
        (tmp_path / "repo" / name / "1").mkdir(parents=True)
        (tmp_path / "repo" / name / "config.pbtxt").write_text(f'name: "{name}"\n')
        (tmp_path / "repo" / name / "1" / "trm-manifest.json").write_text("{}")
    assert _complete(tmp_path, "trm show --repo repo ") == ["alpha", "beta"]
    assert _complete(tmp_path, "trm diff b", TRM_REPOSITORY=str(tmp_path / "repo")) == ["beta"]
    assert _complete(tmp_path, "trm diff beta ", TRM_REPOSITORY=str(tmp_path / "repo")) == ["1"]
    # environments: the settings' and those with a pointer in the store
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(f"store: {tmp_path / 'store'}\nenvironments:\n  staging: {{}}\n")
    (tmp_path / "store" / "envs").mkdir(parents=True)
    (tmp_path / "store" / "envs" / "production.json").write_text("{}")
    assert _complete(tmp_path, "trm promote alpha --to ") == ["production", "staging"]
    assert _complete(tmp_path, "trm history pr") == ["production"]
    # a broken settings file completes nothing instead of printing an error into the shell
    (tmp_path / "configs" / "trm.yaml").write_text("store: [")
    assert _complete(tmp_path, "trm promote alpha --to ") == []


@pytest.fixture
def two_versions(capsys, tmp_path, triton):
    """lin 1 and 2 published for real and verified; 2 has 5 outputs, max batch 4 and 2 instances; a folder
    store where production serves 1 and staging 2."""
    repo, store = tmp_path / "repo", tmp_path / "store"
    first = run_cli(capsys, "publish", "model", om.linear(tmp_path / "a.onnx"), "--name", "lin", "--repo", repo,
                    "--url", triton.url)
    assert first.code == 0, first.err
    second = run_cli(capsys, "publish", "model", om.linear(tmp_path / "b.onnx", out_features=5), "--name", "lin",
                     "--repo", repo, "--url", triton.url, "--max-batch-size", "4", "--instances", "2")
    assert second.code == 0, second.err
    assert run_cli(capsys, "push", store, "--repo", repo, "--model", "lin:1", "--env", "production").code == 0
    assert run_cli(capsys, "push", store, "--repo", repo, "--env", "staging").code == 0
    return repo, store


def test_show_list_diff_as_text_and_json(capsys, two_versions, monkeypatch):
    repo, store = two_versions
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("NO_COLOR", "1")
    shown = run_cli(capsys, "show", "lin", "--repo", repo, "--store", store)
    assert shown.code == 0, shown.err
    assert "\x1b[" not in shown.out  # no colour off a terminal
    assert "lin (onnxruntime): 2 version(s)" in shown.out and "yes vs onnxruntime, worst diff" in shown.out
    assert "production" in shown.out and "staging" in shown.out and "2xCPU" in shown.out
    data = run_cli(capsys, "show", "lin", "--repo", repo, "--store", store, "--version", "1", "--json").json()
    assert data["manifest"]["version"] == 1 and data["essentials"]["max_batch_size"] == 8
    assert [(r["version"], r["environments"]) for r in data["version_rows"]] == [(1, ["production"]),
                                                                                  (2, ["staging"])]
    assert data["version_rows"][0]["verification"]["verified"] is True
    assert data["version_rows"][0]["verification"]["reference"] == "onnxruntime"
    assert data["served"] == {"production": 1, "staging": 2}

    listing = run_cli(capsys, "list", "--repo", repo, "--store", store)
    assert listing.code == 0 and "onnxruntime" in listing.out and "production:1, staging:2" in listing.out
    rows = run_cli(capsys, "list", "--repo", repo, "--json").json()["models"]
    assert rows[0]["latest"] == 2 and rows[0]["backend"] == "onnxruntime" and "served" not in rows[0]
    assert rows[0]["verification"]["verified"] and rows[0]["bytes"] > 0
    every = run_cli(capsys, "list", "--repo", repo, "--all", "--store", store, "--json").json()["models"][0]["all"]
    assert [(v["version"], v["environments"]) for v in every] == [(1, ["production"]), (2, ["staging"])]

    diff = run_cli(capsys, "diff", "lin", "1", "2", "--repo", repo)
    assert diff.code == 0
    assert "max_batch_size: 8 -> 4" in diff.out and "output[Y].dims: [3] -> [5]" in diff.out
    assert "instance_group[0].count: 1 -> 2" in diff.out and "~ model.onnx" in diff.out
    in_store = run_cli(capsys, "diff", "lin", "1", "2", "--store", store, "--json").json()
    assert not in_store["identical"]
    assert {"field": "max_batch_size", "a": 8, "b": 4} in in_store["config"]
    assert [f["path"] for f in in_store["files"]["changed"]] == ["model.onnx"]
    same = run_cli(capsys, "diff", "lin", "2", "2", "--repo", repo)
    assert same.code == 0 and "no differences" in same.out
    assert run_cli(capsys, "diff", "lin", "1", "7", "--repo", repo).code == 4

    plan = run_cli(capsys, "promote", "lin", "--to", "production", "--from", "staging", "--store", store,
                   "--dry-run", "--json").json()
    assert plan["plan"]["replaces"] == 1 and plan["diff"]["a"] == 1 and plan["diff"]["b"] == 2
    assert {"field": "max_batch_size", "a": 8, "b": 4} in plan["diff"]["config"]
    text = run_cli(capsys, "promote", "lin", "--to", "production", "--from", "staging", "--store", store,
                   "--dry-run")
    assert "lin: version 1 -> 2" in text.out and "max_batch_size: 8 -> 4" in text.out


def test_diff_reports_tuning_source_and_verification_changes(capsys, tmp_path):
    repo = tmp_path / "repo"
    assert run_cli(capsys, "publish", "model", om.linear(tmp_path / "b.onnx"), "--name", "lin", "--repo", repo,
                   "--no-verify").code == 0
    base = dataclasses.replace(LocalRepository(repo).manifest("lin", 1), version=2,
                               verification={"passed": True, "samples": 4, "worst_abs_diff": {"Y": 1e-7}})
    chosen = {"max_batch_size": 4, "instances": 2, "dynamic_batching": True, "max_queue_delay_microseconds": 500,
              "preferred_batch_size": [4]}
    # the record trm tune-batching writes (its slo and chosen fields), on a copy of a real manifest
    tuned = dataclasses.replace(base, version=3, source={"kind": "tuning", "from_version": 2},
                                tuning={"slo": {"p99_ms": 20.0, "low_rps": 5.0, "peak_rps": 50.0}, "chosen": chosen,
                                        "tuned_from_version": 2},
                                verification={"passed": True, "method": "trm tune-batching"})
    diff = diff_manifests(base, tuned)
    assert not diff["identical"] and diff["files"]["unchanged"] == 1 and not diff["files"]["changed"]
    assert {"field": "chosen.max_queue_delay_microseconds", "a": None, "b": 500} in diff["tuning"]
    assert {"field": "kind", "a": "onnx", "b": "tuning"} in diff["source"]
    text = diff_text(diff)
    assert "tuning:" in text and "verification: yes vs onnxruntime" in text and "(same files, tuned)" in text
    assert tuning_summary(tuned)["text"] == "p99 20 ms at 5-50 rps: batch 4 x2, delay 500 us, preferred [4]"


ENSEMBLE = '''name: "emb"
platform: "ensemble"
max_batch_size: 8
input [{name: "TEXT" data_type: TYPE_STRING dims: [1]}]
output [{name: "EMBEDDING" data_type: TYPE_FP32 dims: [32]}]
ensemble_scheduling { step [
  { model_name: "emb_tokenizer" model_version: -1
    input_map {key: "TEXT" value: "TEXT"} output_map {key: "input_ids" value: "ids"} },
  { model_name: "emb_encoder" model_version: 3
    input_map {key: "input_ids" value: "ids"} output_map {key: "embedding" value: "EMBEDDING"} } ] }
'''


def test_show_of_an_ensemble_lists_its_steps_and_pinned_members(capsys, tmp_path, monkeypatch):
    """An ensemble version written through the repository's own stage/commit (no members installed)."""
    from repo_manager.manifest import Manifest, now_iso  # noqa: PLC0415

    repo = LocalRepository(tmp_path / "repo")
    staging = repo.stage("emb")
    repo.commit(staging, Manifest("emb", 1, (), ENSEMBLE, source={"kind": "huggingface", "path": "/ckpt"},
                                  verification={"passed": True, "samples": 5,
                                                "cases": [{"case": "sentence", "min_cosine": 0.999999}]},
                                  members={"emb_tokenizer": 2, "emb_encoder": 3}, created_at=now_iso()))
    monkeypatch.setenv("COLUMNS", "120")
    shown = run_cli(capsys, "show", "emb", "--repo", repo.root)
    assert shown.code == 0, shown.err
    assert "ensemble steps" in shown.out and "emb_tokenizer   2" in shown.out and "emb_encoder     3" in shown.out
    assert "yes vs PyTorch, cosine >= 0.999999" in shown.out
    assert "instances" not in shown.out and "dynamic batching" not in shown.out
    data = run_cli(capsys, "show", "emb", "--repo", repo.root, "--json").json()
    assert [(s["model"], s["version"]) for s in data["essentials"]["steps"]] == [("emb_tokenizer", 2),
                                                                                ("emb_encoder", 3)]


def test_bare_trm_prints_its_help_and_errors_stay_one_line(capsys, tmp_path):
    bare = run_cli(capsys)
    assert bare.code == 0 and bare.out.startswith("Usage: trm") and "Commands:" in bare.out and not bare.err
    missing = run_cli(capsys, "show", "ghost", "--repo", tmp_path)
    assert missing.code == 4 and missing.err.splitlines()[0].startswith("error: model 'ghost' not found")
    assert len([line for line in missing.err.splitlines() if line.startswith("error:")]) == 1
