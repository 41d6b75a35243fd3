"""Freshness of the archive (issue 38 item 1): an acknowledged event is queryable within 60 s
(p99), under a steady fleet and on a quiet one (a single late event with nothing after it).

The flush rule: a batch is written once its first row is ``archive.flush_after_ms`` (30 s)
old in the *log's* time -- the Kafka timestamps of later records of its partition and of the
processors' Tick records, or, when nothing follows (a quiet fleet, no processor ticking), the
archiver's timer: the newest log timestamp read plus the time since it was read. The core
never reads a clock; the shell's clock is an argument the pure tests drive.

The broker tests run the continuous archiver (`archive run`, not until-idle) against a real
broker into S3 (moto's server) and poll the archive with `ArchiveReader` as a dashboard would,
with the default settings. Before the flush rule a batch waited for 64 MiB or 6 h of event
time: nothing was queryable until the archiver stopped.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from support import settings_for
from test_archive_store import TOPIC, shell_for

from trajbus.archive.archiver import run_archiver
from trajbus.archive.core import ArchiveBatcher
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore, ObjectStore, open_store
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_topics
from trajbus.bus.producer import close_producer, get_producer
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import Topics
from trajbus.schemas.models import Envelope, Event, Tick

T0 = 1_767_225_600_000
BIG = 10**12


# -- the pure rule ---------------------------------------------------------------------------
def test_a_batch_is_flushed_by_the_first_record_that_shows_it_flush_after_old() -> None:
    b = ArchiveBatcher(target_object_bytes=BIG, max_open_ms=BIG, flush_after_ms=30_000)
    for i in range(30):  # one record a second, log times T0 .. T0+29 s
        assert b.add(TOPIC, 0, i, T0 - 3_600_000, 100, log_time_ms=T0 + i * 1000) == []
    [f] = b.add(TOPIC, 0, 30, T0, 100, log_time_ms=T0 + 30_000)
    assert (f.first_offset, f.last_offset, f.rows, f.reason) == (0, 29, 30, "age")
    assert b.open_batches() == {(TOPIC, 0): (30, 30, 1, 100)}
    # the next batch's age counts from its own first row (T0+30 s), not from the event time
    assert b.add(TOPIC, 0, 31, T0, 100, log_time_ms=T0 + 59_999) == []
    [g] = b.add(TOPIC, 0, 32, T0, 100, log_time_ms=T0 + 60_000)
    assert (g.first_offset, g.last_offset, g.reason) == (30, 31, "age")


def test_a_tick_record_in_the_partition_flushes_a_quiet_batch_by_its_log_time() -> None:
    b = ArchiveBatcher(target_object_bytes=BIG, max_open_ms=BIG, flush_after_ms=30_000)
    assert b.add(TOPIC, 0, 0, T0 - 7_200_000, 100, log_time_ms=T0) == []  # a late event
    for i in range(1, 30):  # the processors' ticks, one a second
        assert b.skip(TOPIC, 0, i, log_time_ms=T0 + i * 1000) == []
    [f] = b.skip(TOPIC, 0, 30, log_time_ms=T0 + 30_000)
    assert (f.first_offset, f.last_offset, f.rows, f.reason) == (0, 29, 1, "age")
    # the same records give the same boundaries (nothing but the records decides)
    again = ArchiveBatcher(target_object_bytes=BIG, max_open_ms=BIG, flush_after_ms=30_000)
    again.add(TOPIC, 0, 0, T0 - 7_200_000, 100, log_time_ms=T0)
    out = [x for i in range(1, 31) for x in again.skip(TOPIC, 0, i, log_time_ms=T0 + i * 1000)]
    assert out == [f]


def test_log_tick_flushes_only_batches_whose_first_row_is_old_enough() -> None:
    b = ArchiveBatcher(target_object_bytes=BIG, max_open_ms=BIG, flush_after_ms=30_000)
    b.add(TOPIC, 0, 0, T0, 100, log_time_ms=T0)
    b.add(TOPIC, 1, 0, T0, 100, log_time_ms=T0 + 10_000)
    b.skip(TOPIC, 2, 0, log_time_ms=T0)  # a tick only: nothing to write
    assert b.log_tick(T0 + 29_999) == []
    [f] = b.log_tick(T0 + 30_000)
    assert (f.partition, f.reason) == (0, "tick")
    [g] = b.log_tick(T0 + 40_000)
    assert g.partition == 1
    assert b.log_tick(T0 + 10**9) == []
    snap = ArchiveBatcher.restore(b.snapshot())
    assert snap.flush_after_ms == 30_000


def _rec(event: Event, offset: int, log_ms: int) -> Any:
    return SimpleNamespace(topic=TOPIC, partition=0, offset=offset,
                           key=event.header.sandbox.encode(), value=event.encode(),
                           timestamp=log_ms)


def test_the_shell_timer_writes_a_single_late_event_flush_after_later(tmp_path: Path) -> None:
    now = [1000.0]
    store = LocalStore(tmp_path / "archive")
    sh = shell_for(store, tmp_path)
    sh.clock = lambda: now[0]
    late = episode_events("web", "sb-1", "ep-1", t0_ms=T0 - 7_200_000)[0]
    assert sh.process([_rec(late, 0, T0)]).batches == []
    now[0] += 29.0  # polls with nothing to read
    assert sh.process([]).batches == []
    now[0] += 1.0
    [batch] = sh.process([]).batches
    assert (batch.first_offset, batch.last_offset) == (0, 0)
    rows = ArchiveReader(store).connect().execute("SELECT event_id FROM events").fetchall()
    assert rows == [(late.header.event_id,)]


# -- against a real broker and S3 ------------------------------------------------------------
class Archive:
    """A continuous archiver into an S3 bucket and a dashboard polling it."""

    def __init__(self, settings: Any, store: ObjectStore, topic: str) -> None:
        self.settings, self.store, self.topic = settings, store, topic
        self.stop = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        self.seen: dict[str, float] = {}  # event id -> when the dashboard first saw it

    async def __aenter__(self) -> Archive:
        self.task = asyncio.create_task(run_archiver(
            self.settings, self.stop, store=self.store, topics=[self.topic],
            dead_letter=lambda *a: None))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 60)

    def _query(self) -> list[str]:
        con = ArchiveReader(self.store, require=False).connect(episodes=False)
        return [r[0] for r in con.execute("SELECT event_id FROM events").fetchall()]

    async def poll(self) -> None:
        ids = await asyncio.to_thread(self._query)
        t = time.time()
        for i in ids:
            self.seen.setdefault(i, t)
        if self.task is not None and self.task.done():
            self.task.result()  # the archiver failed: say why


async def _s3_archive(s3_server: str, tmp_path: Path, settings: Any) -> ObjectStore:
    bucket = f"fresh-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/archive"
    settings.archive = ArchiveSettings(url=url, s3_endpoint_url=s3_server,
                                       spool_dir=str(tmp_path / "spool"))
    assert settings.archive.flush_after_ms == 30_000  # the default is what is measured
    return await asyncio.to_thread(open_store, url, s3_server)


async def _topic(settings: Any) -> str:
    topics = Topics(settings)
    await ensure_topics(settings, [s for s in topics.specs if s.name == topics.sandbox_events])
    return topics.sandbox_events


async def _send(settings: Any, topic: str, event: Event) -> float:
    producer = await get_producer(settings.kafka)
    await (await producer.send(topic, event.encode(), key=event.header.sandbox.encode()))
    return time.time()  # acknowledged


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.99 + 0.5) - 1)]


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_steady_fleet_every_event_queryable_within_60s_p99(
        kafka_broker: Any, unique_name: str, tmp_path: Path, s3_server: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    store = await _s3_archive(s3_server, tmp_path, settings)
    topic = await _topic(settings)
    acked: dict[str, float] = {}
    # 4 sandboxes emitting one event each every second for 35 s (a steady fleet)
    eps = {s: [e for k in range(4) for e in episode_events(
        "web", f"sb-{s}", f"ep-{k}", tool_calls=4, t0_ms=int(time.time() * 1000))]
        for s in range(4)}
    try:
        async with Archive(settings, store, topic) as arch:
            start = time.monotonic()
            step = 0
            while time.monotonic() - start < 35:
                for s in range(4):
                    ev = eps[s][step % len(eps[s])]
                    if ev.header.event_id not in acked:
                        acked[ev.header.event_id] = await _send(settings, topic, ev)
                step += 1
                await arch.poll()
                await asyncio.sleep(max(0.0, start + step - time.monotonic()))
            deadline = time.monotonic() + 75
            while set(acked) - set(arch.seen) and time.monotonic() < deadline:
                await arch.poll()
                await asyncio.sleep(1.0)
    finally:
        await close_producer()
    missing = set(acked) - set(arch.seen)
    ages = [arch.seen[i] - acked[i] for i in acked if i in arch.seen]
    assert not missing, (f"{len(missing)} of {len(acked)} acknowledged events not queryable "
                         f"75 s after the fleet stopped")
    assert len(acked) >= 100
    assert _p99(ages) <= 60, f"freshness p99 {_p99(ages):.1f} s (median " \
                             f"{statistics.median(ages):.1f} s)"


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_quiet_fleet_a_single_late_event_is_queryable_within_60s(
        kafka_broker: Any, unique_name: str, tmp_path: Path, s3_server: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    store = await _s3_archive(s3_server, tmp_path, settings)
    topic = await _topic(settings)
    now_ms = int(time.time() * 1000)
    try:
        async with Archive(settings, store, topic) as arch:
            # some traffic, archived; then the fleet goes quiet
            first = episode_events("web", "sb-a", "ep-0", t0_ms=now_ms)
            for ev in first:
                await _send(settings, topic, ev)
            deadline = time.monotonic() + 90
            while len(arch.seen) < len(first) and time.monotonic() < deadline:
                await arch.poll()
                await asyncio.sleep(1.0)
            assert len(arch.seen) == len(first), "the first episode was never archived"
            # one late event (its event time 2 h ago) and nothing after it
            late = episode_events("web", "sb-b", "ep-9", t0_ms=now_ms - 7_200_000)[0]
            acked = await _send(settings, topic, late)
            deadline = time.monotonic() + 90
            while late.header.event_id not in arch.seen and time.monotonic() < deadline:
                await arch.poll()
                await asyncio.sleep(1.0)
    finally:
        await close_producer()
    assert late.header.event_id in arch.seen, "the late event was not queryable after 90 s"
    assert arch.seen[late.header.event_id] - acked <= 60


def test_tick_records_are_not_archived_but_drive_the_age(tmp_path: Path) -> None:
    """The processors' Ticks in the partition flush the late event's batch by the log's time,
    without the shell's timer (its clock stands still here)."""
    store = LocalStore(tmp_path / "archive")
    sh = shell_for(store, tmp_path)
    sh.clock = lambda: 0.0
    late = episode_events("web", "sb-1", "ep-1", t0_ms=T0 - 7_200_000)[0]
    recs = [_rec(late, 0, T0)]
    for i in range(1, 31):
        tick = Tick(header=Envelope(task="_tick", sandbox="_tick", seq=i,
                                    event_time_ms=T0 + i * 1000, producer_id="w"))
        recs.append(SimpleNamespace(topic=TOPIC, partition=0, offset=i, key=b"_tick",
                                    value=tick.encode(), timestamp=T0 + i * 1000))
    [batch] = sh.process(recs).batches
    assert (batch.first_offset, batch.last_offset) == (0, 29)
    assert ArchiveReader(store).connect().execute(
        "SELECT count(*) FROM events").fetchall() == [(1,)]
