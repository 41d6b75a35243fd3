"""The S3 endpoint unavailable or slow during archival (issue 9, fault 3).

The archiver writes to moto's S3 server through a proxy the test controls
(:class:`faults_support.PausableProxy`): it refuses connections (endpoint down) or holds them
(endpoint hung), then recovers. Checked: no consumer offset is committed while objects are not
durable; after recovery the archive holds every event exactly once (read back with DuckDB over
pyarrow datasets); the committed offsets reach the end of the topics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest
from faults_support import PausableProxy, committed_offsets, end_offsets
from support import produce, settings_for

from trajbus.archive.archiver import run_archiver
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import open_store
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka]


async def _archive_through_outage(bootstrap: str, prefix: str, tmp_path: Path, s3: str,
                                  mode: str, outage_s: float,
                                  restart_allowed: bool) -> dict[str, object]:
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=bucket)
    target = urlparse(s3)
    proxy = PausableProxy(target.hostname or "127.0.0.1", target.port or 80).start()
    settings = settings_for(bootstrap, prefix, archive=ArchiveSettings(
        url=f"s3://{bucket}/arch", s3_endpoint_url=proxy.endpoint,
        spool_dir=str(tmp_path / "spool")))
    await ensure_base_topics(settings)
    topics = Topics(settings)
    events = [e for s in range(4) for ep in range(3)
              for e in episode_events("web", f"sb-{s}", f"ep-{ep}", t0_ms=1_714_557_600_000,
                                      trace=b"x" * 300)]
    await produce(settings, topics.sandbox_events,
                  [(e.header.sandbox, e.encode()) for e in events if e.KIND != "TraceChunk"])
    await produce(settings, topics.trace_chunks,
                  [(e.header.sandbox, e.encode()) for e in events if e.KIND == "TraceChunk"])
    group = f"{prefix}.archiver"
    dead: list[object] = []
    outcome: dict[str, object] = {"restarted": False}
    try:
        run = asyncio.create_task(run_archiver(settings, until_idle=True, group_id=group,
                                               dead_letter=lambda *a: dead.append(a)))
        deadline = time.monotonic() + 30  # the store check (HEAD bucket) went through
        while proxy.stats["bytes_down"] == 0 and not run.done():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        getattr(proxy, mode)()
        t0 = time.monotonic()
        while time.monotonic() - t0 < outage_s:  # the outage: nothing may be committed
            assert await committed_offsets(settings, group) == {}, "committed while S3 down"
            await asyncio.sleep(0.5)
        if mode == "hold":
            proxy.slow(0.05)  # back, but slow
        else:
            proxy.resume()
        try:
            stats = await asyncio.wait_for(run, 120)
        except Exception as exc:  # the archiver gave up during the outage
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            if not restart_allowed:
                raise
            assert await committed_offsets(settings, group) == {}, "committed without objects"
            outcome["restarted"] = True  # what a supervisor does: run it again
            stats = await run_archiver(settings, until_idle=True, group_id=group,
                                       dead_letter=lambda *a: dead.append(a))
        outcome["stats"] = stats
    finally:
        proxy.stop()
    assert dead == []
    store = open_store(f"s3://{bucket}/arch", s3)
    con = ArchiveReader(store).connect()
    n = len(events)
    keys = [o.key for o in store.list("") if o.key.endswith(".parquet")]
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        n, n), (outcome, keys)
    got = con.execute("SELECT sandbox, episode, list(seq ORDER BY seq) FROM events "
                      "GROUP BY ALL").fetchall()
    want = {}
    for e in events:
        want.setdefault((e.header.sandbox, e.header.episode), []).append(e.header.seq)
    assert {(s, ep): seqs for s, ep, seqs in got} == {k: sorted(v) for k, v in want.items()}
    ends = await end_offsets(settings, topics.input_topics)
    done = await committed_offsets(settings, group)
    assert {tp: off for tp, off in ends.items() if off} == {
        tp: off for tp, off in done.items() if ends.get(tp)}
    return outcome


@pytest.mark.timeout(240)
async def test_s3_refusing_connections_for_8s_archive_ends_exactly_once(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    """Endpoint down for 8 s: nothing is committed early, the store retries with backoff, and
    the same run ends with each event once."""
    out = await _archive_through_outage(kafka_broker.bootstrap, unique_name, tmp_path,
                                        s3_server, "refuse", 8, restart_allowed=False)
    assert out["restarted"] is False


@pytest.mark.timeout(240)
async def test_s3_hung_for_8s_then_slow_archive_ends_exactly_once_without_restart(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    """Endpoint accepts but does not answer for 8 s, then answers slowly (50 ms per chunk):
    the archiver waits it out in one run."""
    out = await _archive_through_outage(kafka_broker.bootstrap, unique_name, tmp_path,
                                        s3_server, "hold", 8, restart_allowed=False)
    assert out["restarted"] is False


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_s3_down_30s_archiver_rides_it_out_in_one_run(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    """Bug C (fixed): beyond botocore's own 5 attempts the store retries with backoff for up
    to ``archive.store_retry_s`` (600 s by default), so a 30 s outage needs no restart."""
    out = await _archive_through_outage(kafka_broker.bootstrap, unique_name, tmp_path,
                                        s3_server, "refuse", 30, restart_allowed=False)
    assert out["restarted"] is False


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_s3_down_30s_restart_after_outage_archives_exactly_once(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    await _archive_through_outage(kafka_broker.bootstrap, unique_name, tmp_path, s3_server,
                                  "refuse", 30, restart_allowed=True)


@pytest.mark.timeout(180)
def test_s3_outage_in_the_middle_of_compaction_is_ridden_out(
        tmp_path: Path, s3_server: str) -> None:
    """S3 refuses connections for 6 s from the moment compaction uploads its first merged
    object (inputs read, nothing switched yet): the store's retries carry the same run
    through; afterwards readers see every event exactly once, in fewer objects."""
    import threading

    from trajbus.archive.archiver import ArchiveShell
    from trajbus.archive.maintenance import compact
    from trajbus.archive.storage import S3Store

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    target = urlparse(s3_server)
    proxy = PausableProxy(target.hostname or "127.0.0.1", target.port or 80).start()
    try:
        store = open_store(f"s3://{bucket}/arch", proxy.endpoint, retry_s=60)
        assert isinstance(store, S3Store)
        events = [e for s in range(4) for ep in range(2)
                  for e in episode_events("web", f"sb-{s}", f"ep-{ep}",
                                          t0_ms=1_714_557_600_000)]
        shell = ArchiveShell(store, ArchiveSettings(url="unused", target_object_bytes=3_000,
                                                    spool_dir=str(tmp_path / "spool")))
        shell.process([type("R", (), dict(topic="t.sandbox.events", partition=0, offset=i,
                                           key=None, value=e.encode()))()
                       for i, e in enumerate(events)])
        shell.flush_all()
        n_small = len([o for o in store.list("events/") if o.key.endswith(".parquet")])
        assert n_small > 4

        outage = threading.Event()
        real_put = store.put_file

        def put_file_after_cutting_s3(key: str, local_path: str) -> int:
            if not outage.is_set():
                outage.set()
                proxy.refuse()
                threading.Timer(6.0, proxy.resume).start()
            return real_put(key, local_path)

        store.put_file = put_file_after_cutting_s3  # type: ignore[method-assign]
        t0 = time.monotonic()
        rep = compact(store, target_bytes=10 * 1024 * 1024, min_age_ms=0,
                      now_ms=1_714_557_600_000 + 86_400_000)
        assert outage.is_set() and time.monotonic() - t0 >= 5.5, "the outage did not hit"
        assert rep.outputs and len(rep.inputs) == n_small
    finally:
        proxy.stop()
    direct = open_store(f"s3://{bucket}/arch", s3_server)
    con = ArchiveReader(direct).connect()
    n = len(events)
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        n, n)
