"""Writing a flushed batch: Parquet objects, their index rows, and the batch marker.

For a batch ``[first, last]`` of (topic, partition), :meth:`ArchiveWriter.write_batch`:

1. splits the rows by (UTC date, hour, task) of their event time;
2. sorts each group by (sandbox, episode, seq, kafka_offset) and writes it as one Parquet
   object (zstd, statistics on, row groups capped by rows *and* bytes) to a local temp file;
3. uploads it under its deterministic key (``layout.events_key``): a complete-object PUT, so
   readers never see a partial object;
4. uploads the object's index rows (``index/date=D/task=T/<same name>``), after the object,
   so an index row never points at a missing object;
5. writes the batch marker ``_batches/<topic>-<partition>/<first>-<last>.json`` naming the
   objects.

Then the archiver's loop (``archive/archiver.py``):

6. publishes the step's dead letters;
7. commits ``last + 1`` for the batch's partition: the first moment the batch counts as
   archived. A commit refused after a rebalance keeps the marker for the next owner;
8. deletes the marker (:meth:`ArchiveWriter.clear_marker`).

A crash before step 7 leaves the marker; on restart the archiver replays exactly that batch
boundary (``ArchiveBatcher.expect``) and overwrites the same keys: no duplicate rows.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajbus.archive import layout
from trajbus.archive.index import approx_row_bytes, build_index, index_to_bytes
from trajbus.archive.rows import ARCHIVE_SCHEMA, fill_promoted, with_event_time
from trajbus.archive.storage import ObjectNotFoundError, ObjectStore

SORT_COLUMNS = ["sandbox", "episode", "seq", "kafka_offset"]
DICTIONARY_COLUMNS = ["task", "sandbox", "episode", "kind", "producer_id", "tool", "status",
                      "state", "previous_state", "node", "tenant", "outcome", "kafka_topic",
                      "probe", "content_type", "decision", "alert", "stage", "reason_code",
                      "source_topic", "dataset"]
HOUR_MS = 3_600_000


@dataclass(frozen=True, slots=True)
class WrittenObject:
    key: str
    index_key: str
    date: str
    hour: str
    task: str
    rows: int
    bytes: int
    row_groups: int
    index: pa.Table | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BatchResult:
    topic: str
    partition: int
    first_offset: int
    last_offset: int
    objects: list[WrittenObject]
    marker_key: str
    conflicts: list[WrittenObject] = field(default_factory=list)


def _dense_rank(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Dense rank of each value (0-based, nulls stay null, so they sort last): dictionary
    encode (hashing, O(n)), sort only the distinct values, and map the codes through the
    inverse permutation. Orders like ``pc.rank(..., tiebreaker="dense")`` (byte order for
    strings) but sorts ``distinct`` values instead of ``n``: several times faster on the
    archive's low-cardinality keys (task, sandbox, episode)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = pc.dictionary_encode(arr)
    rank_of_code = pc.cast(pc.sort_indices(pc.sort_indices(enc.dictionary)), pa.int64())
    return pc.take(rank_of_code, enc.indices)


def sort_indices(table: pa.Table, keys: list[str]) -> pa.Array:
    """Indices that sort ``table`` ascending by ``keys`` (nulls last, stable), as
    ``pc.sort_indices`` would, with string keys replaced by their dense ranks first so the
    multi-key sort compares integers only."""
    cols: dict[str, Any] = {}
    for name in keys:
        col = table.column(name)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = _dense_rank(col)
        cols[name] = col
    return pc.sort_indices(pa.table(cols), sort_keys=[(k, "ascending") for k in keys])


def sort_table(table: pa.Table, keys: list[str]) -> pa.Table:
    """``table`` sorted ascending by ``keys`` (nulls last), equal to ``Table.sort_by`` but
    several times faster (see :func:`sort_indices`)."""
    if table.num_rows < 2:
        return table
    return table.take(sort_indices(table, keys))


def split_groups(table: pa.Table) -> list[tuple[str, str, str, pa.Table]]:
    """(date, hour, task, rows sorted by SORT_COLUMNS) per group, in (hour, task) order."""
    n = table.num_rows
    if n == 0:
        return []
    hb = pc.divide(table.column("event_time_ms"), HOUR_MS)  # integer division for int64
    keys = table.select(["task", *SORT_COLUMNS]).append_column("_hb", hb)
    order = sort_indices(keys, ["_hb", "task", *SORT_COLUMNS])
    data = table.take(order)
    # groups are runs of equal (_hb, task) in sorted order: find where either changes
    hb_s = pc.take(hb, order)
    task_s = data.column("task")
    hb_k = pc.fill_null(hb_s, -(2**62))
    task_k = pc.fill_null(_dense_rank(task_s), -1)
    changed = pc.or_(pc.not_equal(hb_k.slice(1), hb_k.slice(0, n - 1)),
                     pc.not_equal(task_k.slice(1), task_k.slice(0, n - 1)))
    starts = [0, *(i + 1 for i in pc.indices_nonzero(changed).to_pylist()), n]
    out: list[tuple[str, str, str, pa.Table]] = []
    for lo, hi in itertools.pairwise(starts):
        date, hour = layout.date_hour(hb_s[lo].as_py() * HOUR_MS)
        out.append((date, hour, task_s[lo].as_py(), data.slice(lo, hi - lo)))
    return out


def row_group_starts(table: pa.Table, max_rows: int, max_bytes: int) -> list[int]:
    """First row of each row group: at most ``max_rows`` rows and about ``max_bytes``.

    Greedy, like filling groups row by row: a group takes the next row unless it already has
    ``max_rows`` rows or the row would take it past ``max_bytes`` (a group always takes at
    least one row). Computed on prefix sums with a binary search per group, not per row."""
    n = table.num_rows
    starts = [0]
    if n == 0:
        return starts
    max_rows = max(1, max_rows)
    sizes = approx_row_bytes(table)
    total = pc.sum(sizes).as_py() or 0
    if n <= max_rows and total <= max_bytes:
        return starts
    cum = [0, *pc.cumulative_sum(sizes).to_pylist()]  # cum[i] = bytes of rows [0, i)
    s = 0
    while True:
        # first j with cum[j] - cum[s] > max_bytes: rows s..j-2 fit, row j-1 does not
        j = bisect.bisect_right(cum, cum[s] + max_bytes, lo=s + 1)
        e = max(s + 1, min(s + max_rows, j - 1))
        if e >= n:
            return starts
        starts.append(e)
        s = e


class ArchiveWriter:
    """Writes sorted, indexed Parquet objects to a store. Thread-safe (no shared state but
    the write pool, itself thread-safe).

    ``write_threads``: the objects of one batch (one per hour and task) are written by this
    many threads at once. Parquet encoding, zstd and the upload release the GIL, so a second
    thread uses a second core; the batch is reported written only when every object is."""

    def __init__(self, store: ObjectStore, *, row_group_rows: int = 50_000,
                 row_group_bytes: int = 32 * 1024 * 1024, compression: str = "zstd",
                 compression_level: int | None = None, tmp_dir: str | None = None,
                 write_threads: int = 1) -> None:
        self.store = store
        self.row_group_rows = row_group_rows
        self.row_group_bytes = row_group_bytes
        self.compression = compression
        self.compression_level = compression_level
        self.tmp_dir = tmp_dir
        self.write_threads = max(1, write_threads)
        self._pool = (ThreadPoolExecutor(self.write_threads, thread_name_prefix="archive-write")
                      if self.write_threads > 1 else None)

    def close(self) -> None:
        """Stop the write threads (idle between batches; nothing is pending after a batch)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def write_object(self, table: pa.Table, key: str, index_key: str | None, date: str,
                     hour: str,
                     metadata: dict[str, str] | None = None,
                     sort: bool = True) -> WrittenObject:
        """Write one object (sorted unless ``sort=False``) plus its index file."""
        if sort:
            table = sort_table(table, SORT_COLUMNS)
        table = table.cast(ARCHIVE_SCHEMA) if table.schema != ARCHIVE_SCHEMA else table
        if table.column("event_time").null_count:  # rows read from an older archive schema
            table = with_event_time(table)
        table = fill_promoted(table)  # rows of a format-2 object (compaction): from the JSON
        starts = row_group_starts(table, self.row_group_rows, self.row_group_bytes)
        bounds = [*starts, table.num_rows]
        schema = ARCHIVE_SCHEMA.with_metadata(
            {**(ARCHIVE_SCHEMA.metadata or {}), **{k.encode(): v.encode()
                                                   for k, v in (metadata or {}).items()}}
        )
        if self.tmp_dir:
            os.makedirs(self.tmp_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".parquet", dir=self.tmp_dir)
        os.close(fd)
        try:
            with pq.ParquetWriter(tmp, schema, compression=self.compression,
                                  compression_level=self.compression_level,
                                  use_dictionary=DICTIONARY_COLUMNS,
                                  write_statistics=True) as w:
                for lo, hi in itertools.pairwise(bounds):
                    w.write_table(table.slice(lo, hi - lo).cast(schema), row_group_size=hi - lo)
            size = self.store.put_file(key, tmp)
        finally:
            os.unlink(tmp)
        index: pa.Table | None = None
        if index_key is not None:
            index = build_index(table, key, date, hour, starts)
            self.store.put_bytes(index_key, index_to_bytes(index))
        task = table.column("task")[0].as_py() if table.num_rows else ""
        return WrittenObject(key, index_key or "", date, hour, task, table.num_rows, size,
                             len(starts) if table.num_rows else 0, index)

    def write_batch(self, table: pa.Table, topic: str, partition: int, first_offset: int,
                    last_offset: int,
                    before_marker: Callable[[], None] | None = None,
                    conflicts: pa.Table | None = None,
                    area: str = "events") -> BatchResult:
        """Write one flushed (topic, partition) batch; see the module docstring.

        The batch marker is written *first*, naming every key the batch will write: a crash
        at any point after it leaves a marker, so the batch is replayed with exactly the same
        boundary (same keys, overwritten). A replay whose rows produce fewer objects than the
        earlier attempt deletes the earlier attempt's extra keys before writing. Conflicting
        copies (``conflicts``) go to ``conflicts/`` objects of the same name (no index). The
        rows go to the data area ``area`` (``events``; a context topic's area, such as
        ``decisions``) and their index to that area's index (``layout.index_key``).
        ``before_marker`` (tests) runs after the objects, before the batch is reported done."""
        meta = {"trajbus.kafka_topic": topic, "trajbus.kafka_partition": str(partition),
                "trajbus.first_offset": str(first_offset),
                "trajbus.last_offset": str(last_offset)}
        planned: list[tuple[str, str, str, str, pa.Table, str, str | None]] = []
        for date, hour, task, rows in split_groups(table):
            name = layout.batch_object_name(topic, partition, first_offset, last_offset, hour)
            planned.append(("data", date, hour, task, rows,
                            layout.data_key(area, date, hour, task, name),
                            layout.index_key(date, task, name, area)))
        if conflicts is not None and conflicts.num_rows:
            for date, hour, task, rows in split_groups(conflicts):
                name = layout.batch_object_name(topic, partition, first_offset, last_offset,
                                                hour)
                planned.append(("conflicts", date, hour, task, rows,
                                layout.conflicts_key(date, hour, task, name), None))
        keys = [k for p in planned for k in (p[5], p[6]) if k is not None]
        marker = layout.batch_marker_key(topic, partition, first_offset, last_offset)
        try:
            earlier = json.loads(self.store.get_bytes(marker)).get("keys", [])
        except ObjectNotFoundError:
            earlier = []
        self.store.put_bytes(marker, json.dumps({
            "topic": topic, "partition": partition, "first_offset": first_offset,
            "last_offset": last_offset, "keys": keys,
        }, sort_keys=True).encode())
        # index files before data objects: an index row never points at a missing object
        for key in sorted(set(earlier) - set(keys), key=lambda k: not k.startswith("index/")):
            self.store.delete(key)
        objects: list[WrittenObject] = []
        conflict_objects: list[WrittenObject] = []
        jobs = [(rows, key, index_key, date, hour) for _, date, hour, _, rows, key, index_key
                in planned]
        for (what, *_), written in zip(planned, self._write_objects(jobs, meta), strict=True):
            (objects if what == "data" else conflict_objects).append(written)
        if before_marker is not None:
            before_marker()
        return BatchResult(topic, partition, first_offset, last_offset, objects, marker,
                           conflict_objects)

    def _write_objects(self, jobs: list[tuple[pa.Table, str, str | None, str, str]],
                       meta: dict[str, str]) -> list[WrittenObject]:
        """Write every object (in ``jobs`` order); raise the first failure only after every
        write has ended, so no write is still running when the batch is retried."""
        if self._pool is None or len(jobs) < 2:
            return [self.write_object(*job, meta, sort=False) for job in jobs]
        futures = [self._pool.submit(self.write_object, *job, meta, sort=False)
                   for job in jobs]
        errors = [f.exception() for f in futures]  # waits for each
        for exc in errors:
            if exc is not None:
                raise exc
        return [f.result() for f in futures]

    def clear_marker(self, result: BatchResult) -> None:
        """After the commit: the batch is durable and committed, the marker is no longer
        needed."""
        self.store.delete(result.marker_key)

    def pending_batches(self, topic: str, partition: int,
                        committed: int) -> list[tuple[int, int]]:
        """Batches uploaded but not committed (``first >= committed``), oldest first.
        Markers of committed batches (``last < committed``) are deleted."""
        out: list[tuple[int, int]] = []
        for obj in self.store.list(layout.batch_marker_prefix(topic, partition)):
            first, last = layout.parse_marker_name(obj.key)
            if last < committed:
                self.store.delete(obj.key)
            elif first >= committed:
                out.append((first, last))
        return sorted(out)
