"""A trainer that leaves its loop early loses nothing (against a real broker).

A common trainer loop takes what it needs and leaves: ``async for ep in client.episodes():
... break``, then asks again for the next batch. The iterator has read more from Kafka than
it handed out: the rest of its last fetch, and the first segments of episodes not complete
yet. Before 2026-12-03 those were gone for this client (the consumer had moved past them; a
*restarted* trainer got them back, since they were never acknowledged), so the next call
yielded episodes without their first segments, and the commit point stopped below them for
good. Now the next iterator reads them again: every episode arrives once, whole, in order,
however often the loop is left, and everything acknowledged is committed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from replay_support import (
    check_whole_once,
    create_replay_topic,
    left_over,
    replay_producer,
    wait_until,
)
from support import Episode, make_episodes, settings_for

from trajbus.bus.settings import Settings
from trajbus.bus.topics import episode_record_key
from trajbus.consumers.replay.client import ReplayClient, SyncReplayClient
from trajbus.schemas import models as m

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

TASK = "web-shop"
EPISODES = 8
SEGMENTS = 3  # per episode


def _segment(ep: Episode, index: int) -> bytes:
    """Segment ``index`` of ``SEGMENTS`` of ``ep``, as the reorder processor writes it."""
    per = -(-ep.n // SEGMENTS)
    first, last = index * per, min(ep.n, (index + 1) * per) - 1
    return m.ReplaySegment(
        header=m.Envelope(event_id=f"seg-{ep.episode}-{index}", task=ep.task,
                          sandbox=ep.sandbox, episode=ep.episode, seq=index,
                          producer_id="test-reorder"),
        first_seq=first, last_seq=last, events=ep.events[first:last + 1],
        is_first=index == 0, is_last=index == SEGMENTS - 1, is_terminal=True).encode()


async def _publish_interleaved(settings: Settings, episodes: list[Episode],
                               indexes: range = range(SEGMENTS)) -> None:
    """Every episode's first segment, then every second one, then every last one: when the
    first episode completes, all the others are open."""
    async with replay_producer(settings, TASK) as (producer, topic):
        for index in indexes:
            for ep in episodes:
                await producer.send_and_wait(topic, _segment(ep, index),
                                             key=episode_record_key(ep.sandbox, ep.episode))


def _episodes(n: int, seed: int) -> list[Episode]:
    # at least SEGMENTS events each (make_episodes gives 4 or more)
    return make_episodes(n, seed=seed, task=TASK)


async def _published(kafka_broker: Any, unique_name: str, seed: int
                     ) -> tuple[Settings, list[Episode]]:
    """This test's settings, and EPISODES episodes published interleaved (all segments)."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=seed)
    await _publish_interleaved(settings, published)
    return settings, published


async def test_episodes_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                         unique_name: str) -> None:
    settings, published = await _published(kafka_broker, unique_name, seed=11)
    group = f"{unique_name}-one-at-a-time"
    received = []
    async with ReplayClient(TASK, group, settings) as client:
        for _ in range(EPISODES * 3):  # a bound; every call below yields one episode
            got = None
            async for ep in client.episodes(idle_timeout=3):
                got = ep
                await client.ack(ep)
                break  # not closed here: the event loop finalizes it later
            if got is None:
                break
            received.append(got)
        assert client.stats["records_read_again_after_early_exit"] > 0
        assert client._in_flight == 0
    check_whole_once(published, received)
    assert await left_over(settings, TASK, group) == 0  # every acknowledgement committed


async def test_segments_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                         unique_name: str) -> None:
    settings, published = await _published(kafka_broker, unique_name, seed=12)
    group = f"{unique_name}-segment-at-a-time"
    seen: list[tuple[str, int]] = []
    async with ReplayClient(TASK, group, settings) as client:
        for _ in range(EPISODES * SEGMENTS * 3):
            it = client.segments(idle_timeout=3)
            seg = await anext(it, None)
            if seg is None:
                break
            await it.aclose()  # closed at once this time
            seen.append((seg.episode, seg.index))
            await client.ack(seg)
        assert client.stats["records_read_again_after_early_exit"] > 0
    assert sorted(seen) == sorted({(ep.episode, i) for ep in published
                                   for i in range(SEGMENTS)})
    assert await left_over(settings, TASK, group) == 0


async def test_a_failing_trainer_step_loses_nothing(kafka_broker: Any, unique_name: str) -> None:
    """An exception out of the loop body ends the iterator too: the episodes held unacknowledged
    are the trainer's (never delivered twice); the rest comes to the next loop."""
    settings, published = await _published(kafka_broker, unique_name, seed=13)
    received: list[Any] = []
    async with ReplayClient(TASK, f"{unique_name}-failing", settings) as client:
        with pytest.raises(RuntimeError, match="trainer step failed"):
            async for ep in client.episodes(idle_timeout=3):
                received.append(ep)
                if len(received) == 2:
                    raise RuntimeError("trainer step failed")
                await client.ack(ep)
        await client.ack(received[1])
        async for ep in client.episodes(idle_timeout=3):
            received.append(ep)
            await client.ack(ep)
    check_whole_once(published, received)


def test_sync_client_episodes_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                               unique_name: str) -> None:
    settings, published = asyncio.run(_published(kafka_broker, unique_name, seed=14))
    group = f"{unique_name}-sync"
    received = []
    with SyncReplayClient(TASK, group, settings) as client:
        for _ in range(EPISODES * 3):
            got = None
            for ep in client.episodes(idle_timeout=3):
                got = ep
                client.ack(ep)
                break
            if got is None:
                break
            received.append(got)
        assert client.stats["records_read_again_after_early_exit"] > 0
    check_whole_once(published, received)
    assert asyncio.run(left_over(settings, TASK, group)) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainer_at", ["fetch", "yield"])
async def test_a_partition_moved_away_and_back_under_open_episodes_loses_nothing(
        kafka_broker: Any, unique_name: str, trainer_at: str) -> None:
    """The trainer holds open episodes on both partitions (their first two segments read)
    when a second member joins, takes a partition, and leaves again -- while its iterator
    waits for the last segments (``fetch``), or holds the first episode completed with the
    rest of that fetch still to look at (``yield``). Then it reads on and leaves its loop
    after each episode, as before. Every episode arrives once and whole: the open episodes of
    the partition that moved are read again from the group's commit, not taken for
    duplicates of what was read before the move, and the rest of a fetch made before the
    rebalance is read again, not looked at."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=15)
    await _publish_interleaved(settings, published, range(SEGMENTS - 1))
    group = f"{unique_name}-moved"
    topic = await create_replay_topic(settings, TASK)
    received: list[Any] = []
    async with ReplayClient(TASK, group, settings) as client:
        consumer = client._consumer
        assert consumer is not None
        it = client.episodes(idle_timeout=30)
        first = asyncio.create_task(anext(it))

        def held() -> int:
            read = client._reading
            return 0 if read is None else sum(len(ep.segments)
                                              for ep in read.open_episodes.values())

        await wait_until(lambda: held() == EPISODES * (SEGMENTS - 1), "all open")
        partitions = {seg.partition for ep in client._reading.open_episodes.values()  # type: ignore[union-attr]
                      for seg in ep.segments}
        assert len(partitions) == 2, "the test needs open episodes on both partitions"
        if trainer_at == "yield":
            await _publish_interleaved(settings, published, range(SEGMENTS - 1, SEGMENTS))
            ep = await asyncio.wait_for(first, 30)
            received.append(ep)
            await client.ack(ep)
        both = set(consumer.assignment())
        rebalances = client._revocations
        other = AIOKafkaConsumer(topic, bootstrap_servers=settings.kafka.bootstrap_servers,
                                 group_id=group, enable_auto_commit=False)
        await other.start()  # joins the group: one partition moves to it
        try:
            await wait_until(lambda: len(consumer.assignment()) == 1, "a partition moved")
        finally:
            await other.stop()  # leaves: the partition comes back
        await wait_until(lambda: (set(consumer.assignment()) == both
                                   and client._revocations >= rebalances + 2
                                   and not client._rebalancing), "it came back")
        # the trainer reads the returned partition again from the group's commit: wait until
        # it has (what it held there is read again), then the last segments come
        if trainer_at == "fetch":
            await wait_until(lambda: held() == EPISODES * (SEGMENTS - 1), "read again")
            await _publish_interleaved(settings, published, range(SEGMENTS - 1, SEGMENTS))
            ep = await asyncio.wait_for(first, 30)
        else:
            ep = await asyncio.wait_for(anext(it), 30)
        received.append(ep)
        await client.ack(ep)
        await it.aclose()
        for _ in range(EPISODES * 3):
            got = None
            async for ep in client.episodes(idle_timeout=3):
                got = ep
                await client.ack(ep)
                break
            if got is None:
                break
            received.append(got)
    check_whole_once(published, received)
    assert await left_over(settings, TASK, group) == 0




async def test_episodes_open_beyond_max_in_flight_do_not_stop_delivery(
        kafka_broker: Any, unique_name: str) -> None:
    """``max_in_flight`` bounds what the trainer holds unacknowledged. The segments of
    episodes not complete yet are the client's, not the trainer's: counted against it, 16
    open segments under a bound of 4 stopped ``episodes()`` for good (it waited for acks of
    episodes it could never complete)."""
    # 16 segments before the first last one
    settings, published = await _published(kafka_broker, unique_name, seed=16)
    received: list[Any] = []
    async with ReplayClient(TASK, f"{unique_name}-bounded", settings, max_in_flight=4) as client:

        async def read_all() -> None:
            async for ep in client.episodes(idle_timeout=3):
                received.append(ep)
                await client.ack(ep)

        await asyncio.wait_for(read_all(), 60)
    check_whole_once(published, received)
