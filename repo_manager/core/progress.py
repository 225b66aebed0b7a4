"""Progress callbacks: operations say what they are doing through a ``Progress``; the CLI prints it to
stderr (``Context.progress``), tests and library users pass nothing."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """The default progress: report nothing."""
