"""Archive maintenance: compaction (small objects -> large ones, atomic swap) and retention.

Compaction merges the small live objects of each (date, hour, task) directory into objects of
about ``target_bytes`` and swaps them in with one manifest switch (see ``manifest.py``). It
groups by (date, hour, task), not (date, task): an object must not span hours, or the
``hour=HH`` directory (which DuckDB/Spark/Polars read as a column with hive partitioning)
would lie about some of its rows. With the archiver's per-batch split, the small-object case
is "many tasks × many batches per hour", which this merges; per hour and task the result is a
handful of large objects. Every data area is compacted the same way (``events/`` and the
decision context: ``decisions/``, ``alerts/``, ``dead_letters/``), each object with its index
in its own index area.

Inputs are bundled greedily up to ``target_bytes`` of *compressed* input; one bundle is read
into memory, sorted and written as one object, so memory is bounded by one output object.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from trajbus.archive import layout
from trajbus.archive.manifest import Manifest, live_objects, read_manifest, switch_manifest
from trajbus.archive.rows import ARCHIVE_SCHEMA
from trajbus.archive.storage import ObjectInfo, ObjectStore
from trajbus.archive.writer import ArchiveWriter


@dataclass
class CompactionReport:
    generation: int
    groups: int = 0
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    rows: int = 0
    purged: list[str] = field(default_factory=list)  # superseded objects deleted after grace
    orphans: list[str] = field(default_factory=list)  # outputs of an unfinished compaction
    dry_run: bool = False


def _now_ms() -> int:
    return int(time.time() * 1000)


def compact(store: ObjectStore, *, target_bytes: int = 64 * 1024 * 1024,
            small_fraction: float = 0.5, min_age_ms: int = 2 * 3600 * 1000,
            grace_ms: int = 3600 * 1000, row_group_rows: int = 50_000,
            now_ms: int | None = None, dry_run: bool = False,
            task: str | None = None) -> CompactionReport:
    """Merge small objects (< ``small_fraction * target_bytes``) per (area, date, hour, task).

    Only hours that ended at least ``min_age_ms`` before ``now_ms`` are touched (recent hours
    still receive objects, including re-uploads of uncommitted batches). Objects superseded
    more than ``grace_ms`` ago are deleted first. One compactor at a time per archive.
    """
    now = _now_ms() if now_ms is None else now_ms
    manifest = read_manifest(store)
    gen = manifest.generation + 1
    report = CompactionReport(generation=gen, dry_run=dry_run)

    # 1. Outputs of a compaction that never switched the pointer are invisible: remove them.
    for area in (*layout.DATA_AREAS, *layout.INDEX_AREAS):
        for info in store.list(f"{area}/"):
            p = layout.parse_object_key(info.key)
            if p is not None and p.compacted_generation is not None \
                    and p.compacted_generation > manifest.generation:
                report.orphans.append(info.key)
                if not dry_run:
                    store.delete(info.key)

    # 2. Delete objects superseded long enough ago, then forget them.
    superseded = dict(manifest.superseded)
    for key, at in sorted(manifest.superseded.items()):
        if now - at >= grace_ms:
            p = layout.parse_object_key(key)
            report.purged.append(key)
            if not dry_run:
                store.delete(key)
                if p is not None:
                    store.delete(p.index_key)
            del superseded[key]

    # 3. Bundle small live objects per (date, hour, task), except objects of batches still
    # being written (a batch marker exists: its replay after a crash would overwrite the
    # object, and a compacted copy of it would be a second copy). Markers are listed *after*
    # the objects: a marker is written before its objects and deleted after the commit, so an
    # object listed above whose marker is gone below is committed.
    groups: dict[tuple[str, str, str, str], list[tuple[layout.ObjectPath, ObjectInfo]]] = \
        defaultdict(list)
    candidates = [c for area in layout.DATA_AREAS
                  for c in live_objects(store, manifest, area, task=task)]
    writing = {layout.parse_marker_key(m.key) for m in store.list(layout.BATCHES)}
    for p, info in candidates:
        if layout.batch_of(p.name) in writing:
            continue
        hour_end = datetime.strptime(f"{p.date} {p.hour}", "%Y-%m-%d %H").replace(
            tzinfo=UTC) + timedelta(hours=1)
        if now - int(hour_end.timestamp() * 1000) < min_age_ms:
            continue
        if info.size < small_fraction * target_bytes:
            groups[(p.area, p.date, p.hour, p.task)].append((p, info))
    writer = ArchiveWriter(store, row_group_rows=row_group_rows)
    n_out = 0
    for (area, date, hour, task_name), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        report.groups += 1
        bundles: list[list[tuple[layout.ObjectPath, ObjectInfo]]] = [[]]
        size = 0
        for m in sorted(members, key=lambda m: m[0].key):
            if bundles[-1] and size + m[1].size > target_bytes:
                bundles.append([])
                size = 0
            bundles[-1].append(m)
            size += m[1].size
        for bundle in bundles:
            if len(bundle) < 2:
                continue
            name = layout.compacted_object_name(gen, hour, n_out)
            n_out += 1
            key = layout.data_key(area, date, hour, task_name, name)
            report.inputs.extend(p.key for p, _ in bundle)
            report.outputs.append(key)
            if dry_run:
                continue
            tables = []
            for p, _ in bundle:
                # whole-object GETs (an input is read entirely anyway): they go through the
                # store's retries, so compaction rides out an S3 outage like the archiver
                data = pa.BufferReader(store.get_bytes(p.key))
                tables.append(pq.read_table(data, schema=ARCHIVE_SCHEMA))
            merged = pa.concat_tables(tables)
            report.rows += merged.num_rows
            writer.write_object(merged, key, layout.index_key(date, task_name, name, area), date,
                                hour,
                                {"trajbus.compacted_generation": str(gen)})
    if dry_run or (not report.outputs and not report.purged):
        return report
    for key in report.inputs:
        superseded[key] = now
    # 4. The switch: one PUT of the pointer.
    switch_manifest(store, Manifest(gen if report.outputs else manifest.generation,
                                    superseded, now))
    if grace_ms <= 0:
        # No grace: delete the replaced objects right after the switch (index files first),
        # so raw globs (which do not read the manifest) double count only between an
        # output's upload and here. They stay listed as superseded until the next run.
        for key in report.inputs:
            p = layout.parse_object_key(key)
            if p is not None:
                store.delete(p.index_key)
            store.delete(key)
    if not report.outputs:
        report.generation = manifest.generation
    return report


def retention(store: ObjectStore, days: int, *, now_ms: int | None = None,
              dry_run: bool = False) -> list[str]:
    """Delete data and index objects whose date partition is more than ``days`` days before
    today (UTC, from ``now_ms``). Returns the keys deleted (or, with ``dry_run``, that would
    be)."""
    if days < 0:
        raise ValueError("days must be >= 0")
    now = _now_ms() if now_ms is None else now_ms
    cutoff = (datetime.fromtimestamp(now / 1000, tz=UTC) - timedelta(days=days)).strftime(
        "%Y-%m-%d")
    doomed: list[str] = []
    for area in (*layout.DATA_AREAS, *layout.INDEX_AREAS, "conflicts"):
        for info in store.list(f"{area}/"):
            p = layout.parse_object_key(info.key)
            if p is not None and p.date < cutoff:
                doomed.append(info.key)
    if not dry_run:
        # Index files first: an index row must never point at a deleted object.
        for key in sorted(doomed, key=lambda k: k.split("/", 1)[0] not in layout.INDEX_AREAS):
            store.delete(key)
    return doomed
