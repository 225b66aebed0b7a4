"""Benchmark: batching configs of one model side by side, measured by the independent load in interleaved rounds.

For the questions a single search run cannot answer because one measurement of a config differs from the next by
a ladder step on this machine: what the fallback queue policy costs at capacity (the same batching with and
without a queue timeout), or which queue delay carries the most at busy rates. The model is the tuning check's
(``tests/cost_model.py``: ``--fixed-ms`` + ``--per-item-ms`` per item, a sleep). Each ``--config`` is
``MAX_BATCH:INSTANCES:DELAY_US[:QUEUE_TIMEOUT_US]``; every one is loaded in turn on one embedded tritonserver and
measured by ``bench/independent_load.py`` (a separate process, fresh Poisson arrivals each round), in ``--rounds``
rounds (the order alternates) after ``--warmup-rounds`` discarded ones: p99 at low, peak and peak x headroom, then
a capacity ladder in 10 % steps, with the requests rejected on it.

Prints one table (markdown) and writes ``bench/results/bench_configs.json``. From the repository root, the
fallback policy's cost (about 7 minutes on 2 cores):

    PYTHONPATH=$PWD python bench/bench_configs.py --config 8:2:0:15250 --config 8:2:0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_tuning import independent_rounds  # noqa: E402
from cost_model import write_cost_model  # noqa: E402
from run_and_record import run_and_record  # noqa: E402

from repo_manager.adapters.repository import LocalRepository  # noqa: E402
from repo_manager.adapters.triton.client import TritonClient  # noqa: E402
from repo_manager.adapters.triton.server import TritonServer  # noqa: E402
from repo_manager.core.settings import Settings  # noqa: E402
from repo_manager.ops.publish import publish_model  # noqa: E402
from repo_manager.ops.serving import load_version, version_config  # noqa: E402
from repo_manager.ops.tuning import Candidate  # noqa: E402


def parse_config(text: str) -> Candidate:
    """``MAX_BATCH:INSTANCES:DELAY_US[:QUEUE_TIMEOUT_US]`` as a dynamic-batching candidate."""
    try:
        fields = [int(part) for part in text.split(":")]
    except ValueError:
        fields = []
    if len(fields) not in (3, 4) or min(fields) < 0 or not fields[0] or not fields[1]:
        raise argparse.ArgumentTypeError(f"{text!s} is not MAX_BATCH:INSTANCES:DELAY_US[:QUEUE_TIMEOUT_US] "
                                         "(whole numbers, max batch and instances at least 1)")
    candidate = Candidate(fields[0], fields[1], True, fields[2], (), "grid")
    return candidate.with_queue_policy(fields[3], origin="grid") if len(fields) == 4 and fields[3] else candidate


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trm-bench-configs-"))
    settings = Settings(repository=tmp / "repo")
    source = write_cost_model(tmp / "src", name="ranker", fixed_ms=args.fixed_ms, per_item_ms=args.per_item_ms,
                              max_batch_size=32, dynamic_batching=True)
    publish_model(settings, source, "ranker", verify_model=False)
    repo = LocalRepository(settings.repository)
    configs = {c.key: c for c in args.config}
    with TritonServer(repo.root) as server, TritonClient(server.url) as client:
        load_version(client, repo, "ranker")
        base = version_config(repo, "ranker", 1)
        if args.warmup_rounds:
            independent_rounds(argparse.Namespace(**{**vars(args), "rounds": args.warmup_rounds}), client, server.url,
                               base, configs, seed=901)
        measured = independent_rounds(args, client, server.url, base, configs)
    return {"model": {"fixed_ms": args.fixed_ms, "per_item_ms": args.per_item_ms},
            "slo": {"p99_ms": args.p99_ms, "low_rps": args.low, "peak_rps": args.peak,
                    "headroom_rps": args.peak * args.headroom},
            "labels": {c.key: c.label for c in args.config}, **measured}


def render(results: dict) -> str:
    slo = results["slo"]
    lines = [f"SLO p99 <= {slo['p99_ms']:g} ms at low {slo['low_rps']:g}/s, peak {slo['peak_rps']:g}/s, peak x "
             f"headroom {slo['headroom_rps']:g}/s; model: {results['model']['fixed_ms']} ms + "
             f"{results['model']['per_item_ms']} ms per item",
             *(f"- `{key}`: {label}" for key, label in results["labels"].items()), "",
             "| round | config | low / peak / headroom p99 ms | capacity/s | ladder: rate p99 ms (rejected) |",
             "|---|---|---|---|---|"]
    for r in results["rounds"]:
        for key, m in r["measured"].items():
            levels = " / ".join(f"{p['p99_ms']:g}" for p in m["levels"])
            ladder = ", ".join(f"{p['rate']:g} {p['p99_ms']:g}" + (f" ({p['rejected']})" if p["rejected"] else "")
                               for p in m["ladder"])
            capacity = "-" if m["capacity_rps"] is None else f"{m['capacity_rps']:g}"
            lines.append(f"| {r['round']} | `{key}` | {levels} | {capacity} | {ladder} |")
    lines.append("")
    for key in results["labels"]:
        capacities = " / ".join("-" if r["measured"][key]["capacity_rps"] is None
                                else f"{r['measured'][key]['capacity_rps']:g}" for r in results["rounds"])
        headroom = " / ".join(f"{r['measured'][key]['levels'][-1]['p99_ms']:g}" for r in results["rounds"])
        lines.append(f"`{key}`: capacity {capacities}/s; p99 at peak x headroom {headroom} ms; every level met in "
                     f"every round: {results['meets_slo_every_round'][key]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=parse_config, action="append", required=True,
                        help="MAX_BATCH:INSTANCES:DELAY_US[:QUEUE_TIMEOUT_US], two or more")
    parser.add_argument("--p99-ms", type=float, default=25.0)
    parser.add_argument("--low", type=float, default=50.0)
    parser.add_argument("--peak", type=float, default=400.0)
    parser.add_argument("--headroom", type=float, default=1.2)
    parser.add_argument("--fixed-ms", type=float, default=6.0)
    parser.add_argument("--per-item-ms", type=float, default=0.75)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds measured first and discarded")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bench_configs.json")
    args = parser.parse_args()
    if len({c.key for c in args.config}) < 2:
        parser.error("--config: at least two different configs")
    run_and_record(run, render, args)


if __name__ == "__main__":
    main()
