"""The schema registry: bundled Avro schemas, parsed once, addressed by name and fingerprint.

The `.avsc` files in `schemas/avro/` are the contract. Each event kind is a record whose first
field, `header`, is the shared `trajbus.Envelope`. A registry knows:

* reader schemas: the bundled ones, by full name (what this version of trajbus reads into);
* writer schemas: every schema it has seen, by CRC-64-AVRO fingerprint of the parsing canonical
  form (the bundled ones, plus any registered later, e.g. from the `trajbus.schemas` topic).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

ENVELOPE = "trajbus.Envelope"


@dataclass(frozen=True, slots=True)
class SchemaInfo:
    """One parsed schema and its identity."""

    name: str  # full name, e.g. "trajbus.events.ToolCall"
    parsed: Any = field(repr=False)  # fastavro parsed schema, self-contained
    canonical: str = field(repr=False)  # Avro parsing canonical form
    fingerprint: bytes = field(repr=False)  # 8 bytes, CRC-64-AVRO, little-endian (as on the wire)
    # The same schema parsed *with* fastavro's "already parsed" marker: schemaless_writer and
    # schemaless_reader re-parse a schema without it on every call (~10x slower). Runtime
    # encode/decode use this one; ``parsed`` stays the plain form (canonical form, tests).
    runtime: Any = field(default=None, repr=False, compare=False)
    # the kind, e.g. "ToolCall" (computed once: decoders read it per record)
    short_name: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "short_name", self.name.rsplit(".", 1)[-1])


def avro_fingerprint(canonical: str) -> bytes:
    """CRC-64-AVRO of a parsing canonical form, as the 8 little-endian wire bytes.

    fastavro returns the hex of the little-endian bytes already; reversing it is a classic bug.
    """
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def _load_bundled_json() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for entry in resources.files("trajbus.schemas").joinpath("avro").iterdir():
        if entry.name.endswith(".avsc"):
            schema = json.loads(entry.read_text(encoding="utf-8"))
            out[f"{schema['namespace']}.{schema['name']}"] = schema
    return out


class SchemaRegistry:
    """Reader schemas by name and writer schemas by fingerprint. Thread-safe for registration."""

    def __init__(self, bundled: dict[str, dict[str, Any]] | None = None) -> None:
        raw = bundled if bundled is not None else _load_bundled_json()
        if ENVELOPE not in raw:
            raise ValueError(f"the schema set lacks {ENVELOPE}")
        self._envelope = raw[ENVELOPE]
        self._readers: dict[str, SchemaInfo] = {}
        self._writers: dict[bytes, SchemaInfo] = {}
        self._definitions: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        for name, schema in sorted(raw.items()):
            if name == ENVELOPE:
                continue
            info = self._parse(schema)
            self._readers[info.name] = info
            self._writers[info.fingerprint] = info
            self._definitions[info.name] = _inline(schema, ENVELOPE, self._envelope)

    def _parse(self, schema: dict[str, Any]) -> SchemaInfo:
        # Inline the envelope so every schema is self-contained: its canonical form (and so
        # its fingerprint) is what any other Avro implementation computes for it.
        inlined = _inline(schema, ENVELOPE, self._envelope)
        parsed = parse_schema(inlined, _write_hint=False)
        canonical = to_parsing_canonical_form(parsed)
        name = parsed["name"] if isinstance(parsed, dict) else str(parsed)
        runtime = parse_schema(inlined)  # hinted: parsed once, never again per call
        return SchemaInfo(name, parsed, canonical, avro_fingerprint(canonical), runtime)

    # -- readers -------------------------------------------------------------------------
    def reader(self, name: str) -> SchemaInfo:
        """The reader (current) schema for a full or short name, e.g. "ToolCall"."""
        info = self._readers.get(name) or self._readers.get(self._by_short().get(name, ""))
        if info is None:
            raise KeyError(f"no bundled schema named {name!r}; known: {sorted(self._by_short())}")
        return info

    def definition(self, name: str) -> dict[str, Any]:
        """The reader schema of a full or short name as its JSON document (the envelope
        inlined), with every field's type, default and doc."""
        return self._definitions[self.reader(name).name]

    def _by_short(self) -> dict[str, str]:
        return _short_names(tuple(self._readers))

    @property
    def names(self) -> list[str]:
        return sorted(self._readers)

    # -- writers -------------------------------------------------------------------------
    def writer(self, fp: bytes) -> SchemaInfo | None:
        return self._writers.get(fp)

    def register_writer(self, schema_json: str | dict[str, Any]) -> SchemaInfo:
        """Learn a writer schema (e.g. from the `trajbus.schemas` topic). Idempotent."""
        schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
        info = self._parse(schema)
        with self._lock:
            self._writers.setdefault(info.fingerprint, info)
        return self._writers[info.fingerprint]


def _inline(schema: dict[str, Any], ref: str, definition: dict[str, Any]) -> dict[str, Any]:
    """Replace the first reference to `ref` among the record's fields by its definition."""
    fields = []
    done = False
    for f in schema.get("fields", []):
        if not done and f.get("type") == ref:
            f = {**f, "type": definition}
            done = True
        fields.append(f)
    return {**schema, "fields": fields}


@cache
def _short_names(full_names: tuple[str, ...]) -> dict[str, str]:
    return {n.rsplit(".", 1)[-1]: n for n in full_names}


_default: SchemaRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> SchemaRegistry:
    """The process-wide registry of bundled schemas, parsed once."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = SchemaRegistry()
    return _default


def avro_type_name(t: Any) -> str:
    """A compact rendering of an Avro type: ``string``, ``null | long``, ``array<string>``,
    ``map<double>``, ``enum ToolStatus {OK, ERROR, TIMEOUT}``, ``record BlobRef {uri:
    string, ...}``."""
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        return " | ".join(avro_type_name(u) for u in t)
    kind = t.get("type")
    if kind == "array":
        return f"array<{avro_type_name(t['items'])}>"
    if kind == "map":
        return f"map<{avro_type_name(t['values'])}>"
    if kind == "enum":
        return f"enum {t['name']} {{{', '.join(t['symbols'])}}}"
    if kind == "record":
        inner = ", ".join(f"{f['name']}: {avro_type_name(f['type'])}" for f in t["fields"])
        return f"record {t['name']} {{{inner}}}"
    return avro_type_name(kind)


def describe_fields(schema: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(name, type, default, doc) of each field of a record schema, in order; the envelope
    (``header``) expanded as ``header.<field>`` rows. ``default`` is the JSON of the default,
    blank for a required field."""
    out: list[tuple[str, str, str, str]] = []
    for f in schema.get("fields", []):
        t = f["type"]
        if f["name"] == "header" and isinstance(t, dict) and t.get("type") == "record":
            out += [(f"header.{name}", type_, default, doc)
                    for name, type_, default, doc in describe_fields(t)]
            continue
        default = json.dumps(f["default"]) if "default" in f else ""
        out.append((f["name"], avro_type_name(t), default, f.get("doc", "")))
    return out
