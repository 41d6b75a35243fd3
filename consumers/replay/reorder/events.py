"""The reorder core's vocabulary: its input event, its outputs, and the deterministic ids and
records built from them (the contract of :mod:`trajbus.consumers.replay.core`). Dead letters
and the content digest are the ones every core shares (:mod:`trajbus.consumers.outputs`,
:mod:`trajbus.bus.digest`)."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, NamedTuple, TypeAlias

from trajbus.bus.digest import DIGEST_SIZE, content_digest
from trajbus.consumers.outputs import DeadLetterOut, Origin

__all__ = [
    "CLOCK_KEY", "DIGEST_SIZE", "HELD_PREFIX", "SEGMENT_NAMESPACE", "DeadLetterOut", "Held",
    "InEvent", "LateOut", "Origin", "Output", "SegmentOut", "content_digest", "episode_key",
    "replay_segment", "segment_event_id", "segment_record",
]

SEGMENT_NAMESPACE = uuid.UUID("6f2b8c1e-3d1a-5b7e-9c4f-2a7d0e5b8f13")
CLOCK_KEY = "@clock"
HELD_PREFIX = "@held/"
"""Changelog key prefix of a sandbox's held events (``"@held/<sandbox>"``)."""

_tnew = tuple.__new__


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
    the event starts count from it at the earliest ("Arrival time" in
    :mod:`trajbus.consumers.replay.core`)."""

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


Held: TypeAlias = tuple[int, InEvent, Origin | None]
"""An event held for the per-sandbox limit: (arrival, event, origin)."""

Output: TypeAlias = SegmentOut | LateOut | DeadLetterOut


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
