"""The difference between two runs over the same log, per sandbox.

Outputs are matched per *slot* = (sandbox, episode, processor, label): the watchdog's LOOP
alerts of one episode, the scheduler's RECLAIM decisions of one sandbox, and so on. Within a
slot, outputs with the same event id pair first (the watchdog's ids name the loop's evidence,
the scheduler's the decision's identity, so the same loop caught later keeps its id), then the
rest pair in time order; a pair whose event time or seq differs has *moved*, an output left
without a partner was *added* (only the changed rules decide it) or *removed* (only the
recorded rules do). Pairs at the same event time and seq (the watchdog's: the input event's;
the scheduler's header seq is a decision counter and is not compared) are unchanged, whatever
their reason text says (it quotes the thresholds).

Time to detect, for a LOOP alert: its ``span_ms``, how long the repetition had lasted (event
time) when the rule fired. A moved LOOP's delta is the changed rules' minus the recorded
rules' (negative: caught sooner).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from trajbus.consumers.operator.tools import DerivedRecord
from trajbus.consumers.whatif.run import SelfCheck
from trajbus.consumers.whatif.source import LogFilter

__all__ = ["Change", "Diff", "SandboxDiff", "diff_runs"]

ChangeKind = Literal["added", "removed", "moved"]


@dataclass(frozen=True)
class Change:
    """One decision or alert that the changed rules add, remove or move."""

    change: ChangeKind
    before: DerivedRecord | None  # the recorded rules' output
    after: DerivedRecord | None  # the changed rules' output

    @property
    def ref(self) -> DerivedRecord:
        d = self.after or self.before
        assert d is not None
        return d

    @property
    def sandbox(self) -> str:
        return str(self.ref.record["header"]["sandbox"])

    @property
    def task(self) -> str:
        return str(self.ref.record["header"]["task"])

    @property
    def episode(self) -> str | None:
        return self.ref.record["header"].get("episode")

    @property
    def processor(self) -> str:
        return self.ref.producer_id.removeprefix("trajbus.")

    @property
    def label(self) -> str:
        return self.ref.label

    @property
    def kind(self) -> str:
        return "alert" if self.ref.kind == "WatchdogAlert" else "decision"

    @property
    def time_ms(self) -> int:
        return self.ref.time_ms

    @property
    def shift_ms(self) -> int | None:
        """Event-time shift of a moved output (changed minus recorded; negative: sooner)."""
        if self.before is None or self.after is None:
            return None
        return self.after.time_ms - self.before.time_ms

    @staticmethod
    def _seq(d: DerivedRecord | None) -> int | None:
        """The seq of the input event behind a watchdog output (the scheduler's header seq is
        its decision counter, not an input position: None)."""
        return None if d is None or not _has_seq(d) else int(d.record["header"]["seq"])

    @staticmethod
    def _detect(d: DerivedRecord | None) -> int | None:
        if d is None or d.kind != "WatchdogAlert" or d.label != "LOOP":
            return None
        return int(d.record.get("span_ms", 0))

    @property
    def seq_before(self) -> int | None:
        return self._seq(self.before)

    @property
    def seq_after(self) -> int | None:
        return self._seq(self.after)

    @property
    def detect_before_ms(self) -> int | None:
        """Time to detect (LOOP alerts): how long the loop had lasted when it was caught."""
        return self._detect(self.before)

    @property
    def detect_after_ms(self) -> int | None:
        return self._detect(self.after)

    @property
    def detect_delta_ms(self) -> int | None:
        a, b = self.detect_before_ms, self.detect_after_ms
        return None if a is None or b is None else b - a

    def to_dict(self) -> dict[str, Any]:
        def side(d: DerivedRecord | None) -> dict[str, Any] | None:
            if d is None:
                return None
            out = {"event_id": d.event_id, "seq": Change._seq(d),
                   "time_ms": d.time_ms, "log_time_ms": d.log_time_ms, "reason": d.reason}
            if d.kind == "WatchdogAlert":
                out.update({k: d.record.get(k) for k in
                            ("first_seq", "last_seq", "repeat_count", "span_ms")})
            return out

        return {"change": self.change, "sandbox": self.sandbox, "task": self.task,
                "episode": self.episode, "processor": self.processor, "kind": self.kind,
                "label": self.label, "time_ms": self.time_ms, "shift_ms": self.shift_ms,
                "detect_before_ms": self.detect_before_ms,
                "detect_after_ms": self.detect_after_ms,
                "detect_delta_ms": self.detect_delta_ms,
                "before": side(self.before), "after": side(self.after)}


@dataclass
class SandboxDiff:
    sandbox: str
    task: str
    changes: list[Change]

    def counts(self) -> dict[str, int]:
        c = Counter(ch.change for ch in self.changes)
        return {k: c.get(k, 0) for k in ("added", "removed", "moved")}

    def to_dict(self) -> dict[str, Any]:
        return {"sandbox": self.sandbox, "task": self.task, **self.counts(),
                "changes": [c.to_dict() for c in self.changes]}


@dataclass
class Diff:
    """What the changed rules would have decided differently, per sandbox, with the
    self-check of the recorded rules first."""

    rules: list[tuple[str, Any, Any]]  # (rule, recorded value, what-if value)
    where: LogFilter
    self_check: SelfCheck
    sandboxes: list[SandboxDiff]
    unchanged: int
    compared_sandboxes: int
    inputs: dict[str, int] = field(default_factory=dict)
    events: int = 0
    seconds: float = 0.0

    @property
    def changes(self) -> list[Change]:
        return [c for s in self.sandboxes for c in s.changes]

    @property
    def empty(self) -> bool:
        return not self.sandboxes

    def totals(self) -> dict[str, Any]:
        """Counts per change and per (change, label); the moved outputs' mean shift and the
        moved LOOP alerts' mean time-to-detect delta (ms, None when there is none)."""
        changes = self.changes
        by = Counter(c.change for c in changes)
        labels: dict[str, dict[str, int]] = defaultdict(dict)
        for (kind, label), n in sorted(Counter((c.change, c.label) for c in changes).items()):
            labels[kind][label] = n
        shifts = [c.shift_ms for c in changes if c.shift_ms is not None]
        detect = [c.detect_delta_ms for c in changes if c.detect_delta_ms is not None]
        return {
            "added": by.get("added", 0), "removed": by.get("removed", 0),
            "moved": by.get("moved", 0), "unchanged": self.unchanged,
            "sandboxes_changed": len(self.sandboxes),
            "sandboxes_compared": self.compared_sandboxes,
            "by_label": dict(labels),
            "mean_shift_ms": round(sum(shifts) / len(shifts)) if shifts else None,
            "mean_detect_delta_ms": round(sum(detect) / len(detect)) if detect else None,
        }

    def to_dict(self) -> dict[str, Any]:
        w = self.where
        return {
            "rules": [{"rule": n, "recorded": a, "whatif": b} for n, a, b in self.rules],
            "where": {"task": w.task, "sandbox": w.sandbox, "from_ms": w.from_ms,
                      "to_ms": w.to_ms},
            "self_check": self.self_check.to_dict(), "totals": self.totals(),
            "inputs": self.inputs, "events": self.events,
            "sandboxes": [s.to_dict() for s in self.sandboxes],
        }


def _slot(d: DerivedRecord) -> tuple[str, str, str, str]:
    h = d.record["header"]
    return (str(h["sandbox"]), h.get("episode") or "", d.producer_id, d.label)


def _has_seq(d: DerivedRecord) -> bool:
    return d.producer_id == "trajbus.watchdog"


def _position(d: DerivedRecord) -> tuple[int, int]:
    return (d.time_ms, int(d.record["header"]["seq"]) if _has_seq(d) else 0)


def diff_runs(before: Iterable[DerivedRecord], after: Iterable[DerivedRecord],
              where: LogFilter, *, rules: list[tuple[str, Any, Any]], self_check: SelfCheck,
              inputs: dict[str, int] | None = None, events: int = 0,
              seconds: float = 0.0) -> Diff:
    """The :class:`Diff` of two runs' outputs (each deduplicated by event id), within
    ``where``."""
    slots: dict[tuple[str, str, str, str], tuple[list[DerivedRecord], list[DerivedRecord]]]
    slots = defaultdict(lambda: ([], []))
    for side, outs in enumerate((before, after)):
        seen: set[str] = set()
        for d in outs:
            if d.event_id in seen or not where.matches(d.record["header"]):
                continue
            seen.add(d.event_id)
            slots[_slot(d)][side].append(d)
    changes: dict[str, list[Change]] = defaultdict(list)
    tasks: dict[str, str] = {}
    unchanged = 0
    for key in sorted(slots):
        a, b = slots[key]
        tasks.setdefault(key[0], str((a or b)[0].record["header"]["task"]))
        b_ids = {d.event_id: d for d in b}
        rest_a, paired = [], set()
        pairs: list[tuple[DerivedRecord, DerivedRecord]] = []
        for d in a:
            twin = b_ids.get(d.event_id)
            if twin is not None:
                pairs.append((d, twin))
                paired.add(d.event_id)
            else:
                rest_a.append(d)
        rest_b = [d for d in b if d.event_id not in paired]
        rest_a.sort(key=_position)
        rest_b.sort(key=_position)
        n = min(len(rest_a), len(rest_b))
        pairs.extend(zip(rest_a[:n], rest_b[:n], strict=True))
        for x, y in pairs:
            if _position(x) == _position(y):
                unchanged += 1
            else:
                changes[key[0]].append(Change("moved", x, y))
        changes[key[0]].extend(Change("removed", d, None) for d in rest_a[n:])
        changes[key[0]].extend(Change("added", None, d) for d in rest_b[n:])
    sandboxes = [SandboxDiff(sb, tasks[sb], sorted(cs, key=lambda c: (c.time_ms, c.label)))
                 for sb, cs in sorted(changes.items()) if cs]
    return Diff(rules, where, self_check, sandboxes, unchanged, len(tasks), inputs or {},
                events, seconds)
