"""The emitter's write-ahead journal: an append-only log of assigned-but-unacknowledged events.

Layout (in the sandbox's state directory)::

    journal/seg-000000000001.log   segments, append-only, never rewritten
    emitter.lock                   flock held by the one live emitter of this directory

Frame: ``<u32 payload length><u32 crc32(payload)>`` + payload; payload = ``<u32 header length>``
+ header JSON + body. Header ``t`` is the record type:

- ``S`` snapshot (first record of every segment): next record id, next seq of every stream,
  open episodes, closed episodes' final seqs, cursors, lifecycle state.
- ``E`` event: record id, stream, seq, event id, kind, topic, state changes; body = the encoded
  event bytes exactly as sent to Kafka.
- ``A`` acknowledgements: record-id ranges the broker acknowledged (the emitter writes them
  in the same ``write(2)`` as its next event, or at flush, drain, close and segment roll).

Guarantees:

- A record is appended with ``write(2)`` before the emitter hands the event to Kafka, so it
  survives SIGKILL of the process; with ``durability="fsync"`` the segment is ``fdatasync``-ed
  before any event in it is sent, so it survives a host crash too.
- Recovery reads frames until the first bad frame (torn tail) and ignores the rest of that
  segment; nothing was sent from a record that was not fully on disk. A restarted emitter
  always opens a *new* segment, so nothing is ever appended after a torn tail.
- A segment is deleted only when it is not the active one and all its events were acked; the
  active segment always starts with a snapshot, so the state is always recoverable.
- Bounded disk: the emitter rolls the active segment as soon as every event in it is acked and
  it holds more than ``drained_roll_bytes`` of events (and at least 3x its snapshot, so
  snapshots stay a small share of the writes); the drained segment is then deleted. The
  journal thus holds the unacknowledged events plus about ``drained_roll_bytes``, not a whole
  ``segment_bytes`` segment of acknowledged ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajbus.producers.libc import libc_function

_FRAME = struct.Struct("<II")
_HLEN = struct.Struct("<I")
# json.dumps(h, separators=(",", ":")) builds a new encoder per call; same output, built once.
_HEADER_JSON = json.JSONEncoder(separators=(",", ":")).encode
_E_KEYS = ("t", "rid", "s", "q", "id", "k", "tp")
_A_KEYS = ("t", "r")
_json_str: Any = getattr(json.encoder, "c_encode_basestring_ascii", None) or (
    json.encoder.py_encode_basestring_ascii)


def _load_syncfs() -> Callable[[int], None] | None:
    """``syncfs(2)`` as ``fn(fd)`` (raises ``OSError``), or None where there is none (not Linux).

    One call writes back every dirty page and the metadata of the whole filesystem holding
    ``fd`` and commits its journal once: the group commit of many emitters' journals (since
    Linux 5.8 it reports writeback errors of the filesystem, as ``fdatasync`` does for a file).
    """
    fn = libc_function("syncfs")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    return syncfs


syncfs: Callable[[int], None] | None = _load_syncfs()


def _header_json(h: dict[str, Any]) -> str:
    """``json.dumps(h, separators=(",", ":"))``, the same text; a plain event header (the
    emitter's keys in its order, ints and strs) is formatted directly, without building an
    encoder (what json does on every call)."""
    if len(h) == 7 and tuple(h) == _E_KEYS:
        t, rid, st, q, eid, k, tp = h.values()
        if (type(rid) is int and type(q) is int and type(t) is str and type(st) is str
                and type(eid) is str and type(k) is str and type(tp) is str):
            return (f'{{"t":{_json_str(t)},"rid":{int.__repr__(rid)},"s":{_json_str(st)},'
                    f'"q":{int.__repr__(q)},"id":{_json_str(eid)},"k":{_json_str(k)},'
                    f'"tp":{_json_str(tp)}}}')
    if len(h) == 2 and tuple(h) == _A_KEYS and h["t"] == "A":  # {"t":"A","r":[[a,b],...]}
        r = h["r"]
        if type(r) is list and all(type(x) is list and len(x) == 2 and type(x[0]) is int
                                   and type(x[1]) is int for x in r):
            return '{"t":"A","r":[' + ",".join([f"[{a:d},{b:d}]" for a, b in r]) + "]}"
    return _HEADER_JSON(h)


def _frame_text(header_json: str, body: bytes) -> bytes:
    """One frame: ``<u32 length><u32 crc32>`` + ``<u32 header length>`` + header + body."""
    hj = header_json.encode()
    head = _HLEN.pack(len(hj)) + hj
    return _FRAME.pack(len(head) + len(body), zlib.crc32(body, zlib.crc32(head))) + head + body


SEG_PREFIX = "seg-"
SEG_SUFFIX = ".log"


class JournalError(RuntimeError):
    """The journal cannot be written (disk full, permissions): the event was not accepted."""


@dataclass
class JournalRecord:
    """One ``E`` record found at recovery (body not loaded: read with :meth:`Journal.read`)."""

    rid: int
    seg: int
    offset: int  # of the body, in the segment file
    length: int
    header: dict[str, Any]


@dataclass
class Recovered:
    state: dict[str, Any] | None  # the last snapshot
    events: list[JournalRecord] = field(default_factory=list)  # every E record found
    tail: list[dict[str, Any]] = field(default_factory=list)  # E headers after the last snapshot
    acked: set[int] = field(default_factory=set)
    segments: list[int] = field(default_factory=list)


def _ranges(rids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for r in sorted(rids):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        elif not out or r > out[-1][1]:
            out.append([r, r])
    return out


class Journal:
    """Segmented append-only journal in ``directory``."""

    def __init__(self, directory: Path, segment_bytes: int = 32 * 1024 * 1024) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.active = 0
        self._fd = -1
        self._size = 0
        self.snapshot_bytes = 0  # of the active segment's first record
        self.seg_bytes: dict[int, int] = {}
        self._dirty = False

    # -- paths --------------------------------------------------------------------------------
    def path(self, seg: int) -> Path:
        return self.dir / f"{SEG_PREFIX}{seg:012d}{SEG_SUFFIX}"

    def segments(self) -> list[int]:
        out = []
        for p in self.dir.glob(f"{SEG_PREFIX}*{SEG_SUFFIX}"):
            try:
                out.append(int(p.name[len(SEG_PREFIX):-len(SEG_SUFFIX)]))
            except ValueError:
                continue
        return sorted(out)

    @property
    def total_bytes(self) -> int:
        return sum(self.seg_bytes.values())

    # -- recovery -----------------------------------------------------------------------------
    def _frames(self, seg: int) -> Iterator[tuple[dict[str, Any], int, int]]:
        """(header, body offset, body length) of each valid frame, stopping at a bad one."""
        data = self.path(seg).read_bytes()
        pos = 0
        while pos + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, pos)
            start = pos + _FRAME.size
            end = start + length
            if length < _HLEN.size or end > len(data):
                return
            payload = memoryview(data)[start:end]
            if zlib.crc32(payload) != crc:
                return
            (hlen,) = _HLEN.unpack_from(payload, 0)
            if _HLEN.size + hlen > length:
                return
            try:
                header = json.loads(bytes(payload[_HLEN.size:_HLEN.size + hlen]))
            except ValueError:
                return
            body_off = start + _HLEN.size + hlen
            yield header, body_off, end - body_off
            pos = end

    def recover(self) -> Recovered:
        """Read every segment. The caller replays ``events`` over ``state``."""
        rec = Recovered(state=None)
        for seg in self.segments():
            rec.segments.append(seg)
            self.seg_bytes[seg] = self.path(seg).stat().st_size
            for header, off, length in self._frames(seg):
                t = header.get("t")
                if t == "S":
                    # Snapshot = the full state at that point; later E records apply on top.
                    rec.state = header
                    rec.tail = []
                elif t == "E":
                    rec.events.append(JournalRecord(header["rid"], seg, off, length, header))
                    rec.tail.append(header)
                elif t == "A":
                    for a, b in header["r"]:
                        rec.acked.update(range(a, b + 1))
        return rec

    # -- writing ------------------------------------------------------------------------------
    def open_new_segment(self, snapshot: dict[str, Any], sync_old: bool = True) -> None:
        """Start a new active segment whose first record is ``snapshot`` (durably).
        ``sync_old=False``: the old segment is about to be deleted (all acked): no sync."""
        old_fd = self._fd
        if old_fd >= 0 and sync_old:
            os.fdatasync(old_fd)
        seg = max([*self.segments(), self.active]) + 1
        path = self.path(seg)
        frame = self._frame({**snapshot, "t": "S"}, b"")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            raise JournalError(f"cannot create journal segment {path}: {exc}") from exc
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(fd, view):]
            os.fdatasync(fd)
            dfd = os.open(self.dir, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException as exc:
            # no half-written segment left behind: the active segment stays the old one
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            if isinstance(exc, OSError):
                raise JournalError(f"cannot start journal segment {path}: {exc}") from exc
            raise
        self._fd = fd
        self.active = seg
        self._size = len(frame)
        self.snapshot_bytes = len(frame)
        self.seg_bytes[seg] = self._size
        if old_fd >= 0:
            os.close(old_fd)

    @staticmethod
    def _frame(header: dict[str, Any], body: bytes) -> bytes:
        return _frame_text(_header_json(header), body)

    def needs_roll(self, incoming: int) -> bool:
        return self._size + incoming > self.segment_bytes and self._size > 4096

    def worth_rolling_drained(self, drained_roll_bytes: int) -> bool:
        """The active segment (all of it acked, the caller knows) holds enough events that
        replacing it by a fresh snapshot saves disk: more than ``drained_roll_bytes`` and at
        least 3x its own snapshot."""
        events = self._size - self.snapshot_bytes
        return events > drained_roll_bytes and events >= 3 * self.snapshot_bytes

    def append(self, header: dict[str, Any], body: bytes = b"",
               acks: list[int] | None = None) -> tuple[int, int, int]:
        """Append one record; returns (segment, body offset, body length). ``acks``: record ids
        acknowledged since the last write, journaled as an ``A`` record in the same
        ``write(2)``, before the record. On failure the segment is cut back to its previous
        size (neither record written) and :class:`JournalError` raised."""
        frame = self._frame(header, body)
        if acks:
            if len(acks) == 1:  # the usual case: one event acked since the last write
                a = acks[0]
                frame = _frame_text(f'{{"t":"A","r":[[{a:d},{a:d}]]}}', b"") + frame
            else:
                frame = self._frame({"t": "A", "r": _ranges(acks)}, b"") + frame
        start = self._size
        try:
            view = memoryview(frame)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as exc:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise JournalError(f"cannot append to {self.path(self.active)}: {exc}") from exc
        self._size += len(frame)
        self.seg_bytes[self.active] = self._size
        self._dirty = True
        return self.active, start + len(frame) - len(body), len(body)

    def append_acks(self, rids: list[int]) -> None:
        if rids:
            self.append({"t": "A", "r": _ranges(rids)})

    def sync_fd(self) -> int | None:
        """A duplicate of the active fd to fdatasync off the event loop (caller closes it), or
        None when nothing was written since the last sync."""
        if not self._dirty or self._fd < 0:
            return None
        self._dirty = False
        return os.dup(self._fd)

    def mark_dirty(self) -> None:
        """Sync again at the next :meth:`sync_fd` (a sync round that did not run)."""
        self._dirty = True

    def read(self, seg: int, offset: int, length: int) -> bytes:
        fd = os.open(self.path(seg), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def delete(self, seg: int) -> None:
        if seg == self.active:
            return
        self.path(seg).unlink(missing_ok=True)
        self.seg_bytes.pop(seg, None)

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.fdatasync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1
