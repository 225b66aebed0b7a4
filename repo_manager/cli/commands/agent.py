"""`trm agent`: the sidecar that keeps one Triton server on what an environment says (docs/agent.md)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click

from repo_manager.cli import Context, Number, cli, pass_ctx, repo_option
from repo_manager.cli.commands.store import endpoint_option

DAY_S = 86_400
SECONDS = Number(0, DAY_S)
"""A wait or timeout: finite, at most a day (an agent that waits longer is a stopped one)."""


@cli.command("agent")
@click.argument("store", required=False)
@click.option("--env", required=True, help="Environment whose pointer this server follows.")
@repo_option
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False),
              help="Node cache shared by the pods of a node (default: .trm-cache beside --repo).")
@click.option("--url", "triton_url", required=True,
              help="The Triton server beside the agent (HTTP, explicit model-control mode).")
@click.option("--grpc-url", help="Its gRPC endpoint (HOST:PORT): loads and unloads go there, as `trm rollout`.")
@click.option("--metrics-url", help="Its metrics endpoint (http://host:8002/metrics): an LLM's old version is "
              "unloaded once its engine reports no stream in flight. Default: port 8002 of --url's host.")
@click.option("--listen", default="127.0.0.1:8090", show_default=True,
              help="Agent HTTP (/healthz /readyz /status /metrics), HOST:PORT; 0.0.0.0:PORT only where "
                   "something off the host must reach it (the kubelet's probes).")
@click.option("--interval", type=Number(0, DAY_S, low_open=True), default=5.0, show_default=True,
              help="Seconds between pointer checks (one conditional GET each).")
@click.option("--jitter", type=Number(0, 1), default=0.2, show_default=True,
              help="Random fraction of the interval added to each wait.")
@click.option("--max-unavailable", type=click.IntRange(1, 10_000), default=1, show_default=True,
              help="At most this many pods of the environment out of rotation at once (drain-swap path).")
@click.option("--no-side-by-side", is_flag=True,
              help="Always drain-swap (readiness false, in-flight finished) instead of loading beside.")
@click.option("--pod-name", help="Identity for coordination and status (default: $HOSTNAME).")
@click.option("--drain-grace", type=SECONDS, default=5.0, show_default=True,
              help="Seconds between readiness going false and waiting for in-flight requests (the readiness "
                   "probe's period).")
@click.option("--drain-timeout", type=SECONDS, default=120.0, show_default=True,
              help="Longest wait for in-flight requests (an LLM's streams) to finish before swapping anyway.")
@click.option("--head-timeout", type=Number(0, 600, low_open=True), default=5.0, show_default=True,
              help="Seconds a connection to --listen has to send its request head; a slower one is closed.")
@click.option("--lease-ttl", type=Number(2, 600), default=60.0, show_default=True,  # agent/lease.py's bounds
              help="Seconds a drain slot lives without renewal (renewed every third of it while out of "
                   "rotation; a killed pod's slot frees after it).")
@click.option("--backoff", type=SECONDS, default=5.0, show_default=True,
              help="First retry delay after a failure (doubles, at most 300 s).")
@click.option("--json", "json_logs", is_flag=True, help="JSON log lines on stderr.")
@endpoint_option
@pass_ctx
def agent_command(ctx: Context, store: str | None, env: str, repository: str | None, cache_dir: str | None,
                  triton_url: str, grpc_url: str | None, metrics_url: str | None, listen: str, interval: float,
                  jitter: float, max_unavailable: int, no_side_by_side: bool, pod_name: str | None, drain_grace: float,
                  drain_timeout: float, head_timeout: float, lease_ttl: float, backoff: float, json_logs: bool,
                  s3_endpoint_url: str | None) -> None:
    """Keep the Triton server at --url serving what ENV in STORE says: sync through the node cache, roll
    out with zero failed requests, refuse versions that fail. Runs until SIGTERM."""
    from repo_manager.core.environments import check_env_name
    from repo_manager.ops.agent import AgentOptions, run_agent
    from repo_manager.ops.sync import cache_dir_for

    settings = ctx.settings.replace(repository=repository, cache_dir=cache_dir, triton_url=triton_url,
                                    s3_endpoint_url=s3_endpoint_url)
    location = store or settings.store
    if not location:
        from repo_manager.core.errors import UsageError

        raise UsageError("no store given", hint="pass STORE (s3://bucket/prefix or a folder) or set TRM_STORE")
    options = AgentOptions(
        store=location, env=check_env_name(env), repository=Path(settings.repository).absolute(),
        cache=cache_dir_for(settings).absolute(), url=triton_url, grpc_url=grpc_url, metrics_url=metrics_url,
        listen=listen,
        interval_s=interval, jitter=jitter, max_unavailable=max_unavailable, side_by_side=not no_side_by_side,
        pod=_check_pod_name(pod_name) or os.environ.get("HOSTNAME") or socket.gethostname(),
        json_logs=json_logs or ctx.json,
        drain_grace_s=drain_grace, drain_timeout_s=drain_timeout, head_timeout_s=head_timeout, lease_ttl_s=lease_ttl,
        backoff_s=backoff)
    run_agent(options, settings)


def _check_pod_name(name: str | None) -> str | None:
    """--pod-name is shown in /status, logs and the drain lease: a DNS-like name, as Kubernetes gives pods."""
    import re

    from repo_manager.core.errors import UsageError

    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", name):
        raise UsageError(f"--pod-name {name[:80]!r} is not a pod name (letters, digits, '.', '_', '-')")
    return name
