"""The rules a what-if run may change, by name, and how a change is applied to the settings.

A *rule* is a setting of a processor's core: ``watchdog.<field>`` of
:class:`~trajbus.bus.settings.WatchdogSettings` (the loop and stall rules) or
``scheduler.<field>`` of :class:`~trajbus.bus.settings.SchedulerSettings` (leases, heartbeats,
probes, drain window, placement). The names are taken from those models, so a new setting is a
new rule without a change here. A bare field name (``loop_min_repeats``) is accepted when only
one group has it.

Values are checked by the settings models themselves (and the watchdog's own rule check), so a
what-if run never runs a core with a configuration the live worker would refuse. ``*_ms``
rules also take a duration: ``90s``, ``15m``, ``2h``.

A task's ``watchdog.per_task`` overrides keep winning over a changed base rule for that task
(as they do live); change them with ``--rules FILE`` (``{"watchdog": {"per_task": {...}}}``).

The reorder stage's rules (``replay.*``) are not what-if rules: the watchdog is re-run over the
recorded replay topics, which the live reorder stage wrote with the recorded rules.
"""

from __future__ import annotations

import json
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from trajbus.bus.errors import UserError
from trajbus.bus.settings import SchedulerSettings, Settings, WatchdogSettings

__all__ = ["GROUPS", "RuleError", "Rules", "rule_names"]

#: The processors whose rules may change, and their settings models.
GROUPS: dict[str, type[BaseModel]] = {"watchdog": WatchdogSettings,
                                      "scheduler": SchedulerSettings}
_NOT_RULES = frozenset({"per_task"})  # a mapping: changed through --rules FILE only
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class RuleError(UserError, ValueError):
    """A rule name that does not exist, or a value a rule cannot take."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        UserError.__init__(self, message, hint)


def rule_names() -> list[str]:
    """Every rule a what-if run may change, ``group.field``, sorted."""
    return sorted(f"{g}.{name}" for g, model in GROUPS.items()
                  for name in model.model_fields if name not in _NOT_RULES)


def _resolve(name: str) -> tuple[str, str]:
    """(group, field) of a rule name, full or bare."""
    text = name.strip().replace("-", "_")
    if text.startswith("replay."):
        raise RuleError(f"{name!r} is a reorder rule: a what-if run cannot change it",
                        hint="the watchdog is re-run over the recorded replay topics, which "
                        "the live reorder stage wrote; change watchdog.* or scheduler.* rules")
    if "." in text:
        group, _, fname = text.partition(".")
        model = GROUPS.get(group)
        if model is not None and ((fname in model.model_fields and fname not in _NOT_RULES)
                                  or (fname == "per_task" and group == "watchdog")):
            return group, fname
    else:
        found = [g for g, model in GROUPS.items()
                 if text in model.model_fields and text not in _NOT_RULES]
        if len(found) == 1:
            return found[0], text
        if len(found) > 1:
            raise RuleError(f"rule {name!r} is ambiguous",
                            hint="write " + " or ".join(f"{g}.{text}" for g in found))
    import difflib

    close = difflib.get_close_matches(text, rule_names() + [n.split(".", 1)[1]
                                                              for n in rule_names()], n=3)
    raise RuleError(f"unknown rule {name!r}",
                    hint=(f"did you mean {', '.join(close)}? " if close else "")
                    + "rules: " + ", ".join(rule_names()))


def _coerce(group: str, fname: str, value: Any) -> Any:
    """A value from text (a flag) or a file, as the field's type wants it."""
    if not isinstance(value, str):
        return value
    annotation = GROUPS[group].model_fields[fname].annotation
    text = value.strip()
    if annotation is int and fname.endswith("_ms"):
        m = _DURATION.match(text.lower())
        if m:
            return int(float(m[1]) * _UNIT_MS[m[2]])
    if annotation is bool:
        low = text.lower()
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
    if typing.get_origin(annotation) is list:
        return [part.strip() for part in text.split(",") if part.strip()]
    if fname == "per_task":
        return json.loads(text)
    if annotation is None:
        return text
    try:
        return TypeAdapter(annotation).validate_python(text)  # "15" -> 15
    except ValidationError:
        return text  # refused by apply(), naming the rule


@dataclass(frozen=True)
class Rules:
    """Changed rules: ``{"watchdog.loop_min_repeats": 15, ...}``. Empty: the recorded rules."""

    changes: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, assignments: Iterable[str] = (), file: str | Path | None = None) -> Rules:
        """From ``NAME=VALUE`` texts (flags) on top of a JSON or TOML file of
        ``{"watchdog": {"loop_min_repeats": 15}}`` or ``{"watchdog.loop_min_repeats": 15}``."""
        raw: dict[str, Any] = {}
        if file is not None:
            raw.update(_read_file(Path(file)))
        for text in assignments:
            name, sep, value = text.partition("=")
            if not sep or not name.strip():
                raise RuleError(f"cannot read {text!r} as a rule change",
                                hint="write NAME=VALUE, e.g. watchdog.loop_min_repeats=15")
            raw[name] = value
        return cls.of(raw)

    @classmethod
    def of(cls, changes: Mapping[str, Any]) -> Rules:
        """Checked changes with full names; values converted to the rules' types."""
        out: dict[str, Any] = {}
        for name, value in changes.items():
            group, fname = _resolve(name)
            out[f"{group}.{fname}"] = _coerce(group, fname, value)
        rules = cls(out)
        rules.apply(Settings.model_construct())  # refuse a bad value now, naming the rule
        return rules

    def apply(self, settings: Settings) -> Settings:
        """``settings`` with these rules changed (a copy; ``settings`` is left alone)."""
        if not self.changes:
            return settings
        update: dict[str, Any] = {}
        for group, model in GROUPS.items():
            mine = {k.split(".", 1)[1]: v for k, v in self.changes.items()
                    if k.startswith(group + ".")}
            if not mine:
                continue
            current = getattr(settings, group, None) or model()
            try:
                new = model.model_validate({**current.model_dump(), **mine})
                if isinstance(new, WatchdogSettings):
                    new.rule_values()
            except (ValidationError, ValueError) as exc:
                raise RuleError(f"invalid {group} rule: {_short(exc)}",
                                hint="values: " + ", ".join(
                                    f"{group}.{k}={v!r}" for k, v in mine.items())) from None
            update[group] = new
        return settings.model_copy(update=update)

    def describe(self, settings: Settings) -> list[tuple[str, Any, Any]]:
        """(rule, recorded value, what-if value) for each changed rule."""
        out = []
        for name, value in sorted(self.changes.items()):
            group, fname = name.split(".", 1)
            out.append((name, getattr(getattr(settings, group), fname), value))
        return out


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                         for e in exc.errors())
    return str(exc)


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise RuleError(f"cannot read rules file {path}: {exc}",
                        hint='JSON like {"watchdog": {"loop_min_repeats": 15}} or TOML with '
                        "a [watchdog] table") from None
    if not isinstance(data, dict):
        raise RuleError(f"rules file {path} must hold an object of rules")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat
