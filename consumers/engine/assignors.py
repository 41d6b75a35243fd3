"""The partition assignors a processor's consumer offers its group."""

from __future__ import annotations

from collections.abc import Mapping

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)


class OneMemberAssignor(RangePartitionAssignor):
    """Every partition to one member of the group: the first by member id (a static member's
    id starts with its instance id, so the worker with the smallest --worker-id). A processor
    with global state (the scheduler) must see all its input in one core; with the range
    assignor a second worker started with the default processors split the scheduler's input
    and wrote the same state partition from two cores. The other members stand by with
    nothing assigned, and one of them takes over when the first leaves or dies."""

    name = "trajbus-one-member"

    @classmethod
    def assign(cls, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]
               ) -> dict[str, ConsumerProtocolMemberAssignment]:
        first = min(members)
        topics = sorted({t for meta in members.values() for t in meta.subscription})
        mine = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        return {member: ConsumerProtocolMemberAssignment(
                    cls.version, mine if member == first else [], b"")
                for member in members}


def group_assignors(global_state: bool) -> tuple[type[RangePartitionAssignor], ...]:
    """The partition assignors a processor's consumer offers its group: range (partition p of
    every input topic to the same member), or :class:`OneMemberAssignor` for a processor with
    global state.

    Exactly one each: aiokafka 0.14 sends one JoinGroup per listed assignor, each with the
    protocols listed so far (aio-libs/aiokafka#1168). With two, once one member waits in a
    join with both protocols while the other joins with the first (a worker killed between
    its two JoinGroups and restarted with the same --worker-id does that), each one's second
    JoinGroup differs from what the coordinator holds for it and forces a new rebalance, and
    the members take turns at that with no end and no owner. A worker of a version that
    offered range alone cannot share a scheduler group with this one (the coordinator refuses
    the later one's join as inconsistent): stop it first; range split the scheduler's state
    anyway."""
    return (OneMemberAssignor,) if global_state else (RangePartitionAssignor,)
