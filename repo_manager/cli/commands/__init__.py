"""Every command module; importing one registers its commands on ``repo_manager.cli.cli``."""

from repo_manager.cli.commands import infer, publish, repository, rollout, serve, tune  # noqa: F401
