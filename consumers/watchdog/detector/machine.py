"""The loop and stall detector: :class:`WatchdogCore` (its rules are the docstring of
:mod:`trajbus.consumers.watchdog.core`, the import path to use)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trajbus.bus.settings import MAX_CYCLE_LENGTH_LIMIT, WatchdogSettings

from ..canonical import CanonicalError
from .explain import Explanation
from .inputs import Invalid, diagnose, fromhex, opaque, read_header
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
    R_TOOL,
    RECONFIGURED,
    RS,
    START,
    W_CHG,
    W_CODE,
    W_SEQ,
    W_TIME,
    Stream,
    dump_stream,
    state_version,
)

_STATUS_PREFIX = {"OK": b"", "ERROR": b"E", "TIMEOUT": b"T"}
_END_KINDS = frozenset({"DRAINING", "RECYCLED"})
_MAX_INTERNED_TOOLS = 4096


class WatchdogCore(LoopRule):
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
            return [self._dead(kind, record, exc.code, exc.reason)]
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            code, reason = diagnose(kind, record)
            if code == "internal_error":
                reason = f"{type(exc).__name__}: {exc}"
            return [self._dead(kind, record, code, reason)]
        except Exception as exc:  # a bug must not take the worker down
            return [self._dead(kind, record, "internal_error", f"{type(exc).__name__}: {exc}")]

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
        fresh = st is None
        if st is None:
            st = self._new(key, task, sandbox, episode)
        self._dirty.add(key)
        st.last_seq = seq
        if t > st.last_time:
            st.last_time = t
        # its timers count again from max(its log's clock, the record's log time) (_seen,
        # inline: the hot path); a call may open the stall timer, a stalled one re-arms it
        lg = self._log_ms
        if lg is None:
            lg = t
        if self._floor > lg:
            lg = self._floor
        if lg > st.last_log:
            st.last_log = lg
        if st.domain != self._domain:
            self._move(st)
        elif call or fresh or st.stalled:
            self._arm(st)
        st.stalled = False
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
                calls = n + 1
                for length, off, need in rules.cycles:
                    if calls - win[off][0] >= need:
                        fired = self._maybe_fire(st, length, off, seq, t, event_id)
                        if fired:
                            outs.extend(fired)
                            break
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
            for length, off, need in rules.cycles:
                if n - win[off][0] >= need:
                    fired = self._maybe_fire(st, length, off, seq, t, event_id)
                    if fired:
                        outs.extend(fired)
                        break
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

    def _on_episode_start(self, rec: Mapping[str, Any]) -> list[Output]:
        task, sandbox, episode, seq, t, _ = read_header(rec)
        key = state_key(sandbox, episode)
        st = self._streams.get(key)
        if st is None:
            st = self._new(key, task, sandbox, episode)
        elif seq <= st.last_seq:
            return []
        self._touch(st, seq, t)
        return []

    def _on_episode_end(self, rec: Mapping[str, Any]) -> list[Output]:
        _, sandbox, episode, seq, t, event_id = read_header(rec)
        st = self._streams.get(state_key(sandbox, episode))
        if st is None or seq <= st.last_seq:
            return []
        if t > st.last_time:
            st.last_time = t
        return self._end_stream(st, seq, t, event_id, f"tracking ended: episode ended at seq {seq}")

    def _on_lifecycle(self, rec: Mapping[str, Any]) -> list[Output]:
        _, sandbox, _, seq, t, event_id = read_header(rec)
        state = rec["state"]
        if type(state) is not str:
            raise Invalid("wrong_type", "state must be a string")
        if state not in _END_KINDS:
            return []
        streams = []
        st = self._by_sandbox.get(sandbox)
        while st is not None:
            streams.append(st)
            st = st.sb_next
        streams.sort(key=lambda s: s.key)
        outs: list[Output] = []
        for st in streams:
            outs.extend(self._end_stream(
                st, st.last_seq, max(t, st.last_time), event_id,
                f"tracking ended: sandbox {state.lower()} (lifecycle seq {seq})"))
        return outs

    def _on_other(self, rec: Mapping[str, Any]) -> None:
        h = rec.get("header") if isinstance(rec, Mapping) else None
        if not isinstance(h, Mapping):
            return
        sandbox, episode, seq, t = (h.get("sandbox"), h.get("episode"), h.get("seq"),
                                    h.get("event_time_ms"))
        if (episode is None or type(sandbox) is not str or type(episode) is not str
                or type(seq) is not int or type(t) is not int):
            return
        st = self._streams.get(f"{sandbox}\x1f{episode}")
        if st is not None and seq > st.last_seq:
            self._touch(st, seq, t)

    # -- loop machinery -----------------------------------------------------------------------
    def _fp_text(self, rules: LoopRules, text: str, what: str) -> bytes:
        c = rules.canon
        try:
            return c.digest_canonical(text) if self.trust_canonical else c.digest(text)
        except CanonicalError as exc:
            raise Invalid(f"bad_{what}_canonical", f"{what}_canonical: {exc}") from None

    def _intern(self, tool: str) -> str:
        if len(self._tools) < _MAX_INTERNED_TOOLS:
            self._tools[tool] = tool
        return tool

    def _end_stream(self, st: Stream, seq: int, t: int, event_id: str,
                    why: str) -> list[Output]:
        outs: list[Output] = []
        if st.loop_len:
            length = st.loop_len
            off = st.rules.cycles[length - 1][1]
            outs.append(self._loop_ended(st, length, off, st.n - 1, seq, t, event_id, why))
        self._drop(st)
        self._dirty.add(st.key)
        return outs

    # -- bookkeeping --------------------------------------------------------------------------
    def _new(self, key: str, task: str, sandbox: str, episode: str | None) -> Stream:
        task = self._tools.get(task) or self._intern(task)
        st = Stream(key, task, sandbox, episode, self._task_rules.get(task, self.default_rules))
        st.domain = self._domain
        self._add(st)
        return st

    def _add(self, st: Stream) -> None:
        self._streams[st.key] = st
        st.sb_next = self._by_sandbox.get(st.sandbox)
        self._by_sandbox[st.sandbox] = st
        self._in_domain.setdefault(st.domain, {})[st.key] = st
        self._arm(st)

    def _drop(self, st: Stream) -> None:
        if self._streams.pop(st.key, None) is None:
            return
        self._leave(st)
        head = self._by_sandbox.get(st.sandbox)
        if head is st:
            if st.sb_next is None:
                del self._by_sandbox[st.sandbox]
            else:
                self._by_sandbox[st.sandbox] = st.sb_next
        else:
            prev = head
            while prev is not None and prev.sb_next is not st:
                prev = prev.sb_next
            if prev is not None:
                prev.sb_next = st.sb_next
        st.sb_next = None

    def _touch(self, st: Stream, seq: int, t: int) -> None:
        st.last_seq = seq
        if t > st.last_time:
            st.last_time = t
        st.stalled = False
        self._seen(st, t)
        self._dirty.add(st.key)

    def _seen(self, st: Stream, t: int) -> None:
        """An event of ``st`` (event time ``t``) was read: its timers count again from
        ``max(its log's clock, the record's log time)`` (a record written before the clock was
        read late: its stream is not made idle by the delay)."""
        lg = self._log_ms
        if lg is None:
            lg = t
        if self._floor > lg:
            lg = self._floor
        if lg > st.last_log:
            st.last_log = lg
        if st.domain != self._domain:
            self._move(st)
        else:
            self._arm(st)

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
        members = self._in_domain.get(st.domain)
        if members is not None and members.get(st.key) is st:
            del members[st.key]
            if not members:
                del self._in_domain[st.domain]

    def _dead(self, kind: str, record: Any, code: str, reason: str) -> DeadLetterOut:
        h = record.get("header") if isinstance(record, Mapping) else None
        if not isinstance(h, Mapping):
            h = {}

        def s(name: str) -> str | None:
            v = h.get(name)
            return v if isinstance(v, str) else None

        seq = h.get("seq")
        return DeadLetterOut(
            reason_code=code, reason=reason, kind=kind if isinstance(kind, str) else repr(kind),
            event_id=s("event_id"), task=s("task"), sandbox=s("sandbox"), episode=s("episode"),
            seq=seq if type(seq) is int else None,
        )

    # -- restore --------------------------------------------------------------------------------
    def _load(self, blob: bytes) -> Stream:
        data = json.loads(blob)
        state_version(data)
        (_, task, sandbox, episode, last_seq, last_time, n, loop_len, stalled, open_old, m,
         ring, win) = data[:13]
        last_log, domain = data[13:] if len(data) == 15 else (-1, "")
        if type(last_log) is not int or type(domain) is not str:
            raise TypeError("last_log must be int, domain str")
        for name, v, typ in (("task", task, str), ("sandbox", sandbox, str)):
            if type(v) is not typ:
                raise TypeError(f"{name} must be {typ.__name__}")
        if episode is not None and type(episode) is not str:
            raise TypeError("episode must be str or null")
        for name, v in (("last_seq", last_seq), ("last_time", last_time), ("n", n),
                        ("loop_len", loop_len), ("open_old", open_old), ("m", m)):
            if type(v) is not int:
                raise TypeError(f"{name} must be int")
        if not (isinstance(ring, list) and isinstance(win, list)):
            raise TypeError("ring/win must be lists")
        if not 1 <= m <= MAX_CYCLE_LENGTH_LIMIT or len(ring) != RS * (m + 1):
            raise ValueError("ring size does not match its cycle length")
        rules = self._task_rules.get(task, self.default_rules)
        task = self._tools.get(task) or self._intern(task)
        st = Stream(state_key(sandbox, episode), task, sandbox, episode, rules)
        st.last_seq, st.last_time, st.n = last_seq, last_time, n
        st.last_log, st.domain = last_log, domain
        st.stalled = bool(stalled)
        st.open_old = open_old
        fps: dict[str, bytes] = {}  # one object per distinct fingerprint, as when live

        def unhex(v: Any) -> bytes | None:
            if v is None:
                return None
            if type(v) is not str:
                raise TypeError("fingerprint must be a hex string")
            fp = fps.get(v)
            if fp is None:
                fp = fps[v] = bytes.fromhex(v)
            return fp

        for i in range(0, len(ring), RS):
            slot = ring[i:i + RS]
            if slot[R_TOOL] is None:
                continue
            tool, _, seq, t, _, cid = slot
            if (type(tool) is not str or type(seq) is not int or type(t) is not int
                    or not (cid is None or type(cid) is str)):
                raise TypeError("bad ring slot")
            ring[i] = self._tools.get(tool) or self._intern(tool)
            ring[i + R_AFP] = unhex(slot[R_AFP])
            ring[i + R_RFP] = unhex(slot[R_RFP])
        win = list(win)
        src_len, dst_len = m + 1, rules.ring_len
        # re-lay the ring into the current cycle-length configuration
        for back in range(min(n, src_len, dst_len)):
            k = n - 1 - back
            src, dst = (k % src_len) * RS, (k % dst_len) * RS
            st.ring[dst:dst + RS] = ring[src:src + RS]
        # calls that no longer fit in a smaller ring: keep their openness
        st.open_old += sum(
            1 for back in range(dst_len, min(n, src_len))
            if ring[((n - 1 - back) % src_len) * RS + R_CID] is not None
        )
        if m == rules.max_cycle_length and len(win) == rules.win_size:
            if n:
                win = [tuple(w) for w in win]
                if any(len(w) != 5 or any(type(v) is not int for v in w) for w in win):
                    raise TypeError("bad window")
            st.win = win
            st.loop_len = loop_len
        elif n > 0:  # cycle setting changed: windows restart from the remembered calls
            kept = min(src_len, dst_len)  # the calls both rings hold; older ones are unknown
            for length, off, _ in rules.cycles:
                self._restart(st, length, off, max(0, n - length, n - kept), RECONFIGURED)
            st.loop_len = 0
        return st

