"""Claim-check references: where a blob lives and how a reader checks it, shared by the
producers that store blobs and the archive that reads and keeps them.

A blob is stored once under its content address ``blobs/sha256/<ab>/<cd>/<sha256 hex>``
(``ab``/``cd`` = the first two byte pairs of the digest). A reference is either absolute --
the store's root URI (:func:`root_uri`) plus that key, the form on Kafka -- or relative to an
archive root (the key alone), the form the archive keeps for blobs inside itself. Pure: no
store, no I/O.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import unquote, urlparse

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


def is_archive_relative(uri: str) -> bool:
    """True for a reference relative to an archive root (``blobs/sha256/ab/cd/<sha>``), the
    form the archive stores references into itself in."""
    return uri.startswith(f"{BLOB_PREFIX}/") and "://" not in uri


def split_uri(uri: str) -> tuple[str, str]:
    """(store location, key) of an absolute blob URI: ``s3://bucket/prefix`` or a local
    directory, and ``blobs/sha256/...``."""
    marker = f"/{BLOB_PREFIX}/"
    idx = uri.rfind(marker)
    if idx < 0:
        raise ValueError(f"not a trajbus blob URI: {uri!r}")
    root, key = uri[:idx], uri[idx + 1:]
    if root.startswith("file://"):
        root = unquote(urlparse(root).path)
    return root, key


def verify(uri: str, data: bytes, size: int, sha256: str) -> bytes:
    """``data`` if its size and sha256 are the reference's; else :class:`BlobIntegrityError`."""
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != size or digest != sha256:
        raise BlobIntegrityError(f"blob {uri}: expected {size} bytes sha256 {sha256}, got "
                                 f"{len(data)} bytes sha256 {digest}")
    return data
