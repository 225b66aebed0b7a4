"""`trm rollout` and `trm status`: move servers to a version, and show what is serving where."""

from __future__ import annotations

from pathlib import Path

import click

from repo_manager.cli import FRACTION, NON_NEGATIVE, Context, cli, complete_models, json_option, pass_ctx, repo_option
from repo_manager.core.errors import Report, ServerError
from repo_manager.core.settings import check_server_url


@cli.command("rollout")
@click.argument("name", shell_complete=complete_models)
@click.option("--version", type=int, help="The version to roll out.")
@click.option("--to-previous", is_flag=True, help="Go back to the version before the newest one served.")
@click.option("--url", "urls", multiple=True, required=True,
              help="A Triton server in explicit model-control mode (repeatable; order = rollout order).")
@click.option("--grpc-url", "grpc_urls", multiple=True,
              help="Each server's gRPC address (host:8001), in --url order: loads and unloads go there, so "
                   "HTTP clients never wait behind a load. Default: control over HTTP.")
@click.option("--metrics-url", "metrics_urls", multiple=True,
              help="Each server's metrics endpoint (http://host:8002/metrics), in --url order: an LLM's old "
                   "version is unloaded once its engine reports no stream in flight. Default: port 8002 of "
                   "each --url's host.")
@click.option("--stream-drain", "stream_drain_s", type=NON_NEGATIVE, default=120.0, show_default=True,
              help="LLM models: longest wait, in seconds, for the old version's streams before it is unloaded.")
@repo_option
@click.option("--from", "source", help="Install the version (and the members it pins) from this store into "
              "--repo first (s3://bucket/prefix or a folder), as `trm sync` does.")
@click.option("--canary", type=int, default=0, show_default=True, help="Servers to roll out and soak first.")
@click.option("--soak", "soak_s", type=NON_NEGATIVE, default=0.0, show_default=True,
              help="Seconds to watch each canary server (each server, without --canary) after it changed.")
@click.option("--smoke", "smoke_file", type=click.Path(exists=True, dir_okay=False),
              help='JSON {"cases": [{"inputs": {...}, "outputs": {...}}]}; default: generated inputs.')
@click.option("--max-error-rate", type=FRACTION, default=0.0, show_default=True,
              help="Largest share of failed requests tolerated during a soak.")
@click.option("--max-p99-increase", type=NON_NEGATIVE, default=0.5, show_default=True,
              help="Largest p99 growth tolerated during a soak, as a fraction (0.5 = +50%).")
@click.option("--keep-previous", is_flag=True, help="Leave the previous version loaded (for pinned clients).")
@click.option("--side-by-side/--no-side-by-side", default=True, show_default=True,
              help="--no-side-by-side: the model cannot be loaded twice; drain each server instead.")
@click.option("--memory-budget", help="Bytes one server may hold for this model (e.g. 24GiB): old + new "
              "over it selects the drain strategy. Default: settings rollout.memory_budget.")
@click.option("--drain-cmd", help="Shell command that takes $TRM_SERVER_URL out of rotation (drain strategy).")
@click.option("--restore-cmd", help="Shell command that brings $TRM_SERVER_URL back (drain strategy).")
@click.option("--precheck/--no-precheck", default=True, show_default=True,
              help="Load and smoke-check the version under a temporary name before touching the live model.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@json_option
@pass_ctx
def rollout_command(ctx: Context, name: str, version: int | None, to_previous: bool, urls: tuple[str, ...],
                    grpc_urls: tuple[str, ...], metrics_urls: tuple[str, ...], stream_drain_s: float,
                    repository: str | None, source: str | None, canary: int, soak_s: float,
                    smoke_file: str | None, max_error_rate: float, max_p99_increase: float,
                    keep_previous: bool, side_by_side: bool, memory_budget: str | None, drain_cmd: str | None,
                    restore_cmd: str | None, precheck: bool, dry_run: bool) -> None:
    """Move running Triton servers to version N of NAME: zero failed requests, automatic rollback.

    Exit codes: 0 done, 10 rolled back (see "reason": load_failed, smoke_failed, threshold_breached),
    6 a server became unreachable (the others are left consistent), 2 bad usage.
    """
    from repo_manager.ops.rollout import RolloutOptions, parse_size, plan_rollout, run_rollout

    settings = ctx.settings.replace(repository=repository)
    check_server_urls(urls, grpc_urls)
    options = RolloutOptions(canary=canary, soak_s=soak_s, max_error_rate=max_error_rate,
                             max_p99_increase=max_p99_increase, keep_previous=keep_previous,
                             side_by_side=side_by_side, memory_budget=parse_size(memory_budget),
                             drain_cmd=drain_cmd, restore_cmd=restore_cmd, precheck=precheck,
                             smoke_file=Path(smoke_file) if smoke_file else None, stream_drain_s=stream_drain_s)
    plan = plan_rollout(settings, name, version, list(urls), options, to_previous=to_previous, source=source,
                        grpc_urls=list(grpc_urls), metrics_urls=list(metrics_urls), progress=ctx.progress)
    if dry_run:
        ctx.emit({"dry_run": True, "plan": plan.to_dict()}, plan.describe())
        return
    ctx.progress(plan.describe())
    result = run_rollout(settings, plan, progress=ctx.progress)  # a failure carries its result (error.report)
    ctx.emit(result.to_dict(), result.describe())


@cli.command("status")
@click.option("--url", "urls", multiple=True, help="Servers to ask (default: every server a rollout recorded).")
@repo_option
@json_option
@pass_ctx
def status_command(ctx: Context, urls: tuple[str, ...], repository: str | None) -> None:
    """Each server's loaded models and versions against the repository's latest."""
    from repo_manager.ops.rollout import describe_status, server_status

    settings = ctx.settings.replace(repository=repository)
    check_server_urls(urls, ())
    statuses = server_status(settings.repository, list(urls))
    report = Report({"servers": [s.to_dict() for s in statuses]}, describe_status(statuses))
    unreachable = [s.url for s in statuses if not s.reachable]
    if unreachable:  # the report says what each answered; the exit code says not all did
        raise ServerError(f"{len(unreachable)} of {len(statuses)} server(s) did not answer: "
                          + ", ".join(unreachable), hint="check that each server runs and its --url is right",
                          report=report)
    ctx.emit(report.data, report.text)


def check_server_urls(urls: tuple[str, ...], grpc_urls: tuple[str, ...]) -> None:
    """Server addresses are well formed and carry no credentials (they would be printed and recorded)."""
    for url in urls:
        check_server_url(url, "--url")
    for url in grpc_urls:
        check_server_url(url, "--grpc-url", schemes=("grpc", "http", "https"))
