"""`trm push`, `trm sync`, `trm export`: the remote store (S3 or a folder).

Operations are imported inside each command: `trm sync` of an unchanged environment (every pod start)
imports only click, the settings, the store adapter and ``sync/noop.py`` (see docs/store-and-sync.md).
"""

from __future__ import annotations

import threading

import click

from repo_manager.cli import Context, cli, complete_envs, json_option, pass_ctx, repo_option
from repo_manager.core.defaults import SYNC_OPTIONS
from repo_manager.ops.sync import result_data
from repo_manager.ops.sync.result import SyncResult


def endpoint_option(function):
    return click.option(SYNC_OPTIONS["s3_endpoint_url"], "s3_endpoint_url",
                        help="S3-compatible endpoint (MinIO, SeaweedFS …). Default: settings "
                             "s3_endpoint_url, else the AWS chain ($AWS_ENDPOINT_URL_S3).")(function)


@cli.command("push")
@click.argument("store")
@repo_option
@click.option("--model", "selections", multiple=True, help="NAME (all its versions) or NAME:VERSION; "
              "repeatable. Default: every version of every model.")
@click.option("--env", shell_complete=complete_envs,
              help="Then point this environment at the newest version pushed of each model.")
@click.option("--create-env", is_flag=True,
              help="Create --env even though its name is close to an environment the store has (a typo is "
                   "refused otherwise).")
@endpoint_option
@json_option
@pass_ctx
def push_command(ctx: Context, store: str, repository: str | None, selections: tuple[str, ...], env: str | None,
                 create_env: bool, s3_endpoint_url: str | None) -> None:
    """Upload complete versions to STORE (s3://bucket/prefix or a folder): missing blobs, then manifests."""
    from repo_manager.adapters.repository import LocalRepository
    from repo_manager.adapters.storage import open_store
    from repo_manager.ops.push import parse_selection, push

    settings = ctx.settings.replace(repository=repository, s3_endpoint_url=s3_endpoint_url)
    target = open_store(store, settings)
    result = push(target, LocalRepository(settings.repository), [parse_selection(s) for s in selections],
                  env=env, create_env=create_env or env in settings.environments, progress=ctx.progress)
    uploaded = [v for v in result.versions if not v.already_present]
    text = (f"pushed {len(uploaded)} version(s) to {result.store} ({result.bytes_uploaded} bytes uploaded, "
            f"{len(result.versions) - len(uploaded)} already there)")
    if env:
        served = ", ".join(f"{m} version {v}" for m, v in sorted(result.env_models.items()))
        text += f"; environment {env} serves {served or 'no model'}"
    ctx.emit(result.to_dict(), text)


class RichProgress:
    """Bytes and files bars on stderr (stdout stays clean for --json); a ``SyncProgress`` (the same
    methods; not a subclass, so that this module imports nothing heavy for --help)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._bar = None

    def start(self, total_bytes: int, total_files: int) -> None:
        if not self.enabled or not total_files:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        class BytesSpeed(TransferSpeedColumn):  # a rate of bytes, not of blobs
            def render(self, task):
                return super().render(task) if task.description == "bytes" else ""

        self._bar = Progress(TextColumn("{task.description:<5}"), BarColumn(), TaskProgressColumn(),
                             TextColumn("{task.fields[detail]}"), BytesSpeed(), TimeRemainingColumn(),
                             console=Console(stderr=True))
        self._total_bytes, self._total_files, self._done_bytes, self._done_files = total_bytes, total_files, 0, 0
        self._bytes = self._bar.add_task("bytes", total=total_bytes, detail=self._bytes_detail())
        self._files = self._bar.add_task("blobs", total=total_files, detail=f"0/{total_files}")
        self._bar.start()

    def _bytes_detail(self) -> str:
        return f"{self._done_bytes / 1e6:.1f}/{self._total_bytes / 1e6:.1f} MB"

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._done_bytes += nbytes
                # a blob fetched twice (a bad first copy) moves more bytes than planned: show what moved
                self._total_bytes = max(self._total_bytes, self._done_bytes)
                self._bar.update(self._bytes, advance=nbytes, total=self._total_bytes, detail=self._bytes_detail())

    def file_done(self) -> None:
        if self._bar is not None:
            with self._lock:
                self._done_files += 1
                self._bar.update(self._files, advance=1, detail=f"{self._done_files}/{self._total_files}")

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"· {text}")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def sync_option(name: str, **attributes):
    """An option of `trm sync` that its quick path (``repo_manager/entry.py``) parses too: one name for both."""
    return click.option(SYNC_OPTIONS[name], name, **attributes)


@cli.command("sync")
@click.argument("store")
@sync_option("env", shell_complete=complete_envs,
             help="Environment whose pointer says which version of each model to serve. Without it, "
             "the newest version of each --model.")
@repo_option
@sync_option("cache_dir", type=click.Path(file_okay=False),
             help="Node-local blob cache shared by the pods of a node (default: .trm-cache beside --repo).")
@sync_option("models", multiple=True, help="Only these models (repeatable).")
@click.option("--prune", is_flag=True, help="Remove local versions the environment no longer serves (never one "
              "the server at --url has loaded) and cache blobs nothing links to.")
@click.option("--url", "triton_url", help="The running Triton server (HTTP) of this node, e.g. "
              "http://127.0.0.1:8000: --prune never removes a version it has loaded. No default: sync starts no "
              "server, and --prune without --url checks no server.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--limit-rate", type=click.FloatRange(min=0, min_open=True),
              help="Download at most this many MB/s (leave bandwidth to serving).")
@endpoint_option
@json_option
@pass_ctx
def sync_command(ctx: Context, store: str, env: str | None, repository: str | None, cache_dir: str | None,
                 models: tuple[str, ...], prune: bool, triton_url: str | None, dry_run: bool,
                 limit_rate: float | None, s3_endpoint_url: str | None) -> None:
    """Make the local repository serve what ENV in STORE says: only missing blobs are downloaded, verified,
    and each version folder appears complete or not at all."""
    from repo_manager.adapters.storage import open_store
    from repo_manager.ops.sync import cache_dir_for

    settings = ctx.settings.replace(repository=repository, cache_dir=cache_dir, triton_url=triton_url,
                                    s3_endpoint_url=s3_endpoint_url)
    source = open_store(store, settings)
    result = None
    if env and not prune and not dry_run:
        from repo_manager.ops.sync.noop import try_unchanged

        result = try_unchanged(source, cache_dir_for(settings), settings.repository, env, models)
    if result is None:
        result = _sync_in_full(ctx, settings, source, env, models, prune, dry_run, limit_rate)
        if result is None:
            return
    data = result.to_dict()
    ctx.emit(data, result_data.summary(data))  # the quick path (entry.py) prints the same text


def _sync_in_full(ctx: Context, settings, source, env: str | None, models: tuple[str, ...], prune: bool,
                  dry_run: bool, limit_rate: float | None) -> SyncResult | None:
    from repo_manager.ops.sync import execute, plan_sync

    plan = plan_sync(settings, source, env=env, models=models, prune=prune)
    if dry_run:
        ctx.emit({"dry_run": True, "plan": plan.to_dict()}, plan.describe())
        return None
    progress = RichProgress(enabled=not ctx.quiet and not ctx.json)
    try:
        return execute(plan, source, progress=progress, limit_bytes_per_s=limit_rate * 1e6 if limit_rate else None)
    finally:
        progress.stop()


@cli.command("export")
@click.argument("store")
@click.argument("dest")
@click.option("--env", shell_complete=complete_envs,
              help="Export the versions this environment serves (default: every version).")
@click.option("--model", "models", multiple=True, help="Only these models (repeatable).")
@endpoint_option
@json_option
@pass_ctx
def export_command(ctx: Context, store: str, dest: str, env: str | None, models: tuple[str, ...],
                   s3_endpoint_url: str | None) -> None:
    """Write a plain Triton layout (<model>/config.pbtxt, <model>/<N>/files) to DEST (folder or s3://), for a
    stock Triton pointed at it."""
    from repo_manager.adapters.storage import open_store
    from repo_manager.ops.export import export

    settings = ctx.settings.replace(s3_endpoint_url=s3_endpoint_url)
    result = export(open_store(store, settings), dest, settings, env=env, models=models, progress=ctx.progress)
    ctx.emit(result.to_dict(), f"exported {result.versions} version(s), {result.files} files "
                               f"({result.bytes} bytes) to {result.dest}")
