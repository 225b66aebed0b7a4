"""Helpers for store, push and sync tests: versions with given files, the CLI in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core import config as cfg
from repo_manager.core.manifest import Manifest, scan_files

ROOT = Path(__file__).resolve().parent.parent


def python_config(model: str) -> str:
    """Canonical text, as every publisher writes it (config_to_text of the schema object)."""
    return cfg.config_to_text(cfg.parse_config(f'name: "{model}"\nbackend: "python"\n'))


def make_version(repo_root: Path, model: str, files: dict[str, bytes], config: str | None = None) -> Manifest:
    """Commit a version holding ``files`` (a Python-backend config; these tests never load them)."""
    repo = LocalRepository(repo_root)
    staging = repo.stage(model)
    for path, data in files.items():
        (staging / path).parent.mkdir(parents=True, exist_ok=True)
        (staging / path).write_bytes(data)
    manifest = Manifest(model=model, version=repo.next_version(model), files=scan_files(staging),
                        config=config or python_config(model))
    repo.commit(staging, manifest)
    return manifest


def pushed_store(tmp_path: Path, model: str = "base", files: dict[str, bytes] | None = None,
                 env: str = "prod") -> str:
    """A folder store at ``tmp_path``/store serving version 1 of ``model`` in ``env``, pushed by `trm push` from
    ``tmp_path``/src (where the version stays)."""
    import pytest

    from repo_manager.cli import main

    store = tmp_path / "store"
    make_version(tmp_path / "src", model, files or {"model.py": b"# v1"})
    with pytest.raises(SystemExit) as exit_info:
        main(["push", str(store), "--repo", str(tmp_path / "src"), "--env", env])
    assert not exit_info.value.code, exit_info.value.code
    return str(store)


def outside_folder(tmp_path: Path) -> Path:
    """``tmp_path``/elsewhere holding one file, ``precious``: what a link may point at, never written through."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "precious").write_text("keep me")
    return folder


def pseudo_random(size: int, seed: int) -> bytes:
    """Incompressible, reproducible bytes, fast enough for tens of MB."""
    block = b"".join(hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(2048))  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


def tree_digest(root: Path) -> dict[str, str]:
    """Every regular file under ``root`` -> sha256, for 'nothing changed' assertions."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def trm_process(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`python -m repo_manager ARGS` in a new process (for concurrency, SIGKILL and crash tests)."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "repo_manager", *map(str, args)], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, dict | None, str]:
    out, err = process.communicate(timeout=timeout)
    try:
        data = json.loads(out) if out.strip() else None
    except ValueError:
        data = None
    return process.returncode, data, err
