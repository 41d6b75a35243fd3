"""Reading the watchdog's input records: the header fields it needs, hash fingerprints, the
precise reason a refused record gets and its dead letter."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from .outputs import DeadLetterOut


class Invalid(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


fromhex = bytes.fromhex


def opaque(value: str) -> bytes:
    """Fingerprint of a hash field that is not hex: still deterministic."""
    return hashlib.sha256(b"opaque\x00" + value.encode("utf-8", "surrogatepass")).digest()


def read_header(rec: Mapping[str, Any]) -> tuple[str, str, str | None, int, int, str]:
    h = rec["header"]
    task, sandbox, episode = h["task"], h["sandbox"], h.get("episode")
    seq, t, event_id = h["seq"], h["event_time_ms"], h["event_id"]
    if (type(seq) is not int or type(t) is not int or seq < 0 or type(sandbox) is not str
            or type(task) is not str or type(event_id) is not str
            or (episode is not None and type(episode) is not str)):
        raise TypeError("field check")
    return task, sandbox, episode, seq, t, event_id


_REQUIRED: dict[str, tuple[tuple[str, tuple[type, ...], bool], ...]] = {
    "ToolCall": (("call_id", (str,), False), ("tool", (str,), False),
                 ("args_hash", (str,), False), ("args_canonical", (str,), True)),
    "ToolResult": (("call_id", (str,), False), ("status", (str,), False),
                   ("result_hash", (str,), False), ("result_canonical", (str,), True)),
    "SandboxLifecycle": (("state", (str,), False),),
}
_HEADER_FIELDS = (("event_id", False), ("task", False), ("sandbox", False), ("episode", True))


def diagnose(kind: str, record: Any) -> tuple[str, str]:
    """Precise reason code for a record the fast path refused."""
    if not isinstance(record, Mapping):
        return "wrong_type", f"record must be a mapping, got {type(record).__name__}"
    h = record.get("header")
    if h is None:
        return "missing_field", "header is missing"
    if not isinstance(h, Mapping):
        return "wrong_type", "header must be a mapping"
    for name, optional in _HEADER_FIELDS:
        if name not in h:
            if optional:
                continue
            return "missing_field", f"header.{name} is missing"
        v = h[name]
        if not (isinstance(v, str) or (optional and v is None)):
            return "wrong_type", f"header.{name} must be a string"
    for name in ("seq", "event_time_ms"):
        if name not in h:
            return "missing_field", f"header.{name} is missing"
        if type(h[name]) is not int:
            return "wrong_type", f"header.{name} must be an int"
    if h["seq"] < 0:
        return "negative_seq", f"header.seq is negative ({h['seq']})"
    for name, types, optional in _REQUIRED.get(kind, ()):
        if name not in record:
            if optional:
                continue
            return "missing_field", f"{name} is missing"
        v = record[name]
        if not (type(v) in types or (optional and v is None)):
            return "wrong_type", f"{name} must be {types[0].__name__}"
    return "internal_error", "unexpected error"



def dead_letter(kind: str, record: Any, code: str, reason: str) -> DeadLetterOut:
    """The dead letter of a refused record: ``code`` and ``reason``, plus whatever of its
    header identifies it (fields of the wrong type are left out)."""
    h = record.get("header") if isinstance(record, Mapping) else None
    if not isinstance(h, Mapping):
        h = {}

    def s(name: str) -> str | None:
        v = h.get(name)
        return v if isinstance(v, str) else None

    seq = h.get("seq")
    return DeadLetterOut(
        reason_code=code, reason=reason, kind=kind if isinstance(kind, str) else repr(kind),
        event_id=s("event_id"), task=s("task"), sandbox=s("sandbox"), episode=s("episode"),
        seq=seq if type(seq) is int else None,
    )
