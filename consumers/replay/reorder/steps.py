"""The reorder core's transition steps that its fast paths and its full transition
(:meth:`.machine.ReorderCore._slow`) share or that only the full one needs: an event accepted
(:meth:`Steps._touch`), buffered beyond the next expected seq (:meth:`Steps._buffer`), an
episode's last seq set (:meth:`Steps._set_stop`), the sandbox-level events (recycle, drained
final seqs), and the dead letters and late events of refused ones.

:class:`Steps` is the part of the machine (:class:`.machine.ReorderCore`) that does them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .episode import EpisodeState
from .events import DeadLetterOut, InEvent, LateOut, Origin, Output
from .timers import TIMER_RECYCLE, TIMER_SANDBOX


class Steps:
    """Transition steps over the machine's state."""

    # the machine's state this part reads and writes (set up by ReorderCore.__init__)
    _c: dict[str, int]
    _eps: dict[tuple[str, str], EpisodeState]
    _dirty_eps: set[EpisodeState]
    _buffered: int
    _buffered_bytes: int
    _now: int
    _recycled: dict[str, int]
    _grace: int
    _ttl: int
    _by_sandbox: dict[str, set[str]]
    _dirty: set[tuple[str, str | None]]

    if TYPE_CHECKING:  # held admission's, emission's and the timers'
        def _hold_drained(self, ev: InEvent) -> InEvent: ...

        def _unbuffer(self, ep: EpisodeState, n: int) -> None: ...

        def _emit(self, ep: EpisodeState, out: list[Output], events: list[bytes],
                  gap: tuple[int, int] | None, last: bool, t: int,
                  first_seq: int | None = None) -> None: ...

        def _arm_gap(self, ep: EpisodeState) -> None: ...

        def _close(self, ep: EpisodeState) -> None: ...

        def _push_timer(self, deadline: int, kind: int, key: tuple[str, str]) -> None: ...

    def _dl(self, ev: InEvent, code: str, reason: str, other: bytes | None = None,
            origin: Origin | None = None) -> DeadLetterOut:
        self._c["dead_letters"] += 1
        seq = getattr(ev, "seq", -1)
        raw = getattr(ev, "raw", b"")
        episode = getattr(ev, "episode", None)
        return DeadLetterOut(
            code, reason, bytes(raw) if isinstance(raw, bytes | bytearray) else b"",
            str(getattr(ev, "task", "")), str(getattr(ev, "sandbox", "")),
            episode if isinstance(episode, str) else None, seq if type(seq) is int else -1,
            other, origin)

    def _late(self, ep: EpisodeState, seq: int, raw: bytes, code: str) -> LateOut:
        self._c["late"] += 1
        return LateOut(ep.task, ep.sandbox, ep.episode, seq, raw, code)


    def _emitted_conflict(self, ev: InEvent, out: list[Output], detail: str) -> None:
        """``ev`` repeats an emitted seq with other content (``detail``: how that is known):
        a ``conflicting_duplicate`` dead letter; the emitted version stays."""
        self._c["conflicts"] += 1
        out.append(self._dl(ev, "conflicting_duplicate",
                            f"seq {ev.seq} was already emitted with different content "
                            f"({detail}); the kept version is in the episode's replay "
                            "segments"))

    def _sandbox_event(self, ev: InEvent, out: list[Output]) -> None:
        sb = ev.sandbox
        if ev.state == "RECYCLED":
            if sb in self._recycled:
                return
            self._c["recycled"] += 1
            dl = self._now + self._grace
            self._recycled[sb] = dl
            self._dirty.add((sb, None))
            self._push_timer(dl + self._ttl, TIMER_SANDBOX, (sb, ""))
            for episode in sorted(self._by_sandbox.get(sb, ())):
                rec = self._eps[(sb, episode)]
                if rec.recycle_at < 0:
                    rec.recycle_at = dl
                    self._dirty_eps.add(rec)
                    self._push_timer(dl, TIMER_RECYCLE, rec.key)
        elif ev.kind == "Drained" and ev.final_seqs:
            ev = self._hold_drained(ev)
            for episode, final in sorted(ev.final_seqs):
                ep = self._eps.get((sb, episode))
                if ep is None or ep.closed or ep.end_seq >= 0 or type(final) is not int:
                    continue
                if final < ep.next_seq - 1 or ep.final_seq >= 0:
                    continue  # contradicts what was emitted, or already known: first wins
                ep.final_seq = final
                self._dirty_eps.add(ep)
                self._set_stop(ep, final, out)
                if ep.next_seq > final and not ep.buf:
                    self._emit(ep, out, [], None, True, ep.last_time)
                    self._close(ep)
        else:
            self._c["ignored"] += 1

    def _set_stop(self, ep: EpisodeState, stop: int, out: list[Output]) -> None:
        ep.stop = stop
        ep.expect = -1
        buf = ep.buf
        if buf:
            for s in sorted(k for k in buf if k > stop):
                raw, _, _ = buf.pop(s)
                self._unbuffer(ep, len(raw))
                self._c["dead_letters"] += 1
                out.append(DeadLetterOut("seq_after_end", f"seq {s} after the last seq {stop}",
                                         raw, ep.task, ep.sandbox, ep.episode, s))
            if not buf:
                ep.buf = None
                ep.gap_since = -1

    def _touch(self, ep: EpisodeState) -> None:
        """An event of the episode is accepted at the arrival time ``_now``: its idle clock
        moves there (never backwards: log times of two topics interleave) and its state is
        changed."""
        if self._now > ep.active:
            ep.active = self._now
        self._dirty_eps.add(ep)

    def _buffer(self, ep: EpisodeState, seq: int, raw: bytes, digest: int, t: int) -> None:
        """Keep an event beyond next_seq until its predecessors arrive; the first one buffered
        stalls the episode (its stall timer starts)."""
        buf = ep.buf
        if buf is None:
            buf = ep.buf = {}
            ep.expect = -1
            self._arm_gap(ep)
        buf[seq] = (raw, digest, t)
        n = len(raw)
        ep.buf_bytes += n
        self._buffered += 1
        self._buffered_bytes += n
