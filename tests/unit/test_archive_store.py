"""Specification of the archive's storage side: objects, index, exactly-once, compaction,
retention — against a local directory and a real S3 endpoint (moto server on loopback)."""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastavro import schemaless_writer

from trajbus.archive import cli as archive_cli
from trajbus.archive import layout
from trajbus.archive.archiver import ArchiveShell
from trajbus.archive.maintenance import compact, retention
from trajbus.archive.manifest import live_objects, read_manifest
from trajbus.archive.query import ArchiveReader, reassemble_trace
from trajbus.archive.rows import rows_to_table, to_row
from trajbus.archive.storage import LocalStore, ObjectStore, StoreConfigError, open_store
from trajbus.archive.synth import episode_events
from trajbus.archive.writer import ArchiveWriter
from trajbus.bus.settings import ArchiveSettings
from trajbus.schemas.codec import MAGIC, Codec
from trajbus.schemas.models import Event
from trajbus.schemas.registry import SchemaRegistry

TOPIC = "trajbus.sandbox.events"
T0 = 1_714_557_600_000  # 2024-05-01T10:00Z


def records(events: list[Event], partition: int = 0, start: int = 0,
            topic: str = TOPIC) -> list[Any]:
    return [SimpleNamespace(topic=topic, partition=partition, offset=start + i,
                            key=e.header.sandbox.encode(), value=e.encode())
            for i, e in enumerate(events)]


def fleet(sandboxes: int = 4, episodes: int = 3, tasks: tuple[str, ...] = ("web", "code"),
          trace: bytes = b"", tool_calls: int = 3) -> list[Event]:
    """Interleaved events of several sandboxes (arrival order mixes sandboxes)."""
    per: list[list[Event]] = []
    for s in range(sandboxes):
        evs: list[Event] = []
        for e in range(episodes):
            evs += episode_events(tasks[s % len(tasks)], f"sb-{s}", f"ep-{e}",
                                  tool_calls=tool_calls, t0_ms=T0 + e * 60_000, trace=trace)
        per.append(evs)
    out: list[Event] = []
    while any(per):
        for evs in per:
            if evs:
                out.append(evs.pop(0))
    return out


def shell_for(store: ObjectStore, tmp_path: Path, codec: Codec | None = None,
              **cfg: Any) -> ArchiveShell:
    settings = ArchiveSettings(url="unused", spool_dir=str(tmp_path / f"spool-{uuid.uuid4()}"),
                               **cfg)
    return ArchiveShell(store, settings, codec)


def archive_all(store: ObjectStore, tmp_path: Path, events: list[Event], **cfg: Any) -> None:
    """Archive ``events`` and commit every batch (as the Kafka shell does after its commit)."""
    sh = shell_for(store, tmp_path, **cfg)
    step = sh.process(records(events))
    sh.committed(step.batches + sh.flush_all().batches)


@pytest.fixture
def s3_store(s3_server: str) -> ObjectStore:
    bucket = f"arch-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/trajbus/archive", s3_server)


# -- S3 round trip ---------------------------------------------------------------------------
def test_s3_round_trip_is_readable_by_duckdb_and_by_the_index(s3_store: ObjectStore,
                                                              s3_server: str,
                                                              tmp_path: Path) -> None:
    events = fleet(trace=bytes(range(200)))
    archive_all(s3_store, tmp_path, events, row_group_rows=7)
    keys = [o.key for o in s3_store.list("events/")]
    assert keys and all(k.startswith("events/date=2024-05-01/hour=10/task=") for k in keys)

    # DuckDB, not our reader: download the raw objects from S3 and query them.
    s3 = boto3.client("s3", endpoint_url=s3_server)
    bucket = s3_store.url.split("/")[2]
    for k in keys:
        dest = tmp_path / "dl" / k
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, f"trajbus/archive/{k}", str(dest))
    con = duckdb.connect()
    counts = con.execute(
        f"SELECT count(*), count(DISTINCT event_id) FROM read_parquet('{tmp_path}/dl/events/"
        "**/*.parquet', hive_partitioning=true)").fetchone()
    assert counts == (len(events), len(events))
    per_task = dict(con.execute(
        f"SELECT task, count(*) FROM read_parquet('{tmp_path}/dl/events/**/*.parquet', "
        "hive_partitioning=true) GROUP BY task").fetchall())
    assert per_task == {"web": len(events) // 2, "code": len(events) // 2}
    # Rows inside an object are sorted by (sandbox, episode, seq).
    one = pq.read_table(tmp_path / "dl" / keys[0])
    order = list(zip(one["sandbox"].to_pylist(), one["episode"].to_pylist(),
                     one["seq"].to_pylist(), strict=True))
    assert order == sorted(order)

    # DuckDB views over S3 through pyarrow's S3 filesystem (no httpfs download).
    reader = ArchiveReader(s3_store)
    sql = reader.connect()
    assert sql.execute("SELECT count(*) FROM events").fetchone() == (len(events),)
    assert sql.execute("SELECT count(*) FROM episodes WHERE completeness = 'complete'"
                       ).fetchone() == (12,)
    # One episode through the index, with its trace.
    ep = reader.episode("code", "sb-1", "ep-2")
    assert ep["seq"].to_pylist() == list(range(ep.num_rows))
    assert reassemble_trace(ep) == (bytes(range(200)), [])


def test_large_files_go_up_as_multipart_and_come_back_whole(
        s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trajbus.archive.storage as storage

    monkeypatch.setattr(storage, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(storage, "MULTIPART_CHUNK", 5 * 1024 * 1024)
    bucket = f"mp-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    store = open_store(f"s3://{bucket}/p", s3_server)
    blob = tmp_path / "big.bin"
    payload = bytes(range(256)) * (11 * 4096)  # 11 MiB -> 3 parts
    blob.write_bytes(payload)
    assert store.put_file("events/big.bin", blob) == len(payload)
    head = boto3.client("s3", endpoint_url=s3_server).head_object(Bucket=bucket,
                                                                  Key="p/events/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload's ETag
    assert store.get_bytes("events/big.bin") == payload
    assert [o.key for o in store.list("events/")] == ["events/big.bin"]


def test_open_store_fails_fast_when_the_bucket_is_missing(s3_server: str) -> None:
    with pytest.raises(StoreConfigError, match=r"does not exist.*TRAJBUS_ARCHIVE__URL"):
        open_store("s3://no-such-bucket-trajbus/x", s3_server)


def test_open_store_fails_fast_without_credentials(monkeypatch: pytest.MonkeyPatch,
                                                   s3_server: str) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreConfigError, match="AWS_ACCESS_KEY_ID"):
        open_store("s3://any-bucket/x", s3_server)


def test_local_puts_are_atomic_and_keys_stay_inside(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    store.put_bytes("x/y.bin", b"1")
    store.put_bytes("x/y.bin", b"22")
    assert store.get_bytes("x/y.bin") == b"22"
    assert [o.key for o in store.list()] == ["x/y.bin"]
    assert not list((tmp_path / "a" / "x").glob(".tmp-*"))
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")
    assert not (tmp_path / "escape").exists()


# -- index -----------------------------------------------------------------------------------
def test_index_lookup_equals_a_full_scan(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "arch")
    events = fleet(sandboxes=6, episodes=4, trace=b"t" * 150)
    # Small objects and row groups: episodes span several objects and row groups.
    archive_all(store, tmp_path, events, target_object_bytes=6_000, row_group_rows=5)
    assert len(store.list("events/")) > 6
    reader = ArchiveReader(store)
    checked = 0
    for s in range(6):
        task = ("web", "code")[s % 2]
        for e in range(4):
            via_index = reader.episode(task, f"sb-{s}", f"ep-{e}")
            scan = reader.scan_episode(task, f"sb-{s}", f"ep-{e}")
            assert via_index.equals(scan)
            assert via_index["seq"].to_pylist() == list(range(via_index.num_rows))
            checked += 1
    assert checked == 24
    # Segments of an episode split across objects are labelled, and together complete.
    idx = reader.index("web")
    assert set(idx["completeness"].to_pylist()) <= {"complete", "partial"}


# -- exactly-once ----------------------------------------------------------------------------
def test_writing_the_same_batch_twice_yields_no_duplicates(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "arch")
    events = fleet()
    table = rows_to_table([to_row(e.KIND, e.to_record() | {"header": e.header.model_dump()},
                                  TOPIC, 0, i) | {"event_digest": i}
                           for i, e in enumerate(events)])
    w = ArchiveWriter(store)
    first = w.write_batch(table, TOPIC, 0, 0, len(events) - 1)
    keys1 = sorted(o.key for o in store.list())
    second = w.write_batch(table, TOPIC, 0, 0, len(events) - 1)  # crash before commit: redo
    assert [o.key for o in first.objects] == [o.key for o in second.objects]
    assert sorted(o.key for o in store.list()) == keys1
    con = ArchiveReader(store).connect()
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        len(events), len(events))


def test_a_batch_written_by_two_threads_is_the_same_as_written_by_one(tmp_path: Path) -> None:
    """The write pool changes who writes an object, never what is written: same keys, same
    bytes, same index, in the same order."""
    events = fleet(sandboxes=6, tasks=("web", "code", "math"))
    table = rows_to_table([to_row(e.KIND, e.to_record() | {"header": e.header.model_dump()},
                                  TOPIC, 0, i) | {"event_digest": i}
                           for i, e in enumerate(events)])
    results = {}
    for threads in (1, 2):
        store = LocalStore(tmp_path / f"arch-{threads}")
        w = ArchiveWriter(store, write_threads=threads)
        results[threads] = (w.write_batch(table, TOPIC, 0, 0, len(events) - 1), store)
        w.close()
    (one, s1), (two, s2) = results[1], results[2]
    assert len(one.objects) == 3  # one object per task: the pool had work to share
    assert [(o.key, o.index_key, o.rows) for o in one.objects] == \
        [(o.key, o.index_key, o.rows) for o in two.objects]
    keys = sorted(o.key for o in s1.list() if not o.key.startswith(layout.BATCHES))
    assert keys == sorted(o.key for o in s2.list() if not o.key.startswith(layout.BATCHES))
    for key in keys:
        t1 = pq.read_table(io.BytesIO(s1.get_bytes(key)))
        t2 = pq.read_table(io.BytesIO(s2.get_bytes(key)))
        assert t1.equals(t2), key


def test_a_failed_object_write_fails_the_batch_after_every_write_ended(tmp_path: Path) -> None:
    """With several write threads, one failing upload fails the batch (nothing is committed)
    and no other write is still running when the error reaches the caller."""
    events = fleet(sandboxes=6, tasks=("web", "code", "math"))
    table = rows_to_table([to_row(e.KIND, e.to_record() | {"header": e.header.model_dump()},
                                  TOPIC, 0, i) | {"event_digest": i}
                           for i, e in enumerate(events)])
    running = 0
    lock = threading.Lock()

    class Flaky(LocalStore):
        def put_file(self, key: str, path: str | os.PathLike[str]) -> int:
            nonlocal running
            with lock:
                running += 1
            try:
                if "task=code" in key:
                    raise OSError("disk full (injected)")
                threading.Event().wait(0.05)  # the other writes are still going on
                return super().put_file(key, path)
            finally:
                with lock:
                    running -= 1

    w = ArchiveWriter(Flaky(tmp_path / "arch"), write_threads=3)
    with pytest.raises(OSError, match="injected"):
        w.write_batch(table, TOPIC, 0, 0, len(events) - 1)
    assert running == 0
    w.close()


def test_crash_between_upload_and_commit_replays_the_same_batch_boundary(
        tmp_path: Path) -> None:
    """A time-dependent (explicit) flush uploaded but never committed is rebuilt exactly on
    restart, so its keys are overwritten instead of duplicated under different names."""
    store = LocalStore(tmp_path / "arch")
    events = fleet()
    recs = records(events)
    sh1 = shell_for(store, tmp_path)
    sh1.process(recs[:10])
    [batch] = sh1.flush_all().batches  # uploaded + marker; the process dies before commit
    assert (batch.first_offset, batch.last_offset) == (0, 9)

    sh2 = shell_for(store, tmp_path)
    assert sh2.assigned(TOPIC, 0, committed=0) == [(0, 9)]
    got = sh2.process(recs)  # the group re-delivers from the committed offset 0
    got.batches += sh2.flush_all().batches
    assert [(b.first_offset, b.last_offset) for b in got.batches] == [(0, 9), (10, len(recs) - 1)]
    sh2.committed(got.batches)
    assert store.list(layout.BATCHES) == []
    con = ArchiveReader(store).connect()
    assert con.execute("SELECT count(*), count(DISTINCT event_id) FROM events").fetchone() == (
        len(events), len(events))


def test_undecodable_records_are_rejected_with_reason_and_still_committed(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "arch")
    sh = shell_for(store, tmp_path)
    good = records(fleet(sandboxes=1, episodes=1))
    bad = SimpleNamespace(topic=TOPIC, partition=0, offset=len(good), key=b"k", value=b"junk")
    step = sh.process([*good, bad])
    step.batches += sh.flush_all().batches
    assert [(r.offset, r.reason_code) for r in step.rejected] == [(len(good), "bad_magic")]
    assert step.batches[-1].last_offset == len(good)  # the bad offset is covered by the commit


# -- schema evolution ------------------------------------------------------------------------
def test_an_extra_optional_field_lands_in_the_same_object(tmp_path: Path) -> None:
    tc = json.loads(Path("schemas/avro/ToolCall.avsc").read_text())
    tc["fields"].append({"name": "cost_usd", "type": ["null", "double"], "default": None})
    reg = SchemaRegistry()
    new = reg.register_writer(tc)
    codec = Codec(reg)
    events = episode_events("web", "sb-1", "ep-1", tool_calls=2, t0_ms=T0)
    recs = records(events)
    rec = events[1].to_record()
    buf = io.BytesIO()
    buf.write(MAGIC + new.fingerprint)
    schemaless_writer(buf, new.parsed, {**rec, "cost_usd": 0.5})
    recs[1].value = buf.getvalue()  # the same ToolCall, from a newer producer

    store = LocalStore(tmp_path / "arch")
    sh = shell_for(store, tmp_path, codec=codec)
    sh.process(recs)
    sh.flush_all()
    [obj] = store.list("events/")
    t = pq.read_table(store.duckdb_path(obj.key))
    assert t.num_rows == len(events)
    payload = json.loads(t.filter(pa.compute.equal(t["seq"], 1))["payload_json"][0].as_py())
    assert payload["cost_usd"] == 0.5


# -- retention -------------------------------------------------------------------------------
def test_retention_dry_run_lists_and_does_not_delete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "arch")
    archive_all(store, tmp_path, fleet(sandboxes=2, episodes=1))
    before = [o.key for o in store.list()]
    now = T0 + 10 * 86_400_000
    assert retention(store, 30, now_ms=now, dry_run=True) == []
    doomed = retention(store, 5, now_ms=now, dry_run=True)
    assert doomed and all(k.startswith(("events/date=2024-05-01", "index/date=2024-05-01"))
                          for k in doomed)
    assert [o.key for o in store.list()] == before
    assert sorted(retention(store, 5, now_ms=now)) == sorted(doomed)
    assert not store.list("events/") and not store.list("index/")


# -- compaction ------------------------------------------------------------------------------
def _snapshot_count(store: ObjectStore) -> tuple[int, int, int]:
    """What a reader sees: (rows, distinct event ids, manifest generation)."""
    m = read_manifest(store)
    total = 0
    ids: set[str] = set()
    for _, info in live_objects(store, m, "events"):
        with store.open_input(info.key) as f:
            col = pq.read_table(f, columns=["event_id"])["event_id"].to_pylist()
        total += len(col)
        ids.update(col)
    return total, len(ids), m.generation


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_compaction_swaps_atomically_under_a_concurrent_reader(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store: ObjectStore = (LocalStore(tmp_path / "arch") if backend == "local"
                          else request.getfixturevalue("s3_store"))
    events = fleet(sandboxes=6, episodes=2)
    archive_all(store, tmp_path, events, target_object_bytes=3_000)
    n_small = len(store.list("events/"))
    assert n_small > 6
    seen: list[tuple[int, int, int]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append(_snapshot_count(store))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=reader)
    th.start()
    try:
        rep = compact(store, target_bytes=10 * 1024 * 1024, min_age_ms=0, now_ms=T0 + 86_400_000)
        # Replaced objects stay until the grace period is over: readers still on the old
        # generation can finish.
        assert len(store.list("events/")) == n_small + len(rep.outputs)
    finally:
        stop.set()
        th.join()
    assert not errors
    purge = compact(store, min_age_ms=0, grace_ms=0, now_ms=T0 + 86_400_000 + 1)
    assert rep.outputs and len(rep.inputs) == n_small
    assert sorted(purge.purged) == sorted(rep.inputs)
    assert seen, "the reader never completed a pass"
    for total, distinct, _gen in seen:  # never both (duplicates) and never neither (missing)
        assert (total, distinct) == (len(events), len(events))
    assert len(store.list("events/")) == len(rep.outputs)
    after = _snapshot_count(store)
    assert after[:2] == (len(events), len(events))
    reader_ = ArchiveReader(store)
    ep = reader_.episode("web", "sb-2", "ep-1")
    assert ep.equals(reader_.scan_episode("web", "sb-2", "ep-1")) and ep.num_rows == 8


def test_an_unfinished_compaction_is_invisible_and_cleaned_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path / "arch")
    events = fleet(sandboxes=4, episodes=1)
    archive_all(store, tmp_path, events, target_object_bytes=2_000)
    import trajbus.archive.maintenance as maint

    def crash(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("killed before the switch")

    monkeypatch.setattr(maint, "switch_manifest", crash)
    with pytest.raises(RuntimeError):
        compact(store, min_age_ms=0, now_ms=T0 + 86_400_000)
    assert _snapshot_count(store)[:2] == (len(events), len(events))
    monkeypatch.undo()
    rep = compact(store, min_age_ms=0, now_ms=T0 + 86_400_000)
    assert rep.orphans and rep.outputs
    assert _snapshot_count(store) == (len(events), len(events), 1)


# -- CLI -------------------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trajbus")
    archive_cli.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_cli_episode_sql_and_retention(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    store = LocalStore(tmp_path / "arch")
    archive_all(store, tmp_path, fleet(sandboxes=2, episodes=1, trace=b"abc" * 50))
    url = str(tmp_path / "arch")
    out = tmp_path / "ep.trace"
    assert _cli(["archive", "--url", url, "episode", "--task", "web", "--sandbox", "sb-0",
                 "--episode", "ep-0", "--json", "--trace-out", str(out)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["seq"] for r in lines] == list(range(len(lines)))
    assert out.read_bytes() == b"abc" * 50
    assert _cli(["archive", "--url", url, "sql", "SELECT count(*) AS n FROM episodes",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": 2}
    assert _cli(["archive", "--url", url, "retention", "--days", "1", "--dry-run"]) == 0
    assert "would delete" in capsys.readouterr().err
    assert store.list("events/")
    with pytest.raises(SystemExit):
        _cli(["archive", "--help"])
    assert "events/date=YYYY-MM-DD" in capsys.readouterr().out
