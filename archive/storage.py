"""Object stores for the archive: a local directory (the embedded default) and S3.

Guarantees, for both implementations:

* **Whole objects only.** A reader sees either no object or the complete object under a key.
  Locally a put writes a temp file in the target directory and ``os.replace``-s it into place;
  on S3 a PUT (single or multipart) becomes visible only when it completes.
* **Keys stay inside the store's prefix.** Keys are relative, '/'-separated, with no empty,
  '.' or '..' segments and no leading '/'; anything else raises :class:`InvalidKeyError`.
* **Fail fast.** :func:`open_store` checks the bucket and the credentials at once and raises
  :class:`StoreConfigError` naming what to set, instead of failing on the first upload.
* **Ride out outages (S3, opt-in).** With ``retry_s > 0`` every S3 operation that fails for a
  transient reason (connection refused or reset, timeouts, 5xx, throttling) is retried with
  capped exponential backoff for up to ``retry_s`` seconds of outage, logging each wait; then
  :class:`StoreUnavailableError` says how long it tried and what to set. Errors that retrying
  cannot mend (credentials, missing bucket, access denied) raise at once. Every archive write
  is idempotent (deterministic keys), so repeating one is safe.

``open_store("s3://bucket/prefix", endpoint_url)`` or ``open_store("/some/dir")``.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from trajbus.bus.settings import mask_url_credentials

MULTIPART_THRESHOLD = 16 * 1024 * 1024
MULTIPART_CHUNK = 16 * 1024 * 1024
RETRY_FIRST_WAIT_S = 0.5
RETRY_MAX_WAIT_S = 10.0

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreError(RuntimeError):
    """Base of object-store errors."""


class StoreConfigError(StoreError):
    """The store cannot be used as configured (missing bucket, credentials, directory)."""


class InvalidKeyError(StoreError, ValueError):
    """A key would escape the store's prefix or is malformed."""


class ObjectNotFoundError(StoreError, KeyError):
    """No object under that key."""


class StoreUnavailableError(StoreError):
    """The store stayed unreachable for longer than the configured retry budget."""


# Error codes that no amount of waiting mends: raise at once.
_PERMANENT_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
    "NoSuchKey", "InvalidBucketName", "AllAccessDisabled", "AccountProblem",
    "InvalidRequest", "InvalidArgument", "EntityTooLarge", "MethodNotAllowed",
    "400", "401", "403", "404", "405",
})


def is_transient(exc: BaseException) -> bool:
    """Whether an S3 failure may pass by waiting: connection and timeout errors, 5xx answers,
    throttling. Credential, permission and not-found errors are permanent."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        NoCredentialsError,
        ParamValidationError,
        PartialCredentialsError,
    )

    if isinstance(exc, NoCredentialsError | PartialCredentialsError | ParamValidationError):
        return False
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _PERMANENT_CODES:
            return False
        return status >= 500 or status in (0, 408, 429) or code in (
            "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
            "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable")
    if isinstance(exc, S3UploadFailedError):
        # boto3 folds the cause into the message ("... An error occurred (AccessDenied) ...")
        text = str(exc)
        return not any(f"({code})" in text for code in _PERMANENT_CODES)
    return isinstance(exc, BotoCoreError | ConnectionError | TimeoutError)


def call_with_retries(what: str, fn: Callable[[], T], *, retry_s: float,
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic,
                      transient: Callable[[BaseException], bool] = is_transient) -> T:
    """Run ``fn``; while it fails transiently, wait (0.5 s doubling to 10 s, jittered) and run
    it again, for at most ``retry_s`` seconds since the first failure. Then raise
    :class:`StoreUnavailableError` (from the last error). Permanent errors raise at once."""
    first_failure: float | None = None
    wait = RETRY_FIRST_WAIT_S
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            from trajbus.archive.metrics import STORE_ERRORS

            if retry_s <= 0 or not transient(exc):
                raise
            STORE_ERRORS.labels("transient").inc()
            now = clock()
            if first_failure is None:
                first_failure = now
            attempt += 1
            down_s = now - first_failure
            if down_s >= retry_s:
                STORE_ERRORS.labels("gave_up").inc()
                raise StoreUnavailableError(
                    f"object store unavailable for {down_s:.0f}s ({attempt} attempts to {what}; "
                    f"last error {type(exc).__name__}: {exc}). Nothing was committed for the "
                    "data not yet stored, so a restart resumes where it stopped; raise "
                    "TRAJBUS_ARCHIVE__STORE_RETRY_S to wait longer") from exc
            pause = min(wait, RETRY_MAX_WAIT_S, retry_s - down_s) * (0.8 + 0.4 * random.random())
            log.warning("object store unavailable for %.0fs (%s: %s); attempt %d to %s failed, "
                        "retrying in %.1fs (gives up after %.0fs)", down_s, type(exc).__name__,
                        exc, attempt, what, pause, retry_s)
            sleep(pause)
            wait *= 2


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise :class:`InvalidKeyError`."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"invalid object key {key!r}: must be a relative '/'-separated path")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKeyError(
                f"invalid object key {key!r}: empty, '.' or '..' segments are not allowed"
            )
    return key


def _validate_prefix(prefix: str) -> str:
    """A list prefix may be empty or end with '/'; its segments follow the key rules."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/") or "x")
    return prefix


class ObjectStore(ABC):
    """The operations the archive needs from a store. Implementations are thread-safe."""

    url: str

    @abstractmethod
    def put_file(self, key: str, local_path: str | os.PathLike[str]) -> int:
        """Upload a complete local file under ``key`` (replacing any object); returns bytes."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically (replacing any object)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object's bytes, or raise :class:`ObjectNotFoundError`."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @abstractmethod
    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        """A pyarrow filesystem and the base path of this store's prefix in it."""

    @abstractmethod
    def duckdb_path(self, key: str) -> str:
        """A path DuckDB can read for ``key`` (a local path, or an ``s3://`` URL for httpfs)."""

    def arrow_path(self, key: str) -> str:
        fs_, base = self.arrow_filesystem()
        del fs_
        return f"{base}/{validate_key(key)}" if base else validate_key(key)

    def glob(self, prefix: str, suffix: str = ".parquet") -> builtins.list[str]:
        """DuckDB-readable paths of the objects under ``prefix`` ending with ``suffix``."""
        return [self.duckdb_path(o.key) for o in self.list(prefix) if o.key.endswith(suffix)]

    def open_input(self, key: str) -> pa.NativeFile:
        """A random-access file for ``key`` (Parquet footers and row groups are ranged reads)."""
        fs_, _ = self.arrow_filesystem()
        return fs_.open_input_file(self.arrow_path(key))


class LocalStore(ObjectStore):
    """A directory. Puts are temp file + ``os.replace`` in the same directory (atomic)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreConfigError(
                f"cannot create archive directory {self.root}: {exc}. Set TRAJBUS_ARCHIVE__URL "
                "to a writable directory or an s3://bucket/prefix URL."
            ) from exc
        self.url = str(self.root)
        self._fs = pafs.LocalFileSystem()

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _atomic_write(self, key: str, write: Any) -> int:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            size = os.path.getsize(tmp)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return size

    def put_file(self, key: str, local_path: str | os.PathLike[str]) -> int:
        def write(fh: Any) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, fh, 1024 * 1024)

        return self._atomic_write(key, write)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda fh: fh.write(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        _validate_prefix(prefix)
        out: list[ObjectInfo] = []
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        dir_part = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / dir_part if dir_part else self.root
        if not start.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if name.startswith(".tmp-"):
                    continue  # an in-flight atomic write
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    try:
                        out.append(ObjectInfo(key, os.path.getsize(full)))
                    except FileNotFoundError:
                        continue  # deleted while listing
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        return self._fs, str(self.root)

    def duckdb_path(self, key: str) -> str:
        return str(self._path(key))


class S3Store(ObjectStore):
    """An S3 bucket and prefix via boto3 (any S3-compatible endpoint via ``endpoint_url``).

    Large files go up as multipart uploads (``upload_file`` + ``TransferConfig``); S3 makes
    the object visible only when the upload completes, so readers never see a partial one.
    """

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 client: Any = None, retry_s: float = 0.0) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.endpoint_url = endpoint_url
        self.retry_s = retry_s
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        # A fresh session: the credentials resolved now (not cached by an earlier client).
        self._client = client or boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 5, "mode": "standard"},
                          max_pool_connections=32),
        )
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK,
            max_concurrency=8, use_threads=True,
        )
        self._fs: pafs.S3FileSystem | None = None
        self._fs_lock = threading.Lock()

    # -- fail fast -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`StoreConfigError` unless the bucket exists and credentials work."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise StoreConfigError(mask_url_credentials(
                f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / an instance role)"
            )) from exc
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreConfigError(mask_url_credentials(
                    f"bucket {self.bucket!r} does not exist"
                    f"{' at ' + self.endpoint_url if self.endpoint_url else ''}: create it, or "
                    "set TRAJBUS_ARCHIVE__URL=s3://<existing-bucket>/<prefix>"
                )) from exc
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise StoreConfigError(
                    f"access to bucket {self.bucket!r} denied ({code}): check AWS_ACCESS_KEY_ID"
                    " / AWS_SECRET_ACCESS_KEY and the bucket policy"
                ) from exc
            raise StoreConfigError(mask_url_credentials(
                f"cannot reach bucket {self.bucket!r}: {exc}")) from exc
        except BotoCoreError as exc:
            raise StoreConfigError(mask_url_credentials(
                f"cannot reach S3 for {self.url} ({type(exc).__name__}: {exc}); set "
                "TRAJBUS_ARCHIVE__S3_ENDPOINT_URL for a non-AWS endpoint"
            )) from exc

    # -- keys ------------------------------------------------------------------------------
    def _k(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    # -- operations ------------------------------------------------------------------------
    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        return call_with_retries(what, fn, retry_s=self.retry_s)

    def put_file(self, key: str, local_path: str | os.PathLike[str]) -> int:
        full = self._k(key)
        self._retrying(f"upload {full}", lambda: self._client.upload_file(
            str(local_path), self.bucket, full, Config=self._transfer))
        return os.path.getsize(local_path)

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._k(key)
        self._retrying(f"put {full}", lambda: self._client.put_object(
            Bucket=self.bucket, Key=full, Body=data))

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        full = self._k(key)

        def get() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            body: bytes = resp["Body"].read()
            return body

        try:
            return self._retrying(f"get {full}", get)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise ObjectNotFoundError(key) from exc
            raise

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        full = self._k(key)
        try:
            self._retrying(f"head {full}", lambda: self._client.head_object(
                Bucket=self.bucket, Key=full))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        _validate_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix

        def list_all() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(self._rel(obj["Key"]), int(obj["Size"])))
            return out

        out = self._retrying(f"list {full or '/'}", list_all)
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        full = self._k(key)
        self._retrying(f"delete {full}", lambda: self._client.delete_object(
            Bucket=self.bucket, Key=full))

    def arrow_filesystem(self) -> tuple[pafs.FileSystem, str]:
        with self._fs_lock:
            if self._fs is None:
                self._fs = _arrow_s3(self.endpoint_url, self._client)
        base = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return self._fs, base

    def duckdb_path(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._k(key)}"


def _arrow_s3(endpoint_url: str | None, client: Any) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem with the same endpoint, region and credentials as boto3."""
    kwargs: dict[str, Any] = {}
    creds = client._request_signer._credentials  # the credentials boto3 resolved
    if creds is not None:
        frozen = creds.get_frozen_credentials()
        kwargs.update(access_key=frozen.access_key, secret_key=frozen.secret_key)
        if frozen.token:
            kwargs["session_token"] = frozen.token
    region = client.meta.region_name
    if region:
        kwargs["region"] = region
    if endpoint_url:
        parsed = urlparse(endpoint_url)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    return pafs.S3FileSystem(**kwargs)


def open_store(url: str, endpoint_url: str | None = None, *, check: bool = True,
               retry_s: float = 0.0) -> ObjectStore:
    """Open the store at ``url``: a local directory or ``s3://bucket[/prefix]``.

    With ``check`` (the default) an S3 store verifies bucket and credentials now and raises
    :class:`StoreConfigError` with what to set. ``retry_s`` > 0 makes an S3 store ride out
    transient outages of up to that many seconds (see the module docstring); the start-up
    check itself never waits, so a wrong endpoint fails fast.
    """
    if url.startswith("s3://"):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise StoreConfigError(f"{url!r} names no bucket: use s3://<bucket>/<prefix>")
        store = S3Store(parsed.netloc, parsed.path, endpoint_url, retry_s=retry_s)
        if check:
            store.check()
        return store
    if "://" in url:
        raise StoreConfigError(
            f"unsupported archive URL {url!r}: use a local directory or s3://bucket/prefix"
        )
    return LocalStore(url)
