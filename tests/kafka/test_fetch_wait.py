"""A consumer of busy and idle partitions never waits ~fetch_max_wait_ms for records already on
the broker (RELIABILITY finding W).

aiokafka keeps one fetch in flight per broker, and a fetch leaves out the partitions whose
records the process has not taken yet. A worker awaits its transaction between polls; if that
takes longer than aiokafka's prefetch backoff (100 ms), the next fetch can hold only idle
partitions, which the broker parks for ``fetch_max_wait_ms`` while the busy partitions' records
wait behind it. With aiokafka's default (500 ms) every partition of a worker went silent for
~0.5-0.6 s now and then (bench/bench_rebalance.py). ``KafkaSettings.fetch_max_wait_ms`` (100 ms,
used by the worker, the archiver and the trainer client) bounds it."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import connection_options
from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
from trajbus.bus.topics import TopicSpec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(150)]

RUN_S = 12.0
LATE_MS = 450  # well above the 100 ms bound, below the 500 ms default's stalls


async def _late_share(bootstrap: str, busy: str, idle: str, fetch_max_wait_ms: int) -> float:
    """Share of the busy topic's records received more than LATE_MS after their append, by a
    read_committed consumer of both topics that now and then awaits 150 ms between polls."""
    k = KafkaSettings(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(busy, idle, **connection_options(k), enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="latest",
                                group_id=f"{busy}-{fetch_max_wait_ms}",
                                fetch_max_wait_ms=fetch_max_wait_ms, max_poll_records=2000)
    producer = AIOKafkaProducer(**connection_options(k), linger_ms=5)
    await consumer.start()
    await producer.start()
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment():  # joined, positions at the end
            assert time.monotonic() < deadline, "the consumer was never assigned"
            await consumer.getmany(timeout_ms=100)
        stop = asyncio.Event()

        async def produce() -> None:  # a record into each of 6 partitions every 20 ms
            while not stop.is_set():
                for p in range(6):
                    await producer.send(busy, b"x" * 200, partition=p)
                await asyncio.sleep(0.02)

        sender = asyncio.create_task(produce())
        rng = random.Random(7)
        received = late = 0
        end = time.monotonic() + RUN_S
        while time.monotonic() < end:
            batch = await consumer.getmany(timeout_ms=100)
            now_ms = time.time() * 1000
            for msgs in batch.values():
                for m in msgs:
                    received += 1
                    late += now_ms - m.timestamp > LATE_MS
            if rng.random() < 0.1:
                await asyncio.sleep(0.15)  # a long transaction, awaited: the fetcher runs
        stop.set()
        await sender
    finally:
        await producer.stop()
        await consumer.stop()
    assert received > 1000, f"only {received} records received"
    return late / received


async def test_idle_partitions_do_not_hold_back_the_busy_ones(kafka_broker, unique_name) -> None:
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=kafka_broker.bootstrap),
                        topics=TopicSettings(prefix=unique_name))
    busy, idle = f"{unique_name}.busy", f"{unique_name}.idle"
    append_time = {"message.timestamp.type": "LogAppendTime"}  # as the sandbox topics
    await ensure_topics(settings, [TopicSpec(t, 6, "test", "-", configs=append_time)
                                   for t in (busy, idle)])
    # the mechanism is there: with aiokafka's default the busy records wait behind idle fetches
    with_default = await _late_share(kafka_broker.bootstrap, busy, idle, 500)
    # the setting the worker, archiver and trainer client use
    ours = await _late_share(kafka_broker.bootstrap, busy, idle,
                             settings.kafka.fetch_max_wait_ms)
    print(f"records later than {LATE_MS} ms: {with_default:.1%} with fetch_max_wait_ms=500, "
          f"{ours:.2%} with {settings.kafka.fetch_max_wait_ms}")
    assert settings.kafka.fetch_max_wait_ms <= 100
    assert with_default > 0.02, f"default: {with_default:.1%} late (the mechanism not reproduced)"
    assert ours < 0.005, f"fetch_max_wait_ms={settings.kafka.fetch_max_wait_ms}: {ours:.1%} late"
