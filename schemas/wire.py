"""The single-object wire format's vocabulary: its framing, its errors, what decoding returns.

Wire format (Avro specification, "Single object encoding"): ``C3 01`` (:data:`MAGIC`) + the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing canonical form
(the first :data:`HEADER_LEN` bytes in all) + the schemaless binary body.

Every error a codec raises is a :class:`CodecError`; the decoding ones are :class:`DecodeError`
subclasses whose ``reason_code`` is stable (it goes to the dead-letter topic). A decoded event is
a :class:`Decoded` (the whole record) or a :class:`Head` (kind, header and top-level enums).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from trajbus.schemas.registry import SchemaInfo

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
