"""Every error trm raises on purpose, and the exit code each one maps to.

Errors carry the facts (model, version, path, server URL) as attributes and a one-line message that says
what happened; ``hint`` says what fixes it. The CLI boundary (``repo_manager.cli.main``) is the only place
that turns them into text and exit codes. Anything that is not a ``TrmError`` is a bug: exit code 1 and a
traceback with ``--verbose``.

Exit codes: ``EXIT_CODES`` below is the one table. README.md, docs/promotion.md, docs/rollout.md and
ci/pipeline.sh repeat it for their readers; tests/test_cli.py checks every copy against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any


@dataclass(frozen=True)
class Report:
    """What a command had found or done when it failed (a validation report, a rolled-back rollout, a blocked
    promotion): the CLI prints it as the command's result (``data`` with --json, the error beside it;
    ``text`` otherwise: a string or a rich table), then the error line."""

    data: dict[str, Any]
    text: Any = None
    result: Any = None
    """The operation's own result object, for API callers (a ``RolloutResult``, a ``PromotionResult``)."""


FACTS = ("model", "version", "path", "url", "store", "env", "case", "reason", "requires", "port", "log", "worst",
         "status", "pod")
"""The facts an error may carry, each a keyword of ``TrmError`` and an attribute of every error (None when it
does not apply); ``--json`` prints the ones that are set."""


class TrmError(Exception):
    """Base of all expected failures. ``hint`` tells the user what to do next; ``report`` is the command's
    result up to the failure, when it has one; the facts (``FACTS``) say what it concerns."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None, report: Report | None = None,
                 model: str | None = None, version: int | str | None = None, path: str | PathLike[str] | None = None,
                 url: str | None = None, store: str | None = None, env: str | None = None, case: str | None = None,
                 reason: str | None = None, requires: str | None = None, port: int | None = None,
                 log: str | None = None, worst: float | None = None, status: int | None = None,
                 pod: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.report = report
        self.model, self.version, self.path, self.url, self.store = model, version, path, url, store
        self.env, self.case, self.reason, self.requires, self.port = env, case, reason, requires, port
        self.log, self.worst, self.status, self.pod = log, worst, status, pod

    @property
    def facts(self) -> dict[str, Any]:
        """The facts that are set, by name (to pass on to another error: ``**exc.facts``)."""
        return {name: getattr(self, name) for name in FACTS if getattr(self, name) is not None}

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"kind": self.kind, "message": self.message, "exit_code": self.exit_code}
        if self.hint:
            data["hint"] = self.hint
        data.update({k: str(v) for k, v in self.facts.items()})
        return data


class UsageError(TrmError):
    exit_code = 2
    kind = "usage"


class InputError(TrmError):
    """The user's input (a file, a folder, a name, a config) is wrong; nothing was changed."""

    exit_code = 3
    kind = "input"


class ConfigError(InputError):
    """A config.pbtxt or a trm settings file cannot be parsed or is not valid."""

    kind = "config"


class RefusedError(InputError):
    """A part of the input that trm will not take as it is, and why (`trm adopt`: a model folder's config, label
    or data file). Planning records it as that part's verdict; the command fails only when asked to act on it."""

    kind = "refused"


class NotFoundError(TrmError):
    exit_code = 4
    kind = "not_found"


class StoreNotFoundError(NotFoundError):
    """The store itself does not exist (a folder store's folder, an S3 bucket): not an object inside it."""

    kind = "store_not_found"


class VersionExistsError(InputError):
    """The target already holds a *different* version under the same number; it is never replaced."""

    kind = "version_exists"


class VerificationError(TrmError):
    """The model loaded but its answers differ from the reference, or it did not load at all."""

    exit_code = 5
    kind = "verification"


class ServerError(TrmError):
    """Triton is not reachable, did not start, or refused a request."""

    exit_code = 6
    kind = "server"


class ServerStartError(ServerError):
    kind = "server_start"


class ModelLoadError(ServerError):
    kind = "model_load"


class StoreError(TrmError):
    exit_code = 7
    kind = "store"


class IntegrityError(StoreError):
    """Data whose size or sha256 does not match its manifest, or a manifest that is hostile."""

    kind = "integrity"


class ConflictError(TrmError):
    """Another writer won a race (a version number, an environment pointer)."""

    exit_code = 8
    kind = "conflict"


class GateError(TrmError):
    """A measured requirement was not met: an SLO, a promotion gate, a check."""

    exit_code = 9
    kind = "gate"


class RolledBackError(TrmError):
    """A rollout step failed; every changed server was rolled back. ``reason`` says which step;
    ``changed`` is False when nothing had changed anywhere yet (the pre-check refused the version)."""

    exit_code = 10
    kind = "rolled_back"

    def __init__(self, message: str, *, changed: bool = True, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.changed = changed


class CompatibilityError(TrmError):
    """An engine or model cannot run on this node: GPU architecture, driver, memory."""

    exit_code = 11
    kind = "compatibility"


EXIT_CODES: dict[int, tuple[str, str]] = {
    0: ("-", "success"),
    1: ("(any other exception)", "internal error: a bug in trm"),
    UsageError.exit_code: ("UsageError", "bad command-line usage"),
    InputError.exit_code: ("InputError", "bad input"),
    NotFoundError.exit_code: ("NotFoundError", "not found"),
    VerificationError.exit_code: ("VerificationError", "verification failed"),
    ServerError.exit_code: ("ServerError", "Triton is down, unreachable, or refused an operation"),
    StoreError.exit_code: ("StoreError", "remote store error"),
    ConflictError.exit_code: ("ConflictError", "lost a race (version number, environment pointer): retry"),
    GateError.exit_code: ("GateError", "a gate or SLO was not met"),
    RolledBackError.exit_code: ("RolledBackError", "a rollout failed and was rolled back"),
    CompatibilityError.exit_code: ("CompatibilityError", "an engine cannot run on this node"),
}
"""code -> (the class that exits with it, its meaning in a few words). Every code trm exits with besides the
signal codes 128 + N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP: ``SIGNAL_EXIT_CODES``)."""

SIGNAL_EXIT_CODES: dict[int, str] = {130: "SIGINT", 143: "SIGTERM", 129: "SIGHUP"}
"""Interrupted: servers stopped and staging removed before exiting with 128 + the signal's number."""
