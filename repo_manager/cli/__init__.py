"""The `trm` command line: parse, call one operation, render text or JSON. Nothing else lives here.

``main()`` is the one boundary that turns errors into a one-line message and an exit code (see
``repo_manager.errors`` for the table). Each command module registers its commands on ``cli``.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import click

from repo_manager import __version__
from repo_manager.errors import TrmError, UsageError
from repo_manager.process import Terminated, terminate_on_signals
from repo_manager.settings import Settings, load_settings


@dataclass
class Context:
    settings: Settings
    json: bool = False
    verbose: bool = False
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def progress(self, message: str) -> None:
        """Progress goes to stderr, so stdout stays clean for --json."""
        if not self.quiet:
            click.echo(f"· {message}", err=True)

    def emit(self, data: Any, text: str | None = None) -> None:
        """Print the result: JSON with --json, else ``text`` (or the JSON when there is no text)."""
        if self.json or text is None:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            click.echo(text)


pass_ctx = click.make_pass_decorator(Context)


def repo_option(function):
    return click.option("--repo", "repository", type=click.Path(file_okay=False),
                        help="Local model repository (default: settings 'repository').")(function)


def url_option(function):
    return click.option("--url", "triton_url", help="A running Triton server (HTTP), e.g. "
                        "http://127.0.0.1:8000. Default: trm starts an embedded one.")(function)


def json_option(function):
    """``--json`` accepted after the subcommand too (``trm list --json``)."""
    def callback(ctx: click.Context, _param, value: bool) -> None:
        if value:
            ctx.find_object(Context).json = True
    return click.option("--json", "json_output", is_flag=True, expose_value=False, callback=callback,
                        help="Print machine-readable JSON.")(function)


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use (see ``repo_manager.cli.commands``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from repo_manager.cli.commands import COMMANDS  # noqa: PLC0415

        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        from repo_manager.cli.commands import COMMANDS  # noqa: PLC0415

        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(f"repo_manager.cli.commands.{COMMANDS[cmd_name]}")
        return self.commands.get(cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="TRM_CONFIG",
              help="Settings file (default: configs/trm.yaml when present).")
@click.option("--json", "json_output", is_flag=True, help="Print machine-readable JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="No progress messages.")
@click.version_option(__version__, prog_name="trm")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None, json_output: bool, verbose: bool, quiet: bool) -> None:
    """trm: publish, tune, store, sync and roll out versioned Triton models."""
    ctx.obj = Context(load_settings(config_file), json=json_output, verbose=verbose, quiet=quiet)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and map every error to its exit code."""
    args = sys.argv[1:] if argv is None else argv
    want_json = "--json" in args
    verbose = "-v" in args or "--verbose" in args
    try:
        with terminate_on_signals():
            cli.main(args=args, prog_name="trm", standalone_mode=False)
    except Terminated as exc:
        click.echo(f"error: terminated by {signal.Signals(exc.signum).name}", err=True)
        sys.exit(exc.code)
    except TrmError as exc:
        _fail(exc, want_json, verbose)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        _fail(UsageError(exc.format_message()), want_json, verbose)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place that catches everything
        if verbose:
            traceback.print_exc()
        click.echo(f"error: internal error ({type(exc).__name__}: {exc}); rerun with --verbose and "
                   "report it", err=True)
        sys.exit(1)
    sys.exit(0)


def _fail(exc: TrmError, want_json: bool, verbose: bool) -> None:
    if verbose:
        traceback.print_exc()
    if want_json and not exc.reported:
        click.echo(json.dumps({"error": exc.to_dict()}, indent=2))
    first, *rest = exc.message.splitlines() or [""]
    click.echo(f"error: {first}", err=True)
    for line in rest:  # e.g. the tail of a server log
        click.echo(f"  | {line}", err=True)
    if exc.hint:
        click.echo(f"hint: {exc.hint}", err=True)
    sys.exit(exc.exit_code)
