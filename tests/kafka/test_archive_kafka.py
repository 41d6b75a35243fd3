"""The archiver against a real broker: until-idle runs archive everything exactly once, dead
letters undecodable records, and commits only what is durable in the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from faults_support import committed_offsets, end_offsets

from trajbus.archive.archiver import run_archiver
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import ArchiveSettings, KafkaSettings, Settings
from trajbus.bus.topics import TopicSpec

pytestmark = pytest.mark.kafka
T0 = 1_714_557_600_000


async def _produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes]]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await p.start()
    try:
        for key, value in values:
            await p.send(topic, value, key=key)
        await p.flush()
    finally:
        await p.stop()


async def test_until_idle_archives_once_and_dead_letters_junk(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=kafka_broker.bootstrap),
                        archive=ArchiveSettings(url=str(tmp_path / "arch"),
                                                spool_dir=str(tmp_path / "spool")))
    topic = unique_name
    await ensure_topics(settings, [TopicSpec(topic, 2, "test", "sandbox")])
    first = [e for s in range(3) for e in episode_events("web", f"sb-{s}", "ep-0", t0_ms=T0,
                                                         trace=b"x" * 100)]
    await _produce(kafka_broker.bootstrap, topic,
                   [(e.header.sandbox.encode(), e.encode()) for e in first]
                   + [(b"sb-0", b"not avro")])
    store = LocalStore(tmp_path / "arch")
    dead: list[tuple[Any, ...]] = []

    def dl(*args: Any) -> None:
        dead.append(args)

    stats = await run_archiver(settings, store=store, dead_letter=dl, until_idle=True,
                               topics=[topic], group_id=unique_name)
    assert stats.rows == len(first) and stats.dead_letters == 1
    assert dead[0][5] == "bad_magic"
    assert sum(stats.committed.values()) == len(first) + 1
    # What the group committed (read from the broker) is durable: every offset below a
    # partition's committed offset is a row of the store or the dead letter, and the commits
    # reach the end of the topic.
    committed = await committed_offsets(settings, unique_name)
    ends = await end_offsets(settings, [topic])
    assert committed == ends
    stored = {(p, o) for p, o in ArchiveReader(store).connect().execute(
        "SELECT kafka_partition, kafka_offset FROM events").fetchall()}
    assert stored | {(d[1], d[2]) for d in dead} == {
        (tp.partition, o) for tp, end in committed.items() for o in range(end)}

    # More events; a second run continues from the committed offsets: nothing twice.
    second = episode_events("web", "sb-0", "ep-1", t0_ms=T0 + 60_000)
    await _produce(kafka_broker.bootstrap, topic,
                   [(e.header.sandbox.encode(), e.encode()) for e in second])
    stats2 = await run_archiver(settings, store=store, dead_letter=dl, until_idle=True,
                                topics=[topic], group_id=unique_name)
    assert stats2.rows == len(second)
    con = ArchiveReader(store).connect()
    total = len(first) + len(second)
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        total, total)
    ep = ArchiveReader(store).episode("web", "sb-0", "ep-1")
    assert ep["seq"].to_pylist() == list(range(len(second)))
