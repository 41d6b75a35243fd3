"""Avro single-object encoding for trajbus events.

Wire format (Avro specification, "Single object encoding"):
``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing
canonical form + the schemaless binary body.

The decoder finds the writer schema by fingerprint and resolves it to this version's reader
schema of the same name, so old and new producers coexist. Anything it cannot decode raises
a :class:`DecodeError` subclass carrying a stable ``reason_code`` for the dead-letter topic.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from trajbus.schemas.registry import SchemaInfo, SchemaRegistry, default_registry

MAGIC = b"\xc3\x01"
HEADER_LEN = 10


class CodecError(Exception):
    """Base of all codec errors. ``reason_code`` is stable and goes to the dead-letter topic."""

    reason_code = "codec_error"


class EncodeError(CodecError):
    reason_code = "encode_error"


class DecodeError(CodecError):
    reason_code = "decode_error"


class NotSingleObjectError(DecodeError):
    """The bytes do not start with the single-object marker (random bytes, other formats)."""

    reason_code = "bad_magic"


class UnknownSchemaError(DecodeError):
    """The fingerprint names no schema this process knows (nor the schema topic)."""

    reason_code = "unknown_schema"

    def __init__(self, fp: bytes) -> None:
        super().__init__(f"unknown writer schema fingerprint {fp.hex()}")
        self.fingerprint = fp


class CorruptBodyError(DecodeError):
    """The body does not decode with its writer schema (truncated or corrupt bytes)."""

    reason_code = "corrupt_body"


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded event: the schema's short name (kind) and the record as a dict."""

    kind: str
    record: dict[str, Any]
    writer: SchemaInfo

    @property
    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = self.record["header"]
        return h


class Codec:
    """Encode and decode events. Schemas are parsed once (in the registry); stateless per call.

    Hot path: per kind (encode) and per writer fingerprint (decode) the codec caches the
    10-byte header and fastavro's pre-parsed schemas, so a call costs one dict lookup plus
    fastavro's own (Cython) encoding, never a schema parse. The caches only memoise what the
    registry returns (bundled readers never change; a fingerprint learned later is looked up
    in the registry on its first use), so behaviour is the same as without them.
    """

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        self.registry = registry or default_registry()
        # kind (short or full name) -> (header bytes, runtime schema, reader info)
        self._enc: dict[str, tuple[bytes, Any, SchemaInfo]] = {}
        # kind -> compiled encoder for plain records (None: schema uses what it doesn't cover)
        self._fast: dict[str, Callable[[dict[str, Any]], bytes] | None] = {}
        # writer fingerprint -> (writer info, reader info, writer runtime, reader runtime|None)
        self._dec: dict[bytes, tuple[SchemaInfo, SchemaInfo, Any, Any]] = {}

    def _encoder(self, kind: str) -> tuple[bytes, Any, SchemaInfo]:
        hit = self._enc.get(kind)
        if hit is None:
            info = self.registry.reader(kind)
            hit = (MAGIC + info.fingerprint, _runtime(info), info)
            self._enc[kind] = hit
        return hit

    def encode(self, kind: str, record: dict[str, Any]) -> bytes:
        """Encode ``record`` with the current schema of ``kind`` (short or full name)."""
        fast = self._fast.get(kind, _MISSING)
        if fast is _MISSING:
            header, _, info = self._encoder(kind)
            fast = self._fast[kind] = _compile_record(info.parsed, header)
        if fast is not None:
            try:
                return fast(record)
            except _Fallback:
                pass  # not the plain, exactly typed shape: fastavro decides (and raises)
        header, schema, info = self._encoder(kind)
        buf = io.BytesIO()
        buf.write(header)
        try:
            schemaless_writer(buf, schema, record, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            raise EncodeError(f"{info.short_name}: {exc}") from exc
        return buf.getvalue()

    def fingerprint_of(self, data: bytes) -> bytes:
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise NotSingleObjectError(
                f"not an Avro single-object message ({len(data)} bytes, starts {data[:2].hex()})"
            )
        return bytes(data[2:HEADER_LEN])

    def writer_of(self, data: bytes) -> SchemaInfo:
        fp = self.fingerprint_of(data)
        info = self.registry.writer(fp)
        if info is None:
            raise UnknownSchemaError(fp)
        return info

    def _decoder(self, data: bytes) -> tuple[SchemaInfo, SchemaInfo, Any, Any]:
        hit = self._dec.get(data[2:HEADER_LEN]) if data[:2] == MAGIC else None
        if hit is None:
            writer = self.writer_of(data)  # raises bad_magic / unknown_schema
            try:
                reader = self.registry.reader(writer.name)
            except KeyError:
                reader = writer
            hit = (writer, reader, _runtime(writer),
                   None if reader is writer else _runtime(reader))
            self._dec[writer.fingerprint] = hit
        return hit

    def writer_runtime(self, data: bytes) -> tuple[SchemaInfo, Any]:
        """The writer's schema info and fastavro runtime schema of an encoded event (cached
        per fingerprint), for readers that decode as written. Raises bad magic / unknown
        schema like :meth:`writer_of`."""
        hit = self._decoder(data)
        return hit[0], hit[2]

    def decode(self, data: bytes) -> Decoded:
        """Decode to the reader schema of the writer's name (or the writer's own schema when
        this version has no reader of that name)."""
        writer, reader, w_schema, r_schema = self._decoder(data)
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            record = schemaless_reader(buf, w_schema, r_schema)
        except Exception as exc:  # fastavro raises many types on corrupt input
            raise CorruptBodyError(f"{writer.short_name}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise CorruptBodyError(
                f"{writer.short_name}: {len(data) - buf.tell()} trailing bytes after the record"
            )
        if not isinstance(record, dict):
            raise CorruptBodyError(f"{writer.short_name}: decoded to {type(record).__name__}")
        return Decoded(reader.short_name, record, writer)


# -- compiled encoder ----------------------------------------------------------------------
# fastavro's writer costs ~20 us for a small event (mostly resolving each union branch by
# validation). For the common shapes -- records of primitives, enums, arrays, maps and
# ["null", T] unions, every field present, every value of exactly the schema's Python type --
# a compiled closure writes the same bytes (Avro binary encoding is unique for a given
# schema, union branch and value) in a few us. Anything else (a missing or extra field, a bool
# for a long, an int for a double, an out-of-range long, a schema with logical types, fixed,
# other unions...) raises _Fallback and fastavro encodes or raises exactly as before.
# tests/test_codec.py checks byte-equality with fastavro on every kind's samples and on fuzz.

_MISSING: Any = object()
_Enc = Callable[[bytearray, Any], None]
_PACK_D = struct.Struct("<d").pack
_PACK_F = struct.Struct("<f").pack
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1


class _Fallback(Exception):
    """The value is not in the compiled encoder's exactly-typed domain."""


class _Unsupported(Exception):
    """The schema uses something the compiled encoder does not cover."""


def _varint(n: int) -> bytes:
    """Zigzag varint of a long already range-checked."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [_varint(i) for i in range(-1024, 1024)]


def _write_long(buf: bytearray, v: Any) -> None:
    if type(v) is not int:
        raise _Fallback
    if -1024 <= v < 1024:
        buf += _SMALL[v + 1024]
    elif _LONG_MIN <= v <= _LONG_MAX:
        buf += _varint(v)
    else:
        raise _Fallback


def _write_int(buf: bytearray, v: Any) -> None:
    if type(v) is not int or not _INT_MIN <= v <= _INT_MAX:
        raise _Fallback
    buf += _SMALL[v + 1024] if -1024 <= v < 1024 else _varint(v)


def _write_string(buf: bytearray, v: Any) -> None:
    if type(v) is not str:
        raise _Fallback
    try:
        b = v.encode("utf-8")
    except UnicodeEncodeError:
        raise _Fallback from None
    n = len(b)
    buf += _SMALL[n + 1024] if n < 1024 else _varint(n)
    buf += b


def _write_bytes(buf: bytearray, v: Any) -> None:
    if type(v) is not bytes:
        raise _Fallback
    n = len(v)
    buf += _SMALL[n + 1024] if n < 1024 else _varint(n)
    buf += v


def _write_null(buf: bytearray, v: Any) -> None:
    if v is not None:
        raise _Fallback


def _write_boolean(buf: bytearray, v: Any) -> None:
    if v is True:
        buf += b"\x01"
    elif v is False:
        buf += b"\x00"
    else:
        raise _Fallback


def _write_double(buf: bytearray, v: Any) -> None:
    if type(v) is not float:
        raise _Fallback
    buf += _PACK_D(v)


def _write_float(buf: bytearray, v: Any) -> None:
    if type(v) is not float:
        raise _Fallback
    try:
        buf += _PACK_F(v)
    except OverflowError:
        raise _Fallback from None


_PRIMITIVE: dict[str, _Enc] = {
    "null": _write_null, "boolean": _write_boolean, "int": _write_int, "long": _write_long,
    "float": _write_float, "double": _write_double, "bytes": _write_bytes,
    "string": _write_string,
}


def _compile(t: Any, named: dict[str, _Enc | None]) -> _Enc:
    if isinstance(t, str):
        if t in _PRIMITIVE:
            return _PRIMITIVE[t]
        enc = named.get(t)
        if enc is None:  # unknown, or a record referring to itself
            raise _Unsupported(t)
        return enc
    if isinstance(t, list):
        return _compile_union(t, named)
    if not isinstance(t, dict) or "logicalType" in t:
        raise _Unsupported(str(t))
    kind = t.get("type")
    if kind in _PRIMITIVE:
        return _PRIMITIVE[kind]
    if kind == "record":
        name = t["name"]
        named[name] = None
        fields = [(f["name"], _compile(f["type"], named)) for f in t["fields"]]
        enc = _record_writer(fields)
        named[name] = enc
        return enc
    if kind == "enum":
        index = {sym: _SMALL[i + 1024] if i < 1024 else _varint(i)
                 for i, sym in enumerate(t["symbols"])}

        def write_enum(buf: bytearray, v: Any) -> None:
            if type(v) is not str:
                raise _Fallback
            b = index.get(v)
            if b is None:
                raise _Fallback
            buf += b

        named[t["name"]] = write_enum
        return write_enum
    if kind == "array":
        item = _compile(t["items"], named)

        def write_array(buf: bytearray, v: Any) -> None:
            if type(v) is not list:
                raise _Fallback
            if v:
                _write_long(buf, len(v))
                for x in v:
                    item(buf, x)
            buf += b"\x00"

        return write_array
    if kind == "map":
        value = _compile(t["values"], named)

        def write_map(buf: bytearray, v: Any) -> None:
            if type(v) is not dict:
                raise _Fallback
            if v:
                _write_long(buf, len(v))
                for k, x in v.items():
                    _write_string(buf, k)
                    value(buf, x)
            buf += b"\x00"

        return write_map
    raise _Unsupported(str(kind))


def _compile_union(branches: list[Any], named: dict[str, _Enc | None]) -> _Enc:
    # Only ["null", T] / [T, "null"] with T not null and not itself ambiguous with None.
    if len(branches) != 2 or "null" not in branches or branches[0] == branches[1]:
        raise _Unsupported(str(branches))
    null_at = branches.index("null")
    other = _compile(branches[1 - null_at], named)
    null_tag = b"\x00" if null_at == 0 else b"\x02"
    other_tag = b"\x02" if null_at == 0 else b"\x00"

    def write_optional(buf: bytearray, v: Any) -> None:
        if v is None:
            buf += null_tag
        else:
            buf += other_tag
            other(buf, v)

    return write_optional


def _record_writer(fields: list[tuple[str, _Enc]]) -> _Enc:
    n = len(fields)
    steps = tuple(fields)

    def write_record(buf: bytearray, v: Any) -> None:
        if type(v) is not dict or len(v) != n:
            raise _Fallback
        try:
            for name, enc in steps:
                enc(buf, v[name])
        except KeyError:
            raise _Fallback from None

    return write_record


def _compile_record(schema: Any, header: bytes) -> Callable[[dict[str, Any]], bytes] | None:
    try:
        enc = _compile(schema, {})
    except (_Unsupported, KeyError, TypeError, ValueError):
        return None

    def encode(record: dict[str, Any]) -> bytes:
        buf = bytearray(header)
        enc(buf, record)
        return bytes(buf)

    return encode


def _runtime(info: SchemaInfo) -> Any:
    """fastavro's pre-parsed (marked) schema for ``info``: the registry's, or parsed here for a
    SchemaInfo built elsewhere without one."""
    if info.runtime is not None:
        return info.runtime
    return parse_schema(info.parsed)


_codec: Codec | None = None


def default_codec() -> Codec:
    """The process-wide codec over the bundled schemas."""
    global _codec
    if _codec is None:
        _codec = Codec()
    return _codec
