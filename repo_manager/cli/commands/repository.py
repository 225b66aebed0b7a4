"""`trm list`, `trm show`, `trm diff`, `trm validate`: read-only views, as tables or --json."""

from __future__ import annotations

import json
from typing import Any

import click

from repo_manager.cli import Context, cli, complete_models, complete_versions, json_option, pass_ctx, repo_option
from repo_manager.core.errors import InputError, Report


def store_option(function):
    return click.option("--store", help="Store whose environments to show (default: the environments and "
                        "store in the settings; none configured: no environments column).")(function)


_NO_WRAP = ("model", "latest", "version", "created", "size")


def _created(stamp: str) -> str:
    return stamp[:16].replace("T", " ")


def _verified(summary: dict[str, Any], key: str):
    from repo_manager.cli.terminal import cell

    return cell(summary[key], style="green" if summary["verified"] else "yellow")


def _cells(*values: Any) -> list[Any]:
    """Every value of a row as data (never rich markup, control characters shown as escapes)."""
    from repo_manager.cli.terminal import cell

    return [value if not isinstance(value, str | int | float) else cell(value) for value in values]


def _envs_cell(envs: list[str] | dict[str, int]) -> str:
    if isinstance(envs, dict):
        return ", ".join(f"{env}:{version}" for env, version in sorted(envs.items())) or "-"
    return ", ".join(envs) or "-"


def _table(title: str | None = None):
    from rich import box
    from rich.table import Table

    from repo_manager.cli.terminal import cell

    return Table(title=cell(title) if title is not None else None, box=box.SIMPLE_HEAD, title_justify="left",
                 pad_edge=False)


def _group(*renderables):
    from rich.console import Group

    from repo_manager.cli.terminal import cell

    return Group(*(cell(r) if isinstance(r, str) else r for r in renderables))


@cli.command("list")
@repo_option
@click.option("--all", "all_versions", is_flag=True, help="One line per version instead of per model.")
@store_option
@json_option
@pass_ctx
def list_command(ctx: Context, repository: str | None, all_versions: bool, store: str | None) -> None:
    """One line per model: backend, latest version, verified, size, environments serving it."""
    from repo_manager.ops.inventory import human_size, list_models

    settings = ctx.settings.replace(repository=repository)
    data = list_models(settings.repository, settings, store=store, all_versions=all_versions)
    from repo_manager.adapters.repository import LocalRepository

    for note in LocalRepository(settings.repository).scan()[1]:  # e.g. lost+found at a volume's root
        ctx.progress(note)
    if not data["models"]:
        ctx.emit(data, f"no models in {settings.repository}")
        return
    with_envs = "stores" in data
    table = _table()
    for header in ("model", "backend", "version" if all_versions else "latest", "verified", "size"):
        table.add_column(header, justify="right" if header in ("size", "version", "latest") else "left",
                         no_wrap=header in _NO_WRAP, overflow="fold")
    if with_envs:
        table.add_column("environments", overflow="fold", min_width=12)
    for row in data["models"]:
        if not row["versions"] or "unreadable" in row:
            table.add_row(*_cells(row["model"], "-", str(row["latest"] or "-"),
                                  "manifest unreadable" if row["versions"] else "no complete version", "-",
                                  *(["-"] if with_envs else [])))
            continue
        for item in row["all"] if all_versions else [row]:
            version = item["version"] if all_versions else row["latest"]
            envs = item["environments"] if all_versions else row["served"] if with_envs else []
            table.add_row(*_cells(row["model"], row["backend"], str(version), _verified(item["verification"], "short"),
                                  human_size(item["bytes_with_members"] or item["bytes"]),
                                  *([_envs_cell(envs)] if with_envs else [])))
    notes = [f"note: {n}" for n in data.get("notes", [])]
    if data["unreadable"]:
        notes += [f"note: {n}" for n in data["unreadable"]] + [f"note: `trm validate {settings.repository}` "
                                                               "lists every problem"]
    if any(row.get("bytes_with_members") is not None for row in data["models"]):
        notes.append("an ensemble's size includes the member versions it pins")
    ctx.emit(data, _group(table, *notes) if notes else table)


@cli.command("show")
@click.argument("name", shell_complete=complete_models)
@click.option("--version", type=int, shell_complete=complete_versions,
              help="Version whose config to show (default: the latest).")
@repo_option
@store_option
@json_option
@pass_ctx
def show_command(ctx: Context, name: str, version: int | None, repository: str | None, store: str | None) -> None:
    """A model's versions (created, source, size, verification, tuning, environments) and its config.

    The config shown is that of --version (default: the latest); --json has every record in full.
    """
    from repo_manager.ops.inventory import show_model

    settings = ctx.settings.replace(repository=repository)
    info = show_model(settings.repository, name, version, settings, store=store)
    ctx.emit(info, _show_renderable(info))


def _show_renderable(info: dict[str, Any]):
    from repo_manager.ops.inventory import size_text

    with_envs = "stores" in info
    shown = info["manifest"]["version"]
    essentials = info["essentials"]
    versions = _table(f"{info['model']} ({essentials['backend']}): {len(info['versions'])} version(s)")
    for header in ("version", "created", "source", "size", "verified", "tuning"):
        versions.add_column(header, justify="right" if header in ("version", "size") else "left", overflow="fold",
                            no_wrap=header in _NO_WRAP)
    if with_envs:
        versions.add_column("environments", overflow="fold", min_width=12)
    for row in info["version_rows"]:
        mark = f"{row['version']}*" if row["version"] == shown else str(row["version"])
        tuning = row["tuning"]["text"] if row["tuning"] else "-"
        versions.add_row(*_cells(mark, _created(row["created_at"]), row["source_text"], size_text(row),
                                 _verified(row["verification"], "text"), tuning,
                                 *([_envs_cell(row["environments"])] if with_envs else [])))
    config = _table(f"config of version {shown}")
    config.add_column("field", style="bold")
    config.add_column("value", overflow="fold")
    for key, value in essentials.items():
        if key == "steps":
            continue
        if isinstance(value, list):
            value = "\n".join(map(str, value)) or "-"
        elif isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items()) or "-"
        config.add_row(*_cells(key.replace("_", " "), str(value)))
    parts: list[Any] = [versions, config]
    if "steps" in essentials:
        steps = _table("ensemble steps")
        for header in ("step", "model", "version", "inputs", "outputs"):
            steps.add_column(header, overflow="fold")
        for i, step in enumerate(essentials["steps"], 1):
            steps.add_row(*_cells(str(i), step["model"], str(step["version"]),
                                  "\n".join(f"{k} <- {v}" for k, v in step["inputs"].items()),
                                  "\n".join(f"{k} -> {v}" for k, v in step["outputs"].items())))
        parts.append(steps)
    if info["engine"]:
        parts += _engine_renderables(info["engine"], shown)
    if info["verification_details"]:
        parts.append(f"verification of version {shown}: " + "; ".join(info["verification_details"]))
    if info.get("quality"):
        parts.append(f"version {shown}: {info['quality']}")
    if info["generation_cases"]:
        parts.append(_generation_table(info, shown))
    if info["tuning_evidence"]:
        parts.append(f"tuning of version {shown}: " + "; ".join(info["tuning_evidence"]))
    parts += [f"note: {n}" for n in info.get("notes", [])]
    return _group(*parts)


def _engine_renderables(engine: dict[str, Any], shown: int) -> list[Any]:
    from repo_manager.ops.inventory import human_size

    args = _table(f"engine arguments of version {shown} (model.json; model: the version folder)")
    args.add_column("argument", style="bold")
    args.add_column("value", overflow="fold")
    for key, value in engine["engine_args"].items():
        args.add_row(*_cells(key, json.dumps(value)))
    plan = [f"memory plan ({engine['device'] or 'device not recorded'}): {engine['reason'] or 'no reason recorded'}"
            + (f"; the engine gets {human_size(engine['kv_cache_bytes'])} of it (kv_cache_memory_bytes)"
               if engine["kv_cache_bytes"] is not None else "")]
    return [args, "\n".join(plan + [f"  {step}" for step in engine["steps"]])]


def _generation_table(info: dict[str, Any], shown: int):
    criterion = (info["manifest"]["verification"] or {}).get("criterion")
    table = _table(f"verification of version {shown}: generations"
                   + (f" ({criterion})" if isinstance(criterion, str) else ""))
    for header in ("case", "prompt tokens", "tokens", "answers", "result"):
        table.add_column(header, justify="right" if header in ("prompt tokens", "tokens", "answers") else "left",
                         overflow="fold")
    for row in info["generation_cases"]:
        table.add_row(*_cells(row["case"], *(str(row[k]) if k in row else "-"
                                             for k in ("prompt_tokens", "tokens", "responses")), row["result"]))
    return table


@cli.command("diff")
@click.argument("name", shell_complete=complete_models)
@click.argument("a", type=int, shell_complete=complete_versions)
@click.argument("b", type=int, shell_complete=complete_versions)
@repo_option
@click.option("--store", help="Compare the versions in this store (s3://bucket/prefix or a folder) instead of "
              "the local repository.")
@json_option
@pass_ctx
def diff_command(ctx: Context, name: str, a: int, b: int, repository: str | None, store: str | None) -> None:
    """What changed between versions A and B of NAME: config fields, files, source, verification, tuning.

    Exits 0 whether or not they differ (a difference is information); --json for pipelines.
    """
    from repo_manager.ops.inventory import diff_manifests, diff_text

    settings = ctx.settings.replace(repository=repository)
    if store:
        from repo_manager.adapters.storage import open_store

        source = open_store(store, settings)
        first, second = source.get_manifest(name, a), source.get_manifest(name, b)
    else:
        from repo_manager.adapters.repository import LocalRepository

        repo = LocalRepository(settings.repository)
        first, second = repo.manifest(name, a), repo.manifest(name, b)
    diff = diff_manifests(first, second)
    ctx.emit(diff, diff_text(diff))


@cli.command("validate")
@click.argument("repo_dir", required=False, type=click.Path(file_okay=False))
@click.option("--fix", is_flag=True, help="Remove leftover staging folders, repair config.pbtxt files and point a "
              "vLLM model.json at its own version folder.")
@json_option
@pass_ctx
def validate_command(ctx: Context, repo_dir: str | None, fix: bool) -> None:
    """Check layout, configs, manifests and checksums; exit 3 when there is any problem."""
    from repo_manager.ops.inventory import validate_repository

    root = repo_dir or ctx.settings.repository
    report = validate_repository(root, fix=fix)
    problems = report["problems"]
    text = "\n".join([f"{root}: {len(problems)} problem(s)"] + [f"  - {p}" for p in problems]) \
        if problems else f"{root}: OK ({report['models']} models, {report['versions']} versions)"
    text += "".join(f"\n  note: {n}" for n in report["notes"])
    if problems:
        raise InputError(f"{len(problems)} problem(s) in {root}", report=Report(report, text))
    ctx.emit(report, text)
