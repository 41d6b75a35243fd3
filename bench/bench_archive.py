"""Archive benchmark: writer throughput, object sizes for a simulated hour, episode lookup.

    python bench/bench_archive.py --json out.json [--events N] [--hour-events N] [--dir D]

Measures, on the local-directory store (the embedded default):

1. throughput of ``ArchiveWriter.write_batch`` (split by date/hour/task, sort by (sandbox,
   episode, seq), zstd Parquet, index, marker) versus raw ``pyarrow.parquet.write_table`` of
   the same rows (zstd), in events/s and MB/s of Arrow data, and the full shell path
   (Avro decode -> rows -> spool -> batcher -> writer) on a smaller sample;
2. a simulated hour of 1,000 sandboxes (scaled down to ``--hour-events`` events, 6 partitions,
   10 tasks) through the real batcher and writer: object count and median object size, before
   and after compaction;
3. one-episode lookup through the index versus a full scan of the task, and versus DuckDB SQL
   over the ``events`` view, on an archive of ``--events`` events (default 10 million).

Prints one summary line and writes all figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trajbus.archive.archiver import ArchiveShell
from trajbus.archive.core import ArchiveBatcher
from trajbus.archive.maintenance import compact
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events, synthetic_table
from trajbus.archive.writer import ArchiveWriter
from trajbus.bus.settings import ArchiveSettings

TOPIC = "trajbus.sandbox.events"
T0 = 1_714_557_600_000


def _timed(fn: Any, repeat: int = 1) -> tuple[float, Any]:
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_throughput(root: Path, n: int) -> dict[str, Any]:
    table = synthetic_table(n, data_bytes=256, events_per_episode=200)
    mb = table.nbytes / 1e6
    store = LocalStore(root / "tp")
    writer = ArchiveWriter(store)
    t_ours, _ = _timed(lambda: writer.write_batch(table, TOPIC, 0, 0, n - 1))
    raw = root / "raw.parquet"
    t_raw, _ = _timed(lambda: pq.write_table(table, raw, compression="zstd",
                                             row_group_size=50_000))
    # The whole shell path, from Avro bytes, on a sample (per-record Python decode).
    sample: list[Any] = []
    i = 0
    while len(sample) < min(n, 50_000):
        for e in episode_events(f"task-{i % 10}", f"sb-{i}", "ep-0", tool_calls=40, t0_ms=T0,
                                trace=b"x" * 1024, chunk=256):
            sample.append(SimpleNamespace(topic=TOPIC, partition=0, offset=len(sample),
                                          key=None, value=e.encode()))
        i += 1
    shell = ArchiveShell(LocalStore(root / "shell"), ArchiveSettings(
        url="unused", spool_dir=str(root / "spool")))

    def run_shell() -> None:
        shell.process(sample)
        shell.flush_all()

    t_shell, _ = _timed(run_shell)
    return {
        "events": n, "arrow_mb": round(mb, 1),
        "writer_events_per_s": round(n / t_ours), "writer_mb_per_s": round(mb / t_ours, 1),
        "raw_pyarrow_events_per_s": round(n / t_raw), "raw_mb_per_s": round(mb / t_raw, 1),
        "writer_vs_raw_ratio": round(t_raw / t_ours, 3),
        "shell_from_avro_events": len(sample),
        "shell_from_avro_events_per_s": round(len(sample) / t_shell),
    }


def bench_hour(root: Path, n: int, target_bytes: int) -> dict[str, Any]:
    """1,000 sandboxes, 10 tasks, 6 partitions, one hour of event time, through the real
    batcher (size/span rotation per partition) and writer."""
    partitions = 6
    table = synthetic_table(n, sandboxes=1_000, tasks=10, data_bytes=2048,
                            events_per_episode=200, partitions=partitions)
    store = LocalStore(root / "hour")
    writer = ArchiveWriter(store)
    batcher = ArchiveBatcher(target_object_bytes=target_bytes, max_open_ms=6 * 3600 * 1000)
    sizes = (pa.compute.add(pa.compute.fill_null(pa.compute.binary_length(table["data"]), 0),
                            200)).to_pylist()
    parts = table["kafka_partition"].to_pylist()
    offs = table["kafka_offset"].to_pylist()
    times = table["event_time_ms"].to_pylist()
    flushes = []
    t = time.perf_counter()
    for p, o, ts, sz in zip(parts, offs, times, sizes, strict=True):
        flushes += batcher.add(TOPIC, p, o, ts, sz)
    flushes += batcher.flush()
    t_batcher = time.perf_counter() - t
    t = time.perf_counter()
    by_part = {p: table.filter(pa.compute.equal(table["kafka_partition"], p))
               for p in range(partitions)}
    for f in flushes:
        pt = by_part[f.partition]
        mask = pa.compute.and_(pa.compute.greater_equal(pt["kafka_offset"], f.first_offset),
                               pa.compute.less_equal(pt["kafka_offset"], f.last_offset))
        writer.write_batch(pt.filter(mask), TOPIC, f.partition, f.first_offset, f.last_offset)
    t_write = time.perf_counter() - t
    before = [o.size for o in store.list("events/")]
    t = time.perf_counter()
    compact(store, target_bytes=target_bytes, min_age_ms=0, grace_ms=0, now_ms=T0 + 86_400_000)
    compact(store, target_bytes=target_bytes, min_age_ms=0, grace_ms=0,
            now_ms=T0 + 86_400_000 + 1)  # purge the replaced objects
    t_compact = time.perf_counter() - t
    after = [o.size for o in store.list("events/")]
    return {
        "events": n, "sandboxes": 1_000, "tasks": 10, "partitions": partitions,
        "arrow_mb": round(table.nbytes / 1e6, 1), "target_object_bytes": target_bytes,
        "batches": len(flushes), "batcher_events_per_s": round(n / t_batcher),
        "write_s": round(t_write, 2),
        "objects": len(before), "median_object_bytes": int(statistics.median(before)),
        "objects_after_compaction": len(after),
        "median_object_bytes_after_compaction": int(statistics.median(after)),
        "compact_s": round(t_compact, 2),
    }


def bench_lookup(root: Path, n: int) -> dict[str, Any]:
    store = LocalStore(root / "big")
    writer = ArchiveWriter(store)
    chunk = 1_000_000
    t = time.perf_counter()
    for k, start in enumerate(range(0, n, chunk)):
        m = min(chunk, n - start)
        part = synthetic_table(m, sandboxes=10_000, tasks=10, events_per_episode=250,
                               start=start, partitions=1)
        writer.write_batch(part, TOPIC, k, start, start + m - 1)
    t_build = time.perf_counter() - t
    reader = ArchiveReader(store)
    task, sandbox, episode = "task-7", "sb-4567", "sb-4567-ep-1"
    t_index, ep = _timed(lambda: reader.episode(task, sandbox, episode), repeat=3)
    t_scan, scan = _timed(lambda: reader.scan_episode(task, sandbox, episode), repeat=1)
    assert ep.equals(scan), "index lookup and full scan disagree"
    con = reader.connect()
    q = ("SELECT * FROM events WHERE task = ? AND sandbox = ? AND episode = ? ORDER BY seq")
    t_sql, rows = _timed(lambda: con.execute(q, [task, sandbox, episode]).fetchall(), repeat=3)
    assert len(rows) == ep.num_rows
    objects = store.list("events/")
    return {
        "events": n, "build_s": round(t_build, 1), "objects": len(objects),
        "archive_bytes": sum(o.size for o in objects), "episode_events": ep.num_rows,
        "index_lookup_ms": round(t_index * 1000, 1), "full_scan_ms": round(t_scan * 1000, 1),
        "speedup": round(t_scan / t_index, 1), "duckdb_sql_ms": round(t_sql * 1000, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the figures here")
    ap.add_argument("--events", type=int, default=10_000_000,
                    help="archive size for the lookup benchmark (default 10,000,000)")
    ap.add_argument("--throughput-events", type=int, default=1_000_000)
    ap.add_argument("--hour-events", type=int, default=600_000,
                    help="events of the simulated hour (scaled down from ~1e8)")
    ap.add_argument("--target-mb", type=float, default=64.0)
    ap.add_argument("--dir", help="work directory (default: a temp dir, removed afterwards)")
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-archive-"))
    try:
        tp = bench_throughput(root, args.throughput_events)
        hour = bench_hour(root, args.hour_events, int(args.target_mb * 1024 * 1024))
        look = bench_lookup(root, args.events)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"throughput": tp, "hour": hour, "lookup": look,
                           "python": sys.version.split()[0], "pyarrow": pa.__version__}
    out["targets"] = [
        {"measure": "archive writer / raw pyarrow events/s", "result": tp["writer_vs_raw_ratio"],
         "target": ">= 0.5", "met": tp["writer_vs_raw_ratio"] >= 0.5},
        {"measure": f"episode lookup via index on {look['events']:,} events (ms)",
         "result": look["index_lookup_ms"], "target": "<= 200",
         "met": look["index_lookup_ms"] <= 200},
    ]
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"archive: writer {tp['writer_events_per_s']:,} ev/s {tp['writer_mb_per_s']} MB/s "
          f"(x{tp['writer_vs_raw_ratio']} of raw pyarrow), from-avro "
          f"{tp['shell_from_avro_events_per_s']:,} ev/s; hour: {hour['objects']} objects "
          f"median {hour['median_object_bytes'] / 1e6:.2f} MB -> "
          f"{hour['objects_after_compaction']} after compaction; lookup on "
          f"{look['events']:,} events: index {look['index_lookup_ms']} ms vs scan "
          f"{look['full_scan_ms']} ms (x{look['speedup']}), duckdb {look['duckdb_sql_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
