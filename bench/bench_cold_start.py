"""Benchmark: cold start of a vLLM version, from an empty node to its first generated token, per GB of weights.

A pod that scales up pays, before its first token: fetching the weights (``trm sync`` from a real S3 store,
here SeaweedFS on 127.0.0.1), checking and linking them into the version folder, starting Triton, loading
the engine (vLLM reads the weights, sizes its KV cache, warms up), and the first streamed token. Two pods
per model, as a node sees them:

1. cold: an empty node (empty repository, empty node cache);
2. second pod on the node: a new, empty repository on the same node cache (the weights are not
   downloaded again; every cached blob is hashed again as it enters the version).

Phases, each timed on its own (the total is the wall time from the sync's start to the first token):

* sync: the whole ``trm sync`` process (as bench/bench_sync.py runs it: the installed ``trm`` command,
  after ``sync(2)``); on the cold pod it is fetch + verify + link, on the second pod verify + link from the
  node cache only, so the cold pod's fetch is read as their difference;
* Triton start: ``tritonserver`` in explicit mode until ready (nothing loaded);
* engine load: the load request until the version is ready (what ``trm_model_load_duration_seconds``
  reports: the figure is read back from that gauge);
* first token: the first answer of one streamed ``generate_stream`` request (greedy).

The fetch is compared with ``s5cmd sync`` of the same version exported as a plain Triton layout (an
empty folder, as bench_sync's cold node; s5cmd checks sizes only). The weights are what the node's page
cache holds right after the download (both pods): a node whose disk is slower than its download pays more
in the engine load.

Models: ``--example smollm2`` (SmolLM2-135M-Instruct, float32 safetensors, 0.54 GB) and, with
``--random-gb G``, a random-weight Llama of about G GB (tests/llm_checkpoints.py) for a second size.

    python bench/bench_cold_start.py [--random-gb 1.2] [--max-model-len 512] [--out bench/results]
    python bench/bench_cold_start.py --no-example --random-gb 1.2 --merge bench/results/cold_start.json

Writes ``bench/results/cold_start.md`` and ``cold_start.json``; the load average is recorded with them.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_sync import BIN, Tools, publish  # noqa: E402
from seaweed import BUCKET, SeaweedServer  # noqa: E402

from repo_manager.adapters import metrics  # noqa: E402
from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.ops.llm.generate import generate  # noqa: E402
from repo_manager.ops.serving import load_version  # noqa: E402

PROMPT = "The capital of France is"
PHASES = {"sync_s": "sync", "sync_cpu_s": "sync CPU", "triton_start_s": "Triton start",
          "engine_load_s": "engine load", "engine_load_cpu_s": "engine load CPU", "first_token_s": "first token",
          "total_s": "total"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def random_checkpoint(folder: Path, gigabytes: float) -> Path:
    """A random-weight Llama (hidden 1024, 16 heads of 64, 4 KV heads) with as many layers as make about
    ``gigabytes`` of float32 weights (~35.7 MB a layer)."""
    from llm_checkpoints import causal_lm

    hidden, kv = 1024, 4 * 64
    per_layer = 4 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * 2 * hidden)
    layers = max(1, round(gigabytes * 1e9 / per_layer))
    return causal_lm(folder, head_dim=64, heads=16, kv_heads=4, layers=layers, max_position_embeddings=1024)


def publish_llm(source: Path, name: str, checkpoint: str | None, max_model_len: int) -> dict:
    """``trm publish model --format vllm`` into ``source`` (no verification: it would start one more engine;
    the bench's own first token is the check)."""
    what = ["--example", "smollm2"] if checkpoint is None else [checkpoint]
    done = subprocess.run([str(BIN / "trm"), "-q", "--json", "publish", "model", *what, "--name", name, "--format",
                           "vllm", "--no-verify", "--repo", str(source), "--max-model-len", str(max_model_len)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"publishing {name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def weight_bytes(version_dir: Path) -> int:
    return sum(p.stat().st_size for p in version_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process tree so far: every live process (children of any of its
    threads: vLLM's engine processes) and what its finished, waited-for children used; a loaded machine
    blurs wall time, not this."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def pod(tools: Tools, store: str, model: str, repo: Path, cache: Path) -> dict:
    """One pod: sync, Triton start, engine load, first token; each phase's seconds and the total."""
    started = time.perf_counter()
    sync = tools.trm(store, repo, cache)
    t0 = time.perf_counter()
    server = TritonServer(repo).start()
    try:
        start_s = time.perf_counter() - t0
        cpu_before = tree_cpu_seconds(server.pid)
        with TritonClient(server.url, timeout_s=1800) as client:
            version = load_version(client, LocalRepository(repo), model)
        load_cpu_s = tree_cpu_seconds(server.pid) - cpu_before
        load_s = metrics.REGISTRY.get_sample_value("trm_model_load_duration_seconds",
                                                   {"model": model, "version": str(version)})
        sent = time.perf_counter()
        answer = generate(server.url, model, PROMPT, {"temperature": 0, "max_tokens": 8}, timeout_s=600)
        first_s = answer.ttft_s or 0.0
        total_s = sent + first_s - started
    finally:
        server.stop()
    return {"sync_s": round(sync["seconds"], 3), "sync_cpu_s": round(sync["cpu_s"], 2),
            "sync_rss_mb": round(sync["rss_mb"]), "bytes_downloaded": sync["bytes"],
            "triton_start_s": round(start_s, 3), "engine_load_s": round(load_s, 3),
            "engine_load_cpu_s": round(load_cpu_s, 1), "first_token_s": round(first_s, 3),
            "total_s": round(total_s, 3), "text": answer.text}


def bench_model(tools: Tools, work: Path, name: str, source: Path, store: str, plain: str) -> dict:
    """``name`` alone in ``source``, pushed to its own ``store`` (an environment of its own) and ``plain``."""
    publish(source, tools.endpoint, store, plain)
    version_dir = LocalRepository(source).version_dir(name, LocalRepository(source).latest(name))
    weights = weight_bytes(version_dir)
    total = sum(p.stat().st_size for p in version_dir.rglob("*") if p.is_file())
    cache = work / f"{name}-cache"
    cold = pod(tools, store, name, work / f"{name}-pod1", cache)
    print(f"{name} cold: {cold}", file=sys.stderr)
    warm = pod(tools, store, name, work / f"{name}-pod2", cache)
    print(f"{name} second pod: {warm}", file=sys.stderr)
    s5 = tools.s5cmd(plain, work / f"{name}-s5cmd")
    print(f"{name} s5cmd: {s5['seconds']:.2f} s", file=sys.stderr)
    for folder in (cache, work / f"{name}-pod1", work / f"{name}-pod2", work / f"{name}-s5cmd"):
        shutil.rmtree(folder, ignore_errors=True)
    return {"weights_bytes": weights, "version_bytes": total, "cold": cold, "second_pod": warm,
            "s5cmd_fetch_s": round(s5["seconds"], 3), "s5cmd_bytes": s5["bytes"], "load_average": os.getloadavg()}


def run(args: argparse.Namespace) -> dict:
    compileall.compile_dir(ROOT / "repo_manager", quiet=1)  # as pip install does (bench_sync.py's docstring)
    work = Path(tempfile.mkdtemp(prefix="trm-cold-", dir=args.work))
    os.environ["TRM_VLLM_ENGINE_REGISTRY"] = str(work / "engines")  # this run's engines only
    results: dict[str, dict] = {}
    try:
        models = [] if args.no_example else [("smollm2", None)]
        if args.random_gb:
            checkpoint = random_checkpoint(work / "random-llama", args.random_gb)
            models.append((f"llama-{args.random_gb:g}gb", str(checkpoint)))
        for name, checkpoint in models:
            published = publish_llm(work / f"source-{name}", name, checkpoint, args.max_model_len)
            print(f"published {name}: {published.get('bytes')} bytes", file=sys.stderr)
        shutil.rmtree(work / "random-llama", ignore_errors=True)
        with SeaweedServer(work / "weed") as server:
            tools = Tools(server.endpoint, dict(os.environ, **server.env), work, server.pid)
            os.environ.update(server.env)
            for name, _ in models:
                results[name] = bench_model(tools, work, name, work / f"source-{name}",
                                            f"s3://{BUCKET}/{name}/store", f"s3://{BUCKET}/{name}/plain")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"max_model_len": args.max_model_len, "cpus": os.cpu_count(), "results": results}


def table(report: dict) -> str:
    lines = ["| model (weights) | pod | sync (CPU s) | Triton start | engine load (CPU s) | first token "
             "| total to first token | total per GB | s5cmd fetch (cold) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        gb = r["weights_bytes"] / 1e9
        for label, p in (("cold node", r["cold"]), ("second pod on the node", r["second_pod"])):
            fetch = ""
            if label == "cold node":
                fetched = max(p["sync_s"] - r["second_pod"]["sync_s"], 0.0)
                fetch = f"; fetch ≈ {fetched:.2f} s; s5cmd / trm sync {r['s5cmd_fetch_s'] / p['sync_s']:.2f}x"
            lines.append(f"| {name} ({gb:.2f} GB) | {label} | {p['sync_s']:.2f} s ({p['sync_cpu_s']:.1f}{fetch}) "
                         f"| {p['triton_start_s']:.2f} s | {p['engine_load_s']:.1f} s "
                         f"({_cpu(p)}) "
                         f"| {p['first_token_s']:.3f} s | {p['total_s']:.1f} s | {p['total_s'] / gb:.0f} s/GB "
                         f"| {r['s5cmd_fetch_s']:.2f} s |")
    lines.append("")
    for name, r in report["results"].items():
        gb = r["weights_bytes"] / 1e9
        per_gb = {k: r["cold"][k] / gb for k in PHASES if k in r["cold"]}
        lines.append(f"- {name}, cold node, per GB of weights: {_phases(per_gb)}; load average after: "
                     f"{', '.join(f'{x:.1f}' for x in r['load_average'])}")
    if len(report["results"]) == 2:
        lines.append(marginal(*report["results"].values()))
    return "\n".join(lines)


def marginal(small: dict, large: dict) -> str:
    """Seconds per GB that the larger model adds over the smaller one, per phase of the cold pod (the engine
    start's fixed part, imports and warm-up, cancels out)."""
    gb = (large["weights_bytes"] - small["weights_bytes"]) / 1e9
    cold = {k: (large["cold"][k] - small["cold"][k]) / gb for k in PHASES if k in small["cold"]}
    warm = {k: (large["second_pod"][k] - small["second_pod"][k]) / gb for k in PHASES if k in small["second_pod"]}
    return (f"- what one more GB of weights adds (larger minus smaller model, per GB): cold node {_phases(cold)}; "
            f"second pod {_phases(warm)}")


def _cpu(pod_result: dict) -> str:
    cpu = pod_result.get("engine_load_cpu_s")
    return "–" if cpu is None else f"{cpu:.0f}"


def _phases(values: dict[str, float]) -> str:
    return ", ".join(f"{PHASES[k]} {v:.2f} s" for k, v in values.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-gb", type=float, default=0.0,
                        help="also a random-weight Llama of about this many GB (0: SmolLM2 only)")
    parser.add_argument("--no-example", action="store_true", help="skip SmolLM2 (with --random-gb)")
    parser.add_argument("--max-model-len", type=int, default=512, help="context of the published versions")
    parser.add_argument("--work", default=None, help="scratch folder (default: the system temp folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--merge", type=Path, help="an earlier run's cold_start.json whose models come first")
    args = parser.parse_args()
    report = run(args)
    if args.merge:
        report["results"] = json.loads(args.merge.read_text())["results"] | report["results"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.json").write_text(json.dumps(report, indent=2))
    text = table(report) + f"\n\n{report['cpus']} CPUs"
    (args.out / "cold_start.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
