"""Avro single-object encoding for trajbus events: the :class:`Codec` and its process-wide one.

Wire format (Avro specification, "Single object encoding", see :mod:`trajbus.schemas.wire`):
``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing
canonical form + the schemaless binary body.

The decoder finds the writer schema by fingerprint and resolves it to this version's reader
schema of the same name, so old and new producers coexist. Anything it cannot decode raises
a :class:`DecodeError` subclass carrying a stable ``reason_code`` for the dead-letter topic.

This module is the codec's façade: the wire format's names (:mod:`~trajbus.schemas.wire`)
import from here too. Its fast paths live in :mod:`~trajbus.schemas.fast_encoder` (encoding
plain records) and :mod:`~trajbus.schemas.head_reader` (:meth:`Codec.decode_head`).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer

from trajbus.schemas.codegen import Fallback
from trajbus.schemas.fast_encoder import compile_encoder
from trajbus.schemas.head_reader import compile_head_reader, top_enum_fields
from trajbus.schemas.registry import SchemaInfo, SchemaRegistry, default_registry
from trajbus.schemas.wire import (
    HEADER_LEN,
    MAGIC,
    CodecError,
    CorruptBodyError,
    Decoded,
    DecodeError,
    EncodeError,
    Head,
    JSONValue,
    NotSingleObjectError,
    UnknownSchemaError,
)

__all__ = [
    "HEADER_LEN",
    "MAGIC",
    "Codec",
    "CodecError",
    "CorruptBodyError",
    "DecodeError",
    "Decoded",
    "EncodeError",
    "Head",
    "JSONValue",
    "NotSingleObjectError",
    "UnknownSchemaError",
    "default_codec",
]

_top_enums = top_enum_fields  # the name some callers import from here

_MISSING: Any = object()


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
            fast = self._fast[kind] = compile_encoder(info.parsed, header)
        if fast is not None:
            try:
                return fast(record)
            except Fallback:
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
            read = (compile_head_reader(reader) if r_schema is None and self._bundled(reader)
                    else None)
            self._head[MAGIC + writer.fingerprint] = read
        if read is not None:
            try:
                return read(data)
            except Fallback:
                pass  # not plainly well formed: decode() decides (a record, or its error)
        record = self.decode(data).record
        reader = self._decoder(data)[1]
        names = self._enums.get(reader.name)
        if names is None:
            names = self._enums[reader.name] = top_enum_fields(reader.parsed)
        return Head(reader.short_name, record["header"], {n: record[n] for n in names})


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
