"""Specification of the archive's pure parts: batching decisions, row flattening, layout, keys."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pytest
from fastavro import schemaless_writer
from hypothesis import given, settings
from hypothesis import strategies as st

from trajbus.archive import layout
from trajbus.archive.core import ArchiveBatcher
from trajbus.archive.rows import (
    ARCHIVE_SCHEMA,
    decode_as_written,
    decoded_to_row,
    row_to_record,
    rows_to_table,
    to_row,
)
from trajbus.archive.storage import InvalidKeyError, validate_key
from trajbus.archive.synth import episode_events
from trajbus.schemas.codec import MAGIC, Codec, default_codec
from trajbus.schemas.registry import SchemaRegistry

T = "trajbus.sandbox.events"


# -- batching --------------------------------------------------------------------------------
def test_size_rotation_flushes_the_batch_before_the_record_that_would_overflow() -> None:
    b = ArchiveBatcher(target_object_bytes=100, max_open_ms=10**9)
    assert b.add(T, 0, 0, 1_000, 60) == []
    [f] = b.add(T, 0, 1, 1_001, 60)
    assert (f.first_offset, f.last_offset, f.rows, f.reason) == (0, 0, 1, "size")
    assert f.commit_offset == 1
    assert b.open_batches() == {(T, 0): (1, 1, 1, 60)}


def test_a_record_larger_than_the_target_is_flushed_alone() -> None:
    b = ArchiveBatcher(target_object_bytes=100, max_open_ms=10**9)
    [f] = b.add(T, 0, 7, 1_000, 500)
    assert (f.first_offset, f.last_offset, f.reason) == (7, 7, "size")
    assert b.open_batches() == {}


def test_event_time_span_rotation_uses_event_time_not_wall_clock() -> None:
    b = ArchiveBatcher(target_object_bytes=10**9, max_open_ms=1_000)
    assert b.add(T, 0, 0, 10_000, 1) == []
    assert b.add(T, 0, 1, 10_900, 1) == []
    [f] = b.add(T, 0, 2, 11_001, 1)  # span would be 1001 ms
    assert (f.first_offset, f.last_offset, f.reason) == (0, 1, "span")


def test_tick_flushes_only_batches_older_than_max_open_by_the_watermark() -> None:
    b = ArchiveBatcher(target_object_bytes=10**9, max_open_ms=1_000)
    b.add(T, 0, 0, 10_000, 1)
    b.add(T, 1, 0, 10_500, 1)
    assert b.tick(10_999) == []
    [f] = b.tick(11_000)
    assert (f.partition, f.reason) == (0, "tick")
    assert list(b.open_batches()) == [(T, 1)]


def test_partitions_rotate_independently_and_explicit_flush_closes_all() -> None:
    b = ArchiveBatcher(target_object_bytes=10**9, max_open_ms=10**9)
    b.add(T, 0, 5, 1, 1)
    b.add(T, 3, 9, 1, 1)
    fl = b.flush()
    assert [(f.partition, f.first_offset, f.reason) for f in fl] == [(0, 5, "explicit"),
                                                                     (3, 9, "explicit")]
    assert b.flush() == []


def test_skipped_offsets_join_the_batch_so_their_offsets_are_committed() -> None:
    b = ArchiveBatcher(target_object_bytes=10**9, max_open_ms=10**9)
    b.add(T, 0, 0, 1, 1)
    b.skip(T, 0, 1)
    [f] = b.flush()
    assert (f.first_offset, f.last_offset, f.rows, f.commit_offset) == (0, 1, 1, 2)


def test_redelivered_offsets_are_ignored() -> None:
    b = ArchiveBatcher()
    b.add(T, 0, 0, 1, 1)
    b.add(T, 0, 1, 1, 1)
    assert b.add(T, 0, 1, 1, 1) == []
    assert b.stats.duplicates == 1
    assert b.open_batches()[(T, 0)][:3] == (0, 1, 2)


def test_expect_reproduces_a_recorded_boundary_whatever_size_says() -> None:
    """After a crash between upload and commit, the same batch must be rebuilt exactly."""
    b = ArchiveBatcher(target_object_bytes=100, max_open_ms=10**9)
    b.reset_position(T, 0, 10)
    b.expect(T, 0, 10, 12)
    assert b.add(T, 0, 10, 1, 90) == []
    assert b.add(T, 0, 11, 1, 90) == []  # would be a size flush without the expectation
    [f] = b.add(T, 0, 12, 1, 90)
    assert (f.first_offset, f.last_offset, f.reason) == (10, 12, "replay")
    [g] = b.add(T, 0, 13, 1, 200)  # back to normal rules
    assert g.reason == "size"


def test_snapshot_restore_round_trip() -> None:
    b = ArchiveBatcher(target_object_bytes=1000, max_open_ms=50)
    b.add(T, 0, 0, 1, 10)
    b.expect(T, 1, 3, 4)
    r = ArchiveBatcher.restore(json.loads(json.dumps(b.snapshot())))
    assert r.snapshot() == b.snapshot()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5_000), st.integers(1, 400)),
                min_size=1, max_size=120))
def test_batches_partition_the_offsets_exactly(recs: list[tuple[int, int, int]]) -> None:
    """Every accepted offset ends in exactly one flushed batch, batches are contiguous and in
    order per partition, and no batch exceeds the target unless it holds one record."""
    b = ArchiveBatcher(target_object_bytes=1_000, max_open_ms=2_000)
    next_off = {0: 0, 1: 0, 2: 0}
    flushes = []
    for p, t, n in recs:
        flushes += b.add(T, p, next_off[p], t, n)
        next_off[p] += 1
    flushes += b.flush()
    for p in range(3):
        mine = [f for f in flushes if f.partition == p]
        covered = [o for f in mine for o in range(f.first_offset, f.last_offset + 1)]
        assert covered == list(range(next_off[p]))
        for f in mine:
            assert f.nbytes <= 1_000 or f.rows == 1


# -- rows ------------------------------------------------------------------------------------
def _rows(events: list, topic: str = T) -> list[dict]:
    c = default_codec()
    return [decoded_to_row(c.decode(e.encode()), topic, 0, i) for i, e in enumerate(events)]


def test_every_kind_flattens_to_the_one_schema_and_back() -> None:
    events = episode_events("web", "sb-1", "ep-1", tool_calls=2, trace=b"0123456789", chunk=4)
    rows = _rows(events)
    table = rows_to_table(rows)
    assert table.schema == ARCHIVE_SCHEMA
    by_kind = {r["kind"]: r for r in rows}
    assert by_kind["ToolCall"]["tool"] == "browser.click"
    assert by_kind["ToolResult"]["status"] == "OK"
    chunks = [r["data"] for r in rows if r["kind"] == "TraceChunk"]
    assert b"".join(chunks) == b"0123456789"
    assert by_kind["EpisodeEnd"]["outcome"] == "TERMINAL"
    for e, r in zip(events, rows, strict=True):
        rec = row_to_record(r)
        want = e.model_dump(mode="json")
        assert rec["header"] == want["header"]
        assert rec["kind"] == e.KIND


def test_a_new_optional_field_goes_to_payload_json_not_a_new_column() -> None:
    """Schema evolution must never change the Arrow schema (that would split files)."""
    tc = json.loads(open("schemas/avro/ToolCall.avsc").read())
    tc["fields"].append({"name": "cost_usd", "type": ["null", "double"], "default": None})
    reg = SchemaRegistry()
    codec = Codec(reg)
    base = episode_events("web", "sb-1", "ep-1", tool_calls=1)[1].to_record()
    base["header"] = dict(base["header"])
    new_info = reg.register_writer(tc)
    buf = io.BytesIO()
    buf.write(MAGIC + new_info.fingerprint)
    schemaless_writer(buf, new_info.parsed, {**base, "cost_usd": 0.25})
    d = decode_as_written(codec, buf.getvalue())
    row = decoded_to_row(d, T, 0, 0)
    assert set(row) <= set(ARCHIVE_SCHEMA.names)  # sparse: an absent column is null
    assert json.loads(row["payload_json"])["cost_usd"] == 0.25
    assert rows_to_table([row]).schema == ARCHIVE_SCHEMA


def test_misfit_types_and_unknown_header_fields_are_kept_in_payload_json() -> None:
    rec = {"header": {"event_id": "e", "task": "t", "sandbox": "s", "episode": None, "seq": 0,
                      "event_time_ms": 1, "producer_id": "p", "policy_version": None,
                      "region": "eu"},
           "duration_ms": "slow", "blob_bytes": b"\x00\x01"}
    row = to_row("Custom", rec, T, 0, 0)
    payload = json.loads(row["payload_json"])
    assert payload["duration_ms"] == "slow" and row.get("duration_ms") is None
    assert payload["$header"] == {"region": "eu"}
    back = row_to_record(row)
    assert back["blob_bytes"] == b"\x00\x01" and back["header"]["region"] == "eu"
    assert pa.Table.from_pylist([row], schema=ARCHIVE_SCHEMA).num_rows == 1


# -- layout and keys -------------------------------------------------------------------------
def test_layout_keys_are_deterministic_and_parse_back() -> None:
    name = layout.batch_object_name(T, 3, 100, 199, "07")
    key = layout.events_key("2024-05-01", "07", "web", name)
    assert key == ("events/date=2024-05-01/hour=07/task=web/"
                   "trajbus.sandbox.events-3-00000000000000000100-00000000000000000199-h07.parquet")
    p = layout.parse_object_key(key)
    assert p is not None and (p.date, p.hour, p.task, p.compacted_generation) == (
        "2024-05-01", "07", "web", None)
    assert p.index_key == f"index/date=2024-05-01/task=web/{name}"
    q = layout.parse_object_key(p.index_key)
    assert q is not None and q.events_key == key
    assert layout.date_hour(1_714_557_600_000) == ("2024-05-01", "10")


@pytest.mark.parametrize("bad", ["../x", "/abs", "a//b", "a/./b", "a/../../b", "", "a\\b"])
def test_keys_cannot_escape_the_prefix(bad: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


@pytest.mark.parametrize("task", ["../etc", "a/b", "..", "-x", ""])
def test_task_ids_are_validated_before_they_become_paths(task: str) -> None:
    with pytest.raises(ValueError):
        layout.events_key("2024-05-01", "00", task, "x.parquet")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]),
                          st.one_of(st.none(), st.sampled_from(["e1", "e2", "e10"])),
                          st.integers(0, 5), st.integers(0, 1000)), min_size=0, max_size=60))
def test_fast_sort_equals_arrow_sort_by(rows: list[tuple[str, str | None, int, int]]) -> None:
    from trajbus.archive.writer import SORT_COLUMNS, sort_table

    t = pa.table({"sandbox": [r[0] for r in rows], "episode": [r[1] for r in rows],
                  "seq": pa.array([r[2] for r in rows], pa.int64()),
                  "kafka_offset": pa.array([r[3] for r in rows], pa.int64())})
    assert sort_table(t, SORT_COLUMNS).equals(
        t.sort_by([(c, "ascending") for c in SORT_COLUMNS]))


def test_a_batch_of_skipped_offsets_only_is_released_but_never_one_with_rows() -> None:
    """Ticks (skipped offsets) open a batch holding no row: the shell may drop it and commit
    past it; a batch with a row, or a boundary to reproduce after a crash, is kept."""
    b = ArchiveBatcher(target_object_bytes=1_000, max_open_ms=1_000)
    for off in range(3):
        assert b.skip("t", 0, off) == []
    assert b.release_empty("t", 0) and b.open_batches() == {}
    assert b.add("t", 0, 3, 10, 5) == [] and b.skip("t", 0, 4) == []
    assert not b.release_empty("t", 0) and b.open_batches()[("t", 0)] == (3, 4, 1, 5)
    b.expect("t", 1, 0, 5)
    b.skip("t", 1, 0)
    assert not b.release_empty("t", 1)
    assert b.release_empty("t", 2)  # nothing open at all
