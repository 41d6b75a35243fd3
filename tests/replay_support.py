"""Replay topics filled directly (no worker): one whole-episode ReplaySegment per episode, as
the reorder processor would publish it, with a chosen record timestamp."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from support import Episode

from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, episode_record_key
from trajbus.schemas import models as m


def whole_episode_segment(ep: Episode) -> bytes:
    """The single segment of a complete episode (every event, first, last, terminal)."""
    return m.ReplaySegment(
        header=m.Envelope(event_id=f"seg-{ep.sandbox}-{ep.episode}", task=ep.task,
                          sandbox=ep.sandbox, episode=ep.episode, seq=0,
                          producer_id="test-reorder"),
        first_seq=0, last_seq=ep.n - 1, events=ep.events, is_first=True, is_last=True,
        is_terminal=True).encode()


async def create_replay_topic(settings: Settings, task: str) -> str:
    topics = Topics(settings)
    await ensure_topics(settings, [topics.replay_spec(task, settings.topics.partitions,
                                                      topics.derived_max_bytes)])
    return topics.replay(task)


async def publish_replay(settings: Settings, task: str, episodes: list[Episode],
                         timestamp_ms: int | None = None) -> None:
    """Create ``task``'s replay topic if needed and publish one segment per episode (record
    timestamp ``timestamp_ms``, default now)."""
    topic = await create_replay_topic(settings, task)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                enable_idempotence=True)
    await producer.start()
    try:
        for ep in episodes:
            await producer.send_and_wait(topic, whole_episode_segment(ep),
                                         key=episode_record_key(ep.sandbox, ep.episode),
                                         timestamp_ms=timestamp_ms)
    finally:
        await producer.stop()


def live_segments(ep: Episode) -> list[bytes]:
    """``ep`` as the reorder processor publishes a live episode: one segment per event (each
    event is released as soon as it is in order), the last one closing the episode."""
    out = []
    for i, event in enumerate(ep.events):
        last = i == ep.n - 1
        out.append(m.ReplaySegment(
            header=m.Envelope(event_id=f"seg-{ep.sandbox}-{ep.episode}-{i}", task=ep.task,
                              sandbox=ep.sandbox, episode=ep.episode, seq=i,
                              producer_id="test-reorder"),
            first_seq=i, last_seq=i, events=[event], is_first=i == 0, is_last=last,
            is_terminal=last).encode())
    return out


async def publish_live(settings: Settings, task: str, episodes: list[Episode]) -> int:
    """Create ``task``'s replay topic if needed and publish ``episodes`` live-sized (see
    :func:`live_segments`), one after another. Returns the number of segments."""
    topic = await create_replay_topic(settings, task)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                enable_idempotence=True)
    await producer.start()
    n = 0
    try:
        for ep in episodes:
            key = episode_record_key(ep.sandbox, ep.episode)
            for value in live_segments(ep):
                await producer.send(topic, value, key=key)
                n += 1
        await producer.flush()
    finally:
        await producer.stop()
    return n
