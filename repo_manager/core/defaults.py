"""Defaults and command-line names that the full command line and its quick path share.

``repo_manager/entry.py`` answers an unchanged ``trm sync s3://… --env E`` before click or the settings
are imported; it parses the options and resolves the settings with the names and defaults here, and
``core/settings.py`` and the click commands (``cli/__init__.py``, ``cli/commands/store.py``) are declared
with the same ones, so the two paths cannot drift apart. Imports nothing (it is on that path).
"""

from __future__ import annotations

REPOSITORY = "model_repository"
"""The local Triton model repository when nothing else names one (``Settings.repository``)."""
CONFIG_FILE = "configs/trm.yaml"
"""The settings file read from the current directory when it exists and neither ``--config`` nor
``$TRM_CONFIG`` names one."""

FLAGS = {"quiet": ("-q", "--quiet"), "json": ("--json",)}
"""trm's own flags the quick path understands (before the subcommand; ``--json`` after it too): name -> flags."""
SYNC_OPTIONS = {"env": "--env", "repository": "--repo", "cache_dir": "--cache", "models": "--model",
                "s3_endpoint_url": "--endpoint-url"}
"""The options of `trm sync` the quick path understands: parameter name (click's, and the setting's where
one is a setting) -> option. ``--model`` repeats; each other one is given once."""
SYNC_SETTINGS = ("repository", "cache_dir", "s3_endpoint_url")
"""The settings among them: an option, else ``$TRM_<NAME>``, else the settings file, else the default."""


def env_variable(setting: str) -> str:
    """The environment variable of a setting: ``repository`` -> ``TRM_REPOSITORY``."""
    return f"TRM_{setting.upper()}"
