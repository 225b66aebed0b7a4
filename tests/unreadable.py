"""Running trm where the kernel really refuses reads (no mock): files and folders hidden with mode 000.

The tests run as root, for whom ``chmod 000`` changes nothing: root reads anything through the
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH capabilities. So trm runs in a child process that drops both
from its capability bounding set before exec (``prctl(PR_CAPBSET_DROP)``): it stays root, owns the test's
files, and its reads of a mode-000 file or folder fail with EACCES, as they would for any user. When the
tests do not run as root, mode 000 is enough on its own.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import ROOT, finish

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def hide(*paths: Path) -> None:
    """Unreadable from now on (mode 000) for trm run by ``trm_unprivileged``."""
    for path in paths:
        path.chmod(0)


def _drop_read_override() -> None:  # runs in the child, between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) refused")


def trm_unprivileged(*args: object) -> tuple[int, dict | None, str]:
    """`python -m repo_manager ARGS` without the power to read what mode 000 hides: exit code, JSON, stderr."""
    extra: dict = {}
    if os.geteuid() == 0:
        extra["preexec_fn"] = _drop_read_override
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        process = subprocess.Popen([sys.executable, "-m", "repo_manager", *map(str, args)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **extra)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot drop the capabilities that let root read anything here: {exc}")
    return finish(process)


def python_unprivileged(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python child that cannot write or read past file modes (as ``trm_unprivileged``)."""
    extra: dict = {}
    if os.geteuid() == 0:
        extra["preexec_fn"] = _drop_read_override
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                              **extra)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot drop the capabilities that let root write anything here: {exc}")
