"""Where to start reading a topic, and times as people write them.

A start position is one of

* ``"earliest"`` / ``"beginning"``: the first retained record of each partition;
* ``"latest"`` / ``"end"``: only records written from now on;
* a point in time: an aware :class:`~datetime.datetime`, epoch milliseconds (``int``), an
  ISO-8601 string (``2026-11-30T10:00``, UTC when it has no zone) or a time relative to now
  (``-1h``, ``-30m``, ``-2d``, ``-90s``; the ``-`` is optional): the first record whose Kafka
  timestamp is at or after it (``offsets_for_times``), the end for a partition with none;
* ``"resume"`` (only where a consumer group exists): the group's committed offsets.

:func:`resolve_offsets` turns one into an offset per partition.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from trajbus.bus.errors import InvalidValueError, UserError

StartPosition = Literal["earliest", "latest", "resume"] | datetime | int | str

_RELATIVE = re.compile(r"^-?\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
            "w": 7 * 86_400_000}
_ALIASES = {"beginning": "earliest", "earliest": "earliest", "start": "earliest",
            "end": "latest", "latest": "latest", "now": "latest", "resume": "resume"}

TIME_HELP = ("ISO-8601 (UTC if no zone, e.g. 2026-11-30T10:00), epoch milliseconds, or "
             "relative to now: -90s, -30m, -1h, -2d")


def now_ms() -> int:
    return int(time.time() * 1000)


def parse_time(value: str | int | datetime, now: int | None = None) -> int:
    """Epoch milliseconds of a time written as :data:`TIME_HELP` says. ``1h`` and ``-1h`` both
    mean one hour ago (``--since 1h``). Raises :class:`InvalidValueError` (a ValueError) for
    anything else."""
    if isinstance(value, datetime):
        dt = value if value.tzinfo else value.replace(tzinfo=UTC)
        return int(dt.timestamp() * 1000)
    if isinstance(value, int):
        return value
    text = value.strip()
    m = _RELATIVE.match(text.lower())
    if m:
        return (now_ms() if now is None else now) - int(float(m[1]) * _UNIT_MS[m[2]])
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidValueError(f"cannot read {value!r} as a time", hint=TIME_HELP) from None
    return parse_time(dt)


def parse_start(value: StartPosition) -> Literal["earliest", "latest", "resume"] | int:
    """``"earliest"``, ``"latest"``, ``"resume"`` or epoch ms, from what a user wrote."""
    if isinstance(value, str) and value.strip().lower() in _ALIASES:
        return _ALIASES[value.strip().lower()]  # type: ignore[return-value]
    try:
        return parse_time(value)
    except UserError:
        raise InvalidValueError(f"unknown start position {value!r}",
                                hint="earliest (or beginning), latest (or end), resume, or a "
                                f"time: {TIME_HELP}") from None


async def resolve_offsets(consumer: Any, tps: Iterable[Any],
                          start: Literal["earliest", "latest"] | int) -> dict[Any, int]:
    """The offset to start each partition at, with an aiokafka consumer (whose isolation level
    decides what "end" means: the last stable offset under ``read_committed``)."""
    tps = list(tps)
    if not tps:
        return {}
    if start == "earliest":
        return dict(await consumer.beginning_offsets(tps))
    end = await consumer.end_offsets(tps)
    if start == "latest":
        return dict(end)
    found = await consumer.offsets_for_times(dict.fromkeys(tps, int(start)))
    return {tp: (found[tp].offset if found.get(tp) is not None else end[tp]) for tp in tps}


def iso(ms: int) -> str:
    """``2026-11-30T10:00:00.123Z``."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def duration(ms: float) -> str:
    """A duration for people: ``850 ms``, ``12.5 s``, ``4m 05s``, ``2h 03m``, ``3d 4h``."""
    ms = float(ms)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    if ms < 1000:
        return f"{sign}{ms:.0f} ms"
    s = ms / 1000
    if s < 60:
        return f"{sign}{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{sign}{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{sign}{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{sign}{d}d {h}h"


def ago(ms: int, now: int | None = None) -> str:
    """``5m 03s ago`` / ``in 12.0 s``, relative to ``now`` (default: the clock)."""
    delta = (now_ms() if now is None else now) - ms
    return f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"
