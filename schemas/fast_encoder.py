"""The compiled encoder: Avro binary bodies of plain records, written by code generated per schema.

fastavro's writer costs ~20 us for a small event (mostly resolving each union branch by
validation). For the common shapes -- records of primitives, enums, arrays, maps and
["null", T] unions, every field present, every value of exactly the schema's Python type --
a compiled closure writes the same bytes (Avro binary encoding is unique for a given
schema, union branch and value) in a few us. Anything else (a missing or extra field, a bool
for a long, an int for a double, an out-of-range long, a schema with logical types, fixed,
other unions...) raises :class:`~trajbus.schemas.codegen.Fallback` and fastavro encodes or
raises exactly as it would without this encoder. tests/unit/test_codec.py checks byte-equality with
fastavro on every kind's samples and on fuzz.

:func:`compile_encoder` is the entry point (the codec calls it once per kind).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from trajbus.schemas.codegen import (
    INT_MAX,
    INT_MIN,
    LONG_MAX,
    LONG_MIN,
    Fallback,
    GeneratedSource,
    Unsupported,
)

_Enc = Callable[[bytearray, Any], None]
_PACK_D = struct.Struct("<d").pack
_PACK_F = struct.Struct("<f").pack


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
        raise Fallback
    if -1024 <= v < 1024:
        buf += _SMALL[v + 1024]
    elif LONG_MIN <= v <= LONG_MAX:
        buf += _varint(v)
    else:
        raise Fallback


def _write_int(buf: bytearray, v: Any) -> None:
    if type(v) is not int or not INT_MIN <= v <= INT_MAX:
        raise Fallback
    buf += _SMALL[v + 1024] if -1024 <= v < 1024 else _varint(v)


def _write_string(buf: bytearray, v: Any) -> None:
    if type(v) is not str:
        raise Fallback
    try:
        b = v.encode("utf-8")
    except UnicodeEncodeError:
        raise Fallback from None
    n = len(b)
    buf += _SMALL[n + 1024] if n < 1024 else _varint(n)
    buf += b


def _write_bytes(buf: bytearray, v: Any) -> None:
    if type(v) is not bytes:
        raise Fallback
    n = len(v)
    buf += _SMALL[n + 1024] if n < 1024 else _varint(n)
    buf += v


def _write_null(buf: bytearray, v: Any) -> None:
    if v is not None:
        raise Fallback


def _write_boolean(buf: bytearray, v: Any) -> None:
    if v is True:
        buf += b"\x01"
    elif v is False:
        buf += b"\x00"
    else:
        raise Fallback


def _write_double(buf: bytearray, v: Any) -> None:
    if type(v) is not float:
        raise Fallback
    buf += _PACK_D(v)


def _write_float(buf: bytearray, v: Any) -> None:
    if type(v) is not float:
        raise Fallback
    try:
        buf += _PACK_F(v)
    except OverflowError:
        raise Fallback from None


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
            raise Unsupported(t)
        return enc
    if isinstance(t, list):
        return _compile_union(t, named)
    if not isinstance(t, dict) or "logicalType" in t:
        raise Unsupported(str(t))
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
                raise Fallback
            b = index.get(v)
            if b is None:
                raise Fallback
            buf += b

        named[t["name"]] = write_enum
        return write_enum
    if kind == "array":
        return _block_writer(list, _compile(t["items"], named))
    if kind == "map":
        return _block_writer(dict, _compile(t["values"], named))
    raise Unsupported(str(kind))


def _block_writer(container: Any, write: _Enc) -> _Enc:
    """The writer of an array (``container`` list: each item with ``write``) or a map (dict:
    each string key, then its value with ``write``): one block of them, then the empty block."""
    keyed = container is dict

    def write_blocks(buf: bytearray, v: Any) -> None:
        if type(v) is not container:
            raise Fallback
        if v:
            _write_long(buf, len(v))
            if keyed:
                for k, x in v.items():
                    _write_string(buf, k)
                    write(buf, x)
            else:
                for x in v:
                    write(buf, x)
        buf += b"\x00"

    return write_blocks


def _compile_union(branches: list[Any], named: dict[str, _Enc | None]) -> _Enc:
    # Only ["null", T] / [T, "null"] with T not null and not itself ambiguous with None.
    if len(branches) != 2 or "null" not in branches or branches[0] == branches[1]:
        raise Unsupported(str(branches))
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
            raise Fallback
        try:
            for name, enc in steps:
                enc(buf, v[name])
        except KeyError:
            raise Fallback from None

    return write_record


def compile_encoder(schema: Any, header: bytes) -> Callable[[dict[str, Any]], bytes] | None:
    """The encoder of one schema: Python source generated from it and compiled once, records,
    optional unions, enums and the common primitives written inline (one function call per
    event instead of one per field: ~1.6x faster on a ToolCall); arrays, maps, floats and doubles
    call the closures of :func:`_compile`. Same bytes and same fallbacks as those closures."""
    named: dict[str, _Enc | None] = {}
    try:
        _compile(schema, named)  # every named type's closure, for what is delegated
        source, env = _EncoderSource(named).build(schema)
    except (Unsupported, KeyError, TypeError, ValueError):
        return None
    env.update(_HEADER=header, _Fallback=Fallback, _SMALL=_SMALL, _varint=_varint,
               _LONG_MIN=LONG_MIN, _LONG_MAX=LONG_MAX, _INT_MIN=INT_MIN, _INT_MAX=INT_MAX)
    exec(compile(source, "<trajbus avro encoder>", "exec"), env)  # our own source
    encode: Callable[[dict[str, Any]], bytes] = env["encode"]
    return encode


class _EncoderSource(GeneratedSource):
    """Writes the source of ``encode(record) -> bytes`` for a schema (see compile_encoder)."""

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
                    raise Unsupported(t)
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
                raise Unsupported(str(t))
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
                raise Unsupported(str(t))
            self.emit(d, f"{self.const(enc)}(buf, {v})")
