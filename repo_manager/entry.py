"""The `trm` executable (and ``python -m repo_manager``): the command line's front door.

Every pod start runs ``trm sync s3://… --env E`` in an init container, and most of the time nothing has
changed. Answering that takes one conditional GET and a few stats; importing click, the settings and the
store classes would take three times as long as the answer itself. So a plain, unchanged
``trm [-q] [--json] sync s3://BUCKET[/PREFIX] --env E [--repo R] [--cache C] [--model M]… [--endpoint-url U]``
is answered here by ``repo_manager.ops.sync.noop.quick`` before anything else is imported, with the same
output the full command prints. Everything else, and any doubt (another option, a settings file, an
keys not in the environment, a moved pointer, a changed file, an error),
goes to ``repo_manager.cli.main``, which decides and reports as always. The quick path writes nothing.

The option names, flags and defaults it reads are declared once, in ``repo_manager/core/defaults.py``,
which the click commands and the settings are declared with too; the result and its text are built by the
full path's own functions (``ops/sync/result_data``). ``tests/test_sync_quick.py`` checks that both paths resolve the
same settings from the same options and environment, parse the same arguments as click does, and print
the same result.
"""

from __future__ import annotations

import os
import sys

from repo_manager.core import defaults

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (this module must stay light)
if TYPE_CHECKING:
    from typing import Any

QUICK_SETTINGS = {defaults.env_variable(name) for name in defaults.SYNC_SETTINGS}
"""The ``TRM_*`` variables the quick path resolves itself; with any other one set (or a settings file) it
loads the settings like the full path (``load_settings``, which validates every one)."""

_GLOBAL_FLAGS = {flag: name for name, flags in defaults.FLAGS.items() for flag in flags}
_SYNC_OPTIONS = {option: name for name, option in defaults.SYNC_OPTIONS.items()}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        output = quick_sync(args, os.environ) if "sync" in args else None
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    except Exception:  # noqa: BLE001 - any doubt goes to the full path, which reports errors properly
        output = None
    if output is not None:
        sys.stdout.write(output)
        sys.stdout.flush()
        sys.exit(0)
    from repo_manager.cli import main as cli_main

    cli_main(args)


def parse_sync(args: list[str]) -> dict[str, Any] | None:
    """The options of a plain ``trm … sync …`` command line (click's names), or None for anything else."""
    found: dict[str, Any] = {"quiet": False, "json": False, "models": []}
    position = 0
    while position < len(args) and args[position] != "sync":
        if args[position] not in _GLOBAL_FLAGS:
            return None
        found[_GLOBAL_FLAGS[args[position]]] = True
        position += 1
    rest = args[position + 1:]
    if position == len(args):
        return None
    index = 0
    while index < len(rest):
        token = rest[index]
        index += 1
        if token in defaults.FLAGS["json"]:
            found["json"] = True
            continue
        name, equals, value = token.partition("=")
        if name in _SYNC_OPTIONS:
            if not equals:
                if index == len(rest):
                    return None
                value = rest[index]
                index += 1
            key = _SYNC_OPTIONS[name]
            if not value or value.startswith("-") or (key != "models" and key in found):
                return None  # empty, option-like or repeated: click's rules there are the full path's business
            if key == "models":
                found["models"].append(value)
            else:
                found[key] = value
        elif token.startswith("-") or "store" in found:
            return None
        else:
            found["store"] = token
    if "store" not in found or "env" not in found:
        return None
    found["models"] = tuple(found["models"])
    return found


def resolve(options: dict[str, Any], environ: dict[str, str] | os._Environ, cwd_has_config: bool) -> tuple[
        str, str, str | None] | None:
    """(repository, node cache, explicit endpoint URL) as ``load_settings`` + the options resolve them, or
    None when the full path must decide (an endpoint URL with credentials in it: it refuses it; a path
    with ``..`` in it, where pathlib's spelling and a normalised one differ).

    Without a settings file and with no ``TRM_*`` variable but these three, that is a few lookups; else
    the settings are loaded (``load_settings``: the YAML file, every variable validated)."""
    from repo_manager.ops.sync import node_cache

    if cwd_has_config or environ.get(defaults.env_variable("config")) or any(
            name.startswith("TRM_") and value and name not in QUICK_SETTINGS for name, value in environ.items()):
        from repo_manager.core.settings import load_settings

        settings = load_settings(None, dict(environ)).replace(
            **{name: options.get(name) for name in defaults.SYNC_SETTINGS})
        repository, cache_dir, endpoint = str(settings.repository), settings.cache_dir, settings.s3_endpoint_url
    else:
        found = {name: options.get(name) or environ.get(defaults.env_variable(name)) or None
                 for name in defaults.SYNC_SETTINGS}
        repository = found["repository"] or defaults.REPOSITORY
        cache_dir, endpoint = found["cache_dir"], found["s3_endpoint_url"]
    if any(".." in str(path).split("/") for path in (repository, cache_dir or "")):
        return None
    for url in (endpoint, environ.get("AWS_ENDPOINT_URL_S3"), environ.get("AWS_ENDPOINT_URL")):
        if url and "@" in url:
            return None  # the full path refuses it with its message
    cache = node_cache(repository, os.path.normpath(cache_dir) if cache_dir else None)  # (pathlib's spelling)
    return os.path.normpath(repository), cache, endpoint or None


def quick_sync(args: list[str], environ: dict[str, str] | os._Environ) -> str | None:
    """What `trm sync` prints for an unchanged environment, or None for the full path to run."""
    options = parse_sync(args)
    if options is None or not options["store"].startswith("s3://"):
        return None
    resolved = resolve(options, environ, os.path.isfile(defaults.CONFIG_FILE))
    if resolved is None:
        return None
    repository, cache, endpoint = resolved
    from repo_manager.ops.sync.noop import quick

    data = quick(options["store"], endpoint, cache, repository, options["env"], options["models"])
    if data is None:
        return None
    return render(data, options["json"])


def render(data: dict[str, Any], as_json: bool) -> str:
    """The CLI's output for this result (``Context.emit``: redacted, and printable on a terminal)."""
    import json

    if as_json:
        text = json.dumps(data, indent=2)
        if "@" in text:
            from repo_manager.core.redact import redact_data

            text = json.dumps(redact_data(json.loads(text)), indent=2)
        return text + "\n"
    from repo_manager.ops.sync.result_data import summary

    text = summary(data)
    if "@" in text or not text.replace("\n", " ").isprintable():
        from repo_manager.core.redact import printable

        text = printable(text)
    return text + "\n"
