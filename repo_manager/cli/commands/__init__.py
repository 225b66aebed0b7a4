"""Every command module; importing one registers its commands on ``repo_manager.cli.cli``."""

from repo_manager.cli.commands import infer, llm, promote, publish, repository, serve, store, tune  # noqa: F401
