"""`trm promote`, `trm history`, `trm specs`: moving versions between environments, on record."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from repo_manager.cli import NUMBER, Context, cli, complete_envs, complete_models, json_option, pass_ctx, url_option
from repo_manager.cli.commands.store import endpoint_option
from repo_manager.core.errors import GateError, UsageError


@cli.command("promote")
@click.argument("name", shell_complete=complete_models)
@click.option("--to", "to_env", required=True, shell_complete=complete_envs,
              help="Environment to point at the version (e.g. production).")
@click.option("--from", "from_env", shell_complete=complete_envs,
              help="Environment that serves the version now (e.g. staging).")
@click.option("--version", type=int, help="Version to promote (default: the one --from serves).")
@click.option("--rollback", is_flag=True, help="Point --to back at the version it served before the current one.")
@click.option("--store", help="Store of both environments (default: each environment's store in configs/).")
@click.option("--to-store", help="Store of the --to environment only (e.g. a separate production bucket).")
@click.option("--gates", help="Comma-separated: checksums, load, latency, agreement, quality, eval; or auto / all "
              "(default: settings gates.default, else auto).")
@click.option("--sample", type=click.Path(dir_okay=False), help=".npz inputs for the agreement and latency gates "
              "(default: the model's spec in configs/models/).")
@click.option("--eval-cmd", help="Evaluation command for the eval gate; it prints a score on its last line.")
@click.option("--eval-threshold", type=NUMBER, help="Lowest score the eval gate accepts.")
@click.option("--quality-data", type=click.Path(dir_okay=False), help="A text service's JSON-lines items for the "
              "quality gate: the new version's answers against the replaced version's, judged by the quality "
              "thresholds (default: quality_data in the model's spec; with it, auto runs the gate).")
@url_option
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--create-env", is_flag=True, help="Create --to if it is neither declared in the settings "
              "(environments:) nor present in the store (without it, a mistyped name is refused).")
@endpoint_option
@json_option
@pass_ctx
def promote_command(ctx: Context, name: str, to_env: str, from_env: str | None, version: int | None, rollback: bool,
                    store: str | None, to_store: str | None, gates: str | None, sample: str | None,
                    eval_cmd: str | None, eval_threshold: float | None, quality_data: str | None,
                    triton_url: str | None, dry_run: bool,
                    create_env: bool, s3_endpoint_url: str | None) -> None:
    """Point environment --to at version --version of NAME after its gates pass; exit 9 when a gate
    fails, 8 when another promotion won the race (nothing is changed in either case)."""
    from repo_manager.core.environments import parse_gates
    from repo_manager.ops.promote import PromotionRequest, execute_promotion, plan_promotion

    settings = ctx.settings.replace(triton_url=triton_url, s3_endpoint_url=s3_endpoint_url)
    request = PromotionRequest(name, to_env, version, from_env, rollback,
                               parse_gates(gates, settings) if gates is not None else None, store, to_store,
                               Path(sample) if sample else None, eval_cmd, eval_threshold, create_env,
                               Path(quality_data) if quality_data else None)
    planned = plan_promotion(settings, request, progress=ctx.progress)
    if dry_run and not planned.nothing_to_do:
        from repo_manager.ops.inventory import diff_text, promotion_diff

        diff = promotion_diff(planned)
        ctx.emit({"dry_run": True, "plan": planned.plan.to_dict(), "diff": diff},
                 planned.plan.describe() + ("\n" + diff_text(diff) if diff else ""))
        return
    try:
        result = execute_promotion(settings, planned, progress=ctx.progress)
    except GateError as exc:
        if exc.report is not None:  # the gates' lines as the text of the blocked promotion's report
            exc.report = dataclasses.replace(exc.report, text=_gate_lines(exc.report.result.gates))
        raise
    plan = result.plan
    if not result.moved:
        ctx.emit(result.to_dict(), f"{plan.to_env} already serves {plan.model} version {plan.version}; nothing to do")
        return
    text = (f"{plan.to_env} now serves {plan.model} version {plan.version} (was "
            f"{plan.replaces if plan.replaces is not None else 'nothing'})"
            + (f"; copied {result.blobs_copied} blob(s), {result.bytes_copied} bytes" if plan.cross_store else "")
            + "\n" + _gate_lines(result.gates))
    ctx.emit(result.to_dict(), text)


def _gate_lines(gates) -> str:
    return "\n".join(f"  {'PASS' if r.passed else 'FAIL'} {r.name}: {r.summary}" for r in gates)


@cli.command("history")
@click.argument("env", shell_complete=complete_envs)
@click.argument("name", required=False, shell_complete=complete_models)
@click.option("--store", help="Store of the environment (default: its store in configs/).")
@endpoint_option
@json_option
@pass_ctx
def history_command(ctx: Context, env: str, name: str | None, store: str | None, s3_endpoint_url: str | None) -> None:
    """Every promotion and rollback of ENV (of model NAME only, if given), oldest first."""
    settings = ctx.settings.replace(s3_endpoint_url=s3_endpoint_url)
    from repo_manager.ops.promote import read_history

    view = read_history(settings, env, name, store)
    location, records = view.store, view.records
    lines = [f"{r.at}  {r.action:8} {r.model} {r.from_version or '-'} -> {r.to_version}"
             f"  gates: {', '.join(g['gate'] + ('' if g['passed'] else ' FAILED') for g in r.gates) or '-'}"
             f"  by {_by(r.pipeline)}" for r in records]
    lines += [f"note: {m} is {_served(v['serving'])} but "
              + (f"its last record says version {v['last_recorded']}" if v["last_recorded"] is not None
                 else "no promotion recorded it") + " (moved outside `trm promote`, e.g. by `trm push --env`)"
              for m, v in view.unrecorded.items()]
    ctx.emit({"env": env, **view.to_dict()}, "\n".join(lines) if lines else f"no history for {env} in {location}")


def _by(pipeline: dict) -> str:
    return str(pipeline.get("github_run_id") or pipeline.get("ci_pipeline_id") or pipeline.get("user") or "unknown")


def _served(version: int | None) -> str:
    return f"served at version {version}" if version is not None else "not served"


@cli.command("specs")
@json_option
@pass_ctx
def specs_command(ctx: Context) -> None:
    """The environments (and the store of each) and the model specs in configs/, for pipelines."""
    from repo_manager.core.environments import env_store, model_specs

    settings = ctx.settings
    envs = {}
    for env in settings.environments:
        try:
            envs[env] = env_store(settings, env)
        except UsageError:
            envs[env] = None  # no store configured yet: commands then need --store
    specs = [spec.to_dict() for spec in model_specs(settings)]
    text = "\n".join([f"environment {e}: {s}" for e, s in envs.items()]
                     + [f"model {s['name']}: {s['source']}" for s in specs]) or "no environments or model specs"
    ctx.emit({"environments": envs, "models": specs}, text)
