"""`trm serve`: the embedded Triton server on the local repository."""

from __future__ import annotations

from contextlib import ExitStack

import click

from repo_manager.adapters import metrics
from repo_manager.cli import Context, cli, json_option, pass_ctx, repo_option
from repo_manager.core.errors import UsageError

PORT = click.IntRange(0, 65535)


@cli.command("serve")
@repo_option
@click.option("--http-port", type=PORT, help="Default: settings http_port (8000); 0 picks a free port.")
@click.option("--grpc-port", type=PORT, help="Default: settings grpc_port (8001).")
@click.option("--metrics-port", type=PORT, help="Default: settings metrics_port (8002).")
@click.option("--model", "models", multiple=True, help="Load only these models (default: all).")
@click.option("--tritonserver", help="tritonserver binary (default: $PATH, then nvidia-pytriton's).")
@click.option("--trm-metrics-port", type=PORT,
              help="Export trm's own metrics (operations, served versions) on this port (0: a free one).")
@json_option
@pass_ctx
def serve_command(ctx: Context, repository: str | None, http_port: int | None, grpc_port: int | None,
                  metrics_port: int | None, models: tuple[str, ...], tritonserver: str | None,
                  trm_metrics_port: int | None) -> None:
    """Start a real tritonserver (explicit model control) on the repository until Ctrl-C / SIGTERM."""
    from repo_manager.adapters.triton.restricted import RESTRICTED_APIS
    from repo_manager.ops.serving import embedded_server, wait_for_signal

    settings = ctx.settings.replace(repository=repository, tritonserver=tritonserver)
    ports = {"--http-port": settings.http_port if http_port is None else http_port,
             "--grpc-port": settings.grpc_port if grpc_port is None else grpc_port,
             "--metrics-port": settings.metrics_port if metrics_port is None else metrics_port,
             "--trm-metrics-port": trm_metrics_port}
    taken: dict[int, str] = {}
    for flag, port in ports.items():
        if port:  # (0: a free one)
            if port in taken:
                raise UsageError(f"{taken[port]} and {flag} are both {port}: each server needs its own port")
            taken[port] = flag
    ctx.progress(f"starting tritonserver on {settings.repository}")
    with ExitStack() as stack:
        exporter = None
        if trm_metrics_port is not None:
            exporter = metrics.start_exporter(trm_metrics_port, settings.bind_address)
            stack.callback(exporter.stop)
        with metrics.operation("serve_start"):
            info = stack.enter_context(embedded_server(settings, list(models), http_port=http_port,
                                                       grpc_port=grpc_port, metrics_port=metrics_port))
        metrics.set_serving(info.models)
        loaded = ", ".join(f"{m}:{v}" for m, v in info.models.items()) or "none"
        restricted = list(RESTRICTED_APIS) if settings.triton_api_key else []
        text = (f"Triton ready  http {info.endpoints.http}  grpc {info.endpoints.grpc}  "
                f"metrics {info.endpoints.metrics}\nmodels: {loaded}\nlog: {info.log}\n"
                + (f"restricted to $TRM_TRITON_API_KEY: {', '.join(restricted)}\n" if restricted else "")
                + (f"trm metrics: {exporter.url}\n" if exporter else "") + "Ctrl-C to stop")

        def announce() -> None:
            ctx.emit({"status": "ready", **info.to_dict(), "restricted_apis": restricted,
                      "trm_metrics": exporter.url if exporter else None}, text)

        signum = wait_for_signal(announce)
        ctx.progress(f"signal {signum}: stopping (in-flight requests finish)")
