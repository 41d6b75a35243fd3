"""Specification of the archive's column types: event time as a UTC timestamp (the integer
kept), the partition columns ``date`` DATE and ``hour`` INTEGER in every view and every
documented reader, JSON encoded once, and Avro schema evolution: objects written from an
older and a newer writer schema read together."""

from __future__ import annotations

import io
import json
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
from fastavro import schemaless_writer
from test_archive_store import T0, records, shell_for

from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events
from trajbus.schemas.codec import MAGIC, Codec
from trajbus.schemas.models import ToolCall, ToolResult, ToolStatus
from trajbus.schemas.registry import SchemaRegistry


def _archive(store: LocalStore, tmp_path: Path, recs: list, codec: Codec | None = None) -> None:
    sh = shell_for(store, tmp_path, codec=codec)
    step = sh.process(recs)
    sh.committed(step.batches + sh.flush_all().batches)


def test_timestamps_partitions_and_json_have_one_type_everywhere(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "a")
    events = episode_events("web", "sb-0", "ep-0", t0_ms=T0 + 1234)
    call = next(e for e in events if isinstance(e, ToolCall))
    events[events.index(call)] = call.model_copy(update={"args_canonical": '{"url":"/x"}'})
    _archive(store, tmp_path, records(events))
    con = ArchiveReader(store).connect()

    def types(sql: str) -> tuple[str, ...]:
        return tuple(con.execute(sql).fetchall()[0])

    assert types("SELECT typeof(event_time), typeof(event_time_ms), typeof(date), typeof(hour) "
                 "FROM events LIMIT 1") == ("TIMESTAMP WITH TIME ZONE", "BIGINT", "DATE",
                                            "INTEGER")
    assert types("SELECT typeof(date), typeof(hour) FROM episode_objects LIMIT 1") == (
        "DATE", "INTEGER")
    assert types("SELECT typeof(date), typeof(start_time) FROM episodes LIMIT 1") == (
        "DATE", "TIMESTAMP WITH TIME ZONE")
    assert types("SELECT count(*) FROM events WHERE epoch_ms(event_time) = event_time_ms "
                 "AND date = DATE '2024-05-01' AND hour = 10") == (len(events),)
    # JSON encoded once: the canonical arguments are a JSON document, not a quoted string
    assert types(f"SELECT args_canonical ->> 'url' FROM events WHERE seq = {call.header.seq}"
                 ) == ("/x",)
    for (payload,) in con.execute("SELECT payload_json FROM events WHERE payload_json IS NOT "
                                  "NULL").fetchall():
        for value in json.loads(payload).values():
            assert not (isinstance(value, str) and value[:1] in "{["), payload

    # the documented raw readers, with the documented partition types
    glob = f"{store.root}/events/**/*.parquet"
    assert duckdb.sql(f"SELECT typeof(date), typeof(hour), typeof(event_time) FROM read_parquet("
                      f"'{glob}', hive_partitioning=true, hive_types={{'date': DATE, "
                      "'hour': INTEGER}) LIMIT 1").fetchall() == [
        ("DATE", "INTEGER", "TIMESTAMP WITH TIME ZONE")]
    schema = pl.scan_parquet(glob, hive_partitioning=True, hive_schema={
        "date": pl.Date, "hour": pl.Int32, "task": pl.String}).collect_schema()
    assert (schema["date"], schema["hour"], schema["event_time"]) == (
        pl.Date, pl.Int32, pl.Datetime("ms", "UTC"))
    part = ds.partitioning(pa.schema([("date", pa.date32()), ("hour", pa.int32()),
                                      ("task", pa.string())]), flavor="hive")
    t = ds.dataset(store.root / "events", format="parquet", partitioning=part).to_table()
    assert (t.schema.field("date").type, t.schema.field("hour").type,
            t.schema.field("event_time").type) == (pa.date32(), pa.int32(),
                                                   pa.timestamp("ms", tz="UTC"))


def test_objects_from_an_older_and_a_newer_writer_schema_read_together(tmp_path: Path) -> None:
    """v1 producers archived first, a v2 producer (one more optional field) hours later: the
    objects differ in no column, and every reader reads both with the new field kept."""
    store = LocalStore(tmp_path / "a")
    old = episode_events("web", "sb-0", "ep-0", t0_ms=T0, tool_calls=2)
    _archive(store, tmp_path, records(old))

    tr = json.loads(Path("schemas/avro/ToolResult.avsc").read_text())
    tr["fields"].append({"name": "cost_usd", "type": ["null", "double"], "default": None})
    reg = SchemaRegistry()
    v2 = reg.register_writer(tr)
    new = episode_events("web", "sb-1", "ep-0", t0_ms=T0 + 7_200_000, tool_calls=2)
    recs = records(new, start=len(old))
    for r, e in zip(recs, new, strict=True):
        if isinstance(e, ToolResult):
            buf = io.BytesIO()
            buf.write(MAGIC + v2.fingerprint)
            schemaless_writer(buf, v2.parsed, {**e.to_record(), "cost_usd": 0.5})
            r.value = buf.getvalue()
    _archive(store, tmp_path, recs, codec=Codec(reg))
    files = sorted((store.root / "events").rglob("*.parquet"))
    assert len(files) == 2, "one object per hour: the v1 and the v2 ones"

    total = len(old) + len(new)
    glob = f"{store.root}/events/**/*.parquet"
    rows = duckdb.sql(f"SELECT sandbox, status, payload_json FROM read_parquet('{glob}', "
                      "hive_partitioning=true, hive_types={'date': DATE, 'hour': INTEGER}) "
                      "WHERE kind = 'ToolResult'").fetchall()
    assert len(rows) == 4 and {r[1] for r in rows} == {ToolStatus.OK.value}
    costs = {sb: json.loads(p or "{}").get("cost_usd") for sb, _, p in rows}
    assert costs == {"sb-0": None, "sb-1": 0.5}
    assert pl.scan_parquet(glob, hive_partitioning=True, hive_schema={
        "date": pl.Date, "hour": pl.Int32, "task": pl.String}).collect().height == total
    assert ds.dataset(store.root / "events", format="parquet").count_rows() == total
    con = ArchiveReader(store).connect()
    assert con.execute("SELECT count(*), count(DISTINCT hour) FROM events").fetchall() == [
        (total, 2)]
