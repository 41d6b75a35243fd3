"""Event ids (uuid4 hex, taken from batches of random bytes) and the emitter's default
producer id."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

_ID_BATCH = 256
_ids: Iterator[str] = iter(())


def _id_batch() -> Iterator[str]:
    """``_ID_BATCH`` ids from one ``os.urandom`` call (one syscall per 256 ids, not per id)."""
    b = bytearray(os.urandom(16 * _ID_BATCH))
    b[6::16] = bytes([(x & 0x0F) | 0x40 for x in b[6::16]])
    b[8::16] = bytes([(x & 0x3F) | 0x80 for x in b[8::16]])
    h = b.hex()
    return iter([h[i:i + 32] for i in range(0, len(h), 32)])


def new_event_id() -> str:
    """``uuid.uuid4().hex`` without building a UUID object: 16 random bytes (``os.urandom``)
    with the version (4) and RFC 4122 variant bits set, as 32 lower-case hex digits. Taken
    from a batch: ``next`` on a list iterator is atomic, so threads never share an id (two
    refilling at once each take fresh bytes), and a forked child starts a batch of its own."""
    global _ids
    for x in _ids:
        return x
    _ids = _id_batch()
    return next(_ids)


def _forget_ids() -> None:
    """A forked child takes no id of its parent's batch."""
    global _ids
    _ids = iter(())


os.register_at_fork(after_in_child=_forget_ids)


def default_producer_id(sandbox: str) -> str:
    """A producer id unique to this process and emitter: sandbox, host, pid, random."""
    return f"{sandbox}@{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
