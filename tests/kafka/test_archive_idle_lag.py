"""An idle archiver's consumer-group lag is 0, as Kafka's own `kafka-consumer-groups --describe`
computes it (committed offset vs log-end offset, per partition).

The processors write Tick records (their clock) into the archiver's input partitions every
second, and transactional writers leave commit markers. Before the fix the archiver opened a
batch for them that held no row and was never written, so its committed offset stayed where
the last archived event was: a standard lag exporter saw the group's lag grow while nothing
was left to archive (issue 37: 642 -> 784 per partition in 30 s) and would page.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
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
from trajbus.consumers.engine.runner import TICK_KEY
from trajbus.infra.kafka_runtime import ensure_jars, require_java
from trajbus.schemas.models import Envelope, Tick

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]
T0 = 1_714_557_600_000


def _tick(seq: int) -> bytes:
    return Tick(header=Envelope(task="_tick", sandbox="_tick", seq=seq, event_time_ms=T0 + seq,
                                producer_id="test-ticker")).encode()


async def _produce(bootstrap: str, topic: str, values: list[tuple[bytes, bytes, int | None]],
                   transactional_id: str | None = None) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True,
                         transactional_id=transactional_id)
    await p.start()
    try:
        if transactional_id:
            async with p.transaction():
                for key, value, part in values:
                    await p.send(topic, value, key=key, partition=part)
        else:
            for key, value, part in values:
                await p.send(topic, value, key=key, partition=part)
            await p.flush()
    finally:
        await p.stop()


def kafka_consumer_groups_lag(bootstrap: str, group: str) -> dict[tuple[str, int], int]:
    """LAG per (topic, partition) from Kafka's own tool (the one lag exporters mirror)."""
    out = subprocess.run(
        [require_java(), "-cp", f"{ensure_jars()}/*",
         "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
         "--bootstrap-server", bootstrap, "--describe", "--group", group],
        capture_output=True, text=True, timeout=90, check=False)
    lag: dict[tuple[str, int], int] = {}
    for line in out.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[0] == group and re.fullmatch(r"\d+", cols[2]):
            lag[(cols[1], int(cols[2]))] = int(cols[5]) if cols[5].isdigit() else -1
    assert lag, f"no partitions in: {out.stdout[-800:]} {out.stderr[-800:]}"
    return lag


async def test_an_idle_archiver_commits_past_ticks_and_markers_so_its_lag_reads_0(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=kafka_broker.bootstrap),
                        archive=ArchiveSettings(url=str(tmp_path / "arch"),
                                                spool_dir=str(tmp_path / "spool")))
    topic, group = unique_name, unique_name
    await ensure_topics(settings, [TopicSpec(topic, 2, "test", "sandbox")])
    events = [e for s in range(4) for e in episode_events("web", f"sb-{s}", "ep-0", t0_ms=T0)]
    await _produce(kafka_broker.bootstrap, topic,
                   [(e.header.sandbox.encode(), e.encode(), None) for e in events])
    store = LocalStore(tmp_path / "arch")
    first = await run_archiver(settings, store=store, until_idle=True, topics=[topic],
                               group_id=group, dead_letter=lambda *a: None)
    assert first.rows == len(events)

    # The archiver runs on, idle, while the processors' ticks arrive (and a transactional
    # writer's commit marker lands after the last of them).
    stop = asyncio.Event()
    running = asyncio.create_task(run_archiver(
        settings, stop, store=store, topics=[topic], group_id=group,
        dead_letter=lambda *a: None, poll_timeout_ms=200))
    try:
        await _produce(kafka_broker.bootstrap, topic,
                       [(TICK_KEY, _tick(i), i % 2) for i in range(60)])
        await _produce(kafka_broker.bootstrap, topic,
                       [(TICK_KEY, _tick(100 + i), i % 2) for i in range(4)],
                       transactional_id=f"{unique_name}-txn")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        committed: dict[Any, int] = {}
        while loop.time() < deadline and not running.done():
            # read again each time: the commit markers are written after the transaction's
            # commit returns, and until then the ends (the last stable offsets) stop short
            ends = await end_offsets(settings, [topic])
            log_ends = await end_offsets(settings, [topic], read_committed=False)
            committed = await committed_offsets(settings, group)
            if committed == ends == log_ends:
                break
            await asyncio.sleep(0.3)
        assert committed == ends == log_ends, (
            f"the idle archiver's committed offsets {committed} never reached the ends {ends} "
            f"(log {log_ends}): "
            "its lag grows by the ticks while nothing is left to archive")
        lag = await asyncio.to_thread(kafka_consumer_groups_lag, kafka_broker.bootstrap, group)
        assert lag == {(topic, 0): 0, (topic, 1): 0}, lag
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
    stats = running.result()
    assert stats.rows == 0 and stats.batches == 0  # nothing written for the ticks

    # Data after the idle commits is archived once, and a restart archives nothing twice.
    more = episode_events("web", "sb-9", "ep-1", t0_ms=T0 + 60_000)
    await _produce(kafka_broker.bootstrap, topic,
                   [(e.header.sandbox.encode(), e.encode(), None) for e in more])
    again = await run_archiver(settings, store=store, until_idle=True, topics=[topic],
                               group_id=group, dead_letter=lambda *a: None)
    assert again.rows == len(more)
    total = len(events) + len(more)
    assert ArchiveReader(store).connect().execute(
        "SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (total, total)
