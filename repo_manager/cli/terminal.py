"""What trm draws on a terminal is data, never markup or control sequences.

Model names, tensor names, backends, config parameters, agent fields and Triton's metric labels all come
from outside trm. Printed through rich as plain ``str`` they would be read as rich markup (``[/ml]`` raises,
``[test]`` vanishes) and their escape sequences (a window title, a clear screen) would reach the terminal.
``console()`` prints with markup and emoji codes off, and every text it lays out (table cells, titles) goes
through ``redact.printable`` first (control characters shown as escapes, URL credentials redacted);
``cell()`` does the same for a ``Text`` made by hand (one with a style).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from repo_manager.core.redact import printable


class _DataConsole(Console):
    def render_str(self, text: str, **options: Any) -> Text:
        return super().render_str(printable(text), **options)


def console(**options: Any) -> Console:
    """A rich console for data: no markup, no emoji codes, no highlighting, printable text only."""
    return _DataConsole(highlight=False, markup=False, emoji=False, **options)


def cell(value: Any, style: str = "") -> Text:
    """``value`` as a table cell: its text exactly (made printable), never markup."""
    return Text(printable(str(value)), style=style)
