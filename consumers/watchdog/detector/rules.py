"""The loop rule's thresholds for one task: the global settings with the task's overrides,
and the cycle layout they imply."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trajbus.bus.settings import WatchdogSettings

from ..canonical import Canonicalizer, canonicalizer


@dataclass(frozen=True, slots=True)
class LoopRules:
    """Effective thresholds for one task (WatchdogSettings + per-task overrides)."""

    loop_min_repeats: int
    loop_min_span_ms: int
    loop_max_distinct_results: int
    max_cycle_length: int
    stall_after_ms: int
    dry_run: bool
    ignore_fields: frozenset[str]
    canon: Canonicalizer = field(repr=False, compare=False)
    # (L, window offset, calls needed) for L = 1..max_cycle_length
    cycles: tuple[tuple[int, int, int], ...] = field(repr=False, compare=False)
    win_size: int = field(repr=False, compare=False)
    ring_len: int = field(repr=False, compare=False)  # calls remembered: max_cycle_length + 1
    # ``search`` of a regex that may match an ignored member name, or None (no ignore set)
    detect: Callable[[str], Any] | None = field(repr=False, compare=False)

    @classmethod
    def build(cls, base: WatchdogSettings, overrides: Mapping[str, Any] | None) -> LoopRules:
        values = base.rule_values(dict(overrides) if overrides else None)
        m = values["max_cycle_length"]
        ignore = frozenset(values["ignore_fields"])
        cycles = []
        off = 0
        for length in range(1, m + 1):
            cycles.append((length, off, length * values["loop_min_repeats"]))
            off += 1
        return cls(
            loop_min_repeats=values["loop_min_repeats"],
            loop_min_span_ms=values["loop_min_span_ms"],
            loop_max_distinct_results=values["loop_max_distinct_results"],
            max_cycle_length=m,
            stall_after_ms=values["stall_after_ms"],
            dry_run=bool(values["dry_run"]),
            ignore_fields=ignore,
            canon=canonicalizer(ignore),
            cycles=tuple(cycles),
            win_size=off,
            ring_len=m + 1,
            detect=canonicalizer(ignore).detector,
        )


