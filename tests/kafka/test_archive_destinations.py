"""S3 as a first-class destination, against a real broker and moto's S3 server: each archive
destination is its own consumer group (derived from its URL), so pointing an archiver at a
new bucket archives everything; an archiver with nothing to do says why."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from support import produce, settings_for

from trajbus.archive.archiver import archiver_group, run_archiver
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore, open_store
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_topics
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import TopicSpec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]
T0 = 1_714_557_600_000


def test_group_names_derive_from_the_destination() -> None:
    assert archiver_group("trajbus", "s3://team-bucket/rl/archive") == \
        "trajbus.archiver.s3.team-bucket.rl-archive"
    a, b = archiver_group("p", "/data/a/archive"), archiver_group("p", "/data/b/archive")
    assert a.startswith("p.archiver.local.archive-") and a != b
    assert archiver_group("p", "s3://x") != archiver_group("p", "s3://y")


async def test_a_second_destination_archives_everything_and_an_idle_run_says_why(
        kafka_broker: Any, unique_name: str, tmp_path: Path, s3_server: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    settings.archive = ArchiveSettings(url=str(tmp_path / "local"),
                                       spool_dir=str(tmp_path / "spool"))
    topic = f"{unique_name}.sandbox.events"
    await ensure_topics(settings, [TopicSpec(topic, 2, "test", "sandbox")])
    events = [e for s in range(4) for e in episode_events("web", f"sb-{s}", "ep-0", t0_ms=T0)]
    await produce(settings, topic, [(e.header.sandbox, e.encode()) for e in events])

    local = LocalStore(tmp_path / "local")
    first = await run_archiver(settings, store=local, until_idle=True, topics=[topic],
                               dead_letter=lambda *a: None)
    assert first.rows == len(events) and first.note is None

    bucket = f"dest-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    s3 = open_store(f"s3://{bucket}/archive", s3_server)
    second = await run_archiver(settings, store=s3, until_idle=True, topics=[topic],
                                dead_letter=lambda *a: None)
    assert second.group_id != first.group_id
    assert second.rows == len(events), "the new bucket must not share the first's offsets"
    con = ArchiveReader(s3).connect()
    assert con.execute("SELECT count(*) FROM events").fetchall() == [(len(events),)]

    again = await run_archiver(settings, store=local, until_idle=True, topics=[topic],
                               dead_letter=lambda *a: None)
    assert again.rows == 0 and again.records == 0
    assert again.note is not None
    assert "nothing to archive" in again.note and first.group_id in again.note
    assert f"{len(events)} records consumed earlier" in again.note
