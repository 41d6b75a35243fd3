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

from fastavro import schemaless_reader, schemaless_writer

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
    """Encode and decode events. Schemas are parsed once (in the registry); stateless per call."""

    def __init__(self, registry: SchemaRegistry | None = None) -> None:
        self.registry = registry or default_registry()

    def encode(self, kind: str, record: dict[str, Any]) -> bytes:
        """Encode ``record`` with the current schema of ``kind`` (short or full name)."""
        info = self.registry.reader(kind)
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(info.fingerprint)
        try:
            schemaless_writer(buf, info.parsed, record, strict_allow_default=True)
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

    def decode(self, data: bytes) -> Decoded:
        """Decode to the reader schema of the writer's name (or the writer's own schema when
        this version has no reader of that name)."""
        writer = self.writer_of(data)
        try:
            reader = self.registry.reader(writer.name)
        except KeyError:
            reader = writer
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            if reader is writer:
                record = schemaless_reader(buf, writer.parsed, None)
            else:
                record = schemaless_reader(buf, writer.parsed, reader.parsed)
        except Exception as exc:  # fastavro raises many types on corrupt input
            raise CorruptBodyError(f"{writer.short_name}: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise CorruptBodyError(
                f"{writer.short_name}: {len(data) - buf.tell()} trailing bytes after the record"
            )
        if not isinstance(record, dict):
            raise CorruptBodyError(f"{writer.short_name}: decoded to {type(record).__name__}")
        return Decoded(reader.short_name, record, writer)


_codec: Codec | None = None


def default_codec() -> Codec:
    """The process-wide codec over the bundled schemas."""
    global _codec
    if _codec is None:
        _codec = Codec()
    return _codec
