"""The bus against a real broker: every event kind round-trips through Kafka, topic creation is
idempotent, the process has one producer, and start-up fails fast with what to set."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest
from aiokafka import AIOKafkaConsumer

from trajbus.bus import producer as shared
from trajbus.bus.admin import ensure_base_topics, ensure_topics
from trajbus.bus.kafka import BrokerUnavailableError, check_broker, connection_options
from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
from trajbus.bus.topics import Topics, TopicSpec
from trajbus.schemas.codec import default_codec
from trajbus.schemas.models import EVENT_MODELS, Envelope
from trajbus.schemas.samples import sample_event

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


def _settings(bootstrap: str, prefix: str) -> Settings:
    return Settings(kafka=KafkaSettings(bootstrap_servers=bootstrap),
                    topics=TopicSettings(prefix=prefix, partitions=2))


async def test_every_event_kind_round_trips_through_kafka(kafka_broker, unique_name) -> None:
    settings = _settings(kafka_broker.bootstrap, unique_name)
    topic = f"{unique_name}.all"
    await ensure_topics(settings, [TopicSpec(topic, 2, "test", "sandbox")])
    sent: dict[str, bytes] = {}
    try:
        producer = await shared.get_producer(settings.kafka)
        futures = []
        for i, kind in enumerate(sorted(EVENT_MODELS)):
            header = Envelope(task="task-a", sandbox=f"sb-{i % 3}", episode="ep-1", seq=i,
                              producer_id="test")
            data = sample_event(kind, header, i).encode()
            sent[kind] = data
            futures.append(await producer.send(topic, data, key=header.sandbox.encode()))
        await asyncio.gather(*futures)
    finally:
        await shared.close_producer()

    received = await _consume(settings, topic, len(sent))
    decoded = {default_codec().decode(v).kind: v for v in received}
    assert decoded == sent


async def test_topic_creation_is_idempotent(kafka_broker, unique_name) -> None:
    settings = _settings(kafka_broker.bootstrap, unique_name)
    created, present = await ensure_base_topics(settings, ["task-a"])
    assert Topics(settings).replay("task-a") in created and not present
    created2, present2 = await ensure_base_topics(settings, ["task-a"])
    assert created2 == [] and sorted(present2) == sorted(created)


async def test_the_producer_is_built_once_per_process(kafka_broker) -> None:
    settings = KafkaSettings(bootstrap_servers=kafka_broker.bootstrap)
    await shared.close_producer()
    before_builds = shared.builds
    first = await shared.get_producer(settings)
    fds_after_first = _open_fds()
    try:
        many = await asyncio.gather(*[shared.get_producer(settings) for _ in range(200)])
        assert all(p is first for p in many)
        assert shared.builds == before_builds + 1
        assert _open_fds() <= fds_after_first + 2  # no client, no sockets per call
    finally:
        await shared.close_producer()


async def test_start_up_fails_fast_and_says_what_to_set() -> None:
    from trajbus.infra.broker import free_port

    settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}", connect_timeout_s=2)
    with pytest.raises(BrokerUnavailableError, match="TRAJBUS_KAFKA__BOOTSTRAP_SERVERS"):
        await check_broker(settings)


async def _consume(settings: Settings, topic: str, n: int, timeout: float = 30) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, **connection_options(settings.kafka),
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    out: list[bytes] = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while len(out) < n and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            out.extend(msg.value for msgs in batch.values() for msg in msgs)
    finally:
        await consumer.stop()
    assert len(out) == n, Counter(default_codec().decode(v).kind for v in out)
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_fleet_input_topics_stamp_records_with_the_brokers_append_time(
        kafka_broker, unique_name) -> None:
    """Processors' timeouts count from a record's log time: on the topics the fleet writes it
    is the broker's clock, whatever timestamp a sandbox (with a wrong clock) sets."""
    import time

    from aiokafka.structs import TopicPartition

    settings = _settings(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings)
    topics = Topics(settings)
    year_2000_ms = 946_684_800_000
    try:
        producer = await shared.get_producer(settings.kafka)
        before = int(time.time() * 1000)
        for topic in (topics.sandbox_events, topics.trace_chunks, topics.control, topics.nodes):
            fut = await producer.send(topic, b"x", key=b"sb", partition=0,
                                      timestamp_ms=year_2000_ms)
            await fut
    finally:
        await shared.close_producer()
    for topic in (topics.sandbox_events, topics.trace_chunks, topics.control, topics.nodes):
        consumer = AIOKafkaConsumer(**connection_options(settings.kafka),
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            msg = await asyncio.wait_for(consumer.getone(), 30)
        finally:
            await consumer.stop()
        assert msg.timestamp >= before - 5_000, topic  # the broker's clock, not year 2000
        assert msg.timestamp_type == 1, topic  # LogAppendTime
