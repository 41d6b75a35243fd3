"""The replay client's iteration API: :meth:`~.client.ReplayClient.segments` and
:meth:`~.client.ReplayClient.episodes` hand the trainer what the fetch loop reads.

Guarantees: one iterator at a time per client (a new one releases the one before, so two
never share records); an episode is handed out whole once its last segment arrived, or, when
filtered (stale; truncated or gappy with ``drop_truncated`` / ``drop_gappy``), acknowledged
and never handed out; leaving a loop early (``break``, an exception) loses nothing: the
segments of episodes not completed and the records read but not looked at are read again by
the next iterator. ``stats["segments"]`` / ``["events"]`` count what the trainer received,
each once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiokafka import TopicPartition

from trajbus.consumers.replay.items import Episode, Segment
from trajbus.consumers.replay.state import ClientState, _Read


class IterationMixin(ClientState):
    """The trainer's iterators (see the module docstring)."""

    async def segments(self, idle_timeout: float | None = None
                       ) -> AsyncGenerator[Segment, None]:
        """Yield segments as they arrive. Stops after ``idle_timeout`` seconds without data
        (None: run forever). Acknowledge each with :meth:`ack`.

        Leaving the loop early (``break``, an exception) loses nothing: the records read
        from Kafka but not yet handed out are read again by the next iterator of this client
        (the consumer is moved back to them)."""
        read = self._new_read()
        segments = self._read_segments(read, idle_timeout, drop_stale=True)
        try:
            async for seg in segments:
                _count_delivered(self.stats, [seg])
                read.at_trainer = True
                yield seg
                read.at_trainer = False
        finally:
            await self._end_read(read, segments)

    async def episodes(self, idle_timeout: float | None = None
                       ) -> AsyncGenerator[Episode, None]:
        """Yield whole episodes once their last segment arrived. Acknowledge with :meth:`ack`.

        Leaving the loop early (``break``, an exception) loses nothing: the segments of
        episodes not yet complete, and the records read but not yet looked at, are read again
        by the next iterator of this client.

        Memory: the segments of an episode are held until its last one arrives. The engine
        ends every episode -- at its end, its drain, its sandbox's recycling, or truncated
        after ``idle_timeout_ms`` of silence (30 min) -- so this is bounded by the episodes
        open on the engine; a replay topic written by something else that never ends its
        episodes would grow it without bound."""
        read = self._new_read()
        open_eps = read.open_episodes
        segments = self._read_segments(read, idle_timeout)  # staleness: of whole episodes
        try:
            async for seg in segments:
                key = (seg.sandbox, seg.episode)
                ep = open_eps.setdefault(key, Episode(seg.task, seg.sandbox, seg.episode))
                ep.segments.append(seg)
                ep.events.extend(seg.events)
                read.open_segments += 1
                if seg.gap:
                    ep.gaps.append(seg.gap)
                if seg.is_last:
                    ep.is_terminal = seg.is_terminal
                    del open_eps[key]
                    read.open_segments -= len(ep.segments)
                    stale = self._too_stale(ep.events)
                    if stale:
                        self.stats["stale_episodes_dropped"] += 1
                        self.stats["stale_dropped"] += len(ep.events)
                    if (stale or (self.drop_truncated and ep.truncated)
                            or (self.drop_gappy and ep.gaps)):
                        self._acknowledge(ep, by_trainer=False)
                        await self._maybe_commit()
                        continue
                    _count_delivered(self.stats, ep.segments)
                    read.at_trainer = True
                    yield ep
                    read.at_trainer = False
        finally:
            await self._end_read(read, segments)

    async def _end_read(self, read: _Read, segments: AsyncGenerator[Segment, None]) -> None:
        """An iterator ends: its fetch loop ``segments`` is closed, then what it read and did
        not hand out is released (:meth:`_release`)."""
        await segments.aclose()
        self._release(read)

    def _new_read(self) -> _Read:
        """The state of a new iterator. An earlier one that was left without being closed
        (``async for`` ... ``break`` closes it only when the event loop finalizes it, maybe
        after this one has started) is released first, so the two never share records."""
        if self._reading is not None:
            self._release(self._reading)
        self._reads += 1
        read = self._reading = _Read(self._reads, self._revocations)
        return read

    def _release(self, read: _Read) -> None:
        """An iterator ended: what it read from Kafka and did not hand out -- the segments of
        episodes it had not completed, the records of its last batch it had not looked at --
        is read again by the next one. Only those: everything before them was handed out
        (skipped while unacknowledged), acknowledged, or had nothing new."""
        if read.released:
            return
        read.released = True
        if self._reading is read:
            self._reading = None
        rewind = dict(read.unhandled)
        for ep in read.open_episodes.values():
            self._forget_open(read, ep)
            for seg in ep.segments:
                tp = TopicPartition(seg.topic, seg.partition)
                rewind[tp] = min(seg.offset, rewind.get(tp, seg.offset))
        read.open_episodes.clear()
        read.open_segments = 0
        read.unhandled.clear()
        self._acked_event.set()
        if self._consumer is None or not rewind:
            return
        if read.revocations_at_fetch != self._revocations or self._rebalancing:
            # a rebalance since the last fetch (or under way) puts every partition kept back
            # to the group's commit, which none of these offsets is past (none is
            # acknowledged): they are read again without a seek, which would race it
            return
        assigned = self._consumer.assignment()
        for tp, offset in rewind.items():
            if tp in assigned:
                self._consumer.seek(tp, offset)
                self.stats["records_read_again_after_early_exit"] += 1


def _count_delivered(stats: dict[str, int], segments: list[Segment]) -> None:
    """``stats["segments"]`` / ``["events"]``: what the trainer received, each once -- counted
    when handed to it, not when read (``episodes()`` reads the segments of an episode it had
    not completed again after a loop left early, and drops filtered episodes)."""
    stats["segments"] += len(segments)
    stats["events"] += sum(len(seg.events) for seg in segments)
