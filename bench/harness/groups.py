"""Watching the reorder worker from outside: its group's committed offsets on the input topic
(``GroupWatch``) and when records of given keys become visible on a replay topic to a
read_committed consumer (``ReplayWatch``)."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

from harness.kafka import kafka_conf


class GroupWatch:
    """The worker group's committed offsets on the input topic, through aiokafka's admin client
    on a private event loop. Not librdkafka's: its admin OffsetFetch can segfault while the
    group's coordinator is not known yet (a fresh broker, a group not joined yet; seen here
    with confluent-kafka 2.16 / librdkafka 2.16, cf. confluent-kafka-python#1982)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        async def start() -> AIOKafkaAdminClient:
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap,
                                        client_id="bench-recovery-watch")
            await admin.start()
            return admin

        self.loop = asyncio.new_event_loop()
        self.admin = self.loop.run_until_complete(asyncio.wait_for(start(), 30))
        self.group = group
        self.topic = topic

    def committed(self, partitions: list[int]) -> dict[int, int]:
        from aiokafka.structs import TopicPartition

        tps = [TopicPartition(self.topic, p) for p in partitions]
        try:
            res = self.loop.run_until_complete(asyncio.wait_for(
                self.admin.list_consumer_group_offsets(self.group, partitions=tps), 5))
        except Exception:  # coordinator not known yet, or a timeout: ask again
            return {}
        return {tp.partition: om.offset for tp, om in res.items() if om is not None}

    def close(self) -> None:
        self.loop.run_until_complete(self.admin.close())
        self.loop.close()

    def wait_caught_up(self, target: dict[int, int], proc: subprocess.Popen[bytes],
                       timeout: float) -> float:
        """Seconds until committed >= target on every partition; raises at the deadline or if
        the worker exits."""
        t = time.monotonic()
        deadline = t + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited ({proc.returncode}) before catching up")
            got = self.committed(sorted(target))
            if all(got.get(p, -1) >= end for p, end in target.items()):
                return time.monotonic() - t
            time.sleep(0.2)
        raise TimeoutError(f"the worker did not catch up within {timeout:.0f} s "
                           f"(committed {self.committed(sorted(target))}, target {target})")


class ReplayWatch:
    """A read_committed consumer of the replay topic, positioned at its end: when does each
    probe's segment become visible?"""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.c = Consumer(kafka_conf(bootstrap, **{
            "group.id": f"bench-recovery-watch-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False, "isolation.level": "read_committed",
            "fetch.wait.max.ms": 20}))
        md = self.c.list_topics(topic, timeout=30).topics[topic]
        parts = sorted(md.partitions)
        ends = {p: self.c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in parts}
        self.c.assign([TopicPartition(topic, p, ends[p]) for p in parts])
        self.c.poll(0.2)  # connect and start fetching before the clock starts

    def wait(self, keys: set[bytes], timeout: float) -> dict[bytes, float]:
        """monotonic time at which each key was first seen; raises at the deadline. The
        first value of each is kept in ``values``."""
        self.values: dict[bytes, bytes] = {}
        seen: dict[bytes, float] = {}
        deadline = time.monotonic() + timeout
        while set(seen) < keys:
            if time.monotonic() > deadline:
                raise TimeoutError(f"probes not served within {timeout:.0f} s: "
                                   f"missing {sorted(k.decode() for k in keys - set(seen))}")
            for msg in self.c.consume(1000, 0.05):
                if msg.error() is not None:
                    continue
                now = time.monotonic()
                k = msg.key()
                if k in keys and k not in seen:
                    seen[k] = now
                    self.values[k] = msg.value()
        return seen

    def close(self) -> None:
        self.c.close()
