"""The emitter's state directory: one live emitter per directory (an flock), the journal
recovered at start (state and unacknowledged events, re-sent), acks journaled in batches, and
fully acknowledged segments deleted (see "Durable before sent" and "One writer per directory"
in :mod:`trajbus.producers.emitter`).

:class:`JournalKeeping` is the part of :class:`~trajbus.producers.emitter.SandboxEmitter`
that keeps its journal."""

from __future__ import annotations

import fcntl
import heapq
import os
import time
from pathlib import Path
from typing import Any

from trajbus.producers.journal import Journal, JournalError

from .emitter_results import STATE_DIR_LOCK_WAIT_S, StateDirLockedError
from .sending import QueuedEvent


class JournalKeeping:
    """The journal of an emitter's state directory, over the emitter's state."""

    # the emitter's state this part reads and writes (set up by SandboxEmitter.__init__)
    sandbox: str
    task: str
    state_dir: Path
    last_error: str | None
    resent_count: int
    _segment_bytes: int
    _drained_roll_bytes: int
    _lock_fd: int
    _journal: Journal | None
    _closed_flag: bool
    _next_rid: int
    _next_seq: dict[str, int]
    _open: dict[str, dict[str, Any]]
    _closed: dict[str, int]
    _cursors: dict[str, Any]
    _lifecycle: str | None
    _pending: list[tuple[int, QueuedEvent]]
    _unacked: dict[int, QueuedEvent]
    _seg_unacked: dict[int, int]
    _acked_rids: list[int]

    def _open_journal(self) -> None:
        """Lock the state directory (waiting up to :data:`STATE_DIR_LOCK_WAIT_S`), recover
        its journal and start a new segment with a snapshot of the state."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / "emitter.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + STATE_DIR_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)  # a forked child about to exec holds it (see the constant)
                    continue
                os.close(fd)
                raise StateDirLockedError(
                    f"{self.state_dir} is in use by another live emitter (flock held for "
                    f"{STATE_DIR_LOCK_WAIT_S:.0f} s); one emitter per state directory: give "
                    f"this one its own state_dir, or close the other first") from None
        self._lock_fd = fd
        try:
            journal = Journal(self.state_dir / "journal", self._segment_bytes)
            self._recover(journal)
            journal.open_new_segment(self._snapshot())
            for seg in list(journal.seg_bytes):
                if seg != journal.active and not self._seg_unacked.get(seg):
                    journal.delete(seg)
            self._journal = journal
        except BaseException:
            os.close(fd)
            self._lock_fd = -1
            raise

    def _recover(self, journal: Journal) -> None:
        """Rebuild the state and the unacknowledged events (to re-send) from the journal."""
        rec = journal.recover()
        if rec.state is not None:
            st = rec.state
            self._next_rid = int(st["rid"])
            self._next_seq = {k: int(v) for k, v in st["seq"].items()}
            self._open = dict(st["open"])
            self._closed = {k: int(v) for k, v in st["closed"].items()}
            self._cursors = dict(st.get("cur", {}))
            self._lifecycle = st.get("ls")
        for h in rec.tail:
            self._apply(h)
        for r in rec.events:
            self._next_rid = max(self._next_rid, r.rid + 1)
            if r.rid in rec.acked:
                continue
            h = r.header
            item = QueuedEvent(r.rid, r.seg, r.offset, r.length, h["tp"], h["k"], h["s"],
                               h["q"], h["id"], None, resent=True)
            self._unacked[r.rid] = item
            heapq.heappush(self._pending, (r.rid, item))
            self._seg_unacked[r.seg] = self._seg_unacked.get(r.seg, 0) + 1
        self.resent_count = len(self._unacked)

    def _apply(self, h: dict[str, Any]) -> None:
        """Apply an E record's state changes (used live and at recovery)."""
        stream = h["s"]
        self._next_rid = max(self._next_rid, h["rid"] + 1)
        self._next_seq[stream] = max(self._next_seq.get(stream, 0), h["q"] + 1)
        if h.get("open"):
            self._open[stream] = {"pv": h.get("pv")}
        if h.get("close"):
            self._open.pop(stream, None)
            self._next_seq.pop(stream, None)
            self._closed[stream] = h["q"]
        if "cur" in h:
            name, cursor = h["cur"]
            self._cursors[name] = cursor
        if "ls" in h:
            self._lifecycle = h["ls"]

    def _snapshot(self) -> dict[str, Any]:
        """The state a new journal segment starts with."""
        closed = self._closed
        if len(closed) > 100_000:  # keep the newest; ids older than that are not reuse-checked
            closed = dict(list(closed.items())[-100_000:])
            self._closed = closed
        return {"rid": self._next_rid, "seq": self._next_seq, "open": self._open,
                "closed": closed, "cur": self._cursors, "ls": self._lifecycle,
                "sandbox": self.sandbox, "task": self.task}

    def _flush_acks(self) -> None:
        """Journal the acks collected since the last time (one record), then let go of what
        they drained."""
        if self._acked_rids and self._journal is not None and not self._closed_flag:
            rids, self._acked_rids = self._acked_rids, []
            try:
                self._journal.append_acks(rids)
            except JournalError as exc:  # acks are an optimisation: worst case a re-send
                self.last_error = str(exc)
            self._roll_if_drained()
            self._gc_segments()

    def _roll_if_drained(self) -> None:
        """Every event of the active segment is acked and it has grown: start a new segment
        (a snapshot) so the drained one is deleted now, not when ``segment_bytes`` fill up.
        Bounds the disk an idle-ish emitter holds to about ``drained_roll_bytes``."""
        journal = self._journal
        if (journal is None or self._seg_unacked.get(journal.active)
                or not journal.worth_rolling_drained(self._drained_roll_bytes)):
            return
        try:
            journal.open_new_segment(self._snapshot(), sync_old=False)
        except JournalError as exc:  # the old segment stays active: nothing lost
            self.last_error = str(exc)

    def _gc_segments(self) -> None:
        """Delete every inactive journal segment whose events are all acknowledged."""
        journal = self._journal
        if journal is None:
            return
        for seg in list(journal.seg_bytes):
            if seg != journal.active and not self._seg_unacked.get(seg):
                journal.delete(seg)
                self._seg_unacked.pop(seg, None)
