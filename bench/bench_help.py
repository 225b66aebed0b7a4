"""Whole-process time of `trm --help` and of every `trm COMMAND --help` (issue 17: under 0.2 s each).

Each is run as a fresh process (``python -m repo_manager``, what the `trm` script runs), several times;
the median and the best wall time are reported, and the median CPU time (user + system of the child: on a
shared, loaded machine the wall time mostly measures the queue for a core, the CPU time the work itself),
against a bare ``python -c pass`` for the interpreter's own start.

    python bench/bench_help.py [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from repo_manager.cli.commands import COMMANDS  # noqa: E402


def timed(args: list[str], runs: int) -> dict[str, float]:
    seconds, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {"median_s": round(statistics.median(seconds), 3), "best_s": round(min(seconds), 3),
            "cpu_s": round(statistics.median(cpu), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    trm = [sys.executable, "-m", "repo_manager"]
    results = {"python -c pass": timed([sys.executable, "-c", "pass"], options.runs),
               "trm --help": timed([*trm, "--help"], options.runs)}
    for name in sorted(COMMANDS):
        results[f"trm {name} --help"] = timed([*trm, name, "--help"], options.runs)
    results["trm publish model --help"] = timed([*trm, "publish", "model", "--help"], options.runs)
    worst = max(v["median_s"] for k, v in results.items() if k.startswith("trm"))
    worst_best = max(v["best_s"] for k, v in results.items() if k.startswith("trm"))
    if options.json:
        print(json.dumps({"runs": options.runs, "results": results, "worst_median_s": worst,
                          "worst_best_s": worst_best}, indent=2))
        return
    for name, value in results.items():
        print(f"{name:<32} median {value['median_s']:.3f} s   best {value['best_s']:.3f} s   "
              f"cpu {value['cpu_s']:.3f} s")
    print(f"worst median of the trm commands: {worst:.3f} s, worst best: {worst_best:.3f} s "
          f"({'under' if worst < 0.2 else 'OVER'} 0.2 s); load average {Path('/proc/loadavg').read_text()[:14]}")


if __name__ == "__main__":
    main()
