"""The reorder core's state as changelog records (see "Persistence" in
:mod:`trajbus.consumers.replay.core`): the blobs of the keys changed since the last call, a
whole snapshot, and restoring from them (an episode put in place, its timers armed before the
next input). The blob format is :mod:`.codec`'s.

:class:`Persistence` is the part of the machine (:class:`.machine.ReorderCore`) that does it."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from .codec import (
    V_CLOCK,
    V_EP,
    V_SB,
    pack_clock,
    pack_episode,
    pack_held,
    pack_sandbox,
    unpack_clock,
    unpack_episode,
    unpack_held,
    unpack_sandbox,
)
from .episode import EpisodeState
from .events import CLOCK_KEY, HELD_PREFIX, Held, episode_key


class Persistence:
    """Changelog blobs out of and into the machine's state."""

    # the machine's state this part reads and writes (set up by ReorderCore.__init__)
    _clock: int
    _persisted_clock: int
    _w: int
    _eps: dict[tuple[str, str], EpisodeState]
    _by_sandbox: dict[str, set[str]]
    _recycled: dict[str, int]
    _held: dict[str, list[Held]]
    _dirty: set[tuple[str, str | None]]
    _dirty_eps: set[EpisodeState]
    _dirty_held: set[str]
    _restored: set[tuple[str, str]]
    _restored_held: set[str]
    _buffered: int
    _buffered_bytes: int

    if TYPE_CHECKING:  # held admission's and emission's
        def _set_held(self, sb: str, held: list[Held] | None, dirty: bool = True) -> None: ...

        def _unbuffer(self, ep: EpisodeState, n: int) -> None: ...

    def take_dirty(self) -> dict[str, bytes | None]:
        """Blobs for every key changed since the last call (``None`` = deleted), sorted by key.
        Persist them in the same transaction as the outputs produced since the last call."""
        res: dict[str, bytes | None] = {}
        if self._clock != self._persisted_clock:
            res[CLOCK_KEY] = pack_clock(self._clock)
            self._persisted_clock = self._clock
        for sb, episode in self._dirty:
            if episode is None:
                dl = self._recycled.get(sb)
                res[f"{sb}/"] = None if dl is None else pack_sandbox(sb, dl)
            else:
                ep = self._eps.get((sb, episode))
                res[episode_key(sb, episode)] = None if ep is None else pack_episode(ep)
        for ep in self._dirty_eps:
            if self._eps.get(ep.key) is ep:
                res[episode_key(ep.sandbox, ep.episode)] = pack_episode(ep)
            elif ep.key not in self._eps:
                res[episode_key(ep.sandbox, ep.episode)] = None
        for sb in self._dirty_held:
            held = self._held.get(sb)
            res[HELD_PREFIX + sb] = pack_held(sb, held) if held else None
        self._dirty.clear()
        self._dirty_eps.clear()
        self._dirty_held.clear()
        return dict(sorted(res.items()))

    def snapshot(self) -> dict[str, bytes]:
        """The whole state as changelog blobs (for tests and cold snapshots)."""
        res: dict[str, bytes] = {CLOCK_KEY: pack_clock(self._clock)}
        for sb, dl in self._recycled.items():
            res[f"{sb}/"] = pack_sandbox(sb, dl)
        for ep in self._eps.values():
            res[episode_key(ep.sandbox, ep.episode)] = pack_episode(ep)
        for sb, held in self._held.items():
            res[HELD_PREFIX + sb] = pack_held(sb, held)
        return dict(sorted(res.items()))

    def restore(self, key: str, blob: bytes | None) -> None:
        """Apply one changelog record (the latest per key wins; ``None`` deletes). Raises
        ``ValueError`` on a blob this version cannot read (fail fast at start-up)."""
        if key.startswith(HELD_PREFIX):
            try:
                sb = key[len(HELD_PREFIX):]
                self._set_held(sb, None if blob is None else unpack_held(blob),
                               dirty=False)
                self._restored_held.add(sb)
            except (struct.error, UnicodeDecodeError, IndexError, ValueError) as exc:
                raise ValueError(f"corrupt reorder state for {key!r}: {exc}") from exc
            return
        if blob is None:
            if key == CLOCK_KEY:
                return
            sb, _, episode = key.partition("/")
            if episode:
                self._drop_ep((sb, episode))
            else:
                self._recycled.pop(sb, None)
            return
        try:
            tag = blob[:2]
            if tag == V_CLOCK:
                self._clock = max(self._clock, unpack_clock(blob))
                self._persisted_clock = self._clock
            elif tag == V_SB:
                sb, dl = unpack_sandbox(blob)
                self._recycled[sb] = dl
                self._restored.add((sb, ""))
            elif tag == V_EP:
                self._restore_episode(*unpack_episode(blob, self._w))
            else:
                raise ValueError(f"unknown blob tag {tag!r}")
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"corrupt reorder state for {key!r}: {exc}") from exc

    def _drop_ep(self, key: tuple[str, str]) -> None:
        ep = self._eps.pop(key, None)
        if ep is None:
            return
        if ep.buf:
            for raw, _, _ in ep.buf.values():
                self._unbuffer(ep, len(raw))
        eps = self._by_sandbox.get(ep.sandbox)
        if eps is not None:
            eps.discard(ep.episode)
            if not eps:
                del self._by_sandbox[ep.sandbox]

    def _restore_episode(self, ep: EpisodeState, buf: dict[int, tuple[bytes, int, int]]) -> None:
        """Put a decoded episode in place of the key's state (its timers are armed before the
        next input, by :meth:`_arm_restored`)."""
        key = ep.key
        self._drop_ep(key)
        self._eps[key] = ep
        self._restored.add(key)
        if ep.closed:
            return
        self._by_sandbox.setdefault(ep.sandbox, set()).add(ep.episode)
        if buf:
            ep.buf = buf
            for raw, _, _ in buf.values():
                ep.buf_bytes += len(raw)
                self._buffered += 1
                self._buffered_bytes += len(raw)
        elif ep.stop < 0:
            ep.expect = ep.next_seq
