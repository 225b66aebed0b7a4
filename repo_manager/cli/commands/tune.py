"""`trm tune-batching`: dynamic-batching settings chosen by measurement under a p99 SLO."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from repo_manager.cli import (
    NUMBER,
    POSITIVE,
    Context,
    Number,
    cli,
    complete_models,
    json_option,
    pass_ctx,
    repo_option,
    url_option,
)
from repo_manager.core.errors import GateError, Report, UsageError
from repo_manager.core.redact import printable

if TYPE_CHECKING:
    from repo_manager.ops.tuning import CheckResult, TuneResult


@contextmanager
def live_progress(ctx: Context, budget_s: float) -> Iterator:
    """A rich progress bar on stderr: what is being measured and how much of the budget is used."""
    if ctx.quiet:
        yield lambda message, used, budget: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed:.0f}/{task.total:.0f} s of budget"))
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting", total=budget_s)

        def update(message: str, used: float, budget: float) -> None:
            bar.update(task, description=message[:90], completed=min(used, budget))

        yield update


@cli.command("tune-batching")
@click.argument("name", shell_complete=complete_models)
@repo_option
@url_option
@click.option("--p99-ms", type=POSITIVE, help="The p99 latency SLO in milliseconds.")
@click.option("--low-rps", type=POSITIVE, help="Low traffic, requests/s (the SLO must hold there too).")
@click.option("--peak-rps", type=POSITIVE, help="Peak traffic, requests/s.")
@click.option("--headroom", type=Number(1), default=1.2, show_default=True,
              help="The SLO must also hold at peak x headroom.")
@click.option("--budget", "budget_s", type=POSITIVE,
              help="Seconds the search may take (default: 300, or what every run measures at these rates if "
                   "more): optional steps are skipped to fit; a budget below what "
                   "every run measures is refused.")
@click.option("--requests", type=click.IntRange(1, 10_000_000),
              help="Requests per measured point (default 1000, at most 6 s of traffic at low rates; a vLLM "
                   "model: 100 streams).")
@click.option("--overload-factor", type=NUMBER, default=2.0, show_default=True,
              help="Choose a queue policy that keeps the SLO for accepted requests at this multiple of the "
                   "measured capacity and rejects the excess fast (0: no queue policy).")
@click.option("--require-overload-policy", is_flag=True,
              help="Fail (exit 9, nothing written) unless a queue policy is shown to keep the SLO under the "
                   "overload; by default the batching choice is written without one, with a warning.")
@click.option("--fast-rejection", is_flag=True,
              help="Also try max_queue_size on top of the queue timeout, kept where measured not to lose goodput: "
                   "a full queue rejects at once instead of after the timeout (off by default: on Triton 2.51 a "
                   "refusal can stall the batcher, docs/tuning.md).")
@click.option("--priority-levels", type=click.IntRange(0, 1000), default=0, show_default=True,
              help="Give the dynamic batcher this many priority levels (requests without one get the lowest).")
@click.option("--write", is_flag=True, help="Publish the choice as a new version (default: dry run).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False),
              help="Write tuning.md, tuning.json and p99_vs_throughput.png here.")
@click.option("--check", "check_only", is_flag=True,
              help="CI: re-measure the served config at low and peak; fail on an SLO miss or a changed environment.")
@click.option("--ttft-p99-ms", type=POSITIVE,
              help="vLLM model: the time-to-first-token p99 SLO in milliseconds (with --itl-p99-ms).")
@click.option("--itl-p99-ms", type=POSITIVE, help="vLLM model: the inter-token latency p99 SLO in milliseconds.")
@click.option("--max-num-seqs", "seqs", metavar="N,N,...",
              help="vLLM model: the max_num_seqs values searched (default: 1,2,4,8,16,32).")
@click.option("--max-num-batched-tokens", "tokens", metavar="N,N,...",
              help="vLLM model: the max_num_batched_tokens values searched (default: 256,1024,4096).")
@click.option("--search", type=click.Choice(["fast", "grid"]),
              help="vLLM model: bisect max_num_seqs and move the token budget only towards the SLO that missed "
                   "(fast, the default), or measure every combination (grid).")
@click.option("--input-tokens", type=click.IntRange(1), help="vLLM model: prompt tokens per request (default 128).")
@click.option("--output-tokens", type=click.IntRange(2), help="vLLM model: output tokens per request (default 64).")
@json_option
@pass_ctx
def tune_batching_command(ctx: Context, name: str, repository: str | None, triton_url: str | None,
                          p99_ms: float | None, low_rps: float | None, peak_rps: float | None, headroom: float,
                          budget_s: float | None, requests: int | None, overload_factor: float,
                          require_overload_policy: bool, fast_rejection: bool, priority_levels: int, write: bool,
                          report_dir: str | None,
                          check_only: bool, ttft_p99_ms: float | None, itl_p99_ms: float | None, seqs: str | None,
                          tokens: str | None, search: str | None, input_tokens: int | None,
                          output_tokens: int | None) -> None:
    """Choose NAME's dynamic-batching settings (max batch, instances, queue delay, preferred sizes) by
    measuring candidates on a real Triton server, under a p99 SLO at low, peak and peak x headroom.

    For a vLLM model, choose the engine's max_num_seqs and max_num_batched_tokens instead, under
    --ttft-p99-ms and --itl-p99-ms at low and peak (goodput: streams within both SLOs per second)."""
    from repo_manager.ops.tuning import TuneRequest, check_batching, tune_batching
    from repo_manager.ops.tuning.core import DEFAULT_BUDGET_S, check_measure_arguments

    settings = ctx.settings.replace(repository=repository, triton_url=triton_url)
    llm_flags = {"--ttft-p99-ms": ttft_p99_ms, "--itl-p99-ms": itl_p99_ms, "--max-num-seqs": seqs,
                 "--max-num-batched-tokens": tokens, "--search": search, "--input-tokens": input_tokens,
                 "--output-tokens": output_tokens}
    if any(v is not None for v in llm_flags.values()) or _is_vllm(settings, name):
        given = [flag for flag, value in (("--p99-ms", p99_ms), ("--check", check_only or None),
                                          ("--budget", budget_s)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} tunes Triton's dynamic batcher; a vLLM model is tuned with --ttft-p99-ms "
                             "and --itl-p99-ms (the engine's max_num_seqs and max_num_batched_tokens)")
        _tune_llm(ctx, settings, name, ttft_p99_ms, itl_p99_ms, low_rps, peak_rps, seqs=seqs, tokens=tokens,
                  search=search, requests=requests, input_tokens=input_tokens, output_tokens=output_tokens,
                  write=write, report_dir=report_dir)
        return
    requests = requests or 1000
    if check_only:
        if write:
            raise UsageError("--check measures only; it cannot be combined with --write")
        check_measure_arguments(p99_ms=p99_ms, low_rps=low_rps, peak_rps=peak_rps, requests=requests)
        with live_progress(ctx, 60.0) as progress:
            checked = check_batching(settings, name, p99_ms=p99_ms, low_rps=low_rps, peak_rps=peak_rps,
                                     requests=requests, progress=progress)
        report = Report(checked.to_dict(), _check_text(checked))
        if not checked.passed:
            raise GateError(f"{name} no longer meets its tuning: " + "; ".join(checked.failures()),
                            hint="re-run `trm tune-batching --write` on this environment", report=report, model=name)
        ctx.emit(report.data, report.text)
        return
    if p99_ms is None or low_rps is None or peak_rps is None:
        raise UsageError("tune-batching needs --p99-ms, --low-rps and --peak-rps")
    request = TuneRequest(name, p99_ms, low_rps, peak_rps, headroom=headroom, budget_s=budget_s or DEFAULT_BUDGET_S,
                          write=write, requests=requests, report_dir=Path(report_dir) if report_dir else None,
                          overload_factor=overload_factor, priority_levels=priority_levels,
                          fast_rejection=fast_rejection,
                          require_overload_policy=require_overload_policy)
    if budget_s is None:  # the default never refuses: low rates need longer points than 300 s allow
        request = dataclasses.replace(request, budget_s=max(DEFAULT_BUDGET_S, request.minimum_budget_s()))
    request.check_target(settings)  # refused before the progress display starts
    with live_progress(ctx, request.budget_s) as progress:
        result = tune_batching(settings, request, progress)
    report = Report(result.to_dict(), _tune_text(result))
    if result.status == "queue-policy-required":
        overload = result.overload
        assert overload is not None
        error = GateError(f"{overload.summary()}; tried: {overload.tried() or 'nothing'}; nothing was written "
                          "(--require-overload-policy)",
                          hint=("give --budget more time, " if overload.cut_short else "") +
                          "relax the SLO, lower --overload-factor, add capacity, or drop --require-overload-policy "
                          "to write the batching choice alone", report=report, model=name)
        raise error
    if result.status in ("chosen-without-queue-policy", "chosen-with-closest-queue-policy") and result.overload:
        done = "written" if result.written_version else "chosen"
        what = (f"{result.overload.fallback_summary()}, {done} with the batching choice" if result.overload.fallback
                else f"the batching choice is {done} without a queue policy")
        click.echo(printable(f"warning: {result.overload.summary()}; {what} (--require-overload-policy makes this "
                             "a failure)"), err=True)
    if result.chosen is None:
        closest = result.outcome.closest
        error = GateError(f"no candidate met p99 <= {p99_ms:g} ms at every level; closest: "
                          f"{closest.label if closest else 'none measured'}; nothing was written",
                          hint="relax the SLO or the rates, or add capacity (instances, hardware)", report=report,
                          model=name)
        raise error
    ctx.emit(report.data, report.text)


def _is_vllm(settings, name: str) -> bool:
    from repo_manager.ops.llm.infer import is_llm

    return is_llm(settings, name)


def _counts(flag: str, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes whole numbers of at least 1 separated by commas (e.g. 4,8,16), "
                         f"not {text!r}")
    return values


def _tune_llm(ctx: Context, settings, name: str, ttft_p99_ms: float | None, itl_p99_ms: float | None,
              low_rps: float | None, peak_rps: float | None, *, seqs: str | None, tokens: str | None,
              search: str | None, requests: int | None, input_tokens: int | None, output_tokens: int | None,
              write: bool, report_dir: str | None) -> None:
    from repo_manager.ops.tuning.llm import LLMTuneRequest, tune_llm

    missing = [flag for flag, value in (("--ttft-p99-ms", ttft_p99_ms), ("--itl-p99-ms", itl_p99_ms),
                                        ("--low-rps", low_rps), ("--peak-rps", peak_rps)) if value is None]
    if missing:
        raise UsageError(f"tuning the vLLM engine of {name} needs --ttft-p99-ms, --itl-p99-ms, --low-rps and "
                         f"--peak-rps (missing: {', '.join(missing)})")
    assert ttft_p99_ms is not None and itl_p99_ms is not None and low_rps is not None and peak_rps is not None
    given = {k: v for k, v in (("seqs", _counts("--max-num-seqs", seqs)),
                               ("tokens", _counts("--max-num-batched-tokens", tokens)), ("search", search),
                               ("requests", requests), ("input_tokens", input_tokens),
                               ("output_tokens", output_tokens)) if v is not None}
    request = LLMTuneRequest(name, ttft_p99_ms, itl_p99_ms, low_rps, peak_rps, write=write,
                             report_dir=Path(report_dir) if report_dir else None, **given)
    request.check_target(settings)
    with live_progress(ctx, 0.0) as progress:
        result = tune_llm(settings, request, progress)
    report = Report(result.to_dict(), _llm_text(result))
    if result.chosen is None:
        raise GateError(f"no engine setting met TTFT p99 <= {ttft_p99_ms:g} ms and ITL p99 <= {itl_p99_ms:g} ms "
                        "at low and peak; nothing was written",
                        hint="relax the SLOs or the rates, widen --max-num-seqs, or add capacity", report=report,
                        model=name)
    ctx.emit(report.data, report.text)


def _llm_text(result) -> str:
    lines = [f"{'candidate':<24} {'level':<5} {'rate':>6} {'goodput':>8} {'tok/s':>7} {'TTFT p99':>9} "
             f"{'ITL p99':>8}  result"]
    for p in result.outcome.points:
        d = p.to_dict()
        ttft = "-" if d.get("ttft_p99_ms") is None else f"{d['ttft_p99_ms']:.0f}"
        itl = "-" if d.get("itl_p99_ms") is None else f"{d['itl_p99_ms']:.1f}"
        lines.append(f"{p.candidate:<24} {p.level:<5} {p.rate:>5g}/s {d.get('goodput_rps', 0):>6.2f}/s "
                     f"{d.get('output_token_throughput', 0):>7.0f} {ttft:>9} {itl:>8}  "
                     f"{'ok' if p.meets_slo else 'MISS: ' + p.note}")
    lines += [f"note: {n}" for n in result.outcome.notes]
    lines.append("")
    lines.append(f"chosen: {result.chosen.key}" if result.chosen else "no engine setting met both SLOs at low and peak")
    if result.written_version:
        lines.append(f"written: {result.model} version {result.written_version}")
    elif result.chosen:
        lines.append("dry run: nothing written (pass --write to publish the choice as a new version)")
    if result.report_files:
        lines.append(f"report: {Path(result.report_files[0]).parent}")
    lines.append(f"{result.outcome.search} search: {len(result.outcome.points)} points, {result.outcome.loads} "
                 f"engine starts, {result.seconds:.0f} s")
    return "\n".join(lines)


def _tune_text(result: TuneResult) -> str:
    lines = [f"{'candidate':<28} {'origin':<8} {'low p99':>8} {'peak p99':>9} {'head p99':>9} {'capacity':>9}"]
    for e in result.outcome.evaluations:
        cells = [f"{e.levels[lvl].p99_ms:.1f}" if e.levels[lvl] else "-" for lvl in ("low", "peak", "headroom")]
        capacity = f"{e.capacity_rps:.0f}/s" if e.capacity_rps else "-"
        lines.append(f"{e.candidate.key:<28} {e.candidate.origin:<8} {cells[0]:>8} {cells[1]:>9} {cells[2]:>9} "
                     f"{capacity:>9}")
    if result.outcome.chosen:
        lines += ["", f"batching: {result.outcome.chosen.label}"]
        lines += [f"  {k}: {v}" for k, v in result.outcome.evidence.items()]
    else:
        lines += ["", "no candidate met the SLO at every level"]
    if result.overload is not None:
        lines += ["", _overload_text(result)]
    if result.chosen:
        lines += ["", f"chosen: {result.chosen.label}"]
        if result.status == "chosen-without-queue-policy":
            lines.append("  (no queue policy: see the overload section above)")
        if result.status == "chosen-with-closest-queue-policy":
            lines.append("  (the closest queue policy tried, not shown to hold: see the overload section above)")
    lines += [f"note: {n}" for n in result.outcome.notes]
    if result.written_version:
        lines.append(f"written: {result.model} version {result.written_version}")
    elif result.chosen:
        lines.append("dry run: nothing written (pass --write to publish the choice as a new version)")
    if result.report_files:
        lines.append(f"report: {Path(result.report_files[0]).parent}")
    lines.append(f"search took {result.seconds:.0f} s")
    return "\n".join(lines)


def _overload_text(result: TuneResult) -> str:
    o = result.overload
    assert o is not None
    lines = [f"overload ({o.factor:g} x capacity), then {o.recover_rps:.0f}/s: {o.summary()}",
             f"  {'policy':<34} {'offered':>8} {'acc p99':>8} {'rejected':>9} {'rej p99':>8} {'goodput':>8} "
             f"{'recover':>8}"]
    for p in o.points:
        rej = "-" if p.overload.rejection_p99_ms is None else f"{p.overload.rejection_p99_ms:.1f}"
        recover = "-" if p.recover_s is None else f"{p.recover_s:.2f}s"
        lines.append(f"  {p.candidate.key:<34} {p.rate:>6.0f}/s {p.overload.accepted_p99_ms:>8.1f} "
                     f"{p.overload.rejected_fraction:>9.1%} {rej:>8} {p.overload.goodput_rps:>6.0f}/s {recover:>8} "
                     f"{'ok' if p.meets else 'MISS: ' + p.note}")
    lines += [f"  note: {n}" for n in o.notes]
    return "\n".join(lines)


def _check_text(result: CheckResult) -> str:
    lines = [f"{p.level:<5} {p.rate:>7.0f}/s  p99 {p.p99_ms:8.1f} ms  {'ok' if p.meets_slo else 'MISS'}  {p.note}"
             for p in result.points]
    lines += [f"environment changed: {k}: {v['tuned']} -> {v['now']}" for k, v in result.changes.items()]
    lines.append("check passed" if result.passed else "check FAILED")
    return "\n".join(lines)
