"""What the demo's (and the soak's) check says when an episode never reached the trainer.

A soak run once failed with two episodes "never reached the trainer" and nothing more
(2026-12-03, `test_soak_short`): whether the worker had written them, whether an open
transaction hid them from read_committed readers, or whether the trainer's consumer had died
(its task's error was discarded) could not be told afterwards. The check now says each."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from aiokafka import AIOKafkaProducer
from support import settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics
from trajbus.pipeline_demo import (
    ReplayTopics,
    View,
    _never_reached,
    _note_reader_failures,
    _unstable_partitions,
)


def test_a_missing_episode_says_what_the_replay_topic_and_the_trainer_hold() -> None:
    view, replay = View(), ReplayTopics()
    view.open[("sb-1", "ep-1")] = [(0, "a"), (1, "b")]
    replay.seqs[("sb-1", "ep-1")] = Counter({(s, f"e{s}"): 1 for s in range(9)})
    replay.closed.add(("sb-1", "ep-1"))
    why = _never_reached("sb-1", "ep-1", 9, view, replay)
    assert why == ("sb-1/ep-1: never reached the trainer (the replay topic holds 9 of its 9 "
                   "events, with its last segment; the trainer had 2)")
    nothing = _never_reached("sb-2", "ep-1", 5, View(), ReplayTopics())
    assert "holds 0 of its 5 events, without its last segment; the trainer had 0" in nothing


def test_a_reader_that_stopped_before_the_run_ended_is_reported_with_its_error() -> None:
    async def scenario() -> list[str]:
        async def fails() -> None:
            raise ConnectionError("coordinator lost")

        async def returns() -> None:
            return None

        async def waits() -> None:
            await asyncio.sleep(60)

        view = View()
        trainer, watcher = asyncio.create_task(fails()), asyncio.create_task(returns())
        await asyncio.sleep(0)
        _note_reader_failures(view, [trainer, watcher])
        running, cancelled = asyncio.create_task(waits()), asyncio.create_task(waits())
        cancelled.cancel()
        await asyncio.sleep(0)
        _note_reader_failures(view, [running, cancelled])  # neither says anything
        running.cancel()
        return view.reader_failures

    assert asyncio.run(scenario()) == [
        "the trainer's consumer failed: ConnectionError: coordinator lost",
        "the watcher's consumer ended early",
    ]


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_an_open_transaction_on_a_replay_partition_is_found(kafka_broker: object,
                                                            unique_name: str) -> None:
    """Records after an open transaction's first one are invisible to every read_committed
    reader (the trainer too) until it ends: the check names such partitions."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    replay = Topics(settings).replay("web-shop")

    async def scenario() -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        await ensure_base_topics(settings, ["web-shop"])
        producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                    transactional_id=f"{unique_name}-txn")
        await producer.start()
        try:
            async with producer.transaction():  # offsets 0-1, marker 2
                for _ in range(2):
                    await producer.send(replay, b"committed", partition=1)
            await producer.begin_transaction()
            for _ in range(3):  # offsets 3-5, not committed yet
                await producer.send(replay, b"open", partition=1)
            await producer.flush()
            during = await _unstable_partitions(settings, [replay])
            await producer.commit_transaction()
        finally:
            await producer.stop()
        return during, await _unstable_partitions(settings, [replay])

    during, after = asyncio.run(scenario())
    assert during == {f"{replay}[1]": (3, 6)}
    assert after == {}
