"""`trm rollout`: move running Triton servers to a new version with zero failed requests.

``build_plan`` (plan.py) decides per server what happens and why; ``execute`` (execute.py) does it,
step by step, rolling back on failure, into a ``RolloutResult`` (result.py); ``checks`` holds the smoke
check and the soak watch; ``record`` keeps what is serving where. ``run_rollout`` ties them together for the CLI.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from repo_manager.adapters.repository import LocalRepository
from repo_manager.core.errors import UsageError
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.rollout.execute import execute
from repo_manager.ops.rollout.plan import (
    PlannedRepository,
    RolloutOptions,
    RolloutPlan,
    build_plan,
    parse_size,
    with_settings,
)
from repo_manager.ops.rollout.record import ServerStatus, describe_status, server_status
from repo_manager.ops.rollout.result import RolloutResult

__all__ = ["RolloutOptions", "RolloutPlan", "RolloutResult", "ServerStatus", "describe_status", "execute",
           "parse_size", "plan_rollout", "run_rollout", "server_status"]




def plan_rollout(settings: Settings, model: str, version: int | None, urls: list[str],
                 options: RolloutOptions, *, to_previous: bool = False, source: str | None = None,
                 grpc_urls: list[str] | None = None, metrics_urls: list[str] | None = None,
                 progress: Progress = quiet) -> RolloutPlan:
    """The plan for moving ``urls`` to ``version`` of ``model`` from the local repository; with ``source``,
    after installing the version from that store (planned here, done by ``run_rollout``). Writes nothing."""
    repo = LocalRepository(settings.repository)
    install = None
    if source is not None:
        if version is None:
            raise UsageError("--from STORE needs --version N")
        from repo_manager.adapters.storage import open_store  # noqa: PLC0415 - only a rollout --from STORE
        from repo_manager.ops.sync import plan_versions  # noqa: PLC0415 - only a rollout --from STORE

        progress(f"planning the install of {model} version {version} from {source}")
        install = plan_versions(settings, open_store(source, settings), {model: version})
        repo = PlannedRepository(repo, install)
    elif not repo.root.is_dir():
        raise UsageError(f"repository {repo.root} does not exist", hint="pass --repo DIR")
    progress(f"planning {model} on {len(urls)} server(s)")
    options = with_settings(options, model, settings.rollout)
    plan = build_plan(repo, model, version, urls, options, to_previous=to_previous, grpc_urls=grpc_urls,
                      metrics_urls=metrics_urls)
    if options.smoke_file is not None:  # a smoke file that cannot be used is bad input, before any server changes
        from repo_manager.core import config as cfg  # noqa: PLC0415 - only with a smoke file
        from repo_manager.ops.rollout.checks import smoke_cases  # noqa: PLC0415 - only with a smoke file

        smoke_cases(cfg.parse_config(repo.manifest(plan.target.model, plan.target.version).config),
                    options.smoke_file)
    return dataclasses.replace(plan, install=install)


def run_rollout(settings: Settings, plan: RolloutPlan, progress: Progress = quiet) -> RolloutResult:
    """Install what the plan installs (``--from``), then move the servers."""
    if plan.install is not None:
        from repo_manager.adapters.storage import open_store  # noqa: PLC0415 - only a rollout --from STORE
        from repo_manager.ops.sync import execute as install  # noqa: PLC0415 - only a rollout --from STORE

        progress(f"installing from {plan.install.store}")
        result = install(plan.install, open_store(plan.install.store, settings))
        progress(f"installed from {plan.install.store}: {result.to_dict().get('bytes_downloaded', 0)} bytes "
                 "downloaded")
    return execute(plan, LocalRepository(Path(plan.repository)), progress)
