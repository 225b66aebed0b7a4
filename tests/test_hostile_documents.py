"""Property tests: arbitrary JSON documents, manifests, pointers and history records in a store (and
manifests in a repository) thrown at sync, export, promote, history and validate.

Whatever the document, every command ends with a documented exit code other than 1 (internal error), and
nothing is written outside its targets. A folder store keeps each example fast; the rules under test
(documents.py, manifest.py, paths.py) sit above the backends.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import python_config, tree_digest

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
