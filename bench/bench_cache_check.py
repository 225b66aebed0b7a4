"""Benchmark: what checking cached blobs costs the second pod on a node (A/B against another checkout).

Every blob a sync links (or copies) from the shared node cache into a version is hashed against its
sha256 first (docs/store-and-sync.md, "The node cache is a trust boundary"). This measures that on the
"second pod" scenario of bench_sync.py: the same data (model 'llm': 3 x 64 MiB shards, model 'tok': 300
small files), one SeaweedFS on 127.0.0.1, the node cache already full, and ``trm sync`` of a new
repository as a whole process. Runs alternate between this checkout and ``--base`` (a checkout without
the check, e.g. ``git archive 944e2c2 | tar -x -C /tmp/base``), so both see the same machine load.
``--layout copy`` puts the repository on another filesystem (/dev/shm), as in the Kubernetes manifests
(cache and repository are two mounts): blobs are copied, and hashed while they are copied.

    python bench/bench_cache_check.py --base /tmp/base [--repeat 5] [--layout link|copy]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]

from bench_sync import BUCKET, SeaweedServer, build_source, publish, timed  # noqa: E402


def sync(checkout: Path, server: SeaweedServer, store: str, repo: Path, cache: Path, cwd: Path,
         warm: bool = True) -> dict:
    env = dict(os.environ, **server.env, PYTHONPATH=str(checkout))
    result = timed([sys.executable, "-m", "repo_manager", "-q", "sync", store, "--env", "prod", "--repo", str(repo),
                    "--cache", str(cache), "--endpoint-url", server.endpoint, "--json"], env, cwd, server.pid)
    data = json.loads(result.pop("stdout"))
    assert data["installed"] and (data["bytes_downloaded"] == 0 or not warm), data
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layout", choices=("link", "copy"), default="link")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trm-bench-check-"))
    pods = Path(tempfile.mkdtemp(prefix="trm-bench-pods-", dir="/dev/shm" if args.layout == "copy" else work))
    runs: dict[str, list[dict]] = {"check": [], "base": []}
    try:
        with SeaweedServer(work / "weed") as server:
            os.environ.update(server.env)
            store = f"s3://{BUCKET}/store"
            build_source(work / "source", 3, 64, 300, 1)
            publish(work / "source", server.endpoint, store, f"s3://{BUCKET}/plain")
            cache = work / "cache"
            sync(ROOT, server, store, work / "pod1", cache, work, warm=False)  # fills the node cache
            for r in range(args.repeat):
                for name, checkout in (("check", ROOT), ("base", args.base))[:: 1 if r % 2 else -1]:
                    pod = pods / f"{name}-{r}"
                    runs[name].append(sync(checkout, server, store, pod, cache, work))
                    shutil.rmtree(pod)
    finally:
        shutil.rmtree(pods, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    for name, rows in runs.items():
        walls = [round(r["seconds"], 3) for r in rows]
        cpus = [round(r["cpu_s"], 2) for r in rows]
        print(f"{name}: wall median {statistics.median(walls):.3f} s {walls}, CPU median "
              f"{statistics.median(cpus):.2f} s {cpus}, peak RSS {max(r['rss_mb'] for r in rows):.0f} MB")
    print(f"layout {args.layout}, load {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
