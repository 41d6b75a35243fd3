"""The replay client's rebalance listener: what a member commits when partitions are revoked
and what it keeps of its progress when the new assignment arrives.

Guarantee: what was acknowledged is committed before another member may take a partition
(one attempt, bounded by :data:`REVOKE_COMMIT_TIMEOUT_S`); a member keeps its progress on a
partition assigned to it again only if the group's commit is still the last one it made or
saw -- otherwise the partition is read again from the group's commit, whose metadata skips
what the other member acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import ConsumerRebalanceListener, TopicPartition

if TYPE_CHECKING:
    from trajbus.consumers.replay.state import ClientState

log = logging.getLogger("trajbus.consumers.replay.client")

REVOKE_COMMIT_TIMEOUT_S = 10.0  # a revocation's commit (the group's rebalance waits for it)
KEPT_COMMIT_TIMEOUT_S = 30.0  # reading the group's commit of a partition kept in a rebalance


class _GroupRebalancing(Exception):
    """Partitions revoked, the new assignment not yet received: commit after it."""


class _StartAt(ConsumerRebalanceListener):
    def __init__(self, client: ClientState) -> None:
        self.client = client

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        # what was acknowledged is committed before another member may take the partitions:
        # after a commit under way (the rebalance waits for this, so for a bounded time), one
        # attempt; what it cannot carry is lost to the partitions' next readers (counted when
        # a partition goes: stats["acks_lost_in_rebalance"]).
        client = self.client
        # first, before any await: a fetch returned before this point read positions the
        # new assignment resets (aiokafka's getmany waits from here until it is made)
        client._revocations += 1
        client._settled.clear()
        outcome = "nothing to commit"
        if client._commit_error is None:
            try:
                await asyncio.wait_for(client._commit_acknowledged(retry_rebalance=False),
                                       REVOKE_COMMIT_TIMEOUT_S)
                outcome = "acknowledgements committed"
            except Exception as exc:  # the next owner reads from the group's last commit
                outcome = "commit failed"
                log.warning("replay client %s: the commit at revocation failed (%s: %s)",
                            client.group_id, type(exc).__name__, exc)
        else:
            outcome = f"no commit ({type(client._commit_error).__name__} pending)"
        log.info("replay client %s: %d partition(s) revoked (%s)", client.group_id,
                 len(revoked), outcome)
        client._rebalancing = True

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        try:
            await self._take(assigned)
        finally:
            # only now, after the start positions: until then a fetch is read again
            # (see _read_segments), and commits wait
            self.client._rebalancing = False
            self.client._settled.set()

    async def _take(self, assigned: list[TopicPartition]) -> None:
        # Partitions another member holds now: their progress goes (it commits them; a
        # partition that comes back later starts from the group's commit, never from ours).
        # What this member handed out of them is not its own any more (see ReplayClient._lose:
        # acknowledging it returns False; should a partition come back, its records are
        # delivered again unless the group's commit passed them).
        client = self.client
        kept = set(assigned)
        gone = [tp for tp in client._progress if tp not in kept]
        # A partition kept may have been another member's meanwhile (this one was evicted,
        # e.g. its loop blocked beyond the session timeout): if the group's commit is not the
        # last this tenure made (or saw at its start), ours is stale -- never commit it (that
        # would move the group back, or drop the other member's acknowledgements beyond it).
        # A tenure that began with no commit in the group and made none is stale as soon as
        # the group has one. The group's commit unreadable: ours is given up too (its records
        # are read again from the group's commit -- never delivered twice by two members).
        consumer = client._consumer
        for tp in [tp for tp in client._progress if tp in kept]:
            if consumer is None:
                break
            progress = client._progress[tp]
            try:  # aiokafka retries a loading coordinator for ever: bounded here
                om = await asyncio.wait_for(client._fetch_committed(tp),
                                            KEPT_COMMIT_TIMEOUT_S)
            except Exception as exc:
                log.warning("replay client %s: the group's commit of %s[%d] could not be read "
                            "(%s: %s); this member's progress on it is given up and its "
                            "records are read again from the group's commit", client.group_id,
                            tp.topic, tp.partition, type(exc).__name__, exc)
                gone.append(tp)
                continue
            if om is None:
                continue  # none, or gone (expired): nobody else committed since
            if (om.offset, om.metadata or "") != progress.last_committed:
                # (not "ahead of our commit point": a start position sought behind the group's
                # commit is ours until someone else commits)
                gone.append(tp)
        # the episodes an iterator holds open on those partitions are not this member's to
        # complete: their segments are read again from the group's commit if they come back
        log.info("replay client %s: %d partition(s) assigned; %d kept, %d given up (%s)",
                 client.group_id, len(assigned), len(client._progress) - len(gone), len(gone),
                 ", ".join(f"{tp.topic}[{tp.partition}]" for tp in gone) or "none")
        client._lose(gone)
        await client._apply_start(assigned)
