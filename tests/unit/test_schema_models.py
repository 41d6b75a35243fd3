"""The pydantic models mirror the Avro schemas field by field (names, types, nullability,
defaults), and every kind round-trips model -> Avro bytes -> model."""

from __future__ import annotations

import json
import types
import typing
from enum import StrEnum
from typing import Any

import pytest
from pydantic import BaseModel

from trajbus.schemas import models
from trajbus.schemas.models import EVENT_MODELS, Envelope, decode_event
from trajbus.schemas.registry import default_registry

REGISTRY = default_registry()
PRIMITIVES: dict[str, Any] = {
    "string": str, "long": int, "int": int, "boolean": bool, "double": float, "float": float,
    "bytes": bytes,
}

# Fields the model fills for a producer (fresh id, current time); required on the wire.
NAMED: dict[str, Any] = {}  # named Avro types seen so far, by short name
GENERATED_BY_MODEL = {("Envelope", "event_id"), ("Envelope", "event_time_ms")}


def _expected(avro: Any) -> Any:
    """The Python annotation an Avro type maps to."""
    if isinstance(avro, str):
        return PRIMITIVES.get(avro) or NAMED[avro.rsplit(".", 1)[-1]]
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        assert len(branches) == 1, "only nullable unions are used"
        return ("optional", _expected(branches[0]))
    kind = avro["type"]
    if kind == "record":
        NAMED[avro["name"].rsplit(".", 1)[-1]] = ("record", avro["name"].rsplit(".", 1)[-1])
        return NAMED[avro["name"].rsplit(".", 1)[-1]]
    if kind == "enum":
        NAMED[avro["name"].rsplit(".", 1)[-1]] = ("enum", tuple(avro["symbols"]))
        return NAMED[avro["name"].rsplit(".", 1)[-1]]
    if kind == "array":
        return ("list", _expected(avro["items"]))
    if kind == "map":
        return ("dict", _expected(avro["values"]))
    return _expected(kind)


def _actual(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        branches = [a for a in args if a is not type(None)]
        assert len(branches) == 1
        return ("optional", _actual(branches[0]))
    if origin is list:
        return ("list", _actual(args[0]))
    if origin is dict:
        assert args[0] is str
        return ("dict", _actual(args[1]))
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        return ("enum", tuple(m.value for m in annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ("record", annotation.__name__)
    return annotation


def _compare(model: type[BaseModel], avro_record: dict[str, Any]) -> None:
    avro_fields = {f["name"]: f for f in avro_record["fields"]}
    assert list(model.model_fields) == list(avro_fields), f"{model.__name__}: field names/order"
    for name, info in model.model_fields.items():
        avro_field = avro_fields[name]
        assert _actual(info.annotation) == _expected(avro_field["type"]), f"{model.__name__}.{name}"
        if "default" in avro_field:
            default = info.get_default(call_default_factory=True)
            assert default == avro_field["default"], f"{model.__name__}.{name} default"
        elif name != "header" and (model.__name__, name) not in GENERATED_BY_MODEL:
            assert info.is_required(), f"{model.__name__}.{name} should be required"
        sub = avro_field["type"]
        if isinstance(sub, list):
            sub = next(b for b in sub if b != "null")
        if isinstance(sub, dict) and sub.get("type") == "array":
            sub = sub["items"]
        if isinstance(sub, dict) and sub.get("type") == "record":
            _compare(getattr(models, sub["name"].rsplit(".", 1)[-1]), sub)


@pytest.mark.parametrize("name", REGISTRY.names)
def test_model_mirrors_schema(name: str) -> None:
    info = REGISTRY.reader(name)
    model = EVENT_MODELS[info.short_name]
    assert f"{model.NAMESPACE}.{model.KIND}" == info.name
    _compare(model, json.loads(info.canonical) | _defaults_of(name))


def test_every_schema_has_a_model_and_vice_versa() -> None:
    assert {REGISTRY.reader(n).short_name for n in REGISTRY.names} == set(EVENT_MODELS)


def _defaults_of(name: str) -> dict[str, Any]:
    # The canonical form strips defaults; compare against the .avsc source for them.
    from importlib import resources

    short = name.rsplit(".", 1)[-1]
    src = json.loads(resources.files("trajbus.schemas").joinpath(f"avro/{short}.avsc").read_text())
    env = json.loads(resources.files("trajbus.schemas").joinpath("avro/Envelope.avsc").read_text())
    src["fields"][0]["type"] = env
    return {"fields": src["fields"]}


def test_model_round_trip_through_avro() -> None:
    h = Envelope(task="t", sandbox="s", episode="e", seq=1, producer_id="p", policy_version=7)
    event = models.SchedulingDecision(
        header=h, decision=models.DecisionKind.PLACE, reason="best fit", node="n1",
        scores={"fit": 0.5, "affinity": 50.0}, cause_event_ids=["a", "b"],
    )
    assert decode_event(event.encode()) == event
