"""Benchmark: the fp16 and int8 versions of a text service beside its fp32 version, on the same embedded Triton.

MiniLM (or mpnet) is published once per precision this node serves, as ``trm publish model --example NAME``
(fp32, version 1) and with ``--precision P --eval-data`` a file of texts unlike trm's own
(tests/test_precision.py's TEXTS: support tickets, recipes, contract clauses, sports and news lines).
Printed: the encoder's bytes, the quality gate's figures (and the int8 recipes tried), and the throughput of
the served ensemble for each version in rounds of alternating order (4 clients sending batches of 8 texts
over HTTP, the shape of bench_hf_publish.py), as the ratio to fp32 per round.

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
from repo_manager.core.errors import VerificationError  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.publish.huggingface.checkpoint import example_checkpoint  # noqa: E402
from repo_manager.ops.publish.huggingface.precision import PRECISIONS, served_here  # noqa: E402
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
    precisions = [p for p in PRECISIONS if p in served_here()[0]]  # fp32 first: version 1 is the reference
    results: dict = {"example": args.example, "precisions": precisions, "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="trm-bench-precision-") as tmp:
        settings = Settings(repository=Path(tmp) / "repo")
        data = Path(tmp) / "eval.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        checkpoint = example_checkpoint(args.example)
        versions, refused = {}, {}
        for precision in list(precisions):
            try:
                versions[precision] = publish_model(settings, checkpoint, "svc", precision=precision,
                                                    eval_data=data if precision != "fp32" else None).version
            except VerificationError as exc:  # the gate's refusal is a result: recorded, the others measured
                refused[precision] = exc.message
                precisions.remove(precision)
                print(f"{args.example} {precision}: refused: {exc.message}", file=sys.stderr)
        results["refused"] = refused
        repo = LocalRepository(settings.repository)
        sizes = {p: next(f.size for f in repo.manifest("svc_encoder", v).files if f.path == "model.onnx")
                 for p, v in versions.items()}
        results["encoder_bytes"] = sizes
        results["quality"] = {p: repo.manifest("svc", v).source["quality"] for p, v in versions.items() if p != "fp32"}
        rounds = []
        with TritonServer(settings.repository) as server, TritonClient(server.url) as client:
            work = batches(8, 64)
            for number in range(args.rounds):
                order = precisions if number % 2 == 0 else precisions[::-1]
                measured = {}
                for precision in order:  # one version loaded at a time (load_version loads exactly it)
                    load_version(client, repo, "svc", versions[precision])
                    measure(runner(server.url, "svc"), work, 1.0, 4)  # warm-up, not counted
                    measured[precision] = summary([measure(runner(server.url, "svc"), work, args.seconds, 4)])
                base = measured["fp32"]["texts_per_s"]
                rounds.append(measured | {"ratio": {p: round(measured[p]["texts_per_s"] / base, 3)
                                                    for p in precisions[1:]}})
                print(f"round {number + 1}: " + ", ".join(f"{p} {measured[p]['texts_per_s']} texts/s"
                                                          for p in precisions), file=sys.stderr)
        results["rounds"] = rounds
    results["load_average_after"] = os.getloadavg()
    for precision in precisions[1:]:
        gate = results["quality"][precision]
        tried = ", ".join(t["recipe"] + (" (kept)" if t["passed"] else "") for t in gate.get("tried", []))
        print(f"{args.example} {precision}: encoder {sizes[precision] / 1e6:.1f} MB "
              f"({sizes[precision] / sizes['fp32']:.2f} of fp32's {sizes['fp32'] / 1e6:.1f} MB); quality on "
              f"{len(TEXTS)} texts: " + ", ".join(f"{k} {v}" for k, v in gate["figures"].items())
              + (f"; int8 recipes tried: {tried}" if tried else ""))
    for precision, message in results["refused"].items():
        print(f"{args.example} {precision}: not published ({message})")
    print("| round | " + " | ".join(f"{p} texts/s (p50 ms)" for p in precisions) + " | "
          + " | ".join(f"{p} / fp32" for p in precisions[1:]) + " |")
    print("|---" * (2 * len(precisions)) + "|")
    for number, r in enumerate(rounds, 1):
        print(f"| {number} | " + " | ".join(f"{r[p]['texts_per_s']} ({r[p]['p50_ms']})" for p in precisions) + " | "
              + " | ".join(str(r["ratio"][p]) for p in precisions[1:]) + " |")
    print(f"load average before/after {results['load_average_before'][0]:.1f}/{results['load_average_after'][0]:.1f}")
    out = ROOT / "bench" / "results" / f"bench_precision_{args.example}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
