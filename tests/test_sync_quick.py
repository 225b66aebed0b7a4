"""The quick path of an unchanged `trm sync` (repo_manager/entry.py, sync/noop.quick, storage/sigv4).

It answers before click, the settings and the store classes are imported, so each of its shortcuts is
checked against the thing it stands in for: the output against the full command's, the settings it
resolves against ``load_settings``, the arguments it parses against click's parser, the paths it spells
against pathlib, and its one HTTP request against a real SeaweedFS and against a socket server that
answers the way other servers may (chunked, kept open, cut short).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_helpers import ROOT, make_version, pseudo_random

from repo_manager import entry
from repo_manager.adapters.storage import sigv4
from repo_manager.core.settings import Settings, load_settings
from repo_manager.ops.sync import cache_dir_for
from repo_manager.ops.sync.noop import absolute

LIGHT_FORBIDDEN = ("click", "dataclasses", "typing", "pathlib", "http.client", "google.protobuf", "boto3",
                   "botocore", "urllib3", "rich", "yaml", "repo_manager.core.settings",
                   "repo_manager.adapters.storage.s3")


def _run(*args: str, module: str = "repo_manager", env: dict[str, str] | None = None, cwd: Path | None = None,
         trace: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, *(["-X", "importtime"] if trace else []), "-m", module, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def _full(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The same command line through the full CLI (click), never the quick path."""
    code = "import sys; from repo_manager.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def _imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_quick_path_prints_what_the_full_command_prints(s3_location, tmp_path):
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    make_version(src, "a", {"model.py": b"# a", "w.bin": pseudo_random(50_000, 1), "sub/x.txt": b"x"})
    make_version(src, "b", {"model.py": b"# b"})
    assert _run("push", s3_location, "--repo", src, "--env", "prod", "--json").returncode == 0
    sync = ("sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache)
    first = _run("-q", *sync, "--json")
    assert first.returncode == 0, first.stderr
    assert not json.loads(first.stdout)["unchanged"]

    quick = _run("-q", *sync, "--json", trace=True)
    assert quick.returncode == 0, quick.stderr
    loaded = _imported(quick.stderr)
    assert not {m for m in loaded if m in LIGHT_FORBIDDEN or m.split(".")[0] in LIGHT_FORBIDDEN}, \
        sorted(m for m in loaded if m.split(".")[0] in LIGHT_FORBIDDEN or m in LIGHT_FORBIDDEN)
    full = _full("-q", *sync, "--json")
    assert full.returncode == 0, full.stderr
    ours, theirs = json.loads(quick.stdout), json.loads(full.stdout)
    assert ours.pop("seconds") >= 0 and theirs.pop("seconds") >= 0
    assert ours == theirs and ours["unchanged"] and ours["remote_reads"] == 1 and ours["files"] == 4
    assert list(json.loads(quick.stdout)) == list(json.loads(full.stdout))  # the same order of keys

    text, full_text = _run(*sync), _full(*sync)
    assert text.returncode == full_text.returncode == 0
    strip = " ".join  # the seconds differ: compare everything else
    assert strip(w for w in text.stdout.split() if not w[0].isdigit()) == \
        strip(w for w in full_text.stdout.split() if not w[0].isdigit())
    assert text.stdout.startswith(f"synced prod from {s3_location}: unchanged; 0 bytes downloaded")

    # a settings file in play: the quick path loads the settings (YAML and all) and still answers alone
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(f"repository: {dst}\ncache_dir: {cache}\n")
    short = ("sync", s3_location, "--env", "prod", "--json")
    with_file = _run(*short, cwd=tmp_path, trace=True)
    assert with_file.returncode == 0, with_file.stderr
    assert "click" not in _imported(with_file.stderr) and json.loads(with_file.stdout)["unchanged"]
    assert json.loads(with_file.stdout)["repository"] == json.loads(_full(*short, cwd=tmp_path).stdout)["repository"]

    # every kind of doubt goes to the full path, which decides as always
    (dst / "a" / "config.pbtxt").write_text("tampered")
    repaired = _run(*sync, "--json", trace=True)
    assert repaired.returncode == 0 and "click" in _imported(repaired.stderr)
    assert not json.loads(repaired.stdout)["unchanged"]
    assert _run(*sync, "--json").returncode == 0
    assert "click" in _imported(_run(*sync, "--json", env={"TRM_CONFIG": str(tmp_path / "missing.yaml")},
                                     trace=True).stderr)
    refused = _run(*sync, "--json", env={"TRM_CONFIG": str(tmp_path / "missing.yaml")})
    assert refused.returncode == 3 and "does not exist" in refused.stderr  # the full path's error, exit code
    no_keys = _run(*sync, "--json", env={"AWS_SECRET_ACCESS_KEY": ""}, trace=True)
    assert "click" in _imported(no_keys.stderr)  # keys elsewhere in the AWS chain: botocore's business


# ---------------------------------------------------------------------------------- settings and arguments
_PATHS = st.sampled_from(["repo", "/srv/models", "./r", "r/", "a//b", "/", ".", "x y", "a/../b", "/t/./m/"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(repo_option=st.none() | _PATHS, repo_env=st.none() | st.just("") | _PATHS,
       cache_option=st.none() | _PATHS, cache_env=st.none() | st.just("") | _PATHS,
       endpoint_option=st.none() | st.sampled_from(["http://127.0.0.1:9000", "https://s3.example.com"]),
       endpoint_env=st.none() | st.just("") | st.sampled_from(["http://10.0.0.1:8333"]))
def test_quick_settings_are_load_settings(tmp_path, repo_option, repo_env, cache_option, cache_env,
                                          endpoint_option, endpoint_env):
    environ = {name: value for name, value in (("TRM_REPOSITORY", repo_env), ("TRM_CACHE_DIR", cache_env),
                                               ("TRM_S3_ENDPOINT_URL", endpoint_env)) if value is not None}
    options = {"repository": repo_option, "cache_dir": cache_option, "s3_endpoint_url": endpoint_option}
    resolved = entry.resolve(options, environ, cwd_has_config=False)
    loaded = load_settings(None, environ).replace(**options)
    if resolved is None:  # only where pathlib and a normalised spelling may name different folders
        assert ".." in str(loaded.repository).split("/") or ".." in str(loaded.cache_dir or "").split("/")
        return
    repository, cache, endpoint = resolved
    assert repository == str(loaded.repository)
    assert cache == str(cache_dir_for(loaded))
    assert endpoint == loaded.s3_endpoint_url


_TOKENS = st.sampled_from(["--env", "--env=prod", "prod", "--repo", "r", "--repo=r=2", "--cache", "c", "--model",
                           "m", "--model=n", "--endpoint-url", "http://h:1", "--json", "-q", "--prune", "--dry-run",
                           "s3://b/p", "s3://b", "--", "-x", "", "--url", "http://t:8000", "--limit-rate", "5"])


@settings(max_examples=400, deadline=None)
@given(before=st.lists(st.sampled_from(["-q", "--quiet", "--json", "-v"]), max_size=2),
       after=st.lists(_TOKENS, max_size=10))
def test_quick_arguments_are_clicks(before, after):
    from repo_manager.cli import Context, cli
    from repo_manager.cli.commands.store import sync_command

    parsed = entry.parse_sync([*before, "sync", *after])
    if parsed is None:
        return
    assert set(before) <= {"-q", "--quiet", "--json"}
    context = sync_command.make_context("sync", list(after), obj=Context(Settings()))
    params = context.params
    assert (parsed["store"], parsed["env"], parsed["models"]) == (params["store"], params["env"], params["models"])
    for name in ("repository", "cache_dir", "s3_endpoint_url"):
        assert parsed.get(name) == params[name], name
    assert not params["prune"] and not params["dry_run"] and params["triton_url"] is None
    assert parsed["json"] == ("--json" in before or "--json" in after)
    group = cli.make_context("trm", [*before, "sync", *after], resilient_parsing=True).params
    assert (parsed["quiet"], parsed["json"] and "--json" in before) == (group["quiet"], group["json_output"])


def test_the_quick_path_and_click_declare_one_table_of_names():
    """`trm sync`'s options and trm's flags the quick path parses are declared to click from the same table
    (``core/defaults.py``), and its defaults are the settings' own."""
    from repo_manager.cli import cli
    from repo_manager.cli.commands.store import sync_command
    from repo_manager.core import defaults, settings

    declared = {param.name: tuple(param.opts) for param in sync_command.params}
    assert {name: declared[name] for name in defaults.SYNC_OPTIONS} == \
        {name: (option,) for name, option in defaults.SYNC_OPTIONS.items()}
    flags = {param.name: tuple(param.opts) for param in cli.params}
    assert (flags["quiet"], flags["json_output"]) == (defaults.FLAGS["quiet"], defaults.FLAGS["json"])
    assert set(defaults.SYNC_SETTINGS) <= set(defaults.SYNC_OPTIONS) and \
        set(defaults.SYNC_SETTINGS) <= {f.name for f in dataclasses.fields(Settings)}
    assert (Settings().repository, settings.DEFAULT_CONFIG) == (Path(defaults.REPOSITORY), Path(defaults.CONFIG_FILE))


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "x y", "é"]), min_size=1, max_size=6),
       st.booleans())
def test_absolute_is_pathlibs(parts, rooted):
    text = ("/" if rooted else "") + "/".join(parts)
    if not text:
        return
    assert absolute(text) == str(Path(text).absolute())


# ---------------------------------------------------------------------------------- the one HTTP request
class _OneAnswer:
    """A socket server that answers each connection with ``raw`` (then, unless ``close``, keeps it open)."""

    def __init__(self, raw: bytes, close: bool = True) -> None:
        self.raw, self.close = raw, close
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/bucket/key"
        self.kept: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            connection.recv(65536)
            connection.sendall(self.raw)
            if self.close:
                connection.close()
            else:
                self.kept.append(connection)

    def stop(self) -> None:
        self.server.close()
        for connection in self.kept:
            connection.close()


@pytest.mark.parametrize(("raw", "close", "expected"), [
    (b"HTTP/1.1 304 Not Modified\r\nETag: \"t\"\r\n\r\n", False, (304, b"")),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", False, (200, b"hello")),
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\n<Code>N</", True, (404, b"<Code>N</")),
    # not the plainest answer: refused, and the quick path leaves the read to the full path
    (b"HTTP/1.0 200 OK\r\n\r\nuntil the end", True, OSError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", True, OSError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", True, OSError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", True, OSError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", True, OSError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", True, OSError),
    (b"SSH-2.0-OpenSSH\r\n\r\n", True, OSError),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", True, OSError),
    (b"", True, OSError),
])
def test_signed_get_answers_or_refuses(raw, close, expected):
    server = _OneAnswer(raw, close=close)
    try:
        if expected is OSError:
            with pytest.raises(OSError):
                sigv4.signed_get(server.url, {}, timeout=5)
        else:
            response = sigv4.signed_get(server.url, {}, timeout=5)
            assert (response.status, response.body) == expected
    finally:
        server.stop()


def test_signed_get_refuses_an_endless_answer(monkeypatch):
    monkeypatch.setattr(sigv4, "MAX_RESPONSE", 10_000)
    server = _OneAnswer(b"HTTP/1.1 200 OK\r\nContent-Length: 20000\r\n\r\n" + b"x" * 20000)
    try:
        with pytest.raises(OSError, match="longer than"):
            sigv4.signed_get(server.url, {}, timeout=5)
    finally:
        server.stop()


def test_a_record_in_the_shared_cache_is_believed_about_nothing_outside_the_repository(s3_location, tmp_path):
    """The record lives in the node cache, which every pod of the node can write: one that names a file
    outside the repository is not believed (the full command plans and decides)."""
    src, dst, cache = tmp_path / "src", tmp_path / "dst", tmp_path / "cache"
    make_version(src, "a", {"model.py": b"# a"})
    assert _run("push", s3_location, "--repo", src, "--env", "prod", "--json").returncode == 0
    sync = ("-q", "sync", s3_location, "--env", "prod", "--repo", dst, "--cache", cache, "--json")
    assert _run(*sync).returncode == 0
    assert json.loads(_run(*sync).stdout)["remote_reads"] == 1  # the quick path believes its own record
    (record,) = (cache / "state").rglob("*.json")
    state = json.loads(record.read_text())
    (tmp_path / "outside").write_bytes(b"0123")
    state["models"]["a"]["files"].append(["../../../outside", 4])
    record.write_text(json.dumps(state))
    again = _run(*sync)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["remote_reads"] > 1  # not the quick path: the full plan read the manifest
