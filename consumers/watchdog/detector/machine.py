"""The loop and stall detector: :class:`WatchdogCore`, the façade over its parts (its rules
are the docstring of :mod:`trajbus.consumers.watchdog.core`, the import path to use).

The tool events (ToolCall, ToolResult: nearly every event) are handled here, in one method
(the hot path); the parts it shares with the other events are :class:`.timers.LogTimers`
(time per log, the timers and :meth:`~.timers.LogTimers._touch`, the step every accepted
event takes), :class:`.tracking.Tracking` (opening, ending and loading streams; the other
events' handlers) and :class:`.loops.LoopRule` (windows, patterns and alerts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trajbus.bus.settings import WatchdogSettings

from ..canonical import CanonicalError
from .explain import Explanation
from .inputs import Invalid, dead_letter, diagnose, fromhex, opaque
from .loops import LoopRule
from .outputs import (
    DeadLetterOut,
    Output,
    state_key,
)
from .rules import LoopRules
from .stream import (
    BROKEN,
    CHANGED,
    R_AFP,
    R_CID,
    R_RFP,
    R_SEQ,
    R_TIME,
    RS,
    START,
    W_CHG,
    W_CODE,
    W_SEQ,
    W_TIME,
    Stream,
    dump_stream,
)
from .timers import LogTimers
from .tracking import Tracking

_STATUS_PREFIX = {"OK": b"", "ERROR": b"E", "TIMEOUT": b"T"}


class WatchdogCore(LoopRule, LogTimers, Tracking):
    """Loop and stall detector. Its exact rules: :mod:`trajbus.consumers.watchdog.core`.

    ``settings``: global thresholds (default ``WatchdogSettings()``); ``per_task``: task name ->
    overrides keyed like :class:`~trajbus.bus.settings.WatchdogSettings` fields (unknown keys
    raise ``ValueError`` here, at construction). ``trust_canonical``: see "Call identity".
    ``evict_idle_ms``: drop streams without any event for this long of their log's time
    (None: never; see "Time" in the core's docstring).
    """

    def __init__(
        self,
        settings: WatchdogSettings | None = None,
        per_task: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        trust_canonical: bool = True,
        evict_idle_ms: int | None = 3_600_000,
    ) -> None:
        self.settings = settings if settings is not None else WatchdogSettings()
        self.default_rules = LoopRules.build(self.settings, None)
        self._task_rules: dict[str, LoopRules] = {
            task: LoopRules.build(self.settings, ov) for task, ov in (per_task or {}).items()
        }
        self.trust_canonical = trust_canonical
        self.evict_idle_ms = evict_idle_ms
        self._streams: dict[str, Stream] = {}
        self._by_sandbox: dict[str, Stream] = {}
        self._dirty: set[str] = set()
        self._tools: dict[str, str] = {}
        # time (see "Time" in the core's docstring): the log the next events are read from
        # and its record's log time (None: the events' own time, for callers without a log)
        self._domain = ""
        self._log_ms: int | None = None
        self._floor = -1  # that log's clock (-1: none yet): no event is timed before it
        self._clock: dict[str, int] = {}  # log -> latest log time read from it
        self._due: dict[str, int] = {}  # log -> no timer of its streams is due before this
        self._in_domain: dict[str, dict[str, Stream]] = {}  # log -> its streams by key

    # -- public API ---------------------------------------------------------------------------
    def rules_for(self, task: str) -> LoopRules:
        """Effective thresholds of a task."""
        return self._task_rules.get(task, self.default_rules)

    def handle(self, kind: str, record: Mapping[str, Any]) -> list[Output]:
        """Process one decoded event (``kind`` = Avro short name, ``record`` = its dict).
        Kinds other than ToolCall, ToolResult, EpisodeStart, EpisodeEnd, SandboxLifecycle and
        Tick only refresh the activity time of their stream. Never raises."""
        try:
            if kind == "ToolCall":
                return self._on_tool(record, True)
            if kind == "ToolResult":
                return self._on_tool(record, False)
            if kind == "EpisodeStart":
                return self._on_episode_start(record)
            if kind == "EpisodeEnd":
                return self._on_episode_end(record)
            if kind == "SandboxLifecycle":
                return self._on_lifecycle(record)
            if kind == "Tick":
                h = record["header"]
                t = h["event_time_ms"]
                if type(t) is not int:
                    raise Invalid("wrong_type", "header.event_time_ms must be an int")
                return self.tick(t)
            self._on_other(record)
            return []
        except Invalid as exc:
            return [dead_letter(kind, record, exc.code, exc.reason)]
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            code, reason = diagnose(kind, record)
            if code == "internal_error":
                reason = f"{type(exc).__name__}: {exc}"
            return [dead_letter(kind, record, code, reason)]
        except Exception as exc:  # a bug must not take the worker down
            return [dead_letter(kind, record, "internal_error", f"{type(exc).__name__}: {exc}")]

    def advance(self, log: str, log_ms: int) -> list[Output]:
        """A record of ``log`` written at ``log_ms`` (its Kafka timestamp) was read: that log's
        clock moves to it, and the timers of the streams it carries that are due by then fire
        (STALL, idle eviction; ordered by state key). The events :meth:`handle` gets next were
        carried by that record: they are timed by ``log_ms`` and belong to ``log``. The Kafka
        adapter calls this once per record, ``log`` = its topic and partition."""
        self._domain = log
        self._log_ms = log_ms if log_ms >= 0 else None
        clock = self._clock.get(log)
        if log_ms >= 0 and (clock is None or log_ms > clock):
            self._clock[log] = clock = log_ms
        self._floor = -1 if clock is None else clock
        if clock is None:
            return []
        due = self._due.get(log)
        if due is None or clock < due:
            return []
        found = self._timers(log, clock)
        found.sort(key=lambda kv: kv[0])
        return [o for _, outs in found for o in outs]

    def tick(self, now_ms: int) -> list[Output]:
        """Every log has reached ``now_ms``: the timers of every stream run (STALL alerts for
        streams with an open call and no event for their ``stall_after_ms``; idle eviction).
        Outputs are ordered by state key. For callers whose only log is the events themselves
        (time = event time); the Kafka adapter never calls it with the wall clock (see "Time"
        in the core's docstring)."""
        found: list[tuple[str, list[Output]]] = []
        for log in sorted(self._in_domain):
            clock = self._clock.get(log)
            if clock is None or now_ms > clock:
                self._clock[log] = clock = now_ms
            found.extend(self._timers(log, clock))
        self._floor = self._clock.get(self._domain, -1)
        found.sort(key=lambda kv: kv[0])
        return [o for _, outs in found for o in outs]

    def take_dirty(self) -> dict[str, bytes | None]:
        """State changed since the last call: key -> serialized state, or None if the stream
        was dropped. Sorted by key."""
        out: dict[str, bytes | None] = {}
        for key in sorted(self._dirty):
            st = self._streams.get(key)
            out[key] = None if st is None else dump_stream(st)
        self._dirty.clear()
        return out

    def snapshot(self) -> dict[str, bytes]:
        """Every tracked stream, serialized (for tests and full checkpoints)."""
        return {k: dump_stream(st) for k, st in sorted(self._streams.items())}

    def restore(self, key: str, blob: bytes | None) -> DeadLetterOut | None:
        """Load one stream's state from the changelog (``None`` deletes it). A corrupt blob is
        refused with a DeadLetterOut (and nothing changes); never raises."""
        if blob is None:
            st = self._streams.get(key)
            if st is not None:
                self._drop(st)
                self._dirty.discard(key)
            return None
        try:
            st = self._load(blob)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            return DeadLetterOut("bad_state", f"cannot restore {key!r}: {exc}", kind="state")
        if st.key != key:
            return DeadLetterOut("bad_state", f"state key {st.key!r} != {key!r}", kind="state")
        old = self._streams.get(key)
        if old is not None:
            self._drop(old)
        self._add(st)
        self._dirty.discard(key)
        return None

    def tracked(self) -> int:
        """Number of tracked streams."""
        return len(self._streams)

    def explain(self, sandbox: str, episode: str | None = None) -> list[Explanation]:
        """Why the loop rule fired or not, for every tracked stream of ``sandbox`` (or one
        episode), ordered by state key."""
        out = []
        st = self._by_sandbox.get(sandbox)
        while st is not None:
            if episode is None or st.episode == episode:
                out.append(self._explain(st))
            st = st.sb_next
        out.sort(key=lambda e: state_key(e.sandbox, e.episode))
        return out

    # -- event handlers -----------------------------------------------------------------------
    def _on_tool(self, rec: Mapping[str, Any], call: bool) -> list[Output]:
        """ToolCall (``call``) or ToolResult. One shared prologue -- read and type-check the
        header and the four kind-specific fields (``call_id``; ``tool``/``status``; the hash;
        the optional canonical text), drop duplicates, compute the fingerprint, create and
        touch the stream; nothing is mutated before every check passed, so a refused event
        leaves no trace -- then the call or the result rule. One method, not a helper that
        returns a tuple: on this hot path the extra call plus tuple per event measured a few
        percent slower (paired runs against the two inline copies), this form at parity."""
        h = rec["header"]
        task = h["task"]
        sandbox = h["sandbox"]
        episode = h.get("episode")
        seq = h["seq"]
        t = h["event_time_ms"]
        event_id = h["event_id"]
        cid = rec["call_id"]
        if call:
            name = rec["tool"]
            fhash = rec["args_hash"]
            canon = rec.get("args_canonical")
        else:
            name = rec["status"]
            fhash = rec["result_hash"]
            canon = rec.get("result_canonical")
        if (type(seq) is not int or type(t) is not int or seq < 0 or type(cid) is not str
                or type(name) is not str or type(fhash) is not str
                or (canon is not None and type(canon) is not str)
                or type(sandbox) is not str or type(task) is not str
                or type(event_id) is not str
                or (episode is not None and type(episode) is not str)):
            raise TypeError("field check")
        key = sandbox if episode is None else f"{sandbox}\x1f{episode}"
        st = self._streams.get(key)
        if st is not None:
            if seq <= st.last_seq:
                return []
            rules = st.rules
        else:
            rules = self._task_rules.get(task, self.default_rules)
        # fingerprint (may refuse the event: still nothing mutated)
        if canon is not None and (not self.trust_canonical or (
                rules.detect is not None and rules.detect(canon) is not None)):
            fp = self._fp_text(rules, canon, "args" if call else "result")
        else:
            try:
                fp = fromhex(fhash)
            except ValueError:
                fp = opaque(fhash)
        if st is None:
            st = self._new(key, task, sandbox, episode)
            self._touch(st, seq, t)
        else:  # only a call may open the stall timer, and a stalled stream's re-arms it
            self._touch(st, seq, t, call or st.stalled)
        ring = st.ring
        win = st.win
        n = st.n
        r = rules.ring_len
        outs: list[Output] = []

        if call:  # -- ToolCall: ring slot, windows, loop rule
            tool = self._tools.get(name) or self._intern(name)
            matched = False  # no window grew: nothing can fire
            if n == 0:
                for _length, off, _ in rules.cycles:
                    win[off] = (0, seq, t, 0, START)
            else:
                for length, off, _ in rules.cycles:
                    if n < length:
                        break
                    j = ((n - length) % r) * RS
                    prev_fp = ring[j + R_AFP]
                    if prev_fp == fp and ring[j] == tool:
                        fp = prev_fp  # share one object per distinct call (memory)
                        matched = True
                        continue
                    # the call breaks this cycle length's window: restart it at the last L
                    if st.loop_len == length:
                        outs.append(self._loop_ended(
                            st, length, off, n - 1, seq, t, event_id,
                            f"pattern broken by {tool}:{fp.hex()} at seq {seq}"))
                    s = n - length + 1
                    b = (s % r) * RS
                    if s == n or ring[b + R_SEQ] is None:  # (a call before a restore into a
                        # larger ring is not remembered: the window starts at this one)
                        win[off] = (n, seq, t, 0, BROKEN)
                    else:
                        win[off] = (s, ring[b + R_SEQ], ring[b + R_TIME], 0, BROKEN)
            slot = (n % r) * RS
            if ring[slot + R_CID] is not None:
                st.open_old += 1
            ring[slot] = tool
            ring[slot + R_AFP] = fp
            ring[slot + R_SEQ] = seq
            ring[slot + R_TIME] = t
            ring[slot + R_RFP] = None
            ring[slot + R_CID] = cid
            st.n = n + 1
            if matched and st.loop_len == 0:
                self._fire_first(st, n + 1, seq, t, event_id, outs)
            return outs

        # -- ToolResult: close the call, result changes, loop rule
        if name != "OK":
            prefix = _STATUS_PREFIX.get(name)
            fp = (prefix if prefix is not None
                  else name.encode("utf-8", "surrogatepass") + b"\x00") + fp
        for i in range(r):
            if ring[i * RS + R_CID] == cid:
                break
        else:
            if st.open_old:
                st.open_old -= 1
            return outs
        b = i * RS
        ring[b + R_RFP] = fp
        ring[b + R_CID] = None
        j = n - 1 - ((n - 1 - i) % r)  # call index of slot i
        lo = n - r  # oldest call index still in the ring
        for length, off, _ in rules.cycles:
            s = win[off][0]
            if j < s:
                continue
            # the same cycle position one cycle earlier...
            k = j - length
            if k >= s and k >= lo:
                other = ring[(k % r) * RS + R_RFP]
                if other is not None:
                    if other == fp:
                        fp = ring[b + R_RFP] = other  # share one object per distinct result
                    else:
                        self._result_changed(st, length, off, j, seq, t, event_id, outs)
            # ...and one cycle later (results may arrive out of order)
            k = j + length
            if k < n:
                other = ring[(k % r) * RS + R_RFP]
                if other is not None and other != fp and win[off][0] <= j:
                    self._result_changed(st, length, off, k, seq, t, event_id, outs)
        if st.loop_len == 0:
            self._fire_first(st, n, seq, t, event_id, outs)
        return outs

    def _result_changed(self, st: Stream, length: int, off: int, at: int, seq: int, t: int,
                        event_id: str, outs: list[Output]) -> None:
        """Call ``at`` returned something else than the same position one cycle before."""
        win = st.win
        w = win[off]
        changes = w[W_CHG] + 1
        if changes <= st.rules.loop_max_distinct_results:
            win[off] = (w[0], w[W_SEQ], w[W_TIME], changes, w[W_CODE])
            return
        ring = st.ring
        r = st.rules.ring_len
        b = (at % r) * RS
        if st.loop_len == length:
            outs.append(self._loop_ended(
                st, length, off, st.n - 1, seq, t, event_id,
                f"result changed at seq {seq} (call seq {ring[b + R_SEQ]})", changes=changes))
        win[off] = (at, ring[b + R_SEQ], ring[b + R_TIME], 0, CHANGED)

    def _fp_text(self, rules: LoopRules, text: str, what: str) -> bytes:
        c = rules.canon
        try:
            return c.digest_canonical(text) if self.trust_canonical else c.digest(text)
        except CanonicalError as exc:
            raise Invalid(f"bad_{what}_canonical", f"{what}_canonical: {exc}") from None
