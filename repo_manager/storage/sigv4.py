"""AWS Signature Version 4 for S3 GETs, in the standard library only.

The sync hot path (the environment pointer of an unchanged environment, then blobs and ranges) signs
every GET. botocore's signer costs ~0.1 s of imports and a few hundred microseconds of CPU per request
(it builds an ``AWSRequest`` and runs its header pipeline); this signs a GET in a few microseconds with
``hmac``/``hashlib`` and imports nothing else. The algorithm is AWS's published one (canonical request,
string to sign, derived key); ``tests/test_sync.py`` checks it against botocore's signer byte for byte.
Credentials still come from the standard chain: the environment directly, else botocore's chain.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class Keys:
    access_key: str
    secret_key: str
    token: str | None = None


def env_keys() -> tuple[Keys, str] | None:
    """(keys, region) straight from the environment (the first link of the AWS chain), or None."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if key and secret and region:
        return Keys(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None), region
    return None


def frozen(credentials: Any) -> Keys:
    """``Keys`` from ours or from botocore credentials (refreshable ones refresh here when due)."""
    if isinstance(credentials, Keys):
        return credentials
    snapshot = credentials.get_frozen_credentials()
    return Keys(snapshot.access_key, snapshot.secret_key, snapshot.token)


class Signer:
    """Signs GETs for one region; caches the derived key per day."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._day = ""
        self._secret = ""
        self._key = b""

    def _signing_key(self, secret: str, day: str) -> bytes:
        if day != self._day or secret != self._secret:
            key = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
            for part in (self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._day, self._secret, self._key = day, secret, key
        return self._key

    def get_headers(self, url: str, keys: Keys, now: float | None = None) -> dict[str, str]:
        """Headers that authorize ``GET url`` (its path URI-encoded once, as S3 wants it; no query
        string). Unsigned headers (Range, If-None-Match) may be added by the caller."""
        parts = urlsplit(url)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
        day = stamp[:8]
        headers = {"host": parts.netloc, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
        if keys.token:
            headers["x-amz-security-token"] = keys.token
        names = sorted(headers)
        canonical = "\n".join(["GET", parts.path or "/", parts.query,  # the path is already URI-encoded
                               "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names),
                               EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(keys.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={keys.access_key}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={signature}")
        del headers["host"]  # the HTTP client sends it
        return headers
