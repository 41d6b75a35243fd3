"""The episode index: one row per (task, sandbox, episode, object), stored beside the data.

``index/date=D/task=T/<object file name>`` holds the index rows of the data object with the
same file name. A row says where an episode's events are inside that object (row-group range)
and what the object holds of it (seq range, count, bytes, event-time span, completeness).
Reading one episode = read the (small) index rows of its task, then only the listed row groups
of the listed objects (``pyarrow.parquet.ParquetFile.read_row_groups``).

``completeness`` of one object's segment of an episode:

* ``complete``: seq 0 (EpisodeStart) to the EpisodeEnd, gapless, outcome TERMINAL;
* ``truncated``: the same, but the episode ended TRUNCATED (RLDS truncation semantics);
* ``partial``: gapless, but the episode's start or end lies in other objects (or not yet);
* ``has_gaps``: some seq inside ``[first_seq, last_seq]`` is missing from this object;
* ``stream``: sandbox-level events (no episode; the lifecycle stream).
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

INDEX_SCHEMA = pa.schema([
    ("task", pa.string()),
    ("sandbox", pa.string()),
    ("episode", pa.string()),
    ("object_key", pa.string()),
    ("date", pa.string()),
    ("hour", pa.string()),
    ("first_seq", pa.int64()),
    ("last_seq", pa.int64()),
    ("event_count", pa.int64()),
    ("distinct_seqs", pa.int64()),
    ("bytes", pa.int64()),
    ("start_time_ms", pa.int64()),
    ("end_time_ms", pa.int64()),
    ("has_start", pa.bool_()),
    ("has_end", pa.bool_()),
    ("outcome", pa.string()),
    ("completeness", pa.string()),
    ("row_group_first", pa.int32()),
    ("row_group_last", pa.int32()),
    ("kafka_topic", pa.string()),
    ("kafka_partition", pa.int32()),
    ("first_offset", pa.int64()),
    ("last_offset", pa.int64()),
])


def approx_row_bytes(table: pa.Table) -> pa.Array:
    """Per-row uncompressed size estimate (payload + data + fixed overhead), vectorised."""
    size = pa.scalar(160, pa.int64())
    for col in ("data", "payload_json"):
        lengths = pc.fill_null(pc.cast(pc.binary_length(table.column(col)), pa.int64()), 0)
        size = pc.add(size, lengths)
    if isinstance(size, pa.Scalar):  # empty table
        return pa.array([], pa.int64())
    return size.combine_chunks() if isinstance(size, pa.ChunkedArray) else size


def build_index(table: pa.Table, object_key: str, date: str, hour: str,
                row_group_starts: Sequence[int]) -> pa.Table:
    """Index rows for one data object. ``table`` is the object's content in file order;
    ``row_group_starts[i]`` is the first row of row group ``i``."""
    if table.num_rows == 0:
        return INDEX_SCHEMA.empty_table()
    n = table.num_rows
    work = pa.table({
        "task": table.column("task"),
        "sandbox": table.column("sandbox"),
        "episode": table.column("episode"),
        "seq": table.column("seq"),
        "t": table.column("event_time_ms"),
        "i": pa.array(range(n), pa.int64()),
        "b": approx_row_bytes(table),
        "end": pc.equal(table.column("kind"), "EpisodeEnd"),
        "outcome": pc.if_else(pc.equal(table.column("kind"), "EpisodeEnd"),
                              table.column("outcome"), pa.scalar(None, pa.string())),
        "topic": table.column("kafka_topic"),
        "part": table.column("kafka_partition"),
        "off": table.column("kafka_offset"),
    })
    agg = work.group_by(["task", "sandbox", "episode"], use_threads=False).aggregate([
        ("seq", "min"), ("seq", "max"), ("seq", "count"), ("seq", "count_distinct"),
        ("t", "min"), ("t", "max"), ("i", "min"), ("i", "max"), ("b", "sum"),
        ("end", "any"), ("outcome", "max"), ("topic", "min"), ("part", "min"),
        ("off", "min"), ("off", "max"),
    ])
    starts = list(row_group_starts)
    rows: dict[str, list[object]] = {f.name: [] for f in INDEX_SCHEMA}
    for r in agg.to_pylist():
        first, last = r["seq_min"], r["seq_max"]
        distinct = r["seq_count_distinct"]
        has_start = first == 0
        has_end = bool(r["end_any"])
        if r["episode"] is None:
            comp = "stream"
        elif last - first + 1 != distinct:
            comp = "has_gaps"
        elif has_start and has_end:
            comp = "truncated" if r["outcome_max"] == "TRUNCATED" else "complete"
        else:
            comp = "partial"
        values = {
            "task": r["task"], "sandbox": r["sandbox"], "episode": r["episode"],
            "object_key": object_key, "date": date, "hour": hour,
            "first_seq": first, "last_seq": last, "event_count": r["seq_count"],
            "distinct_seqs": distinct, "bytes": r["b_sum"],
            "start_time_ms": r["t_min"], "end_time_ms": r["t_max"],
            "has_start": has_start, "has_end": has_end, "outcome": r["outcome_max"],
            "completeness": comp,
            "row_group_first": bisect.bisect_right(starts, r["i_min"]) - 1,
            "row_group_last": bisect.bisect_right(starts, r["i_max"]) - 1,
            "kafka_topic": r["topic_min"], "kafka_partition": r["part_min"],
            "first_offset": r["off_min"], "last_offset": r["off_max"],
        }
        for k, v in values.items():
            rows[k].append(v)
    out = pa.table(rows, schema=INDEX_SCHEMA)
    return out.sort_by([("sandbox", "ascending"), ("episode", "ascending")])


def index_to_bytes(index: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(index, buf, compression="zstd")
    return buf.getvalue()


def index_from_bytes(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data), schema=INDEX_SCHEMA)
