"""A start position inside an episode gives its tail: it is handed out marked, never as a
whole episode (issue 41, item 2: before, an ``Episode`` holding only the tail -- e.g. just
its EpisodeEnd -- looked whole, ``truncated=False``, and nothing said otherwise)."""

from __future__ import annotations

import time

import pytest
from aiokafka import AIOKafkaProducer
from replay_support import create_replay_topic, live_segments
from support import make_episodes, settings_for

from trajbus.bus.topics import episode_record_key
from trajbus.consumers.replay.client import ReplayClient

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


async def test_an_episode_begun_before_the_start_time_is_a_marked_fragment(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name,  # type: ignore[attr-defined]
                            partitions=1)
    topic = await create_replay_topic(settings, "web-shop")
    begun, whole = make_episodes(2, seed=31, task="web-shop", steps=3)
    t_start = int(time.time() * 1000) - 60_000
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers)
    await producer.start()
    try:
        segs = live_segments(begun)
        for i, value in enumerate(segs):  # its first two segments before the start time
            await producer.send_and_wait(topic, value,
                                         key=episode_record_key(begun.sandbox, begun.episode),
                                         timestamp_ms=t_start - 1000 if i < 2 else t_start)
        for value in live_segments(whole):
            await producer.send_and_wait(topic, value,
                                         key=episode_record_key(whole.sandbox, whole.episode),
                                         timestamp_ms=t_start + 1)
    finally:
        await producer.stop()

    async with ReplayClient("web-shop", f"{unique_name}-t", settings, start=t_start) as client:
        got = {}
        async for ep in client.episodes(idle_timeout=3):
            got[ep.episode] = ep
            assert await client.ack(ep)
    assert set(got) == {begun.episode, whole.episode}
    tail = got[begun.episode]
    assert len(tail.events) == begun.n - 2 and not tail.truncated
    assert not tail.complete and tail.fragment_reason == "started_mid_episode"
    assert got[whole.episode].complete and got[whole.episode].fragment_reason is None
    assert len(got[whole.episode].events) == whole.n
