"""The report folder of a tuning run: ``tuning.json``, ``tuning.md``, ``p99_vs_throughput.png`` and, when
a queue policy was tried under overload, ``overload.png`` (every request's latency over time, rejections
marked, for each policy tried).

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

from repo_manager.core.config import atomic_write_bytes
from repo_manager.ops.tuning.overload import RECOVERY_PHASE, OverloadOutcome
from repo_manager.ops.tuning.prober import REPEATED, Point

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


def _meets(evaluation: dict[str, Any]) -> str:
    """The "meets every level" cell: yes, no, or the busy levels when low traffic was not measured."""
    if evaluation["eligible"]:
        return "yes"
    levels = evaluation["levels"]
    busy = all(levels.get(level) and levels[level]["meets_slo"] for level in ("headroom", "peak"))
    return "peak and headroom (low not measured)" if busy and levels.get("low") is None else "no"


def render_markdown(record: dict[str, Any], points: list[Point]) -> str:
    slo = record["slo"]
    out = [f"# Batching tuning of `{record['model']}`", "",
           f"SLO: p99 <= {slo['p99_ms']:g} ms at low {slo['low_rps']:g}/s, peak {slo['peak_rps']:g}/s and "
           f"peak x headroom {slo['headroom_rps']:g}/s. Server {record['server']}, search took "
           f"{record['search_seconds']:g} s.", ""]
    out += headline(record)
    out += overload_section(record.get("overload"), slo["p99_ms"])
    out += ["", "## Candidates", "",
            markdown_table([[e["key"], e["origin"], _meets(e),
                             f"{e['capacity_rps']:.0f}" if e["capacity_rps"] else "-",
                             ", ".join(f"{lvl}: {'-' if p is None else _ms(p['p99_ms'])}"
                                       for lvl, p in e["levels"].items()), e.get("capacity_note", "")]
                            for e in record["candidates"]],
                           ("candidate", "origin", "meets every level", "capacity/s", "p99 ms by level", "note")),
            "", "A level shown as `-` was not measured: the candidate had already missed the SLO at a "
                "harder level (levels run headroom, peak), or, at low traffic, it was not within one ladder "
                "step of the best capacity, where low traffic could decide.", "",
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


def headline(record: dict[str, Any]) -> list[str]:
    """What happened, first: the choice (batching, queue policy), or why there is none."""
    chosen, batching, overload = record.get("chosen"), record.get("batching"), record.get("overload")
    written = record.get("written_version")
    out: list[str] = []
    if chosen:
        out += [f"**Chosen:** `{chosen['key']}`" + (f" (written as version {written})." if written else "."), ""]
    if batching and overload and overload.get("outcome") != "policy-held":
        fallback = overload.get("fallback_summary") if chosen else None
        policy = (f"not shown to hold; {overload['summary']}; {fallback}." if fallback else
                  f"none; {overload['summary']}." + ("" if chosen else
                                                     " Nothing was written (a queue policy was required)."))
        out += [f"**Batching:** `{batching['key']}` met the SLO at every level. **Queue policy:** {policy}", ""]
    elif batching and overload:
        out += [f"**Batching:** `{batching['key']}` met the SLO at every level. **Queue policy:** "
                f"{overload['summary']}.", ""]
    if batching:
        out += [f"- **{name}**: {text}" for name, text in record["evidence"].items()]
    else:
        closest = record.get("closest")
        out += ["**No candidate met the SLO at every level.** Nothing was written.", ""]
        if closest:
            out += [f"Closest: `{closest['key']}` ({closest['origin']})."]
    return out


def _opt_ms(value: float | None) -> str:
    return "-" if value is None else _ms(value)


def overload_section(overload: dict[str, Any] | None, slo_ms: float) -> list[str]:
    if not overload:
        return []
    offered = sorted({p["offered_rps"] for p in overload["points"]}) or [overload["offered_rps"]]
    rates = " and ".join(f"{r:.0f}/s" for r in offered)
    out = ["", "## Overload", "",
           f"Outcome: **{overload.get('outcome', '-')}**: {overload.get('summary', '')}.", "",
           f"Each try: open-loop Poisson traffic at {overload['factor']:g} x the measured capacity ({rates} "
           f"offered; the capacity of each try is in its row), then {overload['recover_rps']:.0f}/s (the load "
           "drops). Goodput: answers within the SLO per second.", ""]
    rows = []
    for p in overload["points"]:
        o = p["overload"]
        rows.append([p["candidate"], f"{p.get('capacity_rps', 0):.0f}", f"{o['offered_rps']:.0f}",
                     f"{o['send_rps']:.0f}", _opt_ms(o["accepted_p99_ms"]),
                     f"{o['rejected_fraction']:.1%}", _opt_ms(o["rejection_p50_ms"]), _opt_ms(o["rejection_p99_ms"]),
                     f"{o['goodput_rps']:.0f}", str(o["errors"]),
                     "-" if p["recover_s"] is None else f"{p['recover_s']:.2f}",
                     "yes" if p["meets"] else "no", p["note"]])
    out.append(markdown_table(rows, ("policy", "capacity/s", "offered/s", "sent/s", "accepted p99 ms", "rejected",
                                     "rejection p50 ms", "rejection p99 ms", "goodput/s", "errors",
                                     "recover s", "keeps SLO", "note")))
    point = overload.get("overload_point")
    if point:
        out += ["", f"**Overload point** ({overload['factor']:g} x capacity): accepted p99 "
                    f"{_opt_ms(point['accepted_p99_ms'])} ms (SLO {slo_ms:g}), {point['rejected_fraction']:.1%} "
                    f"rejected in {_opt_ms(point['rejection_p50_ms'])} ms (p50) / {_opt_ms(point['rejection_p99_ms'])}"
                    f" ms (p99), goodput {point['goodput_rps']:.0f}/s, recovered {point['time_to_recover_s']:.2f} s "
                    "after the load dropped."]
        higher = overload.get("higher_overload_point")
        if higher:
            factor = higher["offered_rps"] / overload["capacity_rps"] if overload.get("capacity_rps") else 0
            head = f"**The same policy at {factor:.2g} x capacity** ({higher['offered_rps']:.0f}/s): "
            if higher.get("drive_problem"):
                out += ["", head + f"not measurable from this client ({higher['drive_problem']})."]
            else:
                recovered = "-" if higher["time_to_recover_s"] is None else f"{higher['time_to_recover_s']:.2f} s"
                out += ["", head + f"accepted p99 {_opt_ms(higher['accepted_p99_ms'])} ms, "
                        f"{higher['rejected_fraction']:.1%} rejected, goodput {higher['goodput_rps']:.0f}/s, "
                        f"recovered {recovered} after the load dropped: "
                        + ("kept the SLO." if higher["kept_slo"] else
                           "did not keep the SLO (a spike this large needs more replicas).")]
    elif overload.get("closest"):
        verdict = ("**The overload could not be driven from this client**, so no policy was judged."
                   if overload.get("outcome") == "not-measurable" else
                   "**No queue policy kept the SLO under overload.**")
        out += ["", f"{verdict} Tried: "
                    + "; ".join(f"`{k}`" for k in dict.fromkeys(p["candidate"] for p in overload["points"]))
                    + f". Closest: `{overload['closest']['key']}`."]
        if overload.get("fallback_summary"):
            out += ["", f"Without a policy shown to hold, {overload['fallback_summary']}."]
    out += [f"- {n}" for n in overload.get("notes", [])]
    return out


def plot_overload(overload: OverloadOutcome, slo_ms: float, path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only a report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib only when a picture is drawn

    traced = [p for p in overload.points if p.trace is not None]
    fig, axes = plt.subplots(len(traced), 1, figsize=(9, 2.6 * len(traced) + 0.6), squeeze=False, sharex=True)
    for number, (ax, point) in enumerate(zip(axes[:, 0], traced), 1):
        trace = point.trace
        assert trace is not None
        for code, colour, label in ((0, "tab:blue", "answered"), (1, "tab:orange", "rejected"),
                                    (2, "tab:red", "failed")):
            mask = trace.outcome == code
            if mask.any():
                ax.scatter(trace.sent_s[mask], trace.latency_ms[mask], s=3, c=colour, label=label)
        ax.axhline(slo_ms, color="red", linestyle="--", linewidth=1)
        ax.axvline(trace.starts[1], color="grey", linestyle=":", linewidth=1)
        ax.axvline(trace.starts[RECOVERY_PHASE], color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylabel("latency ms")
        verdict = "keeps the SLO" if point.meets else f"misses: {point.note}"[:110]
        factor = point.rate / point.capacity_rps if point.capacity_rps else overload.factor
        ax.set_title(f"try {number}: {point.candidate.key} at {point.rate:.0f}/s ({factor:.2g} x "
                     f"{point.capacity_rps:.0f}/s): {verdict}", fontsize=8)
        ax.legend(fontsize=7, loc="upper right", markerscale=3)
    axes[-1, 0].set_xlabel(f"seconds from the first request ({overload.recover_rps:.0f}/s warm-up, the overload "
                           f"between the dotted lines, then {overload.recover_rps:.0f}/s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def plot(points: list[Point], slo_ms: float, path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only a report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib only when a picture is drawn

    fig, ax = plt.subplots(figsize=(9, 5.5))
    by_candidate: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if p.measurement is not None and p.measurement.valid and p.level not in REPEATED:
            p99 = min(p.measurement.p99_ms, slo_ms * 20)  # saturated points: clipped, still visibly failing
            by_candidate.setdefault(p.candidate, []).append((p.measurement.achieved_rps, p99))
    for name, values in sorted(by_candidate.items()):
        values.sort(key=lambda v: v[0])  # by throughput: a line never runs backwards
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


def plot_title(record: dict[str, Any]) -> str:
    chosen = record.get("batching")
    what = f"batching chosen: {chosen['key']}" if chosen else "no candidate met the SLO at every level"
    return f"{record['model']}: p99 vs achieved throughput per candidate ({what})"


def write_report(folder: Path, record: dict[str, Any], points: list[Point],
                 overload: OverloadOutcome | None = None) -> tuple[str, ...]:
    """Write the files into ``folder`` (created); returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = folder / "tuning.json", folder / "tuning.md", folder / "p99_vs_throughput.png"
    atomic_write_bytes(json_path, (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(md_path, render_markdown(record, points).encode())
    plot(points, record["slo"]["p99_ms"], png_path, plot_title(record))
    files = [str(json_path), str(md_path), str(png_path)]
    if overload is not None and any(p.trace is not None for p in overload.points):
        overload_png = folder / "overload.png"
        plot_overload(overload, record["slo"]["p99_ms"], overload_png,
                      f"{record['model']}: every request of each queue-policy try ({overload.outcome})")
        files.append(str(overload_png))
    return tuple(files)


# ------------------------------------------------------------------------------------ vLLM engine tuning

LLM_COLUMNS = ("candidate", "level", "offered/s", "completed/s", "goodput/s", "output tok/s", "TTFT p50", "TTFT p99",
               "ITL p50", "ITL p99", "failed", "broken", "meets SLO", "note")


def _opt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_llm_markdown(record: dict[str, Any]) -> str:
    slo = record["slo"]
    chosen = record.get("chosen")
    out = [f"# Engine tuning of `{record['model']}` (vLLM)", "",
           f"SLO: TTFT p99 <= {slo['ttft_p99_ms']:g} ms and ITL p99 <= {slo['itl_p99_ms']:g} ms at low "
           f"{slo['low_rps']:g}/s and peak {slo['peak_rps']:g}/s ({slo['input_tokens']} prompt tokens, "
           f"{slo['output_tokens']} output tokens per request, open-loop Poisson). Server {record['server']}, "
           f"{record['search']} search, {record['engine_loads']} engine starts, {record['search_seconds']:g} s.", "",
           f"Served: {record['current']['key']}. Chosen: {chosen['key'] if chosen else 'none met the SLO'}."]
    if chosen:
        out.append(f"Rule: {record['evidence']['rule']}.")
    out += [f"Note: {n}" for n in record.get("notes", [])]
    out += [f"Engine did not start with {k}: {v}" for k, v in record.get("load_errors", {}).items()]
    rows = [[p["candidate"], p["level"], f"{p['rate']:g}", _opt(p.get("request_throughput_rps"), 2),
             _opt(p.get("goodput_rps"), 2), _opt(p.get("output_token_throughput"), 0), _opt(p.get("ttft_p50_ms")),
             _opt(p.get("ttft_p99_ms")), _opt(p.get("itl_p50_ms")), _opt(p.get("itl_p99_ms")),
             str(p.get("failed", "-")), str(p.get("broken", "-")), "yes" if p["meets_slo"] else "no", p["note"]]
            for p in record["points"]]
    out += ["", "## Points", "", markdown_table(rows, LLM_COLUMNS), "", "## Environment", ""]
    out += [f"- {k}: {v}" for k, v in record["environment"].items()]
    return "\n".join(out) + "\n"


def plot_llm(record: dict[str, Any], path: Path) -> None:
    """TTFT p99 and ITL p99 against output-token throughput, one line per candidate, the SLOs dashed."""
    import matplotlib  # noqa: PLC0415 - only a report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib only when a picture is drawn

    slo = record["slo"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    by_candidate: dict[str, list[dict[str, Any]]] = {}
    for p in record["points"]:
        if p.get("ttft_p99_ms") is not None:
            by_candidate.setdefault(p["candidate"], []).append(p)
    chosen = (record.get("chosen") or {}).get("key")
    for ax, key, limit, label in ((axes[0], "ttft_p99_ms", slo["ttft_p99_ms"], "TTFT p99 (ms, log)"),
                                  (axes[1], "itl_p99_ms", slo["itl_p99_ms"], "ITL p99 (ms, log)")):
        for name, values in sorted(by_candidate.items()):
            values = sorted(values, key=lambda v: v["output_token_throughput"])
            ax.plot([v["output_token_throughput"] for v in values], [max(v[key], 1e-3) for v in values],
                    marker="o", linewidth=2.5 if name == chosen else 1, label=name + (" (chosen)" if name == chosen
                                                                                      else ""))
        ax.axhline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{record['model']}: TTFT and ITL vs throughput per engine setting "
                 f"({'chosen: ' + chosen if chosen else 'none met the SLO'})")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def write_llm_report(folder: Path, record: dict[str, Any]) -> tuple[str, ...]:
    """``tuning.json``, ``tuning.md`` and ``ttft_itl_vs_throughput.png`` into ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = folder / "tuning.json", folder / "tuning.md", folder / "ttft_itl_vs_throughput.png"
    atomic_write_bytes(json_path, (json.dumps(record, indent=2, default=str) + "\n").encode())
    atomic_write_bytes(md_path, render_llm_markdown(record).encode())
    plot_llm(record, png_path)
    return str(json_path), str(md_path), str(png_path)
