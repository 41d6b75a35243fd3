"""The reorder core's emission: how an episode's stream moves on: contiguous events out as
segments (split by the segment caps), gaps declared and recorded, episodes closed and
truncated (see "Order", "Gaps" and "End" in :mod:`trajbus.consumers.replay.core`).

:class:`Emission` is the part of the machine
(:class:`.machine.ReorderCore`) that does it."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from .episode import GAP_MARK, GAPS_KEPT, HISTORY_GAP_MAX, EpisodeState, h16, remember, trim
from .events import Output, SegmentOut
from .timers import TIMER_TOMBSTONE


class Emission:
    """Segments, gaps and closing, over the machine's state."""

    # the machine's state this part reads and writes (set up by ReorderCore.__init__)
    _c: dict[str, int]
    _w: int
    _seg_events: int
    _seg_bytes: int
    _now: int
    _timeout: int
    _ttl: int
    _buffered: int
    _buffered_bytes: int
    _dirty_eps: set[EpisodeState]
    _by_sandbox: dict[str, set[str]]

    if TYPE_CHECKING:  # the timers' (Deadlines)
        def _push_gap(self, deadline: int, key: tuple[str, str]) -> None: ...

        def _push_timer(self, deadline: int, kind: int, key: tuple[str, str]) -> None: ...

    def _unbuffer(self, ep: EpisodeState, n: int) -> None:
        ep.buf_bytes -= n
        self._buffered -= 1
        self._buffered_bytes -= n

    def _emit(self, ep: EpisodeState, out: list[Output], events: list[bytes],
              gap: tuple[int, int] | None, last: bool, t: int,
              first_seq: int | None = None) -> None:
        idx = ep.seg_index
        ep.seg_index = idx + 1
        end = ep.next_seq - 1
        first = end - len(events) + 1 if first_seq is None else first_seq
        self._c["segments"] += 1
        out.append(SegmentOut(ep.task, ep.sandbox, ep.episode, idx, first, first + len(events) - 1,
                              events, gap, idx == 0, last, last and ep.terminal, t))

    def _drain(self, ep: EpisodeState, out: list[Output], gap: tuple[int, int] | None,
               first: tuple[bytes, int, int] | None, final: bool = False) -> None:
        """Emit everything contiguous from next_seq (``first`` is the event at next_seq when it
        did not come from the buffer), with ``gap`` on the first segment. ``final``: the
        episode is being truncated; the segment is the last when nothing remains after it."""
        w = self._w
        ring = ep.ring
        buf = ep.buf
        seq = start = ep.next_seq
        events: list[bytes] = []
        nbytes = 0
        last_t = ep.last_time
        cap_n, cap_b = self._seg_events, self._seg_bytes
        if first is not None:
            raw, dig, last_t = first
            ring[seq % w] = dig
            remember(ep, seq, h16(dig))
            events.append(raw)
            nbytes = len(raw)
            seq += 1
        while buf and seq in buf:
            raw, dig, t = buf[seq]
            if events and (len(events) >= cap_n or nbytes + len(raw) > cap_b):
                ep.next_seq = seq
                self._emit(ep, out, events, gap, False, last_t, start)
                gap, events, nbytes, start = None, [], 0, seq
            del buf[seq]
            self._unbuffer(ep, len(raw))
            ring[seq % w] = dig
            remember(ep, seq, h16(dig))
            events.append(raw)
            nbytes += len(raw)
            last_t = t
            seq += 1
        ep.next_seq = seq
        ep.last_time = last_t
        if buf is not None:
            if buf:
                self._arm_gap(ep)  # progress while still stalled: restart the stall timer
            else:
                ep.buf = None
                ep.gap_since = -1
        is_last = 0 <= ep.stop < seq or (final and not ep.buf and ep.stop < seq)
        ep.expect = seq if ep.buf is None and ep.stop < 0 else -1
        if events or gap is not None or is_last:
            self._emit(ep, out, events, gap, is_last, last_t, start)
        if is_last:
            self._close(ep)

    def _arm_gap(self, ep: EpisodeState) -> None:
        ep.gap_since = self._now
        self._push_gap(self._now + self._timeout, ep.key)

    def _record_gap(self, ep: EpisodeState, lo: int, hi: int) -> None:
        self._c["gaps"] += 1
        self._c["gap_seqs"] += hi - lo + 1
        w = self._w
        for s in range(max(lo, hi - w + 1), hi + 1):
            ep.ring[s % w] = GAP_MARK
        if hi - lo < HISTORY_GAP_MAX and ep.hist_base + len(ep.hist) == lo:
            ep.hist.extend(array("H", bytes(2 * (hi - lo + 1))))
            trim(ep)
        else:
            del ep.hist[:]
            ep.hist_base = hi + 1
        gaps = ep.gaps
        gaps.append((lo, hi))
        if len(gaps) > GAPS_KEPT:
            del gaps[0]

    def _close_gap(self, ep: EpisodeState, out: list[Output], final: bool = False) -> None:
        """Declare next_seq..(first buffered - 1) missing and stream on from there."""
        assert ep.buf
        lo = ep.next_seq
        nxt = min(ep.buf)
        self._record_gap(ep, lo, nxt - 1)
        ep.next_seq = nxt
        self._dirty_eps.add(ep)
        self._drain(ep, out, (lo, nxt - 1), None, final)

    def _close(self, ep: EpisodeState) -> None:
        if ep.buf:
            for raw, _, _ in ep.buf.values():
                self._unbuffer(ep, len(raw))
        ep.buf = None
        ep.buf_bytes = 0
        ep.gap_since = -1
        ep.closed = True
        ep.expect = -1
        ep.recycle_at = -1
        ep.expire_at = self._now + self._ttl
        self._c["episodes_closed"] += 1
        if not (ep.end_seq >= 0 and ep.terminal):
            self._c["episodes_truncated"] += 1
        self._push_timer(ep.expire_at, TIMER_TOMBSTONE, ep.key)
        self._dirty_eps.add(ep)
        eps = self._by_sandbox.get(ep.sandbox)
        if eps is not None:
            eps.discard(ep.episode)
            if not eps:
                del self._by_sandbox[ep.sandbox]

    def _truncate(self, ep: EpisodeState, out: list[Output]) -> None:
        """Flush everything buffered (closing gaps), then end the episode truncated."""
        while ep.buf and not ep.closed:
            self._close_gap(ep, out, final=True)
        if ep.closed:
            return
        gap = None
        if ep.final_seq >= ep.next_seq:
            gap = (ep.next_seq, ep.final_seq)
            self._record_gap(ep, *gap)
            ep.next_seq = ep.final_seq + 1
        self._emit(ep, out, [], gap, True, ep.last_time)
        self._close(ep)
