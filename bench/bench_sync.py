"""Benchmark: `trm sync` vs `aws s3 sync` vs a Triton-style one-object-at-a-time full download.

One run, one real SeaweedFS on 127.0.0.1 (free ports), one data set: a repository with a few large files
(model shards) and a few hundred small ones (tokenizer / python files). trm reads its content-addressed
store (``push --env prod``); aws and the Triton-style download read the same versions exported as a plain
Triton layout (``trm export``). Scenarios, in order, each for every tool:

1. first sync into an empty node;
2. a second pod on the same node (trm: same node cache, new repository; the others have no cache);
3. a re-sync with nothing changed;
4. a sync after one new version (one shard changed, the rest identical).

Each scenario runs three times (three separate nodes, each with its own repositories and cache) and
reports the median; the machine's load average is printed with the table.

Triton's own S3 repository support downloads the whole model, every version, one object at a time into
a fresh temporary folder on each load: that is what the third column does (boto3, sequential GETs).

Two timings per tool: ``in-process`` (each tool called as a library with warm imports: the work itself)
and ``process`` (the command line, interpreter start-up included, as an operator runs it).

    python bench/bench_sync.py [--large 3] [--large-mb 64] [--small 300] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
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

from repo_manager.export import export  # noqa: E402
from repo_manager.push import push  # noqa: E402
from repo_manager.repository import LocalRepository  # noqa: E402
from repo_manager.settings import Settings  # noqa: E402
from repo_manager.storage import open_store  # noqa: E402
from repo_manager.sync import sync  # noqa: E402

STORE = f"s3://{BUCKET}/store"
PLAIN = f"s3://{BUCKET}/plain"


def build_source(root: Path, large: int, large_mb: int, small: int, version: int) -> None:
    """Model 'llm': ``large`` shards (version 2 changes shard 0); model 'tok': ``small`` small files."""
    shards = {f"shard-{i}.bin": pseudo_random(large_mb * 1024 * 1024, 100 * i + (version if i == 0 else 0))
              for i in range(large)}
    make_version(root, "llm", {**shards, "model.py": f"# llm v{version}\n".encode()})
    if version == 1:
        files = {f"vocab/part-{i:04d}.txt": pseudo_random(4096 + (i * 997) % 28000, 7000 + i) for i in range(small)}
        make_version(root, "tok", {**files, "model.py": b"# tokenizer\n"})


def publish_to_store(source: Path, endpoint: str) -> None:
    settings = Settings(s3_endpoint_url=endpoint)
    store = open_store(STORE, settings)
    push(store, LocalRepository(source), [], env="prod")
    export(store, PLAIN, settings, models=())  # every version: what a stock Triton pointed at S3 sees


# ------------------------------------------------------------------------------------------ the tools
def trm_in_process(repo: Path, cache: Path, endpoint: str) -> dict:
    settings = Settings(repository=repo, cache_dir=cache, s3_endpoint_url=endpoint)
    started = time.perf_counter()
    result = sync(settings, open_store(STORE, settings), env="prod")
    return {"seconds": time.perf_counter() - started, "downloaded": result.bytes_downloaded,
            "reused": result.bytes_reused}


def trm_process(repo: Path, cache: Path, endpoint: str) -> dict:
    command = [sys.executable, "-m", "repo_manager", "-q", "sync", STORE, "--env", "prod", "--repo", str(repo),
               "--cache", str(cache), "--endpoint-url", endpoint, "--json"]
    started = time.perf_counter()
    out = subprocess.run(command, check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    seconds = time.perf_counter() - started
    data = json.loads(out)
    return {"seconds": seconds, "downloaded": data["bytes_downloaded"], "reused": data["bytes_reused"]}


def aws_in_process(dest: Path, endpoint: str) -> dict:
    from awscli.clidriver import create_clidriver  # noqa: PLC0415

    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = create_clidriver().main(["s3", "sync", PLAIN, str(dest), "--endpoint-url", endpoint,
                                        "--only-show-errors"])
    if code:
        raise RuntimeError(f"aws s3 sync exited {code}")
    return {"seconds": time.perf_counter() - started}


def aws_process(dest: Path, endpoint: str) -> dict:
    aws = Path(sys.executable).parent / "aws"
    started = time.perf_counter()
    subprocess.run([str(aws), "s3", "sync", PLAIN, str(dest), "--endpoint-url", endpoint, "--only-show-errors"],
                   check=True, capture_output=True)
    return {"seconds": time.perf_counter() - started}


def triton_style(endpoint: str) -> dict:
    """Every object of every model, one GET at a time, into a fresh temporary folder (then discarded)."""
    import boto3  # noqa: PLC0415

    client = boto3.client("s3", endpoint_url=endpoint)
    started = time.perf_counter()
    total = 0
    with tempfile.TemporaryDirectory(prefix="triton-s3-") as scratch:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="plain/"):
            for item in page.get("Contents", []):
                target = Path(scratch) / item["Key"]
                target.parent.mkdir(parents=True, exist_ok=True)
                body = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"]
                with open(target, "wb") as handle:
                    for chunk in body.iter_chunks(1024 * 1024):
                        handle.write(chunk)
                        total += len(chunk)
    return {"seconds": time.perf_counter() - started, "downloaded": total}


# ------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="trm-bench-"))
    results: dict[str, dict[str, dict]] = {}
    try:
        with SeaweedServer(work / "weed") as server:
            os.environ.update(server.env)
            endpoint = server.endpoint
            source = work / "source"
            build_source(source, args.large, args.large_mb, args.small, 1)
            publish_to_store(source, endpoint)
            size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
            print(f"data: {args.large} x {args.large_mb} MB + {args.small} small files, {size / 1e6:.0f} MB",
                  file=sys.stderr)

            def scenario(name: str, pod: str, cache: str, aws_dest: str, repeat: int = 3) -> None:
                """Run every tool ``repeat`` times (median); names may use {r}, the repetition."""
                rows: dict[str, list[dict]] = {}
                for r in range(repeat):
                    def at(prefix: str, template: str, r: int = r) -> Path:
                        return work / f"{prefix}-{template.format(r=r)}"
                    rows.setdefault("trm in-process", []).append(
                        trm_in_process(at("ip", pod), at("ip", cache), endpoint))
                    rows.setdefault("aws in-process", []).append(aws_in_process(at("ip", aws_dest), endpoint))
                    rows.setdefault("trm process", []).append(trm_process(at("p", pod), at("p", cache), endpoint))
                    rows.setdefault("aws process", []).append(aws_process(at("p", aws_dest), endpoint))
                    rows.setdefault("triton-style", []).append(triton_style(endpoint))
                results[name] = {tool: {**runs[0], "seconds": statistics.median(r["seconds"] for r in runs),
                                        "runs": [round(r["seconds"], 3) for r in runs]}
                                 for tool, runs in rows.items()}
                print(f"{name}: " + ", ".join(f"{t} {r['runs']}" for t, r in results[name].items()), file=sys.stderr)

            # every repetition r gets its own empty node (repository + cache) for the first sync, a second
            # pod on that node, and takes its node through the re-sync and the new version
            scenario("first sync, empty node", "pod1-{r}", "cache-{r}", "aws1-{r}")
            scenario("second pod, same node", "pod2-{r}", "cache-{r}", "aws2-{r}")
            scenario("re-sync, nothing changed", "pod1-{r}", "cache-{r}", "aws1-{r}")
            build_source(source, args.large, args.large_mb, args.small, 2)
            publish_to_store(source, endpoint)
            scenario("after one new version", "pod1-{r}", "cache-{r}", "aws1-{r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"data": {"large_files": args.large, "large_mb": args.large_mb, "small_files": args.small},
            "load_average": os.getloadavg(), "results": results}


def table(report: dict) -> str:
    lines = ["| scenario | trm sync | aws s3 sync | triton-style | aws / trm | triton / trm | trm sync (process) | "
             "aws s3 sync (process) | aws / trm (process) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        trm, aws, tri = (r[k]["seconds"] for k in ("trm in-process", "aws in-process", "triton-style"))
        trm_p, aws_p = r["trm process"]["seconds"], r["aws process"]["seconds"]
        lines.append(f"| {name} | {trm:.3f} s | {aws:.3f} s | {tri:.3f} s | {aws / trm:.1f}x | {tri / trm:.1f}x | "
                     f"{trm_p:.3f} s | {aws_p:.3f} s | {aws_p / trm_p:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", type=int, default=3, help="number of large files")
    parser.add_argument("--large-mb", type=int, default=64, help="size of each large file")
    parser.add_argument("--small", type=int, default=300, help="number of small files (4-32 KB)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    report = run(args)
    text = table(report) + "\n\nload average at the end: " + ", ".join(f"{x:.1f}" for x in report["load_average"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync.json").write_text(json.dumps(report, indent=2))
    (args.out / "sync.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
