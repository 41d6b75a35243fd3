"""One stream's state (a sandbox, or one of its episodes): a ring of the last calls and one
window per cycle length, constant in size; and its changelog form (a compact JSON list)."""

from __future__ import annotations

import json
from typing import Any

from .rules import LoopRules

STATE_VERSION = 2  # 2: + the stream's log time and log (v1 blobs still load)

# ring slot layout (per remembered call)
R_TOOL, R_AFP, R_SEQ, R_TIME, R_RFP, R_CID = range(6)
RS = 6
# window tuple (one per cycle length L): start call index, its seq and time, result changes,
# why it started
W_S, W_SEQ, W_TIME, W_CHG, W_CODE = range(5)

# why a window (re)started
START, BROKEN, CHANGED, RECONFIGURED = 0, 1, 2, 3
START_TEXT = {
    START: "tracking started",
    BROKEN: "the previous pattern was broken by a different call",
    CHANGED: "a result changed",
    RECONFIGURED: "cycle-length setting changed at restore",
}


def state_version(data: Any) -> int:
    """The version of a decoded state (1 or :data:`STATE_VERSION`); ``ValueError`` if it is
    neither."""
    if not isinstance(data, list) or not (
            (len(data) == 13 and data[0] == 1) or (len(data) == 15 and data[0] == 2)):
        raise ValueError(f"not a watchdog state v1 or v{STATE_VERSION}")
    return int(data[0])


class Stream:
    """Per (sandbox, episode) state. Constant size: ring of M calls + M windows."""

    __slots__ = (
        "domain", "episode", "key", "last_log", "last_seq", "last_time", "loop_len", "n",
        "open_old", "ring", "rules", "sandbox", "sb_next", "stalled", "task", "win",
    )

    def __init__(self, key: str, task: str, sandbox: str, episode: str | None,
                 rules: LoopRules) -> None:
        self.key = key
        self.task = task
        self.sandbox = sandbox
        self.episode = episode
        self.rules = rules
        self.last_seq = -1
        self.last_time = 0  # latest event time (the sandbox's clock): the loop rule's span
        # The log that carries the stream (see "Time" in the core's docstring) and the latest
        # log time at which one of its events was read; -1: not known yet (a stream restored
        # from a version-1 state: judged by no timer until its next event).
        self.domain = ""
        self.last_log = -1
        self.n = 0  # calls seen
        self.loop_len = 0  # cycle length of the active (alerted) loop, 0 = none
        self.stalled = False
        self.open_old = 0  # open calls that fell out of the ring
        self.ring: list[Any] = [None] * (RS * rules.ring_len)
        self.win: list[Any] = [None] * rules.win_size
        self.sb_next: Stream | None = None


fromhex = bytes.fromhex


def dump_stream(st: Stream) -> bytes:
    ring = [v.hex() if isinstance(v, bytes) else v for v in st.ring]
    return json.dumps(
        [STATE_VERSION, st.task, st.sandbox, st.episode, st.last_seq, st.last_time, st.n,
         st.loop_len, int(st.stalled), st.open_old, st.rules.max_cycle_length, ring, st.win,
         st.last_log, st.domain],
        separators=(",", ":"), ensure_ascii=False,
    ).encode("utf-8", "surrogatepass")
