"""Benchmark: the unchanged `trm sync` process with its one GET read by ``sigv4.signed_get`` or by http.client.

An unchanged ``trm sync s3://… --env E`` (every pod start) makes one conditional GET of the environment's
pointer (``ops/sync/noop.quick``). ``sigv4.signed_get`` reads it over a socket of its own; the question is
whether ``http.client`` (what the store's ``SignedReader`` uses for everything else) would cost the
process enough to keep a second HTTP client. Both variants run as whole processes, interleaved in a
shuffled order per round, against one real SeaweedFS on 127.0.0.1 (tests/seaweed.py), on the same
unchanged node: ``signed_get`` is trm as it is, ``http.client`` the same process with ``signed_get``
replaced by an ``http.client`` GET (``_HTTP_CLIENT_GET`` below: what a replacement would be). Each run is
checked to be the quick path (click never imported) and to answer "unchanged". Wall time and the
process's CPU seconds (user + system, from ``wait4``: what a loaded machine blurs least) are reported as
medians; trm's modules are byte-compiled first (as ``pip install`` does).

    python bench/bench_sync_reader.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from seaweed import BUCKET, SeaweedServer  # noqa: E402
from store_helpers import make_version, pseudo_random  # noqa: E402

_CHECK = ("import atexit, sys\n"
          "atexit.register(lambda: sys.stderr.write('full path\\n' if 'click' in sys.modules else 'quick path\\n'))\n")
_HTTP_CLIENT_GET = '''
from repo_manager.adapters.storage import sigv4

def signed_get(url, headers, timeout=10.0):
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = cls(parts.netloc, timeout=timeout)
    try:
        connection.request("GET", parts.path + ("?" + parts.query if parts.query else ""),
                           headers={**headers, "Accept-Encoding": "identity"})
        response = connection.getresponse()
        body = response.read(sigv4.MAX_RESPONSE + 1)
        if len(body) > sigv4.MAX_RESPONSE:
            raise OSError("answer too long")
        return sigv4.Response(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
    except http.client.HTTPException as exc:
        raise OSError(str(exc)) from exc
    finally:
        connection.close()

sigv4.signed_get = signed_get
'''
VARIANTS = {"signed_get": _CHECK, "http.client": _CHECK + _HTTP_CLIENT_GET}


def _run(code: str, args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, str, str]:
    """(wall seconds, CPU seconds of the process, stdout, stderr) of one run (the CPU from ``wait4``, which
    the children's resource usage adds up)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + "from repo_manager.entry import main\nmain()\n", *args],
                          capture_output=True, env=env, cwd=cwd, text=True, timeout=120)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout, done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    options = parser.parse_args()
    compileall.compile_dir(str(ROOT / "repo_manager"), quiet=1)
    with tempfile.TemporaryDirectory(prefix="trm-bench-reader-") as tmp, SeaweedServer(Path(tmp) / "weed") as server:
        work = Path(tmp)
        env = dict(os.environ, **server.env, PYTHONPATH=str(ROOT))
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "TRM_CONFIG"):
            env.pop(name, None)
        env.update(AWS_CONFIG_FILE=str(work / "aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(work / "aws-credentials"))
        src = work / "src"
        make_version(src, "a", {"model.py": b"# a", "w.bin": pseudo_random(200_000, 1), "sub/x.txt": b"x"})
        make_version(src, "b", {"model.py": b"# b"})
        location = f"s3://{BUCKET}/bench-reader"
        push = subprocess.run([sys.executable, "-m", "repo_manager", "push", location, "--repo", str(src), "--env",
                               "prod", "--json"], env=env, cwd=work, capture_output=True, text=True, timeout=300)
        assert push.returncode == 0, push.stderr
        sync = ["-q", "sync", location, "--env", "prod", "--repo", str(work / "dst"), "--cache", str(work / "cache"),
                "--json"]
        first = subprocess.run([sys.executable, "-m", "repo_manager", *sync], env=env, cwd=work, capture_output=True,
                               text=True, timeout=300)
        assert first.returncode == 0 and not json.loads(first.stdout)["unchanged"], first.stderr
        samples: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in VARIANTS}
        for _ in range(2):  # warm the page cache and the server once per variant
            for code in VARIANTS.values():
                _run(code, sync, env, work)
        for _ in range(options.repeat):
            order = list(VARIANTS)
            random.shuffle(order)
            for name in order:
                wall, cpu, out, err = _run(VARIANTS[name], sync, env, work)
                assert "quick path" in err and json.loads(out)["unchanged"], (name, out, err)
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)
    load = os.getloadavg()
    print(f"unchanged trm sync, {options.repeat} runs each, interleaved; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    base = {kind: statistics.median(samples["signed_get"][kind]) for kind in ("wall", "cpu")}
    for name, values in samples.items():
        wall, cpu = statistics.median(values["wall"]), statistics.median(values["cpu"])
        print(f"  {name:<12} wall median {wall * 1000:6.1f} ms ({(wall / base['wall'] - 1) * 100:+5.1f} %), "
              f"CPU median {cpu * 1000:6.1f} ms ({(cpu / base['cpu'] - 1) * 100:+5.1f} %); wall min "
              f"{min(values['wall']) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
