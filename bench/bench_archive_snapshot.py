"""Consistent reads during compaction (issue 38 item 3): what a documented reader sees while
`archive compact` swaps an hour's objects, and what an open table format would cost instead.

Parts (each bounded to seconds; local directory and moto's S3 server on loopback):

* ``during_compaction``: an hour of many small archiver objects, compacted (grace as the CLI's
  default) while a reader loop counts the rows with pyarrow, Polars and DuckDB, either through
  the raw glob the README documented before (``raw``) or through the manifest-resolved
  snapshot (``snapshot``, ``trajbus.archive.snapshot``). Wrong counts and errors per reader.
* ``resolve``: the time to resolve what to read: the snapshot (list + manifest) against a
  Delta Lake table (``deltalake``) holding the same objects, one commit per archiver batch.
* ``delta_commit``: what one Delta commit per batch costs the archiver (the per-batch step an
  open table format adds), local and S3, and whether concurrent committers work on S3
  without a lock service.

Run: ``.venv/bin/python bench/bench_archive_snapshot.py [--parts during_compaction,resolve,
delta_commit] [--json out.json]``. ``deltalake`` (``pip install deltalake``; not a trajbus
dependency) is needed for ``resolve`` and ``delta_commit``; without it they are skipped.
Results and the decision: bench/ANALYSIS.md, "Consistent reads during compaction".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajbus.archive.maintenance import compact
from trajbus.archive.storage import LocalStore, ObjectStore, S3Store, open_store
from trajbus.archive.synth import synthetic_table
from trajbus.archive.writer import ArchiveWriter

T0 = 1_714_557_600_000  # 2024-05-01T10:00Z
HIVE = pa.schema([("date", pa.date32()), ("hour", pa.int32()), ("task", pa.string())])


def build(store: ObjectStore, batches: int, rows: int, tasks: int = 3, start: int = 0
          ) -> tuple[int, list[Any]]:
    """``batches`` archiver batches of ``rows`` events each, all in one hour, ``tasks`` tasks:
    ``batches * tasks`` small objects. Returns the row count and the written objects."""
    table = synthetic_table(start + batches * rows, sandboxes=50, tasks=tasks,
                            events_per_episode=40, t0_ms=T0).slice(start)
    # every event in hour 10: event_time within the first 50 minutes
    writer = ArchiveWriter(store)
    objects = []
    for b in range(batches):
        part = table.slice(b * rows, rows)
        first = start + b * rows
        res = writer.write_batch(part, "bench.events", 0, first, first + rows - 1)
        writer.clear_marker(res)
        objects.append(res)
    return table.num_rows, objects


# -- readers ---------------------------------------------------------------------------------
def raw_readers(store: ObjectStore, endpoint: str | None) -> dict[str, Any]:
    """The README's raw-glob snippets before this change (count rows)."""
    import duckdb
    import polars as pl
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    hive_pl = {"date": pl.Date, "hour": pl.Int32, "task": pl.String}
    hive = ds.partitioning(HIVE, flavor="hive")
    if isinstance(store, LocalStore):
        root = str(store.root)

        def pyarrow_() -> int:
            return ds.dataset(f"{root}/events", format="parquet", partitioning=hive).count_rows()

        def polars_() -> int:
            return int(pl.scan_parquet(f"{root}/events/**/*.parquet", hive_partitioning=True,
                                       hive_schema=hive_pl).select(pl.len()).collect().item())

        def duckdb_() -> int:
            return int(duckdb.sql(
                f"SELECT count(*) FROM read_parquet('{root}/events/**/*.parquet', "
                "hive_partitioning=true, hive_types={'date': DATE, 'hour': INTEGER})"
            ).fetchall()[0][0])
    else:
        assert isinstance(store, S3Store)
        url = store.url
        opts = {"aws_endpoint_url": endpoint, "aws_allow_http": "true"} if endpoint else None
        s3 = pafs.S3FileSystem(endpoint_override=endpoint) if endpoint else pafs.S3FileSystem()

        def pyarrow_() -> int:
            return ds.dataset(f"{url.removeprefix('s3://')}/events", format="parquet",
                              filesystem=s3, partitioning=hive).count_rows()

        def polars_() -> int:
            return int(pl.scan_parquet(f"{url}/events/**/*.parquet", hive_partitioning=True,
                                       hive_schema=hive_pl, storage_options=opts)
                       .select(pl.len()).collect().item())

        def duckdb_() -> int:
            ds.dataset(f"{url.removeprefix('s3://')}/events", format="parquet",
                                filesystem=s3, partitioning=hive)
            return int(duckdb.sql("SELECT count(*) FROM events").fetchall()[0][0])
    return {"pyarrow": pyarrow_, "polars": polars_, "duckdb": duckdb_}


def snapshot_readers(store: ObjectStore, endpoint: str | None) -> dict[str, Any]:
    """The README's snippets through ``trajbus.archive.snapshot`` (count rows)."""
    import duckdb
    import polars as pl

    from trajbus.archive.snapshot import snapshot

    hive_pl = {"date": pl.Date, "hour": pl.Int32, "task": pl.String}
    url = store.url

    def pyarrow_() -> int:
        return snapshot(url, s3_endpoint_url=endpoint).dataset().count_rows()

    def polars_() -> int:
        snap = snapshot(url, s3_endpoint_url=endpoint)
        return int(pl.scan_parquet(snap.files, hive_partitioning=True, hive_schema=hive_pl,
                                   storage_options=snap.storage_options)
                   .select(pl.len()).collect().item())

    def duckdb_() -> int:
        snapshot(url, s3_endpoint_url=endpoint).dataset()
        return int(duckdb.sql("SELECT count(*) FROM events").fetchall()[0][0])
    return {"pyarrow": pyarrow_, "polars": polars_, "duckdb": duckdb_}


def during_compaction(store: ObjectStore, endpoint: str | None, way: str, batches: int,
                      rows: int, grace_ms: int, rounds: int = 3) -> dict[str, Any]:
    """``rounds`` times: the archiver writes ``batches`` more small objects into the hour,
    then compaction merges the hour (again) while the readers loop."""
    readers = (raw_readers if way == "raw" else snapshot_readers)(store, endpoint)
    stats: dict[str, Any] = {name: {"reads": 0, "wrong": 0, "errors": 0, "read_s": []}
                             for name in readers}
    t_compact: list[float] = []
    n = 0
    for r in range(rounds):
        n += build(store, batches, rows, start=r * batches * rows)[0]
        done = threading.Event()

        def compactor(done: threading.Event = done) -> None:
            t = time.perf_counter()
            compact(store, min_age_ms=0, grace_ms=grace_ms, target_bytes=64 * 1024 * 1024)
            t_compact.append(time.perf_counter() - t)
            done.set()

        th = threading.Thread(target=compactor)
        th.start()
        while not done.is_set():
            for name, read in readers.items():
                s = stats[name]
                t = time.perf_counter()
                try:
                    got = read()
                    s["wrong"] += got != n
                except Exception as exc:
                    s["errors"] += 1
                    s.setdefault("error", f"{type(exc).__name__}: {str(exc)[:150]}")
                s["reads"] += 1
                s["read_s"].append(time.perf_counter() - t)
        th.join()
    for s in stats.values():
        s["read_ms_p50"] = round(statistics.median(s.pop("read_s")) * 1000, 1)
    return {"way": way, "rows": n, "objects": rounds * batches * 3, "grace_ms": grace_ms,
            "compactions": rounds, "compact_s_max": round(max(t_compact), 2),
            "readers": stats}


# -- an open table format ----------------------------------------------------------------------
def _delta_schema() -> pa.Schema:
    from trajbus.archive.rows import ARCHIVE_SCHEMA

    return ARCHIVE_SCHEMA.append(pa.field("date", pa.date32())).append(
        pa.field("hour", pa.int32()))


def delta_commits(store: ObjectStore, objects: list[Any], storage_options: dict[str, str] |
                  None, table_uri: str) -> dict[str, Any]:
    """One Delta commit per archiver batch (add actions naming the batch's objects, with the
    batch's offset as an idempotent app transaction). Returns commit times."""
    from deltalake import DeltaTable
    from deltalake.transaction import (
        AddAction,
        CommitProperties,
        Transaction,
        create_table_with_add_actions,
    )

    def adds(res: Any) -> list[AddAction]:
        out = []
        for o in res.objects:
            rel = o.key.removeprefix("events/")
            out.append(AddAction(rel, o.bytes, {"date": o.date, "hour": str(int(o.hour))},
                                 int(time.time() * 1000), True,
                                 json.dumps({"numRecords": o.rows})))
        return out

    schema = _delta_schema()
    t = time.perf_counter()
    from deltalake import Schema as DeltaSchema

    create_table_with_add_actions(table_uri, DeltaSchema.from_arrow(schema), adds(objects[0]),
                                  mode="error", partition_by=["date", "hour"],
                                  storage_options=storage_options)
    times = [time.perf_counter() - t]
    dt = DeltaTable(table_uri, storage_options=storage_options)
    for i, res in enumerate(objects[1:], 1):
        t = time.perf_counter()
        dt.update_incremental()
        dt.create_write_transaction(adds(res), mode="append", schema=schema,
                                    partition_by=["date", "hour"],
                                    commit_properties=CommitProperties(app_transactions=[
                                        Transaction("bench.events-0", res.last_offset)]))
        times.append(time.perf_counter() - t)
        del i
    return {"commits": len(times), "commit_ms_p50": round(statistics.median(times) * 1000, 1),
            "commit_ms_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1000, 1)}


def resolve(store: ObjectStore, endpoint: str | None, batches: int, rows: int,
            storage_options: dict[str, str] | None, table_uri: str) -> dict[str, Any]:
    from deltalake import DeltaTable

    from trajbus.archive.snapshot import snapshot

    n, objects = build(store, batches, rows)
    out: dict[str, Any] = {"rows": n, "objects": len(objects) * 3}
    out["delta"] = delta_commits(store, objects, storage_options, table_uri)

    def timed(fn: Any, reps: int = 5) -> float:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return round(statistics.median(ts) * 1000, 1)

    out["resolve_ms"] = {
        "snapshot": timed(lambda: snapshot(store.url, s3_endpoint_url=endpoint).files),
        "delta": timed(lambda: DeltaTable(table_uri, storage_options=storage_options
                                          ).file_uris()),
    }
    out["count_ms"] = {
        "snapshot": timed(lambda: snapshot(store.url, s3_endpoint_url=endpoint)
                          .dataset().count_rows()),
        "delta": timed(lambda: DeltaTable(table_uri, storage_options=storage_options)
                       .to_pyarrow_dataset().count_rows()),
    }
    counts = (snapshot(store.url, s3_endpoint_url=endpoint).dataset().count_rows(),
              DeltaTable(table_uri, storage_options=storage_options)
              .to_pyarrow_dataset().count_rows())
    out["counts_equal"] = counts[0] == counts[1] == n
    return out


def delta_concurrent(table_uri: str, storage_options: dict[str, str], store: ObjectStore
                     ) -> dict[str, Any]:
    """Two committers appending to one Delta table on S3 at once (two archiver processes):
    does every commit land?"""
    from deltalake import DeltaTable

    _, objects = build(store, 41, 50)
    try:
        delta_commits(store, objects[:1], storage_options, table_uri)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    errors: list[str] = []

    def worker(part: list[Any]) -> None:
        from deltalake.transaction import AddAction

        dt = DeltaTable(table_uri, storage_options=storage_options)
        for res in part:
            acts = [AddAction(o.key.removeprefix("events/"), o.bytes,
                              {"date": o.date, "hour": str(int(o.hour))},
                              int(time.time() * 1000), True, json.dumps({"numRecords": o.rows}))
                    for o in res.objects]
            try:
                dt.update_incremental()
                dt.create_write_transaction(acts, mode="append", schema=_delta_schema(),
                                            partition_by=["date", "hour"])
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
    ths = [threading.Thread(target=worker, args=(objects[1 + i::2],)) for i in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    dt = DeltaTable(table_uri, storage_options=storage_options)
    return {"ok": not errors, "commits_expected": 41, "version": dt.version(),
            "files": len(dt.file_uris()), "files_expected": 41 * 3, "errors": errors[:3]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="during_compaction,resolve,delta_commit")
    ap.add_argument("--json")
    ap.add_argument("--ways", default="raw,snapshot")
    args = ap.parse_args()
    parts = args.parts.split(",")
    import importlib.util

    if importlib.util.find_spec("deltalake") is None and {"resolve", "delta_commit"} & set(parts):
        print("deltalake is not installed (not a trajbus dependency): skipping the resolve and "
              "delta_commit parts; `pip install deltalake` to run them", file=sys.stderr)
        parts = [p for p in parts if p not in ("resolve", "delta_commit")]
    from moto.server import ThreadedMotoServer

    from trajbus.infra.broker import free_port

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[var] = "testing"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores",
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    import boto3

    def s3_store() -> ObjectStore:
        bucket = f"b-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        return open_store(f"s3://{bucket}/archive", endpoint)

    s3_opts = {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true",
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION": "us-east-1"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if "during_compaction" in parts:
                for way in args.ways.split(","):
                    for where in ("local", "s3"):
                        store = (LocalStore(Path(tmp) / f"dc-{way}") if where == "local"
                                 else s3_store())
                        r = during_compaction(store, endpoint if where == "s3" else None, way,
                                              batches=60, rows=100,
                                              grace_ms=0 if way == "raw" else 3_600_000)
                        results[f"during_compaction.{way}.{where}"] = r
                        print(where, json.dumps(r), flush=True)
            if "resolve" in parts:
                for where in ("local", "s3"):
                    if where == "local":
                        store = LocalStore(Path(tmp) / "rs")
                        uri, opts = str(Path(tmp) / "rs" / "events"), None
                    else:
                        store = s3_store()
                        uri, opts = f"{store.url}/events", {
                            **s3_opts, "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}
                    r = resolve(store, endpoint if where == "s3" else None, 200, 50, opts, uri)
                    results[f"resolve.{where}"] = r
                    print(where, json.dumps(r), flush=True)
            if "delta_commit" in parts:
                for mode, extra in (("no lock", {}),
                                    ("conditional put", {"conditional_put": "etag"})):
                    store = s3_store()
                    r = delta_concurrent(f"{store.url}/events", {**s3_opts, **extra}, store)
                    results[f"delta_concurrent_s3.{mode}"] = r
                    print(mode, json.dumps(r), flush=True)
    finally:
        server.stop()
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))



if __name__ == "__main__":
    main()
