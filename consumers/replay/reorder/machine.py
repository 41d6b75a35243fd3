"""The reorder state machine: :class:`ReorderCore` (its guarantees are the docstring of
:mod:`trajbus.consumers.replay.core`, the import path to use).

Every event goes through one transition, :meth:`ReorderCore._slow`, except two shapes the
common case consists of, which :meth:`ReorderCore.handle` takes directly with the same
effect: the next expected event of an open episode with nothing buffered (the fast path)
and a plain event that starts, extends or releases an open episode's buffer (the stall
path). Every place that computes a content digest is here. Its parts:
:class:`.admission.HeldAdmission` (held events), :class:`.emission.Emission` (segments, gaps,
closing), :class:`.timers.Deadlines` (timers), :class:`.steps.Steps` (the transition steps
the paths share, sandbox-level events) and :class:`.persistence.Persistence` (changelog
records out and in, in :mod:`.codec`'s format).
"""

from __future__ import annotations

import heapq
from typing import Any

from trajbus.bus.settings import ReplaySettings

from .admission import HeldAdmission
from .emission import Emission
from .episode import (
    GAP_MARK,
    HISTORY_MAX,
    EpisodeState,
    h16,
    remember,
)
from .events import (
    DeadLetterOut,
    Held,
    InEvent,
    LateOut,
    Output,
    SegmentOut,
    content_digest,
)
from .persistence import Persistence
from .steps import Steps
from .timers import (
    NEVER,
    TIMER_IDLE,
    TIMER_RECYCLE,
    Deadlines,
)

_tnew = tuple.__new__


def _classify(ev: object) -> str:
    """Reason code for an event that made processing raise."""
    if (
        not isinstance(ev, InEvent)
        or type(ev.seq) is not int
        or type(ev.event_time_ms) is not int
        or not isinstance(ev.sandbox, str)
        or not isinstance(ev.episode, str | None)
        or not isinstance(ev.raw, bytes)
    ):
        return "invalid_event"
    return "internal_error"


class ReorderCore(HeldAdmission, Emission, Deadlines, Steps, Persistence):
    """Pure reorder state machine for one input partition (its guarantees:
    :mod:`trajbus.consumers.replay.core`)."""

    def __init__(
        self,
        settings: ReplaySettings,
        *,
        max_segment_events: int | None = None,
        max_segment_bytes: int | None = None,
        max_buffered_bytes_per_episode: int | None = None,
        dedupe_window: int | None = None,
        tombstone_ttl_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        recycle_grace_ms: int | None = None,
        event_time_clock: bool = True,
    ) -> None:
        def opt(value: int | None, name: str, default: int | None) -> int | None:
            if value is not None:
                return value
            got = getattr(settings, name, None)
            return default if got is None else int(got)

        self._timeout = int(settings.gap_timeout_ms)
        self._max_ep = int(settings.max_buffered_per_episode)
        self._max_total = int(settings.max_buffered_total)
        self._max_ep_bytes = opt(max_buffered_bytes_per_episode,
                                 "max_buffered_bytes_per_episode", 4 * 1024 * 1024) or 0
        self._seg_events = opt(max_segment_events, "max_segment_events", 1024) or 1
        self._seg_bytes = opt(max_segment_bytes, "max_segment_bytes", 4 * 1024 * 1024) or 1
        self._w = max(1, opt(dedupe_window, "dedupe_window", 64) or 1)
        self._ttl = opt(tombstone_ttl_ms, "tombstone_ttl_ms", 60 * self._timeout) or 0
        self._idle = opt(idle_timeout_ms, "idle_timeout_ms", None)
        self._grace = opt(recycle_grace_ms, "recycle_grace_ms", self._timeout) or 0
        self._max_open = opt(None, "max_open_episodes_per_sandbox", None) or 0  # 0: no limit

        # False: only tick() moves the clock (processing time, ticks logged by the shell), so
        # a producer whose clock runs ahead cannot time out other episodes' gaps.
        self._event_clock = event_time_clock
        self._clock = 0
        self._now = 0  # arrival time of the event being handled (the clock during ticks)
        self._persisted_clock = 0
        self._eps: dict[tuple[str, str], EpisodeState] = {}
        self._by_sandbox: dict[str, set[str]] = {}
        self._recycled: dict[str, int] = {}  # sandbox -> grace deadline
        self._gap_heap: list[tuple[int, tuple[str, str]]] = []
        self._timers: list[tuple[int, int, tuple[str, str]]] = []
        self._dirty: set[tuple[str, str | None]] = set()  # deleted eps, recycled sandboxes
        self._dirty_eps: set[EpisodeState] = set()
        self._next_due = NEVER  # lower bound of the earliest timer/gap deadline
        self._restored: set[tuple[str, str]] = set()  # keys whose timers are not armed yet
        self._held: dict[str, list[Held]] = {}  # sandbox -> events held for the limit
        # sandbox -> {episode with held events: the arrival its events are judged at}
        self._held_eps: dict[str, dict[str, int]] = {}
        self._held_bytes: dict[str, int] = {}  # sandbox -> its held events' changelog bytes
        self._held_total = 0
        self._dirty_held: set[str] = set()
        self._restored_held: set[str] = set()
        self._judging = False
        self._buffered = 0
        self._buffered_bytes = 0
        self._c = dict.fromkeys(
            (
                "events", "segments", "duplicates", "duplicates_unverified", "conflicts",
                "gaps", "gap_seqs", "forced_gap_closes", "late", "dead_letters",
                "episodes_opened", "episodes_closed", "episodes_truncated", "recycled",
                "idle_truncated", "ignored", "episodes_refused", "held_events",
            ),
            0,
        )
        self._n_fast = 0

    # -- public API ------------------------------------------------------------------------
    @property
    def clock_ms(self) -> int:
        return self._clock

    def handle(self, ev: InEvent, origin: tuple[Any, ...] | None = None) -> list[Output]:
        """Process one event; returns outputs in emission order. Never raises.

        ``origin``: the event's source record, a tuple whose first four items are its topic,
        partition, offset and key (the shell's record tuple); kept with an event held for the
        per-sandbox limit, for its dead letter."""
        if self._restored or self._restored_held:
            self._arm_restored()
        try:
            _, sandbox, episode, seq, t, kind, raw, outcome, _, _, log_t = ev
            if type(t) is int:
                if t > self._clock and self._event_clock:
                    self._clock = t
                clock = self._clock
                # the arrival time (the core's docstring); a non-int log time raises below and
                # the event becomes a dead letter
                now = log_t if log_t > clock else clock
                ep = self._eps.get((sandbox, episode))  # type: ignore[arg-type]
                # Fast path: the next expected event of an open episode with nothing buffered
                # (expect is -1 otherwise: a seq of -1 must not match it). It is _slow's
                # seq == next_seq transition (_touch, then _drain of one event) written out for
                # an empty buffer, inline: the calls cost the in-order rate (bench/ANALYSIS.md).
                if (
                    ep is not None
                    and seq == ep.expect >= 0
                    and outcome is None
                    and kind != "EpisodeStart"
                ):
                    # kept for the dedupe window (raises -> dead letter if raw is no bytes)
                    dig = ep.ring[seq % self._w] = content_digest(raw)
                    hist = ep.hist
                    if ep.hist_base + len(hist) == seq and len(hist) < HISTORY_MAX:
                        hist.append((dig & 0xFFFF) or 1)
                    else:
                        remember(ep, seq, (dig & 0xFFFF) or 1)
                    ep.next_seq = ep.expect = seq + 1
                    idx = ep.seg_index
                    ep.seg_index = idx + 1
                    ep.last_time = t
                    if now > ep.active:  # never backwards: log times of two topics interleave
                        ep.active = now
                    self._dirty_eps.add(ep)
                    self._n_fast += 1
                    out: list[Output] = [
                        _tnew(SegmentOut, (ep.task, sandbox, episode, idx, seq, seq, [raw],
                                           None, idx == 0, False, False, t))
                    ]
                    if self._clock >= self._next_due:
                        self._fire(out)
                    return out
                # Stall path: a plain event beyond the next expected seq of an open episode with
                # no known last seq (it starts or extends the buffer), or the missing seq of a
                # stalled one (it releases what is contiguous): _slow's transitions (_touch,
                # _drain, _buffer) without its checks that cannot fail here; anything unusual
                # (duplicates, bounds reached, ends, odd types) still goes through _slow.
                if (
                    ep is not None
                    and outcome is None
                    and type(seq) is int
                    and seq >= ep.next_seq
                    and ep.stop < 0
                    and (ep.buf is not None or ep.expect >= 0)  # open (not closed)
                    and kind != "EpisodeStart"
                    and kind != "EpisodeEnd"
                    and type(raw) is bytes
                ):
                    buf = ep.buf
                    self._now = now  # the drain / buffer below may (re)arm a stall timer
                    if seq == ep.next_seq:  # (buf is not None: else the fast path took it)
                        self._c["events"] += 1
                        self._touch(ep)
                        out = []
                        self._drain(ep, out, None, (raw, content_digest(raw), t))
                        if self._clock >= self._next_due:
                            self._fire(out)
                        return out
                    if (
                        (buf is None or seq not in buf)
                        and (0 if buf is None else len(buf)) < self._max_ep
                        and ep.buf_bytes + len(raw) <= self._max_ep_bytes
                        and self._buffered < self._max_total
                    ):  # buffer it (no bound is reached: nothing to force-close)
                        self._c["events"] += 1
                        self._touch(ep)
                        self._buffer(ep, seq, raw, content_digest(raw), t)
                        out = []
                        if self._clock >= self._next_due:
                            self._fire(out)
                        return out
                self._now = now
            else:
                ep = None
                self._now = self._clock
            out = []
            self._slow(ev, ep, out, origin)
            if self._clock >= self._next_due:
                self._fire(out)
            return out
        except Exception as exc:  # garbage input or a bug must not take the partition down
            return [self._dl(ev, _classify(ev), f"{type(exc).__name__}: {exc}")]

    def tick(self, now_ms: int) -> list[Output]:
        """Advance the clock to ``now_ms`` (never backwards) and fire due timeouts."""
        out: list[Output] = []
        if self._restored or self._restored_held:
            self._arm_restored()
        if now_ms > self._clock:
            self._clock = now_ms
        self._now = self._clock
        try:
            self._fire(out)
        except Exception as exc:  # pragma: no cover - defensive
            out.append(DeadLetterOut("internal_error", f"tick: {type(exc).__name__}: {exc}",
                                     b"", "", "", None, -1))
        return out

    def counters(self) -> dict[str, int]:
        """Metrics: monotonically increasing counts plus current gauges."""
        c = dict(self._c)
        c["events"] += self._n_fast
        c["segments"] += self._n_fast
        open_eps = sum(1 for e in self._eps.values() if not e.closed)
        c["episodes_open"] = open_eps
        c["tombstones"] = len(self._eps) - open_eps
        c["buffered"] = self._buffered
        c["buffered_bytes"] = self._buffered_bytes
        c["recycled_sandboxes"] = len(self._recycled)
        c["held"] = self._held_total
        return c

    # -- event processing ------------------------------------------------------------------
    def _slow(self, ev: InEvent, ep: EpisodeState | None, out: list[Output],
              origin: tuple[Any, ...] | None = None) -> None:
        c = self._c
        c["events"] += 1
        if not isinstance(ev.sandbox, str) or not ev.sandbox:
            out.append(self._dl(ev, "missing_sandbox", "event has no sandbox id"))
            return
        if not isinstance(ev.raw, bytes):
            out.append(self._dl(ev, "invalid_event", "raw must be bytes"))
            return
        if type(ev.event_time_ms) is not int:
            out.append(self._dl(ev, "invalid_event", f"bad event time {ev.event_time_ms!r}"))
            return
        if ev.episode is None:
            self._sandbox_event(ev, out)
            return
        if not isinstance(ev.episode, str) or not ev.episode:
            out.append(self._dl(ev, "missing_episode", f"{ev.kind}: empty episode id"))
            return
        seq = ev.seq
        if type(seq) is not int or seq < 0:
            out.append(self._dl(ev, "invalid_seq", f"{ev.kind}: invalid seq {seq!r}"))
            return
        if ev.kind == "EpisodeStart" and seq != 0:
            out.append(self._dl(ev, "bad_start_seq", f"EpisodeStart with seq {seq} (must be 0)"))
            return
        if ev.kind == "EpisodeEnd" and seq == 0:  # seq 0 is the EpisodeStart's
            out.append(self._dl(ev, "bad_start_seq", "EpisodeEnd at seq 0: the episode ends "
                                "before it starts"))
            return
        is_end = ev.outcome is not None
        if ev.kind == "EpisodeEnd" and not is_end:
            out.append(self._dl(ev, "missing_outcome", "EpisodeEnd without outcome"))
            return
        if ep is None:
            dl = self._recycled.get(ev.sandbox)
            # a held event is judged as on arrival: against the deadline, not today's clock
            if dl is not None and (self._now if self._judging else self._clock) >= dl:
                self._c["late"] += 1
                out.append(LateOut(ev.task, ev.sandbox, ev.episode, seq, ev.raw,
                                   "sandbox_recycled"))
                return
            if self._max_open and ev.episode is not None:
                open_eps = self._by_sandbox.get(ev.sandbox, ())
                n_open = len(open_eps) - (None in open_eps)
                held_eps = self._held_eps.get(ev.sandbox)
                # held events of the sandbox come first (in log time): hold behind them
                if (n_open >= self._max_open or held_eps) and self._hold(ev, origin):
                    c["events"] -= 1  # counted when judged
                    return
                if n_open >= self._max_open:
                    c["episodes_refused"] += 1
                    out.append(self._dl(ev, "too_many_open_episodes", (
                        f"sandbox {ev.sandbox} already has {n_open} open episodes; "
                        f"{ev.episode} would exceed replay.max_open_episodes_per_sandbox="
                        f"{self._max_open}"),
                        origin=None if origin is None else (*origin[:4], ev.log_time_ms)))
                    return
            ep = EpisodeState(ev.task, ev.sandbox, ev.episode, self._now, ev.event_time_ms, self._w)
            self._eps[ep.key] = ep
            self._by_sandbox.setdefault(ep.sandbox, set()).add(ep.episode)
            c["episodes_opened"] += 1
            if dl is not None:
                ep.recycle_at = dl
                self._push_timer(dl, TIMER_RECYCLE, ep.key)
            if self._idle is not None:
                self._push_timer(self._now + self._idle, TIMER_IDLE, ep.key)
        ns = ep.next_seq
        if seq < ns:
            self._old_seq(ep, ev, seq, out)
            return
        if ep.closed:  # a truncated episode (an ended one has stop < ns)
            if ep.stop >= 0 and seq > ep.stop:
                out.append(self._dl(ev, "seq_after_end",
                                    f"seq {seq} after the episode's last seq {ep.stop}"))
            else:
                out.append(self._late(ep, seq, ev.raw, "after_close"))
            return
        if ep.stop >= 0 and seq > ep.stop:
            what = "EpisodeEnd" if ep.end_seq >= 0 else "drained final seq"
            out.append(self._dl(ev, "seq_after_end", f"seq {seq} after the {what} at {ep.stop}"))
            return
        self._touch(ep)
        if is_end:
            if ep.end_seq >= 0 and seq != ep.end_seq:
                out.append(self._dl(ev, "conflicting_end",
                                    f"EpisodeEnd at seq {seq}, but the end is seq {ep.end_seq}"))
                return
            if ep.end_seq < 0:
                ep.end_seq = seq
                ep.terminal = ev.outcome == "TERMINAL"
                self._set_stop(ep, seq, out)
        if seq == ns:
            self._drain(ep, out, None, (ev.raw, content_digest(ev.raw), ev.event_time_ms))
            return
        buf = ep.buf
        digest = content_digest(ev.raw)  # kept with it, or compared with the buffered one
        have = None if buf is None else buf.get(seq)
        if have is not None:
            if have[1] == digest:
                c["duplicates"] += 1
            else:
                c["conflicts"] += 1
                out.append(self._dl(ev, "conflicting_duplicate",
                                    f"seq {seq} already buffered with different content",
                                    have[0]))
            return
        self._buffer(ep, seq, ev.raw, digest, ev.event_time_ms)
        while ep.buf and (len(ep.buf) > self._max_ep or ep.buf_bytes > self._max_ep_bytes):
            c["forced_gap_closes"] += 1
            self._close_gap(ep, out)
        while self._buffered > self._max_total and self._gap_heap:
            deadline, key = heapq.heappop(self._gap_heap)
            victim = self._eps.get(key)
            if victim is not None and self._gap_valid(victim, deadline):
                c["forced_gap_closes"] += 1
                self._close_gap(victim, out)



    def _old_seq(self, ep: EpisodeState, ev: InEvent, seq: int, out: list[Output]) -> None:
        """A seq below next_seq: an emitted duplicate, or late for a closed gap."""
        if ep.next_seq - seq <= self._w:
            have = ep.ring[seq % self._w]
            if have == GAP_MARK:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
            digest = content_digest(ev.raw)
            if have == digest:
                self._c["duplicates"] += 1
            else:
                self._emitted_conflict(ev, out, f"digest {have:016x}, this one {digest:016x}")
            return
        for lo, hi in ep.gaps:
            if lo <= seq <= hi:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
        i = seq - ep.hist_base
        if 0 <= i < len(ep.hist):  # older than the window: its 16-bit digest
            h = ep.hist[i]
            if h == 0:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
            mine = h16(content_digest(ev.raw))
            if h == mine:
                self._c["duplicates"] += 1
            else:
                self._emitted_conflict(ev, out, (
                    f"{ep.next_seq - seq} seqs back, beyond the dedupe window of {self._w}: "
                    f"16-bit digest {h:04x}, this one {mine:04x}"))
            return
        self._c["duplicates_unverified"] += 1
        out.append(self._dl(ev, "unverified_duplicate",
                            f"seq {seq} was already emitted, {ep.next_seq - seq} seqs back: "
                            "older than the content history kept for the episode (from seq "
                            f"{ep.hist_base}), so it was not compared with the kept version "
                            "and is not used; the kept version is in the episode's replay "
                            "segments"))
