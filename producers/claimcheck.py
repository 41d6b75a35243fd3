"""Claim-check for large blobs: store the bytes once in object storage, put a reference on Kafka.

Guarantees:

- Content-addressed: the key is ``blobs/sha256/<ab>/<cd>/<sha256 hex>`` (``ab``/``cd`` = the
  first two byte pairs of the digest), so the same bytes are stored once however often they
  are sent, and a retried put is harmless. A put of a key that already exists is skipped.
- The object is complete before the event referencing it is journaled (the store's puts are
  atomic: temp file + rename locally, a completed PUT on S3).
- :func:`fetch_blob` verifies size and sha256 and raises :class:`BlobIntegrityError` on mismatch;
  a reader never gets bytes that differ from what the producer hashed.

The store is ``settings.archive.url`` by default (a local directory, or ``s3://bucket/prefix``
with ``settings.archive.s3_endpoint_url``). References on Kafka are absolute URIs; the archive
stores a reference into itself relative to its root (``blobs/sha256/ab/cd/<sha>``, see
``archive.rows.to_row``), which :func:`fetch_blob` reads given the archive's store.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

from trajbus.archive.storage import ObjectStore, open_store
from trajbus.bus.settings import Settings, get_settings
from trajbus.schemas.models import BlobRef

BLOB_PREFIX = "blobs/sha256"


class BlobIntegrityError(RuntimeError):
    """A fetched blob's size or sha256 does not match its reference."""


def blob_key(sha256_hex: str) -> str:
    """``blobs/sha256/ab/cd/<sha>`` for a sha256 hex digest."""
    h = sha256_hex.lower()
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"not a sha256 hex digest: {sha256_hex!r}")
    return f"{BLOB_PREFIX}/{h[:2]}/{h[2:4]}/{h}"


def root_uri(url: str) -> str:
    """The URI a store location's blob references start with: ``s3://bucket/prefix`` as is,
    a local directory as the ``file://`` URI of its resolved absolute path."""
    if url.startswith("s3://"):
        return url.rstrip("/")
    return Path(url).expanduser().resolve().as_uri()


class ClaimCheck:
    """Puts blobs into one object store. Thread-safe (the emitter calls it off the loop)."""

    def __init__(self, url: str | None = None, endpoint_url: str | None = None,
                 threshold: int | None = None, settings: Settings | None = None) -> None:
        s = settings or get_settings()
        self.url = url or s.archive.url
        self.endpoint_url = endpoint_url if endpoint_url is not None else s.archive.s3_endpoint_url
        self.threshold = threshold if threshold is not None else s.producer.claim_check_threshold
        self._store: ObjectStore | None = None
        self._lock = threading.Lock()
        self.puts = 0
        self.skipped = 0

    @property
    def store(self) -> ObjectStore:
        with self._lock:
            if self._store is None:
                self._store = open_store(self.url, self.endpoint_url)
            return self._store

    def should_claim(self, size: int) -> bool:
        return size > self.threshold

    def put(self, data: bytes, content_type: str = "application/octet-stream") -> BlobRef:
        """Store ``data`` (once) and return its reference."""
        sha = hashlib.sha256(data).hexdigest()
        key = blob_key(sha)
        store = self.store
        if store.exists(key):
            self.skipped += 1
        else:
            store.put_bytes(key, data)
            self.puts += 1
        return BlobRef(uri=f"{root_uri(self.url)}/{key}", size=len(data), sha256=sha,
                       content_type=content_type)


def _split_uri(uri: str) -> tuple[str, str]:
    """(store url, key) of a blob URI."""
    marker = f"/{BLOB_PREFIX}/"
    idx = uri.rfind(marker)
    if idx < 0:
        raise ValueError(f"not a trajbus blob URI: {uri!r}")
    root, key = uri[:idx], uri[idx + 1:]
    if root.startswith("file://"):
        root = unquote(urlparse(root).path)
    return root, key


_stores: dict[tuple[str, str | None], ObjectStore] = {}
_stores_lock = threading.Lock()


def is_archive_relative(uri: str) -> bool:
    """True for a reference relative to an archive root (``blobs/sha256/ab/cd/<sha>``), the
    form the archive stores references into itself in."""
    return uri.startswith(f"{BLOB_PREFIX}/") and "://" not in uri


def fetch_blob(ref: BlobRef, endpoint_url: str | None = None,
               archive: ObjectStore | None = None) -> bytes:
    """The bytes behind ``ref``, verified against its size and sha256.

    An absolute reference (``file:///.../blobs/sha256/...``, ``s3://bucket/prefix/blobs/...``)
    is read from the store it names. A reference relative to an archive root
    (:func:`is_archive_relative`) is read from ``archive``, the archive's store, which must
    then be given."""
    if is_archive_relative(ref.uri):
        if archive is None:
            raise ValueError(f"blob reference {ref.uri!r} is relative to an archive root: "
                             "read it with the archive's store (ArchiveReader.fetch_blob)")
        data = archive.get_bytes(blob_key(ref.uri.rsplit("/", 1)[-1]))
    else:
        root, key = _split_uri(ref.uri)
        if endpoint_url is None and root.startswith("s3://"):
            endpoint_url = get_settings().archive.s3_endpoint_url
        with _stores_lock:
            store = _stores.get((root, endpoint_url))
            if store is None:
                store = open_store(root, endpoint_url)
                _stores[(root, endpoint_url)] = store
        data = store.get_bytes(key)
    if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
        raise BlobIntegrityError(
            f"blob {ref.uri}: expected {ref.size} bytes sha256 {ref.sha256}, got {len(data)} "
            f"bytes sha256 {hashlib.sha256(data).hexdigest()}"
        )
    return data
