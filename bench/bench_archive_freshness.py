"""Archive freshness benchmark: objects per hour and query time under the flush rule.

    python bench/bench_archive_freshness.py --json out.json [--rate N] [--minutes M]

A steady fleet (``--rate`` events/s of log time, ``--sandboxes`` sandboxes over ``--tasks``
tasks, ``--partitions`` partitions, Avro-encoded like the emitters' records, each record with
its Kafka log timestamp) goes through the real archiver shell (decode, dedupe, spool, batcher,
writer) into a local archive, once per flush rule:

* ``fresh``: the default rule (a batch is written when its first row is
  ``archive.flush_after_ms`` = 30 s old in the log's time);
* ``before``: the rule before issue 38 (64 MiB or 6 h of event time; within the simulated
  hour, every batch is written only at the end).

Reported per rule: objects per hour of log time (Parquet data objects under ``events/``, and
all objects: data + index + batch markers left), median object size, and query times over
the archive (DuckDB ``archive sql``-style aggregate over every event, one episode through the
index), before and after ``archive compact`` (which merges each (date, hour, task)). Time is
simulated (log timestamps), so one hour runs in seconds; the writes and queries are real.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from trajbus.archive.archiver import ArchiveShell
from trajbus.archive.maintenance import compact
from trajbus.archive.query import ArchiveReader
from trajbus.archive.storage import LocalStore
from trajbus.archive.synth import episode_events
from trajbus.bus.settings import ArchiveSettings

TOPIC = "trajbus.sandbox.events"
T0 = 1_714_557_600_000  # 10:00 UTC: the simulated hour stays inside one hour partition


def fleet_records(rate: float, seconds: int, sandboxes: int, tasks: int,
                  partitions: int) -> list[Any]:
    """Records of a steady fleet: sandbox s (task s % tasks, partition s % partitions) runs
    episodes back to back; the fleet emits ``rate`` events per second of log time."""
    n = int(rate * seconds)
    streams: list[list[bytes]] = [[] for _ in range(sandboxes)]
    eps = [0] * sandboxes
    out: list[Any] = []
    offsets = [0] * partitions
    for i in range(n):
        s = i % sandboxes
        if not streams[s]:
            streams[s] = [e.encode() for e in episode_events(
                f"task-{s % tasks}", f"sb-{s}", f"ep-{eps[s]}", tool_calls=20,
                t0_ms=T0 + i * 1000 // int(rate))]
            eps[s] += 1
        p = s % partitions
        out.append(SimpleNamespace(topic=TOPIC, partition=p, offset=offsets[p],
                                   key=f"sb-{s}".encode(), value=streams[s].pop(0),
                                   timestamp=T0 + int(i * 1000 / rate)))
        offsets[p] += 1
    return out


def run_rule(root: Path, name: str, records: list[Any], seconds: int,
             cfg: ArchiveSettings) -> dict[str, Any]:
    store = LocalStore(root / name)
    shell = ArchiveShell(store, cfg, spool_dir=str(root / f"spool-{name}"),
                         clock=lambda: 0.0)  # no timer: a steady fleet's records decide
    t = time.perf_counter()
    batches = []
    for k in range(0, len(records), 500):  # polls of 500 records
        step = shell.process(records[k:k + 500])
        shell.committed(step.batches)
        batches += step.batches
    step = shell.flush_all()
    shell.committed(step.batches)
    batches += step.batches
    archive_s = time.perf_counter() - t
    shell.close()
    per_hour = 3600 / seconds
    data = store.list("events/")
    everything = store.list("")
    reader = ArchiveReader(store)
    out: dict[str, Any] = {
        "batches": len(batches),
        "objects_per_hour": round(len(data) * per_hour),
        "all_objects_per_hour": round(len(everything) * per_hour),
        "median_object_bytes": int(statistics.median(o.size for o in data)),
        "archive_s": round(archive_s, 2),
        "events_per_s": round(len(records) / archive_s),
    }
    out.update({f"{k}": v for k, v in queries(reader).items()})
    t = time.perf_counter()
    compact(store, target_bytes=cfg.target_object_bytes, min_age_ms=0, grace_ms=0,
            now_ms=T0 + 86_400_000)
    compact(store, target_bytes=cfg.target_object_bytes, min_age_ms=0, grace_ms=0,
            now_ms=T0 + 86_400_000 + 1)  # purge the replaced objects
    out["compact_s"] = round(time.perf_counter() - t, 2)
    out["objects_per_hour_after_compaction"] = round(len(store.list("events/")) * per_hour)
    out.update({f"{k}_after_compaction": v for k, v in queries(ArchiveReader(store)).items()})
    return out


def queries(reader: ArchiveReader, repeat: int = 3) -> dict[str, float]:
    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1000, 1)

    def sql() -> None:  # what `trajbus archive sql` does: resolve, connect, query
        reader.connect(episodes=False).execute(
            "SELECT task, kind, count(*) FROM events GROUP BY ALL").fetchall()

    def episode() -> None:
        t = reader.episode("task-3", "sb-3", "ep-1")
        assert t.num_rows > 0

    return {"sql_aggregate_ms": best(sql), "episode_lookup_ms": best(episode)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the figures here")
    ap.add_argument("--rate", type=float, default=50.0, help="fleet events/s (log time)")
    ap.add_argument("--minutes", type=int, default=60, help="simulated log time (default 60)")
    ap.add_argument("--sandboxes", type=int, default=100)
    ap.add_argument("--tasks", type=int, default=5)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--dir", help="work directory (default: a temp dir)")
    args = ap.parse_args(argv)
    seconds = args.minutes * 60
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-fresh-"))
    records = fleet_records(args.rate, seconds, args.sandboxes, args.tasks, args.partitions)
    fresh = ArchiveSettings(url="unused")
    before = ArchiveSettings(url="unused", flush_after_ms=10**12)  # no age rule: 64 MiB / 6 h
    out: dict[str, Any] = {
        "events": len(records), "rate": args.rate, "minutes": args.minutes,
        "sandboxes": args.sandboxes, "tasks": args.tasks, "partitions": args.partitions,
        "flush_after_ms": fresh.flush_after_ms,
        "fresh": run_rule(root, "fresh", records, seconds, fresh),
        "before": run_rule(root, "before", records, seconds, before),
        "python": sys.version.split()[0], "pyarrow": pa.__version__,
    }
    f, b = out["fresh"], out["before"]
    out["targets"] = [
        {"measure": "archive objects/hour, 30 s flush, after compaction (vs before the rule)",
         "result": f["objects_per_hour_after_compaction"],
         "target": f"<= {b['objects_per_hour']}",
         "met": f["objects_per_hour_after_compaction"] <= b["objects_per_hour"]},
    ]
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"archive freshness: {len(records):,} events in {args.minutes} min, "
          f"{args.partitions} partitions x {args.tasks} tasks: 30 s flush "
          f"{f['objects_per_hour']} data objects/h ({f['all_objects_per_hour']} with index), "
          f"sql {f['sql_aggregate_ms']} ms, episode {f['episode_lookup_ms']} ms; compacted "
          f"{f['objects_per_hour_after_compaction']}/h, sql "
          f"{f['sql_aggregate_ms_after_compaction']} ms; before the rule "
          f"{b['objects_per_hour']}/h, sql {b['sql_aggregate_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
