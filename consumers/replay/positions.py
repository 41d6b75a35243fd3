"""Where the replay client reads each partition from: the group's commits read at start, the
start position (``start=``) applied to partitions assigned for the first time, and the
progress of a partition taken, from the group's commit and its metadata.

Guarantees: a start position other than ``resume`` is applied once per partition, the first
time this client is assigned it; a partition whose start cannot be resolved then is paused
and resolved again from the fetch loop, never read from the group's commit instead
(``stats["start_positions_retried"]``); a partition taken starts from the group's commit and
skips what its metadata says the member before acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from trajbus.bus import inventory
from trajbus.bus.clients import new_admin, new_consumer
from trajbus.bus.closing import close_client
from trajbus.bus.positions import resolve_offsets
from trajbus.consumers.replay.progress import _PartitionProgress
from trajbus.consumers.replay.state import _REBALANCE_RETRY_S, ClientState

log = logging.getLogger("trajbus.consumers.replay.client")

COMMITTED_AT_START_TIMEOUT_S = 120.0
"""How long ``start()`` waits for the group's coordinator to answer (loading after a restart)."""


class PositionsMixin(ClientState):
    """Start positions and the progress of partitions taken (see the module docstring)."""

    async def _end_offsets_now(self) -> dict[TopicPartition, int]:
        """End offsets of the subscribed partitions that exist now (for ``start="latest"``)."""
        parts = await inventory.partitions_of(self.settings, [], pattern=self.pattern)
        tps = [TopicPartition(t, p) for t, ps in parts.items() for p in ps]
        if not tps:
            return {}
        consumer = new_consumer(self.settings.kafka,
                                enable_auto_commit=False, isolation_level="read_committed")
        await consumer.start()
        try:
            return dict(await consumer.end_offsets(tps))
        finally:
            await close_client(consumer, "offsets consumer")

    async def _apply_start(self, assigned: Iterable[TopicPartition]) -> None:
        """Seek partitions assigned to this client for the first time to the start position
        (nothing to do for ``resume``: the group's committed offsets apply).

        Runs in the assignment callback, where aiokafka only logs an exception and then
        reads the partitions from the group's commit -- for a new group, from the beginning
        the trainer asked to skip. So partitions whose start cannot be resolved now (the
        broker slow or away) are paused, and the fetch loop resolves them again
        (:meth:`_position_pending`); none is read before it is positioned."""
        self._unpositioned.clear()  # a new assignment: its own pauses (aiokafka resets them)
        new = [tp for tp in assigned if tp not in self._positioned]
        if self.start_position == "resume" or not new:
            self._positioned.update(new)
            return
        if self.start_position == "latest":
            # the end as of start(); a topic created since then is read from its beginning
            self._seek_start({tp: self._latest_at_start[tp]
                              for tp in new if tp in self._latest_at_start})
            new = [tp for tp in new if tp not in self._latest_at_start]
        if not new:
            return
        try:
            self._seek_start(await self._resolve_start(new))
        except Exception as exc:
            assert self._consumer is not None
            self._consumer.pause(*new)
            self._unpositioned.update(new)
            self.stats["start_positions_retried"] += 1
            log.warning("replay client %s: the start position (%s) of %d new partition(s) "
                        "could not be resolved (%s: %s); they wait, paused, and it is tried "
                        "again", self.group_id, self.start_position, len(new),
                        type(exc).__name__, exc)

    async def _resolve_start(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        assert self._consumer is not None
        start = self.start_position
        if start == "resume":  # nothing to seek: the group's committed offsets apply
            return {}
        # ``latest`` reaches here only for topics created since start(): from their beginning
        position = "earliest" if start == "latest" else start
        return dict(await resolve_offsets(self._consumer, tps, position))

    def _seek_start(self, targets: dict[TopicPartition, int]) -> None:
        # positioned only once sought
        assert self._consumer is not None
        for tp, offset in targets.items():
            self._consumer.seek(tp, offset)
            self._tenures += 1
            progress = _PartitionProgress(offset, epoch=self._tenures)
            seen = self._committed_at_start.get(tp)
            if seen is not None:  # what a later rebalance compares the group's commit with
                progress.last_committed = (seen.offset, seen.metadata or "")
            self._progress[tp] = progress
            self._positioned.add(tp)

    async def _position_pending(self) -> None:
        """Resolve again the start of partitions paused by :meth:`_apply_start` (at most every
        ``_REBALANCE_RETRY_S`` * 5); resume those positioned. A rebalance meanwhile makes the
        answer moot: its own assignment callback has dealt with them."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_position_try:
            return
        self._next_position_try = loop.time() + _REBALANCE_RETRY_S * 5
        assert self._consumer is not None
        revocations = self._revocations
        pending = sorted(self._unpositioned, key=lambda tp: (tp.topic, tp.partition))
        try:
            targets = await self._resolve_start(pending)
        except Exception as exc:
            log.debug("replay client %s: start position still unresolved (%s: %s)",
                      self.group_id, type(exc).__name__, exc)
            return
        if revocations != self._revocations or self._rebalancing:
            return
        assigned = self._consumer.assignment()
        targets = {tp: off for tp, off in targets.items()
                   if tp in self._unpositioned and tp in assigned}
        self._seek_start(targets)
        self._unpositioned.difference_update(targets)
        self._consumer.resume(*targets)

    async def _progress_for(self, tp: TopicPartition) -> _PartitionProgress:
        """This tenure's progress of ``tp``; a partition just taken starts from the group's
        commit *and its metadata*: the runs beyond the commit point that the member before
        acknowledged are skipped, so a member taking a partition over delivers nothing the
        other acknowledged."""
        progress = self._progress.get(tp)
        if progress is None:
            om = await self._fetch_committed(tp)
            self._tenures += 1
            if om is None:
                progress = _PartitionProgress(0, epoch=self._tenures)
            else:
                progress = _PartitionProgress.from_commit(om.offset, om.metadata or "",
                                                          self._tenures)
            self._progress[tp] = progress
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: took %s[%d] at %s, carried %s, tenure %d",
                          self.group_id, tp.topic, tp.partition,
                          None if om is None else om.offset, progress.carried[:20],
                          progress.epoch)
        return progress

    async def _fetch_committed(self, tp: TopicPartition) -> OffsetAndMetadata | None:
        """The group's commit of ``tp`` with its metadata (None: none). aiokafka's
        ``committed()`` drops the metadata; its coordinator's fetch (what ``committed()``
        calls) keeps it. Without that, the metadata read at ``start()`` serves if the offset
        still matches."""
        assert self._consumer is not None
        coordinator = getattr(self._consumer, "_coordinator", None)
        fetch = getattr(coordinator, "fetch_committed_offsets", None)
        if fetch is not None:
            offsets = await fetch([tp])
            om = offsets.get(tp)
            if om is None or om.offset < 0:
                return None
            return OffsetAndMetadata(om.offset, om.metadata or "")
        committed = await self._consumer.committed(tp)
        if committed is None:
            return None
        start = self._committed_at_start.get(tp)
        if start is not None and start.offset == committed:
            return OffsetAndMetadata(committed, start.metadata or "")
        return OffsetAndMetadata(committed, "")

    async def _load_committed(self) -> None:
        """The group's committed offsets with their metadata (acknowledged-beyond offsets)."""
        from aiokafka.errors import KafkaError

        admin = new_admin(self.settings.kafka, "admin")
        await admin.start()
        try:
            # the coordinator is briefly unavailable on a new cluster, and loading the
            # group's offsets after a restart (retriable errors): retried up to a deadline
            deadline = asyncio.get_running_loop().time() + COMMITTED_AT_START_TIMEOUT_S
            while True:
                try:
                    self._committed_at_start = await admin.list_consumer_group_offsets(
                        self.group_id)
                    return
                except KafkaError as exc:
                    if (not getattr(exc, "retriable", False)
                            or asyncio.get_running_loop().time() >= deadline):
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await admin.close()
