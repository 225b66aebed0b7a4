"""The one redaction point for URLs: credentials never leave trm in any output.

Credentials come only from the AWS chain (environment, profile, role). A URL that carries them
(``s3://KEY:SECRET@bucket``, ``http://user:pass@host``) is refused where it enters (``check_no_userinfo``),
and everything trm prints or records (errors, ``--json`` documents, progress lines, tracebacks with
``--verbose``, history records) passes through ``redact`` first, so even a URL that slipped past a check
shows ``***@`` instead of its user and password.
"""

from __future__ import annotations

import re
from typing import Any

from repo_manager.core.errors import UsageError

# scheme://userinfo@ - userinfo up to the first '@': any characters but whitespace (a password may hold quotes,
# '<', '/': AWS secret keys do, which moves the rest of the secret into what a URL parser calls the path), or,
# for a password with a space in it, any characters but a newline, a double quote (which ends a JSON string)
# or a '/' (a path: "s3://b/models to /srv; mail ops@corp" is not a URL with a password).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)(?:[^@\s]*|[^@\n\"/]*)@")
REDACTED = "***"
_SECRETS: set[str] = set()


def add_secret(value: str) -> None:
    """A secret that is not a URL (Triton's restricted-API key): ``redact`` replaces it wherever it appears."""
    if len(value) >= 8:  # (shorter ones are refused where they are read; never blank out common text)
        _SECRETS.add(value)


def redact(text: str) -> str:
    """``text`` with the user and password of every URL in it, and every added secret, replaced by ``***``."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "@" not in text:
        return text
    return _USERINFO.sub(rf"\1{REDACTED}@", text)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``redact(text)``, made safe for a terminal: control characters (an escape sequence from hostile store
    content) and lone surrogates (a JSON ``\\ud800`` that cannot be encoded) are shown as escapes."""
    text = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), redact(text))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def redact_data(data: Any) -> Any:
    """``redact`` applied to every string inside a JSON-like document (keys included)."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {redact_data(k): redact_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v) for v in data]
    return data


def has_userinfo(url: str) -> bool:
    """True for ``scheme://…@…``: an '@' anywhere after the scheme (a secret with a '/' in it moves the
    '@' past the first '/'); store locations and endpoints never need one."""
    _, sep, rest = url.partition("://")
    return bool(sep) and "@" in rest


def check_no_userinfo(url: str, origin: str) -> str:
    """Refuse a location that carries credentials (``scheme://USER:SECRET@…``), without repeating it."""
    if has_userinfo(url):
        raise UsageError(f"the location from {origin} carries credentials (USER:SECRET@)",
                         hint="give it without them; credentials come from AWS_ACCESS_KEY_ID/"
                              "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role")
    return url
