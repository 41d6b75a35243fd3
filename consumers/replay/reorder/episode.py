"""One episode's reorder state and its content history (the pure core's per-key state, see
:mod:`trajbus.consumers.replay.core`)."""

from __future__ import annotations

from array import array

GAP_MARK = 0
"""Ring value of a seq declared missing (a content digest is never 0)."""
GAPS_KEPT = 32
"""Closed gaps remembered per episode (beyond the dedupe window) to route late events."""
HISTORY_MAX = 65_536
"""Seqs per episode whose 16-bit content digest is kept beyond the dedupe window."""
HISTORY_GAP_MAX = 4_096
"""A gap wider than this restarts the history (its seqs are remembered in ``gaps``)."""
ZERO8 = b"\x00" * 8


# -- per-episode state -----------------------------------------------------------------------
class EpisodeState:
    """One episode's reorder state: where its stream stands, what is buffered, its timers
    and the content digests that judge its duplicates."""

    __slots__ = (
        "active", "buf", "buf_bytes", "closed", "end_seq", "episode", "expect", "expire_at",
        "final_seq",
        "gap_since", "gaps", "hist", "hist_base", "key", "last_time", "next_seq", "recycle_at",
        "ring", "sandbox",
        "seg_index", "stop", "task", "terminal",
    )

    def __init__(self, task: str, sandbox: str, episode: str, now: int, t: int, w: int) -> None:
        self.key = (sandbox, episode)
        self.task = task
        self.sandbox = sandbox
        self.episode = episode
        self.next_seq = 0
        self.expect = 0  # next_seq when the fast path applies (nothing buffered, no known
        # last seq, open), else -1: the hot path tests one int
        self.seg_index = 0
        self.last_time = t
        self.active = now
        self.buf: dict[int, tuple[bytes, int, int]] | None = None
        self.buf_bytes = 0
        self.gap_since = -1
        self.end_seq = -1
        self.final_seq = -1
        self.stop = -1  # end_seq if known, else final_seq
        self.terminal = False
        self.recycle_at = -1
        self.closed = False
        self.expire_at = -1
        self.ring = array("Q", ZERO8) * w  # digests of the last w seqs, by seq % w
        self.gaps: list[tuple[int, int]] = []
        # 16-bit digests (_h16) of seqs hist_base .. hist_base + len(hist) - 1 (== next_seq - 1
        # while the history is intact); 0 marks a seq declared missing
        self.hist = array("H")
        self.hist_base = 0


def h16(digest: int) -> int:
    """The history's 16-bit digest of a content digest (never 0, the gap mark)."""
    return (digest & 0xFFFF) or 1


def remember(ep: EpisodeState, seq: int, h: int) -> None:
    """Append seq's history digest; restart the history if it does not end right before seq
    (kept contiguous), and forget its oldest seqs beyond ``HISTORY_MAX``."""
    hist = ep.hist
    if ep.hist_base + len(hist) != seq:
        del hist[:]
        ep.hist_base = seq
    hist.append(h)
    trim(ep)


def trim(ep: EpisodeState) -> None:
    """Forget the oldest history digests beyond ``HISTORY_MAX`` (an eighth more at once)."""
    hist = ep.hist
    if len(hist) > HISTORY_MAX:
        cut = len(hist) - HISTORY_MAX + HISTORY_MAX // 8
        del hist[:cut]
        ep.hist_base += cut
