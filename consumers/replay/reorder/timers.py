"""The reorder core's deadlines: the stall-timer heap and the timer queue (recycle grace,
idle timeout, tombstone expiry, recycled sandbox expiry, held events' arrivals), fired in
(deadline, kind, key) order once the clock reaches them, and re-armed after a restore.

:class:`Deadlines` is the part of the machine (:class:`.machine.ReorderCore`) that keeps
them; what a due timer does is the machine's (closing a gap, truncating, dropping a
tombstone, judging held events)."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .episode import EpisodeState
from .events import Held, Output

NEVER = 2**63 - 1
"""The deadline that never comes."""
# timer kinds, in firing order at one deadline
TIMER_RECYCLE = 0
TIMER_IDLE = 1
TIMER_TOMBSTONE = 2
TIMER_SANDBOX = 3
TIMER_HELD = 4


class Deadlines:
    """The stall-timer heap and the timer queue, over the machine's state."""

    # the machine's state this part reads and writes (set up by ReorderCore.__init__)
    _clock: int
    _now: int
    _timeout: int
    _ttl: int
    _idle: int | None
    _c: dict[str, int]
    _eps: dict[tuple[str, str], EpisodeState]
    _recycled: dict[str, int]
    _gap_heap: list[tuple[int, tuple[str, str]]]
    _timers: list[tuple[int, int, tuple[str, str]]]
    _dirty: set[tuple[str, str | None]]
    _dirty_eps: set[EpisodeState]
    _next_due: int
    _restored: set[tuple[str, str]]
    _restored_held: set[str]
    _held: dict[str, list[Held]]

    if TYPE_CHECKING:  # the machine's transitions a due timer runs
        def _close_gap(self, ep: EpisodeState, out: list[Output], final: bool = False
                       ) -> None: ...

        def _truncate(self, ep: EpisodeState, out: list[Output]) -> None: ...

        def _judge(self, sb: str, out: list[Output]) -> None: ...

        def _drop_ep(self, key: tuple[str, str]) -> None: ...

    def _push_gap(self, deadline: int, key: tuple[str, str]) -> None:
        heapq.heappush(self._gap_heap, (deadline, key))
        if deadline < self._next_due:
            self._next_due = deadline

    def _push_timer(self, deadline: int, kind: int, key: tuple[str, str]) -> None:
        heapq.heappush(self._timers, (deadline, kind, key))
        if deadline < self._next_due:
            self._next_due = deadline

    def _gap_valid(self, ep: EpisodeState, deadline: int) -> bool:
        return bool(ep.buf) and not ep.closed and ep.gap_since + self._timeout == deadline

    def _fire(self, out: list[Output]) -> None:
        """Fire every timer due at the current clock, in (deadline, kind, key) order."""
        self._now = self._clock  # timers re-armed here count from the clock
        self._fire_due(out)
        gh, th = self._gap_heap, self._timers
        self._next_due = min(gh[0][0] if gh else NEVER, th[0][0] if th else NEVER)

    def _fire_due(self, out: list[Output]) -> None:
        clock = self._clock
        gh = self._gap_heap
        eps = self._eps
        while gh and gh[0][0] <= clock:
            deadline, key = heapq.heappop(gh)
            ep = eps.get(key)
            if ep is not None and self._gap_valid(ep, deadline):
                self._close_gap(ep, out)
        th = self._timers
        while th and th[0][0] <= clock:
            deadline, kind, key = heapq.heappop(th)
            if kind == TIMER_SANDBOX:
                sb = key[0]
                if self._recycled.get(sb, -1) + self._ttl == deadline:
                    del self._recycled[sb]
                    self._dirty.add((sb, None))
                continue
            ep = eps.get(key)
            if kind == TIMER_HELD:
                self._judge(key[0], out)
            elif ep is None:
                continue
            elif kind == TIMER_TOMBSTONE:
                if ep.closed and ep.expire_at == deadline:
                    self._drop_ep(key)
                    self._dirty.add(key)
            elif ep.closed:
                continue
            elif kind == TIMER_RECYCLE:
                if ep.recycle_at == deadline:
                    self._dirty_eps.add(ep)
                    self._truncate(ep, out)
            elif kind == TIMER_IDLE and self._idle is not None:
                due = ep.active + self._idle
                if due == deadline:
                    self._c["idle_truncated"] += 1
                    self._dirty_eps.add(ep)
                    self._truncate(ep, out)
                else:  # activity since: re-arm (fires in true-due order, even if due now)
                    heapq.heappush(th, (due, TIMER_IDLE, key))
            # the gap heap may have become due again through truncation (timeout 0)
            while gh and gh[0][0] <= clock:
                d2, k2 = heapq.heappop(gh)
                e2 = eps.get(k2)
                if e2 is not None and self._gap_valid(e2, d2):
                    self._close_gap(e2, out)

    def _arm_restored(self) -> None:
        """Arm the timers of every key restored since the last input, once per key, from the
        state it ended up with (a key restored many times gets the timers of the last)."""
        for key in sorted(self._restored):
            if key[1] == "":  # a recycled sandbox
                dl = self._recycled.get(key[0])
                if dl is not None:
                    self._push_timer(dl + self._ttl, TIMER_SANDBOX, key)
                continue
            ep = self._eps.get(key)
            if ep is None:
                continue
            if ep.closed:
                self._push_timer(ep.expire_at, TIMER_TOMBSTONE, key)
                continue
            if ep.buf:
                self._push_gap(ep.gap_since + self._timeout, key)
            if ep.recycle_at >= 0:
                self._push_timer(ep.recycle_at, TIMER_RECYCLE, key)
            if self._idle is not None:
                self._push_timer(ep.active + self._idle, TIMER_IDLE, key)
        self._restored.clear()
        for sb in sorted(self._restored_held):
            for arrival, _, _ in self._held.get(sb, ()):
                self._push_timer(arrival, TIMER_HELD, (sb, ""))
        self._restored_held.clear()
