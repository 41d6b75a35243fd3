"""The replay client's acknowledgements and partition tenures: :meth:`~.client.ReplayClient.ack`
records what the trainer consumed; a partition this member loses takes back what it handed
out from it.

Guarantees: an acknowledgement is recorded in its partition's progress (``commits`` commits
it) and releases flow control; ``ack()`` returns True when it is the group's, False when the
item's partition went to another member since it was handed out (that member delivers it
again, whole); acknowledging again changes nothing. A partition lost forgets what this member
delivered and handed out from it, so that should it come back its records are delivered again
unless the group's commit says they were acknowledged; each acknowledgement ``ack()``
returned True for that no commit carried before the partition went is counted
(``stats["acks_lost_in_rebalance"]``) and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from aiokafka import TopicPartition

from trajbus.consumers.replay.items import Episode, Segment
from trajbus.consumers.replay.progress import _PartitionProgress
from trajbus.consumers.replay.state import REBALANCE_COMMIT_TIMEOUT_S, ClientState, _Read

log = logging.getLogger("trajbus.consumers.replay.client")


class AcksMixin(ClientState):
    """Acknowledgements and the end of a partition's tenure (see the module docstring)."""

    async def ack(self, item: Segment | Episode) -> bool:
        """The trainer has consumed this segment (or every segment of this episode).

        Returns True when the acknowledgement is this member's for the group: with per-ack
        commits (``commit_every_ms=0``) once it is committed; with coalesced commits (the
        default, ``commit_every_ms=100``) at once (it is committed in the background, and at
        the latest when a rebalance takes the partition away or the client stops). An
        acknowledgement that returned True and that no commit could carry is delivered again
        to the partition's next reader, and counted: ``stats["acks_lost_in_rebalance"]`` (the
        revocation's commit failed, e.g. the group dropped this member after a broker outage
        before it could commit what it acknowledged during it), ``stats["acks_lost_at_stop"]``
        (the last commit of ``stop()`` failed, e.g. the broker away); a crash loses the
        acknowledgements since the last commit, uncounted. Returns
        False when the item's partition went to another member of the
        group since it was handed out (a member joined or left): that member delivers it
        again, whole, and its acknowledgement is the one that counts; a trainer that wants
        each episode's work to count once discards what it drew from this one. Acknowledging
        again what is acknowledged already changes nothing."""
        tickets = self._acknowledge(item, by_trainer=True)
        await self._maybe_commit()
        if tickets is None:
            return False
        if self.strict_commits:
            return all(progress.durable >= n for _, progress, n in tickets)
        if not self._settled.is_set():
            # a rebalance under way (from the start of the revocation, whose commit may
            # already be made without this ack) decides whether the partition stays
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._settled.wait(), REBALANCE_COMMIT_TIMEOUT_S)
        # the group's if a commit carried it (the revocation's may have, before the
        # partition went), or if the partition is still this member's (its commits will)
        if not all(progress.durable >= n or self._progress.get(tp) is progress
                   for tp, progress, n in tickets):
            return False
        for _, progress, n in tickets:
            progress.promised = max(progress.promised, n)
        return True

    def _acknowledge(self, item: Segment | Episode, by_trainer: bool
                     ) -> list[tuple[TopicPartition, _PartitionProgress, int]] | None:
        """Record the acknowledgement of ``item``'s segments in the progress of their
        partitions; the (partition, progress, acks recorded) of each, or None when a segment
        was handed out under an earlier tenure of its partition (void: see :meth:`_lose`)."""
        segs = item.segments if isinstance(item, Episode) else [item]
        read = self._reading
        tickets: list[tuple[TopicPartition, _PartitionProgress, int]] = []
        void = False
        for seg in segs:
            tp = TopicPartition(seg.topic, seg.partition)
            progress = self._progress.get(tp)
            if progress is None or (seg._tenure and progress.epoch != seg._tenure):
                # its partition went to another member meanwhile, which reads it again
                self.stats["acks_after_partition_moved"] += 1
                void = True
                continue
            owner = self._handed_out.get(tp, {}).pop(seg.offset, None)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replay client %s: ack %s[%d]@%d tenure %d (commit point %d)",
                          self.group_id, tp.topic, tp.partition, seg.offset, progress.epoch,
                          progress.committed)
            if progress.ack(seg.offset):
                # committed now even when it is beyond the commit point (in the metadata): a
                # restart, or the partition's next owner, must not deliver it again
                self._dirty = True
                tickets.append((tp, progress, progress.acks))
            else:  # acknowledged before: by this very tenure (an earlier ack of it)
                tickets.append((tp, progress, 0))
            if owner is None:
                continue  # acknowledged already (or never handed out): not in flight
            self._in_flight -= 1
            if read is not None and owner == read.serial:
                read.own -= 1
                if by_trainer and not read.at_trainer:
                    read.acked_beside = True  # while the loop was fetching or waiting
        self._acked_event.set()
        return None if void else tickets

    def _lose(self, partitions: Iterable[TopicPartition]) -> None:
        """This member's tenure of ``partitions`` ended (they went to another member, or the
        group's commit moved past ours): what it handed out from them is not the trainer's
        to acknowledge any more -- their next reader delivers it again, and an ``ack()`` of
        it returns False -- and what it knew of their episodes (delivered, finished) is
        forgotten, so that should a partition come back, its records are delivered again
        unless the group's commit says they were acknowledged."""
        lost = {tp for tp in partitions}
        if not lost:
            return
        for tp in lost:
            progress = self._progress.pop(tp, None)
            if progress is not None and progress.durable < progress.promised:
                # acknowledged (coalesced commits: ack() returned True), but no commit
                # carried them before the partition went -- the revocation's commit failed:
                # its next reader delivers them again. (Those whose ack() has not returned
                # yet return False.)
                lost_acks = progress.promised - progress.durable
                self.stats["acks_lost_in_rebalance"] += lost_acks
                log.warning("replay client %s: %d acknowledged offset(s) of %s were not "
                            "committed before the partition went to another member (the "
                            "commit at revocation failed); it delivers them again",
                            self.group_id, lost_acks, tp)
        self._drop_open_episodes(lost)
        read = self._reading
        for tp in lost:
            for serial in self._handed_out.pop(tp, {}).values():
                self._in_flight -= 1
                if read is not None and serial == read.serial:
                    read.own -= 1
        for key in [k for k, tp in self._finished.items() if tp in lost]:
            del self._finished[key]
        for key in [k for k, (_, tp) in self._delivered_hwm.items() if tp in lost]:
            del self._delivered_hwm[key]
        self._acked_event.set()

    def _drop_open_episodes(self, partitions: set[TopicPartition]) -> None:
        """Forget the current iterator's open episodes on ``partitions`` (their progress was
        dropped in a rebalance): not in flight, not "delivered" -- read again, they are
        delivered whole."""
        read = self._reading
        if read is None or not partitions:
            return
        for key, ep in list(read.open_episodes.items()):
            if any(TopicPartition(seg.topic, seg.partition) in partitions for seg in ep.segments):
                del read.open_episodes[key]
                self._forget_open(read, ep)
                read.open_segments -= len(ep.segments)
        self._acked_event.set()

    def _forget_open(self, read: _Read, ep: Episode) -> None:
        """An episode an iterator held open is not the trainer's: not in flight, not held
        back from a re-read, not "delivered" (the re-read would drop its events as
        duplicates)."""
        self._delivered_hwm.pop((ep.sandbox, ep.episode), None)
        for seg in ep.segments:
            handed = self._handed_out.get(TopicPartition(seg.topic, seg.partition), {})
            if handed.pop(seg.offset, None) is not None:
                self._in_flight -= 1
                read.own -= 1
