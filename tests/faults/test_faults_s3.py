"""The S3 endpoint unavailable or slow during archival (issue 9, fault 3).

The archiver writes to moto's S3 server through a proxy the test controls
(:class:`faults_support.PausableProxy`): it refuses connections (endpoint down) or holds them
(endpoint hung), then recovers. Checked: no consumer offset is committed while objects are not
durable; after recovery the archive holds every event exactly once (read back with DuckDB over
pyarrow datasets); the committed offsets reach the end of the topics. The archiver rides an
outage out in one run (no restart needed); and when its process is SIGKILLed during an outage
and restarted (first while S3 is still down, then after), the archive is still exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import boto3
import pytest
from faults_support import PausableProxy, committed_offsets, end_offsets
from support import REPO, env_for, produce, settings_for

from trajbus.archive.archiver import run_archiver
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import open_store
from trajbus.archive.synth import episode_events
from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka]
P = TypeVar("P", bound=PausableProxy)


class FaultProxy(PausableProxy):
    """A :class:`PausableProxy` that can also *reset* the endpoint: every connection (new or
    open) is accepted and aborted at once and counted in ``stats["reset"]``, so the test sees
    each attempt the client makes during the outage (a refused port counts nothing). Chunks
    that arrive while the endpoint is held (``hold()``) are counted in ``stats["held"]``.

    ``trip_on(marker)`` arms it: the outage starts by itself at the first request whose bytes
    contain ``marker`` (that request is not forwarded), i.e. at an exact point of the client's
    sequence of uploads."""

    resetting = False
    trip: bytes | None = None

    def _reset_now(self) -> None:  # on the proxy's loop
        self.resetting = True
        self.trip = None
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    def _accept(self, writer: asyncio.StreamWriter) -> bool:
        if self.resetting:
            self.stats["reset"] += 1
            writer.transport.abort()
            return False
        return True

    def _intercept(self, data: bytes, up: bool) -> bool:
        if up and self.trip is not None and self.trip in data:
            self.stats["tripped"] += 1
            self._reset_now()
            return True
        return False

    def reset_all(self) -> None:
        async def go() -> None:
            self._reset_now()

        self._call(go())

    def trip_on(self, marker: bytes) -> None:
        async def go() -> None:
            self.trip = marker

        self._call(go())

    def resume(self) -> None:
        async def go() -> None:
            self.resetting = False
            self.trip = None

        self._call(go())
        super().resume()


def _bucket_behind(s3: str, proxy_type: type[P]) -> tuple[str, P]:
    """A new bucket on moto's server ``s3``, and a started proxy to that server."""
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=bucket)
    target = urlparse(s3)
    return bucket, proxy_type(target.hostname or "127.0.0.1", target.port or 80).start()


def _sigkill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` unless it has exited, and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _half_written(s3: str, bucket: str) -> tuple[set[str], list[str]]:
    """Batches of the bucket's archive whose object is uploaded but whose index rows are not
    (read directly from ``s3``), and every key in the bucket."""
    listing = boto3.client("s3", endpoint_url=s3).list_objects_v2(Bucket=bucket)
    keys = [o["Key"] for o in listing.get("Contents", [])]
    objects = {k.rsplit("/", 1)[-1] for k in keys if k.startswith("arch/events/")}
    indexed = {k.rsplit("/", 1)[-1] for k in keys if k.startswith("arch/index/")}
    return objects - indexed, keys


async def _archive_through_outage(bootstrap: str, prefix: str, tmp_path: Path, s3: str,
                                  mode: str, outage_s: float,
                                  caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    bucket, proxy = _bucket_behind(s3, FaultProxy)
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
    outcome: dict[str, Any] = {}
    try:
        run = asyncio.create_task(run_archiver(settings, until_idle=True, group_id=group,
                                               dead_letter=lambda *a: dead.append(a)))
        deadline = time.monotonic() + 30  # the store check (HEAD bucket) went through
        while proxy.stats["bytes_down"] == 0 and not run.done():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        getattr(proxy, mode)()
        caplog.clear()

        def hit() -> bool:
            """The outage reached the archiver: its uploads were refused and the store
            retries, or a request hangs on the held endpoint."""
            if mode == "hold":
                return proxy.stats["held"] > 0
            return any(r.name == "trajbus.archive.storage"
                       and "object store unavailable" in r.getMessage()
                       for r in caplog.records)

        # The outage lasts ``outage_s`` from the moment it reached the archiver (a run still
        # joining its group or reading Kafka has not met it yet); nothing may be committed.
        deadline = time.monotonic() + 90 + outage_s
        hit_at: float | None = None
        while hit_at is None or time.monotonic() - hit_at < outage_s:
            assert await committed_offsets(settings, group) == {}, "committed while S3 down"
            assert not run.done(), f"the run ended during the outage: {run}"
            if hit_at is None and hit():
                hit_at = time.monotonic()
            assert time.monotonic() < deadline, "the archiver never reached the dead endpoint"
            await asyncio.sleep(0.5)
        outcome["retries"] = sum(1 for r in caplog.records
                                 if "object store unavailable" in r.getMessage())
        if mode == "hold":
            proxy.slow(0.05)  # back, but slow
        else:
            proxy.resume()
        # one run rides the outage out: an exception here (giving up) fails the test
        stats = await asyncio.wait_for(run, 120)
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


Outage = Callable[[str, float], Awaitable[dict[str, Any]]]


@pytest.fixture
def s3_outage(kafka_broker: Any, unique_name: str, tmp_path: Path, s3_server: str,
              caplog: pytest.LogCaptureFixture) -> Outage:
    """``await s3_outage(mode, outage_s)``: one archiver run until idle, S3 in ``mode``
    (``refuse``, ``hold``) for ``outage_s`` seconds of it; what it checks and returns: see
    :func:`_archive_through_outage`."""

    async def run(mode: str, outage_s: float) -> dict[str, Any]:
        return await _archive_through_outage(kafka_broker.bootstrap, unique_name, tmp_path,
                                             s3_server, mode, outage_s, caplog)

    return run


@pytest.mark.timeout(240)
async def test_s3_refusing_connections_for_8s_archive_ends_exactly_once(s3_outage: Outage) -> None:
    """Endpoint down for 8 s: nothing is committed early, the store retries with backoff, and
    the same run ends with each event once."""
    assert (await s3_outage("refuse", 8))["stats"].objects > 0


@pytest.mark.timeout(240)
async def test_s3_hung_for_8s_then_slow_archive_ends_exactly_once_without_restart(s3_outage: Outage
                                                                                   ) -> None:
    """Endpoint accepts but does not answer for 8 s, then answers slowly (50 ms per chunk):
    the archiver waits it out in one run."""
    assert (await s3_outage("hold", 8))["stats"].objects > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_s3_down_30s_archiver_rides_it_out_in_one_run(s3_outage: Outage) -> None:
    """Bug C (fixed): beyond botocore's own 5 attempts the store retries with backoff for up
    to ``archive.store_retry_s`` (600 s by default), so a 30 s outage needs no restart."""
    assert (await s3_outage("refuse", 30))["stats"].objects > 0


def _archiver(env: dict[str, str], log: Path, group: str, *args: str
              ) -> subprocess.Popen[bytes]:
    """``trajbus archive run --group GROUP ARGS`` as a separate process, output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "trajbus", "archive", "run",
                                 "--group", group, *args],
                                env=env, cwd=REPO, stdout=out, stderr=out)


async def _wait_for(what: str, cond: Callable[[], Awaitable[bool]], timeout: float,
                    proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
                    ) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if proc is not None:
            assert proc.poll() is None, (f"archiver exited ({proc.returncode}) waiting for "
                                         f"{what}:\n{log.read_text()[-3000:] if log else ''}")
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_archiver_sigkilled_during_s3_outage_and_restarted_archives_exactly_once(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    """The archiver process is SIGKILLed while S3 is down and it is retrying an upload: S3
    went down in the middle of a batch (its Parquet object uploaded, its index rows and batch
    marker not), later batches are pending, nothing is committed for them. A supervisor's
    restart while S3 is still down fails fast at the store check and commits nothing; the
    restart after S3 is back ends with every Kafka record in the archive exactly once: each
    (topic, partition, offset) in one row of one object, each event id once, every episode's
    seqs complete, no batch marker left, and the group's offsets at the end of the topics."""
    bucket, proxy = _bucket_behind(s3_server, FaultProxy)
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings)
    topics = Topics(settings)
    group = f"{unique_name}.archiver"
    log = tmp_path / "archiver.log"
    env = env_for(settings,
                  TRAJBUS_ARCHIVE__URL=f"s3://{bucket}/arch",
                  TRAJBUS_ARCHIVE__S3_ENDPOINT_URL=proxy.endpoint,
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp_path / "spool"),
                  # small objects: several batches per partition, so the outage and the kill
                  # fall between batches of one run
                  TRAJBUS_ARCHIVE__TARGET_OBJECT_BYTES="20000")

    events = _wave(0)
    await _publish(settings, events)
    proc = _archiver(env, log, group)
    try:
        async def committed_some() -> bool:
            return bool(await committed_offsets(settings, group))

        await _wait_for("a first commit", committed_some, 90, proc, log)
        # S3 goes down exactly when the next batch has uploaded its Parquet object and starts
        # uploading that object's index rows: a half-written batch (object, no index, no
        # marker), nothing committed for it. More events arrive, so that batch certainly comes.
        proxy.trip_on(f"PUT /{bucket}/arch/index/".encode())
        more = _wave(6)
        events += more
        await _publish(settings, more)

        async def retrying() -> bool:
            return proxy.stats["reset"] >= 8  # past botocore's 5 attempts: the store retries

        await _wait_for("the archiver to retry uploads against the dead endpoint",
                        retrying, 90, proc, log)
        assert proxy.stats["tripped"] == 1
        stuck = await committed_offsets(settings, group)
        resets = proxy.stats["reset"]

        async def still_retrying() -> bool:
            return proxy.stats["reset"] >= resets + 2

        await _wait_for("more retries", still_retrying, 60, proc, log)
        assert await committed_offsets(settings, group) == stuck, "committed while S3 down"
        ends = await end_offsets(settings, topics.input_topics)
        assert any(stuck.get(tp, 0) < end for tp, end in ends.items()), \
            "everything was committed before the outage: the kill would prove nothing"
    finally:
        _sigkill(proc)
    assert proc.returncode == -signal.SIGKILL
    # what the kill left in the bucket (read directly, not through the dead proxy): a batch
    # whose object is uploaded but whose index rows are not (and, depending on timing, the
    # marker of a batch committed just before the outage, whose deletion was cut off)
    half_written, keys = _half_written(s3_server, bucket)
    assert half_written, ("no half-written batch at the kill", keys)

    # A supervisor restarts it at once, S3 still down: the store check fails fast, no commit.
    code = await _run_until_idle(env, log, group, timeout=120)
    assert code == 2, log.read_text()[-3000:]
    assert "cannot reach S3" in log.read_text()
    assert await committed_offsets(settings, group) == stuck

    # S3 is back: the next restart finishes the job
    await _back_then_exact(proxy, env, log, settings, group, bucket, s3_server, events)


@pytest.mark.timeout(300)
async def test_archiver_killed_in_its_final_flush_during_s3_outage_rewrites_that_batch(
        kafka_broker, unique_name, tmp_path: Path, s3_server: str) -> None:
    """A batch whose boundary depends on timing, not on the records (the final flush of an
    until-idle run; likewise shutdown and tick flushes), is half written when S3 goes down (its
    Parquet object uploaded, its index rows not) and the process is SIGKILLed while retrying.
    More events arrive before the restart, so the restarted run would draw a different
    boundary (a different object key) for the same offsets unless the first attempt's
    boundary was recorded before its object was uploaded: the half-written object must not
    stay beside the new one (each Kafka record exactly once in the archive)."""
    bucket, proxy = _bucket_behind(s3_server, FaultProxy)
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=1)
    await ensure_base_topics(settings)
    group = f"{unique_name}.archiver"
    log = tmp_path / "archiver.log"
    # the default 64 MiB objects: no size flush, so the only boundaries are the final flush's
    env = env_for(settings, TRAJBUS_ARCHIVE__URL=f"s3://{bucket}/arch",
                  TRAJBUS_ARCHIVE__S3_ENDPOINT_URL=proxy.endpoint,
                  TRAJBUS_ARCHIVE__SPOOL_DIR=str(tmp_path / "spool"))
    events = _wave(0, sandboxes=3)
    await _publish(settings, events)
    proxy.trip_on(f"PUT /{bucket}/arch/index/".encode())  # S3 dies at the first index upload
    proc = _archiver(env, log, group, "--until-idle")
    try:
        async def retrying() -> bool:
            return proxy.stats["tripped"] == 1 and proxy.stats["reset"] >= 8

        await _wait_for("the final flush to retry against the dead endpoint", retrying, 90,
                        proc, log)
        assert await committed_offsets(settings, group) == {}, "committed while S3 down"
    finally:
        _sigkill(proc)
    assert proc.returncode == -signal.SIGKILL
    half_written, keys = _half_written(s3_server, bucket)
    assert len(half_written) == 1, ("not exactly one half-written batch", keys)

    more = _wave(3, sandboxes=3)  # the next run sees more records
    events += more
    await _publish(settings, more)
    await _back_then_exact(proxy, env, log, settings, group, bucket, s3_server, events)


def _wave(first_sandbox: int, sandboxes: int = 6) -> list[Any]:
    """Whole episodes (3 per sandbox) with 2 KB of trace per chunk, event ids unique."""
    return [e for s in range(first_sandbox, first_sandbox + sandboxes) for ep in range(3)
            for e in episode_events("web", f"sb-{s}", f"ep-{ep}", tool_calls=6,
                                    t0_ms=1_714_557_600_000, trace=b"x" * 2000)]


async def _publish(settings: Any, events: list[Any]) -> None:
    topics = Topics(settings)
    await produce(settings, topics.sandbox_events,
                  [(e.header.sandbox, e.encode()) for e in events if e.KIND != "TraceChunk"])
    await produce(settings, topics.trace_chunks,
                  [(e.header.sandbox, e.encode()) for e in events if e.KIND == "TraceChunk"])


async def _run_until_idle(env: dict[str, str], log: Path, group: str,
                          timeout: float = 180) -> int:
    """``trajbus archive run --until-idle`` to its end; its exit code."""
    proc = _archiver(env, log, group, "--until-idle")
    try:
        return await asyncio.to_thread(proc.wait, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def _assert_archive_exact(settings: Any, group: str, bucket: str, s3: str,
                                events: list[Any]) -> None:
    """Every Kafka record of the input topics in exactly one row of one object (read straight
    from S3, every object the readers see), each event once, every episode's seqs complete,
    no batch marker left, and the group's committed offsets at the end of the topics."""
    topics = Topics(settings)
    store = open_store(f"s3://{bucket}/arch", s3)
    con = ArchiveReader(store).connect()
    n = len(events)
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        n, n), [o.key for o in store.list("events/")]
    positions = con.execute("SELECT kafka_topic, kafka_partition, kafka_offset, count(*) "
                            "FROM events GROUP BY ALL").fetchall()
    assert max(c for *_, c in positions) == 1, "a Kafka record was archived twice"
    ends = await end_offsets(settings, topics.input_topics)
    assert {(t, p, o) for t, p, o, _ in positions} == {
        (tp.topic, tp.partition, o) for tp, end in ends.items() for o in range(end)}
    got = con.execute("SELECT sandbox, episode, list(seq ORDER BY seq) FROM events "
                      "GROUP BY ALL").fetchall()
    want: dict[tuple[str, str], list[int]] = {}
    for e in events:
        want.setdefault((e.header.sandbox, e.header.episode), []).append(e.header.seq)
    assert {(s, ep): seqs for s, ep, seqs in got} == {k: sorted(v) for k, v in want.items()}
    assert [o.key for o in store.list("_batches/")] == [], "batch markers left behind"
    done = await committed_offsets(settings, group)
    assert {tp: off for tp, off in ends.items() if off} == {
        tp: off for tp, off in done.items() if ends.get(tp)}


async def _back_then_exact(proxy: PausableProxy, env: dict[str, str], log: Path, settings: Any,
                           group: str, bucket: str, s3: str, events: list[Any]) -> None:
    """S3 comes back (``proxy`` resumes; it is stopped afterwards): a restarted run until idle
    exits 0 and leaves the archive exact (:func:`_assert_archive_exact`)."""
    proxy.resume()
    try:
        code = await _run_until_idle(env, log, group)
    finally:
        proxy.stop()
    assert code == 0, log.read_text()[-3000:]
    await _assert_archive_exact(settings, group, bucket, s3, events)


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

    bucket, proxy = _bucket_behind(s3_server, PausableProxy)
    try:
        store = open_store(f"s3://{bucket}/arch", proxy.endpoint, retry_s=60)
        assert isinstance(store, S3Store)
        events = [e for s in range(4) for ep in range(2)
                  for e in episode_events("web", f"sb-{s}", f"ep-{ep}",
                                          t0_ms=1_714_557_600_000)]
        shell = ArchiveShell(store, ArchiveSettings(url="unused", target_object_bytes=3_000,
                                                    spool_dir=str(tmp_path / "spool")))
        step = shell.process([type("R", (), dict(topic="t.sandbox.events", partition=0,
                                                  offset=i, key=None, value=e.encode()))()
                              for i, e in enumerate(events)])
        # committed, as the archiver does after the Kafka commit (compaction leaves batches
        # whose marker is still there alone: they may be re-uploaded)
        shell.committed(step.batches + shell.flush_all().batches)
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
