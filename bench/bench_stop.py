"""Benchmark: how long a server trm started takes to stop.

Publishes a small ONNX model into a scratch repository, then times, per case:

* `trm serve` as a subprocess, with or without an idle keep-alive HTTP client connected: SIGTERM to exit;
* ``TritonServer(repo, models=[...])`` in this process (what tuning, verification and the tests use) with
  an idle keep-alive client: ``stop()``.
 Triton's own SIGTERM path waits for every open HTTP connection (idle keep-alive ones included) for
its whole exit timeout; trm drains first (unloads every model: in-flight requests finish), so the exit
timeout only covers the idle connections.

    python bench/bench_stop.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import onnx_models as om

from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer


def _serve(repo: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "repo_manager", "--json", "serve", "--repo", str(repo),
                             "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    decoder, text = json.JSONDecoder(), ""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("trm serve ended before it was ready")
        text += line
        try:
            return proc, decoder.decode(text)
        except json.JSONDecodeError:
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trm-bench-stop-") as tmp:
        repo = Path(tmp) / "repo"
        subprocess.run([sys.executable, "-m", "repo_manager", "-q", "publish", "model",
                        str(om.linear(Path(tmp) / "m.onnx")), "--name", "lin", "--repo", str(repo)], check=True)
        for case in ("no client", "idle keep-alive client"):
            times = []
            for _ in range(args.repeat):
                proc, info = _serve(repo)
                client = None
                if case != "no client":
                    client = TritonClient(info["endpoints"]["http"])
                    client.is_ready()
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                times.append(time.monotonic() - started)
                if client:
                    client.close()
            print(f"trm serve, {case:24s} stop: median {statistics.median(times):5.1f} s  (runs: "
                  f"{', '.join(f'{t:.1f}' for t in times)})")
        times = []
        for _ in range(args.repeat):
            server = TritonServer(repo, models=["lin"]).start()
            client = TritonClient(server.url)
            client.is_ready()
            started = time.monotonic()
            server.stop()
            times.append(time.monotonic() - started)
            client.close()
        print(f"TritonServer.stop(), idle keep-alive client   stop: median {statistics.median(times):5.1f} s  "
              f"(runs: {', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    main()
