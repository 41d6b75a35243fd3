"""Stopping a Kafka client never ends in a traceback nor leaves its connections open.

aiokafka's ``AIOKafkaConsumer.stop()`` raises ``CancelledError`` when a fetch is pending at
that moment (aio-libs/aiokafka#647): ``Fetcher.close`` cancels each pending fetch task and
awaits it. On a cluster with a node down that is the normal case -- the fetch to that node
sleeps in its retry back-off. These tests put such a back-off in the real fetcher's pending
set of a real consumer and show the raw ``stop()`` failing, then :func:`close_client` closing
the same way cleanly.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from trajbus.bus.closing import close_client

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


async def _consumer_with_fetch_in_backoff(bootstrap: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    await consumer.topics()  # a connection to the node is open
    # what _proc_fetch_request does after a failed fetch: sleep retry_backoff_ms
    backoff = asyncio.ensure_future(asyncio.sleep(3600))
    consumer._fetcher._pending_tasks.add(backoff)
    return consumer


def _open_connections(consumer: AIOKafkaConsumer) -> int:
    return sum(1 for conn in consumer._client._conns.values() if conn.connected())


async def test_aiokafka_stop_raises_cancelled_error_with_a_fetch_in_backoff(kafka_broker) -> None:
    """The upstream bug itself, so that the day aiokafka fixes it this test says so."""
    consumer = await _consumer_with_fetch_in_backoff(kafka_broker.bootstrap)
    assert _open_connections(consumer) >= 1
    with pytest.raises(asyncio.CancelledError):
        await consumer.stop()
    assert _open_connections(consumer) >= 1  # stop() ended before closing its connections
    await consumer._client.close()


async def test_close_client_finishes_the_close_and_raises_nothing(kafka_broker) -> None:
    consumer = await _consumer_with_fetch_in_backoff(kafka_broker.bootstrap)
    assert await close_client(consumer, "test consumer") is True
    assert _open_connections(consumer) == 0
    # and the caller's task is not left marked as cancelled
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_close_client_passes_the_callers_own_cancellation_on(kafka_broker) -> None:
    """A close that hangs is cut by the caller's cancellation: the guard must not swallow
    a CancelledError that was meant for the caller."""
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    await producer.start()
    started = asyncio.Event()
    real_stop = producer.stop

    async def slow_stop() -> None:
        started.set()
        await asyncio.sleep(3600)

    producer.stop = slow_stop  # type: ignore[method-assign]
    closing = asyncio.ensure_future(close_client(producer, "slow producer", timeout=60))
    await asyncio.wait_for(started.wait(), 5)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await real_stop()


async def test_close_client_gives_up_a_hanging_close_after_its_timeout(kafka_broker) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    await producer.start()
    real_stop = producer.stop

    async def hanging_stop() -> None:
        await asyncio.sleep(3600)

    producer.stop = hanging_stop  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await close_client(producer, "hanging producer", timeout=0.5) is False
    assert loop.time() - began < 5
    assert not any(conn.connected() for conn in producer.client._conns.values())
    await real_stop()


async def test_close_client_of_none_or_a_closed_client_is_a_no_op(kafka_broker) -> None:
    assert await close_client(None) is True
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_broker.bootstrap)
    await consumer.start()
    assert await close_client(consumer) is True
    assert await close_client(consumer) is True
