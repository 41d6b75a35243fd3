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
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from trajbus.schemas.registry import SchemaInfo, SchemaRegistry, default_registry

JSONValue: TypeAlias = "dict[str, JSONValue] | list[JSONValue] | str | int | float | bool | None"
"""A parsed JSON value (:meth:`Decoded.result_json`)."""

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

    @property
    def seq(self) -> int:
        """The event's sequence number in its sandbox's stream."""
        return int(self.record["header"]["seq"])

    def args_json(self) -> dict[str, Any] | None:
        """A ToolCall's arguments, parsed from ``args_canonical`` (the canonical JSON the
        emitter sent, redacted); None when only their hash and summary were sent (arguments
        over 4 KiB). Raises TypeError for another kind, or arguments that are not a JSON
        object (read ``record["args_canonical"]`` then)."""
        parsed = self._canonical("ToolCall", "args_canonical")
        if parsed is not None and not isinstance(parsed, dict):
            raise TypeError(f"this ToolCall's arguments are a JSON {type(parsed).__name__}, "
                            "not an object")
        return parsed

    def result_json(self) -> JSONValue:
        """A ToolResult's result, parsed from ``result_canonical`` (any JSON value); None when
        only its hash and summary were sent (results over 4 KiB) -- or the result was null.
        Raises TypeError for another kind."""
        return self._canonical("ToolResult", "result_canonical")

    def _canonical(self, kind: str, field: str) -> Any:
        if self.kind != kind:
            raise TypeError(f"{field} is a {kind}'s field; this event is a {self.kind}")
        text = self.record.get(field)
        return None if text is None else json.loads(text)


class Head(NamedTuple):
    """What :meth:`Codec.decode_head` returns: the event's kind, its header (the same dict as
    ``decode(data).record["header"]``) and its top-level enum fields by name (e.g. EpisodeEnd's
    ``outcome``, SandboxLifecycle's ``state``; empty for kinds without one)."""

    kind: str
    header: dict[str, Any]
    enums: dict[str, str]


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
        # marker + writer fingerprint -> head reader (None: decode() decides every record)
        self._head: dict[bytes, Callable[[bytes], Head] | None] = {}
        self._enums: dict[str, tuple[str, ...]] = {}  # reader name -> its top-level enum fields

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
            # its messages may name the stream object ("... from <_io.BytesIO object at
            # 0x7f...>"): say "the body" instead, so the dead letter's reason is reproducible
            why = str(exc).replace(repr(buf), "the body")
            raise CorruptBodyError(f"{writer.short_name}: {type(exc).__name__}: {why}") from exc
        if buf.tell() != len(data):
            raise CorruptBodyError(
                f"{writer.short_name}: {len(data) - buf.tell()} trailing bytes after the record"
            )
        if not isinstance(record, dict):
            raise CorruptBodyError(f"{writer.short_name}: decoded to {type(record).__name__}")
        return Decoded(reader.short_name, record, writer)

    def _bundled(self, info: SchemaInfo) -> bool:
        try:
            return self.registry.reader(info.name) is info
        except KeyError:
            return False

    def decode_head(self, data: bytes) -> Head:
        """The kind, header and top-level enum fields of an encoded event, once the whole
        body is known to decode: exactly what :meth:`decode` gives for them, and the same
        :class:`DecodeError` for anything :meth:`decode` refuses, without building the
        body's other values (see "header-first decoding" below)."""
        read = self._head.get(data[:HEADER_LEN], _MISSING)  # by marker + fingerprint
        if read is _MISSING:
            writer, reader, _, r_schema = self._decoder(data)  # raises bad magic / unknown
            # compiled only for this package's own schemas: never generate code from a
            # schema that came from outside (a writer found in the schema topic)
            read = (_compile_head(reader) if r_schema is None and self._bundled(reader)
                    else None)
            self._head[MAGIC + writer.fingerprint] = read
        if read is not None:
            try:
                return read(data)
            except _Fallback:
                pass  # not plainly well formed: decode() decides (a record, or its error)
        record = self.decode(data).record
        reader = self._decoder(data)[1]
        names = self._enums.get(reader.name)
        if names is None:
            names = self._enums[reader.name] = _top_enums(reader.parsed)
        return Head(reader.short_name, record["header"], {n: record[n] for n in names})


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
    """The encoder of one schema: Python source generated from it and compiled once, records,
    optional unions, enums and the common primitives written inline (one function call per
    event instead of one per field: ~1.6x faster on a ToolCall); arrays, maps, floats and doubles
    call the closures of :func:`_compile`. Same bytes and same fallbacks as those closures."""
    named: dict[str, _Enc | None] = {}
    try:
        _compile(schema, named)  # every named type's closure, for what is delegated
        source, env = _EncoderSource(named).build(schema)
    except (_Unsupported, KeyError, TypeError, ValueError):
        return None
    env.update(_HEADER=header, _Fallback=_Fallback, _SMALL=_SMALL, _varint=_varint,
               _LONG_MIN=_LONG_MIN, _LONG_MAX=_LONG_MAX, _INT_MIN=_INT_MIN, _INT_MAX=_INT_MAX)
    exec(compile(source, "<trajbus avro encoder>", "exec"), env)  # our own source
    encode: Callable[[dict[str, Any]], bytes] = env["encode"]
    return encode


class _Source:
    """Lines of generated Python source, fresh local names and the constants it refers to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self._n = 0

    def var(self, stem: str = "v") -> str:
        self._n += 1
        return f"{stem}{self._n}"

    def const(self, value: Any) -> str:
        name = self.var("_c")
        self.consts[name] = value
        return name

    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)


class _EncoderSource(_Source):
    """Writes the source of ``encode(record) -> bytes`` for a schema (see _compile_record)."""

    def __init__(self, named: dict[str, _Enc | None]) -> None:
        super().__init__()
        self.named = named  # name -> closure (delegated kinds, enums)
        self.schemas: dict[str, Any] = {}  # name -> schema, for records referred to by name

    def build(self, schema: Any) -> tuple[str, dict[str, Any]]:
        self.lines = ["def encode(v0):", "    buf = bytearray(_HEADER)", "    try:"]
        self.value(schema, "v0", 2)
        self.lines += ["    except (KeyError, UnicodeEncodeError):",
                       "        raise _Fallback from None", "    return bytes(buf)"]
        return "\n".join(self.lines) + "\n", self.consts

    def emit(self, depth: int, *lines: str) -> None:
        for text in lines:
            self.line(depth, text)

    def value(self, t: Any, v: str, d: int) -> None:
        if isinstance(t, dict) and t.get("type") in _PRIMITIVE and "logicalType" not in t:
            t = t["type"]
        if isinstance(t, str) and t not in _PRIMITIVE:
            if t not in self.schemas:  # an enum (or what _compile delegated): its closure
                enc = self.named.get(t)
                if enc is None:
                    raise _Unsupported(t)
                self.emit(d, f"{self.const(enc)}(buf, {v})")
                return
            t = self.schemas[t]
        if t == "string":
            self.emit(d, f"if type({v}) is not str: raise _Fallback",
                      f"b = {v}.encode('utf-8')", "n = len(b)",
                      "buf += _SMALL[n + 1024] if n < 1024 else _varint(n)", "buf += b")
        elif t == "bytes":
            self.emit(d, f"if type({v}) is not bytes: raise _Fallback", f"n = len({v})",
                      "buf += _SMALL[n + 1024] if n < 1024 else _varint(n)", f"buf += {v}")
        elif t in ("long", "int"):
            lo, hi = ("_LONG_MIN", "_LONG_MAX") if t == "long" else ("_INT_MIN", "_INT_MAX")
            self.emit(d, f"if type({v}) is not int: raise _Fallback",
                      f"if -1024 <= {v} < 1024: buf += _SMALL[{v} + 1024]",
                      f"elif {lo} <= {v} <= {hi}: buf += _varint({v})",
                      "else: raise _Fallback")
        elif t == "boolean":
            self.emit(d, f"if {v} is True: buf += b'\\x01'",
                      f"elif {v} is False: buf += b'\\x00'", "else: raise _Fallback")
        elif t == "null":
            self.emit(d, f"if {v} is not None: raise _Fallback")
        elif isinstance(t, list):
            if len(t) != 2 or "null" not in t or t[0] == t[1]:
                raise _Unsupported(str(t))
            null_at = t.index("null")
            null_tag, other_tag = (b"\x00", b"\x02") if null_at == 0 else (b"\x02", b"\x00")
            self.emit(d, f"if {v} is None: buf += {null_tag!r}", "else:",
                      f"    buf += {other_tag!r}")
            self.value(t[1 - null_at], v, d + 1)
        elif isinstance(t, dict) and t.get("type") == "record" and "logicalType" not in t:
            self.schemas[t["name"]] = t
            fields = t["fields"]
            self.emit(d, f"if type({v}) is not dict or len({v}) != {len(fields)}: "
                         "raise _Fallback")
            for f in fields:
                x = self.var()
                self.emit(d, f"{x} = {v}[{f['name']!r}]")
                self.value(f["type"], x, d)
        else:  # enum, array, map, float, double: the closure _compile made
            if isinstance(t, dict) and t.get("type") == "enum":
                enc = self.named.get(t["name"])
            else:
                enc = _compile(t, self.named)
            if enc is None:
                raise _Unsupported(str(t))
            self.emit(d, f"{self.const(enc)}(buf, {v})")


# -- header-first decoding -------------------------------------------------------------------
# decode() builds every value of a record with fastavro (~6 us for a small event). A router
# that reads only the envelope (the reorder worker) needs the header, a few enum fields and the
# certainty that the whole body decodes. decode_head() runs, per writer schema, a reader
# generated from the schema (Python source compiled once, like the encoder above) that walks
# the body checking what fastavro checks on the way -- every length and count, union branch
# and enum index, strings valid UTF-8, nothing left over -- but builds only the header dict and
# the top-level enum symbols (~2.5 us). It accepts only plainly well-formed bytes: a varint
# longer than 9 bytes, a negative length or block count, a union or enum index out of range, an
# int outside 32 bits, a boolean byte other than 0/1, invalid UTF-8, bytes missing or left over,
# raise _Fallback, as does every record of a schema it does not cover (logical types, recursive
# records, a writer resolved to another reader schema: no reader is generated). decode() then
# decides: it returns the record or raises the DecodeError it always raised. So for all bytes b,
# decode_head(b) equals the head of decode(b), errors included; tests/test_codec.py checks it on
# every kind's samples, mutated and truncated bytes and random bytes.


def _read_varint(data: bytes, p: int) -> tuple[int, int]:
    """The zigzag varint at ``data[p]`` (a first byte >= 0x80; one-byte varints are read
    inline) and the position after it. At most 9 bytes (|value| < 2**62), else _Fallback."""
    n = 0
    shift = 0
    while True:
        b = data[p]
        p += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return (n >> 1) ^ -(n & 1), p
        shift += 7
        if shift == 63:
            raise _Fallback


def _read_length(data: bytes, p: int) -> tuple[int, int]:
    """A length or count that is not a one-byte positive varint (read inline): any varint,
    not negative; two-byte ones (64 to 8191, e.g. a sha256 hex string) without a loop."""
    b = data[p]
    if b < 0x80:
        n, p = (b >> 1) ^ -(b & 1), p + 1
    elif data[p + 1] < 0x80:
        n, p = (b & 0x7F) | (data[p + 1] << 7), p + 2
        n = (n >> 1) ^ -(n & 1)
    else:
        n, p = _read_varint(data, p)
    if n < 0:
        raise _Fallback
    return n, p


class _HeadSource(_Source):
    """Writes the Python source of one schema's head reader. Every step reads ``data`` at
    position ``p`` and leaves ``p`` after what it read; ``p`` never moves backwards, so reading
    past the end shows as an IndexError, or as ``p != end`` at the end (both _Fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.named: dict[str, Any] = {}  # full name -> definition (record, enum, fixed)
        self.open: set[str] = set()  # records being written (a reference back: recursive)

    def long(self, d: int, target: str) -> None:
        self.line(d, "b = data[p]")
        self.line(d, "if b < 0x80:")
        self.line(d + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        self.line(d + 1, "p += 1")
        self.line(d, "else:")
        self.line(d + 1, f"{target}, p = _read_varint(data, p)")

    def length(self, d: int, target: str) -> None:
        """A byte/string length or a block count, never negative here (a one-byte varint with
        its low bit clear: one test for the common case)."""
        self.line(d, f"{target} = data[p]")
        self.line(d, f"if {target} & 0x81:")
        self.line(d + 1, f"{target}, p = _read_length(data, p)")
        self.line(d, "else:")
        self.line(d + 1, f"{target} >>= 1")
        self.line(d + 1, "p += 1")

    def value(self, d: int, t: Any, target: str | None) -> None:
        """Read one value of type ``t``; keep it in ``target`` (None: check and skip it)."""
        if isinstance(t, list):
            return self.union(d, t, target)
        if isinstance(t, str):
            if t not in self.named:
                return self.primitive(d, t, target)
            if t in self.open:
                raise _Unsupported(f"recursive {t}")
            t = self.named[t]
        if not isinstance(t, dict) or "logicalType" in t:
            raise _Unsupported(str(t))
        kind = t.get("type")
        if kind in ("record", "enum", "fixed"):
            self.named[t["name"]] = t
        if kind == "record":
            return self.record(d, t, target)
        if kind == "enum":
            return self.enum(d, t, target)
        if kind not in ("fixed", "array", "map"):
            return self.value(d, kind, target)  # {"type": "long"} and the like
        if target is not None:  # kept values are the header's and enums: plain types only
            raise _Unsupported(f"kept {kind}")
        if kind == "fixed":
            self.line(d, f"p += {int(t['size'])}")
        elif kind == "array":
            if self.may_be_empty(t["items"]):  # a count of empty items reads no byte: no bound
                raise _Unsupported("array of possibly empty items")
            self.blocks(d, lambda dd: self.value(dd, t["items"], None))
        else:
            def entry(dd: int) -> None:  # a map entry: its key, then its value
                self.primitive(dd, "string", None)
                self.value(dd, t["values"], None)

            self.blocks(d, entry)
        return None

    def primitive(self, d: int, t: str, target: str | None) -> None:
        keep = target or "_"
        if t == "null":
            if target is not None:
                self.line(d, f"{target} = None")
        elif t == "boolean":
            self.line(d, "b = data[p]")
            self.line(d, "p += 1")
            self.line(d, "if b > 1:")
            self.line(d + 1, "raise _Fallback")
            if target is not None:
                self.line(d, f"{target} = b == 1")
        elif t in ("int", "long"):
            self.long(d, keep)
            if t == "int":
                self.line(d, f"if not {_INT_MIN} <= {keep} <= {_INT_MAX}:")
                self.line(d + 1, "raise _Fallback")
        elif t in ("float", "double"):
            if target is not None:
                raise _Unsupported(f"kept {t}")
            self.line(d, f"p += {4 if t == 'float' else 8}")
        elif t in ("string", "bytes"):
            n = self.var("n")
            self.length(d, n)
            self.line(d, f"q = p + {n}")
            if t == "string":  # UTF-8 checked as fastavro does: by decoding it
                self.line(d, f"{keep} = data[p:q].decode()")
            elif target is not None:
                self.line(d, f"{target} = data[p:q]")
            self.line(d, "p = q")
        else:
            raise _Unsupported(t)

    def union(self, d: int, branches: list[Any], target: str | None) -> None:
        if not branches or len(branches) > 63:
            raise _Unsupported("union")
        self.line(d, "b = data[p]")
        self.line(d, "p += 1")
        for i, branch in enumerate(branches):  # branch i is the one-byte varint 2 * i
            self.line(d, f"{'if' if i == 0 else 'elif'} b == {2 * i}:")
            self.value(d + 1, branch, target)
            if self.lines[-1].endswith(":"):
                self.line(d + 1, "pass")
        self.line(d, "else:")
        self.line(d + 1, "raise _Fallback")

    def enum(self, d: int, t: dict[str, Any], target: str | None) -> None:
        symbols = tuple(t["symbols"])
        i = self.var("i")
        self.long(d, i)
        self.line(d, f"if not 0 <= {i} < {len(symbols)}:")
        self.line(d + 1, "raise _Fallback")
        if target is not None:
            name = self.var("SYMBOLS")
            self.consts[name] = symbols
            self.line(d, f"{target} = {name}[{i}]")

    def record(self, d: int, t: dict[str, Any], target: str | None) -> None:
        name = t["name"]
        self.open.add(name)
        keep: list[tuple[str, str]] = []
        for f in t["fields"]:
            v = None if target is None else self.var()
            self.value(d, f["type"], v)
            if v is not None:
                keep.append((f["name"], v))
        self.open.discard(name)
        if target is not None:
            self.line(d, f"{target} = {{{', '.join(f'{k!r}: {v}' for k, v in keep)}}}")

    def blocks(self, d: int, item: Callable[[int], Any]) -> None:
        """An array's or map's blocks: count, items, ... until a count of 0. Every item reads
        at least one byte, so a count beyond the bytes left is refused before looping."""
        n = self.var("n")
        self.length(d, n)
        self.line(d, f"while {n}:")
        self.line(d + 1, f"if {n} > end - p:")
        self.line(d + 2, "raise _Fallback")
        self.line(d + 1, f"for _ in range({n}):")
        item(d + 2)
        self.length(d + 1, n)

    def may_be_empty(self, t: Any) -> bool:
        """Whether a value of type ``t`` can take no byte (null, a record of such, fixed 0)."""
        if isinstance(t, str):
            if t not in self.named:
                return t == "null"
            if t in self.open:
                return False  # recursive: refused anyway
            t = self.named[t]
        if isinstance(t, list):
            return False  # the branch index takes a byte
        if not isinstance(t, dict):
            return False
        kind = t.get("type")
        if kind == "record":
            return all(self.may_be_empty(f["type"]) for f in t["fields"])
        if kind == "fixed":
            return int(t["size"]) == 0
        if kind in ("enum", "array", "map"):
            return False
        return self.may_be_empty(kind)


def _compile_head(info: SchemaInfo) -> Callable[[bytes], Head] | None:
    """The head reader of records written with ``info`` and read with it, or None when the
    schema uses something the generator does not cover."""
    schema = info.parsed
    src = _HeadSource()
    try:
        enums = _top_enums(schema)
        src.named[schema["name"]] = schema
        src.open.add(schema["name"])
        src.line(0, "def read_head(data):")
        src.line(1, "end = len(data)")
        src.line(1, f"p = {HEADER_LEN}")
        src.line(1, "try:")
        kept = {}
        for f in schema["fields"]:
            name = f["name"]
            target = None
            if name == "header" or name in enums:
                target = kept[name] = src.var()
            src.value(2, f["type"], target)
        if "header" not in kept:
            raise _Unsupported("no header field")
    except (_Unsupported, KeyError, TypeError, ValueError):
        return None
    header = kept.pop("header")
    enum_dict = ", ".join(f"{k!r}: {v}" for k, v in kept.items())
    src.line(1, "except (IndexError, UnicodeDecodeError):")
    src.line(2, "raise _Fallback from None")
    src.line(1, "if p != end:")
    src.line(2, "raise _Fallback")
    src.line(1, f"return _new(Head, (KIND, {header}, {{{enum_dict}}}))")
    source = "\n".join(src.lines)
    namespace: dict[str, Any] = {
        "_read_varint": _read_varint, "_read_length": _read_length, "_Fallback": _Fallback,
        "_new": tuple.__new__, "Head": Head, "KIND": info.short_name, **src.consts}
    exec(compile(source, f"<head reader of {info.name}>", "exec"), namespace)
    read: Callable[[bytes], Head] = namespace["read_head"]
    read.source = source  # type: ignore[attr-defined]  # for tests and debugging
    return read


def _top_enums(schema: Any) -> tuple[str, ...]:
    """The names of the record's top-level fields whose type is an enum (defined in the field
    or, by name, anywhere before it)."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise _Unsupported(str(schema))
    enums: set[str] = set()
    out: list[str] = []

    def collect(t: Any) -> None:  # named enums defined inside t
        if isinstance(t, list):
            for branch in t:
                collect(branch)
        elif isinstance(t, dict):
            if t.get("type") == "enum":
                enums.add(t["name"])
            for f in t.get("fields", ()):
                collect(f["type"])
            for key in ("items", "values", "type"):
                if isinstance(t.get(key), dict | list):
                    collect(t[key])

    for f in schema["fields"]:
        t = f["type"]
        if (isinstance(t, dict) and t.get("type") == "enum") or (isinstance(t, str)
                                                                  and t in enums):
            out.append(f["name"])
        collect(t)
    return tuple(out)


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
