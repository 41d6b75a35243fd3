"""A consistent snapshot of the archive for ordinary readers (pyarrow, Polars, DuckDB, Spark).

A raw glob over ``events/**/*.parquet`` cannot be exact while ``trajbus archive compact``
replaces an hour's objects: no object store renames or deletes many keys at once, so a
listing taken during the swap holds both the merged object and its inputs, or an object that
is deleted before it is read. :func:`snapshot` resolves what to read the way
``ArchiveReader`` does -- the compaction manifest once (``manifest.read_manifest``), then the
live objects of that generation -- and hands the list to the reader. Guarantees:

* **Exact.** The objects of a snapshot hold each archived event once: the old set or the new
  set of every compaction, never both, never neither; objects of a compaction not yet
  switched are left out. A batch the archiver is still writing may be partly in it (its rows
  once each; the rest is in the next snapshot).
* **Readable for the grace period.** Compaction deletes a replaced object only
  ``--grace-seconds`` (default 3600) after the switch that replaced it, so every object of a
  snapshot stays readable for at least that long after the snapshot was taken. Take a new
  snapshot per query (resolving costs one list of the area plus two small GETs; the store
  behind it, with its connection pool, is opened once per URL and process).
* **Append-only growth.** Objects the archiver writes after the snapshot are not in it; a
  later snapshot has every row of an earlier one (or of the objects that replaced them).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from trajbus.archive import layout
from trajbus.archive.index import INDEX_SCHEMA
from trajbus.archive.manifest import live_objects, read_manifest
from trajbus.archive.rows import ARCHIVE_SCHEMA
from trajbus.archive.storage import LocalStore, ObjectStore, open_store, require_archive

HIVE_SCHEMA = pa.schema([("date", pa.date32()), ("hour", pa.int32()), ("task", pa.string())])
"""The hive partition columns of a data area's paths, with the types every reader uses."""


@dataclass(frozen=True)
class Snapshot:
    """The live objects of one data area (or index area) under one manifest generation.

    ``files``: one path per object, as pyarrow, Polars, DuckDB and Spark take it (an absolute
    local path, or ``s3://bucket/key``); ``base``: the area's directory in the same form
    (Spark's ``basePath``, pyarrow's ``partition_base_dir``); ``storage_options``: what Polars
    needs for a non-AWS S3 endpoint (None otherwise)."""

    url: str
    area: str
    generation: int
    taken_ms: int
    files: list[str]
    base: str
    storage_options: dict[str, str] | None = None
    keys: list[str] = field(default_factory=list, repr=False)
    sizes: list[int] = field(default_factory=list, repr=False)
    store: ObjectStore | None = field(default=None, repr=False, compare=False)

    def dataset(self) -> ds.Dataset:
        """A pyarrow dataset of exactly these objects, with ``date`` (DATE), ``hour`` (INTEGER)
        and ``task`` from the path (data areas; an index area has them as columns). DuckDB
        queries it by its Python name (``duckdb.sql("SELECT ... FROM events")``). Built from
        the snapshot's listing (sizes included): no request per object before the scan."""
        index = self.area in layout.INDEX_AREAS
        schema = INDEX_SCHEMA if index else data_schema()
        if not self.files:
            return ds.dataset(schema.empty_table())
        assert self.store is not None
        fs, base = self.store.arrow_filesystem()
        fmt = ds.ParquetFileFormat()
        fragments = []
        for key, size in zip(self.keys, self.sizes, strict=True):
            p = layout.parse_object_key(key)
            part = ds.scalar(True)
            if p is not None and not index:
                part = ((ds.field("date") == pa.scalar(_date(p.date), pa.date32()))
                        & (ds.field("hour") == pa.scalar(int(p.hour), pa.int32()))
                        & (ds.field("task") == p.task))
            fragments.append(fmt.make_fragment(f"{base}/{key}" if base else key, fs, part,
                                               file_size=size))
        return ds.FileSystemDataset(fragments, schema, fmt, fs)


def _date(text: str) -> datetime.date:
    return datetime.date.fromisoformat(text)


def data_schema() -> pa.Schema:
    """The archive's columns plus the hive partition columns (``date``, ``hour``)."""
    schema = ARCHIVE_SCHEMA
    for f in HIVE_SCHEMA:
        if f.name not in schema.names:
            schema = schema.append(f)
    return schema


def snapshot(url: str | None = None, area: str = "events", *,
             s3_endpoint_url: str | None = None) -> Snapshot:
    """The live objects of ``area`` (``events``; ``decisions``, ``alerts``, ``dead_letters``,
    ``conflicts``; an index area such as ``index``) of the archive at ``url`` (default
    ``TRAJBUS_ARCHIVE__URL``), resolved once. ``s3_endpoint_url`` defaults to
    ``TRAJBUS_ARCHIVE__S3_ENDPOINT_URL`` (MinIO and other non-AWS endpoints); credentials come
    from the usual ``AWS_*`` variables. A location that holds no archive raises
    ``NoArchiveError``."""
    url = url or os.environ.get("TRAJBUS_ARCHIVE__URL")
    if not url:
        raise ValueError("no archive URL: pass one or set TRAJBUS_ARCHIVE__URL")
    if s3_endpoint_url is None:
        s3_endpoint_url = os.environ.get("TRAJBUS_ARCHIVE__S3_ENDPOINT_URL") or None
    return snapshot_of(_store(url, s3_endpoint_url), area)


_STORES: dict[tuple[str, str | None], ObjectStore] = {}
_STORES_LOCK = threading.Lock()


def _store(url: str, endpoint: str | None) -> ObjectStore:
    """One store per (url, endpoint) per process, checked once: an S3 store owns a
    connection pool (boto3 client, pyarrow filesystem), so a loop of snapshots shares one.
    A local path is keyed by its absolute form (a relative one names another archive after
    a change of directory)."""
    if "://" not in url:
        url = os.path.abspath(url)
    with _STORES_LOCK:
        store = _STORES.get((url, endpoint))
        if store is None:
            store = require_archive(open_store(url, endpoint, create=False))
            _STORES[(url, endpoint)] = store
        return store


def snapshot_of(store: ObjectStore, area: str = "events") -> Snapshot:
    """:func:`snapshot` of an open store."""
    taken = int(time.time() * 1000)
    manifest = read_manifest(store)
    live = [info for _, info in live_objects(store, manifest, area)]
    keys = [info.key for info in live]
    if isinstance(store, LocalStore):
        files = [store.duckdb_path(k) for k in keys]
        base = str(store.root / area)
        options = None
    else:
        files = [store.duckdb_path(k) for k in keys]
        base = store.duckdb_path(area)
        endpoint = getattr(store, "endpoint_url", None)
        options = ({"aws_endpoint_url": endpoint,
                    "aws_allow_http": str(endpoint.startswith("http:")).lower()}
                   if endpoint else None)
    return Snapshot(store.url, area, manifest.generation, taken, files, base, options, keys,
                    [info.size for info in live], store)


def describe(snap: Snapshot) -> dict[str, Any]:
    """A JSON-ready summary (``trajbus archive files --json``)."""
    return {"url": snap.url, "area": snap.area, "generation": snap.generation,
            "taken_ms": snap.taken_ms, "base": snap.base, "files": snap.files}
