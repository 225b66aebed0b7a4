"""S3 GETs signed with AWS Signature Version 4, in the standard library only.

The sync hot path (the environment pointer of an unchanged environment, then blobs and ranges) signs
every GET. botocore's signer costs ~0.1 s of imports and a few hundred microseconds of CPU per request
(it builds an ``AWSRequest`` and runs its header pipeline); this signs a GET in a few microseconds with
``hmac``/``hashlib`` and imports nothing else. The algorithm is AWS's published one (canonical request,
string to sign, derived key); ``tests/test_storage_contract.py`` checks it against botocore's signer byte
for byte. Credentials still come from the standard chain: the environment directly, else botocore's chain.

``signed_get`` is one GET over a fresh socket: the one read of an unchanged sync (``ops/sync/noop.quick``,
before the store classes are imported), the environment pointer with ``If-None-Match``. It reads only the
plainest answer (a Content-Length, or a 304); anything else sends the command to the full path. Every read of
``S3Store`` (pointers, manifests, blobs, ranges) goes over ``SignedReader``'s ``http.client`` keep-alive
connections, where one import serves hundreds of requests. For the quick path's single read, ``http.client``
is kept out: its import (its ``email`` parser above all) costs more than the whole request. Measured as
whole processes by ``bench/bench_sync_reader.py`` (an unchanged ``trm sync`` of two models from a real
SeaweedFS, 20 interleaved runs per variant, medians; 2 CPUs beside a CI run, load average 3.7–4.2, two
rounds):

=====================================  ==============  ==============
the pointer read                       wall            CPU
=====================================  ==============  ==============
``signed_get``                         56 / 74 ms      51 / 38 ms
an ``http.client`` GET instead         95 / 130 ms     80 / 62 ms
difference                             +71 / +77 %     +56 / +63 %
=====================================  ==============  ==============

Everything here is light on purpose: the unchanged sync imports this module and not the rest of
``repo_manager.adapters.storage`` (see ``repo_manager/entry.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from urllib.parse import quote, urlsplit

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
MAX_RESPONSE = 64 * 1024 * 1024
"""``signed_get`` reads environment pointers, never blobs: a longer answer is refused."""


class Keys:
    """An access key, its secret and an optional session token (the secret never appears in a repr)."""

    __slots__ = ("access_key", "secret_key", "token")

    def __init__(self, access_key: str, secret_key: str, token: str | None = None) -> None:
        self.access_key, self.secret_key, self.token = access_key, secret_key, token

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keys) and (self.access_key, self.secret_key, self.token) == (
            other.access_key, other.secret_key, other.token)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Keys(access_key={self.access_key!r}, secret_key='***')"


def env_keys() -> tuple[Keys, str] | None:
    """(keys, region) straight from the environment (the first link of the AWS chain), or None."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if key and secret and region:
        return Keys(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None), region
    return None


def frozen(credentials: object) -> Keys:
    """``Keys`` from ours or from botocore credentials (refreshable ones refresh here when due)."""
    if isinstance(credentials, Keys):
        return credentials
    snapshot = credentials.get_frozen_credentials()  # type: ignore[attr-defined]
    return Keys(snapshot.access_key, snapshot.secret_key, snapshot.token)


def parse_s3_url(location: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix"). Credentials in it are refused."""
    if "@" in location:  # (redact's check, imported only where a URL may carry credentials)
        from repo_manager.core.redact import check_no_userinfo  # noqa: PLC0415 - off the quick sync path

        check_no_userinfo(location, "the store location")
    rest = location[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        from repo_manager.core.errors import StoreError  # noqa: PLC0415 - the error module only for an error

        raise StoreError(f"store location {location!r} has no bucket", hint="write s3://BUCKET[/PREFIX]")
    return bucket, prefix.strip("/")


def s3_endpoint(endpoint_url: str | None) -> str | None:
    """The S3-compatible endpoint in use: the given one, else the chain's ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL``; None for AWS itself."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_base_url(bucket: str, endpoint_url: str | None, region: str) -> str:
    """Where ``bucket``'s objects are: ``s3_endpoint`` (path style), else AWS itself (virtual-host style
    when the name allows it)."""
    endpoint = s3_endpoint(endpoint_url)
    if endpoint:
        return f"{endpoint.rstrip('/')}/{bucket}"
    if "." in bucket:
        return f"https://s3.{region}.amazonaws.com/{bucket}"
    return f"https://{bucket}.s3.{region}.amazonaws.com"


def object_url(base: str, key: str) -> str:
    return f"{base}/{quote(key, safe='/~')}"


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


class Response:
    """A whole HTTP answer: status, headers (lower-case names) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def get_if_none_match(signer: Signer, url: str, keys: Keys, etag: str | None, timeout: float = 10.0) -> Response:
    """``GET url`` signed for ``keys``, with ``If-None-Match: etag`` when there is one (a 304 answers that the
    object still has it), through ``signed_get``: the quick path's one read."""
    headers = signer.get_headers(url, keys)
    if etag:
        headers["If-None-Match"] = etag
    return signed_get(url, headers, timeout)


def signed_get(url: str, headers: dict[str, str], timeout: float = 10.0) -> Response:
    """``GET url`` with ``headers`` (signed by the caller) on a new connection closed after the answer.

    Only the plainest answer is read: HTTP/1.1 with ``Connection: close``, a body of the length its
    Content-Length says (none for 304). Anything else (a chunked or length-less answer, a cut or malformed
    one) is an OSError, and the quick path leaves the read to the full path and its ``http.client``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OSError(f"not an http(s) URL: {parts.scheme}://{parts.hostname}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    lines = [f"GET {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1", f"Host: {parts.netloc}",
             *(f"{name}: {value}" for name, value in headers.items()), "Accept-Encoding: identity",
             "Connection: close", "", ""]
    request = "\r\n".join(lines).encode()
    host: str | bytes = parts.hostname
    if host.isascii():
        host = host.encode()  # (a str host is encoded by the idna codec, one more import)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        if parts.scheme == "https":
            import ssl  # noqa: PLC0415 - only for TLS endpoints

            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        sock.sendall(request)
        received = bytearray()
        head: _Head | None = None
        while head is None or len(received) - head.offset < head.length:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            received += chunk
            if len(received) > MAX_RESPONSE:
                raise OSError(f"answer longer than {MAX_RESPONSE} bytes")
            if head is None:
                head = _Head.parse(received)
    finally:
        sock.close()
    if head is None:
        raise OSError("the connection closed before a whole answer arrived")
    if len(received) - head.offset < head.length:
        raise OSError("the connection closed before the whole body arrived")
    return Response(head.status, head.headers, bytes(received[head.offset:head.offset + head.length]))


class _Head:
    """Status line and headers of an answer, where its body starts and how long it is."""

    def __init__(self, status: int, headers: dict[str, str], offset: int) -> None:
        self.status, self.headers, self.offset = status, headers, offset
        if status in (204, 304) or 100 <= status < 200:
            self.length = 0
            return
        length = headers.get("content-length")
        if length is None or not length.isdigit() or "transfer-encoding" in headers:
            raise OSError("not a plain answer with a Content-Length")
        self.length = int(length)

    @classmethod
    def parse(cls, raw: bytes | bytearray) -> _Head | None:
        """The head once ``raw`` holds all of it, else None."""
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            return None
        status_line, *header_lines = bytes(raw[:end]).decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise OSError(f"not an HTTP/1.x answer: {status_line[:40]!r}")
        headers: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon:
                raise OSError(f"malformed header line {line[:40]!r}")
            headers[name.strip().lower()] = value.strip()
        return cls(int(rest[:3]), headers, end + 4)
