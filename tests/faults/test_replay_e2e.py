"""Ordered replay end to end: shuffled, duplicated events go through a real broker and a
`trajbus worker` process; a trainer's ReplayClient receives every episode in order, once —
also when the worker is killed with SIGKILL mid-stream, and when the trainer crashes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support import (
    Worker,
    consume_until,
    make_episodes,
    produce,
    settings_for,
    shuffled_with_duplicates,
)

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics
from trajbus.consumers.replay.client import ReplayClient
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def _expected(eps):  # type: ignore[no-untyped-def]
    return {(e.sandbox, e.episode): e.events for e in eps}


async def _trainer_view(settings, group: str, n_episodes: int, *, ack_limit: int | None = None,
                        timeout: float = 90) -> dict[tuple[str, str], list[bytes]]:
    """Episodes as a trainer sees them (events re-encoded bytes compared by event id)."""
    got: dict[tuple[str, str], list[bytes]] = {}
    async with ReplayClient(["task-a"], group, settings) as client:
        async def loop() -> None:
            async for ep in client.episodes(idle_timeout=None):
                got[(ep.sandbox, ep.episode)] = [ev_bytes(ev) for ev in ep.events]
                await client.ack(ep)
                if len(got) >= (ack_limit or n_episodes):
                    return
        await asyncio.wait_for(loop(), timeout)
    return got


def ev_bytes(decoded) -> bytes:  # type: ignore[no-untyped-def]
    return default_codec().encode(decoded.kind, decoded.record)


async def test_shuffled_duplicated_events_replay_in_order_exactly_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    eps = make_episodes(40, seed=1)
    await produce(settings, Topics(settings).sandbox_events, shuffled_with_duplicates(eps, 1))
    worker = Worker(settings, "reorder", log_path=tmp_path / "worker.log").start()
    try:
        got = await _trainer_view(settings, f"{unique_name}-trainer", len(eps))
    finally:
        worker.stop()
    assert got == _expected(eps)


async def test_worker_killed_mid_stream_still_delivers_each_event_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps = make_episodes(120, seed=2)
    stream = shuffled_with_duplicates(eps, 2)
    half = len(stream) // 2
    await produce(settings, topics.sandbox_events, stream[:half])
    worker = Worker(settings, "reorder", log_path=tmp_path / "worker.log").start()
    # Wait until the worker has committed some output, then kill it mid-stream.
    await consume_until(settings, topics.replay("task-a"), lambda v: len(v) >= 10, timeout=60)
    await produce(settings, topics.sandbox_events, stream[half:])
    worker.kill()
    worker = Worker(settings, "reorder", log_path=tmp_path / "worker.log").start()
    try:
        got = await _trainer_view(settings, f"{unique_name}-trainer", len(eps))
    finally:
        worker.stop()
    assert got == _expected(eps)


async def test_trainer_crash_resumes_from_last_acknowledgement(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    eps = make_episodes(30, seed=3)
    await produce(settings, Topics(settings).sandbox_events, shuffled_with_duplicates(eps, 3))
    worker = Worker(settings, "reorder", log_path=tmp_path / "worker.log").start()
    group = f"{unique_name}-trainer"
    try:
        first = await _trainer_view(settings, group, len(eps), ack_limit=12)
        rest = await _trainer_view(settings, group, len(eps) - len(first))
    finally:
        worker.stop()
    assert not set(first) & set(rest), "an acknowledged episode was delivered again"
    assert {**first, **rest} == _expected(eps)
