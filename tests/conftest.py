"""Fixtures shared by the whole suite: a real tritonserver, settings in temporary folders.

Every test works in its own temporary folders; nothing touches the user's home, caches or the project's
model_repository/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from repo_manager.settings import Settings  # noqa: E402
from repo_manager.triton.server import TritonServer  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    """No settings file, no TRM_* variables from the developer's shell."""
    for key in list(os.environ):
        if key.startswith("TRM_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def triton(tmp_path_factory) -> TritonServer:
    """One real tritonserver for the session, on an empty scratch repository (explicit mode).

    Verification loads candidates through the load API with file overrides, so tests can share it.
    """
    scratch = tmp_path_factory.mktemp("scratch-repo")
    with TritonServer(scratch) as server:
        yield server


@pytest.fixture
def settings(tmp_path, triton) -> Settings:
    """Settings on a fresh repository, verifying on the session server."""
    return Settings(repository=tmp_path / "repo", triton_url=triton.url)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real SeaweedFS S3 server for the session, on free ports, bound to 127.0.0.1."""
    from seaweed import SeaweedServer  # noqa: PLC0415

    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """The AWS chain pointed at the session SeaweedFS (keys, region, endpoint), for this test only."""
    for key, value in seaweed.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    return seaweed


@pytest.fixture
def s3_location(s3_env, request):
    """A fresh prefix in the session bucket for one test."""
    import uuid  # noqa: PLC0415

    from seaweed import BUCKET  # noqa: PLC0415

    return f"s3://{BUCKET}/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"
