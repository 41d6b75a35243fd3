"""Turning a replay record into a :class:`~.items.Segment` for the trainer: decoded, its
events deduplicated against what this member delivered; and the staleness check.

Guarantees: while this member remembers an episode (the last :data:`_REMEMBERED` ones), none
of its events is handed out twice (an event at or below the highest seq delivered is dropped,
and a re-derived copy of an episode delivered whole: ``stats["duplicates_dropped"]``); an
undecodable record or event is counted (``stats["undecodable"]``), never raised. Events are
stale when the oldest policy version among them is more than ``max_staleness`` behind the
trainer's; events without one are never stale.
"""

from __future__ import annotations

from aiokafka import TopicPartition

from trajbus.consumers.replay.items import Segment
from trajbus.consumers.replay.state import ClientState
from trajbus.schemas.codec import Decoded, DecodeError

_REMEMBERED = 200_000  # episodes whose delivery state the client keeps (bounded memory)


class DecodingMixin(ClientState):
    """Records to segments, and staleness (see the module docstring)."""

    def _to_segment(self, tp: TopicPartition, offset: int, value: bytes,
                    timestamp_ms: int = 0, tenure: int = 0) -> Segment | None:
        try:
            decoded = self.codec.decode(value)
        except DecodeError:
            self.stats["undecodable"] += 1
            return None
        rec = decoded.record
        h = rec["header"]
        key = (h["sandbox"], h["episode"] or "")
        if key in self._finished:  # a re-derived copy of an episode already delivered whole
            self.stats["duplicates_dropped"] += len(rec["events"])
            return None
        hwm = self._delivered_hwm.get(key, (-1, tp))[0]
        events: list[Decoded] = []
        for raw in rec["events"]:
            try:
                ev = self.codec.decode(raw)
            except DecodeError:
                self.stats["undecodable"] += 1
                continue
            seq = ev.record["header"]["seq"]
            if seq <= hwm:
                self.stats["duplicates_dropped"] += 1
                continue
            events.append(ev)
            hwm = seq
        if not events and not rec["is_last"] and rec["gap"] is None:
            return None
        self._delivered_hwm[key] = (max(hwm, rec["last_seq"]), tp)
        self._delivered_hwm.move_to_end(key)
        while len(self._delivered_hwm) > _REMEMBERED:  # bounded memory: forget the oldest
            self._delivered_hwm.popitem(last=False)
        if rec["is_last"]:
            self._delivered_hwm.pop(key, None)
            self._finished[key] = tp
            while len(self._finished) > _REMEMBERED:
                self._finished.popitem(last=False)
        gap = rec["gap"]
        return Segment(
            task=h["task"], sandbox=h["sandbox"], episode=h["episode"] or "", index=h["seq"],
            first_seq=events[0].record["header"]["seq"] if events else rec["first_seq"],
            last_seq=rec["last_seq"], events=events,
            gap=(gap["from_seq"], gap["to_seq"]) if gap else None,
            is_first=rec["is_first"], is_last=rec["is_last"], is_terminal=rec["is_terminal"],
            topic=tp.topic, partition=tp.partition, offset=offset, timestamp_ms=timestamp_ms,
            _tenure=tenure,
        )

    def _too_stale(self, events: list[Decoded]) -> bool:
        """The oldest policy version among ``events`` is more than ``max_staleness`` behind
        the trainer's (events without one are never stale)."""
        if self.max_staleness is None or self.current_policy_version is None:
            return False
        versions = [v for ev in events
                    if (v := ev.record["header"].get("policy_version")) is not None]
        if not versions:
            return False
        return bool(self.current_policy_version() - min(versions) > self.max_staleness)
