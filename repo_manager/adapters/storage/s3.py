"""The store in S3 or any S3-compatible service (MinIO, SeaweedFS, Ceph …), through boto3.

Credentials, region and profile come from the standard AWS chain (environment, ~/.aws, instance role);
the endpoint from ``Settings.s3_endpoint_url`` or the chain's ``AWS_ENDPOINT_URL[_S3]``. trm never logs
or repeats credentials: errors name the bucket, the key and the service's error code only.

Conditional writes are the service's own: ``If-None-Match: *`` creates a blob or claims a version
number, ``If-Match: <etag>`` moves an environment pointer; a 412 becomes ``ConflictError``. SeaweedFS
4.x, MinIO and AWS honour both (checked by the contract tests against a real SeaweedFS).

Uploads carry SHA-256 checksums the service verifies: a small blob is sent with ``ChecksumSHA256`` set
to the manifest's digest, so the store itself refuses content that is not the file the manifest names;
a large one goes multipart, in parallel parts that each carry their own SHA-256, after the whole file
was hashed against the manifest (a part corrupted on the wire is refused by the service).

Reads (the sync hot path: one pointer, manifests, blobs and ranges of blobs) go through ``SignedReader``:
SigV4-signed GETs (trm's stdlib signer) sent over plain ``http.client`` keep-alive connections, one per
thread, without botocore's per-call pipeline (several milliseconds of CPU per request: the difference
between a few hundred small files taking a second or a fraction of one) and without building a boto3
client at all for a sync. Blob bytes are received with ``readinto`` straight into the buffers that are
then written and hashed: one copy from the socket, where urllib3's streaming made two or three more
(measured on a 2 GiB model: see docs/store-and-sync.md). The boto3 client is created on first use, for
writes, HEADs and listings.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from repo_manager.adapters.storage.base import Store, blob_key
from repo_manager.adapters.storage.sigv4 import (
    Signer,
    env_keys,
    frozen,
    object_url,
    parse_s3_url,
    s3_base_url,
    s3_endpoint,
)
from repo_manager.core import documents
from repo_manager.core.errors import (
    ConflictError,
    IntegrityError,
    NotFoundError,
    StoreError,
    StoreNotFoundError,
    UsageError,
)
from repo_manager.core.manifest import sha256_file

MULTIPART_THRESHOLD = 32 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024
PART_WORKERS = 8


def check_endpoint_url(url: str | None, origin: str = "--endpoint-url") -> str | None:
    """Refuse an endpoint URL that carries credentials (``http://KEY:SECRET@host``) or does not parse.

    Every S3 error names the endpoint, so credentials inside it would be printed; the message never
    repeats the URL itself, only where it came from.
    """
    if not url:
        return url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise UsageError(f"the S3 endpoint URL from {origin} is malformed",
                         hint="write http(s)://HOST[:PORT]") from None if "@" in url else exc
    if "@" in parts.netloc:
        raise UsageError(f"the S3 endpoint URL from {origin} carries credentials (USER:PASSWORD@)",
                         hint="give only http(s)://HOST[:PORT]; credentials come from AWS_ACCESS_KEY_ID/"
                              "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or a role")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"the S3 endpoint URL from {origin} is not http(s)://HOST[:PORT]: {url}")
    return url


def make_client(endpoint_url: str | None = None, max_connections: int = 32, *,
                timeout_s: float | None = None) -> Any:
    """A boto3 S3 client. ``timeout_s`` bounds each connect and each read and makes one attempt only (for
    look-ups that must answer quickly, such as shell completion); by default 5 s to connect, 60 s to read,
    three attempts."""
    import boto3  # noqa: PLC0415 - boto3 is slow to import; only S3 users pay for it
    from botocore.config import Config  # noqa: PLC0415 - botocore is slow to import; only S3 users pay for it

    session = boto3.session.Session()
    config = Config(max_pool_connections=max_connections, connect_timeout=timeout_s or 5,
                    read_timeout=timeout_s or 60,
                    retries={"max_attempts": 1 if timeout_s else 3, "mode": "standard"},
                    # only send/verify checksums where trm asks for them (ranged reads cannot be validated)
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    region = session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=endpoint_url or None, region_name=region, config=config)


class S3Store(Store):
    def __init__(self, location: str, *, endpoint_url: str | None = None, client: Any = None,
                 timeout_s: float | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(location)
        self.timeout_s = timeout_s
        """Bound on each connect and read of the boto3 client, one attempt (see ``make_client``)."""
        self.location = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = check_endpoint_url(endpoint_url)
        for variable in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # boto3 and SignedReader read these
            check_endpoint_url(os.environ.get(variable), f"${variable}")
        self._client = client
        self._reader: SignedReader | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.endpoint_url, timeout_s=self.timeout_s)
        return self._client

    @property
    def reader(self) -> SignedReader:
        if self._reader is None:
            self._reader = SignedReader(self.bucket, self.endpoint_url)
        return self._reader

    def _get(self, key: str, byte_range: tuple[int, int] | None = None) -> Any:
        """A signed GET, errors named with the store location (never with credentials)."""
        where = f"s3://{self.bucket}/{self._key(key)}"
        try:
            return self.reader.get(self._key(key), byte_range)
        except StoreNotFoundError:
            raise
        except NotFoundError as exc:
            raise NotFoundError(f"{where} does not exist", store=self.location) from exc
        except StoreError as exc:
            raise type(exc)(exc.message.replace(self._key(key), where), hint=exc.hint, store=self.location) from exc

    def get_object_if_changed(self, key: str, tag: str | None) -> tuple[bytes, str] | None:
        """One GET with ``If-None-Match`` (a 304 carries no body), without urllib3 or botocore: the
        no-op sync's only read, and what `trm agent` polls."""
        where = f"s3://{self.bucket}/{self._key(key)}"
        try:
            payload, new_tag = self.reader.conditional_get(self._key(key), tag)
        except StoreNotFoundError:
            raise
        except NotFoundError as exc:
            raise NotFoundError(f"{where} does not exist", store=self.location) from exc
        except StoreError as exc:
            raise type(exc)(exc.message.replace(self._key(key), where), hint=exc.hint, store=self.location) from exc
        if payload is None:
            return None
        documents.check_size(len(payload), where)  # only documents are read this way: bounded like get_object
        return payload, new_tag

    def _key(self, key: str) -> str:
        return self.object_name(key)

    def object_name(self, key: str) -> str:
        """The S3 object name of a store key (below the store's prefix)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: Exception, key: str, action: str) -> Exception:
        """Translate a botocore failure; never includes credentials (only codes, bucket and key)."""
        from botocore.exceptions import ClientError  # noqa: PLC0415 - heavy library, imported where used

        where = f"s3://{self.bucket}/{self._key(key)}"
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return NotFoundError(f"{where} does not exist", store=self.location)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return ConflictError(f"{where} was changed by another writer ({action})", store=self.location)
            if code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidRequest") \
                    and action.startswith("upload"):
                return IntegrityError(f"the store refused {where}: its checksum does not match ({code})",
                                      store=self.location)
            if code in ("NoSuchBucket",):
                return StoreNotFoundError(f"bucket {self.bucket} does not exist at {self._endpoint()}",
                                          hint="create it, or fix the store location", store=self.location)
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
                return StoreError(f"access to {where} was denied ({code})",
                                  hint="check the AWS credentials (environment, profile or role)",
                                  store=self.location)
            return StoreError(f"{action} of {where} failed: {code or status}", store=self.location)
        return StoreError(f"S3 endpoint {self._endpoint()} is not reachable ({action} of {where}): "
                          f"{type(exc).__name__}", hint="check --endpoint-url and that the service is up",
                          store=self.location)

    def _endpoint(self) -> str:
        return self.endpoint_url or "AWS S3"

    def _call(self, action: str, key: str, fn, **kwargs) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - heavy library, imported where used

        try:
            return fn(Bucket=self.bucket, Key=self._key(key), **kwargs)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, action) from exc

    # ------------------------------------------------------------------------------- primitives
    def put_object(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None,
                   sha256: str | None = None) -> str:
        extra: dict[str, Any] = {"ChecksumSHA256": _b64(hashlib.sha256(data).digest() if sha256 is None
                                                        else bytes.fromhex(sha256))}
        if if_absent:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        response = self._call("upload", key, self.client.put_object, Body=data, **extra)
        return str(response.get("ETag", ""))

    def get_object(self, key: str) -> tuple[bytes, str]:
        response = self._get(key)
        try:
            return response.document(f"s3://{self.bucket}/{key}")
        except (http.client.HTTPException, OSError) as exc:
            raise self._error(exc, key, "download") from exc
        finally:
            response.release_conn()

    def read_object(self, key: str, start: int, length: int) -> Iterator[bytes]:
        if length <= 0:
            return iter(())
        response = self._get(key, (start, start + length - 1))

        def chunks() -> Iterator[bytes]:
            try:
                yield from response.units(self.reader.buffers)
            except (http.client.HTTPException, OSError) as exc:
                raise self._error(exc, key, "download") from exc
            finally:
                response.release_conn()
        return chunks()

    def recycle(self, chunk: bytes | bytearray) -> None:
        self.reader.buffers.put(chunk)

    def object_size(self, key: str) -> int:
        return int(self._call("head", key, self.client.head_object)["ContentLength"])

    def list_names(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - heavy library, imported where used

        full = self._key(prefix)
        names: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full,
                                                                              Delimiter="/"):
                names += [c["Prefix"][len(full):] for c in page.get("CommonPrefixes", [])]
                names += [o["Key"][len(full):] for o in page.get("Contents", [])]
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, prefix, "listing") from exc
        return sorted(n for n in names if n)

    def list_sizes(self, prefix: str) -> dict[str, int]:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415 - heavy library, imported where used

        full = self._key(prefix)
        found: dict[str, int] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                found.update({o["Key"][len(full):]: int(o["Size"]) for o in page.get("Contents", [])})
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, prefix, "listing") from exc
        return found

    def copy_server_side(self, source: Store, digest: str, key: str) -> bool:
        if not (isinstance(source, S3Store) and source.endpoint_url == self.endpoint_url):
            return False
        try:
            self._call("server-side copy", key, self.client.copy_object,
                       CopySource={"Bucket": source.bucket, "Key": source.object_name(blob_key(digest))})
        except StoreError:
            return False  # e.g. buckets in two accounts: the caller moves the bytes
        return True

    def put_stream(self, key: str, chunks: Iterable[bytes], size: int, sha256: str) -> None:
        """One part (PART_SIZE) in memory at a time: a multi-GB blob copied between two endpoints never is
        held whole. The sha256 of everything sent is checked before the upload is completed."""
        digest = hashlib.sha256()
        if size < MULTIPART_THRESHOLD:
            data = b"".join(chunks)
            if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
                raise IntegrityError(f"refusing to store {key}: the content does not match sha256 {sha256}")
            try:
                self.put_object(key, data, if_absent=True, sha256=sha256)
            except ConflictError:
                pass  # the same content, written by another writer
            return
        parts: list[dict[str, Any]] = []
        buffer, sent = bytearray(), 0
        with self._multipart_upload(key) as upload_id:
            for chunk in chunks:
                digest.update(chunk)
                sent += len(chunk)
                buffer += chunk
                while len(buffer) >= PART_SIZE:
                    parts.append(self._upload_part(key, upload_id, len(parts) + 1, bytes(buffer[:PART_SIZE])))
                    del buffer[:PART_SIZE]
            if buffer:
                parts.append(self._upload_part(key, upload_id, len(parts) + 1, bytes(buffer)))
            if sent != size or digest.hexdigest() != sha256:
                raise IntegrityError(f"refusing to store {key}: the content does not match sha256 {sha256}")
            self._call("upload", key, self.client.complete_multipart_upload, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def put_file(self, key: str, path: Path, size: int, sha256: str) -> None:
        if size < MULTIPART_THRESHOLD:
            data = path.read_bytes()
            if len(data) != size:
                raise IntegrityError(f"{path} changed: size {len(data)}, manifest says {size}")
            try:
                self.put_object(key, data, if_absent=True, sha256=sha256)
            except ConflictError:
                pass  # the same content, uploaded by another writer
            return
        if sha256_file(path) != sha256 or path.stat().st_size != size:
            raise IntegrityError(f"{path} changed: it no longer matches its manifest (sha256 {sha256})",
                                 hint="republish the version")
        self._multipart(key, path, size)

    def _multipart(self, key: str, path: Path, size: int) -> None:
        def send(number: int) -> dict[str, Any]:
            offset = (number - 1) * PART_SIZE
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read(min(PART_SIZE, size - offset))
            return self._upload_part(key, upload_id, number, data)

        count = (size + PART_SIZE - 1) // PART_SIZE
        with self._multipart_upload(key) as upload_id:
            with ThreadPoolExecutor(PART_WORKERS) as pool:
                parts = list(pool.map(send, range(1, count + 1)))
            self._call("upload", key, self.client.complete_multipart_upload, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    @contextmanager
    def _multipart_upload(self, key: str) -> Iterator[str]:
        """A multipart upload of ``key`` (its id), completed inside the block; aborted when the block fails, and
        silently when another writer created ``key`` first (the same content: a ConflictError)."""
        upload_id = self._call("upload", key, self.client.create_multipart_upload,
                               ChecksumAlgorithm="SHA256")["UploadId"]
        try:
            yield upload_id
        except ConflictError:
            self._abort(key, upload_id)  # the same content, uploaded by another writer
        except BaseException:
            self._abort(key, upload_id)
            raise

    def _upload_part(self, key: str, upload_id: str, number: int, data: bytes) -> dict[str, Any]:
        checksum = _b64(hashlib.sha256(data).digest())
        part = self._call("upload part", key, self.client.upload_part, UploadId=upload_id,
                          PartNumber=number, Body=data, ChecksumSHA256=checksum)
        return {"PartNumber": number, "ETag": part["ETag"], "ChecksumSHA256": checksum}

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort upload", key, self.client.abort_multipart_upload, UploadId=upload_id)
        except StoreError:
            pass  # the service expires abandoned uploads; nothing was published


class SignedReader:
    """GET objects with SigV4 signatures over ``http.client`` keep-alive connections, one per thread (see
    the module docstring)."""

    RETRIES = 3
    TIMEOUT_S = 60.0
    POINTER_TIMEOUT_S = 10.0
    """A pointer read (each poll of `trm agent`) waits at most this per attempt: a hung endpoint must not
    stall a poll for minutes."""

    def __init__(self, bucket: str, endpoint_url: str | None) -> None:
        self._local = threading.local()
        self.buffers = BufferPool(READ_UNIT)
        self.credentials, self.region = _credentials_and_region()
        self.base = s3_base_url(bucket, endpoint_url, self.region)
        self.endpoint = s3_endpoint(endpoint_url) or "AWS S3"
        self.bucket = bucket
        self.signer = Signer(self.region)

    def conditional_get(self, key: str, etag: str | None) -> tuple[bytes | None, str]:
        """GET with ``If-None-Match: etag`` over this thread's connection, like every other read. (None, etag)
        when unchanged (304), else (content, its ETag); the content is a document, bounded before it is read."""
        response = self.get(key, if_none_match=etag, timeout_s=self.POINTER_TIMEOUT_S)
        try:
            if response.status == 304:
                response.read()  # no body: this ends the answer, the connection is kept
                return None, etag or str(response.headers.get("ETag", ""))
            return response.document(f"s3://{self.bucket}/{key}")
        except (http.client.HTTPException, OSError) as exc:
            raise self._unreachable(key, exc) from exc
        finally:
            response.release_conn()

    def _unreachable(self, key: str, exc: Exception) -> StoreError:
        return StoreError(f"S3 endpoint {self.endpoint} is not reachable (download of {key}): {type(exc).__name__}",
                          hint="check --endpoint-url and that the service is up")

    def _refuse(self, key: str, status: int, body: bytes) -> None:
        """The error for a final non-success answer: a missing bucket is the whole store, not one object."""
        if status == 404 and _error_code(body) == "NoSuchBucket":
            raise StoreNotFoundError(f"bucket {self.bucket} does not exist at {self.endpoint}",
                                     hint="create it, or fix the store location")
        _raise_for_status(key, status, body)

    def url(self, key: str) -> str:
        return object_url(self.base, key)

    def headers(self, url: str) -> dict[str, str]:
        return self.signer.get_headers(url, frozen(self.credentials))

    def _connection(self) -> Any:
        """This thread's keep-alive connection to the endpoint (opened on first use)."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            parts = urlsplit(self.base)
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = cls(parts.netloc, timeout=self.TIMEOUT_S)
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is not None:
            connection.close()

    def get(self, key: str, byte_range: tuple[int, int] | None = None, *,
            if_none_match: str | None = None, timeout_s: float | None = None) -> _Response:
        """An open response (status 200/206, or 304 when ``if_none_match`` is still the object's tag);
        NotFoundError, ConflictError or StoreError otherwise. Read it to the end or ``release_conn()`` it
        (which closes a connection left mid-body)."""

        url = self.url(key)
        path = urlsplit(url).path
        for attempt in range(1, self.RETRIES + 1):
            headers = self.headers(url)
            if byte_range:
                headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
            if if_none_match:
                headers["If-None-Match"] = if_none_match
            reused = getattr(self._local, "connection", None) is not None
            try:
                connection = self._connection()
                connection.timeout = timeout_s or self.TIMEOUT_S  # for a connect, and below for the open socket
                if connection.sock is not None:
                    connection.sock.settimeout(connection.timeout)
                connection.request("GET", path, headers=headers)
                response = connection.getresponse()
            except (http.client.HTTPException, OSError) as exc:
                self._drop_connection()  # a keep-alive connection the server closed meanwhile, or none at all
                if attempt == self.RETRIES:
                    raise self._unreachable(key, exc) from exc
                if not reused:  # an idle connection the server closed is retried at once, on a new one
                    time.sleep(0.2 * 2 ** attempt)
                continue
            if response.status in (200, 206) or response.status == 304 and if_none_match:
                return _Response(response, self._drop_connection)
            try:
                body = response.read(2048)
            except (http.client.HTTPException, OSError):
                body = b""
            if not response.isclosed():  # an error body not read to its end: the connection cannot be reused
                self._drop_connection()
            if response.status >= 500 and attempt < self.RETRIES:
                time.sleep(0.2 * 2 ** attempt)
                continue
            self._refuse(key, response.status, body)
        raise AssertionError("unreachable")


READ_UNIT = 1024 * 1024
"""Blob bytes are received in buffers of this size (the sync cache writes and resumes in the same units)."""


class BufferPool:
    """Receive buffers of one size, reused once their reader is done with them (``Store.recycle``): a
    fresh 1 MiB buffer costs its page faults every time (0.35 CPU-s per 2 GiB received, measured here),
    a reused one none. Keeps at most ``keep`` spare buffers; thread-safe (deque appends and pops are)."""

    def __init__(self, size: int, keep: int = 96) -> None:
        self.size, self.keep = size, keep
        self._spare: deque[bytearray] = deque()

    def get(self) -> bytearray:
        try:
            return self._spare.pop()
        except IndexError:
            return bytearray(self.size)

    def put(self, buffer: bytes | bytearray) -> None:
        if isinstance(buffer, bytearray) and len(buffer) == self.size and len(self._spare) < self.keep:
            self._spare.append(buffer)


class _Response:
    """An ``http.client`` response on a kept-alive connection: what the store's readers need of it."""

    def __init__(self, response: Any, drop: Callable[[], None]) -> None:
        self._response, self._drop = response, drop
        self.status = response.status
        self.headers = response.headers

    def read(self, amount: int | None = None) -> bytes:
        return self._response.read(amount)

    def document(self, where: str) -> tuple[bytes, str]:
        """The whole body and its ETag: only documents are read whole, bounded before anything is allocated."""
        length = str(self.headers.get("Content-Length") or "0")
        documents.check_size(int(length) if length.isdigit() else 0, where)
        data = self.read(documents.MAX_DOCUMENT_BYTES + 1)
        documents.check_size(len(data), where)
        return data, str(self.headers.get("ETag", ""))

    def units(self, pool: BufferPool) -> Iterator[bytearray]:
        """The body in buffers of ``pool.size`` bytes (the last one shorter), each filled by ``readinto``
        straight from the socket; whole ones come from the pool (the caller may ``put`` them back when
        done). A body that ends early ends the iteration early: callers compare the length they got with
        the length they asked for."""
        response = self._response
        while not response.isclosed():
            left = response.length  # None: chunked, length unknown
            size = pool.size if left is None else min(pool.size, left)
            if not size:
                return
            buffer = pool.get() if size == pool.size else bytearray(size)
            view = memoryview(buffer)
            filled = 0
            while filled < size:
                got = response.readinto(view[filled:])
                if not got:
                    break
                filled += got
            view.release()
            if filled < size:
                buffer = buffer[:filled]  # a copy: a pool buffer keeps its size
            if filled:
                yield buffer
            if filled < size:
                return

    def release_conn(self) -> None:
        """Done with the response: a connection whose body was not read to the end is closed, not reused."""
        if not self._response.isclosed():
            self._drop()


def _raise_for_status(key: str, status: int, body: bytes) -> None:
    if status == 404:
        raise NotFoundError(f"s3 object {key} does not exist")
    if status in (409, 412):
        raise ConflictError(f"s3 object {key} was changed by another writer")
    if status == 416:  # a range its manifest promises is not there: truncated object
        raise IntegrityError(f"s3 object {key} is shorter than its manifest says (HTTP 416)",
                             hint="the object in the store is corrupt: push the version again")
    code = _error_code(body)
    hint = "check the AWS credentials (environment, profile or role)" if status == 403 else None
    raise StoreError(f"download of {key} failed: HTTP {status} {code}".rstrip(), hint=hint)


def _credentials_and_region() -> tuple[Any, str]:
    """The standard AWS chain. Keys in the environment come first in that chain anyway; taking them
    directly skips importing botocore and building a session (~0.1 s, most of an unchanged sync)."""
    found = env_keys()
    if found is not None:
        return found
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    import botocore.session  # noqa: PLC0415 - botocore is slow to import; only S3 users pay for it

    session = botocore.session.Session()  # env, profile, shared files, SSO, web identity, instance role
    credentials = session.get_credentials()
    if credentials is None:
        raise StoreError("no AWS credentials found",
                         hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use a role")
    return credentials, region or session.get_config_variable("region") or "us-east-1"


def _error_code(body: bytes) -> str:
    start, end = body.find(b"<Code>"), body.find(b"</Code>")
    return body[start + 6:end].decode(errors="replace") if 0 <= start < end else ""


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()
