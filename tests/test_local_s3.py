"""docs/local-s3.md's walk-through, run as written, and scripts/setup.sh's promises about what it installs.

The walk-through runs in a scratch copy of the project folder (its scripts/, configs/ and a .venv that is
this test's own environment), so the project's model_repository/ and .trm-s3/ are never touched. The only
change to the text is the three port variables the document itself offers for that: free ports, since
other programs on a test machine may hold the defaults.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from repo_manager.adapters.triton.server import ephemeral_port_range, free_ports

ROOT = Path(__file__).resolve().parent.parent


def walkthrough_commands(doc: Path) -> str:
    """Every ```bash block under '## Walk-through', in order: the script the test runs."""
    section = doc.read_text().split("## Walk-through", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```bash\n(.*?)```", section, flags=re.S))


def _project_copy(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "local-s3.sh", project / "scripts")
    shutil.copytree(ROOT / "configs", project / "configs")
    (project / ".venv").symlink_to(Path(sys.prefix))  # `export PATH="$PWD/.venv/bin:$PATH"` finds trm, weed
    return project


@pytest.mark.timeout(1200)
def test_the_local_s3_walkthrough_runs_as_written(tmp_path):
    """push → sync → promote → agent against SeaweedFS started by the documented command, with the
    documented keys and endpoint: every step exits 0, production is served by the agent's server, and the
    local store stops again."""
    script = walkthrough_commands(ROOT / "docs" / "local-s3.md")
    assert "scripts/local-s3.sh start" in script and "trm agent" in script and "trm promote" in script
    project = _project_copy(tmp_path)
    # ports the walk-through binds minutes after they are picked: outside the kernel's ephemeral range, where
    # the walk-through's own S3 and HTTP connections would take one as their local end now and then
    s3, agent, triton = free_ports(3)
    while _busy(triton) or triton + 2 >= ephemeral_port_range()[0]:
        triton = free_ports(1)[0]  # Triton's HTTP port and the two after it (gRPC, metrics), as the document uses them
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRM_", "AWS_"))}
    env.update(S3_PORT=str(s3), TRITON_PORT=str(triton), AGENT_PORT=str(agent), PYTHONPATH=str(ROOT),
               HOME=str(tmp_path / "home"), NO_COLOR="1")
    # the output goes to a file, not a pipe: when a step fails, the server and agent the script started in the
    # background would hold a pipe open, and the test would wait for its timeout instead of the script
    log = tmp_path / "walkthrough.log"
    with open(log, "w") as out_file:
        run = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=project, env=env,
                               stdout=out_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            run.wait(timeout=1100)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGTERM)
                run.wait(30)
            _stop_leftovers(project, env, run.pid)
    out = log.read_text()
    assert run.returncode == 0, out[-6000:]
    assert '"ready": true' in out and '"state": "ready"' in out, out[-6000:]  # the agent's /status
    assert "EMBEDDING [1, 384]" in out  # the text's embedding, answered by the server the agent filled
    assert not (project / ".trm-s3" / "weed.pid").exists()  # stopped by the documented command
    assert (project / "node-production" / "minilm").is_dir() and (project / "node-staging" / "minilm").is_dir()


def _busy(port: int) -> set[int]:
    """Of port and the two after it (Triton's gRPC and metrics in the walk-through), those taken."""
    taken = set()
    for candidate in (port, port + 1, port + 2):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                taken.add(candidate)
    return taken


def _stop_leftovers(project: Path, env: dict[str, str], group: int) -> None:
    """A failed run may leave the background server, agent or SeaweedFS: stop each one this test started."""
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if (project / ".trm-s3" / "weed.pid").exists():
        subprocess.run(["bash", "scripts/local-s3.sh", "stop"], cwd=project, env=env, timeout=60, check=False)


def test_setup_installs_nothing_outside_the_venv_unless_asked_and_says_what_it_did(tmp_path):
    """scripts/setup.sh, run as root with apt-get on the PATH: without --with-prometheus it never calls
    apt-get; it prints each step, the time taken and the size of .venv; an unknown option is exit 2.

    Stand-ins, named as such: pip's installs (minutes and gigabytes from PyPI) are replaced by a .venv whose
    python records its arguments, and apt-get by a script that records being called. What is tested is the
    script's own logic, not pip."""
    project = tmp_path / "project"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", project / "scripts")
    bin_dir, calls = project / ".venv" / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "python $*" >> {calls}\n')
    (bin_dir / "trm").write_text("#!/bin/sh\necho 'trm 0.0-test'\n")
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {calls}\n')
    for path in (bin_dir / "python", bin_dir / "trm", fake / "apt-get"):
        path.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:/usr/bin:/bin")
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    recorded = calls.read_text()
    assert "apt-get" not in recorded and "-e .[torch,test]" in recorded and "torch==2.13.0" in recorded
    assert "[setup] PyTorch" in done.stderr and "done in" in done.stderr
    assert re.search(r"on disk, \d+ s in all", done.stderr), done.stderr
    if os.geteuid() == 0 and shutil.which("promtool") is None:
        assert "--with-prometheus" in done.stderr  # says what it left out and how to get it
        asked = subprocess.run(["bash", "scripts/setup.sh", "--with-prometheus"], cwd=project, env=env,
                               capture_output=True, text=True, timeout=120)
        assert "apt-get" in calls.read_text() and "Debian's prometheus package" in asked.stderr
    wrong = subprocess.run(["bash", "scripts/setup.sh", "--prometheus"], cwd=project, env=env, capture_output=True,
                           text=True, timeout=60)
    assert wrong.returncode == 2 and "unknown option --prometheus" in wrong.stderr
