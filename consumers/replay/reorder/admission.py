"""Held admission for the per-sandbox episode limit: an event that would open one episode too
many while its arrival is still ahead of the clock is held, and judged in arrival order once
the clock reaches it (see "Per-sandbox limit" in :mod:`trajbus.consumers.replay.core`).

:class:`HeldAdmission` is the part of the machine (:class:`.machine.ReorderCore`) that
holds and judges; it keeps the held events, their per-episode arrivals and their changelog
bytes, and judges a held event with the machine's own ``_slow`` transition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .codec import HELD_OVERHEAD, packable
from .episode import EpisodeState
from .events import (
    DeadLetterOut,
    Held,
    InEvent,
    Origin,
    Output,
)
from .timers import NEVER, TIMER_HELD


class HeldAdmission:
    """The held events of every sandbox and the transitions that hold and judge them."""

    # the machine's state this part reads and writes (set up by ReorderCore.__init__)
    _clock: int
    _now: int
    _max_ep: int
    _max_ep_bytes: int
    _max_total: int
    _buffered: int
    _eps: dict[tuple[str, str], EpisodeState]
    _c: dict[str, int]
    _held: dict[str, list[Held]]
    _held_eps: dict[str, dict[str, int]]
    _held_bytes: dict[str, int]
    _held_total: int
    _dirty_held: set[str]
    _judging: bool

    if TYPE_CHECKING:  # the machine's full transition, the timers' queue
        def _slow(self, ev: InEvent, ep: EpisodeState | None, out: list[Output],
                  origin: tuple[Any, ...] | None = None) -> None: ...

        def _push_timer(self, deadline: int, kind: int, key: tuple[str, str]) -> None: ...

    def _hold(self, ev: InEvent, origin: tuple[Any, ...] | None) -> bool:
        """Hold an event that would open an episode beyond the sandbox's limit, or that comes
        after held events of its sandbox, while its arrival is ahead of the clock (module
        docstring, "Per-sandbox limit"). An event of an episode already held is judged with
        it: at the later of its own arrival and the episode's. False: judge it now (the clock
        has reached it, it is being judged, a bound on held events is reached, or it could
        not be persisted)."""
        if self._judging:
            return False
        sb = ev.sandbox
        eps = self._held_eps.get(sb)
        first = eps.get(ev.episode) if eps else None  # type: ignore[arg-type]
        at = self._now if first is None or first < self._now else first
        if at <= self._clock:
            return False
        held = self._held.get(sb)
        if (not packable(ev) or (held is not None and len(held) >= self._max_ep)
                or self._held_bytes.get(sb, 0) + len(ev.raw) + HELD_OVERHEAD
                > self._max_ep_bytes
                or self._buffered + self._held_total >= self._max_total):
            return False
        self._hold_entry(sb, at, ev, None if origin is None else
                         (origin[0], origin[1], origin[2], origin[3], ev.log_time_ms))
        return True

    def _hold_drained(self, ev: InEvent) -> InEvent:
        """A Drained's final seqs of held episodes are held too, judged after those
        episodes' events; returns the Drained with the rest, to apply now."""
        eps = self._held_eps.get(ev.sandbox)
        if not eps or self._judging or not packable(ev):
            return ev
        later = tuple(f for f in ev.final_seqs if f[0] in eps)
        if not later:
            return ev
        at = max(self._now, *(eps[episode] for episode, _ in later))
        self._hold_entry(ev.sandbox, at, ev._replace(final_seqs=later), None)
        return ev._replace(final_seqs=tuple(f for f in ev.final_seqs if f[0] not in eps))

    def _hold_entry(self, sb: str, at: int, ev: InEvent, origin: Origin | None) -> None:
        held = self._held.get(sb)
        if held is None:
            held = self._held[sb] = []
            self._held_eps[sb] = {}
            self._held_bytes[sb] = 0
        held.append((at, ev, origin))
        if ev.episode is not None:
            self._held_eps[sb].setdefault(ev.episode, at)
        self._held_bytes[sb] += len(ev.raw) + HELD_OVERHEAD
        self._held_total += 1
        self._c["held_events"] += 1
        self._dirty_held.add(sb)
        self._push_timer(at, TIMER_HELD, (sb, ""))

    def _judge(self, sb: str, out: list[Output]) -> None:
        """Judge the sandbox's held events the clock has reached, in arrival order (a stable
        sort: the order they were held in among equal arrivals)."""
        held = self._held.get(sb)
        if not held:
            return
        clock = self._clock
        # in arrival order, not the order they were held in: the lagging topic's records of
        # a held episode are held after the leading topic's records of later episodes
        due = sorted((h for h in held if h[0] <= clock), key=lambda h: h[0])
        if not due:
            return
        self._set_held(sb, [h for h in held if h[0] > clock])
        now = self._now
        self._judging = True
        try:
            for arrival, ev, origin in due:
                self._now = arrival
                n0 = len(out)
                if ev.episode is None:  # a Drained's held part: the event was counted
                    self._c["events"] -= 1
                self._slow(ev, self._eps.get((sb, ev.episode)), out, origin)  # type: ignore[arg-type]
                if origin is not None:  # its dead letters name its record, not the tick's
                    for i in range(n0, len(out)):
                        o = out[i]
                        if isinstance(o, DeadLetterOut) and o.origin is None and o.raw is ev.raw:
                            out[i] = o._replace(origin=origin)
        finally:
            self._judging = False
            self._now = now

    def _set_held(self, sb: str, held: list[Held] | None, dirty: bool = True) -> None:
        """Replace the sandbox's held events (None/empty: none)."""
        old = self._held.pop(sb, None)
        self._held_eps.pop(sb, None)
        self._held_bytes.pop(sb, None)
        if old:
            self._held_total -= len(old)
        if held:
            self._held[sb] = held
            eps: dict[str, int] = {}
            for at, ev, _ in held:
                if ev.episode is not None and at < eps.get(ev.episode, NEVER):
                    eps[ev.episode] = at
            self._held_eps[sb] = eps
            self._held_bytes[sb] = sum(len(h[1].raw) + HELD_OVERHEAD for h in held)
            self._held_total += len(held)
        if dirty:
            self._dirty_held.add(sb)
