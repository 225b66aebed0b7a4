"""The report folder of a tuning run: ``tuning.json``, ``tuning.md`` and ``p99_vs_throughput.png``.

The JSON is the full tuning record (the same one a written version's manifest carries). The markdown
has one row per measured point, every candidate at every traffic level it was measured at (a
candidate stops at its first missed level, which the table says), the chosen values with the rule and
evidence, what was pruned and why, and the environment.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from repo_manager.config import atomic_write_bytes
from repo_manager.tuning.prober import Point

COLUMNS = ("candidate", "level", "offered/s", "achieved/s", "requests", "p50", "p90", "p99", "max", "mean batch",
           "batch histogram", "queue ms", "compute ms", "meets SLO", "valid", "note")


def _ms(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def point_row(point: Point) -> list[str]:
    m = point.measurement
    if m is None:
        return [point.candidate, point.level, f"{point.rate:.0f}"] + ["-"] * 10 + ["no", "-", point.note]
    server = m.server
    histogram = " ".join(f"{k}:{v}" for k, v in server.batch_histogram.items()) if server else "-"
    return [point.candidate, point.level, f"{point.rate:.0f}", f"{m.achieved_rps:.0f}", str(m.requests),
            _ms(m.p50_ms), _ms(m.p90_ms), _ms(m.p99_ms), _ms(m.max_ms),
            f"{server.mean_batch:.2f}" if server else "-", histogram or "-",
            f"{server.queue_ms:.2f}" if server else "-", f"{server.compute_ms:.2f}" if server else "-",
            "yes" if point.meets_slo else "no", "yes" if m.valid else "no",
            ("saturated; " if m.saturated else "") + point.note]


def markdown_table(rows: list[list[str]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(record: dict[str, Any], points: list[Point]) -> str:
    slo = record["slo"]
    chosen = record.get("chosen")
    out = [f"# Batching tuning of `{record['model']}`", "",
           f"SLO: p99 <= {slo['p99_ms']:g} ms at low {slo['low_rps']:g}/s, peak {slo['peak_rps']:g}/s and "
           f"peak x headroom {slo['headroom_rps']:g}/s. Server {record['server']}, search took "
           f"{record['search_seconds']:g} s.", ""]
    if chosen:
        out += [f"**Chosen:** `{chosen['key']}`", ""]
        out += [f"- **{name}**: {text}" for name, text in record["evidence"].items()]
    else:
        closest = record.get("closest")
        out += ["**No candidate met the SLO at every level.** Nothing was written.", ""]
        if closest:
            out += [f"Closest: `{closest['key']}` ({closest['origin']})."]
    out += ["", "## Candidates", "",
            markdown_table([[e["key"], e["origin"], "yes" if e["eligible"] else "no",
                             f"{e['capacity_rps']:.0f}" if e["capacity_rps"] else "-",
                             ", ".join(f"{lvl}: {'-' if p is None else _ms(p['p99_ms'])}"
                                       for lvl, p in e["levels"].items()), e.get("capacity_note", "")]
                            for e in record["candidates"]],
                           ("candidate", "origin", "meets every level", "capacity/s", "p99 ms by level", "note")),
            "", "A level shown as `-` was not measured: the candidate had already missed the SLO at a "
                "harder level (levels run headroom, peak, low).", "",
            "## Every measured point", "", markdown_table([point_row(p) for p in points]), ""]
    if record["pruned"]:
        out += ["## Pruned without measuring", "",
                markdown_table([[p["key"], p["reason"]] for p in record["pruned"]], ("candidate", "reason")), ""]
    profile = record["profile"]
    out += ["## Execution-time profile", "",
            markdown_table([[k, f"{v:.2f}", f"{profile['per_request_ms'][k]:.2f}"]
                            for k, v in profile["exec_ms_by_batch"].items()],
                           ("batch size", "execution ms", "ms per request")),
            "", f"Client + network overhead per request: {profile['overhead_ms']:.2f} ms.", ""]
    if record["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in record["notes"]] + [""]
    out += ["## Environment", "", "```json", json.dumps(record["environment"], indent=2), "```", ""]
    return "\n".join(out)


def plot(points: list[Point], slo_ms: float, path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only a report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.5))
    by_candidate: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if p.measurement is not None and p.measurement.valid and p.level != "remeasure":
            p99 = min(p.measurement.p99_ms, slo_ms * 20)  # saturated points: clipped, still visibly failing
            by_candidate.setdefault(p.candidate, []).append((p.measurement.achieved_rps, p99))
    for name, values in sorted(by_candidate.items()):
        values.sort()
        ax.plot([v[0] for v in values], [v[1] for v in values], marker="o", label=name)
    ax.axhline(slo_ms, color="red", linestyle="--", label=f"SLO p99 {slo_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("p99 latency (ms, log)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_report(folder: Path, record: dict[str, Any], points: list[Point]) -> tuple[str, ...]:
    """Write the three files into ``folder`` (created); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = folder / "tuning.json", folder / "tuning.md", folder / "p99_vs_throughput.png"
    atomic_write_bytes(json_path, (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(md_path, render_markdown(record, points).encode())
    plot(points, record["slo"]["p99_ms"], png_path, f"{record['model']}: p99 vs throughput per candidate")
    return str(json_path), str(md_path), str(png_path)
