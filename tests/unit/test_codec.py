"""The Avro single-object codec: wire format, fingerprints, round trips and typed errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajbus.schemas.codec import (
    MAGIC,
    Codec,
    CorruptBodyError,
    DecodeError,
    EncodeError,
    NotSingleObjectError,
    UnknownSchemaError,
)
from trajbus.schemas.registry import avro_fingerprint, default_registry
from trajbus.schemas.testing import records

REGISTRY = default_registry()
CODEC = Codec(REGISTRY)


def crc64_avro(data: bytes) -> int:
    """Independent CRC-64-AVRO, transcribed from the Avro specification's reference code."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def test_fingerprint_matches_the_avro_specification_test_vector() -> None:
    # The schema "int" has CRC-64-AVRO 0x7275D51A3F395C8F; on the wire it is little-endian.
    assert crc64_avro(b'"int"') == 0x7275D51A3F395C8F
    assert avro_fingerprint('"int"') == bytes.fromhex("8f5c393f1ad57572")
    assert MAGIC + avro_fingerprint('"int"') == bytes.fromhex("c3018f5c393f1ad57572")


@pytest.mark.parametrize("name", REGISTRY.names)
def test_every_schema_fingerprint_equals_an_independent_crc64(name: str) -> None:
    info = REGISTRY.reader(name)
    assert info.fingerprint == crc64_avro(info.canonical.encode()).to_bytes(8, "little")


@pytest.mark.parametrize("name", REGISTRY.names)
def test_canonical_form_is_self_contained(name: str) -> None:
    # The envelope is inlined: another Avro implementation can parse the canonical form alone.
    canonical = json.loads(REGISTRY.reader(name).canonical)
    header = canonical["fields"][0]
    assert header["name"] == "header" and header["type"]["name"] == "trajbus.Envelope"


def test_message_layout_is_marker_fingerprint_body() -> None:
    record = {"header": _header(), "call_id": "c1", "tool": "exec", "args_hash": "ab"}
    data = CODEC.encode("ToolCall", record)
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == REGISTRY.reader("ToolCall").fingerprint
    decoded = CODEC.decode(data)
    assert decoded.kind == "ToolCall"
    assert decoded.record["call_id"] == "c1" and decoded.record["args_summary"] == ""


@pytest.mark.parametrize("name", REGISTRY.names)
def test_round_trip_of_every_kind_property(name: str) -> None:
    info = REGISTRY.reader(name)

    @settings(max_examples=40, deadline=None)
    @given(records(json.loads(info.canonical)))
    def check(record: dict) -> None:  # type: ignore[type-arg]
        decoded = CODEC.decode(CODEC.encode(name, record))
        assert decoded.kind == info.short_name
        assert _normalise(decoded.record) == _normalise(record)

    check()


def test_random_bytes_raise_typed_errors_never_anything_else() -> None:
    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=64))
    def check(data: bytes) -> None:
        try:
            CODEC.decode(data)
        except DecodeError as exc:
            assert exc.reason_code in {"bad_magic", "unknown_schema", "corrupt_body"}

    check()


def test_truncated_body_is_corrupt_body() -> None:
    data = CODEC.encode("ToolCall", {"header": _header(), "call_id": "c", "tool": "t",
                                     "args_hash": "h"})
    with pytest.raises(CorruptBodyError) as err:
        CODEC.decode(data[:-4])
    assert err.value.reason_code == "corrupt_body"


def test_trailing_garbage_is_corrupt_body() -> None:
    data = CODEC.encode("Heartbeat", {"header": _header()})
    with pytest.raises(CorruptBodyError):
        CODEC.decode(data + b"\x00\x01")


def test_corrupt_body_reasons_are_reproducible() -> None:
    """A dead letter's reason names no object address (fastavro's EOF messages name the
    stream): the same bytes give the same reason in every process."""
    data = CODEC.encode("EpisodeEnd", {"header": _header(), "outcome": "TERMINAL",
                                       "reason": "", "reward": 0.5})
    with pytest.raises(CorruptBodyError) as err:
        CODEC.decode(data[:-3])
    assert "0x" not in str(err.value) and "the body" in str(err.value), str(err.value)


def test_unknown_fingerprint_and_bad_magic_are_distinguished() -> None:
    with pytest.raises(UnknownSchemaError) as err:
        CODEC.decode(b"\xc3\x01" + b"\x11" * 8 + b"\x00")
    assert err.value.reason_code == "unknown_schema"
    with pytest.raises(NotSingleObjectError):
        CODEC.decode(b'{"json": true}')


def test_encoding_an_invalid_record_raises_encode_error() -> None:
    with pytest.raises(EncodeError):
        CODEC.encode("ToolCall", {"header": _header(), "call_id": 7, "tool": "t",
                                  "args_hash": "h"})


def test_a_writer_schema_learned_at_run_time_is_resolved_to_the_reader_schema() -> None:
    # An older producer wrote ToolCall without args_summary: its schema arrives via the
    # schema topic; today's reader fills the default.
    old = json.loads(REGISTRY.reader("ToolCall").canonical)
    old["fields"] = [f for f in old["fields"] if f["name"] != "args_summary"]
    info = REGISTRY.register_writer(old)
    import io

    from fastavro import schemaless_writer

    buf = io.BytesIO()
    buf.write(MAGIC + info.fingerprint)
    schemaless_writer(buf, info.parsed, {"header": _header(), "call_id": "c", "tool": "t",
                                         "args_hash": "h", "args_canonical": None})
    decoded = Codec(REGISTRY).decode(buf.getvalue())
    assert decoded.kind == "ToolCall" and decoded.record["args_summary"] == ""


def _header() -> dict:  # type: ignore[type-arg]
    return {"event_id": "e1", "task": "t", "sandbox": "s", "episode": "ep", "seq": 3,
            "event_time_ms": 1_700_000_000_000, "producer_id": "p", "policy_version": None}


def _normalise(value):  # type: ignore[no-untyped-def]
    # float32 fields lose precision on the wire; compare them loosely.
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, float):
        return round(value, 3) if abs(value) < 1e30 else value
    return value


def _fastavro_reference(name: str, record: dict) -> bytes | str:  # type: ignore[type-arg]
    """What fastavro alone writes for ``record`` (or "error")."""
    import io

    from fastavro import schemaless_writer

    header, schema, _ = CODEC._encoder(name)
    buf = io.BytesIO()
    buf.write(header)
    try:
        schemaless_writer(buf, schema, record, strict_allow_default=True)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return "error"
    return buf.getvalue()


def _encoded(name: str, record: dict) -> bytes | str:  # type: ignore[type-arg]
    try:
        return CODEC.encode(name, record)
    except EncodeError:
        return "error"


@pytest.mark.parametrize("name", REGISTRY.names)
def test_compiled_encoder_writes_exactly_what_fastavro_writes(name: str) -> None:
    """The compiled fast path is byte-identical to fastavro on random valid records of every
    kind, and on the same records mutated (missing/extra fields, wrong or edge-typed values:
    bool for long, int for double, out-of-range longs, lone surrogates...), where it must fall
    back to fastavro (same bytes, or the same EncodeError)."""
    import copy
    import random

    info = REGISTRY.reader(name)
    rng = random.Random(name)
    odd = [True, False, 0, 1, -1, 1.0, float("nan"), "x", "\ud800", b"x", None, [], {}, 2**31,
           -(2**31) - 1, 2**63, -(2**63), 2**63 - 1, 1023, 1024, -1024, -1025, "é" * 70]

    @settings(max_examples=40, deadline=None)
    @given(records(json.loads(info.canonical)))
    def check(record: dict) -> None:  # type: ignore[type-arg]
        assert _encoded(name, record) == _fastavro_reference(name, record)
        for _ in range(10):
            r = copy.deepcopy(record)
            target = r if rng.random() < 0.6 else r["header"]
            key = rng.choice(list(target))
            op = rng.randrange(3)
            if op == 0:
                del target[key]
            elif op == 1:
                target[key] = rng.choice(odd)
            else:
                target["zz_extra"] = 1
            assert _encoded(name, r) == _fastavro_reference(name, r), (key, r)

    check()
    # every bundled kind is covered by the compiled encoder (none silently falls back)
    assert CODEC._fast.get(name) is not None or CODEC._fast.get(info.short_name) is not None


# -- header-first decoding -------------------------------------------------------------------
def _head_of(data: bytes) -> tuple:  # type: ignore[type-arg]
    """What decode() says, as decode_head() must say it: (kind, header, enum fields) or the
    error (type, reason code, message)."""
    from trajbus.schemas.head_reader import top_enum_fields

    try:
        decoded = CODEC.decode(data)
    except DecodeError as exc:
        return ("error", type(exc), exc.reason_code, str(exc))
    reader = CODEC._decoder(data)[1]
    return (decoded.kind, decoded.record["header"],
            {n: decoded.record[n] for n in top_enum_fields(reader.parsed)})


def _head(data: bytes) -> tuple:  # type: ignore[type-arg]
    try:
        return tuple(CODEC.decode_head(data))
    except DecodeError as exc:
        return ("error", type(exc), exc.reason_code, str(exc))


def _mutations(rng: object, data: bytes) -> list[bytes]:
    import random

    assert isinstance(rng, random.Random)
    out = [data[:n] for n in range(len(data))]  # every truncation
    out += [data + bytes([b]) for b in (0, 1, 0x80)]
    for _ in range(60):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            b[i] = rng.choice([rng.randrange(256), 0x80, 0xFF, 0x01, 0x00, 0x7F, 0xC3, 0xED,
                               b[i] ^ 1, b[i] ^ 0x80])
        out.append(bytes(b))
        c = bytearray(data)
        c.insert(rng.randrange(HEAD_MIN, len(c) + 1), rng.randrange(256))
        out.append(bytes(c))
    return out


HEAD_MIN = 10


@pytest.mark.parametrize("name", REGISTRY.names)
def test_decode_head_says_what_decode_says(name: str) -> None:
    """decode_head (the generated reader that checks the body without building it) gives
    decode's header and enum fields on valid records of every kind, and decode's answer --
    the same record head, or the same DecodeError -- on the same records truncated, extended
    and with bytes changed (invalid UTF-8, overlong varints, negative lengths, union and enum
    indexes out of range...)."""
    import random

    info = REGISTRY.reader(name)
    rng = random.Random(name)

    @settings(max_examples=30, deadline=None)
    @given(records(json.loads(info.canonical)))
    def check(record: dict) -> None:  # type: ignore[type-arg]
        data = CODEC.encode(name, record)
        assert _head(data) == _head_of(data)
        for bad in _mutations(rng, data):
            assert _head(bad) == _head_of(bad), bad

    check()
    # every byte of a sample changed to each of a few telling values: one-byte varints of
    # small indexes and lengths (0, 1, 2, 3, 4, -1...), a continuation byte, a lead byte
    from trajbus.schemas import models as m
    from trajbus.schemas.samples import sample_event

    short = info.short_name
    for i in range(3):
        data = sample_event(short, m.Envelope(task="t", sandbox="s", episode="e", seq=i,
                                              producer_id="p", policy_version=i or None),
                            i).encode()
        for pos in range(HEAD_MIN, len(data)):
            for value in (0, 1, 2, 3, 4, 6, 8, 0x7F, 0x80, 0xC3, 0xFF):
                bad = data[:pos] + bytes([value]) + data[pos + 1:]
                assert _head(bad) == _head_of(bad), (pos, value)
    # every bundled kind has a generated reader (none silently takes the slow path)
    assert CODEC._head[MAGIC + info.fingerprint] is not None


def test_decode_head_of_random_bytes_and_of_an_older_writer() -> None:
    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=64))
    def check(data: bytes) -> None:
        assert _head(data) == _head_of(data)

    check()
    old = json.loads(REGISTRY.reader("ToolCall").canonical)
    old["fields"] = [f for f in old["fields"] if f["name"] != "args_summary"]
    info = REGISTRY.register_writer(old)
    import io

    from fastavro import schemaless_writer

    buf = io.BytesIO()
    buf.write(MAGIC + info.fingerprint)
    schemaless_writer(buf, info.parsed, {"header": _header(), "call_id": "c", "tool": "t",
                                         "args_hash": "h", "args_canonical": None})
    data = buf.getvalue()
    assert _head(data) == _head_of(data) == ("ToolCall", _header(), {})
    assert CODEC._head[data[:10]] is None  # resolved to another reader: decode() decides
