"""The loop rule over one stream's ring and windows: a window's pattern, whether it fires
(LOOP alert and TERMINATE decision) or ends (LOOP_ENDED), the STALL alert, and the
explanation of a stream (see "Loop rule" and "Stall rule"
in :mod:`trajbus.consumers.watchdog.core`).

:class:`LoopRule` is the part of the detector (:class:`.machine.WatchdogCore`) that reads a
stream's windows; it keeps no state of its own."""

from __future__ import annotations

from .explain import CandidateExplanation, Explanation
from .outputs import AlertOut, DecisionOut, Output, output_event_id
from .stream import (
    R_AFP,
    R_CID,
    R_SEQ,
    R_TIME,
    RS,
    START_TEXT,
    W_CHG,
    W_CODE,
    W_SEQ,
    W_TIME,
    Stream,
)


class LoopRule:
    """Windows, patterns and the alerts they give; methods over a :class:`.stream.Stream`."""

    def _restart(self, st: Stream, length: int, off: int, s: int, code: int) -> None:
        """Restart window ``length`` at call ``s`` (which must be in the ring)."""
        win = st.win
        b = (s % st.rules.ring_len) * RS
        win[off] = (s, st.ring[b + R_SEQ], st.ring[b + R_TIME], 0, code)

    def _pattern(self, st: Stream, length: int, off: int, last: int) -> list[tuple[str, bytes]]:
        """Calls of the window's pattern (positions 0..L-1), from the ring; ``last`` = index of
        the newest call in the ring."""
        s = st.win[off][0]
        ring = st.ring
        m = st.rules.ring_len
        out = []
        for p in range(length):
            k = s + p
            if k > last:
                break
            k = last - ((last - k) % length)
            b = (k % m) * RS
            out.append((ring[b], ring[b + R_AFP]))
        return out

    @staticmethod
    def _primitive(pat: list[tuple[str, bytes]]) -> bool:
        n = len(pat)
        for d in range(1, n):
            if n % d == 0 and all(pat[i] == pat[i - d] for i in range(d, n)):
                return False
        return True

    def _maybe_fire(self, st: Stream, length: int, off: int, seq: int, t: int,
                    event_id: str) -> list[Output] | None:
        win = st.win
        rules = st.rules
        span = st.last_time - win[off][W_TIME]
        if span < rules.loop_min_span_ms or win[off][W_CHG] > rules.loop_max_distinct_results:
            return None
        pat = self._pattern(st, length, off, st.n - 1)
        if len(pat) < length or not self._primitive(pat):
            return None
        st.loop_len = length
        repeats = (st.n - win[off][0]) // length
        first_seq = win[off][W_SEQ]
        changes = win[off][W_CHG]
        pattern = tuple(f"{tool}:{afp.hex()}" for tool, afp in pat)
        dry = rules.dry_run
        alert_id = output_event_id("LOOP", st.sandbox, st.episode, first_seq, length)
        reason = (
            f"{length}-call cycle repeated {repeats} times in a row over {span} ms with "
            f"{changes} result change(s) (thresholds: >= {rules.loop_min_repeats} repeats, "
            f">= {rules.loop_min_span_ms} ms, <= {rules.loop_max_distinct_results} changes)"
        )
        outs: list[Output] = [AlertOut(
            alert="LOOP", task=st.task, sandbox=st.sandbox, episode=st.episode,
            pattern=pattern, repeat_count=repeats, span_ms=span, first_seq=first_seq,
            last_seq=seq, distinct_results=changes, dry_run=dry, reason=reason, seq=seq,
            event_time_ms=t, event_id=alert_id, cause_event_ids=(event_id,),
        )]
        if not dry:
            outs.append(DecisionOut(
                decision="TERMINATE", task=st.task, sandbox=st.sandbox, episode=st.episode,
                reason=f"watchdog loop: {reason}", suspicious=True,
                details={
                    "alert_event_id": alert_id,
                    "cycle_length": str(length),
                    "distinct_results": str(changes),
                    "episode": st.episode or "",
                    "first_seq": str(first_seq),
                    "last_seq": str(seq),
                    "pattern": " ".join(pattern),
                    "repeat_count": str(repeats),
                    "span_ms": str(span),
                },
                cause_event_ids=(event_id, alert_id), seq=seq, time_ms=t,
                event_id=output_event_id("TERMINATE", st.sandbox, st.episode, first_seq, length),
            ))
        return outs

    def _fire_first(self, st: Stream, calls: int, seq: int, t: int, event_id: str,
                    outs: list[Output]) -> None:
        """The loop rule after an event (``calls``: the calls its windows count to): the
        shortest cycle length whose window holds enough calls and fires adds its outputs to
        ``outs``; at most one fires."""
        win = st.win
        for length, off, need in st.rules.cycles:
            if calls - win[off][0] >= need:
                fired = self._maybe_fire(st, length, off, seq, t, event_id)
                if fired:
                    outs.extend(fired)
                    return

    def _loop_ended(self, st: Stream, length: int, off: int, last: int, seq: int, t: int,
                    event_id: str, why: str, changes: int | None = None) -> AlertOut:
        """LOOP_ENDED for the active loop; ``last`` = index of the newest call in the ring."""
        win = st.win
        first_seq = win[off][W_SEQ]
        pat = self._pattern(st, length, off, last)
        st.loop_len = 0
        return AlertOut(
            alert="LOOP_ENDED", task=st.task, sandbox=st.sandbox, episode=st.episode,
            pattern=tuple(f"{tool}:{afp.hex()}" for tool, afp in pat),
            repeat_count=(last + 1 - win[off][0]) // length,
            span_ms=max(t, st.last_time) - win[off][W_TIME], first_seq=first_seq,
            last_seq=seq, distinct_results=win[off][W_CHG] if changes is None else changes,
            dry_run=st.rules.dry_run, reason=f"loop ended: {why}", seq=seq, event_time_ms=t,
            event_id=output_event_id("LOOP_ENDED", st.sandbox, st.episode, first_seq, length),
            cause_event_ids=(event_id,) if event_id else (),
        )

    def _stall_alert(self, st: Stream, now_ms: int, idle: int) -> AlertOut:
        ring = st.ring
        m = st.rules.ring_len
        pattern: tuple[str, ...] = ()
        first_seq = -1
        for back in range(min(st.n, m)):  # newest open call in the ring
            b = ((st.n - 1 - back) % m) * RS
            if ring[b + R_CID] is not None:
                pattern = (f"{ring[b]}:{ring[b + R_AFP].hex()}",)
                first_seq = ring[b + R_SEQ]
                break
        return AlertOut(
            alert="STALL", task=st.task, sandbox=st.sandbox, episode=st.episode,
            pattern=pattern, repeat_count=0, span_ms=idle, first_seq=first_seq,
            last_seq=st.last_seq, distinct_results=0, dry_run=st.rules.dry_run,
            reason=(f"{self._open_calls(st)} open tool call(s) and no event for {idle} ms "
                    f"(threshold {st.rules.stall_after_ms} ms)"),
            seq=st.last_seq, event_time_ms=now_ms,
            event_id=output_event_id("STALL", st.sandbox, st.episode, st.last_seq, 0),
        )

    @staticmethod
    def _open_calls(st: Stream) -> int:
        ring = st.ring
        return st.open_old + sum(
            1 for i in range(st.rules.ring_len) if ring[i * RS + R_CID] is not None
        )

    def _explain(self, st: Stream) -> Explanation:
        rules = st.rules
        win = st.win
        cands = []
        for length, off, _ in rules.cycles:
            if st.n == 0 or win[off] is None:
                continue
            s = win[off][0]
            calls = st.n - s
            pat = self._pattern(st, length, off, st.n - 1)
            primitive = len(pat) == length and self._primitive(pat)
            repeats = calls // length
            span = st.last_time - win[off][W_TIME]
            changes = win[off][W_CHG]
            blockers = []
            if repeats < rules.loop_min_repeats:
                blockers.append(f"repeats {repeats} < {rules.loop_min_repeats}")
            if span < rules.loop_min_span_ms:
                blockers.append(f"span {span} ms < {rules.loop_min_span_ms} ms")
            if changes > rules.loop_max_distinct_results:
                blockers.append(
                    f"result changes {changes} > {rules.loop_max_distinct_results}")
            if len(pat) == length and not primitive:
                blockers.append("pattern repeats a shorter cycle (covered by that length)")
            if st.loop_len:
                blockers.append(
                    "loop already alerted" if st.loop_len == length
                    else f"a {st.loop_len}-call loop is active")
            code = win[off][W_CODE]
            cands.append(CandidateExplanation(
                cycle_length=length,
                pattern=tuple(f"{tool}:{afp.hex()}" for tool, afp in pat),
                calls=calls, repeat_count=repeats, span_ms=span,
                first_seq=win[off][W_SEQ], result_changes=changes, primitive=primitive,
                since=START_TEXT[code], blockers=tuple(blockers),
            ))
        return Explanation(
            task=st.task, sandbox=st.sandbox, episode=st.episode, rules=rules,
            last_seq=st.last_seq, last_event_time_ms=st.last_time, calls_seen=st.n,
            open_calls=self._open_calls(st), stalled=st.stalled, loop_active=bool(st.loop_len),
            loop_cycle_length=st.loop_len, candidates=tuple(cands),
        )
