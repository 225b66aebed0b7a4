"""ci/pipeline.sh end to end: a project with one tiny ONNX model, a real SeaweedFS, the embedded Triton.

The steps use the session's tritonserver (TRM_URL) instead of starting one per command: the same code
path as `--url` in CI, and minutes faster here.

Tuning is skipped (TRM_PIPELINE_SKIP_TUNING=1): `trm tune-batching --requests 100` on the tiny model took
2 minutes on this shared machine (the measurements every run makes, whatever its budget), and it has its
own tests.
The pipeline's tuning step is tune-batching --write, then the push-promote sequence of its staging step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_models as om
import yaml

from repo_manager.adapters.storage import open_store
from repo_manager.core.errors import EXIT_CODES
from repo_manager.core.settings import load_settings
from repo_manager.ops.promote import read_history

ROOT = Path(__file__).resolve().parent.parent
FAST_LATENCY = {"rate": 40, "requests": 80, "rounds": 1, "concurrency": 2, "max_p99_increase_pct": 300,
                "min_p99_delta_ms": 50, "max_capacity_drop_pct": 75, "arrivals": "constant", "max_lag_ms": 50,
                "capacity_slice_s": 0.1}


def _project(root: Path, store: str) -> Path:
    (root / "configs" / "models").mkdir(parents=True)
    om.linear(root / "models" / "tiny.onnx", seed=0)
    (root / "samples").mkdir()
    np.savez(root / "samples" / "tiny.npz", X=np.arange(8, dtype=np.float32).reshape(2, 4))
    (root / "configs" / "trm.yaml").write_text(yaml.safe_dump({
        "store": store, "environments": {"staging": {}, "production": {}},
        "gates": {"default": "auto", "latency": FAST_LATENCY}}))
    (root / "configs" / "models" / "tiny.yaml").write_text(yaml.safe_dump({
        "name": "tiny", "source": "models/tiny.onnx", "publish": {"max_batch_size": 4, "warmup": False},
        "slo": {"p99_ms": 50, "low_rps": 5, "peak_rps": 40}, "sample": "samples/tiny.npz",
        "eval": {"command": "echo 0.1", "threshold": 0.5}}))
    return root


def _pipeline(project: Path, stage: str, url: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, TRM=f"{sys.executable} -m repo_manager", PYTHON=sys.executable, TRM_URL=url,
                PYTHONPATH=str(ROOT), TRM_PIPELINE_SKIP_TUNING="1", GITHUB_RUN_ID="777", **env)
    return subprocess.run(["bash", str(ROOT / "ci" / "pipeline.sh"), stage], cwd=project, env=full,
                          capture_output=True, text=True, timeout=600)


def test_pipeline_publishes_to_staging_then_promotes_to_production_through_the_gates(s3_location, tmp_path, triton):
    project = _project(tmp_path / "project", s3_location)
    settings = load_settings(project / "configs" / "trm.yaml")
    store = open_store(s3_location, settings)

    first = _pipeline(project, "staging", triton.url)
    assert first.returncode == 0, first.stderr
    assert store.get_env("staging").models == {"tiny": 1}
    released = _pipeline(project, "production", triton.url)
    assert released.returncode == 0, released.stderr
    assert store.get_env("production").models == {"tiny": 1}

    # the next push to main: a new version in staging; a gate that fails stops the release with exit 9
    second = _pipeline(project, "staging", triton.url)
    assert second.returncode == 0, second.stderr
    assert store.get_env("staging").models == {"tiny": 2}
    blocked = _pipeline(project, "production", triton.url, TRM_PROMOTE_GATES="checksums,eval")
    assert blocked.returncode == 9, blocked.stderr
    assert f"exit code 9 ({EXIT_CODES[9][1]}; nothing was changed)" in blocked.stderr
    assert store.get_env("production").models == {"tiny": 1}

    # auto gates: the same files with the same config -> latency and agreement with version 1 on the sample
    released = _pipeline(project, "production", triton.url)
    assert released.returncode == 0, released.stderr
    assert store.get_env("production").models == {"tiny": 2}
    again = _pipeline(project, "production", triton.url)  # a re-run job changes nothing and succeeds
    assert again.returncode == 0 and "already serves version 2" in again.stderr

    records = read_history(settings, "production").records
    assert [(r.from_version, r.to_version) for r in records] == [(None, 1), (1, 2)]
    assert [g["gate"] for g in records[-1].gates] == ["checksums", "load", "latency", "agreement"]
    assert records[-1].pipeline["github_run_id"] == "777"
