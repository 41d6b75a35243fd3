"""The archive's batching decisions: a pure, deterministic state machine (no I/O, no clock).

:class:`ArchiveBatcher` keeps one open *batch* per (topic, partition): the offset range
``[first, last]``, the row count, the (uncompressed) byte size and the event-time span. It
never holds rows: the shell appends each row to a disk spool for the same (topic, partition)
(``spool.py``), so memory stays bounded by one spool chunk per partition however far the
archiver is behind. It returns :class:`Flush` instructions:

* ``size``: adding the record would take the batch past ``target_object_bytes`` -> the batch
  *without* the record is flushed, and the record opens the next batch (a single record larger
  than the target is flushed alone, ``reason="size"``, ``includes`` the record);
* ``span``: the record's event time would stretch the batch's event-time span past
  ``max_open_ms`` -> same, the record opens the next batch;
* ``tick``: :meth:`tick` with an event-time watermark flushes batches opened more than
  ``max_open_ms`` before it (the shell passes the highest event time it has seen, never the
  wall clock);
* ``explicit``: :meth:`flush` (shutdown, until-idle mode);
* ``replay``: a batch boundary recorded before a crash (:meth:`expect`) is reproduced exactly,
  so the re-upload after a crash between upload and commit writes the same object keys.

Size and span decisions depend only on that partition's records, so they repeat identically on
re-consumption; ``tick``/``explicit`` boundaries depend on timing and are made repeatable by
the batch markers plus :meth:`expect`.

Undecodable records still advance the batch's offset range (:meth:`skip`): their offsets are
committed with the batch, after they went to the dead-letter topic.

A batch of skipped offsets only (the processors' Tick records, re-sent copies, dead letters)
holds no row: :meth:`release_empty` lets the shell drop it and commit past it without writing
anything, so an idle archiver's committed offset keeps up with the ticks written into its
input partitions (a lag exporter reads 0, not a lag growing by the ticks). The shell does so
only together with a commit, so a batch that opens afterwards starts at (or after) the
committed offset, as every batch does, and a replay after a crash reproduces its boundary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FlushReason = Literal["size", "span", "tick", "explicit", "replay"]
TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Flush:
    """Write rows ``[first_offset, last_offset]`` of (topic, partition), then commit
    ``commit_offset``."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int
    rows: int
    nbytes: int
    min_event_time_ms: int | None
    max_event_time_ms: int | None
    reason: FlushReason

    @property
    def commit_offset(self) -> int:
        return self.last_offset + 1


@dataclass(slots=True)
class _Open:
    first: int
    last: int
    rows: int = 0
    nbytes: int = 0
    tmin: int | None = None
    tmax: int | None = None

    def span_with(self, t: int) -> int:
        if self.tmin is None or self.tmax is None:
            return 0
        return max(self.tmax, t) - min(self.tmin, t)


@dataclass(slots=True)
class BatcherStats:
    duplicates: int = 0  # records at or below an offset already seen (re-delivery)
    flushes: dict[str, int] = field(default_factory=dict)


class ArchiveBatcher:
    """One open batch per (topic, partition); see the module docstring for the rules."""

    def __init__(self, target_object_bytes: int = 64 * 1024 * 1024,
                 max_open_ms: int = 6 * 3600 * 1000) -> None:
        if target_object_bytes <= 0 or max_open_ms <= 0:
            raise ValueError("target_object_bytes and max_open_ms must be positive")
        self.target_object_bytes = target_object_bytes
        self.max_open_ms = max_open_ms
        self._open: dict[TP, _Open] = {}
        self._seen: dict[TP, int] = {}  # highest offset accepted per partition
        self._expected: dict[TP, list[tuple[int, int]]] = {}
        self.stats = BatcherStats()

    # -- inputs ----------------------------------------------------------------------------
    def add(self, topic: str, partition: int, offset: int, event_time_ms: int,
            nbytes: int) -> list[Flush]:
        """Account one archived record. Flushes whose ``last_offset < offset`` close the batch
        before this record; a flush with ``last_offset == offset`` includes it."""
        return self._accept(topic, partition, offset, event_time_ms, max(nbytes, 0))

    def skip(self, topic: str, partition: int, offset: int) -> list[Flush]:
        """Account an offset that produced no row (dead-lettered): it joins the open batch."""
        return self._accept(topic, partition, offset, None, 0)

    def tick(self, watermark_ms: int) -> list[Flush]:
        """Flush every batch whose first event is more than ``max_open_ms`` before the
        event-time ``watermark_ms``."""
        out: list[Flush] = []
        for tp in sorted(self._open):
            b = self._open[tp]
            if b.tmin is not None and watermark_ms - b.tmin >= self.max_open_ms \
                    and not self._expected.get(tp):
                out.append(self._close(tp, "tick"))
        return out

    def flush(self, topic: str | None = None, partition: int | None = None) -> list[Flush]:
        """Flush the open batches (all, one topic's, or one partition's)."""
        out: list[Flush] = []
        for tp in sorted(self._open):
            if (topic is None or tp[0] == topic) and (partition is None or tp[1] == partition):
                out.append(self._close(tp, "explicit"))
        return out

    def expect(self, topic: str, partition: int, first_offset: int, last_offset: int) -> None:
        """Reproduce a batch boundary recorded before a crash: the batch containing
        ``last_offset`` ends exactly there, whatever the size/span rules say."""
        lst = self._expected.setdefault((topic, partition), [])
        lst.append((first_offset, last_offset))
        lst.sort()

    def drop(self, topic: str, partition: int) -> None:
        """Forget a partition (revoked in a rebalance): its uncommitted records will be
        re-consumed by the new owner."""
        tp = (topic, partition)
        self._open.pop(tp, None)
        self._seen.pop(tp, None)
        self._expected.pop(tp, None)

    def release_empty(self, topic: str, partition: int) -> bool:
        """Whether nothing of (topic, partition) waits to be written: no open batch, or one
        holding no row (only skipped offsets), which is dropped; never while a batch boundary
        recorded before a crash is to be reproduced. True: the shell may commit the
        consumer's position (and must, before any later batch opens)."""
        tp = (topic, partition)
        if self._expected.get(tp):
            return False
        b = self._open.get(tp)
        if b is not None:
            if b.rows:
                return False
            del self._open[tp]
        return True

    def reset_position(self, topic: str, partition: int, next_offset: int) -> None:
        """The consumer will (re)deliver from ``next_offset`` (assignment, seek)."""
        tp = (topic, partition)
        self._open.pop(tp, None)
        self._seen[tp] = next_offset - 1

    # -- queries ---------------------------------------------------------------------------
    def open_batches(self) -> dict[TP, tuple[int, int, int, int]]:
        """(first, last, rows, nbytes) of every open batch."""
        return {tp: (b.first, b.last, b.rows, b.nbytes) for tp, b in self._open.items()}

    def snapshot(self) -> dict[str, Any]:
        return {
            "target_object_bytes": self.target_object_bytes,
            "max_open_ms": self.max_open_ms,
            "open": [[t, p, asdict(b)] for (t, p), b in sorted(self._open.items())],
            "seen": [[t, p, o] for (t, p), o in sorted(self._seen.items())],
            "expected": [[t, p, e] for (t, p), e in sorted(self._expected.items())],
        }

    @classmethod
    def restore(cls, snap: dict[str, Any]) -> ArchiveBatcher:
        b = cls(snap["target_object_bytes"], snap["max_open_ms"])
        b._open = {(t, p): _Open(**d) for t, p, d in snap["open"]}
        b._seen = {(t, p): o for t, p, o in snap["seen"]}
        b._expected = {(t, p): [tuple(x) for x in e] for t, p, e in snap["expected"]}
        return b

    # -- internals -------------------------------------------------------------------------
    def _accept(self, topic: str, partition: int, offset: int, t: int | None,
                nbytes: int) -> list[Flush]:
        tp = (topic, partition)
        if offset <= self._seen.get(tp, -1):
            self.stats.duplicates += 1
            return []
        self._seen[tp] = offset
        expected = self._expected.get(tp)
        b = self._open.get(tp)
        if b is not None and not expected and t is not None:
            # the common case: an open batch, no replayed boundary, an archived record
            tmin, tmax = b.tmin, b.tmax
            if b.rows and b.nbytes + nbytes > self.target_object_bytes:
                out = [self._close(tp, "size")]
                b = None
            elif tmin is not None and tmax is not None and \
                    (tmax if tmax > t else t) - (tmin if tmin < t else t) > self.max_open_ms:
                out = [self._close(tp, "span")]
                b = None
            else:
                b.last = offset
                b.rows += 1
                b.nbytes += nbytes
                if tmin is None or t < tmin:
                    b.tmin = t
                if tmax is None or t > tmax:
                    b.tmax = t
                if b.nbytes >= self.target_object_bytes:
                    return [self._close(tp, "size")]
                return []
        else:
            out = []
        # Drop recorded boundaries that lie entirely behind us.
        while expected and expected[0][1] < offset and tp not in self._open:
            expected.pop(0)
        if b is not None:
            if expected:
                if offset > expected[0][1]:
                    out.append(self._close(tp, "replay"))
                    expected.pop(0)
                    b = None
            elif b.rows and b.nbytes + nbytes > self.target_object_bytes:
                out.append(self._close(tp, "size"))
                b = None
            elif t is not None and b.span_with(t) > self.max_open_ms:
                out.append(self._close(tp, "span"))
                b = None
        if b is None:
            b = self._open[tp] = _Open(first=offset, last=offset)
        b.last = offset
        if t is not None:
            b.rows += 1
            b.nbytes += nbytes
            b.tmin = t if b.tmin is None else min(b.tmin, t)
            b.tmax = t if b.tmax is None else max(b.tmax, t)
        expected = self._expected.get(tp)
        if expected and offset >= expected[0][1]:
            out.append(self._close(tp, "replay"))
            expected.pop(0)
        elif not expected and b.nbytes >= self.target_object_bytes:
            out.append(self._close(tp, "size"))
        return out

    def _close(self, tp: TP, reason: FlushReason) -> Flush:
        b = self._open.pop(tp)
        self.stats.flushes[reason] = self.stats.flushes.get(reason, 0) + 1
        return Flush(tp[0], tp[1], b.first, b.last, b.rows, b.nbytes, b.tmin, b.tmax, reason)
