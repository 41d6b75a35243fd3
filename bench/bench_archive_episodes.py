"""What the archive's ``episodes`` table costs at scale.

``ArchiveReader.connect()`` (``trajbus archive sql`` with a query that names ``episodes``)
and ``ArchiveReader.episodes()`` build the table from the episode index: one index row per
(episode, object). This measures
:func:`trajbus.archive.episodes.build_episodes` (the arithmetic in DuckDB) beside
:func:`~trajbus.archive.episodes.build_episodes_reference` (the same rules in Python, one
episode at a time) on a synthetic index -- N episodes, each in ``--objects`` objects (an
episode spans batches: a live episode is written every flush), one seq run per object,
half of them ended.

    .venv/bin/python bench/bench_archive_episodes.py --episodes 10000 100000 1000000

Prints one line per size and builder: index rows, seconds, episodes/s and the peak RSS
growth of the process while building (``ru_maxrss``; the larger sizes run last).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from trajbus.archive.episodes import build_episodes, build_episodes_reference
from trajbus.archive.index import INDEX_SCHEMA

T0 = 1_780_000_000_000


def synthetic_index(episodes: int, objects: int, events: int = 40) -> pa.Table:
    """Index rows of ``episodes`` episodes of ``events`` events, each split over ``objects``
    objects; every other episode ended (TERMINAL)."""
    per = max(1, events // objects)
    cols: dict[str, list[object]] = {f.name: [] for f in INDEX_SCHEMA}
    for e in range(episodes):
        sandbox = f"sb-{e // 10:06d}"
        ended = e % 2 == 0
        for o in range(objects):
            first, last = o * per, (o + 1) * per - 1
            is_last = o == objects - 1
            row = {
                "task": f"task-{e % 5}", "sandbox": sandbox, "episode": f"{e % 10:05d}",
                "object_key": f"events/date=2026-12-06/hour=10/task=task-{e % 5}/{o}.parquet",
                "date": None, "hour": 10, "first_seq": first, "last_seq": last,
                "end_seq": last if (ended and is_last) else None,
                "seq_runs": [{"first": first, "last": last}], "event_count": per,
                "distinct_seqs": per, "bytes": per * 300,
                "start_time_ms": T0 + e * 1000 + first, "end_time_ms": T0 + e * 1000 + last,
                "has_start": o == 0, "has_end": ended and is_last,
                "outcome": "TERMINAL" if (ended and is_last) else None,
                "completeness": None, "row_group_first": 0, "row_group_last": 0,
                "kafka_topic": "trajbus.sandbox.events", "kafka_partition": e % 6,
                "first_offset": e * 100, "last_offset": e * 100 + per,
            }
            for k, v in row.items():
                cols[k].append(v)
    return pa.table({f.name: pa.array(cols[f.name], f.type) for f in INDEX_SCHEMA},
                    schema=INDEX_SCHEMA)


def measure(episodes: int, objects: int, name: str,
            build: Callable[[pa.Table], pa.Table]) -> dict[str, object]:
    index = synthetic_index(episodes, objects)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    table = build(index)
    seconds = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert table.num_rows == episodes, (table.num_rows, episodes)
    return {"builder": name, "episodes": episodes, "index_rows": index.num_rows,
            "seconds": round(seconds, 2), "episodes_per_s": round(episodes / seconds),
            "peak_rss_growth_mib": round((rss_after - rss_before) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--objects", type=int, default=4,
                        help="objects each episode spans (index rows per episode)")
    parser.add_argument("--reference-up-to", type=int, default=100_000,
                        help="run the Python reference only up to this many episodes")
    parser.add_argument("--json", type=Path, help="write the results here (bench/run_all.py)")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "python": platform.python_version(), "objects": args.objects}))
    rows = []
    for n in sorted(args.episodes):
        rows.append(measure(n, args.objects, "duckdb", build_episodes))
        print(json.dumps(rows[-1]), flush=True)
        if n <= args.reference_up_to:
            rows.append(measure(n, args.objects, "python", build_episodes_reference))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"objects_per_episode": args.objects, "runs": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
