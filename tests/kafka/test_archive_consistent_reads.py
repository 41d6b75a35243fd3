"""Consistent reads (issue 38 item 3): every documented reader -- pyarrow, Polars and DuckDB,
each the way the README's data-team section reads the archive -- counts each archived event
exactly once while `archive run` adds objects and `archive compact` (its command line, with
its default grace period) swaps merged objects in, on a local archive and on S3 (moto's server
on loopback).

A raw glob over ``events/**/*.parquet`` fails this: a listing taken during a swap holds the
merged object and its inputs (double counts), or an input deleted before it is read
("Could not open Parquet input source"). The documented readers go through a snapshot
(``trajbus.archive.snapshot``): the live objects of one manifest generation, kept readable
for the grace period.

"Expected count" of a read, while the archiver is still writing: as many rows as distinct
events (nothing counted twice), at least as many as any earlier read of the same reader saw
(nothing went missing), and every sent event once the archiver has caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from support import settings_for
from test_archive_store import records, shell_for

from trajbus.archive.archiver import run_archiver
from trajbus.archive.maintenance import compact
from trajbus.archive.snapshot import snapshot, snapshot_of
from trajbus.archive.storage import LocalStore, ObjectStore, open_store
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_topics
from trajbus.bus.producer import close_producer, get_producer
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import Topics
from trajbus.cli import build_parser
from trajbus.schemas.models import Event

T0 = 1_714_557_600_000  # 2024-05-01T10:00Z: hours long over, so compaction may merge them


def fleet() -> list[Event]:
    """Two tasks, 12 sandboxes, 2 episodes each, across two hours."""
    evs: list[Event] = []
    for s in range(12):
        for e in range(2):
            evs += episode_events(("web", "swe")[s % 2], f"sb-{s}", f"ep-{e}", tool_calls=3,
                                  t0_ms=T0 + e * 3_600_000 + s * 1_000)
    return evs


# -- the documented readers (README, "For the data team") ------------------------------------
Reader = Callable[[], tuple[int, int]]  # -> (rows, distinct events)


def readers(url: str, s3: bool) -> dict[str, Reader]:
    import duckdb
    import polars as pl
    import pyarrow.compute as pc


    def with_pyarrow() -> tuple[int, int]:
        ids = snapshot(url).dataset().to_table(columns=["event_id"]).column("event_id")
        return len(ids), pc.count_distinct(ids).as_py()

    def with_polars() -> tuple[int, int]:
        df = pl.scan_pyarrow_dataset(snapshot(url).dataset()).select(
            pl.len(), pl.col("event_id").n_unique()).collect()
        return int(df.item(0, 0)), int(df.item(0, 1))

    def with_duckdb() -> tuple[int, int]:
        events = snapshot(url).dataset()  # noqa: F841 (DuckDB finds it by name)
        row = duckdb.sql("SELECT count(*), count(DISTINCT event_id) FROM events").fetchall()[0]
        return int(row[0]), int(row[1])

    return {"pyarrow": with_pyarrow, "polars": with_polars, "duckdb": with_duckdb}


@dataclass
class ReadLog:
    reads: list[tuple[str, float, float, int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    compactions: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, n


def read_loop(rs: dict[str, Reader], log: ReadLog, stop: threading.Event) -> None:
    while not stop.is_set():
        for name, read in rs.items():
            t = time.monotonic()
            try:
                rows, distinct = read()
            except Exception as exc:  # a missing object, a failed scan: a wrong answer
                log.errors.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            log.reads.append((name, t, time.monotonic(), rows, distinct))
        time.sleep(0.05)


def compact_loop(cli: list[str], log: ReadLog, stop: threading.Event) -> None:
    """`trajbus archive [--url ...] compact --min-age-hours 0`, again and again (the
    README's schedule, compressed): its command line, so its default grace period."""
    while not stop.is_set():
        args = build_parser().parse_args([*cli, "compact", "--min-age-hours", "0"])
        out = io.StringIO()
        t = time.monotonic()
        try:
            with contextlib.redirect_stdout(out):
                args.func(args)
        except Exception as exc:
            log.errors.append(f"compact: {type(exc).__name__}: {exc}")
            return
        log.compactions.append((t, time.monotonic(), len(json.loads(out.getvalue())["outputs"])))
        time.sleep(0.3)


async def _send_slowly(settings: Any, topic: str, events: list[Event], seconds: float) -> None:
    producer = await get_producer(settings.kafka)
    per = seconds / len(events)
    for ev in events:
        await producer.send_and_wait(topic, ev.encode(), key=ev.header.sandbox.encode())
        await asyncio.sleep(per)


async def check_reads_while_archiving_and_compacting(settings: Any, store: ObjectStore,
                                                     cli: list[str], s3: bool) -> None:
    topics = Topics(settings)
    await ensure_topics(settings, [s for s in topics.specs if s.name == topics.sandbox_events])
    events = fleet()
    log = ReadLog()
    stop_reads, stop_compact, stop_archiver = threading.Event(), threading.Event(), \
        asyncio.Event()
    archiver = asyncio.create_task(run_archiver(settings, stop_archiver, store=store,
                                                topics=[topics.sandbox_events],
                                                dead_letter=lambda *a: None))
    sender = asyncio.create_task(_send_slowly(settings, topics.sandbox_events, events, 12.0))
    # the archiver's marker first: the readers need an archive to read
    deadline = time.monotonic() + 30
    while not store.exists("_trajbus_archive.json") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    rs = readers(store.url, s3)
    threads = [threading.Thread(target=read_loop, args=(rs, log, stop_reads)),
               threading.Thread(target=compact_loop, args=(cli, log, stop_compact))]
    for th in threads:
        th.start()
    try:
        await sender
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not archiver.done():
            done = {r[0] for r in log.reads[-6:] if r[3] == len(events)}
            if done == set(rs) and sum(n > 0 for *_, n in log.compactions) >= 3:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)  # a few more reads and compactions of the whole archive
    finally:
        stop_compact.set()
        stop_reads.set()
        for th in threads:
            await asyncio.to_thread(th.join, 60)
        stop_archiver.set()
        await asyncio.wait_for(archiver, 60)
        sender.cancel()
        await close_producer()

    swaps = [(a, b) for a, b, n in log.compactions if n > 0]
    during = [r for r in log.reads if any(r[1] < b and r[2] > a for a, b in swaps)]
    print(f"\n{store.url}: {len(log.reads)} reads ({len(during)} during a compaction), "
          f"{len(swaps)} compactions merged objects, {len(log.errors)} errors")
    assert not log.errors, f"{len(log.errors)} reads failed, first: {log.errors[:3]}"
    for name in rs:
        mine = [r for r in log.reads if r[0] == name]
        assert mine, f"{name} never read"
        doubled = [(rows, distinct) for _, _, _, rows, distinct in mine if rows != distinct]
        assert not doubled, f"{name} counted events twice: (rows, distinct) {doubled[:5]}"
        counts = [rows for *_, rows, _ in mine]
        lost = [(a, b) for a, b in itertools.pairwise(counts) if b < a]
        assert not lost, f"{name} lost rows between reads: {lost[:5]}"
        assert counts[-1] == len(events), f"{name}: {counts[-1]} of {len(events)} events"
    assert len(swaps) >= 3, f"only {len(swaps)} compactions merged anything"
    assert len(during) >= 6, f"only {len(during)} reads overlapped a compaction"
    # the replaced objects are still there (grace), and a fresh snapshot holds none of them
    snap = snapshot_of(store)
    assert len(snap.files) < len(store.list("events/"))


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_local_every_read_counts_each_event_once_while_archiving_and_compacting(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    url = str(tmp_path / "archive")
    settings.archive = ArchiveSettings(url=url, spool_dir=str(tmp_path / "spool"),
                                       flush_after_ms=1_000)
    store = LocalStore(url)
    await check_reads_while_archiving_and_compacting(settings, store, ["archive", "--url", url],
                                                     s3=False)


@pytest.mark.kafka
@pytest.mark.timeout(180)
async def test_s3_every_read_counts_each_event_once_while_archiving_and_compacting(
        kafka_broker: Any, unique_name: str, tmp_path: Path, s3_server: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    bucket = f"reads-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/archive"
    monkeypatch.setenv("TRAJBUS_ARCHIVE__S3_ENDPOINT_URL", s3_server)
    settings.archive = ArchiveSettings(url=url, s3_endpoint_url=s3_server,
                                       spool_dir=str(tmp_path / "spool"), flush_after_ms=1_000)
    store = await asyncio.to_thread(open_store, url, s3_server)
    await check_reads_while_archiving_and_compacting(
        settings, store, ["archive", "--url", url, "--endpoint-url", s3_server], s3=True)


# -- the snapshot's rules, without a broker ----------------------------------------------------
def test_a_snapshot_taken_before_a_compaction_still_reads_exactly_after_the_switch(
        tmp_path: Path) -> None:
    """The old set stays readable for the grace period, the new set replaces it, and the
    raw glob (merged objects and their inputs) is what a snapshot protects against."""
    import duckdb

    store = LocalStore(tmp_path / "archive")
    events = fleet()
    sh = shell_for(store, tmp_path, target_object_bytes=2_000)
    step = sh.process(records(events))
    sh.committed(step.batches + sh.flush_all().batches)
    before = snapshot(str(store.root))
    rep = compact(store, min_age_ms=0, grace_ms=3_600_000)
    after = snapshot(str(store.root))
    assert rep.outputs and after.generation == before.generation + 1
    assert set(before.files) - set(after.files)  # the inputs left the live set ...
    assert before.dataset().count_rows() == after.dataset().count_rows() == len(events)
    raw = duckdb.sql(f"SELECT count(*) FROM read_parquet('{store.root}/events/**/*.parquet')"
                     ).fetchall()[0][0]
    assert raw > len(events)  # ... but are still there, for readers of the old snapshot


def test_a_relative_archive_path_names_the_archive_of_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots share one store per archive; a relative path is resolved first, so the same
    ".trajbus/archive" in two directories is two archives, not the first one again."""
    for name, n in (("one", 3), ("two", 5)):
        here = tmp_path / name
        store = LocalStore(here / ".trajbus" / "archive")
        shell = shell_for(store, here)
        events = [e for i in range(n) for e in episode_events("t", f"sb-{i}", "00000",
                                                             t0_ms=T0)]
        step = shell.process(records(events))
        shell.committed(step.batches + shell.flush_all().batches)
        monkeypatch.chdir(here)
        assert snapshot(".trajbus/archive").dataset().count_rows() == len(events)
