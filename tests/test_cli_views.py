"""The human side of the CLI: help without heavy imports, shell completion, `show`, `list`, `diff`.

Models are published for real (verified on the session's tritonserver) and pushed to a real folder store;
completion runs click's own protocol (`_TRM_COMPLETE=...`) in a subprocess, as a shell does.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx_models as om
import pytest
from helpers import FixedAnswers, run_cli

from repo_manager.adapters.repository import LocalRepository
from repo_manager.ops.inventory import diff_manifests, diff_text, tuning_summary

HEAVY = ("rich", "numpy", "onnx", "onnxruntime", "boto3", "tritonclient", "google.protobuf", "torch", "aiohttp")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                     os.environ.get("PYTHONPATH", "")])}


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={**{k: v for k, v in ENV.items() if not k.startswith("TRM_")}, **env}, timeout=120)


def test_help_of_trm_and_of_every_command_imports_nothing_heavy(tmp_path):
    from repo_manager.cli.commands import COMMANDS

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
    import repo_manager.cli.commands as commands
    from repo_manager.cli import cli

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
    from repo_manager.core.manifest import Manifest, now_iso

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


# ------------------------------------------------------------------------------------ output for people

CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 8
input [{{name: "X" data_type: TYPE_FP32 dims: [4]}}]
output [{{name: "Y" data_type: TYPE_FP32 dims: [2]}}]
instance_group [{{count: 2 kind: KIND_CPU}}]
dynamic_batching {{max_queue_delay_microseconds: 500 preferred_batch_size: [4, 8]}}
parameters {{key: "note" value {{string_value: "{note}"}}}}
'''
TUNING = {"tool": "trm tune-batching", "tuned_from_version": 1, "slo": {"p99_ms": 25.0, "low_rps": 50, "peak_rps": 400,
                                                                    "headroom": 1.2, "overload_factor": 2},
          "chosen": {"key": "b8-i2-d500-q6824", "origin": "overload", "max_batch_size": 8, "instances": 2,
                     "dynamic_batching": True, "max_queue_delay_microseconds": 500, "preferred_batch_size": [4, 8],
                     "queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 6824,
                                      "allow_timeout_override": True, "max_queue_size": 0, "priority_levels": 0}},
          "evidence": {"max_batch_size": "8: the cost per request stops dropping above it"}, "notes": [],
          "points": [{"p99_ms": float("nan")}]}
HF_VERIFICATION = {"passed": True, "samples": 5, "criterion": "cosine >= 0.999",
                   "reference": {"library": "sentence-transformers", "version": "3.0.1",
                                 "call": "SentenceTransformer(path).encode(texts)", "max_length": 256},
                   "cases": [{"case": "sentence", "min_cosine": 0.9999991, "max_length_ratio_diff": 1e-7}]}


def commit_version(root: Path, name: str, *, config: str | None = None, files: dict[str, bytes] | None = None,
                   **records) -> None:
    """A version written through the repository's own stage/commit, with the records trm's writers put in
    manifests (given as keyword arguments: verification, tuning, source, members)."""
    from repo_manager.core.manifest import Manifest, now_iso, scan_files

    repo = LocalRepository(root)
    staging = repo.stage(name)
    for path, data in (files or {"model.py": b"# stand-in\n"}).items():
        (staging / path).write_bytes(data)
    repo.commit(staging, Manifest(name, repo.next_version(name), scan_files(staging),
                                  config or CONFIG.format(name=name, note="plain"), created_at=now_iso(), **records))


def people_project(root: Path) -> Path:
    """A project folder as a user has one: configs/trm.yaml with staging and production in a folder store, a
    repository with a verified model, a tuned version of it, and a Hugging Face ensemble with its members."""
    repo = root / "model_repository"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "trm.yaml").write_text(f"repository: model_repository\nstore: {root / 'store'}\n"
                                               "environments:\n  staging: {}\n  production: {}\n")
    commit_version(repo, "lin", source={"kind": "onnx", "path": "/src/lin.onnx"},
                   verification={"passed": True, "samples": 8, "worst_abs_diff": {"Y": 1.5e-7}, "reference": None})
    commit_version(repo, "lin", source={"kind": "tuning", "from_version": 1}, tuning=TUNING,
                   verification={"passed": True, "method": "trm tune-batching"})
    for member in ("emb_tokenizer", "emb_encoder"):
        commit_version(repo, member, source={"kind": "huggingface", "path": "/ckpt"}, verification={"skipped": True})
    commit_version(repo, "emb", config=ENSEMBLE.replace("model_version: 3", "model_version: 1"),
                   files={}, source={"kind": "huggingface", "path": "/ckpt"}, verification=HF_VERIFICATION,
                   members={"emb_tokenizer": 1, "emb_encoder": 1})
    return repo


PYTHON_VALUES = ("None", "{'", "[(", "(('", "<repo_manager", "Traceback")


def test_every_view_speaks_to_people_no_python_values_and_diff_within_100_columns(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    people_project(tmp_path)
    store = tmp_path / "store"
    commands = [["push", store, "--env", "staging"], ["push", store, "--model", "lin:1", "--env", "production"],
                ["list"], ["list", "--all"], ["show", "lin"], ["show", "lin", "--version", "1"], ["show", "emb"],
                ["diff", "lin", "1", "2"], ["diff", "lin", "1", "2", "--store", store], ["validate"],
                ["history", "staging"], ["history", "production"], ["specs"],
                ["observe", "rules", "--out", tmp_path / "obs"],
                ["observe", "rules", "staging", "--out", tmp_path / "o2"],
                ["promote", "lin", "--from", "staging", "--to", "production", "--dry-run"],
                ["sync", store, "--env", "production", "--repo", tmp_path / "node", "--cache", tmp_path / "cache"],
                ["sync", store, "--env", "staging", "--repo", tmp_path / "node", "--cache", tmp_path / "cache",
                 "--dry-run"],
                ["export", store, tmp_path / "exported", "--env", "staging"]]
    seen = {}
    for args in commands:
        result = run_cli(capsys, *args)
        assert result.code == 0, (args, result.err)
        text = result.out + result.err
        seen[" ".join(map(str, args)).replace(str(tmp_path), "")] = text
        for marker in PYTHON_VALUES:
            assert marker not in text, (args, marker, text)
    assert "environment staging serves emb version 1, emb_encoder version 1, emb_tokenizer version 1, lin version 2" \
        in seen["push /store --env staging"]
    # the ensemble's reference is its library and version, not the mapping that records the call
    emb = run_cli(capsys, "show", "emb", "--json").json()["version_rows"][0]
    assert emb["verification"]["text"] == "yes vs sentence-transformers 3.0.1, cosine >= 0.999999"
    lin = run_cli(capsys, "show", "lin", "--json").json()["version_rows"][1]
    assert lin["tuning"]["text"] == ("p99 25 ms at 50-400 rps: batch 8 x2, delay 500 us, preferred [4, 8], "
                                     "queue timeout 6824 us then reject")
    history = run_cli(capsys, "history", "production").out
    assert "lin is served at version 1 but no promotion recorded it" in history
    for line in run_cli(capsys, "diff", "lin", "1", "2").out.splitlines():
        assert len(line) <= 100, line


def test_list_in_a_project_without_stores_leaves_the_environments_column_out(capsys, tmp_path, monkeypatch):
    """The project's own configs/trm.yaml names staging and production with no store: nothing to show."""
    monkeypatch.chdir(tmp_path)
    people_project(tmp_path)
    (tmp_path / "configs" / "trm.yaml").write_text("repository: model_repository\nstore: null\n"
                                                   "environments:\n  staging: {store: null}\n"
                                                   "  production: {store: null}\n")
    listing = run_cli(capsys, "list")
    assert listing.code == 0, listing.err
    assert "environments" not in listing.out and "note:" not in listing.out and "no store" not in listing.out
    assert "lin" in listing.out and "served" not in run_cli(capsys, "list", "--json").json()["models"][0]
    shown = run_cli(capsys, "show", "lin")
    assert shown.code == 0 and "environments" not in shown.out and "no store" not in shown.out


def test_a_mistyped_command_suggests_the_close_one(capsys):
    for typed, meant in (("lst", "'list'"), ("shwo", "'show'"), ("hisotry", "'history'")):
        result = run_cli(capsys, typed)
        assert result.code == 2 and f"Did you mean {meant}?" in result.err, result.err
    assert "Did you mean" not in run_cli(capsys, "zzzz").err


# ------------------------------------------------------------------------------------ a real terminal

TITLE, CLEAR = "\x1b]0;pwned\x07", "\x1b[2J\x1b[H"
HOSTILE = f"[/ml]{TITLE}[test]{CLEAR}"


def _metrics(model: str) -> bytes:
    labels = f'model="{model}",version="1"'
    lines = [f"nv_inference_request_success{{{labels}}} 10", f"nv_inference_count{{{labels}}} 10",
             f"nv_inference_exec_count{{{labels}}} 5", f"nv_inference_pending_request_count{{{labels}}} 2",
             'nv_inference_request_success{model="trm-verify-0a1b2c3d-lin",version="1"} 4',
             'nv_inference_pending_request_count{model="trm-verify-0a1b2c3d-lin",version="1"} 0']
    return ("\n".join(lines) + "\n").encode()


def _in_tmux(script: Path, lines: list[str]) -> tuple[str, str]:
    """Run ``lines`` in a bash inside a fresh tmux server (200 x 150): the screen at the end, and the pane's
    title (what a window-title escape would change)."""
    import time

    script.write_text("\n".join([*lines, "echo SESSION-DONE", "sleep 120"]) + "\n")
    tmux = ["tmux", "-S", str(script.with_name("tmux.sock")), "-f", "/dev/null"]  # its own server, socket here
    subprocess.run([*tmux, "new-session", "-d", "-x", "200", "-y", "150", "bash", "--norc", str(script)],
                   check=True, env={**{k: v for k, v in ENV.items() if not k.startswith("TRM_")}, "TERM": "xterm"})
    try:
        deadline, screen = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "SESSION-DONE" not in screen:
            time.sleep(0.5)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True).stdout
        title = subprocess.run([*tmux, "display-message", "-p", "#{pane_title}"], capture_output=True,
                               text=True).stdout.strip()
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return screen, title


@pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux, a real terminal to render into")
def test_hostile_names_reach_a_real_terminal_as_text(tmp_path):
    """list, show, diff, top (once and live) in tmux: names with rich markup and escape sequences (a window
    title, a clear screen) in a backend, a tensor, a config parameter, a Triton metric label and an agent's
    /status show as text; the pane keeps its title and its earlier lines; every command exits 0."""
    import json

    repo = tmp_path / "repo"
    hostile_config = (f'name: "lin"\nbackend: "py{HOSTILE}"\nmax_batch_size: 4\n'
                      f'input [{{name: "IN{HOSTILE}" data_type: TYPE_FP32 dims: [2]}}]\n'
                      f'parameters {{key: "k{HOSTILE}" value {{string_value: "v{HOSTILE}"}}}}\n')
    commit_version(repo, "lin", verification={"passed": True, "reference": f"lib{HOSTILE}",
                                              "worst_abs_diff": {f"OUT{HOSTILE}": 1e-6}})
    commit_version(repo, "lin", config=hostile_config.encode("unicode_escape").decode().replace('\\n', '\n'),
                   verification={"passed": True, "reference": f"lib{HOSTILE}"})
    # stand-ins for Triton's /metrics and an agent's /status: trm refuses such names, so a real Triton or
    # agent cannot be given them through trm
    status = {"pod": f"pod{HOSTILE}", "env": "prod", "state": f"s{HOSTILE}", "ready": True,
              "served": {f"lin{HOSTILE}": 1}, "wanted": {},
              "last_rollout": {"outcome": "done", "seconds": 1.5, "reason": HOSTILE}}
    with FixedAnswers({"/metrics": _metrics(f"m{HOSTILE}"), "/status": json.dumps(status).encode()}) as endpoints:
        trm = f"env PYTHONPATH={ENV['PYTHONPATH']} {sys.executable} -m repo_manager"
        top = f"{trm} top {endpoints.url}/metrics --agent {endpoints.url}"
        screen, title = _in_tmux(tmp_path / "session.sh", [
            "echo EARLIER-LINE", f"{trm} list --repo {repo}; echo rc=$?",
            f"{trm} show lin --repo {repo}; echo rc=$?", f"{trm} diff lin 1 2 --repo {repo}; echo rc=$?",
            f"{top} --once --interval 0.2; echo rc=$?",
            f"timeout -s INT --preserve-status 3 {top} --interval 0.3; echo live-rc=$?"])
    assert "SESSION-DONE" in screen, screen
    assert title != "pwned" and "pwned" not in title, title
    assert screen.lstrip().startswith("EARLIER-LINE"), screen  # nothing cleared the screen
    assert screen.count("\nrc=0") == 4 and ("live-rc=0" in screen or "live-rc=130" in screen), screen
    assert "[/ml]" in screen and "[test]" in screen and r"\x1b]0;pwned\x07" in screen, screen
    for shown in ("py[/ml]", "IN[/ml]", "k[/ml]", "m[/ml]", "pod[/ml]", "lib[/ml]"):
        assert shown in screen, (shown, screen)
    assert "trm-verify" not in screen, screen
