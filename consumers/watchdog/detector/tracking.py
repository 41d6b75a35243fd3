"""Which streams the detector tracks (see "Streams" in :mod:`trajbus.consumers.watchdog.core`):
a stream is opened by its first event, ended by its EpisodeEnd, by a DRAINING or RECYCLED
lifecycle of its sandbox or by idle eviction (a LOOP_ENDED first when a loop is active), and
loaded back from its changelog form. The handlers of the events that only open, touch or end
streams (all but ToolCall and ToolResult) are here.

:class:`Tracking` is the part of the detector (:class:`.machine.WatchdogCore`) that keeps the
streams by key, by sandbox and by log."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trajbus.bus.settings import MAX_CYCLE_LENGTH_LIMIT

from .inputs import Invalid, read_header
from .outputs import AlertOut, Output, state_key
from .rules import LoopRules
from .stream import (
    R_AFP,
    R_CID,
    R_RFP,
    R_TOOL,
    RECONFIGURED,
    RS,
    Stream,
    state_version,
)

_END_KINDS = frozenset({"DRAINING", "RECYCLED"})
_MAX_INTERNED_TOOLS = 4096


class Tracking:
    """The tracked streams: opening, ending, dropping and loading them."""

    # the detector's state this part reads and writes (set up by WatchdogCore.__init__)
    default_rules: LoopRules
    _task_rules: dict[str, LoopRules]
    _streams: dict[str, Stream]
    _by_sandbox: dict[str, Stream]
    _dirty: set[str]
    _tools: dict[str, str]
    _domain: str
    _in_domain: dict[str, dict[str, Stream]]

    if TYPE_CHECKING:  # the loop rule's and the timers' (LoopRule, LogTimers)
        def _loop_ended(self, st: Stream, length: int, off: int, last: int, seq: int, t: int,
                        event_id: str, why: str, changes: int | None = None) -> AlertOut: ...

        def _restart(self, st: Stream, length: int, off: int, s: int, code: int) -> None: ...

        def _touch(self, st: Stream, seq: int, t: int, rearm: bool = True) -> None: ...

        def _arm(self, st: Stream) -> None: ...

        def _leave(self, st: Stream) -> None: ...

    # -- events that open, touch or end streams ---------------------------------------------
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

    # -- streams ----------------------------------------------------------------------------
    def _intern(self, tool: str) -> str:
        """One string object per tool (and task) name, up to a bound (memory)."""
        if len(self._tools) < _MAX_INTERNED_TOOLS:
            self._tools[tool] = tool
        return tool

    def _end_stream(self, st: Stream, seq: int, t: int, event_id: str,
                    why: str) -> list[Output]:
        """Stop tracking ``st`` (a LOOP_ENDED first when a loop is active)."""
        outs: list[Output] = []
        if st.loop_len:
            length = st.loop_len
            off = st.rules.cycles[length - 1][1]
            outs.append(self._loop_ended(st, length, off, st.n - 1, seq, t, event_id, why))
        self._drop(st)
        self._dirty.add(st.key)
        return outs

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

    # -- restore ----------------------------------------------------------------------------
    def _load(self, blob: bytes) -> Stream:
        """A stream from its changelog form (version 1 or 2), re-laid into the current cycle
        settings; raises ``ValueError``/``TypeError``/``KeyError``/``IndexError`` on a blob
        it cannot read."""
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

