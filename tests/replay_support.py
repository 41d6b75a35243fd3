"""Replay topics filled directly (no worker): one whole-episode ReplaySegment per episode, as
the reorder processor would publish it, with a chosen record timestamp; and what the trainer
client tests check of what a trainer received."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaProducer
from support import Episode, make_episodes, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, episode_record_key
from trajbus.consumers.replay.client import ReplayClient
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


@asynccontextmanager
async def replay_producer(settings: Settings, task: str
                          ) -> AsyncIterator[tuple[AIOKafkaProducer, str]]:
    """An idempotent producer and ``task``'s replay topic (created if needed); the producer
    is stopped on leaving."""
    topic = await create_replay_topic(settings, task)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                enable_idempotence=True)
    await producer.start()
    try:
        yield producer, topic
    finally:
        await producer.stop()


async def publish_replay(settings: Settings, task: str, episodes: list[Episode],
                         timestamp_ms: int | None = None) -> None:
    """Create ``task``'s replay topic if needed and publish one segment per episode (record
    timestamp ``timestamp_ms``, default now)."""
    async with replay_producer(settings, task) as (producer, topic):
        for ep in episodes:
            await producer.send_and_wait(topic, whole_episode_segment(ep),
                                         key=episode_record_key(ep.sandbox, ep.episode),
                                         timestamp_ms=timestamp_ms)


async def settings_with_replay(bootstrap: str, prefix: str, task: str, episodes: int,
                               seed: int) -> Settings:
    """A test's settings (:func:`support.settings_for`), ``task``'s replay topic holding
    ``episodes`` whole episodes (``make_episodes(episodes, seed)``)."""
    settings = settings_for(bootstrap, prefix)
    await publish_replay(settings, task, make_episodes(episodes, seed=seed, task=task))
    return settings


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
    n = 0
    async with replay_producer(settings, task) as (producer, topic):
        for ep in episodes:
            key = episode_record_key(ep.sandbox, ep.episode)
            for value in live_segments(ep):
                await producer.send(topic, value, key=key)
                n += 1
        await producer.flush()
    return n


# -- what a trainer received ---------------------------------------------------------------
def check_whole_once(published: list[Episode], received: list[Any]) -> None:
    """Each published episode received exactly once, with all its events in seq order."""
    names = [ep.episode for ep in received]
    assert sorted(names) == sorted(ep.episode for ep in published), names
    by_name = {ep.episode: ep for ep in published}
    for ep in received:
        seqs = [ev.record["header"]["seq"] for ev in ep.events]
        assert seqs == list(range(by_name[ep.episode].n)), (ep.episode, seqs)


async def left_over(settings: Settings, task: str, group: str) -> int:
    """Segments of ``task`` a new member of ``group`` reads: what the group has not
    committed (it acknowledges them, so a second call counts only what came since)."""
    async with ReplayClient(task, group, settings) as c:
        n = 0
        async for seg in c.segments(idle_timeout=3):
            n += 1
            await c.ack(seg)
        return n


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` every 50 ms; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)
