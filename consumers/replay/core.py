"""The replay reorder core: a pure, deterministic state machine that turns one partition's
shuffled, duplicated episode events into ordered, deduplicated replay segments.

The Kafka shell (written separately) decodes each input record, builds an :class:`InEvent`
with :meth:`InEvent.from_decoded`, calls :meth:`ReorderCore.handle`, calls
:meth:`ReorderCore.tick` with its own clock now and then, and writes the outputs plus
:meth:`ReorderCore.take_dirty` (the changelog) in one Kafka transaction.

Guarantees (per episode, keyed by ``(sandbox, episode)``):

* **Order, exactly once.** Every accepted event appears in exactly one :class:`SegmentOut`,
  in ``seq`` order; concatenating an episode's segments gives its events sorted by seq,
  without duplicates. Segment indexes count 0, 1, 2, ... with no holes.
* **Streaming.** A segment is emitted as soon as the next expected seq arrives; it carries
  that event plus every buffered event that is now contiguous (split by the segment caps).
* **Exact duplicates** (same key, same content digest) are dropped and counted; a
  **conflicting duplicate** (same key, different content) becomes a :class:`DeadLetterOut`
  (``conflicting_duplicate``) carrying both versions when the first one is still buffered,
  and the new one plus a reason when the first one was already emitted. The first version
  always wins. Content comparison for already-emitted events covers the last
  ``dedupe_window`` sequences of the episode by their 64-bit digest and every older seq of
  the episode (up to ``HISTORY_MAX`` seqs) by a 16-bit digest: an older exact duplicate is
  dropped (counter ``duplicates``), an older conflicting one is a ``conflicting_duplicate``
  dead letter like a recent one (missed only when the 16-bit digests collide, 1 in 65,536).
  A duplicate older than the history (an episode longer than ``HISTORY_MAX`` seqs, a gap
  wider than ``HISTORY_GAP_MAX`` seqs, or state restored from a changelog written before
  the history existed) cannot be compared: it is an ``unverified_duplicate`` dead letter
  (counter ``duplicates_unverified``), never dropped silently.
* **Gaps.** When an event beyond the next expected seq arrives, the episode *stalls*; the
  stall timer starts at the event's *arrival time* (below) and restarts whenever the episode
  makes progress while events are still buffered. Once the clock has passed that time plus
  ``gap_timeout_ms`` without the missing seqs, the gap is closed: the next segment carries
  ``gap=(from_seq, to_seq)`` (the seqs declared missing) and the stream continues. An event
  that arrives after its gap was closed is a :class:`LateOut` (``after_gap``), never spliced
  into a later segment.
* **Clock.** The core's clock is the maximum of every event time and every ``tick(now_ms)``
  seen (a watermark); the wall clock is never read. A producer with a clock far ahead
  therefore closes gaps early (the shell should tick from a sane clock and may clamp
  event times). With ``event_time_clock=False`` only ticks move it.
* **Arrival time.** Every timeout an event starts (stall, recycle grace, idle, tombstone)
  counts from ``max(clock, ev.log_time_ms)``: the record's log time (when it was written to
  Kafka) at the earliest. The clock can lag far behind that moment (one input topic read
  behind the other, or a clock restored from a changelog that is stale by the downtime); a
  timer started from the lagging clock would expire as soon as the clock caught up, before
  the records written right after the opening one were read: a false gap. Decisions still
  depend only on the log (log times are in it).
* **End.** The EpisodeEnd's seq is the last: the segment that contains it (once everything
  before it was emitted or declared missing) has ``is_last=True`` and
  ``is_terminal = (outcome == "TERMINAL")``. A ``Drained`` event's ``final_seq`` for an
  episode without EpisodeEnd also bounds it: once everything up to it is emitted the
  episode ends truncated (``is_last=True, is_terminal=False``). Events with a seq beyond
  the known last seq are dead letters (``seq_after_end``).
* **Recycle.** ``SandboxLifecycle(state=RECYCLED)`` (sandbox-level, ``episode=None``) arms a
  grace deadline (``recycle_grace_ms``, default ``gap_timeout_ms``) on every open episode of
  that sandbox: trace chunks travel on another topic and may still be in flight. At the
  deadline, buffered events are flushed (closing gaps with markers) and the episode ends
  truncated with a final segment (zero events when nothing was pending; its ``gap`` covers
  the seqs up to the drained final seq when one is known). Episodes first seen for a
  recycled sandbox after the grace are late (``sandbox_recycled``).
* **Closed episodes** stay as tombstones for ``tombstone_ttl_ms`` (default
  ``60 * gap_timeout_ms``): duplicates of their events are still dropped (or dead-lettered
  when conflicting); seqs inside a closed gap are :class:`LateOut` (``after_gap``); new seqs
  of a truncated episode are :class:`LateOut` (``after_close``). After the TTL the key is
  forgotten (a ``None`` in the changelog).
* **Bounded memory.** An episode never holds more than ``max_buffered_per_episode`` events
  (nor ``max_buffered_bytes_per_episode`` bytes) and the core never more than
  ``max_buffered_total``: when a bound is exceeded, the oldest gap (of that episode, or of
  the episode that has stalled longest for the total bound) is force-closed early, exactly
  as on timeout (gap marker, stream continues; counter ``forced_gap_closes``). Nothing
  stalls and nothing is dropped silently.
* **Per-sandbox limit.** A sandbox may have at most ``max_open_episodes_per_sandbox`` episodes
  open at once (a sandbox runs one episode at a time; a flood of opened episodes is a broken
  or hostile sandbox). An event that would open one more is a dead letter
  (``too_many_open_episodes``, counter ``episodes_refused``) with its bytes; once the sandbox's
  episodes end, new ones are admitted again.
  The limit is judged at the event's arrival time *on the clock*, i.e. once every input
  topic has been read that far: an event that would exceed it while its arrival is still
  ahead of the clock is **held** (counters ``held_events``, gauge ``held``) and judged when
  the clock reaches it. Episodes look open while another input topic lags (their ends and
  middle events are in its unread part); judged at once, a sandbox's ordinary episodes would
  be refused because the worker read one topic ahead of the other. Held events are judged in
  arrival order; while a sandbox has held events, its new episodes queue behind them (a slot
  freed meanwhile goes to the earliest); an episode is judged as one, at its first held
  arrival (its other events join it), and a ``Drained``'s final seq for a held episode is held
  with it. A held event is judged as on arrival (the same recycle deadline and limit); its
  dead letter names its source record (``DeadLetterOut.origin``). Held events of a sandbox
  are bounded by ``max_buffered_per_episode`` (count) and ``max_buffered_bytes_per_episode``
  (bytes) and count towards ``max_buffered_total``; beyond a bound an event is judged at once.
* **Bad input never raises**: it becomes a :class:`DeadLetterOut` with a stable
  ``reason_code`` (``invalid_seq``, ``missing_episode``, ``missing_sandbox``,
  ``invalid_event``, ``bad_start_seq``, ``missing_outcome``, ``seq_after_end``,
  ``conflicting_end``, ``conflicting_duplicate``, ``unverified_duplicate``,
  ``too_many_open_episodes``, ``internal_error``).
* **Determinism.** Outputs depend only on the sequence of ``handle``/``tick`` calls. Segment
  event ids are uuid5 of ``sandbox/episode/segment_index``; :func:`segment_record` builds the
  ReplaySegment record, so re-running a log produces byte-identical segments.
* **Persistence.** :meth:`ReorderCore.take_dirty` returns compact blobs for every key
  changed since the last call (``"sandbox/episode"`` per episode, ``"sandbox/"`` per
  recycled sandbox, ``"@clock"`` for the clock; ``None`` when deleted). Feeding the latest
  blob of every key to :meth:`ReorderCore.restore` of a fresh core resumes with outputs
  identical to an uninterrupted run. Restoring a key several times (a changelog not yet
  compacted) costs no more memory than restoring its latest record: timers are armed once per
  restored key, before the next ``handle``/``tick``.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import sys
import uuid
from array import array
from typing import Any, NamedTuple, TypeAlias

from trajbus.bus.settings import ReplaySettings

DIGEST_SIZE = 8
_GAP_MARK = 0  # ring value of a seq declared missing (content_digest is never 0)
_NEVER = 2**63 - 1
GAPS_KEPT = 32
HISTORY_MAX = 65_536
"""Seqs per episode whose 16-bit content digest is kept beyond the dedupe window."""
HISTORY_GAP_MAX = 4_096
"""A gap wider than this restarts the history (its seqs are remembered in ``gaps``)."""
"""Closed gaps remembered per episode (beyond the dedupe window) to route late events."""

SEGMENT_NAMESPACE = uuid.UUID("6f2b8c1e-3d1a-5b7e-9c4f-2a7d0e5b8f13")
CLOCK_KEY = "@clock"

_TIMER_RECYCLE = 0
_TIMER_IDLE = 1
_TIMER_TOMBSTONE = 2
_TIMER_SANDBOX = 3
_TIMER_HELD = 4
HELD_PREFIX = "@held/"
"""Changelog key prefix of a sandbox's held events (``"@held/<sandbox>"``)."""


def content_digest(raw: bytes) -> int:
    """The content digest the core compares for duplicates: blake2b-64 of the raw bytes as
    an unsigned int (never 0, which marks declared-missing seqs)."""
    d = int.from_bytes(hashlib.blake2b(raw, digest_size=DIGEST_SIZE).digest(), "little")
    return d or 1


def segment_event_id(sandbox: str, episode: str, segment_index: int) -> str:
    """Deterministic event id of a replay segment: the hex of
    ``uuid.uuid5(SEGMENT_NAMESPACE, f"{sandbox}/{episode}/{segment_index}")``, computed as
    uuid5 does (SHA-1 of namespace + name, first 16 bytes, version 5 and RFC 4122 variant
    bits) without building the UUID object (once per segment written)."""
    h = bytearray(hashlib.sha1(_SEGMENT_NS + f"{sandbox}/{episode}/{segment_index}".encode(),
                               usedforsecurity=False).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50
    h[8] = (h[8] & 0x3F) | 0x80
    return h.hex()


_SEGMENT_NS = SEGMENT_NAMESPACE.bytes


def episode_key(sandbox: str, episode: str) -> str:
    """The changelog key of an episode's state."""
    return f"{sandbox}/{episode}"


# -- input and outputs ---------------------------------------------------------------------
class InEvent(NamedTuple):
    """One decoded input event, reduced to what the core needs. Cheap to build."""

    task: str
    sandbox: str
    episode: str | None
    seq: int
    event_time_ms: int
    kind: str
    raw: bytes
    """The original single-object-encoded message; goes into segments unchanged. The core
    compares duplicates by its :func:`content_digest`, computed where a duplicate seq can need
    it (an event emitted or buffered, a duplicate compared), not for every event."""
    outcome: str | None = None
    """EpisodeEnd only: "TERMINAL" or "TRUNCATED"."""
    state: str | None = None
    """SandboxLifecycle only: the new lifecycle state."""
    final_seqs: tuple[tuple[str, int], ...] = ()
    """Drained only: (episode, final_seq) pairs."""
    log_time_ms: int = 0
    """When the record was written to the log (its Kafka timestamp); 0 when unknown. Timeouts
    the event starts count from it at the earliest (module docstring, "Arrival time")."""

    @classmethod
    def from_decoded(cls, decoded: Any, raw: bytes, log_time_ms: int = 0) -> InEvent:
        """Build from a :class:`trajbus.schemas.codec.Decoded`, the message bytes and the
        record's log timestamp (see :meth:`from_head`)."""
        rec: dict[str, Any] = decoded.record
        return cls.from_head(decoded.kind, rec.get("header") or {}, rec, raw, log_time_ms)

    @classmethod
    def from_head(cls, kind: str, header: dict[str, Any], fields: dict[str, Any], raw: bytes,
                  log_time_ms: int = 0) -> InEvent:
        """Build from the event's kind, header and the body fields the core reads
        (EpisodeEnd's ``outcome``, SandboxLifecycle's ``state``, Drained's ``final_seqs``;
        :meth:`trajbus.schemas.codec.Codec.decode_head` gives the first two), the message
        bytes and the record's log timestamp.

        Never raises on a schema-valid record; odd values (e.g. a negative seq) are left for
        :meth:`ReorderCore.handle` to dead-letter.
        """
        h = header
        outcome = state = None
        final: tuple[tuple[str, int], ...] = ()
        if kind == "EpisodeEnd":
            o = fields.get("outcome")
            outcome = None if o is None else str(getattr(o, "value", o))
        elif kind == "SandboxLifecycle":
            s = fields.get("state")
            state = None if s is None else str(getattr(s, "value", s))
        elif kind == "Drained":
            final = tuple(
                (str(f.get("episode")), int(f.get("final_seq", -1)))
                for f in fields.get("final_seqs") or ()
            )
        return _tnew(cls, (
            h.get("task") or "", h.get("sandbox") or "", h.get("episode"),
            h.get("seq", -1), h.get("event_time_ms", 0), kind, raw, outcome, state, final,
            log_time_ms,
        ))


class SegmentOut(NamedTuple):
    """A contiguous run of one episode's events. ``events`` is empty only for a gap or final
    marker; then ``last_seq == first_seq - 1``."""

    task: str
    sandbox: str
    episode: str
    segment_index: int
    first_seq: int
    last_seq: int
    events: list[bytes]
    gap: tuple[int, int] | None
    is_first: bool
    is_last: bool
    is_terminal: bool
    event_time_ms: int
    """Event time of the segment's last event (of the episode's last emitted event for an
    empty marker)."""


class LateOut(NamedTuple):
    """A valid event that arrived after its place in the stream was given up."""

    task: str
    sandbox: str
    episode: str
    seq: int
    raw: bytes
    reason_code: str  # after_gap | after_close | sandbox_recycled


class DeadLetterOut(NamedTuple):
    """Input the core refuses, with a stable reason code and a human reason."""

    reason_code: str
    reason: str
    raw: bytes
    task: str
    sandbox: str
    episode: str | None
    seq: int
    conflicting_with: bytes | None = None
    """For ``conflicting_duplicate``: the version that was kept, when still buffered."""
    origin: tuple[str, int, int, bytes | None, int] | None = None
    """For an event judged after it was held: its source record's (topic, partition, offset,
    key, log time), as the shell passed them to :meth:`ReorderCore.handle`."""


Origin: TypeAlias = tuple[str, int, int, bytes | None, int]
_Held: TypeAlias = tuple[int, InEvent, Origin | None]  # (arrival, event, origin)


Output: TypeAlias = SegmentOut | LateOut | DeadLetterOut


# -- per-episode state -----------------------------------------------------------------------
class _Ep:
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
        self.ring = array("Q", _ZERO8) * w  # digests of the last w seqs, by seq % w
        self.gaps: list[tuple[int, int]] = []
        # 16-bit digests (_h16) of seqs hist_base .. hist_base + len(hist) - 1 (== next_seq - 1
        # while the history is intact); 0 marks a seq declared missing
        self.hist = array("H")
        self.hist_base = 0


def _h16(digest: int) -> int:
    """The history's 16-bit digest of a content digest (never 0, the gap mark)."""
    return (digest & 0xFFFF) or 1


def _remember(ep: _Ep, seq: int, h: int) -> None:
    """Append seq's history digest; restart the history if it does not end right before seq
    (kept contiguous), and forget its oldest seqs beyond ``HISTORY_MAX``."""
    hist = ep.hist
    if ep.hist_base + len(hist) != seq:
        del hist[:]
        ep.hist_base = seq
    hist.append(h)
    _trim(ep)


def _trim(ep: _Ep) -> None:
    hist = ep.hist
    if len(hist) > HISTORY_MAX:
        cut = len(hist) - HISTORY_MAX + HISTORY_MAX // 8
        del hist[:cut]
        ep.hist_base += cut


_HIST = struct.Struct("<qI")
_ZERO8 = b"\x00" * 8
_FIXED = struct.Struct("<qqqqqqqqqBI")
_STR = struct.Struct("<I")
_PAIR = struct.Struct("<qq")
_BUFHDR = struct.Struct("<qqQI")
_Q = struct.Struct("<q")
_V_EP = b"\x01E"
_V_SB = b"\x01S"
_V_CLOCK = b"\x01C"
_V_HELD = b"\x01H"
# arrival, seq, event time, log time, partition, offset, raw length, flags (_HELD_*)
_HELDHDR = struct.Struct("<qqqqqqIB")
_HELD_NO_EPISODE = 1
_HELD_OUTCOME = 2
_HELD_OVERHEAD = 256  # changelog bytes of a held event besides its raw bytes (an upper bound)


def _pstr(s: str) -> bytes:
    b = s.encode("utf-8")
    return _STR.pack(len(b)) + b


def _ustr(blob: bytes, off: int) -> tuple[str, int]:
    (n,) = _STR.unpack_from(blob, off)
    off += 4
    return blob[off : off + n].decode("utf-8"), off + n


_tnew = tuple.__new__
_I64 = range(-(2**63), 2**63)


def _packable(ev: InEvent) -> bool:
    """Whether a held event's fields fit its changelog record (hand-built events may not)."""
    return (type(ev.task) is str and type(ev.kind) is str
            and (ev.outcome is None or type(ev.outcome) is str)
            and type(ev.log_time_ms) is int and type(ev.event_time_ms) is int
            and type(ev.seq) is int
            and ev.seq in _I64 and ev.event_time_ms in _I64 and ev.log_time_ms in _I64
            and all(type(e) is str and type(f) is int and f in _I64 for e, f in ev.final_seqs))


def _classify(ev: object) -> str:
    """Reason code for an event that made processing raise."""
    if (
        not isinstance(ev, InEvent)
        or type(ev.seq) is not int
        or type(ev.event_time_ms) is not int
        or not isinstance(ev.sandbox, str)
        or not isinstance(ev.episode, str | None)
        or not isinstance(ev.raw, bytes)
    ):
        return "invalid_event"
    return "internal_error"


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


# -- the core --------------------------------------------------------------------------------
class ReorderCore:
    """Pure reorder state machine for one input partition. See the module docstring."""

    def __init__(
        self,
        settings: ReplaySettings,
        *,
        max_segment_events: int | None = None,
        max_segment_bytes: int | None = None,
        max_buffered_bytes_per_episode: int | None = None,
        dedupe_window: int | None = None,
        tombstone_ttl_ms: int | None = None,
        idle_timeout_ms: int | None = None,
        recycle_grace_ms: int | None = None,
        event_time_clock: bool = True,
    ) -> None:
        def opt(value: int | None, name: str, default: int | None) -> int | None:
            if value is not None:
                return value
            got = getattr(settings, name, None)
            return default if got is None else int(got)

        self._timeout = int(settings.gap_timeout_ms)
        self._max_ep = int(settings.max_buffered_per_episode)
        self._max_total = int(settings.max_buffered_total)
        self._max_ep_bytes = opt(max_buffered_bytes_per_episode,
                                 "max_buffered_bytes_per_episode", 4 * 1024 * 1024) or 0
        self._seg_events = opt(max_segment_events, "max_segment_events", 1024) or 1
        self._seg_bytes = opt(max_segment_bytes, "max_segment_bytes", 4 * 1024 * 1024) or 1
        self._w = max(1, opt(dedupe_window, "dedupe_window", 64) or 1)
        self._ttl = opt(tombstone_ttl_ms, "tombstone_ttl_ms", 60 * self._timeout) or 0
        self._idle = opt(idle_timeout_ms, "idle_timeout_ms", None)
        self._grace = opt(recycle_grace_ms, "recycle_grace_ms", self._timeout) or 0
        self._max_open = opt(None, "max_open_episodes_per_sandbox", None) or 0  # 0: no limit

        # False: only tick() moves the clock (processing time, ticks logged by the shell), so
        # a producer whose clock runs ahead cannot time out other episodes' gaps.
        self._event_clock = event_time_clock
        self._clock = 0
        self._now = 0  # arrival time of the event being handled (the clock during ticks)
        self._persisted_clock = 0
        self._eps: dict[tuple[str, str], _Ep] = {}
        self._by_sandbox: dict[str, set[str]] = {}
        self._recycled: dict[str, int] = {}  # sandbox -> grace deadline
        self._gap_heap: list[tuple[int, tuple[str, str]]] = []
        self._timers: list[tuple[int, int, tuple[str, str]]] = []
        self._dirty: set[tuple[str, str | None]] = set()  # deleted eps, recycled sandboxes
        self._dirty_eps: set[_Ep] = set()
        self._next_due = _NEVER  # lower bound of the earliest timer/gap deadline
        self._restored: set[tuple[str, str]] = set()  # keys whose timers are not armed yet
        self._held: dict[str, list[_Held]] = {}  # sandbox -> events held for the limit
        # sandbox -> {episode with held events: the arrival its events are judged at}
        self._held_eps: dict[str, dict[str, int]] = {}
        self._held_bytes: dict[str, int] = {}  # sandbox -> its held events' changelog bytes
        self._held_total = 0
        self._dirty_held: set[str] = set()
        self._restored_held: set[str] = set()
        self._judging = False
        self._buffered = 0
        self._buffered_bytes = 0
        self._c = dict.fromkeys(
            (
                "events", "segments", "duplicates", "duplicates_unverified", "conflicts",
                "gaps", "gap_seqs", "forced_gap_closes", "late", "dead_letters",
                "episodes_opened", "episodes_closed", "episodes_truncated", "recycled",
                "idle_truncated", "ignored", "episodes_refused", "held_events",
            ),
            0,
        )
        self._n_fast = 0

    # -- public API ------------------------------------------------------------------------
    @property
    def clock_ms(self) -> int:
        return self._clock

    def handle(self, ev: InEvent, origin: tuple[Any, ...] | None = None) -> list[Output]:
        """Process one event; returns outputs in emission order. Never raises.

        ``origin``: the event's source record, a tuple whose first four items are its topic,
        partition, offset and key (the shell's record tuple); kept with an event held for the
        per-sandbox limit, for its dead letter."""
        if self._restored or self._restored_held:
            self._arm_restored()
        try:
            _, sandbox, episode, seq, t, kind, raw, outcome, _, _, log_t = ev
            if type(t) is int:
                if t > self._clock and self._event_clock:
                    self._clock = t
                clock = self._clock
                # the arrival time (module docstring); a non-int log time raises below and
                # the event becomes a dead letter
                now = log_t if log_t > clock else clock
                ep = self._eps.get((sandbox, episode))  # type: ignore[arg-type]
                # Fast path: the next expected event of an open episode with nothing buffered
                # (expect is -1 otherwise: a seq of -1 must not match it).
                if (
                    ep is not None
                    and seq == ep.expect >= 0
                    and outcome is None
                    and kind != "EpisodeStart"
                ):
                    # kept for the dedupe window (raises -> dead letter if raw is no bytes)
                    dig = ep.ring[seq % self._w] = content_digest(raw)
                    hist = ep.hist
                    if ep.hist_base + len(hist) == seq and len(hist) < HISTORY_MAX:
                        hist.append((dig & 0xFFFF) or 1)
                    else:
                        _remember(ep, seq, (dig & 0xFFFF) or 1)
                    ep.next_seq = ep.expect = seq + 1
                    idx = ep.seg_index
                    ep.seg_index = idx + 1
                    ep.last_time = t
                    if now > ep.active:  # never backwards: log times of two topics interleave
                        ep.active = now
                    self._dirty_eps.add(ep)
                    self._n_fast += 1
                    out: list[Output] = [
                        _tnew(SegmentOut, (ep.task, sandbox, episode, idx, seq, seq, [raw],
                                           None, idx == 0, False, False, t))
                    ]
                    if self._clock >= self._next_due:
                        self._fire(out)
                    return out
                # Stall path: a plain event beyond the next expected seq of an open episode with
                # no known last seq (it starts or extends the buffer), or the missing seq of a
                # stalled one (it releases what is contiguous). Exactly what _slow does for
                # such an event, minus its checks that cannot fail here; anything unusual
                # (duplicates, bounds reached, ends, odd types) still goes through _slow.
                if (
                    ep is not None
                    and outcome is None
                    and type(seq) is int
                    and seq >= ep.next_seq
                    and ep.stop < 0
                    and (ep.buf is not None or ep.expect >= 0)  # open (not closed)
                    and kind != "EpisodeStart"
                    and kind != "EpisodeEnd"
                    and type(raw) is bytes
                ):
                    buf = ep.buf
                    n = len(raw)
                    self._now = now  # the drain / buffer below may (re)arm a stall timer
                    if seq == ep.next_seq:  # (buf is not None: else the fast path took it)
                        self._c["events"] += 1
                        if now > ep.active:
                            ep.active = now
                        self._dirty_eps.add(ep)
                        out = []
                        self._drain(ep, out, None, (raw, content_digest(raw), t))
                        if self._clock >= self._next_due:
                            self._fire(out)
                        return out
                    if (
                        (buf is None or seq not in buf)
                        and (0 if buf is None else len(buf)) < self._max_ep
                        and ep.buf_bytes + n <= self._max_ep_bytes
                        and self._buffered < self._max_total
                    ):  # buffer it (no bound is reached: nothing to force-close)
                        self._c["events"] += 1
                        if now > ep.active:
                            ep.active = now
                        self._dirty_eps.add(ep)
                        if buf is None:
                            buf = ep.buf = {}
                            ep.expect = -1
                            self._arm_gap(ep)
                        buf[seq] = (raw, content_digest(raw), t)
                        ep.buf_bytes += n
                        self._buffered += 1
                        self._buffered_bytes += n
                        out = []
                        if self._clock >= self._next_due:
                            self._fire(out)
                        return out
                self._now = now
            else:
                ep = None
                self._now = self._clock
            out = []
            self._slow(ev, ep, out, origin)
            if self._clock >= self._next_due:
                self._fire(out)
            return out
        except Exception as exc:  # garbage input or a bug must not take the partition down
            return [self._dl(ev, _classify(ev), f"{type(exc).__name__}: {exc}")]

    def tick(self, now_ms: int) -> list[Output]:
        """Advance the clock to ``now_ms`` (never backwards) and fire due timeouts."""
        out: list[Output] = []
        if self._restored or self._restored_held:
            self._arm_restored()
        if now_ms > self._clock:
            self._clock = now_ms
        self._now = self._clock
        try:
            self._fire(out)
        except Exception as exc:  # pragma: no cover - defensive
            out.append(DeadLetterOut("internal_error", f"tick: {type(exc).__name__}: {exc}",
                                     b"", "", "", None, -1))
        return out

    def counters(self) -> dict[str, int]:
        """Metrics: monotonically increasing counts plus current gauges."""
        c = dict(self._c)
        c["events"] += self._n_fast
        c["segments"] += self._n_fast
        open_eps = sum(1 for e in self._eps.values() if not e.closed)
        c["episodes_open"] = open_eps
        c["tombstones"] = len(self._eps) - open_eps
        c["buffered"] = self._buffered
        c["buffered_bytes"] = self._buffered_bytes
        c["recycled_sandboxes"] = len(self._recycled)
        c["held"] = self._held_total
        return c

    def take_dirty(self) -> dict[str, bytes | None]:
        """Blobs for every key changed since the last call (``None`` = deleted), sorted by key.
        Persist them in the same transaction as the outputs produced since the last call."""
        res: dict[str, bytes | None] = {}
        if self._clock != self._persisted_clock:
            res[CLOCK_KEY] = _V_CLOCK + _Q.pack(self._clock)
            self._persisted_clock = self._clock
        for sb, episode in self._dirty:
            if episode is None:
                dl = self._recycled.get(sb)
                res[f"{sb}/"] = None if dl is None else _V_SB + _Q.pack(dl) + _pstr(sb)
            else:
                ep = self._eps.get((sb, episode))
                res[episode_key(sb, episode)] = None if ep is None else self._pack(ep)
        for ep in self._dirty_eps:
            if self._eps.get(ep.key) is ep:
                res[episode_key(ep.sandbox, ep.episode)] = self._pack(ep)
            elif ep.key not in self._eps:
                res[episode_key(ep.sandbox, ep.episode)] = None
        for sb in self._dirty_held:
            held = self._held.get(sb)
            res[HELD_PREFIX + sb] = self._pack_held(sb, held) if held else None
        self._dirty.clear()
        self._dirty_eps.clear()
        self._dirty_held.clear()
        return dict(sorted(res.items()))

    def snapshot(self) -> dict[str, bytes]:
        """The whole state as changelog blobs (for tests and cold snapshots)."""
        res: dict[str, bytes] = {CLOCK_KEY: _V_CLOCK + _Q.pack(self._clock)}
        for sb, dl in self._recycled.items():
            res[f"{sb}/"] = _V_SB + _Q.pack(dl) + _pstr(sb)
        for ep in self._eps.values():
            res[episode_key(ep.sandbox, ep.episode)] = self._pack(ep)
        for sb, held in self._held.items():
            res[HELD_PREFIX + sb] = self._pack_held(sb, held)
        return dict(sorted(res.items()))

    def restore(self, key: str, blob: bytes | None) -> None:
        """Apply one changelog record (the latest per key wins; ``None`` deletes). Raises
        ``ValueError`` on a blob this version cannot read (fail fast at start-up)."""
        if key.startswith(HELD_PREFIX):
            try:
                sb = key[len(HELD_PREFIX):]
                self._set_held(sb, None if blob is None else self._unpack_held(blob),
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
            if tag == _V_CLOCK:
                self._clock = max(self._clock, _Q.unpack_from(blob, 2)[0])
                self._persisted_clock = self._clock
            elif tag == _V_SB:
                (dl,) = _Q.unpack_from(blob, 2)
                sb, _ = _ustr(blob, 10)
                self._recycled[sb] = dl
                self._restored.add((sb, ""))
            elif tag == _V_EP:
                self._unpack(blob)
            else:
                raise ValueError(f"unknown blob tag {tag!r}")
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"corrupt reorder state for {key!r}: {exc}") from exc

    # -- event processing ------------------------------------------------------------------
    def _dl(self, ev: InEvent, code: str, reason: str, other: bytes | None = None,
            origin: Origin | None = None) -> DeadLetterOut:
        self._c["dead_letters"] += 1
        seq = getattr(ev, "seq", -1)
        raw = getattr(ev, "raw", b"")
        episode = getattr(ev, "episode", None)
        return DeadLetterOut(
            code, reason, bytes(raw) if isinstance(raw, bytes | bytearray) else b"",
            str(getattr(ev, "task", "")), str(getattr(ev, "sandbox", "")),
            episode if isinstance(episode, str) else None, seq if type(seq) is int else -1,
            other, origin)

    def _late(self, ep: _Ep, seq: int, raw: bytes, code: str) -> LateOut:
        self._c["late"] += 1
        return LateOut(ep.task, ep.sandbox, ep.episode, seq, raw, code)

    def _slow(self, ev: InEvent, ep: _Ep | None, out: list[Output],
              origin: tuple[Any, ...] | None = None) -> None:
        c = self._c
        c["events"] += 1
        if not isinstance(ev.sandbox, str) or not ev.sandbox:
            out.append(self._dl(ev, "missing_sandbox", "event has no sandbox id"))
            return
        if not isinstance(ev.raw, bytes):
            out.append(self._dl(ev, "invalid_event", "raw must be bytes"))
            return
        if type(ev.event_time_ms) is not int:
            out.append(self._dl(ev, "invalid_event", f"bad event time {ev.event_time_ms!r}"))
            return
        if ev.episode is None:
            self._sandbox_event(ev, out)
            return
        if not isinstance(ev.episode, str) or not ev.episode:
            out.append(self._dl(ev, "missing_episode", f"{ev.kind}: empty episode id"))
            return
        seq = ev.seq
        if type(seq) is not int or seq < 0:
            out.append(self._dl(ev, "invalid_seq", f"{ev.kind}: invalid seq {seq!r}"))
            return
        if ev.kind == "EpisodeStart" and seq != 0:
            out.append(self._dl(ev, "bad_start_seq", f"EpisodeStart with seq {seq} (must be 0)"))
            return
        if ev.kind == "EpisodeEnd" and seq == 0:  # seq 0 is the EpisodeStart's
            out.append(self._dl(ev, "bad_start_seq", "EpisodeEnd at seq 0: the episode ends "
                                "before it starts"))
            return
        is_end = ev.outcome is not None
        if ev.kind == "EpisodeEnd" and not is_end:
            out.append(self._dl(ev, "missing_outcome", "EpisodeEnd without outcome"))
            return
        if ep is None:
            dl = self._recycled.get(ev.sandbox)
            # a held event is judged as on arrival: against the deadline, not today's clock
            if dl is not None and (self._now if self._judging else self._clock) >= dl:
                self._c["late"] += 1
                out.append(LateOut(ev.task, ev.sandbox, ev.episode, seq, ev.raw,
                                   "sandbox_recycled"))
                return
            if self._max_open and ev.episode is not None:
                open_eps = self._by_sandbox.get(ev.sandbox, ())
                n_open = len(open_eps) - (None in open_eps)
                held_eps = self._held_eps.get(ev.sandbox)
                # held events of the sandbox come first (in log time): hold behind them
                if (n_open >= self._max_open or held_eps) and self._hold(ev, origin):
                    c["events"] -= 1  # counted when judged
                    return
                if n_open >= self._max_open:
                    c["episodes_refused"] += 1
                    out.append(self._dl(ev, "too_many_open_episodes", (
                        f"sandbox {ev.sandbox} already has {n_open} open episodes; "
                        f"{ev.episode} would exceed replay.max_open_episodes_per_sandbox="
                        f"{self._max_open}"),
                        origin=None if origin is None else (*origin[:4], ev.log_time_ms)))
                    return
            ep = _Ep(ev.task, ev.sandbox, ev.episode, self._now, ev.event_time_ms, self._w)
            self._eps[ep.key] = ep
            self._by_sandbox.setdefault(ep.sandbox, set()).add(ep.episode)
            c["episodes_opened"] += 1
            if dl is not None:
                ep.recycle_at = dl
                self._push_timer(dl, _TIMER_RECYCLE, ep.key)
            if self._idle is not None:
                self._push_timer(self._now + self._idle, _TIMER_IDLE, ep.key)
        ns = ep.next_seq
        if seq < ns:
            self._old_seq(ep, ev, seq, out)
            return
        if ep.closed:  # a truncated episode (an ended one has stop < ns)
            if ep.stop >= 0 and seq > ep.stop:
                out.append(self._dl(ev, "seq_after_end",
                                    f"seq {seq} after the episode's last seq {ep.stop}"))
            else:
                out.append(self._late(ep, seq, ev.raw, "after_close"))
            return
        if ep.stop >= 0 and seq > ep.stop:
            what = "EpisodeEnd" if ep.end_seq >= 0 else "drained final seq"
            out.append(self._dl(ev, "seq_after_end", f"seq {seq} after the {what} at {ep.stop}"))
            return
        if self._now > ep.active:
            ep.active = self._now
        self._dirty_eps.add(ep)
        if is_end:
            if ep.end_seq >= 0 and seq != ep.end_seq:
                out.append(self._dl(ev, "conflicting_end",
                                    f"EpisodeEnd at seq {seq}, but the end is seq {ep.end_seq}"))
                return
            if ep.end_seq < 0:
                ep.end_seq = seq
                ep.terminal = ev.outcome == "TERMINAL"
                self._set_stop(ep, seq, out)
        if seq == ns:
            self._drain(ep, out, None, (ev.raw, content_digest(ev.raw), ev.event_time_ms))
            return
        buf = ep.buf
        if buf is None:
            buf = ep.buf = {}
            ep.expect = -1
            self._arm_gap(ep)
        digest = content_digest(ev.raw)  # kept with it, or compared with the buffered one
        have = buf.get(seq)
        if have is not None:
            if have[1] == digest:
                c["duplicates"] += 1
            else:
                c["conflicts"] += 1
                out.append(self._dl(ev, "conflicting_duplicate",
                                    f"seq {seq} already buffered with different content",
                                    have[0]))
            return
        n = len(ev.raw)
        buf[seq] = (ev.raw, digest, ev.event_time_ms)
        ep.buf_bytes += n
        self._buffered += 1
        self._buffered_bytes += n
        while ep.buf and (len(ep.buf) > self._max_ep or ep.buf_bytes > self._max_ep_bytes):
            c["forced_gap_closes"] += 1
            self._close_gap(ep, out)
        while self._buffered > self._max_total and self._gap_heap:
            deadline, key = heapq.heappop(self._gap_heap)
            victim = self._eps.get(key)
            if victim is not None and self._gap_valid(victim, deadline):
                c["forced_gap_closes"] += 1
                self._close_gap(victim, out)

    def _hold(self, ev: InEvent, origin: tuple[Any, ...] | None) -> bool:
        """Hold an event that would open an episode beyond the sandbox's limit, or that comes
        after held events of its sandbox, while its arrival is ahead of the clock (module
        docstring, "Per-sandbox limit"). An event of an episode already held is judged with
        it: at the later of its own arrival and the episode's. False: judge it now (the clock
        has reached it, it is being judged, a bound on held events is reached, or it could
        not be persisted)."""
        if self._judging:
            return False
        sb = ev.sandbox
        eps = self._held_eps.get(sb)
        first = eps.get(ev.episode) if eps else None  # type: ignore[arg-type]
        at = self._now if first is None or first < self._now else first
        if at <= self._clock:
            return False
        held = self._held.get(sb)
        if (not _packable(ev) or (held is not None and len(held) >= self._max_ep)
                or self._held_bytes.get(sb, 0) + len(ev.raw) + _HELD_OVERHEAD
                > self._max_ep_bytes
                or self._buffered + self._held_total >= self._max_total):
            return False
        self._hold_entry(sb, at, ev, None if origin is None else
                         (origin[0], origin[1], origin[2], origin[3], ev.log_time_ms))
        return True

    def _hold_drained(self, ev: InEvent) -> InEvent:
        """A Drained's final seqs of held episodes are held too, judged after those
        episodes' events; returns the Drained with the rest, to apply now."""
        eps = self._held_eps.get(ev.sandbox)
        if not eps or self._judging or not _packable(ev):
            return ev
        later = tuple(f for f in ev.final_seqs if f[0] in eps)
        if not later:
            return ev
        at = max(self._now, *(eps[episode] for episode, _ in later))
        self._hold_entry(ev.sandbox, at, ev._replace(final_seqs=later), None)
        return ev._replace(final_seqs=tuple(f for f in ev.final_seqs if f[0] not in eps))

    def _hold_entry(self, sb: str, at: int, ev: InEvent, origin: Origin | None) -> None:
        held = self._held.get(sb)
        if held is None:
            held = self._held[sb] = []
            self._held_eps[sb] = {}
            self._held_bytes[sb] = 0
        held.append((at, ev, origin))
        if ev.episode is not None:
            self._held_eps[sb].setdefault(ev.episode, at)
        self._held_bytes[sb] += len(ev.raw) + _HELD_OVERHEAD
        self._held_total += 1
        self._c["held_events"] += 1
        self._dirty_held.add(sb)
        self._push_timer(at, _TIMER_HELD, (sb, ""))

    def _judge(self, sb: str, out: list[Output]) -> None:
        """Judge the sandbox's held events the clock has reached, in arrival order (a stable
        sort: the order they were held in among equal arrivals)."""
        held = self._held.get(sb)
        if not held:
            return
        clock = self._clock
        # in arrival order, not the order they were held in: the lagging topic's records of
        # a held episode are held after the leading topic's records of later episodes
        due = sorted((h for h in held if h[0] <= clock), key=lambda h: h[0])
        if not due:
            return
        self._set_held(sb, [h for h in held if h[0] > clock])
        now = self._now
        self._judging = True
        try:
            for arrival, ev, origin in due:
                self._now = arrival
                n0 = len(out)
                if ev.episode is None:  # a Drained's held part: the event was counted
                    self._c["events"] -= 1
                self._slow(ev, self._eps.get((sb, ev.episode)), out, origin)  # type: ignore[arg-type]
                if origin is not None:  # its dead letters name its record, not the tick's
                    for i in range(n0, len(out)):
                        o = out[i]
                        if isinstance(o, DeadLetterOut) and o.origin is None and o.raw is ev.raw:
                            out[i] = o._replace(origin=origin)
        finally:
            self._judging = False
            self._now = now

    def _set_held(self, sb: str, held: list[_Held] | None, dirty: bool = True) -> None:
        """Replace the sandbox's held events (None/empty: none)."""
        old = self._held.pop(sb, None)
        self._held_eps.pop(sb, None)
        self._held_bytes.pop(sb, None)
        if old:
            self._held_total -= len(old)
        if held:
            self._held[sb] = held
            eps: dict[str, int] = {}
            for at, ev, _ in held:
                if ev.episode is not None and at < eps.get(ev.episode, _NEVER):
                    eps[ev.episode] = at
            self._held_eps[sb] = eps
            self._held_bytes[sb] = sum(len(h[1].raw) + _HELD_OVERHEAD for h in held)
            self._held_total += len(held)
        if dirty:
            self._dirty_held.add(sb)

    def _old_seq(self, ep: _Ep, ev: InEvent, seq: int, out: list[Output]) -> None:
        """A seq below next_seq: an emitted duplicate, or late for a closed gap."""
        if ep.next_seq - seq <= self._w:
            have = ep.ring[seq % self._w]
            if have == _GAP_MARK:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
            digest = content_digest(ev.raw)
            if have == digest:
                self._c["duplicates"] += 1
            else:
                self._c["conflicts"] += 1
                out.append(self._dl(ev, "conflicting_duplicate",
                                    f"seq {seq} was already emitted with different content "
                                    f"(digest {have:016x}, this one {digest:016x}); the kept "
                                    "version is in the episode's replay segments"))
            return
        for lo, hi in ep.gaps:
            if lo <= seq <= hi:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
        i = seq - ep.hist_base
        if 0 <= i < len(ep.hist):  # older than the window: its 16-bit digest
            h = ep.hist[i]
            if h == 0:
                out.append(self._late(ep, seq, ev.raw, "after_gap"))
                return
            mine = _h16(content_digest(ev.raw))
            if h == mine:
                self._c["duplicates"] += 1
            else:
                self._c["conflicts"] += 1
                out.append(self._dl(ev, "conflicting_duplicate",
                                    f"seq {seq} was already emitted with different content "
                                    f"({ep.next_seq - seq} seqs back, beyond the dedupe window "
                                    f"of {self._w}: 16-bit digest {h:04x}, this one "
                                    f"{mine:04x}); the kept version is in the episode's "
                                    "replay segments"))
            return
        self._c["duplicates_unverified"] += 1
        out.append(self._dl(ev, "unverified_duplicate",
                            f"seq {seq} was already emitted, {ep.next_seq - seq} seqs back: "
                            "older than the content history kept for the episode (from seq "
                            f"{ep.hist_base}), so it was not compared with the kept version "
                            "and is not used; the kept version is in the episode's replay "
                            "segments"))

    def _sandbox_event(self, ev: InEvent, out: list[Output]) -> None:
        sb = ev.sandbox
        if ev.state == "RECYCLED":
            if sb in self._recycled:
                return
            self._c["recycled"] += 1
            dl = self._now + self._grace
            self._recycled[sb] = dl
            self._dirty.add((sb, None))
            self._push_timer(dl + self._ttl, _TIMER_SANDBOX, (sb, ""))
            for episode in sorted(self._by_sandbox.get(sb, ())):
                rec = self._eps[(sb, episode)]
                if rec.recycle_at < 0:
                    rec.recycle_at = dl
                    self._dirty_eps.add(rec)
                    self._push_timer(dl, _TIMER_RECYCLE, rec.key)
        elif ev.kind == "Drained" and ev.final_seqs:
            ev = self._hold_drained(ev)
            for episode, final in sorted(ev.final_seqs):
                ep = self._eps.get((sb, episode))
                if ep is None or ep.closed or ep.end_seq >= 0 or type(final) is not int:
                    continue
                if final < ep.next_seq - 1 or ep.final_seq >= 0:
                    continue  # contradicts what was emitted, or already known: first wins
                ep.final_seq = final
                self._dirty_eps.add(ep)
                self._set_stop(ep, final, out)
                if ep.next_seq > final and not ep.buf:
                    self._emit(ep, out, [], None, True, ep.last_time)
                    self._close(ep)
        else:
            self._c["ignored"] += 1

    def _set_stop(self, ep: _Ep, stop: int, out: list[Output]) -> None:
        ep.stop = stop
        ep.expect = -1
        buf = ep.buf
        if buf:
            for s in sorted(k for k in buf if k > stop):
                raw, _, _ = buf.pop(s)
                self._unbuffer(ep, len(raw))
                self._c["dead_letters"] += 1
                out.append(DeadLetterOut("seq_after_end", f"seq {s} after the last seq {stop}",
                                         raw, ep.task, ep.sandbox, ep.episode, s))
            if not buf:
                ep.buf = None
                ep.gap_since = -1

    def _unbuffer(self, ep: _Ep, n: int) -> None:
        ep.buf_bytes -= n
        self._buffered -= 1
        self._buffered_bytes -= n

    # -- emission --------------------------------------------------------------------------
    def _emit(self, ep: _Ep, out: list[Output], events: list[bytes], gap: tuple[int, int] | None,
              last: bool, t: int, first_seq: int | None = None) -> None:
        idx = ep.seg_index
        ep.seg_index = idx + 1
        end = ep.next_seq - 1
        first = end - len(events) + 1 if first_seq is None else first_seq
        self._c["segments"] += 1
        out.append(SegmentOut(ep.task, ep.sandbox, ep.episode, idx, first, first + len(events) - 1,
                              events, gap, idx == 0, last, last and ep.terminal, t))

    def _drain(self, ep: _Ep, out: list[Output], gap: tuple[int, int] | None,
               first: tuple[bytes, int, int] | None, final: bool = False) -> None:
        """Emit everything contiguous from next_seq (``first`` is the event at next_seq when it
        did not come from the buffer), with ``gap`` on the first segment. ``final``: the
        episode is being truncated; the segment is the last when nothing remains after it."""
        w = self._w
        ring = ep.ring
        buf = ep.buf
        seq = start = ep.next_seq
        events: list[bytes] = []
        nbytes = 0
        last_t = ep.last_time
        cap_n, cap_b = self._seg_events, self._seg_bytes
        if first is not None:
            raw, dig, last_t = first
            ring[seq % w] = dig
            _remember(ep, seq, _h16(dig))
            events.append(raw)
            nbytes = len(raw)
            seq += 1
        while buf and seq in buf:
            raw, dig, t = buf[seq]
            if events and (len(events) >= cap_n or nbytes + len(raw) > cap_b):
                ep.next_seq = seq
                self._emit(ep, out, events, gap, False, last_t, start)
                gap, events, nbytes, start = None, [], 0, seq
            del buf[seq]
            self._unbuffer(ep, len(raw))
            ring[seq % w] = dig
            _remember(ep, seq, _h16(dig))
            events.append(raw)
            nbytes += len(raw)
            last_t = t
            seq += 1
        ep.next_seq = seq
        ep.last_time = last_t
        if buf is not None:
            if buf:
                self._arm_gap(ep)  # progress while still stalled: restart the stall timer
            else:
                ep.buf = None
                ep.gap_since = -1
        is_last = 0 <= ep.stop < seq or (final and not ep.buf and ep.stop < seq)
        ep.expect = seq if ep.buf is None and ep.stop < 0 else -1
        if events or gap is not None or is_last:
            self._emit(ep, out, events, gap, is_last, last_t, start)
        if is_last:
            self._close(ep)

    def _arm_gap(self, ep: _Ep) -> None:
        ep.gap_since = self._now
        self._push_gap(self._now + self._timeout, ep.key)

    def _push_gap(self, deadline: int, key: tuple[str, str]) -> None:
        heapq.heappush(self._gap_heap, (deadline, key))
        if deadline < self._next_due:
            self._next_due = deadline

    def _push_timer(self, deadline: int, kind: int, key: tuple[str, str]) -> None:
        heapq.heappush(self._timers, (deadline, kind, key))
        if deadline < self._next_due:
            self._next_due = deadline

    def _gap_valid(self, ep: _Ep, deadline: int) -> bool:
        return bool(ep.buf) and not ep.closed and ep.gap_since + self._timeout == deadline

    def _record_gap(self, ep: _Ep, lo: int, hi: int) -> None:
        self._c["gaps"] += 1
        self._c["gap_seqs"] += hi - lo + 1
        w = self._w
        for s in range(max(lo, hi - w + 1), hi + 1):
            ep.ring[s % w] = _GAP_MARK
        if hi - lo < HISTORY_GAP_MAX and ep.hist_base + len(ep.hist) == lo:
            ep.hist.extend(array("H", bytes(2 * (hi - lo + 1))))
            _trim(ep)
        else:
            del ep.hist[:]
            ep.hist_base = hi + 1
        gaps = ep.gaps
        gaps.append((lo, hi))
        if len(gaps) > GAPS_KEPT:
            del gaps[0]

    def _close_gap(self, ep: _Ep, out: list[Output], final: bool = False) -> None:
        """Declare next_seq..(first buffered - 1) missing and stream on from there."""
        assert ep.buf
        lo = ep.next_seq
        nxt = min(ep.buf)
        self._record_gap(ep, lo, nxt - 1)
        ep.next_seq = nxt
        self._dirty_eps.add(ep)
        self._drain(ep, out, (lo, nxt - 1), None, final)

    def _close(self, ep: _Ep) -> None:
        if ep.buf:
            for raw, _, _ in ep.buf.values():
                self._unbuffer(ep, len(raw))
        ep.buf = None
        ep.buf_bytes = 0
        ep.gap_since = -1
        ep.closed = True
        ep.expect = -1
        ep.recycle_at = -1
        ep.expire_at = self._now + self._ttl
        self._c["episodes_closed"] += 1
        if not (ep.end_seq >= 0 and ep.terminal):
            self._c["episodes_truncated"] += 1
        self._push_timer(ep.expire_at, _TIMER_TOMBSTONE, ep.key)
        self._dirty_eps.add(ep)
        eps = self._by_sandbox.get(ep.sandbox)
        if eps is not None:
            eps.discard(ep.episode)
            if not eps:
                del self._by_sandbox[ep.sandbox]

    def _truncate(self, ep: _Ep, out: list[Output]) -> None:
        """Flush everything buffered (closing gaps), then end the episode truncated."""
        while ep.buf and not ep.closed:
            self._close_gap(ep, out, final=True)
        if ep.closed:
            return
        gap = None
        if ep.final_seq >= ep.next_seq:
            gap = (ep.next_seq, ep.final_seq)
            self._record_gap(ep, *gap)
            ep.next_seq = ep.final_seq + 1
        self._emit(ep, out, [], gap, True, ep.last_time)
        self._close(ep)

    def _fire(self, out: list[Output]) -> None:
        """Fire every timer due at the current clock, in (deadline, kind, key) order."""
        self._now = self._clock  # timers re-armed here count from the clock
        self._fire_due(out)
        gh, th = self._gap_heap, self._timers
        self._next_due = min(gh[0][0] if gh else _NEVER, th[0][0] if th else _NEVER)

    def _fire_due(self, out: list[Output]) -> None:
        clock = self._clock
        gh = self._gap_heap
        eps = self._eps
        while gh and gh[0][0] <= clock:
            deadline, key = heapq.heappop(gh)
            ep = eps.get(key)
            if ep is not None and self._gap_valid(ep, deadline):
                self._close_gap(ep, out)
        th = self._timers
        while th and th[0][0] <= clock:
            deadline, kind, key = heapq.heappop(th)
            if kind == _TIMER_SANDBOX:
                sb = key[0]
                if self._recycled.get(sb, -1) + self._ttl == deadline:
                    del self._recycled[sb]
                    self._dirty.add((sb, None))
                continue
            ep = eps.get(key)
            if kind == _TIMER_HELD:
                self._judge(key[0], out)
            elif ep is None:
                continue
            elif kind == _TIMER_TOMBSTONE:
                if ep.closed and ep.expire_at == deadline:
                    self._drop_ep(key)
                    self._dirty.add(key)
            elif ep.closed:
                continue
            elif kind == _TIMER_RECYCLE:
                if ep.recycle_at == deadline:
                    self._dirty_eps.add(ep)
                    self._truncate(ep, out)
            elif kind == _TIMER_IDLE and self._idle is not None:
                due = ep.active + self._idle
                if due == deadline:
                    self._c["idle_truncated"] += 1
                    self._dirty_eps.add(ep)
                    self._truncate(ep, out)
                else:  # activity since: re-arm (fires in true-due order, even if due now)
                    heapq.heappush(th, (due, _TIMER_IDLE, key))
            # the gap heap may have become due again through truncation (timeout 0)
            while gh and gh[0][0] <= clock:
                d2, k2 = heapq.heappop(gh)
                e2 = eps.get(k2)
                if e2 is not None and self._gap_valid(e2, d2):
                    self._close_gap(e2, out)

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

    # -- persistence -----------------------------------------------------------------------
    def _pack(self, ep: _Ep) -> bytes:
        flags = (1 if ep.closed else 0) | (2 if ep.terminal else 0)
        parts = [
            _V_EP, _pstr(ep.task), _pstr(ep.sandbox), _pstr(ep.episode),
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

    def _pack_held(self, sb: str, held: list[_Held]) -> bytes:
        parts = [_V_HELD, _pstr(sb), _STR.pack(len(held))]
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

    def _unpack_held(self, blob: bytes) -> list[_Held]:
        if blob[:2] != _V_HELD:
            raise ValueError(f"unknown blob tag {blob[:2]!r}")
        sb, off = _ustr(blob, 2)
        (n,) = _STR.unpack_from(blob, off)
        off += 4
        held: list[_Held] = []
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

    def _unpack(self, blob: bytes) -> None:
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
        buf: dict[int, tuple[bytes, int, int]] = {}
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

        key = (sb, episode)
        self._drop_ep(key)
        ep = _Ep(task, sb, episode, active, last_t, self._w)
        ep.next_seq, ep.seg_index, ep.gap_since = ns, idx, gap_since
        ep.end_seq, ep.final_seq, ep.recycle_at, ep.expire_at = (
            end_seq, final_seq, recycle_at, expire_at)
        ep.stop = end_seq if end_seq >= 0 else final_seq
        ep.closed, ep.terminal = bool(flags & 1), bool(flags & 2)
        ep.gaps = [(int(lo), int(hi)) for lo, hi in gaps]
        ep.hist, ep.hist_base = hist, hist_base
        old_w = ring_len
        if old_w == self._w:
            ep.ring = old_ring
        else:  # the dedupe window changed: carry over the seqs both windows cover
            for s in range(max(0, ns - min(old_w, self._w)), ns):
                ep.ring[s % self._w] = old_ring[s % old_w]
        self._eps[key] = ep
        ep.expect = -1
        self._restored.add(key)
        if ep.closed:
            return
        self._by_sandbox.setdefault(sb, set()).add(episode)
        if buf:
            ep.buf = buf
            for raw, _, _ in buf.values():
                ep.buf_bytes += len(raw)
                self._buffered += 1
                self._buffered_bytes += len(raw)
        elif ep.stop < 0:
            ep.expect = ns

    def _arm_restored(self) -> None:
        """Arm the timers of every key restored since the last input, once per key, from the
        state it ended up with (a key restored many times gets the timers of the last)."""
        for key in sorted(self._restored):
            if key[1] == "":  # a recycled sandbox
                dl = self._recycled.get(key[0])
                if dl is not None:
                    self._push_timer(dl + self._ttl, _TIMER_SANDBOX, key)
                continue
            ep = self._eps.get(key)
            if ep is None:
                continue
            if ep.closed:
                self._push_timer(ep.expire_at, _TIMER_TOMBSTONE, key)
                continue
            if ep.buf:
                self._push_gap(ep.gap_since + self._timeout, key)
            if ep.recycle_at >= 0:
                self._push_timer(ep.recycle_at, _TIMER_RECYCLE, key)
            if self._idle is not None:
                self._push_timer(ep.active + self._idle, _TIMER_IDLE, key)
        self._restored.clear()
        for sb in sorted(self._restored_held):
            for arrival, _, _ in self._held.get(sb, ()):
                self._push_timer(arrival, _TIMER_HELD, (sb, ""))
        self._restored_held.clear()


# -- ReplaySegment builders ------------------------------------------------------------------
def segment_record(seg: SegmentOut, producer_id: str) -> dict[str, Any]:
    """The Avro record (dict) of the ReplaySegment for ``seg``: encode it with
    ``default_codec().encode("ReplaySegment", record)``. Deterministic: the same segment gives
    the same bytes."""
    return {
        "header": {
            "event_id": segment_event_id(seg.sandbox, seg.episode, seg.segment_index),
            "task": seg.task,
            "sandbox": seg.sandbox,
            "episode": seg.episode,
            "seq": seg.segment_index,
            "event_time_ms": seg.event_time_ms,
            "producer_id": producer_id,
            "policy_version": None,
        },
        "first_seq": seg.first_seq,
        "last_seq": seg.last_seq,
        "events": list(seg.events),
        "gap": None if seg.gap is None else {"from_seq": seg.gap[0], "to_seq": seg.gap[1]},
        "is_first": seg.is_first,
        "is_last": seg.is_last,
        "is_terminal": seg.is_terminal,
    }


def replay_segment(seg: SegmentOut, producer_id: str) -> Any:
    """The :class:`trajbus.schemas.models.ReplaySegment` model for ``seg`` (validated; use
    :func:`segment_record` on hot paths)."""
    from trajbus.schemas.models import ReplaySegment

    return ReplaySegment.model_validate(segment_record(seg, producer_id))
