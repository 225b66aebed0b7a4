"""Benchmark: a promotion across two buckets, CopyObject inside the service vs upload through this machine.

One real SeaweedFS on 127.0.0.1 (free ports) with two buckets; a version with one large file (``--mb``).
Three promotions of that version to ``production`` with the ``checksums`` gate only (no Triton):

* ``same store``: a compare-and-swap only (the checksums gate downloads and verifies the blob once);
* ``bucket -> bucket``: the missing blob copied server-side, then the target's copy verified;
* ``folder -> bucket``: the missing blob uploaded from the verified download, then verified.

    python bench/bench_promote.py [--mb 128] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from seaweed import BUCKET, SeaweedServer  # noqa: E402
from store_helpers import make_version, pseudo_random  # noqa: E402

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.storage import open_store  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.promote import PromotionRequest, promote  # noqa: E402
from repo_manager.ops.push import push  # noqa: E402


def timed(settings: Settings, **request) -> dict:
    started = time.perf_counter()
    result = promote(settings, PromotionRequest("big", "production", gates=("checksums",), **request))
    return {"seconds": round(time.perf_counter() - started, 2), "blobs_copied": result.blobs_copied,
            "server_side": result.blobs_copied_server_side, "bytes_copied": result.bytes_copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(Path(tmp) / "weed", buckets=(BUCKET, "prod")) as weed:
        os.environ.update(weed.env)
        work = Path(tmp)
        make_version(work / "repo", "big", {"weights.bin": pseudo_random(args.mb * 1024 * 1024, 1)})
        settings = Settings(repository=work / "repo")
        stores = {"staging": f"s3://{BUCKET}/staging", "folder": str(work / "folder")}
        for location in stores.values():
            push(open_store(location, settings), LocalRepository(work / "repo"), [("big", 1)])
        results = {
            "same store": timed(settings, version=1, store=stores["staging"]),
            "bucket -> bucket": timed(settings, version=1, store=stores["staging"], to_store="s3://prod/a"),
            "folder -> bucket": timed(settings, version=1, store=stores["folder"], to_store="s3://prod/b"),
        }
    report = {"mb": args.mb, "results": results}
    print(json.dumps(report, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_promote.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
