"""The detector's time (see "Time" and "Stall rule" in :mod:`trajbus.consumers.watchdog.core`):
the log each stream's events come from, the latest log time at which one was read, when a
log's next timer is due at the earliest, and the timers themselves (STALL, idle eviction).

:class:`LogTimers` is the part of the detector (:class:`.machine.WatchdogCore`) that keeps
them; an accepted event of a stream goes through :meth:`LogTimers._touch`, on the fast path
(tool events) and on the others alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .outputs import AlertOut, Output
from .stream import Stream


class LogTimers:
    """Each log's streams and timers, over the detector's state."""

    # the detector's state this part reads and writes (set up by WatchdogCore.__init__)
    evict_idle_ms: int | None
    _dirty: set[str]
    _domain: str
    _log_ms: int | None
    _floor: int
    _due: dict[str, int]
    _in_domain: dict[str, dict[str, Stream]]

    if TYPE_CHECKING:  # the loop rule's and the streams' (LoopRule, StreamLife)
        def _open_calls(self, st: Stream) -> int: ...

        def _stall_alert(self, st: Stream, now_ms: int, idle: int) -> AlertOut: ...

        def _end_stream(self, st: Stream, seq: int, t: int, event_id: str,
                        why: str) -> list[Output]: ...

    def _timers(self, log: str, clock: int) -> list[tuple[str, list[Output]]]:
        """Fire the timers of ``log``'s streams due by ``clock`` (its log time): a STALL first
        (its deadline comes first), then idle eviction; and note when the next one is due."""
        found: list[tuple[str, list[Output]]] = []
        evict = self.evict_idle_ms
        members = self._in_domain.get(log)
        nxt: int | None = None
        for st in list(members.values()) if members else ():
            last = st.last_log
            if last < 0:
                continue
            idle = clock - last
            stall = st.rules.stall_after_ms
            outs: list[Output] = []
            open_calls = not st.stalled and self._open_calls(st) > 0
            if open_calls and idle >= stall:
                st.stalled = True
                open_calls = False
                self._dirty.add(st.key)
                outs.append(self._stall_alert(st, clock, idle))
            if evict is not None and idle >= evict:
                outs.extend(self._end_stream(
                    st, st.last_seq, st.last_time, "",
                    f"tracking ended: idle for {idle} ms of its log"))
                found.append((st.key, outs))
                continue
            if outs:
                found.append((st.key, outs))
            for due in (last + evict if evict is not None else None,
                        last + stall if open_calls else None):
                if due is not None and (nxt is None or due < nxt):
                    nxt = due
        if nxt is None:
            self._due.pop(log, None)
        else:
            self._due[log] = nxt
        return found

    def _touch(self, st: Stream, seq: int, t: int, rearm: bool = True) -> None:
        """An event of ``st`` (seq ``seq``, event time ``t``) was accepted: its state changed,
        it is no longer stalled, and its timers count again from ``max(its log's clock, the
        record's log time)`` (a record written before the clock was read late: its stream is
        not made idle by the delay). ``rearm=False``: none of its timers can be due earlier
        than its log already waits for (the caller knows it; no re-arming needed)."""
        st.last_seq = seq
        if t > st.last_time:
            st.last_time = t
        st.stalled = False
        lg = self._log_ms
        if lg is None:
            lg = t
        if self._floor > lg:
            lg = self._floor
        if lg > st.last_log:
            st.last_log = lg
        if st.domain != self._domain:
            self._move(st)
        elif rearm:
            self._arm(st)
        self._dirty.add(st.key)

    def _move(self, st: Stream) -> None:
        """``st``'s events now come from the current log (or did not come from any yet)."""
        self._leave(st)
        st.domain = self._domain
        self._in_domain.setdefault(st.domain, {})[st.key] = st
        self._arm(st)

    def _arm(self, st: Stream) -> None:
        """Its log's next-due time is not after ``st``'s earliest possible timer."""
        if st.last_log < 0:
            return
        stall, evict = st.rules.stall_after_ms, self.evict_idle_ms
        due = st.last_log + (stall if evict is None or stall < evict else evict)
        cur = self._due.get(st.domain)
        if cur is None or due < cur:
            self._due[st.domain] = due

    def _leave(self, st: Stream) -> None:
        """``st`` no longer counts among its log's streams."""
        members = self._in_domain.get(st.domain)
        if members is not None and members.get(st.key) is st:
            del members[st.key]
            if not members:
                del self._in_domain[st.domain]
