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
