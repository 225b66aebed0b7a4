"""`trm adopt`: make an existing Triton model repository a trm repository."""

from __future__ import annotations

import click

from repo_manager.cli import Context, cli, json_option, pass_ctx, url_option


@cli.command("adopt")
@click.argument("repo_dir", type=click.Path(file_okay=False))
@click.option("--into", "target", type=click.Path(file_okay=False),
              help="Copy the versions into this repository instead of adding manifests in place.")
@click.option("--dry-run", is_flag=True, help="Print the plan (what would be adopted, what is refused) only.")
@click.option("--skip-broken", is_flag=True, help="Adopt what can be adopted; report the rest (exit 0).")
@click.option("--no-verify", "no_verify", is_flag=True, help="Do not load the versions on Triton.")
@url_option
@json_option
@pass_ctx
def adopt_command(ctx: Context, repo_dir: str, target: str | None, dry_run: bool, skip_broken: bool,
                  no_verify: bool, triton_url: str | None) -> None:
    """Adopt the Triton repository REPO_DIR: every model version gets a manifest (files, sha256, original
    config, verification). Files are never modified; exit 3 when anything is refused (see --skip-broken)."""
    from repo_manager.core.errors import InputError, Report
    from repo_manager.ops.adopt import execute_adoption, plan_adoption

    plan = plan_adoption(repo_dir, target)
    if dry_run:
        report = Report(plan.to_dict(), _plan_text(plan.to_dict()))
        if plan.problems() and not skip_broken:
            raise InputError(f"{len(plan.problems())} problem(s): nothing would be adopted without --skip-broken",
                             report=report)
        ctx.emit(report.data, report.text)
        return
    settings = ctx.settings.replace(triton_url=triton_url)
    result = execute_adoption(plan, settings, verify_models=not no_verify, skip_broken=skip_broken,
                              progress=ctx.progress)
    data = result.to_dict()
    lines = [f"adopted {len(result.adopted)} version(s), {result.present} already adopted, "
             f"{len(result.refused)} refused ({result.seconds:.1f} s)"]
    for item in result.adopted:
        lines.append(f"  {item.model}/{item.version}: " + (f"verified ({item.detail})" if item.verified
                                                           else f"unverified: {item.detail}"))
    lines += [f"  refused {p}" for p in result.refused]
    # what Triton ignores (a model file beside config.pbtxt, a stray folder) is said here too, not only by --dry-run
    lines += [f"  note: {m.name}: {n}" for m in result.plan.models for n in m.notes]
    lines += [f"  note: {n}" for n in result.plan.notes]
    ctx.emit(data, "\n".join(lines))


def _plan_text(plan: dict) -> str:
    counts = plan["counts"]
    lines = [f"{plan['source']}: {counts['adopt']} to adopt, {counts['present']} already adopted, "
             f"{counts['refused']} refused" + (f" → into {plan['target']}" if plan["target"] else " (in place)")]
    for model in plan["models"]:
        head = f"  {model['model']} [{model['backend'] or '?'}]"
        if model.get("refused"):
            lines.append(f"{head}: REFUSED {model['refused']}")
            continue
        lines.append(head)
        for version in model["versions"]:
            reason = f": {version['reason']}" if version.get("reason") else ""
            lines.append(f"    {version['version']}: {version['action']}{reason}")
        if model.get("labels"):
            lines.append(f"    label files: {', '.join(model['labels'])} (carried in every version's manifest)")
        lines += [f"    note: {n}" for n in model["notes"]]
    lines += [f"  note: {n}" for n in plan["notes"]]
    return "\n".join(lines)
