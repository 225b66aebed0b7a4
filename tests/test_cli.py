"""The `trm` command line: exit codes, --json, serve/infer on a real tritonserver, error mapping."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx_models as om
import pytest
from helpers import run_cli
from store_helpers import make_version

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.ops.serving import load_version


def test_publish_list_show_validate_json(capsys, tmp_path, triton):
    source = om.linear(tmp_path / "m.onnx")
    repo = tmp_path / "repo"
    result = run_cli(capsys, "publish", "model", source, "--name", "lin", "--repo", repo, "--url", triton.url,
                     "--json")
    assert result.code == 0, result.err
    assert result.json()["version"] == 1
    listing = run_cli(capsys, "--json", "list", "--repo", repo).json()
    assert [(m["model"], m["versions"], m["latest"]) for m in listing["models"]] == [("lin", [1], 1)]
    shown = run_cli(capsys, "show", "lin", "--repo", repo, "--json").json()
    assert shown["config"]["max_batch_size"] == 8 and shown["manifest"]["verification"]["passed"]
    valid = run_cli(capsys, "validate", str(repo), "--json")
    assert valid.code == 0 and valid.json()["ok"] is True


def test_validate_lists_every_problem_and_exits_3(capsys, tmp_path, triton):
    repo = tmp_path / "repo"
    run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin", "--repo", repo,
            "--url", triton.url)
    (repo / "lin" / "1" / "model.onnx").write_bytes(b"tampered")
    (repo / "lin" / "5").mkdir()
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text("max_batch_size: {")
    result = run_cli(capsys, "validate", str(repo), "--json")
    assert result.code == 3
    problems = result.json()["problems"]
    assert any("model.onnx has size" in p for p in problems)
    assert any("lin/5: no manifest" in p for p in problems)
    assert any(p.startswith("broken:") and "not a valid Triton model config" in p for p in problems)


def test_usage_errors_exit_2(capsys):
    assert run_cli(capsys, "publish", "model").code == 2
    assert run_cli(capsys, "no-such-command").code == 2


def test_unknown_model_exits_4(capsys, tmp_path):
    (tmp_path / "repo").mkdir()
    result = run_cli(capsys, "show", "ghost", "--repo", tmp_path / "repo")
    assert result.code == 4 and "ghost" in result.err


def test_server_down_is_a_clear_error(capsys, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin",
                     "--repo", tmp_path / "repo", "--url", f"http://127.0.0.1:{port}")
    assert result.code == 6
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not reachable" in errors[0]
    assert not (tmp_path / "repo" / "lin").exists()


def test_missing_tritonserver_binary(capsys, tmp_path):
    result = run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin",
                     "--repo", tmp_path / "repo")
    assert result.code == 0  # embedded server found (bundled)
    os.environ["TRM_TRITONSERVER"] = str(tmp_path / "nope")
    try:
        result = run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin",
                         "--repo", tmp_path / "repo")
    finally:
        del os.environ["TRM_TRITONSERVER"]
    assert result.code == 6 and "does not exist" in result.err


def test_malformed_settings_file(capsys, tmp_path):
    (tmp_path / "bad.yaml").write_text("repository: [unclosed\n")
    result = run_cli(capsys, "--config", tmp_path / "bad.yaml", "list")
    assert result.code == 3 and "not valid YAML" in result.err
    (tmp_path / "odd.yaml").write_text("colour: blue\n")
    result = run_cli(capsys, "--config", tmp_path / "odd.yaml", "list")
    assert result.code == 3 and "unknown setting" in result.err


def _start_serve(repo, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "repo_manager", "--json", "serve", "--repo", str(repo),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        return proc, None
    decoder = json.JSONDecoder()
    text = line
    while True:
        try:
            return proc, decoder.decode(text)
        except json.JSONDecodeError:
            text += proc.stdout.readline()


def test_serve_answers_then_stops_cleanly_on_sigterm(tmp_path, triton, capsys):
    repo = tmp_path / "repo"
    source = om.linear(tmp_path / "m.onnx", seed=3)
    run_cli(capsys, "publish", "model", source, "--name", "lin", "--repo", repo, "--url", triton.url)
    run_cli(capsys, "publish", "model", source, "--name", "lin", "--repo", repo, "--url", triton.url)
    proc, info = _start_serve(repo)
    try:
        assert info["status"] == "ready" and info["models"] == {"lin": 2}
        with TritonClient(info["endpoints"]["http"]) as client:
            out = client.infer("lin", {"X": np.ones((2, 4), np.float32)})
            assert out["Y"].shape == (2, 3)
            assert client.loaded_versions("lin") == [2]
        result = run_cli(capsys, "infer", "lin", "--input", f"X={_npy(tmp_path)}", "--url",
                         info["endpoints"]["http"], "--json")
        assert result.code == 0 and result.json()["shapes"] == {"Y": [2, 3]}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    with pytest.raises(OSError):  # the server is gone with it
        socket.create_connection(("127.0.0.1", int(info["endpoints"]["http"].rsplit(":", 1)[1])), timeout=1)


def _npy(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.ones((2, 4), np.float32))
    return path


def test_serve_refuses_a_port_in_use(tmp_path, capsys, triton):
    repo = tmp_path / "repo"
    run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin", "--repo", repo,
            "--url", triton.url)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        started = time.monotonic()
        result = run_cli(capsys, "serve", "--repo", repo, "--http-port", port, "--grpc-port", "0",
                         "--metrics-port", "0")
    assert result.code == 6 and f"port {port} is already in use" in result.err
    assert time.monotonic() - started < 30


def test_serve_refuses_a_malformed_config_in_the_repository(tmp_path, capsys, triton):
    repo = tmp_path / "repo"
    run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin", "--repo", repo,
            "--url", triton.url)
    manifest = repo / "lin" / "1" / "trm-manifest.json"
    data = json.loads(manifest.read_text())
    data["config"] = "max_batch_size: {"
    manifest.write_text(json.dumps(data))
    result = run_cli(capsys, "serve", "--repo", repo, "--http-port", "0", "--grpc-port", "0",
                     "--metrics-port", "0")
    assert result.code == 3 and "not a valid Triton model config" in result.err


def test_every_command_module_is_in_the_lazy_table():
    """The lazy command table names exactly the commands the modules define."""
    import importlib
    import pkgutil

    import repo_manager.cli.commands as commands
    from repo_manager.cli import cli

    for module in pkgutil.iter_modules(commands.__path__):
        importlib.import_module(f"repo_manager.cli.commands.{module.name}")
    assert set(cli.commands) == set(commands.COMMANDS)


def test_a_light_command_does_not_import_the_heavy_stack(tmp_path):
    code = ("import sys; from repo_manager.cli import main\n"
            "try:\n    main(['list', '--repo', '.'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'torch', 'transformers', 'matplotlib', 'boto3')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_validate_fix_never_removes_the_staging_folder_of_a_running_publish_or_sync(capsys, tmp_path):
    """A real process holds a staging folder, as a publish or sync does while it writes a version."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from repo_manager.adapters.repository import LocalRepository\n"
        f"staging = LocalRepository({str(tmp_path / 'repo')!r}).stage('m')\n"
        "(staging / 'model.py').write_text('# being written')\n"
        "print(staging, flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    try:
        staging = Path(holder.stdout.readline().strip())
        assert staging.is_dir()
        result = run_cli(capsys, "validate", tmp_path / "repo", "--fix", "--json")
        assert result.code == 3 and "staging" in result.out, result.err  # reported, not removed
        assert staging.is_dir() and (staging / "model.py").read_text() == "# being written", result.out
    finally:
        holder.kill()
        holder.wait()
    result = run_cli(capsys, "validate", tmp_path / "repo", "--fix", "--json")
    assert not staging.exists(), result.out + result.err  # its owner is gone: a leftover, removed


def test_a_non_positive_sync_rate_limit_is_a_usage_error(capsys, tmp_path):
    result = run_cli(capsys, "sync", str(tmp_path / "store"), "--env", "staging", "--repo", tmp_path / "repo",
                     "--limit-rate", "0")
    assert result.code == 2 and "limit-rate" in result.err
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("key, setting, value, words", [
    ("latency", "rate", "fast", "must be a number, 0 or more, not fast"),
    ("latency", "min_p99_delta_ms", -1, "must be a number, 0 or more"),
    ("latency", "requests", 2.5, "must be a whole number"),
    ("llm_latency", "rounds", float("nan"), "must be a whole number"),
    ("llm_latency", "block_inconclusive", 2, "must be 0 or 1"),
    ("llm_latency", "arrivals", "bursty", "must be one of poisson, constant"),
    ("latency", "rate_rps", 3, "unknown gates.latency setting(s) rate_rps"),
])
def test_a_gate_setting_of_the_wrong_kind_is_a_config_error_naming_it(key, setting, value, words):
    from repo_manager.core.environments import gate_settings
    from repo_manager.core.errors import ConfigError
    from repo_manager.core.settings import Settings

    with pytest.raises(ConfigError, match=re.escape(words)):
        gate_settings(Settings(gates={key: {setting: value}}))


def test_gate_settings_are_typed_with_the_configured_values_over_the_defaults():
    from repo_manager.core.environments import LLMLatencyGate, gate_settings
    from repo_manager.core.settings import Settings

    gates = gate_settings(Settings(gates={"default": "checksums", "latency": {"rounds": 2.0, "rate": 7},
                                          "llm_latency": {"block_inconclusive": 1, "arrivals": "constant"}}))
    assert gates.default == "checksums"
    assert (gates.latency.rounds, gates.latency.rate, gates.latency.requests) == (2, 7.0, 200)
    assert isinstance(gates.latency.rounds, int) and isinstance(gates.latency.rate, float)
    assert gates.llm_latency == LLMLatencyGate(block_inconclusive=True, arrivals="constant")
    assert gates.llm_latency.to_dict()["output_tokens"] == 32


ROOT = Path(__file__).resolve().parent.parent


def _table_codes(text: str, heading: str) -> dict[int, list[str]]:
    """The rows of the markdown table under ``heading``: code -> its other cells (a row of codes such as
    ``130, 143, 129`` gives each)."""
    section = text.split(heading, 1)[1]
    rows: dict[int, list[str]] = {}
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for code in cells[0].split(","):
            if code.strip().isdigit():
                rows[int(code)] = cells[1:]
    return rows


def test_every_copy_of_the_exit_code_table_agrees_with_errors_py():
    """errors.EXIT_CODES is the source; the README's table, docs/promotion.md's, docs/rollout.md's classes and
    ci/pipeline.sh's words are checked against it (the pipeline once read 10 and 11 as internal errors)."""
    from repo_manager.core import errors

    codes = set(errors.EXIT_CODES)
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.TrmError)]
    assert {c.exit_code for c in classes} - {1} <= codes
    for code, (name, _) in errors.EXIT_CODES.items():
        if code > 1:
            assert getattr(errors, name).exit_code == code
    readme = _table_codes((ROOT / "README.md").read_text(), "## Exit codes")
    assert set(readme) == codes | set(errors.SIGNAL_EXIT_CODES)
    promotion = _table_codes((ROOT / "docs/promotion.md").read_text(), "## Exit codes")
    assert set(promotion) == codes
    rollout = _table_codes((ROOT / "docs/rollout.md").read_text(), "## Rollback and exit codes")
    for code, cells in rollout.items():
        assert cells[0] in ("-", errors.EXIT_CODES[code][0]), (code, cells)
    script = (ROOT / "ci/pipeline.sh").read_text()
    function = script[script.index("meaning() {"):script.index("\n}\n", script.index("meaning() {")) + 3]
    for code in [*codes, *errors.SIGNAL_EXIT_CODES, 12]:
        said = subprocess.run(["bash", "-c", function + f'meaning {code}'], capture_output=True, text=True,
                              check=True).stdout.strip()
        if code in codes:
            assert said.startswith(errors.EXIT_CODES[code][1]), (code, said)
        elif code in errors.SIGNAL_EXIT_CODES:
            assert said == "interrupted by a signal"
        else:
            assert "internal" not in said


def test_sync_help_does_not_promise_an_embedded_server(capsys):
    """sync starts no server: its --url is the node's own Triton, used by --prune only."""
    result = run_cli(capsys, "sync", "--help")
    assert result.code == 0
    text = " ".join(result.out.split())
    assert "embedded" not in text and "No default: sync starts no server" in text


def _save(tmp_path, name: str, array) -> str:
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    return str(path)


def test_infer_version_loads_that_version_on_the_embedded_server(capsys, tmp_path, triton):
    """`trm infer NAME --version N` without --url loads version N (not only the latest) and answers with it;
    a version that does not exist is exit 4 naming the versions there are, before any server starts."""
    import onnxruntime as ort

    repo = tmp_path / "repo"
    sources = [om.linear(tmp_path / f"m{seed}.onnx", seed=seed) for seed in (1, 2)]
    for source in sources:
        assert run_cli(capsys, "publish", "model", source, "--name", "lin", "--repo", repo, "--url",
                       triton.url).code == 0
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for version, source in zip((1, 2), sources):
        result = run_cli(capsys, "--json", "infer", "lin", "--version", version, "--input",
                         f"X={_save(tmp_path, 'x', x)}", "--repo", repo)
        assert result.code == 0, result.err
        want = ort.InferenceSession(str(source)).run(None, {"X": x})[0]
        np.testing.assert_allclose(np.array(result.json()["outputs"]["Y"]), want, rtol=1e-5, atol=1e-5)
    missing = run_cli(capsys, "infer", "lin", "--version", 7, "--input", f"X={_save(tmp_path, 'x', x)}",
                      "--repo", repo)
    assert missing.code == 4 and "no version 7" in missing.err and "its versions: 1, 2" in missing.err


BAD_INPUTS = [
    ("X", np.ones((2, 4), np.float64), "input X is float64; lin takes FP32", "x.astype(np.float32)"),
    ("X", np.ones(4, np.float32), "without a batch dimension", "x[np.newaxis]"),
    ("X", np.ones((2, 5), np.float32), "has shape [2, 5]; lin takes X FP32 [batch, 4]", "reshape it"),
    ("X", np.ones((9, 4), np.float32), "is a batch of 9; lin takes at most 8", "split it into requests of at most 8"),
    ("Z", np.ones((2, 4), np.float32), "lin has no input 'Z'", "its inputs: X FP32 [batch, 4]"),
]


@pytest.mark.parametrize(("name", "array", "message", "hint"), BAD_INPUTS, ids=["dtype", "no_batch_dim", "shape",
                                                                              "batch_too_large", "unknown_name"])
def test_infer_checks_inputs_against_the_config_before_sending(capsys, tmp_path, triton, name, array, message,
                                                                hint):
    """Each bad request is exit 3 with a hint naming the fix, checked before a server is started (so no
    error can name the address of a temporary server), and the same against a running server."""
    repo = tmp_path / "repo"
    assert run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin", "--repo", repo,
                   "--url", triton.url, "--max-batch-size", 8).code == 0
    path = _save(tmp_path, name, array)
    result = run_cli(capsys, "infer", "lin", "--input", f"{name}={path}", "--repo", repo)
    assert result.code == 3, result.err
    assert message in result.err and "hint: " in result.err and hint in result.err, result.err
    assert "127.0.0.1" not in result.err and "starting an embedded" not in result.err
    with TritonServer(repo) as server, TritonClient(server.url) as client:
        load_version(client, LocalRepository(repo), "lin")
        remote = run_cli(capsys, "infer", "lin", "--input", f"{name}={path}", "--url", server.url)
    assert remote.code == 3 and message in remote.err, remote.err


def test_an_error_from_the_embedded_server_does_not_name_its_address(capsys, tmp_path, triton):
    """What the embedded server refuses reads "the embedded Triton", not an address that is gone by then."""
    from repo_manager.core.errors import ServerError
    from repo_manager.core.settings import Settings
    from repo_manager.ops.serving import embedded_server

    repo = tmp_path / "repo"
    assert run_cli(capsys, "publish", "model", om.linear(tmp_path / "m.onnx"), "--name", "lin", "--repo", repo,
                   "--url", triton.url).code == 0
    seen = []
    with pytest.raises(ServerError) as info, embedded_server(Settings(repository=repo), ["lin"], http_port=0,
                                                             grpc_port=0, metrics_port=0) as served, \
            TritonClient(served.endpoints.http) as client:
        seen.append(served.endpoints.http)
        client.infer("lin", {"X": np.ones((2, 7), np.float32)})  # past every check: Triton refuses it
    url = seen[0]
    assert url not in info.value.message and "the embedded Triton" in info.value.message, info.value.message
    assert "127.0.0.1" not in json.dumps(info.value.to_dict())


# ---------------------------------------------------------------------------------------------- internal errors
def test_an_internal_error_is_still_json_with_json(capsys, tmp_path, monkeypatch):
    """Mock, named as such: a bug cannot be produced for real. Whatever raises, --json prints JSON (exit 1)."""
    import json

    import repo_manager.ops.push

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(repo_manager.ops.push, "push", broken)
    make_version(tmp_path / "src", "base", {"model.py": b"# v1"})
    result = run_cli(capsys, "--json", "push", tmp_path / "store", "--repo", tmp_path / "src")
    assert result.code == 1 and json.loads(result.out)["error"]["kind"] == "internal", result.out
