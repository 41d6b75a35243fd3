"""The runner's ticker rides out a broker restart, and never dies silently.

Found by the soak under heavy CPU load (2026-12-01, 1 run in ~30 with 6 CPU hogs): the
broker restarted while a freshly restarted worker's ticker was still starting its producer.
The ticker task died with ``KafkaConnectionError`` ('Unable to bootstrap'); nothing noticed,
the worker ran on without ticks (its time-driven rules and the scheduler's watermark stalled),
and at its clean stop the ticker's error skipped closing the clients and made the worker exit 1
("unexpected worker exit").

Here the broker is "away" for the ticker's first attempts (its producer's start fails as a
restarting broker's does), or for a while after it started (its sends fail): the ticks must
still reach every input partition and the worker must stop cleanly. A ticker that cannot start
at all must stop the worker, with its error, and the clients closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, OutOfOrderSequenceNumber
from support import QuietCore, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import connection_options
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine import ticker as ticker_module
from trajbus.consumers.engine.runner import TICK_KEY, ProcessorSpec, Runner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

PARTITIONS = 3


def _is_ticker(producer: AIOKafkaProducer) -> bool:
    return str(producer.client._client_id).endswith("-ticker")


@pytest.fixture
def broker_away_for_ticker(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """The ticker's producer start fails ``starts`` times and its sends fail ``sends`` times,
    as against a broker that is restarting. Other clients are untouched."""
    away = {"starts": 0, "sends": 0, "start_calls": 0}
    real_start, real_send = AIOKafkaProducer.start, AIOKafkaProducer.send

    async def start(self: AIOKafkaProducer) -> None:
        if _is_ticker(self):
            away["start_calls"] += 1
            if away["starts"] > 0:
                away["starts"] -= 1
                raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")
        await real_start(self)

    async def send(self: AIOKafkaProducer, *args: Any, **kwargs: Any) -> Any:
        if _is_ticker(self) and away["sends"] > 0:
            away["sends"] -= 1
            raise KafkaTimeoutError("no metadata for the tick topic (broker away)")
        return await real_send(self, *args, **kwargs)

    monkeypatch.setattr(AIOKafkaProducer, "start", start)
    monkeypatch.setattr(AIOKafkaProducer, "send", send)
    yield away


async def _ticks_per_partition(settings: Any, topic: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        counts = dict.fromkeys(range(PARTITIONS), 0)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, msgs in (await consumer.getmany(timeout_ms=1000)).items():
                counts[tp.partition] += sum(1 for m in msgs if m.key == TICK_KEY)
        return counts
    finally:
        await consumer.stop()


def _runner(settings: Any, unique_name: str) -> tuple[Runner, str]:
    in_topic = f"{unique_name}.in"
    spec = ProcessorSpec(name="quiet", input_topics=[in_topic], factory=QuietCore)
    return Runner(settings, spec, "w0"), in_topic


async def _run(settings: Any, unique_name: str, until_idle: float) -> tuple[Runner, str]:
    runner, in_topic = _runner(settings, unique_name)
    await ensure_topics(settings, [TopicSpec(in_topic, PARTITIONS, "test input", "key")])
    await asyncio.wait_for(runner.run(until_idle=until_idle), timeout=60)
    return runner, in_topic


async def test_a_ticker_that_starts_while_the_broker_restarts_waits_for_it_and_ticks(
        kafka_broker, unique_name, broker_away_for_ticker) -> None:
    broker_away_for_ticker["starts"] = 2  # ~0.75 s of retries (0.25 s, then 0.5 s)
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    settings.scheduler.tick_interval_ms = 200
    _, in_topic = await _run(settings, unique_name, until_idle=3.0)  # raised before the fix
    assert broker_away_for_ticker["start_calls"] == 3
    counts = await _ticks_per_partition(settings, in_topic)
    assert all(n >= 3 for n in counts.values()), counts


async def test_ticks_that_cannot_be_sent_are_skipped_and_the_ticker_goes_on(
        kafka_broker, unique_name, broker_away_for_ticker) -> None:
    broker_away_for_ticker["sends"] = 5  # the first five ticks fail (the broker is away)
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    settings.scheduler.tick_interval_ms = 200
    _, in_topic = await _run(settings, unique_name, until_idle=4.0)  # raised before the fix
    assert broker_away_for_ticker["sends"] == 0
    counts = await _ticks_per_partition(settings, in_topic)
    assert all(n >= 3 for n in counts.values()), counts


async def test_a_ticker_that_cannot_start_stops_the_worker_with_its_error(
        kafka_broker, unique_name, broker_away_for_ticker, monkeypatch) -> None:
    monkeypatch.setattr(ticker_module, "TOPIC_SETUP_PATIENCE_S", 1.0)
    broker_away_for_ticker["starts"] = 1_000
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    runner, in_topic = _runner(settings, unique_name)
    await ensure_topics(settings, [TopicSpec(in_topic, PARTITIONS, "test input", "key")])
    with pytest.raises(KafkaConnectionError):
        # before the fix the worker ran on without ticks (here until the 15 s deadline)
        await asyncio.wait_for(runner.run(until_idle=60.0), timeout=15)
    assert runner._consumer is not None and runner._consumer._closed


async def test_a_ticker_whose_producer_can_no_longer_deliver_starts_a_new_one(
        kafka_broker, unique_name, monkeypatch) -> None:
    """A trial of 2026-12-02: the broker went down right after a worker restored and came
    back a minute later; from then on every tick's delivery failed with
    OutOfOrderSequenceNumber (the idempotent producer had lost a sequence), unread ("Future
    exception was never retrieved", 18 a second), and the watchdog's clock stopped for good.
    Here the ticker's first producer fails every delivery that way."""
    broken: list[AIOKafkaProducer] = []
    starts = {"ticker": 0}
    real_start, real_send = AIOKafkaProducer.start, AIOKafkaProducer.send

    async def start(self: AIOKafkaProducer) -> None:
        if _is_ticker(self):
            starts["ticker"] += 1
            if not broken:
                broken.append(self)
        await real_start(self)

    async def send(self: AIOKafkaProducer, *args: Any, **kwargs: Any) -> Any:
        if broken and self is broken[0]:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(OutOfOrderSequenceNumber())
            return failed
        return await real_send(self, *args, **kwargs)

    monkeypatch.setattr(AIOKafkaProducer, "start", start)
    monkeypatch.setattr(AIOKafkaProducer, "send", send)
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    settings.scheduler.tick_interval_ms = 200
    _, in_topic = await _run(settings, unique_name, until_idle=3.0)
    assert starts["ticker"] == 2  # the broken producer was replaced once
    counts = await _ticks_per_partition(settings, in_topic)
    assert all(n >= 3 for n in counts.values()), counts  # none before the fix
