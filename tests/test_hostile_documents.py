"""Property tests: arbitrary JSON documents, manifests, pointers and history records in a store (and
manifests in a repository) thrown at sync, export, promote, history and validate.

Whatever the document, every command ends with a documented exit code other than 1 (internal error), and
nothing is written outside its targets. A folder store keeps each example fast; the rules under test
(documents.py, manifest.py, paths.py) sit above the backends. At the end, hand-made documents no generator
is likely to find: nested twenty million deep, a petabyte file, more bytes than the disk holds, malformed data
files, text a terminal would obey.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest
from helpers import FixedAnswers, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import make_version, pushed_store, python_config, tree_digest

from repo_manager.adapters.storage import open_store

DOCUMENTED = {0, 2, 3, 4, 5, 6, 7, 8, 9}
BLOB = b"abc"
DIGEST = hashlib.sha256(BLOB).hexdigest()
TARGETS = {"store", "repo", "cache", "dest", "outside"}
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# text with what hurts most: lone surrogates (valid JSON escapes Python cannot encode), terminal escapes,
# separators and dots
nasty = st.lists(st.sampled_from(["a", "\ud800", "\x1b[2J", "\n", "/", ".", "\\", "é", "\x00", " "]),
                 max_size=6).map("".join)
scalars = (st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
           | st.floats(allow_nan=False) | st.text(max_size=20) | nasty)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
paths = st.sampled_from(["x.txt", "a/b.bin", "../up", "/abs", "a\nb", "a\\b", "./x", "a//b", "trm-manifest.json",
                         "é.txt", "x" * 300, "a/", "", "\x00"]) | st.text(max_size=12) | nasty
sizes = st.sampled_from([3, 0, -1, 2 ** 50, 2 ** 63, 3.0, True]) | st.integers()
digests = st.sampled_from([DIGEST, "0" * 64, DIGEST.upper(), "zz"]) | st.text(max_size=4)
configs = st.sampled_from([python_config("m"), python_config("other"), "not { a config", 'name: "m"\n' * 3,
                           "input [" * 200, ""]) | st.text(max_size=40) | nasty
files = st.lists(st.fixed_dictionaries({"path": paths | json_values, "size": sizes | json_values,
                                        "sha256": digests | json_values}), max_size=3)


def _maybe(strategy, good):
    """Mostly the good value, sometimes anything: keeps examples close enough to valid to go deep."""
    return st.one_of(st.just(good), st.just(good), strategy)


manifests = st.fixed_dictionaries({
    "schema": _maybe(json_values, "trm.manifest/1"),
    "model": _maybe(json_values | nasty | st.sampled_from(["M", "../m", "m/x", "m\n"]), "m"),
    "version": _maybe(json_values | st.sampled_from([0, 2, 2 ** 64, "1"]), 1),
    "files": _maybe(files | json_values, [{"path": "x.txt", "size": 3, "sha256": DIGEST}]),
    "config": _maybe(configs | json_values, python_config("m")),
}, optional={"members": json_values | st.dictionaries(st.sampled_from(["m", "n", "../x", "M"]),
                                                      st.integers(min_value=-1, max_value=3), max_size=2),
             "source": json_values, "tuning": json_values, "created_at": json_values})
pointers = st.fixed_dictionaries({
    "schema": _maybe(json_values, "trm.env/1"),
    "env": _maybe(json_values, "prod"),
    "models": _maybe(json_values | st.dictionaries(st.text(max_size=6) | st.sampled_from(["m", "M", "..", "a/b"]),
                                                   json_values | st.integers(min_value=-1, max_value=3),
                                                   max_size=3), {"m": 1}),
})
records = st.fixed_dictionaries({
    "schema": _maybe(json_values, "trm.history/1"),
    "env": _maybe(json_values, "prod"), "model": _maybe(json_values, "m"),
    "action": _maybe(json_values, "promote"),
    "from_version": _maybe(json_values, None), "to_version": _maybe(json_values, 1),
    "store": _maybe(json_values, "s"),
}, optional={"gates": json_values, "pipeline": json_values, "id": json_values, "at": json_values,
             "unknown": json_values})


def _payload(document, raw: bytes | None) -> bytes:
    return raw if raw is not None else json.dumps(document).encode()


def _layout(root: Path, manifest: bytes, pointer: bytes | None = None, record: bytes | None = None) -> None:
    store = root / "store"
    (store / "blobs" / "sha256").mkdir(parents=True)
    (store / "blobs" / "sha256" / DIGEST).write_bytes(BLOB)
    (store / "models" / "m" / "versions").mkdir(parents=True)
    (store / "models" / "m" / "versions" / "1.json").write_bytes(manifest)
    revs = store / "envs" / "prod.json.revs"
    revs.mkdir(parents=True)
    (revs / "000000000001.json").write_bytes(pointer or b'{"schema": "trm.env/1", "env": "prod", "models": {"m": 1}}')
    if record is not None:
        (store / "history" / "prod").mkdir(parents=True)
        (store / "history" / "prod" / "00000000000000000001-abc.json").write_bytes(record)
    (root / "outside").mkdir()
    (root / "outside" / "keep").write_text("keep")


def _check(capsys, root: Path, *commands: list) -> None:
    before = tree_digest(root / "outside")
    for args in commands:
        result = run_cli(capsys, *args)
        assert result.code in DOCUMENTED, (args, result.code, result.err)
        assert "internal error" not in result.err, (args, result.err)
    assert {p.name for p in root.iterdir()} <= TARGETS, sorted(p.name for p in root.iterdir())
    assert tree_digest(root / "outside") == before


def _store_commands(root: Path) -> list[list]:
    store = root / "store"
    return [["sync", store, "--env", "prod", "--repo", root / "repo", "--cache", root / "cache", "--json"],
            ["export", store, root / "dest", "--json"],
            ["promote", "m", "--from", "prod", "--to", "live", "--create-env", "--store", store,
             "--gates", "checksums", "--json"],
            ["history", "prod", "--store", store, "--json"],
            ["validate", root / "repo", "--json"]]


@PROPERTY
@given(manifest=manifests, raw=st.none() | st.binary(max_size=40))
def test_any_manifest_in_a_store_is_refused_or_used_never_an_internal_error(capsys, manifest, raw):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        _layout(root, _payload(manifest, raw))
        _check(capsys, root, *_store_commands(root))


@PROPERTY
@given(pointer=pointers, record=records)
def test_any_pointer_or_history_record_is_refused_or_used_never_an_internal_error(capsys, pointer, record):
    good = {"schema": "trm.manifest/1", "model": "m", "version": 1, "config": python_config("m"),
            "files": [{"path": "x.txt", "size": 3, "sha256": DIGEST}]}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        _layout(root, json.dumps(good).encode(), json.dumps(pointer).encode(), json.dumps(record).encode())
        store = root / "store"
        _check(capsys, root, *_store_commands(root),
               ["promote", "m", "--rollback", "--to", "prod", "--store", store, "--json"])


@PROPERTY
@given(manifest=manifests, raw=st.none() | st.binary(max_size=40))
def test_any_manifest_in_a_repository_is_reported_by_validate(capsys, manifest, raw):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        version = root / "repo" / "m" / "1"
        version.mkdir(parents=True)
        (version / "x.txt").write_bytes(BLOB)
        (version / "trm-manifest.json").write_bytes(_payload(manifest, raw))
        (root / "repo" / "m" / "config.pbtxt").write_text(python_config("m"))
        (root / "outside").mkdir()
        _check(capsys, root, ["validate", root / "repo", "--json"], ["validate", root / "repo", "--fix"],
               ["list", "--repo", root / "repo", "--json"], ["show", "m", "--repo", root / "repo", "--json"])


# ------------------------------------------------------------------------------------ every reader, every record
# The records the views and the alert rules read (verification, tuning, source), the config's names and an
# agent's /status: arbitrary JSON, and near-valid records whose values have the wrong type or are not finite.

numbers = st.floats(allow_nan=True, allow_infinity=True) | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
odd = numbers | st.none() | st.booleans() | nasty | st.lists(st.integers(), max_size=2) | st.just({})
markup = st.sampled_from(["python", "[/ml]", "[test]", "[bold]x", "\x1b]0;title\x07", "\x1b[2J", "a\x1b[31mb",
                          ":smile:", "\ud800", "x" * 200]) | nasty
names = markup.filter(lambda text: "\ud800" not in text)
"""Names in a config (backend, tensor, parameter): protobuf strings are UTF-8, so no lone surrogates."""
verifications = json_values | st.fixed_dictionaries({}, optional={
    "passed": _maybe(odd, True), "skipped": odd, "reason": odd, "samples": odd,
    "reference": odd | st.fixed_dictionaries({}, optional={"library": odd, "version": odd, "call": odd}),
    "worst_abs_diff": odd | st.dictionaries(markup, odd, max_size=2),
    "cases": odd | st.lists(json_values | st.fixed_dictionaries({}, optional={"case": odd, "min_cosine": odd}),
                            max_size=2)})
tunings = json_values | st.fixed_dictionaries({}, optional={
    "slo": odd | st.fixed_dictionaries({}, optional={"p99_ms": odd, "low_rps": odd, "peak_rps": odd}),
    "chosen": odd | st.fixed_dictionaries({}, optional={
        "max_batch_size": odd, "instances": odd, "dynamic_batching": odd, "max_queue_delay_microseconds": odd,
        "preferred_batch_size": odd | st.lists(odd, max_size=2),
        "queue_policy": odd | st.fixed_dictionaries({}, optional={"default_timeout_microseconds": odd,
                                                                   "max_queue_size": odd})}),
    "tuned_from_version": odd, "evidence": odd | st.dictionaries(markup, odd, max_size=2)})
records_of_a_version = st.fixed_dictionaries({}, optional={
    "verification": verifications, "tuning": tunings, "created_at": odd,
    "source": json_values | st.fixed_dictionaries({}, optional={"kind": odd | markup, "path": odd | markup,
                                                                "from_version": odd})})


def _config(backend: str, tensor: str, parameter: str) -> str:
    from repo_manager.core import config as cfg

    config = cfg.parse_config('name: "m"\nmax_batch_size: 4\n')
    config.backend = backend
    config.input.add(name=tensor, data_type=cfg.mc.TYPE_FP32, dims=[2])
    config.output.add(name=f"out{tensor}", data_type=cfg.mc.TYPE_FP32, dims=[2])
    config.parameters[parameter].string_value = parameter
    return cfg.config_to_text(config)


def _reader_layout(root: Path, first: dict, second: dict, config: str) -> None:
    """Versions 1 and 2 of m, with these records, in a repository and in a folder store where prod serves 2."""
    base = {"schema": "trm.manifest/1", "model": "m", "config": config,
            "files": [{"path": "x.txt", "size": 3, "sha256": DIGEST}]}
    store = root / "store"
    (store / "blobs" / "sha256").mkdir(parents=True)
    (store / "blobs" / "sha256" / DIGEST).write_bytes(BLOB)
    (store / "models" / "m" / "versions").mkdir(parents=True)
    (store / "envs" / "prod.json.revs").mkdir(parents=True)
    (store / "envs" / "prod.json.revs" / "000000000001.json").write_text(
        json.dumps({"schema": "trm.env/1", "env": "prod", "models": {"m": 2}}))
    for version, records in ((1, first), (2, second)):
        payload = json.dumps({**base, **records, "version": version}).encode()
        (store / "models" / "m" / "versions" / f"{version}.json").write_bytes(payload)
        folder = root / "repo" / "m" / str(version)
        folder.mkdir(parents=True)
        (folder / "x.txt").write_bytes(BLOB)
        (folder / "trm-manifest.json").write_bytes(payload)
    (root / "repo" / "m" / "config.pbtxt").write_text(config)
    (root / "outside").mkdir()


def _reader_commands(root: Path) -> list[list]:
    repo, store = root / "repo", root / "store"
    text = [["list", "--repo", repo], ["list", "--repo", repo, "--all", "--store", store],
            ["show", "m", "--repo", repo],
            ["show", "m", "--repo", repo, "--version", "1"], ["diff", "m", "1", "2", "--repo", repo],
            ["diff", "m", "1", "2", "--store", store], ["observe", "rules", "--repo", repo, "--out", root / "dest"],
            ["observe", "rules", "prod", "--store", store, "--out", root / "dest"]]
    return text + [[*args, "--json"] for args in text]


@settings(PROPERTY, max_examples=60)
@given(first=records_of_a_version, second=records_of_a_version, backend=names, tensor=names, parameter=names)
def test_every_reader_of_versions_is_total_over_any_record(capsys, first, second, backend, tensor, parameter):
    """list, show, diff (repository and store) and observe rules: a documented exit code, one error line at
    most, no traceback, and nothing the terminal would read as an escape sequence."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        _reader_layout(root, first, second, _config(backend, tensor, parameter))
        for args in _reader_commands(root):
            result = run_cli(capsys, *args)
            assert result.code in DOCUMENTED, (args, result.code, result.err)
            assert "internal error" not in result.err and "Traceback" not in result.err, (args, result.err)
            assert "\x1b" not in result.out + result.err, (args, result.out, result.err)
            assert len([line for line in result.err.splitlines() if line.startswith("error:")]) <= 1
            if args[0] == "list" or args[0] in ("show", "diff") and result.code != 7:
                # a record of the wrong type is shown as such; only a manifest trm refuses outright stops a
                # view of that version (exit 7), never the listing of the others
                assert result.code == 0, (args, result.err)


def test_observe_rules_refuses_an_slo_that_would_never_or_always_fire(capsys, tmp_path):
    for slo in ("NaN", "Infinity", "-Infinity", "-5", "0", '"25"', "[25]", "null"):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        manifest = {"tuning": {"slo": {"p99_ms": 1}}}
        _reader_layout(root, manifest, manifest, _config("python", "X", "k"))
        path = root / "store" / "models" / "m" / "versions" / "2.json"
        path.write_text(path.read_text().replace('"p99_ms": 1', f'"p99_ms": {slo}'))
        result = run_cli(capsys, "observe", "rules", "prod", "--store", root / "store", "--out", root / "dest")
        if slo == "null":  # no SLO recorded: no latency alert, said so
            assert result.code == 0 and "no p99 SLO" in result.out, result.err
            continue
        assert result.code == 7, (slo, result.out, result.err)
        assert result.err.splitlines()[0] == ("error: manifest of m/2: tuning.slo.p99_ms is not a positive finite "
                                              "number"), result.err
        assert not (root / "dest").exists()


statuses = json_values | st.fixed_dictionaries({}, optional={
    "pod": odd | markup, "env": odd | markup, "state": odd | markup, "ready": odd, "reason": odd | markup,
    "served": odd | st.dictionaries(markup, odd, max_size=2), "wanted": odd | st.dictionaries(markup, odd, max_size=2),
    "pointer": odd | st.fixed_dictionaries({}, optional={"age_s": odd}),
    "last_rollout": odd | st.fixed_dictionaries({}, optional={"outcome": odd | markup, "seconds": odd,
                                                               "reason": odd | markup})})


@PROPERTY
@given(status=statuses, raw=st.none() | st.binary(max_size=40))
def test_top_reads_any_agent_status_without_an_internal_error(capsys, status, raw):
    """A stand-in answers /status: a real agent only ever answers documents of the right shape."""
    with FixedAnswers({"/status": raw if raw is not None else json.dumps(status).encode()}) as server:
        for args in (["top", "--agent", server.url, "--once"], ["top", "--agent", server.url, "--json"]):
            result = run_cli(capsys, *args)
            assert result.code in (0, 6), (args, result.code, result.err)
            assert "internal error" not in result.err and "Traceback" not in result.err, result.err
            assert "\x1b" not in result.out + result.err, (result.out, result.err)


label_values = markup | st.sampled_from(['a\\"b', "a\\\\", "trm-verify-0a1b2c3d-m", ""])
metric_lines = st.builds(
    lambda name, model, version, value: f'{name}{{model="{model}",version="{version}"}} {value}',
    st.sampled_from(["nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                     "nv_inference_queue_duration_us", "nv_inference_pending_request_count",
                     "nv_inference_request_failure", "nv_inference_request_summary_us", "other"]),
    label_values, label_values | st.sampled_from(["1", "-1", ""]),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e308", "-1", "0", "x", "3"]) | st.floats().map(repr)) | nasty


@PROPERTY
@given(before=st.lists(metric_lines, max_size=8), after=st.lists(metric_lines, max_size=8))
def test_top_renders_any_metrics_text_as_printable_rows(before, after):
    """Whatever a /metrics endpoint answers: rows with finite figures or none, JSON without NaN/Infinity, and
    text without escape sequences."""
    from repo_manager.ops.observe.top import Scrape, Server, View, between, parse_metrics, render

    server = Server("http://h:8002/metrics")
    rows = between(Scrape(server, 0.0, *parse_metrics("\n".join(before))),
                   Scrape(server, 1.0, *parse_metrics("\n".join(after))))
    view = View(tuple(rows), 1.0, ())
    json.dumps(view.to_dict(), allow_nan=False)
    text = render(view)
    assert "\x1b" not in text and "\x07" not in text
    assert not any(r.model.startswith("trm-verify-") for r in rows)


# ------------------------------------------------------------------------ hand-made documents, one case each
def _put_raw(store: str, key: str, payload: bytes) -> None:
    path = Path(store) / key
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.chmod(0o644)
    path.write_bytes(payload)


def test_a_manifest_nested_twenty_million_deep_is_refused_not_a_recursion_error(capsys, tmp_path):
    store = pushed_store(tmp_path)
    _put_raw(store, "models/base/versions/1.json", b"[" * 20_000_000)
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 7, result.err
    assert "internal error" not in result.err


def test_a_pointer_nested_deep_or_oversized_is_refused(capsys, tmp_path):
    store = pushed_store(tmp_path)
    revs = sorted((Path(store) / "envs" / "prod.json.revs").iterdir())
    for payload in (b'{"schema": "trm.env/1", "models": ' + b"[" * 500_000, b" " * (2 * 1024 * 1024)):
        revs[-1].chmod(0o644)
        revs[-1].write_bytes(payload)
        result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache",
                         tmp_path / "c")
        assert result.code == 7, result.err


def test_a_manifest_claiming_a_petabyte_file_is_refused_before_any_allocation(capsys, tmp_path):
    store = pushed_store(tmp_path)
    manifest = open_store(store).get_manifest("base", 1).to_dict()
    manifest["files"][0]["size"] = 2 ** 50
    _put_raw(store, "models/base/versions/1.json", __import__("json").dumps(manifest).encode())
    for args in (["sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"],
                 ["export", store, tmp_path / "out"]):
        result = run_cli(capsys, *args)
        assert result.code == 7, result.err
        assert "invalid size" in result.err
    assert not (tmp_path / "c" / "partial").exists() or not list((tmp_path / "c" / "partial").iterdir())


def test_a_manifest_claiming_more_than_the_disk_holds_is_refused_before_downloading(capsys, tmp_path):
    import json

    store = pushed_store(tmp_path)
    manifest = open_store(store).get_manifest("base", 1).to_dict()
    manifest["files"][0]["size"] = 4 * 1024 ** 4  # within S3's limit, beyond this test disk
    _put_raw(store, "models/base/versions/1.json", json.dumps(manifest).encode())
    for args in (["sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c"],
                 ["export", store, tmp_path / "out"]):
        result = run_cli(capsys, *args)
        assert result.code == 3 and "free" in result.err, result.err
    assert not list((tmp_path / "c" / "partial").iterdir())


@pytest.mark.parametrize("data", ['"QUJDé"', "[]", '""', "0", '{"warmup/x": 5}', '{"warmup/x": "!!"}'])
def test_a_manifest_with_malformed_data_files_is_refused_as_corrupt(capsys, tmp_path, data):
    import json

    store = pushed_store(tmp_path)
    [manifest] = list((Path(store) / "models" / "base").rglob("1.json"))
    document = json.loads(manifest.read_text())
    document["data"] = json.loads(data) if data != '"QUJDé"' else {"warmup/input0.raw": "QUJDé"}
    manifest.write_text(json.dumps(document))
    result = run_cli(capsys, "sync", store, "--env", "prod", "--repo", tmp_path / "r", "--cache", tmp_path / "c")
    assert result.code == 7 and "data" in result.err, result.err


def test_text_from_hostile_content_is_printed_safely(capsys, tmp_path):
    """A lone surrogate (a valid JSON escape Python cannot encode) and a terminal escape in a manifest's
    config reach validate's report: printed as escapes, never an internal error."""
    import json

    repo = tmp_path / "repo"
    make_version(repo, "m", {"x.txt": b"abc"})
    path = repo / "m" / "1" / "trm-manifest.json"
    data = json.loads(path.read_bytes())
    data["config"] = "\ud800\x1b[2J name"
    path.chmod(0o644)
    path.write_text(json.dumps(data))
    result = run_cli(capsys, "validate", repo)
    assert result.code == 3, result.err
    assert "\\ud800" in result.out and "\x1b" not in result.out
