"""Claim-check for large blobs: store the bytes once in object storage, put a reference on Kafka.

Guarantees:

- Content-addressed: the key is ``blobs/sha256/<ab>/<cd>/<sha256 hex>`` (``ab``/``cd`` = the
  first two byte pairs of the digest), so the same bytes are stored once however often they
  are sent, and a retried put is harmless. A put of a key that already exists is skipped.
- The object is complete before the event referencing it is journaled (the store's puts are
  atomic: temp file + rename locally, a completed PUT on S3).
- Readers verify size and sha256 (``trajbus.archive.blobs.fetch_blob`` raises
  :class:`BlobIntegrityError` on a mismatch): a reader never gets bytes that differ from what
  the producer hashed.

The store is ``settings.archive.url`` by default (a local directory, or ``s3://bucket/prefix``
with ``settings.archive.s3_endpoint_url``). References on Kafka are absolute URIs
(``trajbus.bus.blobref``: the reference format both sides share); the archive stores a
reference into itself relative to its root (``blobs/sha256/ab/cd/<sha>``, see
``archive.rows.to_row``).
"""

from __future__ import annotations

import hashlib
import threading

from trajbus.archive.storage import ObjectStore, open_store
from trajbus.bus.blobref import (
    BLOB_PREFIX,
    BlobIntegrityError,
    blob_key,
    is_archive_relative,
    root_uri,
)
from trajbus.bus.settings import Settings, get_settings
from trajbus.schemas.models import BlobRef

__all__ = ["BLOB_PREFIX", "BlobIntegrityError", "ClaimCheck", "blob_key", "is_archive_relative",
           "root_uri"]


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
