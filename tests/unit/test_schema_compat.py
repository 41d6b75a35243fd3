"""Schema evolution guard: every schema stays backward and forward compatible with its released
versions (schemas/compat/vN). Breaking changes need a new record name (a new major version)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import given, settings

from trajbus.schemas.testing import records

ROOT = Path(__file__).resolve().parents[2] / "schemas"
CURRENT = ROOT / "avro"
RELEASED = sorted((ROOT / "compat").glob("v*"))


def _load(folder: Path, name: str) -> Any:
    env = json.loads((folder / "Envelope.avsc").read_text())
    schema = json.loads((folder / f"{name}.avsc").read_text())
    schema["fields"] = [
        {**f, "type": env} if f["type"] == "trajbus.Envelope" else f for f in schema["fields"]
    ]
    return schema


def _resolves(writer: Any, reader: Any, record: dict[str, Any]) -> None:
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(writer, _write_hint=False), record)
    buf.seek(0)
    schemaless_reader(buf, parse_schema(writer, _write_hint=False),
                      parse_schema(reader, _write_hint=False))


PAIRS = [
    (version.name, path.stem)
    for version in RELEASED
    for path in sorted(version.glob("*.avsc"))
    if path.stem != "Envelope" and (CURRENT / path.name).exists()
]


def test_every_current_schema_has_a_released_version_or_is_new() -> None:
    released = {p.stem for v in RELEASED for p in v.glob("*.avsc")}
    current = {p.stem for p in CURRENT.glob("*.avsc")}
    # A schema may be added; a released one may never disappear (old data must stay readable).
    assert released <= current, f"released schemas removed: {sorted(released - current)}"


@pytest.mark.parametrize(("version", "name"), PAIRS)
def test_backward_and_forward_compatible_with_release(version: str, name: str) -> None:
    old = _load(ROOT / "compat" / version, name)
    new = _load(CURRENT, name)

    @settings(max_examples=25, deadline=None)
    @given(records(json.loads(json.dumps(old))))
    def backward(record: dict[str, Any]) -> None:
        _resolves(old, new, record)  # today's reader reads released data

    @settings(max_examples=25, deadline=None)
    @given(records(json.loads(json.dumps(new))))
    def forward(record: dict[str, Any]) -> None:
        _resolves(new, old, record)  # the released reader reads today's data

    backward()
    forward()


def test_the_guard_catches_a_breaking_change() -> None:
    """A sanity check of the checker itself: removing a required field's default or changing a
    type must fail resolution."""
    old = _load(CURRENT, "Heartbeat")
    broken = json.loads(json.dumps(old))
    broken["fields"].append({"name": "zone", "type": "string"})  # new field without default
    record = {"header": {"event_id": "e", "task": "t", "sandbox": "s", "episode": None,
                         "seq": 0, "event_time_ms": 0, "producer_id": "p",
                         "policy_version": None}, "lease_ttl_ms": 1}
    with pytest.raises(Exception, match=r"zone|default"):
        _resolves(old, broken, record)
