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
