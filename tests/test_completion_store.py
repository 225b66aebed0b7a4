"""Environment-name completion asks the store, but never makes the shell wait on it: a store endpoint that
accepts connections and never answers completes the settings' names within COMPLETION_STORE_TIMEOUT_S, and a
real S3 store (SeaweedFS) still completes its environments. Completion runs click's own protocol
(`_TRM_COMPLETE=bash_complete`) in a subprocess, as a shell does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from seaweed import BUCKET

ROOT = Path(__file__).parents[1]
WORDS = "trm promote alpha --to "


def _complete(cwd: Path, env: dict[str, str], timeout: float) -> list[str]:
    """What click answers a bash completing the last word of WORDS."""
    out = subprocess.run([sys.executable, "-m", "repo_manager"], capture_output=True, text=True, cwd=cwd,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith(("TRM_", "AWS_"))},
                              **env, "PYTHONPATH": str(ROOT), "_TRM_COMPLETE": "bash_complete",
                              "COMP_WORDS": WORDS, "COMP_CWORD": str(len(WORDS.split(" ")) - 1)},
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # nothing printed into the user's shell
    return [line.split(",", 1)[1] for line in out.stdout.splitlines() if line]


@pytest.fixture
def silent_endpoint() -> Iterator[tuple[str, list[socket.socket]]]:
    """A real loopback socket that accepts every connection and never answers (held until the test ends)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # so that the accepting thread sees the end of the test
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", held
    finally:
        done.set()
        thread.join(5)
        server.close()
        for connection in held:
            connection.close()


def test_a_store_that_never_answers_completes_the_settings_names_without_waiting(tmp_path, silent_endpoint):
    """It waited 241 s (boto3's 60 s reads, retried). The bound asserted is the subprocess timeout, far
    above the ~2 s it takes and far below the old wait: the answer is the settings' names."""
    endpoint, held = silent_endpoint
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(
        f"store: s3://bucket/prefix\ns3_endpoint_url: {endpoint}\nenvironments:\n  staging: {{}}\n")
    names = _complete(tmp_path, {"AWS_ACCESS_KEY_ID": "completion", "AWS_SECRET_ACCESS_KEY": "test-only",
                                    "AWS_DEFAULT_REGION": "us-east-1"}, timeout=30)
    assert names == ["staging"]
    assert held, "the completion never reached the store endpoint"


def test_a_real_s3_store_still_completes_its_environments(tmp_path, s3_env, s3_location):
    prefix = s3_location.removeprefix(f"s3://{BUCKET}/")
    boto3.client("s3", endpoint_url=s3_env.endpoint).put_object(Bucket=BUCKET, Key=f"{prefix}/envs/production.json",
                                                                Body=b"{}")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "trm.yaml").write_text(f"store: {s3_location}\nenvironments:\n  staging: {{}}\n")
    # the store's answer within 30 s (the 1 s default bounds a store that never answers, above; here boto3's import
    # and the look-up must not race a busy machine)
    names = _complete(tmp_path, {**s3_env.env, "TRM_COMPLETION_TIMEOUT_S": "30"}, timeout=120)
    assert names == ["production", "staging"]
