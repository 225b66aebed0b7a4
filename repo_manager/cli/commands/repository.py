"""`trm list`, `trm show`, `trm validate`."""

from __future__ import annotations

import click

from repo_manager.cli import Context, cli, json_option, pass_ctx, repo_option
from repo_manager.errors import InputError
from repo_manager.inventory import list_models, show_model, validate_repository
from repo_manager.repository import LocalRepository


@cli.command("list")
@repo_option
@json_option
@pass_ctx
def list_command(ctx: Context, repository: str | None) -> None:
    """List the models of the repository and their versions."""
    settings = ctx.settings.replace(repository=repository)
    rows = list_models(settings.repository)
    for note in LocalRepository(settings.repository).scan()[1]:  # e.g. lost+found at a volume's root
        ctx.progress(note)
    lines = [f"{r['model']:<32} latest {r['latest'] or '-':<5} versions {r['versions']}" for r in rows]
    ctx.emit({"repository": str(settings.repository), "models": rows},
             "\n".join(lines) if lines else f"no models in {settings.repository}")


@cli.command("show")
@click.argument("name")
@click.option("--version", type=int, help="Default: the latest version.")
@repo_option
@json_option
@pass_ctx
def show_command(ctx: Context, name: str, version: int | None, repository: str | None) -> None:
    """Show a model: versions, manifest summary, config summary."""
    settings = ctx.settings.replace(repository=repository)
    info = show_model(settings.repository, name, version)
    m = info["manifest"]
    lines = [f"{name}: versions {info['versions']}, showing {m['version']}",
             f"  created {m['created_at']}, {m['files']} files, {m['bytes']} bytes",
             f"  source: {m['source'].get('kind')} {m['source'].get('path', '')}",
             f"  verification: {m['verification']}"]
    for key, value in info["config"].items():
        lines.append(f"  {key}: {value}")
    if m.get("members"):
        lines.append(f"  members: {m['members']}")
    if m.get("tuning"):
        lines.append(f"  tuned: {m['tuning'].get('summary', 'yes')}")
    ctx.emit(info, "\n".join(lines))


@cli.command("validate")
@click.argument("repo_dir", required=False, type=click.Path(file_okay=False))
@click.option("--fix", is_flag=True, help="Remove leftover staging folders and repair config.pbtxt files.")
@json_option
@pass_ctx
def validate_command(ctx: Context, repo_dir: str | None, fix: bool) -> None:
    """Check layout, configs, manifests and checksums; exit 3 when there is any problem."""
    root = repo_dir or ctx.settings.repository
    report = validate_repository(root, fix=fix)
    problems = report["problems"]
    text = "\n".join([f"{root}: {len(problems)} problem(s)"] + [f"  - {p}" for p in problems]) \
        if problems else f"{root}: OK ({report['models']} models, {report['versions']} versions)"
    text += "".join(f"\n  note: {n}" for n in report["notes"])
    ctx.emit(report, text)
    if problems:
        error = InputError(f"{len(problems)} problem(s) in {root}")
        error.reported = True
        raise error
