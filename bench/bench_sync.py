"""Benchmark: `trm sync` vs `s5cmd sync` vs `aws s3 sync`, as whole processes, on one SeaweedFS.

What a user (or an init container) pays is the whole process: interpreter start, imports, requests,
writes. Every tool here runs as its own command line against one real SeaweedFS on 127.0.0.1 (free
ports), on the same data. trm reads its content-addressed store (``push --env prod``); s5cmd and aws read
the same versions exported as a plain Triton layout (``trm export``), which is what they would sync.
Each tool runs as a user runs it: the ``trm`` command installed in the virtual environment (as
scripts/setup.sh installs it), s5cmd's binary, ``aws``, all from the same neutral working folder. trm's
modules are byte-compiled first, as ``pip install`` does for an installed package: with
PYTHONDONTWRITEBYTECODE set (as on the development machine) an editable install would otherwise compile
them again on every run (~40 ms of a cold sync) — a cost of the checkout, not of trm.
Each run is timed as wall time; the tool's peak RSS and CPU seconds (user + system) come from ``wait4``
(through GNU time), and the S3 server's CPU seconds during the run from /proc (on a small machine the
client and the server share the cores: the sum is what bounds a multi-GB transfer). CPU seconds are what
a loaded machine does not blur. Every run starts after ``sync(2)``: s5cmd and aws exit with their files
still dirty in the page cache (trm fsyncs before a version appears), and whichever tool ran next would
otherwise pay for that writeback.

Scenarios (each repetition has its own empty node, so a median is over independent nodes):

1. cold: first sync into an empty node;
2. unchanged: the same node again, nothing changed;
3. second pod: trm: a new repository on the same node (the shared node cache); peers: an empty folder;
4. new version: the node after one new version was pushed (one 64 MiB shard changed);
5. multi-GB: a cold sync of one model of several large files (``--big-files`` x ``--big-mb``).

    python bench/bench_sync.py [--repeat 3] [--big-files 4] [--big-mb 1100] [--out bench/results]

Writes ``bench/results/sync.md`` and ``sync.json``; the machine's load average is recorded with them.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
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

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.storage import open_store  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.export import export  # noqa: E402
from repo_manager.ops.push import push  # noqa: E402

BIN = Path(sys.executable).parent
VERIFIES = {
    "trm": "sha256 of every byte against the manifest (ranged parts included), before a version folder "
           "appears by one rename, and again for every cached blob as it enters a version; corrupt objects "
           "refused",
    "s5cmd": "nothing beyond the object size (sync compares size and modification time; no checksum on "
             "download)",
    "aws": "size/mtime to decide; on download, botocore checks a response checksum only where the object "
           "stores one and the GET is whole-object (not for ranged multipart downloads)",
}


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds a running process and its descendants have used so far (/proc); 0 when
    unknown. (The server's pid is trm's reaper; ``weed`` is its child.)"""
    total, stack = 0.0, [pid] if pid else []
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            stack += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def timed(command: list[str], env: dict[str, str], cwd: Path | None = None, server_pid: int | None = None) -> dict:
    """Run ``command``; wall seconds and the tool's peak RSS (MB).

    The RSS comes from ``wait4`` in GNU time (``%M``), not in this process: a child forked from this
    (large) Python process inherits its high-water mark until it execs, so its own ``wait4`` would report
    the benchmark's memory rather than the tool's."""
    os.sync()  # no run pays for the writeback of an earlier one (s5cmd and aws leave their files dirty)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        server_before = cpu_seconds(server_pid)
        started = time.perf_counter()
        process = subprocess.run(["/usr/bin/time", "-f", "\nbench-rss-kb %M %U %S", *command], stdout=out, stderr=err,
                                 env=env, cwd=cwd, check=False)
        seconds = time.perf_counter() - started
        server_cpu = cpu_seconds(server_pid) - server_before
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{command[:4]} exited {process.returncode}: {stderr[-2000:]}")
    rss_kb, user, system = stderr.rsplit("bench-rss-kb ", 1)[1].split()[:3]
    return {"seconds": seconds, "rss_mb": int(rss_kb) / 1024, "cpu_s": float(user) + float(system),
            "server_cpu_s": server_cpu, "stdout": stdout}


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


class Tools:
    """Each tool as a user runs it: trm's installed ``trm`` command, s5cmd's binary, aws's command, all
    from the same neutral working folder (an init container's; a settings file in the folder a command
    runs from is read by trm, ~15 ms of YAML)."""

    def __init__(self, endpoint: str, env: dict[str, str], cwd: Path, server_pid: int | None) -> None:
        self.endpoint = endpoint
        self.env = env
        self.cwd = cwd
        self.server_pid = server_pid

    def trm(self, store: str, repo: Path, cache: Path) -> dict:
        result = timed([str(BIN / "trm"), "-q", "sync", store, "--env", "prod", "--repo", str(repo), "--cache",
                        str(cache), "--endpoint-url", self.endpoint, "--json"], self.env, self.cwd, self.server_pid)
        data = json.loads(result.pop("stdout"))
        return {**result, "bytes": data["bytes_downloaded"], "remote_reads": data["remote_reads"]}

    def s5cmd(self, plain: str, dest: Path) -> dict:
        before = tree_bytes(dest)
        result = timed([str(BIN / "s5cmd"), "--endpoint-url", self.endpoint, "sync", f"{plain}/*", f"{dest}/"],
                       self.env, self.cwd, self.server_pid)
        result.pop("stdout")
        return {**result, "bytes": tree_bytes(dest) - before}

    def aws(self, plain: str, dest: Path) -> dict:
        before = tree_bytes(dest)
        result = timed([str(BIN / "aws"), "s3", "sync", plain, str(dest), "--endpoint-url", self.endpoint,
                        "--only-show-errors"], self.env, self.cwd, self.server_pid)
        result.pop("stdout")
        return {**result, "bytes": tree_bytes(dest) - before}


def build_source(root: Path, large: int, large_mb: int, small: int, version: int) -> None:
    """Model 'llm': ``large`` shards (version 2 changes shard 0); model 'tok': ``small`` small files."""
    shards = {f"shard-{i}.bin": pseudo_random(large_mb * 1024 * 1024, 100 * i + (version if i == 0 else 0))
              for i in range(large)}
    make_version(root, "llm", {**shards, "model.py": f"# llm v{version}\n".encode()})
    if version == 1:
        files = {f"vocab/part-{i:04d}.txt": pseudo_random(4096 + (i * 997) % 28000, 7000 + i) for i in range(small)}
        make_version(root, "tok", {**files, "model.py": b"# tokenizer\n"})


def build_big(root: Path, files: int, megabytes: int) -> None:
    """One model of ``files`` large files, written in 64 MiB pieces (bounded memory)."""
    from store_helpers import python_config

    from repo_manager.core.manifest import Manifest, scan_files

    repo = LocalRepository(root)
    staging = repo.stage("big")
    generator = random.Random(42)
    for i in range(files):
        with open(staging / f"weights-{i:02d}.bin", "wb") as handle:
            left = megabytes * 1024 * 1024
            while left:
                piece = min(left, 64 * 1024 * 1024)
                handle.write(generator.randbytes(piece))
                left -= piece
    (staging / "model.py").write_bytes(b"# big\n")
    repo.commit(staging, Manifest(model="big", version=1, files=scan_files(staging), config=python_config("big")))


def publish(source: Path, endpoint: str, store: str, plain: str) -> None:
    settings = Settings(s3_endpoint_url=endpoint)
    target = open_store(store, settings)
    push(target, LocalRepository(source), [], env="prod")
    export(target, plain, settings, models=())  # every version: what the peers sync


def summarize(runs: list[dict]) -> dict:
    return {"seconds": statistics.median(r["seconds"] for r in runs), "rss_mb": max(r["rss_mb"] for r in runs),
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "server_cpu_s": statistics.median(r["server_cpu_s"] for r in runs),
            "bytes": statistics.median(r["bytes"] for r in runs), "runs": [round(r["seconds"], 3) for r in runs]}


def run(args: argparse.Namespace) -> dict:
    compileall.compile_dir(ROOT / "repo_manager", quiet=1)  # what pip install does (see the docstring)
    work = Path(tempfile.mkdtemp(prefix="trm-bench-", dir=args.work))
    results: dict[str, dict[str, dict]] = {}
    loads: list[tuple[float, float, float]] = []
    try:
        with SeaweedServer(work / "weed") as server:
            tools = Tools(server.endpoint, dict(os.environ, **server.env), work, server.pid)
            os.environ.update(server.env)
            store, plain = f"s3://{BUCKET}/store", f"s3://{BUCKET}/plain"
            source = work / "source"
            build_source(source, args.large, args.large_mb, args.small, 1)
            publish(source, server.endpoint, store, plain)
            print(f"data: {args.large} x {args.large_mb} MiB + {args.small} small files, "
                  f"{tree_bytes(source) / 1e6:.0f} MB", file=sys.stderr)

            def scenario(name: str, pod: str, dest: str) -> None:
                rows: dict[str, list[dict]] = {"trm": [], "s5cmd": [], "aws": []}
                for r in range(args.repeat):
                    rows["trm"].append(tools.trm(store, work / f"{pod}-{r}", work / f"cache-{r}"))
                    rows["s5cmd"].append(tools.s5cmd(plain, work / f"s5-{dest}-{r}"))
                    rows["aws"].append(tools.aws(plain, work / f"aws-{dest}-{r}"))
                results[name] = {tool: summarize(runs) for tool, runs in rows.items()}
                loads.append(os.getloadavg())
                print(f"{name}: " + ", ".join(f"{t} {r['runs']}" for t, r in results[name].items()) +
                      f" (load {loads[-1][0]:.1f})", file=sys.stderr)

            scenario("cold, empty node", "pod1", "1")
            scenario("unchanged re-sync", "pod1", "1")
            scenario("second pod on the node", "pod2", "2")
            build_source(source, args.large, args.large_mb, args.small, 2)
            publish(source, server.endpoint, store, plain)
            scenario("after one new version", "pod1", "1")
            for path in work.iterdir():
                if path.name != "weed":
                    shutil.rmtree(path)
            if args.big_files:
                big_store, big_plain = f"s3://{BUCKET}/big-store", f"s3://{BUCKET}/big-plain"
                big = work / "big-source"
                build_big(big, args.big_files, args.big_mb)
                publish(big, server.endpoint, big_store, big_plain)
                shutil.rmtree(big)
                rows: dict[str, list[dict]] = {"trm": [], "s5cmd": [], "aws": []}
                for _ in range(args.big_repeat):
                    for tool in rows:
                        dest = work / f"big-{tool}"
                        if tool == "trm":
                            rows[tool].append(tools.trm(big_store, dest / "repo", dest / "cache"))
                        else:
                            rows[tool].append(getattr(tools, tool)(big_plain, dest))
                        shutil.rmtree(dest)
                name = f"multi-GB model ({args.big_files} x {args.big_mb} MiB)"
                results[name] = {tool: summarize(runs) for tool, runs in rows.items()}
                loads.append(os.getloadavg())
                print(f"{name}: " + ", ".join(f"{t} {r['runs']}" for t, r in results[name].items()) +
                      f" (load {loads[-1][0]:.1f})", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"data": {"large_files": args.large, "large_mb": args.large_mb, "small_files": args.small,
                     "big_files": args.big_files, "big_mb": args.big_mb, "repeat": args.repeat},
            "load_averages": loads, "cpus": os.cpu_count(), "results": results, "verifies": VERIFIES}


def table(report: dict) -> str:
    lines = ["| scenario | trm sync | s5cmd sync | aws s3 sync | s5cmd / trm | aws / trm | GB/s trm · s5cmd · aws "
             "| peak RSS MB trm · s5cmd · aws | CPU s trm · s5cmd · aws | server CPU s (with trm · s5cmd · aws) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        t, s, a = (r[k] for k in ("trm", "s5cmd", "aws"))
        rates = " · ".join(f"{x['bytes'] / x['seconds'] / 1e9:.2f}" if x["bytes"] > 1e6 else "–" for x in (t, s, a))
        rss = " · ".join(f"{x['rss_mb']:.0f}" for x in (t, s, a))
        cpu = " · ".join(f"{x['cpu_s']:.2f}" for x in (t, s, a))
        server = " · ".join(f"{x.get('server_cpu_s', 0):.2f}" for x in (t, s, a))
        lines.append(f"| {name} | {t['seconds']:.3f} s | {s['seconds']:.3f} s | {a['seconds']:.3f} s | "
                     f"{s['seconds'] / t['seconds']:.2f}x | {a['seconds'] / t['seconds']:.1f}x | {rates} | {rss} "
                     f"| {cpu} | {server} |")
    lines.append("")
    lines += [f"- {tool} verifies: {text}" for tool, text in report["verifies"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="independent nodes per scenario (median)")
    parser.add_argument("--large", type=int, default=3, help="large files of model 'llm'")
    parser.add_argument("--large-mb", type=int, default=64, help="MiB per large file")
    parser.add_argument("--small", type=int, default=300, help="small files (4-32 KB) of model 'tok'")
    parser.add_argument("--big-files", type=int, default=4, help="files of the multi-GB model (0: skip it)")
    parser.add_argument("--big-mb", type=int, default=1100, help="MiB per file of the multi-GB model")
    parser.add_argument("--big-repeat", type=int, default=3, help="runs of the multi-GB cold sync (median)")
    parser.add_argument("--work", default=None, help="scratch folder (default: the system temp folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    report = run(args)
    loads = ", ".join(f"{x[0]:.1f}" for x in report["load_averages"])
    text = table(report) + f"\n\n{report['cpus']} CPUs; 1-minute load average after each scenario: {loads}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync.json").write_text(json.dumps(report, indent=2))
    (args.out / "sync.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
