"""The `trm` command line: parse, call one operation, render text or JSON. Nothing else lives here.

``main()`` is the one boundary that turns errors into a one-line message and an exit code (see
``repo_manager.core.errors`` for the table). Each command module registers its commands on ``cli``.

This module is on every command's path, `--help` and shell completion included: it imports click, the
settings and nothing heavy (no rich, numpy, protobuf or tritonclient; tests/test_cli_views.py checks).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import click

from repo_manager import __version__
from repo_manager.adapters.process import Terminated, terminate_on_signals
from repo_manager.core.defaults import FLAGS, SYNC_OPTIONS
from repo_manager.core.errors import TrmError, UsageError
from repo_manager.core.redact import printable, redact_data
from repo_manager.core.settings import Settings, load_settings


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
            click.echo(printable(f"· {message}"), err=True)

    def emit(self, data: Any, text: Any = None) -> None:
        """Print the result: JSON with --json, else ``text`` (or the JSON when there is no text).

        ``text`` may be a rich renderable (a table): it is printed to the terminal's width, in colour only
        on a terminal and never with NO_COLOR set (rich's own rules).
        """
        _print(data, text, self.json)


def _print(data: Any, text: Any, want_json: bool) -> None:
    if want_json or text is None:
        click.echo(json.dumps(redact_data(json.loads(json.dumps(data, default=str))), indent=2))
    elif isinstance(text, str):
        click.echo(printable(text))
    else:
        from repo_manager.cli.terminal import console

        console().print(text)  # data, not markup: see repo_manager/cli/terminal.py


pass_ctx = click.make_pass_decorator(Context)


def repo_option(function):
    return click.option(SYNC_OPTIONS["repository"], "repository", type=click.Path(file_okay=False),
                        help="Local model repository (default: settings 'repository').")(function)


def url_option(function):
    return click.option("--url", "triton_url", help="A running Triton server (HTTP), e.g. "
                        "http://127.0.0.1:8000. Default: trm starts an embedded one.")(function)


def json_option(function):
    """``--json`` accepted after the subcommand too (``trm list --json``)."""
    def callback(ctx: click.Context, _param, value: bool) -> None:
        if value:
            ctx.find_object(Context).json = True
    return click.option(*FLAGS["json"], "json_output", is_flag=True, expose_value=False, callback=callback,
                        help="Print machine-readable JSON.")(function)


class Number(click.ParamType):
    """A finite number for an option, optionally within bounds (``low_open``: above ``low``). nan and inf are
    refused like any other bad value (exit 2): a nan threshold compares false with everything, so a rollback
    or an alert it guards could never trigger."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        import math

        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.low is not None and (number <= self.low if self.low_open else number < self.low):
            self.fail(f"{value!r} must be {'above' if self.low_open else 'at least'} {self.low:g}", param, ctx)
        if self.high is not None and number > self.high:
            self.fail(f"{value!r} must be at most {self.high:g}", param, ctx)
        return number


NUMBER = Number()
POSITIVE = Number(0, low_open=True)
NON_NEGATIVE = Number(0)
FRACTION = Number(0, 1)


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use (see ``repo_manager.cli.commands``).

    Its own help and the completion of command names use the static one-line help table, so that
    `trm --help` and `trm <TAB>` import no command module.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        from repo_manager.cli.commands import COMMANDS

        return sorted(set(COMMANDS) | set(self.commands))

    def _short_help(self, ctx: click.Context, name: str, limit: int = 45) -> str | None:
        """The command's one-line help; None for a hidden or unknown command."""
        from repo_manager.cli.commands import SHORT_HELP

        if name in SHORT_HELP and name not in self.commands:
            # a bare Command carrying the text: click shortens it exactly as it would the real command's
            return click.Command(name, help=SHORT_HELP[name]).get_short_help_str(limit)
        command = self.get_command(ctx, name)
        if command is None or command.hidden:
            return None
        return command.get_short_help_str(limit)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, text) for name in names if (text := self._short_help(ctx, name, limit)) is not None]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list:
        from click.shell_completion import CompletionItem

        items = [CompletionItem(name, help=text) for name in self.list_commands(ctx)
                 if name.startswith(incomplete) and (text := self._short_help(ctx, name)) is not None]
        return items + click.Command.shell_complete(self, ctx, incomplete)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        from repo_manager.cli.commands import COMMANDS

        if cmd_name not in self.commands and cmd_name in COMMANDS:
            importlib.import_module(f"repo_manager.cli.commands.{COMMANDS[cmd_name]}")
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                            list[str]]:
        name = click.utils.make_str(args[0])
        if not ctx.resilient_parsing and not name.startswith("-") and self.get_command(ctx, name) is None:
            # click suggests only among the commands imported so far; `trm lst` should hear of `list`
            import difflib

            close = difflib.get_close_matches(name, self.list_commands(ctx))
            ctx.fail(f"No such command {name!r}." + (f" Did you mean {close[0]!r}?" if len(close) == 1 else
                                                     f" Did you mean one of: {', '.join(close)}?" if close else ""))
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), envvar="TRM_CONFIG",
              help="Settings file (default: configs/trm.yaml when present).")
@click.option(*FLAGS["json"], "json_output", is_flag=True, help="Print machine-readable JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks on errors.")
@click.option(*FLAGS["quiet"], "quiet", is_flag=True, help="No progress messages.")
@click.version_option(__version__, prog_name="trm")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None, json_output: bool, verbose: bool, quiet: bool) -> None:
    """trm: publish, tune, store, sync and roll out versioned Triton models."""
    ctx.obj = Context(load_settings(config_file), json=json_output, verbose=verbose, quiet=quiet)
    from repo_manager.adapters.triton.restricted import process_key

    ctx.with_resource(process_key(ctx.obj.settings))  # Triton's restricted-API key, for this command


# ------------------------------------------------------------------------------------ shell completion
# Called by click's completion protocol (`_TRM_COMPLETE=bash_complete trm ...`). The group's callback has
# not run there, so each completer loads the settings itself; any failure completes nothing rather than
# printing an error into the user's shell.

def _completion_settings(ctx: click.Context) -> Settings:
    return load_settings(ctx.find_root().params.get("config_file"))


def complete_models(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Model names of the repository (--repo when typed before, else the settings' repository)."""
    try:
        from repo_manager.adapters.repository import LocalRepository

        root = ctx.params.get("repository") or _completion_settings(ctx).repository
        return [name for name in LocalRepository(root).models() if name.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion must never break the shell
        return []


def complete_versions(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Version numbers of the model named by the command's NAME argument, in the repository."""
    try:
        from repo_manager.adapters.repository import LocalRepository

        root = ctx.params.get("repository") or _completion_settings(ctx).repository
        versions = LocalRepository(root).versions(ctx.params["name"])
        return [str(v) for v in versions if str(v).startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion must never break the shell
        return []


def complete_envs(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[str]:
    """Environment names: those in the settings, and those in the store (--store when typed, else the
    settings' store)."""
    try:
        settings = _completion_settings(ctx)
    except Exception:  # noqa: BLE001 - completion must never break the shell
        return []
    names = set(settings.environments)
    location = ctx.params.get("store") or settings.store
    if location:
        names.update(_store_envs(location, settings))
    return sorted(name for name in names if name.startswith(incomplete))


COMPLETION_STORE_TIMEOUT_S = 1.0
"""How long env-name completion waits for the store (each connect and read, and the look-up as a whole);
a store that does not answer in time completes the names of the settings only. ``TRM_COMPLETION_TIMEOUT_S``
sets another (a store far away, or a busy machine)."""


def _completion_timeout_s() -> float:
    try:
        value = float(os.environ.get("TRM_COMPLETION_TIMEOUT_S", COMPLETION_STORE_TIMEOUT_S))
    except ValueError:  # completion must never break the shell: a bad value is the default
        return COMPLETION_STORE_TIMEOUT_S
    return value if value > 0 else COMPLETION_STORE_TIMEOUT_S


def _store_envs(location: str, settings: Settings) -> list[str]:
    """The store's environment names, or none when it fails or does not answer within
    COMPLETION_STORE_TIMEOUT_S (or TRM_COMPLETION_TIMEOUT_S). The short client timeouts bound the network; the
    thread also bounds what they cannot (name resolution, the credential chain, a folder store on a hung
    mount): it is left behind, a daemon, when the shell's answer is printed and the process exits."""
    found: list[str] = []
    timeout_s = _completion_timeout_s()

    def look_up() -> None:
        try:
            from repo_manager.adapters.storage import open_store

            found.extend(open_store(location, settings, timeout_s=timeout_s).list_envs())
        except Exception:  # noqa: BLE001 - an unreachable store still completes the configured names
            pass

    worker = threading.Thread(target=look_up, name="trm-complete-envs", daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    return list(found) if not worker.is_alive() else []


# click >= 8.2 raises this for a group called without a command; older releases print the help themselves
_NoArgsIsHelp: type[click.ClickException] = getattr(click.exceptions, "NoArgsIsHelpError", type("_Never", (
    click.ClickException,), {}))


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
    except _NoArgsIsHelp as exc:  # bare `trm` / `trm publish`: the help, not a multi-line "error"
        click.echo(exc.ctx.get_help())
        sys.exit(0)
    except click.ClickException as exc:
        _fail(UsageError(exc.format_message()), want_json, verbose)
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place that catches everything
        if verbose:
            click.echo(printable(traceback.format_exc()), err=True, nl=False)
        message = f"internal error ({type(exc).__name__}: {exc}); rerun with --verbose and report it"
        if want_json:  # --json promises JSON on stdout, even for a bug
            click.echo(json.dumps({"error": redact_data({"kind": "internal", "message": message, "exit_code": 1})},
                                  indent=2))
        click.echo(printable(f"error: {message}"), err=True)
        sys.exit(1)
    sys.exit(0)


def _fail(exc: TrmError, want_json: bool, verbose: bool) -> None:
    # every line goes through printable(): no URL credentials in any output (see repo_manager/core/redact.py)
    if verbose:
        click.echo(printable(traceback.format_exc()), err=True, nl=False)
    if exc.report is not None:  # the command's result up to the failure, then the error
        data = {**exc.report.data, "error": exc.to_dict()} if want_json else exc.report.data
        _print(data, exc.report.text, want_json)
    elif want_json:
        click.echo(json.dumps({"error": redact_data(exc.to_dict())}, indent=2))
    first, *rest = printable(exc.message).splitlines() or [""]
    click.echo(f"error: {first}", err=True)
    for line in rest:  # e.g. the tail of a server log
        click.echo(f"  | {line}", err=True)
    if exc.hint:
        click.echo(f"hint: {printable(exc.hint)}", err=True)
    sys.exit(exc.exit_code)
