"""Log silences: the stretches of log time in which an input partition wrote nothing at all.

A healthy input partition of a worker is never silent for long: the worker's ticker writes a
Tick into it every ``tick_interval_ms``. When it is silent longer than that, the partition
could not be written -- its leader died and a new one was not elected yet, the cluster lost
its in-sync majority, the whole cluster was down. Records produced meanwhile sit in their
producers' retries and reach the log *after* the silence, in any order against the ticks
that queued up with them: after a leader's crash a record produced before it can be written
seconds later, behind queued ticks that claim earlier times, and a gap timeout judged in log
time alone would declare a false gap (docs/decisions/0010-log-silences.md).

:class:`LogSilences` turns log time into *serving time*: log time with every silence taken
out (time stands still while any input partition is out). Timeouts judged in serving time
(the reorder's gap timeout and recycle grace) therefore pause for an outage and give the
records delayed by it ``gap_timeout_ms`` of serving log to arrive -- a timer counts from the
log, and the log was not being written.

Deterministic: everything it uses is in the log (records' log-append timestamps); its state
is persisted with the processor's changelog (:meth:`pack` / :meth:`unpack`). A silence is
known only once the silent partition speaks again, so a record of another partition read
ahead of that moment is judged without it: its timer counts from a later serving time, i.e.
it waits longer, never less.
"""

from __future__ import annotations

import bisect
import json

#: Changelog key of a processor's log silences (next to the reorder core's ``@clock``).
SILENCES_KEY = "@silences"
#: Silences that ended this long (log time) before the processor's clock are folded into one
#: total: no record that old is still judged.
FOLD_AFTER_MS = 3_600_000
_MAX_INTERVALS = 256


class LogSilences:
    """Merged silence intervals ``[start, end)`` in log time, per processor (one input
    partition of each input topic). ``allowance_ms``: the longest a healthy partition goes
    without a record (the tick interval plus slack for a slow ticker); only what exceeds it
    counts as silence."""

    def __init__(self, allowance_ms: int) -> None:
        self.allowance_ms = allowance_ms
        self.last: dict[str, int] = {}  # topic -> latest log time seen
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.folded = 0  # total length of the silences folded away (all before fold_until)
        self.fold_until = 0
        self.dirty = False

    def observe(self, topic: str, log_ms: int) -> None:
        """A record of ``topic`` (any record, ticks included) written at ``log_ms``."""
        prev = self.last.get(topic)
        if prev is None or log_ms > prev:
            self.last[topic] = log_ms
            self.dirty = True
            if prev is not None and log_ms - prev > self.allowance_ms:
                self._add(max(prev + self.allowance_ms, self.fold_until), log_ms)

    def _add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self.ends, start)  # first interval ending at/after start
        j = bisect.bisect_right(self.starts, end)  # intervals starting after end stay
        if i < j:  # overlaps intervals i..j-1: merge
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def silent_before(self, t: int) -> int:
        """Total silence in log time before ``t``."""
        total = self.folded
        for start, end in zip(self.starts, self.ends, strict=True):
            if start >= t:
                break
            total += min(t, end) - start
        return total

    def serving(self, t: int) -> int:
        """Serving time of log time ``t``: ``t`` less every silence before it."""
        if not self.starts:  # the usual case, per record: no silence since the last fold
            return t - self.folded if t > 0 else t
        return t - self.silent_before(t) if t > 0 else t

    def fold(self, clock_log_ms: int) -> None:
        """Fold the silences that ended long before ``clock_log_ms`` into one total."""
        horizon = clock_log_ms - FOLD_AFTER_MS
        n = 0
        while n < len(self.starts) and (self.ends[n] <= horizon
                                        or len(self.starts) - n > _MAX_INTERVALS):
            n += 1
        if n:
            self.folded += sum(e - s for s, e in zip(self.starts[:n], self.ends[:n],
                                                     strict=True))
            self.fold_until = max(self.fold_until, self.ends[n - 1])
            del self.starts[:n], self.ends[:n]
            self.dirty = True

    # -- changelog ---------------------------------------------------------------------------
    def pack(self) -> bytes:
        self.dirty = False
        return json.dumps({"v": 1, "last": self.last, "starts": self.starts, "ends": self.ends,
                           "folded": self.folded, "fold_until": self.fold_until},
                          separators=(",", ":"), sort_keys=True).encode()

    def unpack(self, blob: bytes | None) -> None:
        if blob is None:
            self.__init__(self.allowance_ms)  # type: ignore[misc]
            return
        try:
            data = json.loads(blob)
            if data.get("v") != 1:
                raise ValueError(f"version {data.get('v')!r}")
            self.last = {str(k): int(v) for k, v in data["last"].items()}
            self.starts = [int(x) for x in data["starts"]]
            self.ends = [int(x) for x in data["ends"]]
            self.folded = int(data["folded"])
            self.fold_until = int(data["fold_until"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"corrupt log silences state: {exc}") from exc
        self.dirty = False
