"""Content digests of record bytes: the one digest the reorder core compares duplicates by
and the archive deduplicates with, so both judge "same content" the same way.

Pure (hashlib only): the pure cores may import it."""

from __future__ import annotations

import hashlib

#: Bytes of the blake2b digest (64 bits).
DIGEST_SIZE = 8


def content_digest(raw: bytes) -> int:
    """blake2b-64 of ``raw`` as an unsigned int, never 0 (0 marks a declared-missing seq in
    the reorder core's state)."""
    d = int.from_bytes(hashlib.blake2b(raw, digest_size=DIGEST_SIZE).digest(), "little")
    return d or 1
