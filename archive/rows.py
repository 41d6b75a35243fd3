"""Flattening decoded events into one Arrow schema shared by every event kind.

One schema for all kinds and all schema versions means a schema change never splits files:

* header columns (``event_id, task, sandbox, episode, seq, event_time`` (UTC timestamp),
  ``event_time_ms, producer_id, policy_version, kind``);
* typed columns for the fields the data team filters on (tool calls, results, lifecycle,
  episode outcome, trace chunk position); ``args_canonical``/``result_canonical`` hold the
  producer's canonical JSON text as is (JSON encoded once, never re-encoded inside
  ``payload_json``);
* promoted columns (:data:`PROMOTED_FIELDS`, archive format 3): probe results, trace chunk
  content type, drain reports, decisions, alerts, dead letters as typed values; unlike the
  typed columns above, these fields *also* stay in ``payload_json``, so a query or reader
  written against ``payload_json`` reads objects of every format alike. ``dataset`` is
  derived: a SandboxRequest's ``dataset``, else the ``dataset`` entry of an EpisodeStart's
  ``context`` or a SchedulingDecision's ``details``;
* ``payload_json``: every other field of the record as canonical JSON (sorted keys; bytes as
  ``{"$b64": "..."}``), including fields added by a newer schema version;
* ``data``: a trace chunk's inline bytes (binary); ``blob_uri``: its claim-check reference,
  relative to the archive root (``blobs/sha256/ab/cd/<sha256>``) when the blob is stored in
  the archive the row is written to (``to_row(blob_root=...)``; the ``blob`` field in
  ``payload_json`` says the same), else the producer's absolute URI;
* ``event_digest``: blake2b-64 of the record bytes (int64), what re-sent copies are compared by;
* ``kafka_topic, kafka_partition, kafka_offset``: the source position (the exactly-once key).

:data:`ARCHIVE_SCHEMA` is fixed; :func:`to_row` never adds columns. Columns that every row has
(:data:`NON_NULL`) are declared non-null: a Parquet object with a null there cannot be
written. Objects of an older format lack the promoted columns: readers that conform them to
:data:`ARCHIVE_SCHEMA` (:func:`conform`, ``pyarrow.dataset`` with the schema, DuckDB
``union_by_name``) read those as null. :func:`row_to_record` reverses the flattening for one
row (typed columns + payload_json + data -> the record dict).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fastavro import schemaless_reader

from trajbus.schemas.codec import HEADER_LEN, Codec, CorruptBodyError, Decoded

HEADER_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("event_id", pa.string()),
    ("task", pa.string()),
    ("sandbox", pa.string()),
    ("episode", pa.string()),
    ("seq", pa.int64()),
    ("event_time_ms", pa.int64()),
    ("producer_id", pa.string()),
    ("policy_version", pa.int64()),
)
EVENT_TIME = pa.timestamp("ms", tz="UTC")

# Typed columns: a record field of this name (any kind) lands here instead of payload_json.
# Formats 2 and 3.
TYPED_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("tool", pa.string()),
    ("call_id", pa.string()),
    ("args_hash", pa.string()),
    ("args_canonical", pa.string()),
    ("args_summary", pa.string()),
    ("result_hash", pa.string()),
    ("result_canonical", pa.string()),
    ("result_summary", pa.string()),
    ("status", pa.string()),
    ("duration_ms", pa.int64()),
    ("state", pa.string()),
    ("previous_state", pa.string()),
    ("node", pa.string()),
    ("tenant", pa.string()),
    ("outcome", pa.string()),
    ("reward", pa.float64()),
    ("reason", pa.string()),
    ("file_offset", pa.int64()),
    ("length", pa.int64()),
    ("sha256", pa.string()),
)

FINAL_SEQ = pa.struct([pa.field("episode", pa.string()), pa.field("final_seq", pa.int64())])

# Promoted columns (format 3): a record field of this name (any kind) is copied here when its
# value fits the type, and stays in payload_json too.
PROMOTED_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    # LivenessProbe
    ("probe", pa.string()),
    ("target", pa.string()),
    ("ok", pa.bool_()),
    ("latency_ms", pa.int64()),
    ("error", pa.string()),
    # EpisodeStart
    ("env_snapshot", pa.string()),
    # TraceChunk
    ("content_type", pa.string()),
    ("reset", pa.string()),
    # Drained
    ("final_seqs", pa.list_(FINAL_SEQ)),
    ("complete", pa.bool_()),
    ("unflushed", pa.int64()),
    # SchedulingDecision, DecisionAck, SandboxRequest
    ("decision", pa.string()),
    ("decision_event_id", pa.string()),
    ("request_id", pa.string()),
    ("suspicious", pa.bool_()),
    ("cause_event_ids", pa.list_(pa.string())),
    # WatchdogAlert
    ("alert", pa.string()),
    ("dry_run", pa.bool_()),
    ("repeat_count", pa.int64()),
    ("span_ms", pa.int64()),
    ("distinct_results", pa.int64()),
    # DeadLetter
    ("stage", pa.string()),
    ("reason_code", pa.string()),
    ("source_topic", pa.string()),
    ("source_partition", pa.int32()),
    ("source_offset", pa.int64()),
)
DERIVED_FIELDS: tuple[tuple[str, pa.DataType], ...] = (("dataset", pa.string()),)
"""Columns computed from a record rather than copied from one field (see the module doc)."""

PROMOTED_KINDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("probe", "target", "ok", "latency_ms", "error"), ("LivenessProbe",)),
    "env_snapshot": ("EpisodeStart",),
    **dict.fromkeys(("content_type", "reset"), ("TraceChunk",)),
    **dict.fromkeys(("final_seqs", "complete", "unflushed"), ("Drained",)),
    "decision": ("SchedulingDecision", "DecisionAck"),
    "decision_event_id": ("DecisionAck",),
    "request_id": ("SchedulingDecision", "SandboxRequest"),
    **dict.fromkeys(("suspicious", "cause_event_ids"), ("SchedulingDecision",)),
    **dict.fromkeys(("alert", "dry_run", "repeat_count", "span_ms", "distinct_results"),
                    ("WatchdogAlert",)),
    **dict.fromkeys(("stage", "reason_code", "source_topic", "source_partition",
                     "source_offset"), ("DeadLetter",)),
    "dataset": ("SandboxRequest", "EpisodeStart", "SchedulingDecision"),
}
"""The kinds whose records fill each promoted and derived column (the bundled schemas')."""
_DATASET_KINDS = frozenset(PROMOTED_KINDS["dataset"])

NON_NULL: frozenset[str] = frozenset({
    "event_id", "task", "sandbox", "seq", "event_time", "event_time_ms", "producer_id", "kind",
    "event_digest", "kafka_topic", "kafka_partition", "kafka_offset"})
"""The columns every archived row has (the envelope's required fields, the kind, the digest
and the source position), declared non-null in :data:`ARCHIVE_SCHEMA`."""

FORMAT = "3"
"""Archive format (Parquet metadata ``trajbus.archive.schema``). 2: without the promoted and
derived columns, every column but ``kind`` nullable. 3: with them, :data:`NON_NULL`."""


def _field(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=name not in NON_NULL)


ARCHIVE_SCHEMA = pa.schema(
    [_field(n, t) for n, t in HEADER_FIELDS[:5]]
    + [_field("event_time", EVENT_TIME)]
    + [_field(n, t) for n, t in HEADER_FIELDS[5:]]
    + [_field("kind", pa.string())]
    + [_field(n, t) for n, t in TYPED_FIELDS]
    + [_field(n, t) for n, t in PROMOTED_FIELDS]
    + [_field(n, t) for n, t in DERIVED_FIELDS]
    + [
        _field("payload_json", pa.string()),
        _field("data", pa.binary()),
        _field("blob_uri", pa.string()),
        _field("event_digest", pa.int64()),
        _field("kafka_topic", pa.string()),
        _field("kafka_partition", pa.int32()),
        _field("kafka_offset", pa.int64()),
    ],
    metadata={b"trajbus.archive.schema": FORMAT.encode()},
)
COLUMNS: tuple[str, ...] = tuple(ARCHIVE_SCHEMA.names)
_COLUMN_SET = frozenset(COLUMNS)
BLOB_DIR = "blobs/"
"""Where claim-check blobs live under an archive root (``blobs/sha256/ab/cd/<sha256>``,
``bus.blobref.blob_key``)."""
_HEADER_NAMES = tuple(n for n, _ in HEADER_FIELDS)
_TYPED = dict(TYPED_FIELDS)
_INT_TYPES = {n for n, t in TYPED_FIELDS if pa.types.is_integer(t)}
_FLOAT_TYPES = {n for n, t in TYPED_FIELDS if pa.types.is_floating(t)}
# Per-row overhead estimate (offsets, validity, fixed-width columns) for size accounting.
_ROW_OVERHEAD = 160

Row = dict[str, Any]


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _unjson(value: Any) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and "$b64" in value:
            return base64.b64decode(value["$b64"])
        return {k: _unjson(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    return value


# Per typed column, the one test its value must pass ("s" str, "i" int but not bool, "f" int or
# float but not bool); a value that fails stays in payload_json.
_TYPED_TEST: dict[str, str] = {
    n: "i" if n in _INT_TYPES else "f" if n in _FLOAT_TYPES else "s" for n in _TYPED
}
_HEADER_SET = frozenset(_HEADER_NAMES)


def _fits_final_seqs(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, Mapping) and isinstance(v.get("episode"), str)
        and isinstance(v.get("final_seq"), int) and not isinstance(v.get("final_seq"), bool)
        for v in value)


# Per promoted column, the test its value must pass to be copied ("s" str, "i" int but not
# bool, "b" bool, "ls" list of str, "fs" list of {episode, final_seq}).
_PROMOTED_TEST: dict[str, str] = {}
for _n, _t in PROMOTED_FIELDS:
    _PROMOTED_TEST[_n] = ("b" if pa.types.is_boolean(_t) else "i" if pa.types.is_integer(_t)
                          else "s" if pa.types.is_string(_t)
                          else "fs" if _n == "final_seqs" else "ls")


def _promoted(test: str, value: Any) -> bool:
    if test == "s":
        return isinstance(value, str)
    if test == "b":
        return isinstance(value, bool)
    if test == "i":
        return isinstance(value, int) and not isinstance(value, bool)
    if test == "ls":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return _fits_final_seqs(value)


def _dataset(fields: Mapping[str, Any]) -> str | None:
    """The derived ``dataset`` of a record's fields: its own ``dataset``, else the entry of
    its ``context`` or ``details`` map (None when empty or absent)."""
    for holder in (fields, fields.get("context"), fields.get("details")):
        if isinstance(holder, Mapping):
            dataset = holder.get("dataset")
            if isinstance(dataset, str) and dataset:
                return dataset
    return None


def relative_blob_uri(uri: str, blob_root: str | None) -> str:
    """``uri`` relative to the archive root ``blob_root`` (``blobs/sha256/...``) when it points
    into that root's ``blobs/``, else ``uri`` unchanged."""
    if blob_root:
        prefix = blob_root.rstrip("/") + "/"
        if uri.startswith(prefix) and uri[len(prefix):].startswith(BLOB_DIR):
            return uri[len(prefix):]
    return uri


def to_row(kind: str, record: Mapping[str, Any], topic: str, partition: int,
           offset: int, blob_root: str | None = None) -> Row:
    """Flatten one decoded record (``{"header": {...}, ...}``) into an archive row.

    Unknown fields (a newer schema) and fields whose type does not fit their typed column go
    to ``payload_json``; promoted fields are copied to their column and kept there too. The
    row holds columns of :data:`COLUMNS` only; a column it does not hold is null
    (``row.get(name)``). Rows are sparse because most typed columns are null for any one
    kind, and ``pa.Table.from_pylist`` converts sparse dicts ~35% faster.

    ``blob_root``: the root URI of the archive being written (``file:///...`` or
    ``s3://bucket/prefix``, ``bus.blobref.root_uri``); a claim-check reference into
    it is stored relative to it (:func:`relative_blob_uri`), in ``blob_uri`` and in the
    ``blob`` field of ``payload_json``.
    """
    header = record["header"]
    extra_header: dict[str, Any] | None = None
    if header.keys() <= _HEADER_SET:
        row: Row = dict(header)
    else:  # header fields a newer envelope added are kept in payload_json
        row = {n: header.get(n) for n in _HEADER_NAMES}
        extra_header = {k: v for k, v in header.items() if k not in _HEADER_SET}
    row["kind"] = kind
    rest: dict[str, Any] = {}
    for name, value in record.items():
        if name == "header":
            continue
        test = _TYPED_TEST.get(name)
        if test is not None:
            if value is None:
                continue
            if test == "s":
                if isinstance(value, str):
                    row[name] = value
                    continue
            elif isinstance(value, bool):
                pass
            elif test == "i":
                if isinstance(value, int):
                    row[name] = value
                    continue
            elif isinstance(value, int | float):
                row[name] = float(value)
                continue
        else:
            ptest = _PROMOTED_TEST.get(name)
            if ptest is not None and value is not None and _promoted(ptest, value):
                row[name] = value
        if kind == "TraceChunk" and name == "data" and isinstance(value, bytes | bytearray):
            row["data"] = bytes(value)
            continue
        if name == "blob" and isinstance(value, Mapping) and isinstance(value.get("uri"), str):
            uri = relative_blob_uri(value["uri"], blob_root)
            if uri != value["uri"]:
                value = {**value, "uri": uri}
            row["blob_uri"] = uri
        rest[name] = value
    if kind in _DATASET_KINDS:  # SandboxRequest.dataset, EpisodeStart.context, ...details
        dataset = _dataset(record)
        if dataset is not None:
            row["dataset"] = dataset
    if extra_header:
        rest["$header"] = extra_header
    if rest:
        row["payload_json"] = json.dumps(_jsonable(rest), sort_keys=True,
                                         separators=(",", ":"), default=str)
    row["kafka_topic"] = topic
    row["kafka_partition"] = partition
    row["kafka_offset"] = offset
    return row


def decode_as_written(codec: Codec, data: bytes) -> Decoded:
    """Decode with the *writer's* schema only, so the archive keeps every field the producer
    wrote (a newer producer's extra fields included; :meth:`Codec.decode` would project them
    away onto this version's reader schema). Raises the codec's ``DecodeError`` subclasses."""
    writer, parsed = codec.writer_runtime(data)  # raises bad magic / unknown schema
    buf = io.BytesIO(data)
    buf.seek(HEADER_LEN)
    try:
        record = schemaless_reader(buf, parsed, None)
    except Exception as exc:  # fastavro raises many types on corrupt input
        raise CorruptBodyError(f"{writer.short_name}: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(data):
        raise CorruptBodyError(
            f"{writer.short_name}: {len(data) - buf.tell()} trailing bytes after the record")
    if not isinstance(record, dict) or not isinstance(record.get("header"), dict):
        raise CorruptBodyError(f"{writer.short_name}: not a trajbus event record")
    return Decoded(writer.short_name, record, writer)


def decoded_to_row(decoded: Decoded, topic: str, partition: int, offset: int,
                   blob_root: str | None = None) -> Row:
    return to_row(decoded.kind, decoded.record, topic, partition, offset, blob_root)


_SIZED = ("event_id", "task", "sandbox", "episode", "producer_id", "payload_json", "sha256",
          "args_hash", "result_hash", "tool", "call_id", "reason", "data")


def row_nbytes(row: Row) -> int:
    """Approximate in-memory (uncompressed) size of a row, for batching decisions."""
    n = _ROW_OVERHEAD
    for v in map(row.get, _SIZED):
        if v is not None:
            n += len(v)
    return n


def rows_to_table(rows: Sequence[Row] | Iterable[Row]) -> pa.Table:
    """Rows (dicts of :data:`COLUMNS`, absent = null; ``event_time`` is derived from
    ``event_time_ms``) to a table of :data:`ARCHIVE_SCHEMA`."""
    return with_event_time(pa.Table.from_pylist(list(rows), schema=ARCHIVE_SCHEMA))


_EVENT_TIME_POS = ARCHIVE_SCHEMA.get_field_index("event_time")


def with_event_time(table: pa.Table) -> pa.Table:
    """``table`` with its ``event_time`` column (UTC timestamp, ms) set from ``event_time_ms``."""
    ts = pc.cast(table.column("event_time_ms"), pa.int64()).cast(EVENT_TIME)
    return table.set_column(_EVENT_TIME_POS, ARCHIVE_SCHEMA.field("event_time"), ts)


def conform(table: pa.Table, columns: Sequence[str] | None = None) -> pa.Table:
    """``table`` (rows read from an archive object of any format) as ``columns`` (default:
    every column of :data:`ARCHIVE_SCHEMA`) in that order, with the schema's types; a column
    the object lacks (an older format) is null. Tables of objects of different formats then
    concatenate."""
    wanted = list(COLUMNS) if columns is None else list(columns)
    schema = table.schema
    fields = [ARCHIVE_SCHEMA.field(n) if n in _COLUMN_SET else schema.field(n) for n in wanted]
    if schema.names == wanted and all(a.equals(b) for a, b in zip(schema, fields,
                                                                   strict=True)):
        return table
    arrays = []
    for f in fields:
        i = schema.get_field_index(f.name)
        if i < 0:
            arrays.append(pa.nulls(table.num_rows, f.type))
        else:
            col = table.column(i)
            arrays.append(col if col.type == f.type else col.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


_KIND_COLUMNS: dict[str, tuple[str, ...]] = {}
for _col, _kinds in PROMOTED_KINDS.items():
    for _k in _kinds:
        _KIND_COLUMNS[_k] = (*_KIND_COLUMNS.get(_k, ()), _col)
_FIELD_TYPES = dict(PROMOTED_FIELDS + DERIVED_FIELDS)


def _payload_value(name: str, payload: Mapping[str, Any]) -> Any:
    """The value of promoted column ``name`` for a record whose fields are ``payload``
    (as :func:`to_row` would have set it), or None."""
    if name == "dataset":
        return _dataset(payload)
    v = payload.get(name)
    return v if v is not None and _promoted(_PROMOTED_TEST[name], v) else None


def fill_promoted(table: pa.Table) -> pa.Table:
    """``table`` (archive rows, with ``kind`` and ``payload_json``) with the promoted and
    derived columns of rows written before they existed (format 2) filled from
    ``payload_json``. Such a row is one whose kind has every one of them null: the current
    format sets at least one (a required field) for every kind but EpisodeStart (one row per
    episode), so current rows are not parsed again."""
    names = set(table.schema.names)
    if "kind" not in names or "payload_json" not in names or table.num_rows == 0:
        return table
    kind = table.column("kind")
    has_payload = pc.is_valid(table.column("payload_json"))
    updates: dict[str, tuple[list[int], list[Any]]] = {}
    for k, cols in _KIND_COLUMNS.items():
        cols = tuple(c for c in cols if c in names)
        if not cols:
            continue
        mask = pc.and_(pc.equal(kind, k), has_payload)
        for c in cols:
            mask = pc.and_(mask, pc.is_null(table.column(c)))
        if not pc.any(mask).as_py():
            continue
        idx = pc.indices_nonzero(mask.combine_chunks() if isinstance(mask, pa.ChunkedArray)
                                 else mask).to_pylist()
        payloads = pc.take(table.column("payload_json"), pa.array(idx, pa.int64())).to_pylist()
        parsed = [json.loads(p) for p in payloads]
        for c in cols:
            positions, values = updates.setdefault(c, ([], []))
            positions.extend(idx)
            values.extend(_payload_value(c, p) if isinstance(p, dict) else None
                          for p in parsed)
    for c, (positions, values) in updates.items():
        if not any(v is not None for v in values):
            continue
        full: list[Any] = [None] * table.num_rows
        for i, v in zip(positions, values, strict=True):
            full[i] = v
        t = _FIELD_TYPES[c]
        new = pc.if_else(pa.array([v is not None for v in full], pa.bool_()),
                         pa.array(full, t), table.column(c).combine_chunks().cast(t))
        table = table.set_column(table.schema.get_field_index(c), table.schema.field(c), new)
    return table


def row_to_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the event record (``{"kind", "header", ...fields}``) from an archive row."""
    header = {n: row.get(n) for n in _HEADER_NAMES}
    out: dict[str, Any] = {"kind": row.get("kind")}
    payload = json.loads(row["payload_json"]) if row.get("payload_json") else {}
    payload = _unjson(payload)
    extra_header = payload.pop("$header", None)
    if isinstance(extra_header, dict):
        header.update(extra_header)
    out["header"] = header
    for name in _TYPED:  # promoted and derived columns are in payload_json or not fields
        if row.get(name) is not None:
            out[name] = row[name]
    out.update(payload)
    if row.get("data") is not None:
        out["data"] = row["data"]
    return out
