"""The end every tuning bench shares: run it, record its wall time and how busy the machine was, write the JSON,
print the table.

The machine is shared: every latency a bench measures depends on its load, so the load average before and after
goes into the results beside the figures. A bench stopped by SIGTERM or SIGHUP ends as trm does
(``terminate_on_signals``): its servers are stopped and their shared memory freed on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from repo_manager.adapters.process import terminate_on_signals
from repo_manager.core import config as cfg


def run_and_record(run: Callable[[argparse.Namespace], dict], render: Callable[[dict], str],
                   args: argparse.Namespace) -> dict:
    """``run(args)``, with ``total_seconds`` and ``load_average`` added, written to ``args.out`` as JSON; prints
    ``render``'s text and a summary line. Returns the results."""
    started, load_before = time.monotonic(), os.getloadavg()
    with terminate_on_signals():
        results = run(args)
    results["total_seconds"] = round(time.monotonic() - started, 1)
    results["load_average"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.atomic_write_bytes(args.out, (json.dumps(results, indent=2, default=str) + "\n").encode())
    print(render(results))
    load = results["load_average"]
    print(f"\ntotal {results['total_seconds']:g} s; load average before/after {load['before'][0]:.1f}"
          f"/{load['after'][0]:.1f} on {os.cpu_count()} CPUs; full results in {args.out}")
    return results
