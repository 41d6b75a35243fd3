"""Flattening decoded events into one Arrow schema shared by every event kind.

One schema for all kinds and all schema versions means a schema change never splits files:

* header columns (``event_id, task, sandbox, episode, seq, event_time`` (UTC timestamp),
  ``event_time_ms, producer_id, policy_version, kind``);
* typed columns for the fields the data team filters on (tool calls, results, lifecycle,
  episode outcome, trace chunk position); ``args_canonical``/``result_canonical`` hold the
  producer's canonical JSON text as is (JSON encoded once, never re-encoded inside
  ``payload_json``);
* ``payload_json``: every other field of the record as canonical JSON (sorted keys; bytes as
  ``{"$b64": "..."}``), including fields added by a newer schema version;
* ``data``: a trace chunk's inline bytes (binary); ``blob_uri``: its claim-check reference;
* ``event_digest``: blake2b-64 of the record bytes (int64), what re-sent copies are compared by;
* ``kafka_topic, kafka_partition, kafka_offset``: the source position (the exactly-once key).

:data:`ARCHIVE_SCHEMA` is fixed; :func:`to_row` never adds columns. :func:`row_to_record`
reverses the flattening for one row (typed columns + payload_json + data -> the record dict).
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

ARCHIVE_SCHEMA = pa.schema(
    [pa.field(n, t) for n, t in HEADER_FIELDS[:5]]
    + [pa.field("event_time", EVENT_TIME)]
    + [pa.field(n, t) for n, t in HEADER_FIELDS[5:]]
    + [pa.field("kind", pa.string(), nullable=False)]
    + [pa.field(n, t) for n, t in TYPED_FIELDS]
    + [
        pa.field("payload_json", pa.string()),
        pa.field("data", pa.binary()),
        pa.field("blob_uri", pa.string()),
        pa.field("event_digest", pa.int64()),
        pa.field("kafka_topic", pa.string()),
        pa.field("kafka_partition", pa.int32()),
        pa.field("kafka_offset", pa.int64()),
    ],
    metadata={b"trajbus.archive.schema": b"2"},
)
COLUMNS: tuple[str, ...] = tuple(ARCHIVE_SCHEMA.names)
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


def to_row(kind: str, record: Mapping[str, Any], topic: str, partition: int,
           offset: int) -> Row:
    """Flatten one decoded record (``{"header": {...}, ...}``) into an archive row.

    Unknown fields (a newer schema) and fields whose type does not fit their typed column go
    to ``payload_json``. The row holds columns of :data:`COLUMNS` only; a column it does not
    hold is null (``row.get(name)``). Rows are sparse because most typed columns are null for
    any one kind, and ``pa.Table.from_pylist`` converts sparse dicts ~35% faster.
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
        if kind == "TraceChunk" and name == "data" and isinstance(value, bytes | bytearray):
            row["data"] = bytes(value)
            continue
        if name == "blob" and isinstance(value, Mapping) and isinstance(value.get("uri"), str):
            row["blob_uri"] = value["uri"]
        rest[name] = value
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


def decoded_to_row(decoded: Decoded, topic: str, partition: int, offset: int) -> Row:
    return to_row(decoded.kind, decoded.record, topic, partition, offset)


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
    for name in _TYPED:
        if row.get(name) is not None:
            out[name] = row[name]
    out.update(payload)
    if row.get("data") is not None:
        out["data"] = row["data"]
    return out
