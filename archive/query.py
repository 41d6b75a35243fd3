"""Reading the archive: one episode through the index, SQL over everything with DuckDB.

Every read first resolves the compaction manifest once (``manifest.read_manifest``), so a
query sees one consistent set of objects even while compaction swaps objects underneath it.

* :meth:`ArchiveReader.episode` reads the index rows of the task, then only the row groups
  the index names (``ParquetFile.read_row_groups``), and returns the episode's events sorted
  by ``seq`` with duplicates (same seq) removed.
* :meth:`ArchiveReader.connect` returns a DuckDB connection with views: ``events`` (the
  archived rows plus ``date`` and ``hour`` from the directory layout), ``episodes`` (one row
  per episode, with its outcome) and the decision context (:data:`CONTEXT_VIEWS`). Local
  archives are read with DuckDB's own Parquet reader; S3 archives through pyarrow datasets on
  ``pyarrow.fs.S3FileSystem`` (no httpfs extension download needed).
* :meth:`ArchiveReader.context` returns one episode's (or sandbox's) decision context: its
  outcome, the decisions and alerts about it, its dead letters, the runtime's acks and the
  sandbox's lifecycle.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from trajbus.archive import layout
from trajbus.archive.context import STREAM_KINDS, ContextFacts, context_facts
from trajbus.archive.episodes import build_episodes
from trajbus.archive.index import INDEX_SCHEMA
from trajbus.archive.manifest import Manifest, live_objects, read_manifest
from trajbus.archive.rows import ARCHIVE_SCHEMA, conform
from trajbus.archive.storage import LocalStore, ObjectStore, require_archive
from trajbus.bus.topics import validate_name


def _dedupe_sorted(table: pa.Table, key: str = "seq") -> pa.Table:
    """Keep the first row of each run of equal ``key`` values (table sorted by key)."""
    if table.num_rows < 2:
        return table
    values = table.column(key).to_pylist()
    keep = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1]]
    return table if len(keep) == len(values) else table.take(pa.array(keep, pa.int64()))


class ArchiveReader:
    """Read access to an archive store (local directory or S3).

    A store that holds no archive (a misspelled path, a wrong S3 prefix) raises
    :class:`~trajbus.archive.storage.NoArchiveError` here, saying what was expected there,
    instead of answering zero rows; ``require=False`` reads it as empty."""

    def __init__(self, store: ObjectStore, require: bool = True) -> None:
        if require:
            require_archive(store)
        self.store = store

    def manifest(self) -> Manifest:
        return read_manifest(self.store)

    # -- index -----------------------------------------------------------------------------
    def index(self, task: str | None = None, date_from: str | None = None,
              date_to: str | None = None, manifest: Manifest | None = None) -> pa.Table:
        """The index rows of live objects (optionally one task and a date range)."""
        if task is not None:
            validate_name("task", task)
        m = manifest or self.manifest()
        files = live_objects(self.store, m, "index", task=task, dates=(date_from, date_to))
        if not files:
            return INDEX_SCHEMA.empty_table()
        fs, base = self.store.arrow_filesystem()
        paths = [f"{base}/{info.key}" for _, info in files]
        return ds.dataset(paths, schema=INDEX_SCHEMA, format="parquet",
                          filesystem=fs).to_table()

    def episode_index(self, task: str, sandbox: str, episode: str | None,
                      manifest: Manifest | None = None) -> pa.Table:
        validate_name("sandbox", sandbox)
        idx = self.index(task, manifest=manifest)
        mask = pc.equal(idx.column("sandbox"), sandbox)
        ep = idx.column("episode")
        mask = pc.and_(mask, pc.is_null(ep) if episode is None else pc.equal(ep, episode))
        return idx.filter(mask).sort_by([("first_seq", "ascending"),
                                         ("object_key", "ascending")])

    # -- one episode -----------------------------------------------------------------------
    def episode(self, task: str, sandbox: str, episode: str | None,
                columns: list[str] | None = None) -> pa.Table:
        """The episode's archived events in seq order (no duplicates), via the index and only
        the row groups it names. ``episode=None`` reads the sandbox's lifecycle stream.

        If an object vanished under the read (a compaction purge with a grace period shorter
        than this read), the manifest is resolved again and the read retried."""
        for attempt in range(3):
            try:
                return self._episode_once(task, sandbox, episode, columns)
            except FileNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _episode_once(self, task: str, sandbox: str, episode: str | None,
                      columns: list[str] | None) -> pa.Table:
        m = self.manifest()
        idx = self.episode_index(task, sandbox, episode, manifest=m)
        by_object: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for r in idx.select(["object_key", "row_group_first", "row_group_last"]).to_pylist():
            by_object[r["object_key"]].append((r["row_group_first"], r["row_group_last"]))
        cols = columns_with_keys(columns)

        def read(item: tuple[str, list[tuple[int, int]]]) -> pa.Table:
            key, ranges = item
            groups = sorted({g for lo, hi in ranges for g in range(lo, hi + 1)})
            with self.store.open_input(key) as f:
                pf = pq.ParquetFile(f)
                have = set(pf.schema_arrow.names)  # an older format: fewer columns
                t = pf.read_row_groups(groups, columns=None if cols is None else
                                       [c for c in cols if c in have])
                return conform(t, cols)

        items = sorted(by_object.items())
        if len(items) > 1:  # an episode spanning objects: read them concurrently
            with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
                parts = list(pool.map(read, items))
        else:
            parts = [read(i) for i in items]
        return _select_episode(parts, sandbox, episode, columns)

    def fetch_blob(self, row: dict[str, Any]) -> bytes:
        """The claim-check blob of a TraceChunk row read from this archive, verified
        (:func:`fetch_row_blob`; a reference relative to the archive root resolves against
        this store)."""
        endpoint = getattr(self.store, "endpoint_url", None)
        return fetch_row_blob(row, endpoint, self.store)

    def scan_episode(self, task: str, sandbox: str, episode: str | None) -> pa.Table:
        """The same result as :meth:`episode` by scanning every live object of the task (for
        verification and benchmarks)."""
        m = self.manifest()
        parts = []
        for _, info in live_objects(self.store, m, "events", task=task):
            with self.store.open_input(info.key) as f:
                parts.append(pq.read_table(f, schema=ARCHIVE_SCHEMA))
        return _select_episode(parts, sandbox, episode, None)

    # -- SQL -------------------------------------------------------------------------------
    def connect(self, database: str = ":memory:", episodes: bool = True) -> Any:
        """A DuckDB connection with views over the live objects of one manifest generation:
        ``events`` (one row per event), ``conflicts`` (conflicting copies, kept apart),
        ``episode_objects`` (the per-object episode index) and, unless ``episodes=False``,
        ``episodes`` (one row per episode, computed from the index when connecting)."""
        import duckdb

        m = self.manifest()
        con = duckdb.connect(database)
        areas = {name: [info.key for _, info in live_objects(self.store, m, area)]
                 for name, area in (("events", "events"), ("conflicts", "conflicts"),
                                    ("episode_objects", "index"),
                                    *((f"_{a}_rows", a) for a in layout.CONTEXT_AREAS))}
        for name, keys in areas.items():
            hive = name != "episode_objects"
            schema = ARCHIVE_SCHEMA if hive else INDEX_SCHEMA
            if isinstance(self.store, LocalStore):
                _local_view(con, name, [self.store.duckdb_path(k) for k in keys], schema,
                            hive=hive)
                continue
            fs, base = self.store.arrow_filesystem()
            if not keys:
                dataset = ds.dataset(_with_partitions(schema, hive).empty_table())
            elif hive:
                area = keys[0].split("/", 1)[0]
                dataset = ds.dataset([f"{base}/{k}" for k in keys], format="parquet",
                                     filesystem=fs, partitioning=ds.partitioning(
                                         PARTITION_SCHEMA, flavor="hive"),
                                     partition_base_dir=f"{base}/{area}",
                                     schema=_with_partitions(schema, hive))
            else:
                dataset = ds.dataset([f"{base}/{k}" for k in keys], format="parquet",
                                     filesystem=fs, schema=schema)
            con.register(f"_{name}_ds", dataset)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_ds")
        for sql in CONTEXT_VIEWS.values():
            con.execute(sql)
        if episodes:
            con.register("_episodes_table", self.episodes(manifest=m))
            con.execute("CREATE VIEW episodes AS SELECT * FROM _episodes_table")
        return con

    def episodes(self, task: str | None = None, manifest: Manifest | None = None) -> pa.Table:
        """The episode table (one row per task, sandbox, episode; see ``episodes.py``),
        built from the index of the live objects, with each episode's outcome from the
        decision context and the sandboxes' lifecycle streams (``context.py``)."""
        m = manifest or self.manifest()
        return build_episodes(self.index(task, manifest=m), self.context_facts(task, m))

    # -- the decision context --------------------------------------------------------------
    def area(self, area: str, task: str | None = None, manifest: Manifest | None = None,
             columns: list[str] | None = None, filter: Any = None) -> pa.Table:
        """The rows of one data area (``events``, ``decisions``, ``alerts``,
        ``dead_letters``) of the live objects, optionally one task; ``filter`` is a
        ``pyarrow.dataset`` expression."""
        if task is not None:
            validate_name("task", task)
        m = manifest or self.manifest()
        files = live_objects(self.store, m, area, task=task)
        if not files:
            t = ARCHIVE_SCHEMA.empty_table()
            return t.select(columns) if columns else t
        fs, base = self.store.arrow_filesystem()
        dataset = ds.dataset([f"{base}/{info.key}" for _, info in files], format="parquet",
                             filesystem=fs, schema=ARCHIVE_SCHEMA)
        return dataset.to_table(columns=columns, filter=filter)

    def lifecycle_rows(self, task: str | None = None, sandbox: str | None = None,
                       manifest: Manifest | None = None,
                       payload_kinds: tuple[str, ...] = STREAM_KINDS) -> pa.Table:
        """The sandboxes' lifecycle rows (kinds ``SandboxLifecycle``, ``Drained``,
        ``DecisionAck``: their streams, ``episode`` null), through the index: only the row
        groups holding lifecycle streams are read, and their (large) ``payload_json`` column
        only where a row of ``payload_kinds`` is (null for the other rows)."""
        m = manifest or self.manifest()
        idx = self.index(task, manifest=m)
        mask = pc.is_null(idx.column("episode"))
        if sandbox is not None:
            mask = pc.and_(mask, pc.equal(idx.column("sandbox"), sandbox))
        idx = idx.filter(mask)
        by_object: dict[str, set[int]] = defaultdict(set)
        for r in idx.select(["object_key", "row_group_first", "row_group_last"]).to_pylist():
            by_object[r["object_key"]].update(range(r["row_group_first"],
                                                    r["row_group_last"] + 1))
        cheap = [c for c in STREAM_COLUMNS if c != "payload_json"]
        kinds, wanted = pa.array(STREAM_KINDS), pa.array(payload_kinds, pa.string())
        parts = []
        for key, groups in sorted(by_object.items()):
            with self.store.open_input(key) as f:
                pf = pq.ParquetFile(f)
                have = set(pf.schema_arrow.names)  # an older archive schema: fewer columns
                for g in sorted(groups):
                    t = pf.read_row_group(g, columns=[c for c in cheap if c in have])
                    for c in cheap:
                        if c not in have:
                            t = t.append_column(ARCHIVE_SCHEMA.field(c),
                                                pa.nulls(t.num_rows, ARCHIVE_SCHEMA.field(c).type))
                    mask = pc.and_(pc.is_null(t.column("episode")),
                                   pc.is_in(t.column("kind"), kinds))
                    if sandbox is not None:
                        mask = pc.and_(mask, pc.equal(t.column("sandbox"), sandbox))
                    if not pc.any(mask).as_py():
                        continue
                    need = pc.and_(mask, pc.is_in(t.column("kind"), wanted))
                    if pc.any(need).as_py():
                        payload = pf.read_row_group(g, columns=["payload_json"]).column(0)
                        payload = pc.if_else(need, payload, pa.scalar(None, pa.string()))
                    else:
                        payload = pa.nulls(t.num_rows, pa.string())
                    parts.append(t.append_column("payload_json", payload).filter(mask))
        if not parts:
            return ARCHIVE_SCHEMA.empty_table().select(STREAM_COLUMNS)
        # objects of an older format declare other nullability: conform before concatenating
        return pa.concat_tables([conform(p, STREAM_COLUMNS) for p in parts]).sort_by(
            [("task", "ascending"), ("sandbox", "ascending"), ("seq", "ascending")])

    def context_facts(self, task: str | None = None,
                      manifest: Manifest | None = None) -> ContextFacts:
        """What the episode outcomes are decided from (``context.context_facts``)."""
        m = manifest or self.manifest()
        stream = self.lifecycle_rows(task, manifest=m, payload_kinds=("DecisionAck",)
                                     ).to_pylist()
        decisions = self.area("decisions", task, m, columns=STREAM_COLUMNS).to_pylist()
        alerts = self.area("alerts", task, m, columns=STREAM_COLUMNS).to_pylist()
        return context_facts(stream, decisions, alerts)

    def context(self, task: str, sandbox: str, episode: str | None = None
                ) -> DecisionContext:
        """The decision context of one episode (or, with ``episode=None``, of the sandbox):
        its outcome row of ``episodes``, the decisions and alerts about it (the sandbox's own
        and the episode's; not those naming another episode), its dead letters, the runtime's
        acknowledgements and the sandbox's lifecycle, each in time order."""
        validate_name("task", task)
        m = self.manifest()
        eps = self.episodes(task, manifest=m)
        outcome = None
        if episode is not None:
            rows = eps.filter(pc.and_(pc.equal(eps.column("sandbox"), sandbox),
                                      pc.equal(eps.column("episode"), episode))).to_pylist()
            outcome = rows[0] if rows else None
        about = ds.field("sandbox") == sandbox
        if episode is not None:
            about = about & (ds.field("episode").is_null() | (ds.field("episode") == episode))

        def ordered(t: pa.Table) -> pa.Table:
            return t.sort_by([("event_time_ms", "ascending"), ("event_id", "ascending")])

        stream = self.lifecycle_rows(task, sandbox, manifest=m)
        kinds = stream.column("kind")
        return DecisionContext(
            task=task, sandbox=sandbox, episode=episode, outcome=outcome,
            decisions=with_decided_by(ordered(self.area("decisions", task, m, filter=about))),
            alerts=ordered(self.area("alerts", task, m, filter=about)),
            dead_letters=ordered(self.area("dead_letters", task, m, filter=about)),
            acks=stream.filter(pc.equal(kinds, "DecisionAck")),
            lifecycle=stream.filter(pc.not_equal(kinds, "DecisionAck")),
        )


STREAM_COLUMNS = ["task", "sandbox", "episode", "seq", "kind", "state", "previous_state",
                  "reason", "outcome", "event_id", "event_time_ms", "producer_id",
                  "payload_json"]
"""The columns the decision context is decided from."""


@dataclass
class DecisionContext:
    """One episode's (or sandbox's) decision context, from the archive alone.

    ``outcome``: the episode's row of the ``episodes`` table (``ending``, ``truncated_by``,
    ``terminate_decision_id``, ...), None for a sandbox or an episode not archived;
    ``decisions`` (with ``decided_by``), ``alerts``, ``dead_letters``: archive rows of those
    areas; ``acks``: the runtime's ``DecisionAck`` rows; ``lifecycle``: the sandbox's
    ``SandboxLifecycle`` and ``Drained`` rows."""

    task: str
    sandbox: str
    episode: str | None
    outcome: dict[str, Any] | None
    decisions: pa.Table
    alerts: pa.Table
    dead_letters: pa.Table
    acks: pa.Table
    lifecycle: pa.Table

    def summary(self) -> dict[str, Any]:
        """A JSON-ready digest: the outcome and one line per decision, alert, dead letter,
        ack and lifecycle change."""
        def brief(t: pa.Table, fields: list[str]) -> list[dict[str, Any]]:
            out = []
            for r in t.to_pylist():
                p = json.loads(r["payload_json"]) if r.get("payload_json") else {}
                item = {"event_id": r.get("event_id"), "event_time_ms": r.get("event_time_ms"),
                        "episode": r.get("episode")}
                for f in fields:
                    item[f] = r[f] if f in r else p.get(f)
                out.append(item)
            return out

        outcome = None
        if self.outcome is not None:
            outcome = {k: self.outcome.get(k) for k in (
                "ending", "truncated_by", "terminate_decision_id", "terminate_decided_by",
                "terminate_ack", "outcome", "completeness", "first_seq", "last_seq")}
        return {
            "task": self.task, "sandbox": self.sandbox, "episode": self.episode,
            "outcome": outcome,
            "decisions": brief(self.decisions, ["decision", "decided_by", "reason",
                                                "suspicious", "cause_event_ids"]),
            "alerts": brief(self.alerts, ["alert", "reason", "repeat_count", "dry_run"]),
            "dead_letters": brief(self.dead_letters, ["stage", "reason_code", "reason",
                                                      "source_topic", "source_offset"]),
            "acks": brief(self.acks, ["decision_event_id", "decision", "outcome", "detail"]),
            "lifecycle": brief(self.lifecycle, ["kind", "state", "reason"]),
        }


def with_decided_by(decisions: pa.Table) -> pa.Table:
    """``decisions`` with a ``decided_by`` column (``context.decided_by`` of the producer)."""
    from trajbus.archive.context import decided_by

    values = [decided_by(p) for p in decisions.column("producer_id").to_pylist()]
    return decisions.append_column("decided_by", pa.array(values, pa.string()))


_DECIDED_BY = "coalesce(nullif(regexp_replace(producer_id, '^trajbus[.]', ''), ''), 'unknown')"


def _sql_type(t: pa.DataType) -> str:
    if pa.types.is_list(t):
        return f"{_sql_type(t.value_type)}[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f"{f.name} {_sql_type(f.type)}" for f in t) + ")"
    return {"string": "VARCHAR", "bool": "BOOLEAN", "int64": "BIGINT", "int32": "INTEGER",
            "double": "DOUBLE"}[str(t)]


def _typed(name: str) -> str:
    """Promoted column ``name``, or (rows of objects written before it existed, format 2) the
    same field from ``payload_json``, as ``name``."""
    t = ARCHIVE_SCHEMA.field(name).type
    if pa.types.is_string(t):
        old = f"json_extract_string(payload_json, '$.{name}')"
    else:
        old = f"CAST(json_extract(payload_json, '$.{name}') AS {_sql_type(t)})"
    return f"coalesce({name}, {old}) AS {name}"


CONTEXT_VIEWS: dict[str, str] = {
    "decisions": "CREATE VIEW decisions AS SELECT event_id AS decision_id, "
    f"{_typed('decision')}, {_DECIDED_BY} AS decided_by, {_typed('suspicious')}, "
    f"{_typed('request_id')}, {_typed('cause_event_ids')}, "
    "CAST(json_extract(payload_json, '$.details') AS MAP(VARCHAR, VARCHAR)) AS details, "
    "* EXCLUDE (decision, suspicious, request_id, cause_event_ids) FROM _decisions_rows",
    "alerts": "CREATE VIEW alerts AS SELECT event_id AS alert_id, "
    f"{_typed('alert')}, {_typed('dry_run')}, {_typed('repeat_count')}, {_typed('span_ms')}, "
    "CAST(json_extract(payload_json, '$.first_seq') AS BIGINT) AS first_seq, "
    "CAST(json_extract(payload_json, '$.last_seq') AS BIGINT) AS last_seq, "
    f"{_typed('distinct_results')}, "
    "CAST(json_extract(payload_json, '$.pattern') AS VARCHAR[]) AS pattern, "
    "* EXCLUDE (alert, dry_run, repeat_count, span_ms, distinct_results) FROM _alerts_rows",
    "dead_letters": "CREATE VIEW dead_letters AS SELECT event_id AS dead_letter_id, "
    f"{_typed('stage')}, {_typed('reason_code')}, {_typed('source_topic')}, "
    f"{_typed('source_partition')}, {_typed('source_offset')}, "
    "* EXCLUDE (stage, reason_code, source_topic, source_partition, source_offset) "
    "FROM _dead_letters_rows",
    "decision_acks": "CREATE VIEW decision_acks AS SELECT a.task, a.sandbox, a.event_time, "
    "a.event_time_ms, a.event_id AS ack_id, a.decision_event_id AS decision_id, a.decision, "
    "a.outcome AS ack, json_extract_string(a.payload_json, '$.detail') AS detail, "
    "d.decided_by, d.event_time AS decided_at, a.date, a.hour "
    f"FROM (SELECT {_typed('decision_event_id')}, {_typed('decision')}, "
    "* EXCLUDE (decision_event_id, decision) FROM events WHERE kind = 'DecisionAck') a "
    "LEFT JOIN decisions d ON d.decision_id = a.decision_event_id",
    "lifecycle": "CREATE VIEW lifecycle AS SELECT task, sandbox, seq, event_time, "
    "event_time_ms, kind, state, previous_state, node, tenant, reason, "
    f"{_typed('final_seqs')}, {_typed('complete')}, {_typed('unflushed')}, "
    "producer_id, event_id, date, hour FROM events "
    "WHERE episode IS NULL AND kind IN ('SandboxLifecycle', 'Drained')",
}
"""The decision-context views of :meth:`ArchiveReader.connect`: ``decisions`` (with
``decided_by``: scheduler / watchdog), ``alerts``, ``dead_letters``, ``decision_acks`` (the
sandbox runtime's answers, joined to the decision they answer) and ``lifecycle`` (the
sandboxes' state changes and drain reports). Their fields are the archive's typed columns,
read from ``payload_json`` in objects written before those columns existed (format 2), and
a few more fields extracted from ``payload_json``."""

PARTITION_SCHEMA = pa.schema([("date", pa.date32()), ("hour", pa.int32())])
"""The hive partition columns' types, the same in every view and every documented reader."""


def _with_partitions(schema: pa.Schema, hive: bool) -> pa.Schema:
    if not hive:
        return schema
    for f in PARTITION_SCHEMA:
        schema = schema.append(f)
    return schema


def columns_with_keys(columns: list[str] | None) -> list[str] | None:
    if columns is None:
        return None
    return list(dict.fromkeys([*columns, "sandbox", "episode", "seq", "kafka_offset"]))


def _select_episode(parts: list[pa.Table], sandbox: str, episode: str | None,
                    columns: list[str] | None) -> pa.Table:
    if not parts:
        t = ARCHIVE_SCHEMA.empty_table()
        return t.select(columns) if columns else t
    t = pa.concat_tables(parts)
    mask = pc.equal(t.column("sandbox"), sandbox)
    ep = t.column("episode")
    mask = pc.and_(mask, pc.is_null(ep) if episode is None else pc.equal(ep, episode))
    t = t.filter(mask).sort_by([("seq", "ascending"), ("kafka_offset", "ascending")])
    t = _dedupe_sorted(t)
    return t.select(columns) if columns else t


def _local_view(con: Any, name: str, paths: list[str], schema: pa.Schema, hive: bool) -> None:
    if not paths:
        con.register(f"_{name}_empty", _with_partitions(schema, hive).empty_table())
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_empty")
        return
    listing = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
    options = ("hive_partitioning=true, hive_types={'date': DATE, 'hour': INTEGER}"
               if hive else "hive_partitioning=false")
    # union_by_name: files of an older archive schema (fewer columns) read with newer ones
    files = f"SELECT * FROM read_parquet([{listing}], {options}, union_by_name=true)"
    if not set(schema.names) <= set(pq.read_schema(paths[-1]).names):
        # With union_by_name, one object of the current format gives every column; the last
        # listed (usually the newest) is not one, and maybe none is: an empty table of the
        # current schema first, so every column exists, with its type and in its order.
        con.register(f"_{name}_empty", _with_partitions(schema, hive).empty_table())
        files = f"SELECT * FROM _{name}_empty UNION ALL BY NAME {files}"
    con.execute(f"CREATE VIEW {name} AS {files}")


def reassemble_trace(events: pa.Table | Iterable[dict[str, Any]],
                     fetch_blob: Callable[[dict[str, Any]], bytes] | None = None,
                     ) -> tuple[bytes, list[str]]:
    """Rebuild an episode's trace file from its TraceChunk events (seq order). Returns the
    bytes and the claim-check URIs of chunks not stored inline and not fetched: with
    ``fetch_blob`` (row -> verified bytes, e.g. :func:`fetch_row_blob`) those are fetched and
    placed too. A chunk with ``reset`` set restarts the file (the trace was truncated or
    replaced)."""
    rows = events.to_pylist() if isinstance(events, pa.Table) else list(events)
    buf = bytearray()
    missing: list[str] = []
    for r in sorted((r for r in rows if r.get("kind") == "TraceChunk"),
                    key=lambda r: r["seq"]):
        payload = json.loads(r["payload_json"]) if r.get("payload_json") else {}
        if payload.get("reset"):
            del buf[:]
        off = int(r.get("file_offset") or 0)
        data = r.get("data")
        if data is None:
            if not r.get("blob_uri"):
                continue
            if fetch_blob is None:
                missing.append(r["blob_uri"])
                continue
            data = fetch_blob(r)
        if len(buf) < off:
            buf.extend(b"\x00" * (off - len(buf)))
        buf[off:off + len(data)] = data
    return bytes(buf), missing


def fetch_row_blob(row: dict[str, Any], endpoint_url: str | None = None,
                   archive: ObjectStore | None = None) -> bytes:
    """The claim-check blob of an archived TraceChunk row, verified against the row's
    ``length`` and ``sha256`` (raises ``BlobIntegrityError`` on a mismatch). A ``blob_uri``
    relative to the archive root (``blobs/sha256/...``) is read from ``archive``, the store
    the row was read from; an absolute one (objects written before references were made
    relative, or a blob stored outside the archive) from the store it names."""
    from trajbus.archive.blobs import fetch_blob
    from trajbus.schemas.models import BlobRef

    ref = BlobRef(uri=row["blob_uri"], size=int(row["length"]), sha256=row["sha256"])
    return fetch_blob(ref, endpoint_url, archive)


def sandbox_events(settings: Any, sandbox: str, episode: str | None = None
                   ) -> list[dict[str, Any]]:
    """Every archived event of one sandbox (all tasks; one episode when given), as archive
    rows with ``kind``: the operators' `trajbus replay events --source archive`. Goes through
    the index, so only the row groups holding the sandbox are read."""
    from trajbus.archive.storage import open_store

    validate_name("sandbox", sandbox)
    reader = ArchiveReader(open_store(settings.archive.url, settings.archive.s3_endpoint_url,
                                      create=False))
    m = reader.manifest()
    idx = reader.index(manifest=m)
    idx = idx.filter(pc.equal(idx.column("sandbox"), sandbox))
    if episode is not None:
        idx = idx.filter(pc.equal(idx.column("episode"), episode))
    keys = sorted({(r["task"], r["episode"]) for r in
                   idx.select(["task", "episode"]).to_pylist()},
                  key=lambda k: (k[0], k[1] or ""))
    rows: list[dict[str, Any]] = []
    for task, ep in keys:
        rows.extend(reader.episode(task, sandbox, ep).to_pylist())
    return rows
