"""Benchmark: an int8 version of a text service beside its fp32 version, on the same embedded Triton.

MiniLM (or mpnet) is published twice, as ``trm publish model --example NAME`` (fp32, version 1) and with
``--precision int8 --eval-data`` a file of texts unlike trm's own (tests/test_precision.py's TEXTS: support
tickets, recipes, contract clauses, sports and news lines; version 2). Printed: the encoder's bytes, the
quality gate's figures for int8, and the throughput of the served ensemble for each version in alternating
rounds (4 clients sending batches of 8 texts over HTTP, the shape of bench_hf_publish.py), as the ratio
int8 / fp32 per round.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_precision.py [--example mpnet] [--seconds 10] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_hf_publish import batches, measure, summary  # noqa: E402
from test_precision import TEXTS  # noqa: E402

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint  # noqa: E402
from repo_manager.ops.serving import load_version, text_inputs  # noqa: E402


def runner(url: str, name: str):
    def make():
        client = TritonClient(url)
        config = client.model_config(name)

        def run(texts: list[str]):
            return client.infer(name, text_inputs(config, texts))["EMBEDDING"]
        return run
    make.per_thread = True
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", choices=["minilm", "mpnet"], default="minilm")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per version and round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    results: dict = {"example": args.example, "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="trm-bench-precision-") as tmp:
        settings = Settings(repository=Path(tmp) / "repo")
        data = Path(tmp) / "eval.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        checkpoint = example_checkpoint(args.example)
        publish_model(settings, checkpoint, "svc")
        publish_model(settings, checkpoint, "svc", precision="int8", eval_data=data)
        repo = LocalRepository(settings.repository)
        sizes = {v: next(f.size for f in repo.manifest("svc_encoder", v).files if f.path == "model.onnx")
                 for v in (1, 2)}
        results["encoder_bytes"] = {"fp32": sizes[1], "int8": sizes[2]}
        results["quality"] = repo.manifest("svc", 2).source["quality"]
        rounds = []
        with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
            work = batches(8, 64)
            for number in range(args.rounds):
                order = (1, 2) if number % 2 == 0 else (2, 1)
                measured = {}
                for version in order:  # one version loaded at a time (load_version loads exactly it)
                    load_version(client, repo, "svc", version)
                    measure(runner(server.url, "svc"), work, 1.0, 4)  # warm-up, not counted
                    measured[version] = summary([measure(runner(server.url, "svc"), work, args.seconds, 4)])
                rounds.append({"fp32": measured[1], "int8": measured[2],
                               "ratio": round(measured[2]["texts_per_s"] / measured[1]["texts_per_s"], 3)})
                print(f"round {number + 1}: fp32 {measured[1]['texts_per_s']} texts/s, int8 "
                      f"{measured[2]['texts_per_s']} texts/s, ratio {rounds[-1]['ratio']}", file=sys.stderr)
        results["rounds"] = rounds
    results["load_average_after"] = os.getloadavg()
    figures = results["quality"]["figures"]
    print(f"{args.example}: encoder {sizes[1] / 1e6:.1f} MB fp32, {sizes[2] / 1e6:.1f} MB int8 "
          f"({sizes[2] / sizes[1]:.2f}); int8 quality on {len(TEXTS)} texts: "
          + ", ".join(f"{k} {v}" for k, v in figures.items()))
    print("| round | fp32 texts/s (p50 ms) | int8 texts/s (p50 ms) | int8 / fp32 |\n|---|---|---|---|")
    for number, r in enumerate(rounds, 1):
        print(f"| {number} | {r['fp32']['texts_per_s']} ({r['fp32']['p50_ms']}) | {r['int8']['texts_per_s']} "
              f"({r['int8']['p50_ms']}) | {r['ratio']} |")
    print(f"load average before/after {results['load_average_before'][0]:.1f}/{results['load_average_after'][0]:.1f}")
    out = ROOT / "bench" / "results" / f"bench_precision_{args.example}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
