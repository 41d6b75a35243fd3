"""The runner's transactions never hit the broker's verification race (issue 17).

Kafka 4.x brokers verify a transactional write before appending it (KIP-890 part 1,
``transaction.partition.verification.enable``, on by default): the partition leader asks the
transaction coordinator whether the partition is in the transaction, and the group coordinator
does the same for a TxnOffsetCommit. The broker keeps ONE pending verification per
transactional id and coordinator: a second one arriving while the first waits replaces it, and
the first is answered NETWORK_EXCEPTION. For a produce request of a pre-KIP-890 client
(aiokafka sends produce v7) the broker translates that into NOT_ENOUGH_REPLICAS ("Unable to
verify the partition has been added to the transaction. Underlying error:
NETWORK_EXCEPTION"); for the TxnOffsetCommit into COORDINATOR_NOT_AVAILABLE. aiokafka retries
both after ``retry_backoff_ms`` (100 ms), logging "Got error produce response ... retrying.
Error: NotEnoughReplicasError" or re-discovering the group coordinator.

The runner used to send the input offsets to the transaction while its output and changelog
records were still in flight, so the two verifications raced: ~500 such warnings a minute at
2,000 events/s on a single-broker cluster. It now sends the offsets only once every record of
the transaction is acknowledged. This test drives a live runner for a few seconds of steady
input and asserts that not one produce was retried that way and that the group coordinator
was never re-discovered.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from support import EchoCore, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.producer import close_producer, get_producer
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine.runner import ProcessorSpec, Runner

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(90)]

PARTITIONS = 3
FEED_SECONDS = 6.0
PER_TICK = 10  # records every 10 ms: ~1,000 records/s, transactions back to back


async def test_transactions_are_never_retried_for_unverified_partitions(
        kafka_broker, unique_name, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiokafka")
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    in_topic, out_topic = f"{unique_name}.in", f"{unique_name}.out"
    await ensure_topics(settings, [TopicSpec(in_topic, PARTITIONS, "test input", "key")])
    spec = ProcessorSpec(
        name="echo", input_topics=[in_topic], factory=lambda: EchoCore(out_topic),
        output_topics=lambda: [TopicSpec(out_topic, PARTITIONS, "test output", "key")])
    runner = Runner(settings, spec, "w0")
    worker = asyncio.create_task(runner.run(until_idle=3.0))

    producer = await get_producer(settings.kafka)
    fed = 0
    try:
        started = time.monotonic()
        while time.monotonic() - started < FEED_SECONDS:
            futures = [await producer.send(in_topic, b"v%d" % (fed + i),
                                           key=b"k%d" % ((fed + i) % 60))
                       for i in range(PER_TICK)]
            fed += PER_TICK
            await asyncio.gather(*futures)
            await asyncio.sleep(0.01)
            assert not worker.done(), worker.exception()
    finally:
        await close_producer()
    await asyncio.wait_for(worker, timeout=60)

    assert runner.processed >= fed  # every record went through a committed transaction
    retried = [r.getMessage() for r in caplog.records
               if r.name.startswith("aiokafka") and r.levelno >= logging.WARNING
               and ("NotEnoughReplicas" in r.getMessage()
                    or "Unable to verify" in r.getMessage())]
    assert retried == [], f"{len(retried)} produce retries, e.g. {retried[:3]}"
    rediscovered = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("Discovered coordinator")
                    and "for group id" in r.getMessage()
                    and r.name == "aiokafka.producer.sender"]
    # the transactional producer finds the group's coordinator once; each later lookup
    # followed a TxnOffsetCommit answered COORDINATOR_NOT_AVAILABLE (the same race)
    assert len(rediscovered) <= 1, rediscovered
