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

import datetime
import io
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SEQ_RANGE = pa.struct([("first", pa.int64()), ("last", pa.int64())])
"""An inclusive range of seqs: the index's ``seq_runs`` and the episode table's ``gaps``."""

INDEX_SCHEMA = pa.schema([
    ("task", pa.string()),
    ("sandbox", pa.string()),
    ("episode", pa.string()),
    ("object_key", pa.string()),
    ("date", pa.date32()),
    ("hour", pa.int32()),
    ("first_seq", pa.int64()),
    ("last_seq", pa.int64()),
    ("end_seq", pa.int64()),
    ("seq_runs", pa.list_(SEQ_RANGE)),
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


def _row_numbers(n: int) -> pa.Array:
    """0, 1, ..., n-1 as int64, built in C (``pa.array(range(n))`` converts n Python ints)."""
    return pc.subtract(pc.cumulative_sum(pa.nulls(n, pa.int64()).fill_null(1)), 1)


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
        "i": _row_numbers(n),
        "b": approx_row_bytes(table),
        "end": pc.equal(table.column("kind"), "EpisodeEnd"),
        "end_seq": pc.if_else(pc.equal(table.column("kind"), "EpisodeEnd"),
                              table.column("seq"), pa.scalar(None, pa.int64())),
        "outcome": pc.if_else(pc.equal(table.column("kind"), "EpisodeEnd"),
                              table.column("outcome"), pa.scalar(None, pa.string())),
        "topic": table.column("kafka_topic"),
        "part": table.column("kafka_partition"),
        "off": table.column("kafka_offset"),
    })
    agg = work.group_by(["task", "sandbox", "episode"], use_threads=False).aggregate([
        ("seq", "min"), ("seq", "max"), ("seq", "count"), ("seq", "count_distinct"),
        ("t", "min"), ("t", "max"), ("i", "min"), ("i", "max"), ("b", "sum"),
        ("end", "any"), ("end_seq", "max"), ("outcome", "max"), ("topic", "min"),
        ("part", "min"), ("off", "min"), ("off", "max"),
    ])
    return _index_rows(agg, _seq_runs(work, agg), object_key, date, hour,
                       list(row_group_starts))


def _seq_runs(work: pa.Table, agg: pa.Table) -> pa.Array:
    """Per aggregate row (same order as ``agg``): the episode's seqs in this object as
    maximal runs of consecutive seqs, ``[{first, last}, ...]``. ``work`` is in file order,
    sorted by (sandbox, episode, seq); the runs are joined back onto ``agg``'s keys."""
    from trajbus.archive.writer import _dense_rank  # here: writer imports this module

    n = work.num_rows
    seq = work.column("seq").combine_chunks()
    key = pc.add(pc.multiply(pc.fill_null(_dense_rank(work.column("sandbox")), -1), n + 1),
                 pc.fill_null(_dense_rank(work.column("episode")), -1))
    if n > 1:
        cont = pc.and_(pc.equal(key.slice(1), key.slice(0, n - 1)),
                       pc.less_equal(pc.subtract(seq.slice(1), seq.slice(0, n - 1)), 1))
        start = pa.concat_arrays([pa.array([True]), pc.invert(cont)])
    else:
        start = pa.array([True] * n)
    end = pa.concat_arrays([start.slice(1), pa.array([True])]) if n else start
    null_ep = "\x00"  # episode ids never contain NUL: stands for null (joins skip nulls)
    runs = pa.table({
        "task": work.column("task").filter(start), "sandbox": work.column("sandbox").filter(start),
        "episode": pc.fill_null(work.column("episode").filter(start), null_ep),
        "first": seq.filter(start), "last": seq.filter(end),
    }).group_by(["task", "sandbox", "episode"], use_threads=False).aggregate(
        [("first", "list"), ("last", "list")])
    # the aggregate's row order: look the runs' groups up by key (one entry per episode)
    keys = ("task", "sandbox", "episode")
    where = {k: i for i, k in enumerate(zip(*(runs.column(c).to_pylist() for c in keys),
                                            strict=True))}
    agg_keys = zip(agg.column("task").to_pylist(), agg.column("sandbox").to_pylist(),
                   pc.fill_null(agg.column("episode"), null_ep).to_pylist(), strict=True)
    runs = runs.take(pa.array([where[k] for k in agg_keys], pa.int64()))
    firsts = runs.column("first_list").combine_chunks()
    lasts = runs.column("last_list").combine_chunks()
    return pa.ListArray.from_arrays(firsts.offsets, pa.StructArray.from_arrays(
        [firsts.values, lasts.values], fields=list(SEQ_RANGE)))


def _row_group_of(i: pa.Array, starts: list[int]) -> pa.Array:
    """Row group of each row index ``i``: ``bisect_right(starts, i) - 1`` (starts[0] == 0)."""
    rg: Any = pa.scalar(-1, pa.int32())
    for s in starts:
        rg = pc.add(rg, pc.cast(pc.greater_equal(i, s), pa.int32()))
    return rg


def _index_rows(agg: pa.Table, runs: pa.Array, object_key: str, date: str, hour: str,
                starts: list[int]) -> pa.Table:
    """The index table from the per-episode aggregates, computed column-wise."""
    n = agg.num_rows
    first, last = agg.column("seq_min"), agg.column("seq_max")
    distinct = agg.column("seq_count_distinct")
    has_start = pc.equal(first, 0)
    has_end = pc.fill_null(agg.column("end_any"), False)
    outcome = agg.column("outcome_max")
    gapless = pc.equal(pc.add(pc.subtract(last, first), 1), distinct)
    whole = pc.if_else(pc.equal(outcome, "TRUNCATED"), "truncated", "complete")
    comp = pc.if_else(
        pc.is_null(agg.column("episode")), "stream",
        pc.if_else(pc.invert(gapless), "has_gaps",
                   pc.if_else(pc.and_(has_start, has_end),
                              pc.fill_null(whole, "complete"), "partial")))

    def const(v: str) -> pa.Array:
        return pa.nulls(n, pa.string()).fill_null(v)

    day = pa.scalar(datetime.date.fromisoformat(date), pa.date32())

    cols = {
        "task": agg.column("task"), "sandbox": agg.column("sandbox"),
        "episode": agg.column("episode"),
        "object_key": const(object_key),
        "date": pa.nulls(n, pa.date32()).fill_null(day),
        "hour": pa.nulls(n, pa.int32()).fill_null(int(hour)),
        "first_seq": first, "last_seq": last, "end_seq": agg.column("end_seq_max"),
        "seq_runs": runs, "event_count": agg.column("seq_count"),
        "distinct_seqs": distinct, "bytes": agg.column("b_sum"),
        "start_time_ms": agg.column("t_min"), "end_time_ms": agg.column("t_max"),
        "has_start": has_start, "has_end": has_end, "outcome": outcome,
        "completeness": comp,
        "row_group_first": _row_group_of(agg.column("i_min"), starts),
        "row_group_last": _row_group_of(agg.column("i_max"), starts),
        "kafka_topic": agg.column("topic_min"), "kafka_partition": agg.column("part_min"),
        "first_offset": agg.column("off_min"), "last_offset": agg.column("off_max"),
    }
    out = pa.table([pc.cast(cols[f.name], f.type) for f in INDEX_SCHEMA], schema=INDEX_SCHEMA)
    return out.sort_by([("sandbox", "ascending"), ("episode", "ascending")])


def index_to_bytes(index: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(index, buf, compression="zstd")
    return buf.getvalue()


def index_from_bytes(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data), schema=INDEX_SCHEMA)
