"""The reorder core's changelog format: compact binary blobs for the clock, a recycled
sandbox, an episode's state and a sandbox's held events (see "Persistence" in
:mod:`trajbus.consumers.replay.core`).

Every blob starts with a two-byte tag; integers are little-endian. Decoders raise
``struct.error``, ``UnicodeDecodeError``, ``IndexError`` or ``ValueError`` on a blob they
cannot read, and never change anything before it is read whole.
"""

from __future__ import annotations

import struct
import sys
from array import array

from .episode import EpisodeState
from .events import Held, InEvent

_HIST = struct.Struct("<qI")
_FIXED = struct.Struct("<qqqqqqqqqBI")
_STR = struct.Struct("<I")
_PAIR = struct.Struct("<qq")
_BUFHDR = struct.Struct("<qqQI")
_Q = struct.Struct("<q")
V_EP = b"\x01E"
V_SB = b"\x01S"
V_CLOCK = b"\x01C"
V_HELD = b"\x01H"
# arrival, seq, event time, log time, partition, offset, raw length, flags (_HELD_*)
_HELDHDR = struct.Struct("<qqqqqqIB")
_HELD_NO_EPISODE = 1
_HELD_OUTCOME = 2
HELD_OVERHEAD = 256
"""Changelog bytes of a held event besides its raw bytes (an upper bound)."""

Buffer = dict[int, tuple[bytes, int, int]]
"""An episode's buffered events: seq -> (raw, content digest, event time)."""


def _pstr(s: str) -> bytes:
    b = s.encode("utf-8")
    return _STR.pack(len(b)) + b


def _ustr(blob: bytes, off: int) -> tuple[str, int]:
    (n,) = _STR.unpack_from(blob, off)
    off += 4
    return blob[off : off + n].decode("utf-8"), off + n


_I64 = range(-(2**63), 2**63)


def packable(ev: InEvent) -> bool:
    """Whether a held event's fields fit its changelog record (hand-built events may not)."""
    return (type(ev.task) is str and type(ev.kind) is str
            and (ev.outcome is None or type(ev.outcome) is str)
            and type(ev.log_time_ms) is int and type(ev.event_time_ms) is int
            and type(ev.seq) is int
            and ev.seq in _I64 and ev.event_time_ms in _I64 and ev.log_time_ms in _I64
            and all(type(e) is str and type(f) is int and f in _I64 for e, f in ev.final_seqs))


def _ring_bytes(ring: array[int]) -> bytes:
    if sys.byteorder == "little":
        return ring.tobytes()
    r = array("Q", ring)
    r.byteswap()
    return r.tobytes()


def _ring_from(data: bytes) -> array[int]:
    r = array("Q")
    r.frombytes(data)
    if sys.byteorder != "little":
        r.byteswap()
    return r


# -- clock and recycled sandboxes ----------------------------------------------------------
def pack_clock(clock: int) -> bytes:
    """The clock's blob."""
    return V_CLOCK + _Q.pack(clock)


def unpack_clock(blob: bytes) -> int:
    """The clock of a blob tagged :data:`V_CLOCK`."""
    return int(_Q.unpack_from(blob, 2)[0])


def pack_sandbox(sb: str, deadline: int) -> bytes:
    """A recycled sandbox's blob: its recycle grace deadline."""
    return V_SB + _Q.pack(deadline) + _pstr(sb)


def unpack_sandbox(blob: bytes) -> tuple[str, int]:
    """(sandbox, grace deadline) of a blob tagged :data:`V_SB`."""
    (dl,) = _Q.unpack_from(blob, 2)
    sb, _ = _ustr(blob, 10)
    return sb, dl


# -- episodes -------------------------------------------------------------------------------
def pack_episode(ep: EpisodeState) -> bytes:
    """An episode's blob: its fixed fields, dedupe ring, closed gaps, buffered events (by
    seq) and content history."""
    flags = (1 if ep.closed else 0) | (2 if ep.terminal else 0)
    parts = [
        V_EP, _pstr(ep.task), _pstr(ep.sandbox), _pstr(ep.episode),
        _FIXED.pack(ep.next_seq, ep.seg_index, ep.last_time, ep.active, ep.gap_since,
                    ep.end_seq, ep.final_seq, ep.recycle_at, ep.expire_at, flags,
                    len(ep.ring)),
        _ring_bytes(ep.ring), _STR.pack(len(ep.gaps)),
    ]
    parts.extend(_PAIR.pack(lo, hi) for lo, hi in ep.gaps)
    buf = ep.buf or {}
    parts.append(_STR.pack(len(buf)))
    for s in sorted(buf):
        raw, dig, t = buf[s]
        parts.append(_BUFHDR.pack(s, t, dig, len(raw)))
        parts.append(raw)
    hist = ep.hist
    parts.append(_HIST.pack(ep.hist_base, len(hist)))
    if sys.byteorder == "little":
        parts.append(hist.tobytes())
    else:
        h = array("H", hist)
        h.byteswap()
        parts.append(h.tobytes())
    return b"".join(parts)


def unpack_episode(blob: bytes, w: int) -> tuple[EpisodeState, Buffer]:
    """The episode of a blob tagged :data:`V_EP`, for a core with dedupe window ``w`` (a
    ring of another width carries over the seqs both cover), and its buffered events. The
    episode comes back detached: no buffer, ``expect`` -1; the caller attaches the buffer
    to an open episode."""
    off = 2
    task, off = _ustr(blob, off)
    sb, off = _ustr(blob, off)
    episode, off = _ustr(blob, off)
    (ns, idx, last_t, active, gap_since, end_seq, final_seq, recycle_at, expire_at, flags,
     ring_len) = _FIXED.unpack_from(blob, off)
    off += _FIXED.size
    old_ring = _ring_from(blob[off : off + 8 * ring_len])
    off += 8 * ring_len
    (ngaps,) = _STR.unpack_from(blob, off)
    off += 4
    gaps = []
    for _ in range(ngaps):
        gaps.append(_PAIR.unpack_from(blob, off))
        off += _PAIR.size
    (nbuf,) = _STR.unpack_from(blob, off)
    off += 4
    buf: Buffer = {}
    for _ in range(nbuf):
        s, t, dig, n = _BUFHDR.unpack_from(blob, off)
        off += _BUFHDR.size
        buf[s] = (blob[off : off + n], dig, t)
        off += n
    hist = array("H")
    hist_base = ns  # a blob written before the history: it starts now
    if off < len(blob):
        hist_base, nhist = _HIST.unpack_from(blob, off)
        off += _HIST.size
        hist.frombytes(blob[off : off + 2 * nhist])
        if sys.byteorder != "little":
            hist.byteswap()
        off += 2 * nhist
        if len(hist) != nhist:
            raise ValueError("reorder state blob has the wrong length")
    if off != len(blob) or len(old_ring) != ring_len:
        raise ValueError("reorder state blob has the wrong length")

    ep = EpisodeState(task, sb, episode, active, last_t, w)
    ep.next_seq, ep.seg_index, ep.gap_since = ns, idx, gap_since
    ep.end_seq, ep.final_seq, ep.recycle_at, ep.expire_at = (
        end_seq, final_seq, recycle_at, expire_at)
    ep.stop = end_seq if end_seq >= 0 else final_seq
    ep.closed, ep.terminal = bool(flags & 1), bool(flags & 2)
    ep.gaps = [(int(lo), int(hi)) for lo, hi in gaps]
    ep.hist, ep.hist_base = hist, hist_base
    old_w = ring_len
    if old_w == w:
        ep.ring = old_ring
    else:  # the dedupe window changed: carry over the seqs both windows cover
        for s in range(max(0, ns - min(old_w, w)), ns):
            ep.ring[s % w] = old_ring[s % old_w]
    ep.expect = -1
    return ep, buf


# -- held events ----------------------------------------------------------------------------
def pack_held(sb: str, held: list[Held]) -> bytes:
    """A sandbox's held events' blob, in the order they were held."""
    parts = [V_HELD, _pstr(sb), _STR.pack(len(held))]
    for arrival, ev, origin in held:
        topic, partition, offset, key = ("", -1, -1, None) if origin is None else origin[:4]
        flags = ((_HELD_NO_EPISODE if ev.episode is None else 0)
                 | (_HELD_OUTCOME if ev.outcome is not None else 0))
        parts += [
            _HELDHDR.pack(arrival, ev.seq, ev.event_time_ms, ev.log_time_ms, partition,
                          offset, len(ev.raw), flags),
            ev.raw, _pstr(ev.task), _pstr(ev.episode or ""), _pstr(ev.kind),
            _pstr(ev.outcome or ""), _pstr(topic),
            _STR.pack(0) if key is None else _STR.pack(len(key) + 1) + key,
            _STR.pack(len(ev.final_seqs)),
        ]
        for episode, final in ev.final_seqs:
            parts += [_pstr(episode), _Q.pack(final)]
    return b"".join(parts)


def unpack_held(blob: bytes) -> list[Held]:
    """The held events of a blob tagged :data:`V_HELD`."""
    if blob[:2] != V_HELD:
        raise ValueError(f"unknown blob tag {blob[:2]!r}")
    sb, off = _ustr(blob, 2)
    (n,) = _STR.unpack_from(blob, off)
    off += 4
    held: list[Held] = []
    for _ in range(n):
        (arrival, seq, t, log_t, partition, offset, nraw, flags
         ) = _HELDHDR.unpack_from(blob, off)
        off += _HELDHDR.size
        raw = blob[off : off + nraw]
        off += nraw
        task, off = _ustr(blob, off)
        episode, off = _ustr(blob, off)
        kind, off = _ustr(blob, off)
        outcome, off = _ustr(blob, off)
        topic, off = _ustr(blob, off)
        (nkey,) = _STR.unpack_from(blob, off)
        off += 4
        key = None if nkey == 0 else blob[off : off + nkey - 1]
        off += max(0, nkey - 1)
        (nfinal,) = _STR.unpack_from(blob, off)
        off += 4
        finals = []
        for _ in range(nfinal):
            fep, off = _ustr(blob, off)
            finals.append((fep, _Q.unpack_from(blob, off)[0]))
            off += 8
        if len(raw) != nraw:
            raise ValueError("held-events blob is cut short")
        ev = InEvent(task, sb, None if flags & _HELD_NO_EPISODE else episode, seq, t, kind,
                     raw, outcome if flags & _HELD_OUTCOME else None,
                     final_seqs=tuple(finals), log_time_ms=log_t)
        held.append((arrival, ev, None if partition < 0 else
                     (topic, partition, offset, key, log_t)))
    if off != len(blob):
        raise ValueError("held-events blob has the wrong length")
    return held
