"""Kafka from the harness's side, on confluent-kafka: topics, producing a prepared set of
records (``Fleet``), reading a topic whole, end offsets, counting a partition's records.
Separate from the clients under test: what these do is not measured."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
Record = tuple[bytes, bytes, int | None]  # key, value, explicit partition (None: by key)


def kafka_conf(bootstrap: str, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, **extra}


def create_topics(bootstrap: str, names: list[str], partitions: int,
                  compacted: bool = False) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(kafka_conf(bootstrap))
    cfg = {"cleanup.policy": "compact"} if compacted else {}
    fs = admin.create_topics([NewTopic(n, partitions, 1, config=cfg) for n in names])
    for f in fs.values():
        f.result(30)


class Fleet:
    """A producer of prepared records (the fleet's events, probes) to one topic: idempotent,
    large batches, records keyed by sandbox unless a partition is given."""

    def __init__(self, bootstrap: str, topic: str, compression: str,
                 linger_ms: int = 20) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.errors: list[str] = []
        self.producer = Producer(kafka_conf(bootstrap, **{
            "compression.type": compression, "linger.ms": linger_ms, "enable.idempotence": True,
            "partitioner": "murmur2_random", "queue.buffering.max.messages": 1_000_000,
            "batch.size": 1_000_000}))

    def _cb(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.errors.append(str(err))

    def produce(self, records: list[Record], timeout: float) -> None:
        """Every record, acknowledged within ``timeout`` s; raises on a delivery error."""
        for i, (key, value, partition) in enumerate(records):
            kw: dict[str, Any] = {} if partition is None else {"partition": partition}
            while True:
                try:
                    self.producer.produce(self.topic, value, key=key, on_delivery=self._cb, **kw)
                    break
                except BufferError:
                    self.producer.poll(0.05)
            if i % 10_000 == 0:
                self.producer.poll(0)
        if self.producer.flush(timeout) or self.errors:
            raise RuntimeError(f"producing to {self.topic}: {self.errors[:3] or 'flush timed out'}")

    def close(self) -> None:
        self.producer.flush(10)
        del self.producer


def produce_records(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]],
                    compression: str, partition_of: list[int] | None = None) -> None:
    """(key, value) records to ``topic`` (into ``partition_of[i]`` when given), all
    acknowledged within 120 s."""
    Fleet(bootstrap, topic, compression, linger_ms=50).produce(
        [(k, v, None if partition_of is None else partition_of[i])
         for i, (k, v) in enumerate(records)], timeout=120)


def read_topic(bootstrap: str, topic: str, read_committed: bool = True
               ) -> list[tuple[int, bytes | None, bytes]]:
    """Every record of ``topic`` as (partition, key, value), in partition order."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer(kafka_conf(bootstrap, **{
        "group.id": f"bench-check-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "enable.partition.eof": True,
        "isolation.level": "read_committed" if read_committed else "read_uncommitted"}))
    try:
        md = c.list_topics(topic, timeout=30).topics[topic]
        parts = sorted(md.partitions)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        pending = set(parts)
        out: list[tuple[int, bytes | None, bytes]] = []
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for msg in c.consume(5000, 0.5):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    raise RuntimeError(f"reading {topic}: {err}")
                out.append((msg.partition() or 0, msg.key(), msg.value() or b""))
        if pending:
            raise RuntimeError(f"reading {topic}: partitions {sorted(pending)} not read to "
                               "the end in 120 s")
        return out
    finally:
        c.close()


def end_offsets(bootstrap: str, topic: str, partitions: int | None = None) -> dict[int, int]:
    """Partition -> end offset of ``topic`` (of its first ``partitions``, or all it has)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(kafka_conf(bootstrap, **{"group.id": f"bench-offsets-{uuid.uuid4().hex[:6]}"}))
    try:
        parts = (range(partitions) if partitions is not None
                 else sorted(c.list_topics(topic, timeout=30).topics[topic].partitions))
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in parts}
    finally:
        c.close()


def copy_topic(bootstrap: str, src: str, dst: str, compression: str) -> None:
    """dst := src record for record (same partition, key and value)."""
    recs = read_topic(bootstrap, src, read_committed=False)
    produce_records(bootstrap, dst, [(k or b"", v) for _, k, v in recs], compression,
                    partition_of=[p for p, _, _ in recs])


def count_records(bootstrap: str, topic: str) -> tuple[int, int]:
    """(records, tombstones) of partition 0 of ``topic``, read from the start to its end."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(kafka_conf(bootstrap, **{"group.id": f"bench-count-{uuid.uuid4().hex[:6]}",
                                          "enable.auto.commit": False}))
    try:
        end = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)[1]
        c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        n = dead = 0
        pos = -1
        while pos < end - 1:
            for msg in c.consume(10_000, 1.0):
                if msg.error() is None:
                    n += 1
                    dead += msg.value() is None
                    pos = msg.offset()
        return n, dead
    finally:
        c.close()


def when_ready(make: Callable[[], T], patience_s: float = 60) -> T:
    """``make()``, retried while the broker answers that a new topic has no leader yet."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + patience_s
    while True:
        try:
            return make()
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def delete_topic(settings: Any, topic: str) -> None:
    """Delete ``topic`` (``settings``: trajbus Settings, for the connection)."""
    from aiokafka.admin import AIOKafkaAdminClient

    from trajbus.bus.kafka import connection_options

    async def delete() -> None:
        admin = AIOKafkaAdminClient(**connection_options(settings.kafka))
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()

    asyncio.run(delete())
