"""Which offsets of a partition a trainer client has acknowledged, and what it may commit.

:class:`_PartitionProgress` is one member's tenure of one partition: acknowledged offsets,
offsets that hold no record for this reader (transaction markers, aborted records), and
the runs beyond the commit point that the group's commit metadata says are passed.
:func:`encode_acked_beyond` / :func:`parse_acked_beyond` are that metadata's format: a few
bytes per run, so that a restart, or the partition's next owner, skips every acknowledged
offset beyond the commit point. Pure: no Kafka client, no clock.
"""

from __future__ import annotations

import base64
import bisect
import json
import logging
import zlib
from collections.abc import Iterable

log = logging.getLogger("trajbus.consumers.replay.client")

_METADATA_LIMIT = 3500  # below Kafka's default offset.metadata.max.bytes (4096)


class _PartitionProgress:
    """Which offsets of one partition are acknowledged; what may be committed.

    One object per *tenure*: from the moment this member takes the partition (``epoch``, a
    number the client gives each) until it loses it. What was handed out under an earlier
    tenure is not this one's: its acknowledgement is void (the partition's next owner
    delivers it again)."""

    def __init__(self, committed: int, carried: Iterable[tuple[int, int]] = (),
                 epoch: int = 0) -> None:
        self.committed = committed  # next offset to read after a restart
        self.epoch = epoch
        self.acked: set[int] = set()
        # Runs [start, end) beyond the commit point that the group's commit metadata says are
        # passed (acknowledged, or holding nothing) -- by an earlier run or another member
        self.carried: list[tuple[int, int]] = _merge_runs(
            (max(a, committed), b) for a, b in carried if b > committed)
        # Offsets that hold no record for this reader: a transaction's commit marker (one per
        # transaction of the worker's transactional producer), an aborted transaction's
        # records, offsets compacted away. The commit point passes them (else it would stop at
        # the first marker for good). start -> end of each such run.
        self.holes: dict[int, int] = {}
        self.read_to = committed  # offset after the last record read (where the fetch is)
        self._prune_at = 1024
        self.acks = 0  # acknowledgements recorded (each new one counts)
        self.durable = 0  # of those, how many a successful commit carried
        self.promised = 0  # of those, how many an ack() returned True for before a commit
        # carried them (coalesced commits)
        self.last_committed: tuple[int, str] = _NO_COMMIT  # (offset, metadata) the group
        # has from this tenure (or had when it began; _NO_COMMIT: none)
        self.metadata_cut = 0  # runs left out of the last metadata (too long)

    @classmethod
    def from_commit(cls, offset: int, metadata: str, epoch: int = 0) -> _PartitionProgress:
        """The progress the group's commit (offset and metadata) stands for."""
        progress = cls(offset, parse_acked_beyond(metadata, offset), epoch)
        progress.last_committed = (offset, metadata)
        return progress

    def note_read(self, offset: int) -> None:
        """A record at ``offset`` was fetched. Read in order from ``read_to``, the offsets
        skipped on the way hold nothing this reader can get (a fetch returns the first
        deliverable record at or after its position). An earlier offset is a re-read after
        a seek back: reading goes on in order from there."""
        if offset > self.read_to:
            self.holes[self.read_to] = offset
        elif offset < self.read_to and self.holes:
            # learnt again on the way from here (and not trusted over a rewritten log)
            self.holes = {a: b for a, b in self.holes.items() if a < offset}
        self.read_to = offset + 1

    def ack(self, offset: int) -> bool:
        """Record an acknowledgement; True when it is new (the commit's offset or its
        metadata changes)."""
        if offset >= self.committed and offset not in self.acked and not self._carried(offset):
            self.acked.add(offset)
            self.acks += 1
            return True
        return False

    def _carried(self, offset: int) -> bool:
        runs = self.carried
        if not runs:
            return False
        i = bisect.bisect_right(runs, (offset, _NO_END)) - 1
        return i >= 0 and runs[i][0] <= offset < runs[i][1]

    def skip_on_restart(self, offset: int) -> bool:
        # below the commit point too: acknowledged beyond it at the start, then passed by it
        # when the segments before it were acknowledged in this run
        return offset < self.committed or offset in self.acked or self._carried(offset)

    def advance(self) -> bool:
        """Move the commit point over contiguous acknowledged offsets, the holes between
        them and the runs carried from the group's commit. True when it moved."""
        moved = False
        carried = self.carried
        while True:
            if self.committed in self.acked:
                self.acked.discard(self.committed)
                self.committed += 1
            elif self.committed in self.holes:
                self.committed = max(self.committed, self.holes.pop(self.committed))
            elif carried and carried[0][0] <= self.committed:
                self.committed = max(self.committed, carried.pop(0)[1])
            else:
                break
            moved = True
        if len(self.holes) > self._prune_at:  # those behind the commit point are never
            self.holes = {a: b for a, b in self.holes.items() if b > self.committed}
            self._prune_at = max(1024, 2 * len(self.holes))  # looked up: amortised
        return moved

    def beyond(self) -> list[tuple[int, int]]:
        """The runs [start, end) beyond the commit point that are passed: acknowledged offsets,
        carried runs, and the holes between them (a reader skips a hole anyway)."""
        runs = _merge_runs([(o, o + 1) for o in self.acked]
                           + [r for r in self.carried if r[1] > self.committed])
        if not runs:
            return []
        hi = runs[-1][1]
        holes = [(max(a, self.committed), min(b, hi)) for a, b in self.holes.items()
                 if b > self.committed and a < hi]
        return _merge_runs(runs + holes) if holes else runs

    def metadata(self) -> str:
        """The commit's metadata: the runs beyond the commit point that are passed, so that a
        trainer resuming -- this one restarted, or another member the partition moves to --
        skips them (see :func:`encode_acked_beyond`). Runs that do not fit are left out (the
        highest first; ``metadata_cut`` counts them): they are delivered again."""
        text, self.metadata_cut = encode_acked_beyond(self.beyond(), self.committed)
        return text


_NO_END = 2**63
_NO_COMMIT = (-1, "")  # a partition's last commit known to a tenure when the group had none
_RUNS_TAG = "r1:"


def _merge_runs(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping, non-adjacent runs [start, end) covering ``runs``."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in runs if r[1] > r[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _varint(out: bytearray, n: int) -> None:
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def encode_acked_beyond(runs: list[tuple[int, int]], committed: int,
                        limit: int = 0) -> tuple[str, int]:
    """Commit metadata for the passed runs beyond ``committed``: ``"r1:"`` and the base64 of
    the zlib-compressed varints (gap from the previous run's end, length) of each run -- a
    few bytes per run whatever its length (the offsets of thousands of acknowledged live
    segments fit). Returns the text and how many runs were left out to keep it under
    ``limit`` (default: Kafka's default ``offset.metadata.max.bytes`` with a margin); the
    highest go first, and are delivered again to the next reader."""
    limit = limit or _METADATA_LIMIT
    if not runs:
        return "", 0
    keep = len(runs)
    while True:
        out = bytearray()
        prev = committed
        for a, b in runs[:keep]:
            _varint(out, a - prev)
            _varint(out, b - a)
            prev = b
        text = _RUNS_TAG + base64.b64encode(zlib.compress(bytes(out), 9)).decode()
        if len(text) <= limit or keep == 0:
            return (text if keep else ""), len(runs) - keep
        keep = keep * limit // len(text) if keep > 1 else 0  # proportionally fewer


def parse_acked_beyond(metadata: str, committed: int) -> list[tuple[int, int]]:
    """The passed runs a commit's metadata names (:func:`encode_acked_beyond`; also the older
    format, a JSON list of offsets). Unreadable metadata names none."""
    if not metadata:
        return []
    try:
        if metadata.startswith(_RUNS_TAG):
            data = zlib.decompress(base64.b64decode(metadata[len(_RUNS_TAG):]))
            nums: list[int] = []
            n = shift = 0
            for byte in data:
                n |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    nums.append(n)
                    n = shift = 0
            runs = []
            prev = committed
            for gap, length in zip(nums[::2], nums[1::2], strict=False):
                start = prev + gap
                prev = start + length
                runs.append((start, prev))
            return runs
        return _merge_runs((int(x), int(x) + 1) for x in json.loads(metadata))
    except (ValueError, TypeError, zlib.error):
        log.warning("unreadable commit metadata %r: ignored (what it named is read again)",
                    metadata[:80])
        return []
