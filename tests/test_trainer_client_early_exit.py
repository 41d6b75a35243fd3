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
from aiokafka import AIOKafkaProducer
from replay_support import create_replay_topic
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


async def _publish_interleaved(settings: Settings, episodes: list[Episode]) -> None:
    """Every episode's first segment, then every second one, then every last one: when the
    first episode completes, all the others are open."""
    topic = await create_replay_topic(settings, TASK)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                enable_idempotence=True)
    await producer.start()
    try:
        for index in range(SEGMENTS):
            for ep in episodes:
                await producer.send_and_wait(topic, _segment(ep, index),
                                             key=episode_record_key(ep.sandbox, ep.episode))
    finally:
        await producer.stop()


def _episodes(n: int, seed: int) -> list[Episode]:
    # at least SEGMENTS events each (make_episodes gives 4 or more)
    return make_episodes(n, seed=seed, task=TASK)


def _check_whole_once(published: list[Episode], received: list[Any]) -> None:
    """Each published episode received exactly once, with all its events in seq order."""
    names = [ep.episode for ep in received]
    assert sorted(names) == sorted(ep.episode for ep in published), names
    by_name = {ep.episode: ep for ep in published}
    for ep in received:
        seqs = [ev.record["header"]["seq"] for ev in ep.events]
        assert seqs == list(range(by_name[ep.episode].n)), (ep.episode, seqs)


async def _left_over(settings: Settings, group: str) -> int:
    async with ReplayClient(TASK, group, settings) as c:
        n = 0
        async for seg in c.segments(idle_timeout=3):
            n += 1
            await c.ack(seg)
        return n


async def test_episodes_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                         unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=11)
    await _publish_interleaved(settings, published)
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
    _check_whole_once(published, received)
    assert await _left_over(settings, group) == 0  # every acknowledgement committed


async def test_segments_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                         unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=12)
    await _publish_interleaved(settings, published)
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
    assert await _left_over(settings, group) == 0


async def test_a_failing_trainer_step_loses_nothing(kafka_broker: Any, unique_name: str) -> None:
    """An exception out of the loop body ends the iterator too: the episodes held unacknowledged
    are the trainer's (never delivered twice); the rest comes to the next loop."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=13)
    await _publish_interleaved(settings, published)
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
    _check_whole_once(published, received)


def test_sync_client_episodes_left_after_each_one_lose_nothing(kafka_broker: Any,
                                                               unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(EPISODES, seed=14)
    asyncio.run(_publish_interleaved(settings, published))
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
    _check_whole_once(published, received)
    assert asyncio.run(_left_over(settings, group)) == 0
