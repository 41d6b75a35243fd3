"""The scheduler has one owner however many workers run it (found by a new-user pass,
2026-12-01).

The scheduler keeps one state for the whole fleet (one core, one state partition). Two workers
started with the default processors split its input with the range assignor: each restored the
whole state, decided on half the events and wrote the same state partition. Its group now
gives every partition to one member; the others stand by and one takes over when it leaves.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import ConsumerProtocol, ConsumerProtocolMemberMetadata
from aiokafka.protocol.group import JoinGroupRequest
from support import Worker, settings_for

from trajbus.bus.admin import ensure_base_topics, ensure_topics
from trajbus.bus.inventory import describe_group
from trajbus.bus.kafka import connection_options
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine.runner import OneMemberAssignor, group_assignors
from trajbus.consumers.operator.tools import fleet_status


class _Cluster(ClusterMetadata):
    def __init__(self, partitions: dict[str, int]) -> None:
        super().__init__()
        self._counts = partitions

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        n = self._counts.get(topic)
        return None if n is None else set(range(n))


def test_every_partition_goes_to_the_first_member() -> None:
    meta = ConsumerProtocolMemberMetadata(0, ["control", "events"], b"")
    members = {"sched.w2-9f": meta, "sched.w1-c3": meta, "sched.w3-01": meta}
    out = OneMemberAssignor.assign(_Cluster({"control": 1, "events": 3}), members)
    assert out["sched.w1-c3"].assignment == [("control", [0]), ("events", [0, 1, 2])]
    assert out["sched.w2-9f"].assignment == [] and out["sched.w3-01"].assignment == []


async def _scheduler_members(settings: Any) -> list[dict[str, Any]]:
    status = await fleet_status(settings)
    return status["processors"]["scheduler"]["members"]


async def _wait(cond: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.5)


def _holding(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in members if any(parts for parts in m["partitions"].values())]


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_two_workers_with_the_default_processors_give_the_scheduler_one_owner(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=4)
    await ensure_base_topics(settings, ["task-a"])
    w1 = Worker(settings, "reorder,watchdog,scheduler", "w1", log_path=tmp_path / "w1.log")
    w2 = Worker(settings, "reorder,watchdog,scheduler", "w2", log_path=tmp_path / "w2.log")
    w1.start()
    try:
        async def one_member() -> list[dict[str, Any]] | None:
            members = await _scheduler_members(settings)
            return members if len(_holding(members)) == 1 else None

        await _wait(one_member, "w1 to own the scheduler")
        w2.start()

        async def both_joined() -> list[dict[str, Any]] | None:
            members = await _scheduler_members(settings)
            return members if len(members) == 2 and _holding(members) else None

        members = await _wait(both_joined, "w2 to join the scheduler's group")
        [owner] = _holding(members)  # never split between the two
        assert "w1" in owner["client_id"], members
        owned = {t: sorted(p) for t, p in owner["partitions"].items()}
        assert owned[f"{unique_name}.sandbox.events"] == [0, 1, 2, 3], owned

        assert w1.stop() == 0  # the owner leaves: the standby takes everything over

        async def w2_owns() -> list[dict[str, Any]] | None:
            members = await _scheduler_members(settings)
            holding = _holding(members)
            return members if len(holding) == 1 and "w2" in holding[0]["client_id"] else None

        members = await _wait(w2_owns, "w2 to take the scheduler over")
        owned = {t: sorted(p) for t, p in _holding(members)[0]["partitions"].items()}
        assert owned[f"{unique_name}.sandbox.events"] == [0, 1, 2, 3], owned
    finally:
        if w1.proc is not None:
            w1.stop()
        if w2.proc is not None:
            w2.stop()
    assert "scheduler: restored" in (tmp_path / "w2.log").read_text()


def _scheduler_consumer(settings: Any, group: str, worker_id: str) -> AIOKafkaConsumer:
    """A consumer joining ``group`` as the scheduler's runner does (static member, the
    assignors of a global processor)."""
    return AIOKafkaConsumer(**connection_options(settings.kafka), group_id=group,
                            client_id=f"{group}-{worker_id}",
                            group_instance_id=f"{group}.{worker_id}",
                            partition_assignment_strategy=group_assignors(True),
                            session_timeout_ms=10_000, heartbeat_interval_ms=500,
                            enable_auto_commit=False)


async def _first_join_only(settings: Any, group: str, worker_id: str, topic: str) -> None:
    """The first JoinGroup a scheduler's consumer sends, and nothing after it: what a worker
    SIGKILLed while joining leaves in its group."""
    client = AIOKafkaClient(**connection_options(settings.kafka))
    await client.bootstrap()
    try:
        node = await client.coordinator_lookup(CoordinationType.GROUP, group)
        first = group_assignors(True)[0]
        response = await client.send(node, JoinGroupRequest(
            group, 10_000, 30_000, "", f"{group}.{worker_id}", ConsumerProtocol.PROTOCOL_TYPE,
            [(first.name, first.metadata({topic}).encode())]))
        assert response.error_code == 0, response
    finally:
        await client.close()


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_worker_killed_while_joining_leaves_the_scheduler_group_settling(
        kafka_broker, unique_name) -> None:
    """w2 dies in the middle of joining (after its first JoinGroup) and is restarted with the
    same --worker-id: the group settles, w1 owns everything, w2 stands by, and no rebalance
    follows. (aiokafka sends one JoinGroup per listed assignor: with two, each member's second
    JoinGroup forced a rebalance on the other, without end.)"""
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=3)
    topic, group = f"{unique_name}.events", f"{unique_name}.scheduler"
    await ensure_topics(settings, [TopicSpec(topic, 3, "input", "sandbox_id")])

    async def poll(consumer: AIOKafkaConsumer) -> None:
        while True:
            await consumer.getmany(timeout_ms=100)

    w1 = _scheduler_consumer(settings, group, "w1")
    w2 = _scheduler_consumer(settings, group, "w2")
    tasks: list[asyncio.Task[None]] = []
    try:
        await w1.start()
        w1.subscribe([topic])
        tasks.append(asyncio.create_task(poll(w1)))

        async def w1_owns() -> bool:
            return len(w1.assignment()) == 3
        await _wait(w1_owns, "w1 to own the group alone")

        await _first_join_only(settings, group, "w2", topic)  # w1 rejoins meanwhile
        await w2.start()  # the restarted w2
        w2.subscribe([topic])
        tasks.append(asyncio.create_task(poll(w2)))

        async def settled() -> bool:
            info = await describe_group(settings, group)
            holding = [m for m in info.members if any(m.assignment.values())]
            # and both members know it (w2's SyncGroup answer may still be on its way when
            # the coordinator already says Stable: its generation reads -1 until then)
            return (info.state == "Stable" and len(info.members) == 2 and len(holding) == 1
                    and holding[0].client_id.endswith("-w1")
                    and w1._coordinator.generation == w2._coordinator.generation >= 0)
        await _wait(settled, "the group to settle with w1 owning everything", timeout=45)

        # then it stays settled: no new generation over 10 heartbeats of both members
        # (aiokafka keeps the member's generation in its coordinator)
        generation = w1._coordinator.generation
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            now = (w1._coordinator.generation, w2._coordinator.generation)
            assert now == (generation, generation), \
                f"the group rebalanced again: generation {generation} -> {now}"
            await asyncio.sleep(0.1)
        assert len(w1.assignment()) == 3 and not w2.assignment()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(w1.stop(), w2.stop(), return_exceptions=True)
