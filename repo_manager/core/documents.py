"""Bounded parsing of the JSON documents trm reads from stores and repositories (manifests, environment
pointers, history records).

Everything in a store may be hostile. Before a document is parsed its size is checked (a store object is
never read past ``MAX_DOCUMENT_BYTES``); parsing itself cannot recurse without bound (a document nested
millions deep is refused, not a ``RecursionError``); after parsing, nesting deeper than ``MAX_DEPTH`` is
refused. Any failure is an ``IntegrityError`` (exit 7) naming the document.
"""

from __future__ import annotations

import json
from typing import Any

from repo_manager.core.errors import IntegrityError

MAX_DOCUMENT_BYTES = 32 * 1024 * 1024
"""A manifest of 100,000 files is about 20 MB; nothing trm writes comes near this."""
MAX_POINTER_BYTES = 1024 * 1024
"""An environment pointer or a history record (tens of models, a few gate results)."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings (the deepest trm writes is about 6)."""
MAX_FILE_BYTES = 5 * 1024 ** 4
"""Largest file a manifest may list: S3's largest object (5 TiB), the smallest limit of trm's backends."""
MAX_FILES = 1_000_000


def check_size(size: int, origin: str, limit: int = MAX_DOCUMENT_BYTES) -> None:
    if size > limit:
        raise IntegrityError(f"{origin} is {size} bytes, more than any trm document ({limit} bytes)",
                             hint="the store holds something trm did not write there")


def parse(payload: bytes | str, origin: str, *, limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """The JSON value in ``payload``, bounded in size and depth; IntegrityError for anything else."""
    check_size(len(payload), origin, limit)
    try:
        data = json.loads(payload)
    except RecursionError as exc:
        raise IntegrityError(f"{origin} is nested too deeply to be a trm document") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{origin} is not valid JSON") from exc
    check_depth(data, origin)
    return data


def check_depth(data: Any, origin: str, limit: int = MAX_DEPTH) -> None:
    """Iterative (no recursion): a deep document cannot exhaust the stack here either."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise IntegrityError(f"{origin} is nested more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children)
