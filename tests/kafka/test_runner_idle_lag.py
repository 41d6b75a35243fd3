"""An idle worker's consumer-group lag is 0 in Kafka's own tools, also on inputs that a
transactional producer writes (the replay topics: each transaction of the reorder worker
leaves a commit marker after its records).

The runner committed "last record processed + 1"; the marker sits at that offset, so
`kafka-consumer-groups --describe` read lag 1 per such partition for as long as the worker
was idle, and a lag exporter mirroring it would page. Now the position past the marker is
committed once the partition has been idle a moment, and nothing is processed twice or
skipped for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from faults_support import committed_offsets, end_offsets
from support import QuietCore, settings_for
from test_archive_idle_lag import kafka_consumer_groups_lag

from trajbus.bus.admin import ensure_topics
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine.runner import TICK_KEY, ProcessorSpec, Runner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

PARTITIONS = 2


async def _write_in_a_transaction(bootstrap: str, topic: str, n: int, txn_id: str,
                                  first: int = 0) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True,
                                transactional_id=txn_id)
    await producer.start()
    try:
        async with producer.transaction():
            for i in range(first, first + n):
                await producer.send(topic, f"record {i}".encode(), key=b"k",
                                    partition=i % PARTITIONS)
    finally:
        await producer.stop()


async def _until(check: Any, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.3)


SEEN: list[tuple[str, int, int]] = []  # (topic, partition, offset) of each record handled


class CountingCore(QuietCore):
    """No outputs, no state; notes every input record that is not a tick."""

    def handle(self, rec: Any) -> list[object]:
        if rec.key != TICK_KEY:
            SEEN.append((rec.topic, rec.partition, rec.offset))
        return []


def _runner(settings: Any, in_topic: str, tick_topic: str) -> Runner:
    # as the watchdog: its inputs are the replay topics and a ticks topic of its own, where
    # its ticker writes (a tick after the marker in the same partition would hide it); the
    # ticks keep its poll busy every tick interval, the replay partitions stay idle
    spec = ProcessorSpec(name="idle", input_topics=[in_topic, tick_topic], factory=CountingCore,
                         tick_topics=[tick_topic])
    return Runner(settings, spec, "w0")


async def test_an_idle_worker_commits_past_commit_markers_so_its_lag_reads_0(
        kafka_broker: Any, unique_name: str) -> None:
    SEEN.clear()
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    settings.scheduler.tick_interval_ms = 500  # the default is 1 s
    in_topic, tick_topic = f"{unique_name}.in", f"{unique_name}.ticks"
    await ensure_topics(settings, [TopicSpec(in_topic, PARTITIONS, "test input", "key"),
                                   TopicSpec(tick_topic, 1, "test ticks", "key")])
    await _write_in_a_transaction(kafka_broker.bootstrap, in_topic, 10, f"{unique_name}-t")
    runner = _runner(settings, in_topic, tick_topic)
    group = runner.group_id
    running = asyncio.create_task(runner.run())
    try:
        async def records_seen(n: int) -> bool:
            assert not running.done(), running
            return len(SEEN) >= n

        await _until(lambda: records_seen(10), "the 10 records were never processed")
        ticks_at_first = runner.processed - 10

        async def committed_at_log_end() -> bool:
            assert not running.done(), running
            ends = await end_offsets(settings, [in_topic], read_committed=False)
            committed = await committed_offsets(settings, group)
            return {tp: o for tp, o in committed.items() if tp.topic == in_topic} == ends

        await _until(committed_at_log_end,
                     "the idle worker's commit stayed before its inputs' commit markers")
        lag = await asyncio.to_thread(kafka_consumer_groups_lag, kafka_broker.bootstrap, group)
        assert {k: v for k, v in lag.items() if k[0] == in_topic} == {
            (in_topic, 0): 0, (in_topic, 1): 0}, lag
        assert runner.processed > 10 + ticks_at_first  # the ticks kept coming meanwhile

        # records after the idle commit: each processed once, none skipped
        await _write_in_a_transaction(kafka_broker.bootstrap, in_topic, 4, f"{unique_name}-t",
                                      first=10)
        await _until(lambda: records_seen(14), "the records after the idle commit were skipped")
        await _until(committed_at_log_end, "the second transaction's marker was not passed")
        assert len(SEEN) == 14 and len(set(SEEN)) == 14, SEEN
    finally:
        runner.stopping.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
    running.result()

    # a restart resumes from the commit: nothing is processed again
    again = _runner(settings, in_topic, tick_topic)
    await asyncio.wait_for(again.run(until_idle=3.0), timeout=60)
    assert len(SEEN) == 14, SEEN
