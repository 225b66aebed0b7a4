"""`trm observe rules` (alert rules + dashboard as files) and `trm top` (a live view of Triton servers)."""

from __future__ import annotations

from pathlib import Path

import click

from repo_manager.cli import FRACTION, NON_NEGATIVE, POSITIVE, Context, cli, json_option, pass_ctx, repo_option
from repo_manager.cli.commands.store import endpoint_option
from repo_manager.core.errors import ServerError, UsageError
from repo_manager.core.redact import printable
from repo_manager.core.settings import check_server_url


@cli.group()
def observe() -> None:
    """Alerting rules and dashboards for the models trm serves."""


@observe.command("rules")
@click.argument("env", required=False)
@click.option("--model", "models", multiple=True, help="NAME or NAME:VERSION (repeatable); with ENV: only these. "
              "Without ENV: models of the local repository (default: all, latest versions).")
@click.option("--store", help="Store of ENV (default: its store in configs/).")
@endpoint_option
@repo_option
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="observability", show_default=True,
              help="Folder for trm-rules.yml and trm-dashboard.json.")
@click.option("--p99-ms", type=POSITIVE, help="p99 SLO for every model (default: each version's tuning record).")
@click.option("--queue-per-replica", type=POSITIVE, default=1.0, show_default=True,
              help="Queued requests per Triton server that raise TrmQueueBacklog.")
@click.option("--queue-for", default="1m", show_default=True, help="How long the backlog must last.")
@click.option("--samples", type=int, default=3, show_default=True,
              help="Evaluations in a row with p99 above the SLO before TrmLatencyAboveSLO fires.")
@click.option("--evaluation-interval", "interval_s", type=POSITIVE, default=15.0, show_default=True,
              help="Seconds between rule evaluations (the rule groups' interval).")
@click.option("--max-rejected", type=FRACTION, default=0.01, show_default=True,
              help="Share of requests the queue policy may reject before TrmRequestsRejected fires.")
@click.option("--rejected-for", default="1m", show_default=True)
@click.option("--not-ready-for", default="1m", show_default=True)
@click.option("--versions-for", default="15m", show_default=True,
              help="How long versions may differ across the fleet (longer than a rollout).")
@click.option("--rate-window", default="1m", show_default=True, help="Range of rate() in the rules and panels.")
@click.option("--selector", default="", help='Extra label matchers for every Triton series, e.g. job="triton".')
@click.option("--pointer-stale", "pointer_stale_s", type=POSITIVE, default=600.0, show_default=True,
              help="Seconds an agent may go without reading its environment before TrmAgentPointerStale.")
@click.option("--ttft-p99-ms", type=POSITIVE, help="LLM models: time-to-first-token p99 SLO (default: each "
              "version's tuning record, slo.ttft_p99_ms).")
@click.option("--itl-p99-ms", type=POSITIVE, help="LLM models: inter-token latency p99 SLO (default: each "
              "version's tuning record, slo.itl_p99_ms).")
@click.option("--waiting-per-replica", type=NON_NEGATIVE, default=0.0, show_default=True,
              help="LLM models: requests waiting in the engine per replica above which TrmLlmRequestsWaiting "
                   "fires.")
@click.option("--waiting-for", default="30s", show_default=True, help="How long LLM requests must keep waiting.")
@json_option
@pass_ctx
def rules_command(ctx: Context, env: str | None, models: tuple[str, ...], store: str | None,
                  s3_endpoint_url: str | None, repository: str | None, out_dir: str, p99_ms: float | None,
                  queue_per_replica: float, queue_for: str, samples: int, interval_s: float, max_rejected: float,
                  rejected_for: str, not_ready_for: str, versions_for: str, rate_window: str, selector: str,
                  pointer_stale_s: float, ttft_p99_ms: float | None = None, itl_p99_ms: float | None = None,
                  waiting_per_replica: float = 0.0, waiting_for: str = "30s") -> None:
    """Write Prometheus alerting rules and a Grafana dashboard for the models ENV serves (or --model ...)."""
    from repo_manager.ops.observe.rules import (
        Thresholds,
        watches_from_env,
        watches_from_repo,
        write_artifacts,
    )

    settings = ctx.settings.replace(repository=repository, s3_endpoint_url=s3_endpoint_url)
    if p99_ms is not None and not p99_ms > 0:
        raise UsageError(f"--p99-ms must be positive, not {p99_ms}")
    thresholds = Thresholds(queue_per_replica, queue_for, samples, interval_s, max_rejected, rejected_for,
                            not_ready_for, versions_for, rate_window, selector, pointer_stale_s,
                            waiting_per_replica, waiting_for)
    if env:
        watches = watches_from_env(settings, env, store, p99_ms, tuple(m.split(":")[0] for m in models),
                                   ttft_p99_ms, itl_p99_ms)
    else:
        watches = watches_from_repo(Path(settings.repository), models, p99_ms, ttft_p99_ms, itl_p99_ms)
    result = write_artifacts(Path(out_dir), watches, thresholds, env)
    lines = [f"{m.name}{' v' + str(m.version) if m.version else ''}: "
             + (f"LLM model, TTFT p99 SLO {_ms(m.ttft_p99_ms)}, ITL p99 SLO {_ms(m.itl_p99_ms)}"
                + (f" ({m.llm_slo_source})" if m.llm_slo_source else "") if m.llm else
                f"p99 SLO {f'{m.p99_ms:g} ms ({m.slo_source})' if m.p99_ms is not None else 'none'}")
             + f", max batch {m.max_batch_size}, {m.instances} instance(s)" for m in result.models]
    lines += [f"alerts: {', '.join(result.alerts)}"] + [f"note: {n}" for n in result.notes]
    lines += [f"wrote {f}" for f in result.files]
    lines.append(f"check: promtool check rules {result.files[0]}")
    ctx.emit(result.to_dict(), "\n".join(lines))


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:g} ms"


@cli.command("top")
@click.argument("servers", nargs=-1)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True,
              help="Triton's metrics port, for servers given by their HTTP URL.")
@click.option("--interval", "interval_s", type=POSITIVE, default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one view (two scrapes, --interval apart) and exit.")
@click.option("--agent", "agents", multiple=True, metavar="URL",
              help="A `trm agent` to show too (its --listen address, e.g. http://pod:8090; repeatable).")
@json_option
@pass_ctx
def top_command(ctx: Context, servers: tuple[str, ...], metrics_port: int, interval_s: float, once: bool,
                agents: tuple[str, ...]) -> None:
    """Live view of Triton servers (http://host:8000, or a .../metrics URL; default: settings' triton_url):
    per model and version, request rate, p50/p99, queue vs compute time, pending requests, executed batch
    sizes, rejections and failures; for LLM models (vLLM's metrics), running and waiting requests, KV-cache
    use, output tokens/s and TTFT/ITL p50/p99; with --agent, each agent's state and versions. --json prints one
    snapshot."""
    from repo_manager.ops.observe.top import Server, Watcher, render, snapshot

    if not interval_s > 0:
        raise UsageError(f"--interval must be positive, not {interval_s}")
    default = [ctx.settings.triton_url] if ctx.settings.triton_url and not agents else []
    targets = list(servers) or default
    if not targets and not agents:
        raise UsageError("name a server to watch", hint="trm top http://127.0.0.1:8000 [URL ...] [--agent URL]")
    for target in targets:
        check_server_url(target, "trm top")
    for agent in agents:
        check_server_url(agent, "--agent")
    parsed = [Server.parse(t, metrics_port) for t in targets]
    if ctx.json or once:
        view = snapshot(parsed, interval_s, list(agents))
        ctx.emit(view.to_dict(), render(view))
        return
    from rich.live import Live
    from rich.text import Text

    from repo_manager.cli.terminal import console

    watcher = Watcher(parsed, list(agents))
    first = watcher.view()
    if len(first.problems) == watcher.targets:
        raise ServerError("; ".join(first.problems))
    import time

    with Live(Text("reading metrics ..."), console=console(), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                # render() made every value printable: metric labels and agent fields are data
                live.update(Text(printable(render(watcher.view())) + "\n(Ctrl-C to quit)"))
        except KeyboardInterrupt:
            return
