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
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from repo_manager.errors import ConflictError, IntegrityError, NotFoundError, StoreError
from repo_manager.manifest import sha256_file
from repo_manager.storage.base import Store

MULTIPART_THRESHOLD = 32 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024
PART_WORKERS = 8


def parse_s3_url(location: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix")."""
    rest = location[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"store location {location!r} has no bucket", hint="write s3://BUCKET[/PREFIX]")
    return bucket, prefix.strip("/")


def make_client(endpoint_url: str | None = None, max_connections: int = 32) -> Any:
    import boto3  # noqa: PLC0415 - boto3 is slow to import; only S3 users pay for it
    from botocore.config import Config  # noqa: PLC0415

    session = boto3.session.Session()
    config = Config(max_pool_connections=max_connections, connect_timeout=5, read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"},
                    # only send/verify checksums where trm asks for them (ranged reads cannot be validated)
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    region = session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=endpoint_url or None, region_name=region, config=config)


class S3Store(Store):
    def __init__(self, location: str, *, endpoint_url: str | None = None, client: Any = None) -> None:
        self.bucket, self.prefix = parse_s3_url(location)
        self.location = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = endpoint_url
        self.client = client or make_client(endpoint_url)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: Exception, key: str, action: str) -> Exception:
        """Translate a botocore failure; never includes credentials (only codes, bucket and key)."""
        from botocore.exceptions import ClientError  # noqa: PLC0415

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
                return StoreError(f"bucket {self.bucket} does not exist at {self._endpoint()}",
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
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            return fn(Bucket=self.bucket, Key=self._key(key), **kwargs)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise self._error(exc, key, action) from exc

    # ------------------------------------------------------------------------------- primitives
    def _put_bytes(self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None,
                   sha256: str | None = None) -> str:
        extra: dict[str, Any] = {"ChecksumSHA256": _b64(hashlib.sha256(data).digest() if sha256 is None
                                                        else bytes.fromhex(sha256))}
        if if_absent:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        response = self._call("upload", key, self.client.put_object, Body=data, **extra)
        return str(response.get("ETag", ""))

    def _get_bytes(self, key: str) -> tuple[bytes, str]:
        from botocore.exceptions import BotoCoreError  # noqa: PLC0415

        response = self._call("download", key, self.client.get_object)
        try:
            return response["Body"].read(), str(response.get("ETag", ""))
        except (BotoCoreError, OSError) as exc:
            raise self._error(exc, key, "download") from exc

    def _read_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError  # noqa: PLC0415

        if length <= 0:
            return iter(())
        response = self._call("download", key, self.client.get_object, Range=f"bytes={start}-{start + length - 1}")
        body = response["Body"]

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(1024 * 1024)
            except (BotoCoreError, OSError) as exc:
                raise self._error(exc, key, "download") from exc
            finally:
                body.close()
        return chunks()

    def _size(self, key: str) -> int:
        return int(self._call("head", key, self.client.head_object)["ContentLength"])

    def _list_names(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

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

    def _upload_file(self, key: str, path: Path, size: int, sha256: str) -> None:
        if size < MULTIPART_THRESHOLD:
            data = path.read_bytes()
            if len(data) != size:
                raise IntegrityError(f"{path} changed: size {len(data)}, manifest says {size}")
            try:
                self._put_bytes(key, data, if_absent=True, sha256=sha256)
            except ConflictError:
                pass  # the same content, uploaded by another writer
            return
        if sha256_file(path) != sha256 or path.stat().st_size != size:
            raise IntegrityError(f"{path} changed: it no longer matches its manifest (sha256 {sha256})",
                                 hint="republish the version")
        self._multipart(key, path, size)

    def _multipart(self, key: str, path: Path, size: int) -> None:
        upload = self._call("upload", key, self.client.create_multipart_upload, ChecksumAlgorithm="SHA256")
        upload_id = upload["UploadId"]

        def send(number: int) -> dict[str, Any]:
            offset = (number - 1) * PART_SIZE
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read(min(PART_SIZE, size - offset))
            checksum = _b64(hashlib.sha256(data).digest())
            part = self._call("upload part", key, self.client.upload_part, UploadId=upload_id,
                              PartNumber=number, Body=data, ChecksumSHA256=checksum)
            return {"PartNumber": number, "ETag": part["ETag"], "ChecksumSHA256": checksum}

        count = (size + PART_SIZE - 1) // PART_SIZE
        try:
            with ThreadPoolExecutor(PART_WORKERS) as pool:
                parts = list(pool.map(send, range(1, count + 1)))
            self._call("upload", key, self.client.complete_multipart_upload, UploadId=upload_id,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except ConflictError:
            self._abort(key, upload_id)  # the same content, uploaded by another writer
        except BaseException:
            self._abort(key, upload_id)
            raise

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self._call("abort upload", key, self.client.abort_multipart_upload, UploadId=upload_id)
        except StoreError:
            pass  # the service expires abandoned uploads; nothing was published


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()
