"""The head reader: an event's kind, header and top-level enums, its whole body checked, not built.

The codec's ``decode()`` builds every value of a record with fastavro (~6 us for a small
event). A router that reads only the envelope (the reorder worker) needs the header, a few enum
fields and the certainty that the whole body decodes. ``decode_head()`` runs, per writer schema,
a reader generated from the schema (Python source compiled once, like the compiled encoder of
:mod:`trajbus.schemas.fast_encoder`) that walks the body checking what fastavro checks on the
way -- every length and count, union branch and enum index, strings valid UTF-8, nothing left
over -- but builds only the header dict and the top-level enum symbols (~2.5 us). It accepts
only plainly well-formed bytes: a varint longer than 9 bytes, a negative length or block count,
a union or enum index out of range, an int outside 32 bits, a boolean byte other than 0/1,
invalid UTF-8, bytes missing or left over, raise :class:`~trajbus.schemas.codegen.Fallback`, as
does every record of a schema it does not cover (logical types, recursive records, a writer
resolved to another reader schema: no reader is generated). ``decode()`` then decides: it
returns the record or raises the DecodeError it always raised. So for all bytes b,
``decode_head(b)`` equals the head of ``decode(b)``, errors included;
tests/unit/test_codec.py checks it on every kind's samples, mutated and truncated bytes
and random bytes.

:func:`compile_head_reader` is the entry point (the codec calls it once per writer schema);
:func:`top_enum_fields` names the enum fields a head carries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trajbus.schemas.codegen import INT_MAX, INT_MIN, Fallback, GeneratedSource, Unsupported
from trajbus.schemas.registry import SchemaInfo
from trajbus.schemas.wire import HEADER_LEN, Head


def _read_varint(data: bytes, p: int) -> tuple[int, int]:
    """The zigzag varint at ``data[p]`` (a first byte >= 0x80; one-byte varints are read
    inline) and the position after it. At most 9 bytes (|value| < 2**62), else Fallback."""
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
            raise Fallback


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
        raise Fallback
    return n, p


class _HeadSource(GeneratedSource):
    """Writes the Python source of one schema's head reader. Every step reads ``data`` at
    position ``p`` and leaves ``p`` after what it read; ``p`` never moves backwards, so reading
    past the end shows as an IndexError, or as ``p != end`` at the end (both Fallback)."""

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
                raise Unsupported(f"recursive {t}")
            t = self.named[t]
        if not isinstance(t, dict) or "logicalType" in t:
            raise Unsupported(str(t))
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
            raise Unsupported(f"kept {kind}")
        if kind == "fixed":
            self.line(d, f"p += {int(t['size'])}")
        elif kind == "array":
            if self.may_be_empty(t["items"]):  # a count of empty items reads no byte: no bound
                raise Unsupported("array of possibly empty items")
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
                self.line(d, f"if not {INT_MIN} <= {keep} <= {INT_MAX}:")
                self.line(d + 1, "raise _Fallback")
        elif t in ("float", "double"):
            if target is not None:
                raise Unsupported(f"kept {t}")
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
            raise Unsupported(t)

    def union(self, d: int, branches: list[Any], target: str | None) -> None:
        if not branches or len(branches) > 63:
            raise Unsupported("union")
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


def compile_head_reader(info: SchemaInfo) -> Callable[[bytes], Head] | None:
    """The head reader of records written with ``info`` and read with it, or None when the
    schema uses something the generator does not cover."""
    schema = info.parsed
    src = _HeadSource()
    try:
        enums = top_enum_fields(schema)
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
            raise Unsupported("no header field")
    except (Unsupported, KeyError, TypeError, ValueError):
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
        "_read_varint": _read_varint, "_read_length": _read_length, "_Fallback": Fallback,
        "_new": tuple.__new__, "Head": Head, "KIND": info.short_name, **src.consts}
    exec(compile(source, f"<head reader of {info.name}>", "exec"), namespace)
    read: Callable[[bytes], Head] = namespace["read_head"]
    read.source = source  # type: ignore[attr-defined]  # for tests and debugging
    return read


def top_enum_fields(schema: Any) -> tuple[str, ...]:
    """The names of the record's top-level fields whose type is an enum (defined in the field
    or, by name, anywhere before it)."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        raise Unsupported(str(schema))
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
