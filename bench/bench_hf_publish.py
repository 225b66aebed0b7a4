"""Benchmark: publishing all-MiniLM-L6-v2 and serving it, in one run (a few minutes on 2 CPU cores).

1. Publish time, split into: loading the checkpoint (tokenizer + weights), ONNX export, verification on
   Triton (embedded server start, loading the three models, the edge-case requests, the PyTorch reference)
   and writing the versions.
2. Throughput of the embedding service through Triton (HTTP, the ensemble: tokenizer -> ONNX encoder with
   pooling) with 1 and with 4 concurrent clients, against the same checkpoint called in PyTorch directly
   (transformers tokenizer + model + mean pooling + normalisation) in this process, on the same batches.

    .venv/bin/python bench/bench_hf_publish.py [--seconds 10] [--batch 8]

Results: a table on stdout and bench/results/hf_publish-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import json
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

from repo_manager.publish import publish_model  # noqa: E402
from repo_manager.publish.huggingface import example_checkpoint  # noqa: E402
from repo_manager.repository import LocalRepository  # noqa: E402
from repo_manager.serving import load_version, text_inputs  # noqa: E402
from repo_manager.settings import Settings  # noqa: E402
from repo_manager.triton.client import TritonClient  # noqa: E402
from repo_manager.triton.server import TritonServer  # noqa: E402

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


def measure(run, work: list[list[str]], seconds: float, threads: int = 1) -> dict[str, float]:
    """Run ``run(texts)`` over ``work`` round-robin in ``threads`` threads for ``seconds``."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(offset: int) -> None:
        state = run() if callable(run) and getattr(run, "per_thread", False) else run
        i = offset
        mine = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            state(work[i % len(work)])
            mine.append(time.perf_counter() - t0)
            i += threads
        with lock:
            latencies.extend(mine)

    started = time.monotonic()
    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.monotonic() - started
    texts = len(latencies) * len(work[0])
    return {"requests": len(latencies), "sentences_per_s": round(texts / elapsed, 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
            "p95_ms": round(float(np.percentile(latencies, 95)) * 1000, 1)}


def triton_runner(url: str):
    def make():
        client = TritonClient(url)
        config = client.model_config("minilm")

        def run(texts: list[str]) -> np.ndarray:
            return client.infer("minilm", text_inputs(config, texts))["EMBEDDING"]
        return run
    make.per_thread = True
    return make


def torch_runner(checkpoint: Path):
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModel.from_pretrained(str(checkpoint)).eval()

    def run(texts: list[str]) -> np.ndarray:
        batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=1).numpy()
    return run, torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each throughput run")
    parser.add_argument("--batch", type=int, default=8, help="sentences per request")
    args = parser.parse_args()
    checkpoint = example_checkpoint("minilm")
    machine = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    results: dict = {"machine": machine, "batch": args.batch, "seconds_per_run": args.seconds}
    with tempfile.TemporaryDirectory(prefix="trm-bench-") as tmp:
        settings = Settings(repository=Path(tmp) / "repo")
        t0 = time.monotonic()
        published = publish_model(settings, checkpoint, "minilm",
                                  progress=lambda m: print(f"· {m}", file=sys.stderr))
        total = time.monotonic() - t0
        timings = published.timings
        results["publish"] = {"total_s": round(total, 2), "export_s": timings["convert"],
                              "verify_s": timings["verify"], "write_s": timings["write"],
                              "load_checkpoint_s": round(total - sum(timings.values()), 2),
                              "min_cosine": min(c["min_cosine"] for c in published.verification["cases"])}
        work = batches(args.batch, 64)
        with TritonServer(settings.repository) as server:
            with TritonClient(server.url) as client:
                load_version(client, LocalRepository(settings.repository), "minilm")
            runner = triton_runner(server.url)
            runner()(work[0])  # warm
            print("· measuring Triton, 1 client", file=sys.stderr)
            results["triton_1_client"] = measure(runner, work, args.seconds, 1)
            print("· measuring Triton, 4 clients", file=sys.stderr)
            results["triton_4_clients"] = measure(runner, work, args.seconds, 4)
            check = runner()(work[0])
    run, threads = torch_runner(checkpoint)
    reference = run(work[0])
    results["max_abs_diff_triton_vs_torch"] = float(np.max(np.abs(check - reference)))
    print("· measuring PyTorch in-process", file=sys.stderr)
    results["pytorch_direct"] = {**measure(run, work, args.seconds, 1), "torch_threads": threads}
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"hf_publish-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nresults: {path}")


def print_table(r: dict) -> None:
    p = r["publish"]
    print("\nMiniLM publish                      seconds")
    for key, label in [("load_checkpoint_s", "load checkpoint (tokenizer, weights)"), ("export_s", "ONNX export"),
                       ("verify_s", "verification on Triton"), ("write_s", "writing versions"),
                       ("total_s", "total")]:
        print(f"  {label:<36}{p[key]:>7.2f}")
    print(f"  verification: min cosine vs PyTorch {p['min_cosine']:.6f}")
    print(f"\nembedding throughput (batch {r['batch']}, {r['seconds_per_run']:g} s each)  sentences/s  p50 ms  p95 ms")
    for key, label in [("triton_1_client", "Triton ensemble, 1 client"),
                       ("triton_4_clients", "Triton ensemble, 4 clients"), ("pytorch_direct", "PyTorch in-process")]:
        m = r[key]
        print(f"  {label:<44}{m['sentences_per_s']:>11.1f}{m['p50_ms']:>8.1f}{m['p95_ms']:>8.1f}")
    print(f"  Triton vs PyTorch max abs diff: {r['max_abs_diff_triton_vs_torch']:.2e}")


if __name__ == "__main__":
    main()
