"""Trace tailer: follows a sandbox's trace directory (``/dev/shm/<runtime>-trace/``) and
publishes what the agent writes as TraceChunk events, then EpisodeEnd when the ``.done``
marker appears.

Layout followed: ``episode_<n>.trace`` (grows while the agent acts) and ``episode_<n>.done``
(written when the episode is over; optional JSON ``{"outcome": "TERMINAL"|"TRUNCATED",
"reward": 1.0, "reason": "..."}``). The episode id is ``<n>`` as written in the file name.

Guarantees:

- **No byte re-sent or skipped across restarts.** The tailer's offset for a file is journaled
  *in the same journal record* as the chunk that advances it (``trace_chunk(cursor=...)``), so
  the two cannot disagree after a crash; the emitter re-sends journaled-but-unacknowledged
  chunks itself. A restarted tailer (same state directory) resumes at the journaled offset.
  This is stronger than committing offsets after the broker's ack, which would re-send (with
  new seqs) the chunks between the ack and the commit after a crash.
- **Truncation and replacement are explicit.** A file whose inode changed (replaced) or whose
  size shrank below the offset (truncated) restarts at offset 0 with a chunk carrying
  ``reset="replaced"`` / ``"truncated"``; a consumer rebuilding the file starts over there.
- Chunks are at most ``chunk_size`` (default ``settings.producer.chunk_size``, 256 KiB) and
  never above the topic's message limit; a chunk is cut after the last newline when the window
  has one, so lines (and secrets in them) are rarely split across chunks. An incomplete last
  line is held back until it completes or the episode is done.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

from trajbus.producers.emitter import MESSAGE_OVERHEAD, SandboxEmitter

TRACE_RE = re.compile(r"^episode_(?P<n>[A-Za-z0-9][A-Za-z0-9._-]*)\.trace$")


class TraceTailer:
    """Tails ``trace_dir`` into ``emitter`` (which owns the state directory and its journal)."""

    def __init__(self, emitter: SandboxEmitter, trace_dir: str | os.PathLike[str], *,
                 chunk_size: int | None = None, poll_ms: int = 200,
                 content_type: str = "application/jsonl") -> None:
        self.em = emitter
        self.dir = Path(trace_dir)
        limit = emitter.max_inline - MESSAGE_OVERHEAD
        want = chunk_size or emitter.settings.producer.chunk_size
        self.chunk_size = max(1, min(want, limit))
        self.poll_ms = poll_ms
        self.content_type = content_type
        self.bytes_sent = 0
        self.resets = 0

    @staticmethod
    def _cursor_name(episode: str) -> str:
        return f"trace:{episode}"

    def _files(self) -> list[tuple[str, Path]]:
        out = []
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        for name in names:
            m = TRACE_RE.match(name)
            if m:
                out.append((m.group("n"), self.dir / name))
        return out

    async def poll_once(self) -> int:
        """Publish whatever is new in every trace file; returns the bytes published."""
        total = 0
        for episode, path in self._files():
            total += await self._follow(episode, path)
        return total

    async def _follow(self, episode: str, path: Path) -> int:
        em = self.em
        name = self._cursor_name(episode)
        cur: dict[str, Any] = em.cursor(name) or {"ino": None, "off": 0, "done": False}
        if cur.get("done") or em.is_closed(episode):
            return 0
        done_path = path.with_suffix(".done")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        sent = 0
        try:
            st = os.fstat(fd)
            if not em.is_open(episode):
                await em.start_episode(episode)
            off = int(cur["off"])
            reset: str | None = None
            if cur["ino"] is not None and cur["ino"] != st.st_ino:
                reset, off = "replaced", 0
            elif st.st_size < off:
                reset, off = "truncated", 0
            done = done_path.exists()  # checked before reading: all bytes are in by then
            size = os.fstat(fd).st_size
            while off < size or reset is not None:
                want = min(self.chunk_size, size - off)
                data = os.pread(fd, want, off) if want > 0 else b""
                if len(data) < want:
                    size = off + len(data)  # shrank under us: next poll sees it
                more = off + len(data) < size
                if data and (more or not done):
                    nl = data.rfind(b"\n")
                    if nl >= 0:
                        data = data[: nl + 1]
                    elif not more and len(data) < self.chunk_size:
                        break  # an incomplete line: wait for the rest
                if not data and reset is None:
                    break
                await em.trace_chunk(
                    episode, data, file_offset=off, content_type=self.content_type,
                    reset=reset,
                    cursor=(name, {"ino": st.st_ino, "off": off + len(data), "done": False}))
                if reset is not None:
                    self.resets += 1
                reset = None
                off += len(data)
                sent += len(data)
            if done and off >= size:
                outcome, reward, reason = _read_done(done_path)
                await em.end_episode(episode, outcome, reward=reward, reason=reason,
                                     cursor=(name, {"ino": st.st_ino, "off": off, "done": True}))
        finally:
            os.close(fd)
        self.bytes_sent += sent
        return sent

    async def run(self, *, once: bool = False, stop: asyncio.Event | None = None) -> None:
        """Poll every ``poll_ms`` until ``stop`` is set (or one pass with ``once``)."""
        while True:
            await self.poll_once()
            if once or (stop is not None and stop.is_set()):
                return
            if stop is None:
                await asyncio.sleep(self.poll_ms / 1000)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), self.poll_ms / 1000)
                except TimeoutError:
                    pass


def _read_done(path: Path) -> tuple[str, float | None, str]:
    try:
        text = path.read_text().strip()
    except OSError:
        return "TERMINAL", None, ""
    if not text:
        return "TERMINAL", None, ""
    try:
        d = json.loads(text)
    except ValueError:
        return "TERMINAL", None, text[:256]
    if not isinstance(d, dict):
        return "TERMINAL", None, ""
    outcome = d.get("outcome", "TERMINAL")
    if outcome not in ("TERMINAL", "TRUNCATED"):
        outcome = "TERMINAL"
    reward = d.get("reward")
    return outcome, float(reward) if isinstance(reward, int | float) else None, str(
        d.get("reason", ""))[:256]
