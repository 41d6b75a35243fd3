"""``replay explain``: re-run the processor adapters (``SchedulerProcessor`` and, when it
exists, ``WatchdogProcessor``) over the log, collect what they derive for a sandbox, and compare
it with what was recorded on ``Topics.decisions`` / ``Topics.alerts``.

Replay order (an approximation, documented)
-------------------------------------------
---------------------------------------------------------------
Each processor is re-run over exactly the input records its consumer group has committed (what
the live worker has processed, so records that arrived after it stopped are not counted
against it); a processor whose group has committed nothing is not re-run, and its recorded
outputs are listed as ``unchecked``.
A live processor sees its input partitions interleaved in whatever order the fetches returned.
That order is not recorded anywhere, so the re-run merges the partitions by **record
timestamp** (each partition stays in offset order; ties go to the topic listed first, then the
lower partition). This is the best available approximation of the live order. The scheduler
core is built to be insensitive to it for deadline-driven decisions (decisions are stamped with
their deadline, event ids are uuid5 of the decision's identity), so reproduced decisions match
recorded ones by event id; divergences point at either a real nondeterminism, an input lost to
retention, a state restored from a different log, or an out-of-band write to the outputs.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiokafka import TopicPartition

from trajbus.bus.errors import NotFoundError, existing
from trajbus.bus.kafka import check_broker
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.consumers.operator.reads import (
    _decode_all,
    group_offsets,
    merge_by_timestamp,
    read_records,
)
from trajbus.consumers.operator.timeline import (
    TimelineEntry,
    _iso,
    _jsonable,
    entry_from_decoded,
    humanize,
    short_id,
)
from trajbus.schemas.codec import Decoded, default_codec


@dataclass(frozen=True, slots=True)
class DerivedRecord:
    """A scheduling decision or watchdog alert, recorded or reproduced."""

    event_id: str
    kind: str  # SchedulingDecision | WatchdogAlert
    label: str  # the decision or alert kind (RECLAIM, LOOP, ...)
    time_ms: int
    reason: str
    producer_id: str
    record: dict[str, Any] = field(repr=False)
    log_time_ms: int = -1
    """When it was written (recorded) or when its triggering input was written (reproduced)."""

    @property
    def cause_event_ids(self) -> list[str]:
        return list(self.record.get("cause_event_ids") or [])

    def comparable(self) -> dict[str, Any]:
        """The record without fields allowed to differ between runs (producer id, and the
        scheduler's global decision counter ``header.seq``)."""
        d = dict(self.record)
        d["header"] = {k: v for k, v in self.record["header"].items()
                       if k not in ("producer_id", "seq")}
        return d

    @classmethod
    def from_decoded(cls, d: Decoded, log_time_ms: int = -1) -> DerivedRecord:
        r = d.record
        label = r.get("decision") or r.get("alert") or d.kind
        return cls(event_id=str(r["header"]["event_id"]), kind=d.kind, label=str(label),
                   time_ms=int(r["header"]["event_time_ms"]), reason=str(r.get("reason", "")),
                   producer_id=str(r["header"]["producer_id"]), record=r,
                   log_time_ms=log_time_ms)


Status = Literal["reproduced", "recorded_only", "reproduced_only", "differs", "unchecked"]


@dataclass(frozen=True, slots=True)
class ExplainedItem:
    """One decision/alert about the sandbox with the events that caused it."""

    derived: DerivedRecord
    status: Status
    causes: tuple[TimelineEntry, ...]
    unresolved_causes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.derived.event_id, "kind": self.derived.kind,
            "label": self.derived.label, "time": _iso(self.derived.time_ms),
            "time_ms": self.derived.time_ms, "written_ms": self.derived.log_time_ms,
            "reason": self.derived.reason,
            "producer_id": self.derived.producer_id, "status": self.status,
            "record": _jsonable(self.derived.record, False),
            "causes": [c.to_dict() for c in self.causes],
            "unresolved_causes": list(self.unresolved_causes),
        }


@dataclass(frozen=True, slots=True)
class Divergence:
    kind: Literal["recorded_not_reproduced", "reproduced_not_recorded", "content_differs"]
    event_id: str
    summary: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "event_id": self.event_id, "summary": self.summary,
                "detail": self.detail}


@dataclass
class Explanation:
    """What the processors decided about a sandbox, why, and whether a re-run agrees."""

    sandbox: str
    items: list[ExplainedItem]
    divergences: list[Divergence]
    notes: list[str]
    processors: list[str]
    inputs_read: dict[str, int]

    @property
    def consistent(self) -> bool:
        return not self.divergences

    def to_dict(self) -> dict[str, Any]:
        return {
            "sandbox": self.sandbox, "consistent": self.consistent,
            "processors": self.processors, "inputs_read": self.inputs_read,
            "items": [i.to_dict() for i in self.items],
            "divergences": [d.to_dict() for d in self.divergences], "notes": self.notes,
        }

    def render(self) -> str:
        """Each decision/alert as cause -> effect, in the order they happened (when they were
        written to Kafka; a decision citing another comes after it), with human times and
        short ids (``--json`` has the whole ids and epoch ms)."""
        lines = [f"sandbox {self.sandbox}: {len(self.items)} decisions/alerts, causes before "
                 f"effects; re-ran {', '.join(self.processors) or 'nothing'} over "
                 f"{sum(self.inputs_read.values())} input records"]
        day = _day(_when(self.items[0].derived)) if self.items else None
        if day:
            lines.append(f"times: when written to Kafka, UTC, {day}; ids: first 8 characters")
        for it in self.items:
            d = it.derived
            lines.append("")
            lines.append(f"{_clock(_when(d), day)}  {d.label} by "
                         f"{d.producer_id.removeprefix('trajbus.')} [{it.status}]  id "
                         f"{short_id(d.event_id)}")
            for c in sorted(it.causes, key=lambda c: (_entry_when(c), c.seq)):
                where = f"{c.episode}#{c.seq}" if c.episode is not None else f"sandbox#{c.seq}"
                lines.append(f"    cause   {_clock(_entry_when(c), day)}  {c.kind:<17} "
                             f"{where:<14} {humanize(c.summary)}  (id {short_id(c.event_id)})")
            for cid in it.unresolved_causes:
                lines.append(f"    cause   {'?':<12}  id {short_id(cid)} (not found in the log "
                             "read)")
            lines.append(f"    effect  {humanize(d.reason)}")
        lines.append("")
        if self.divergences:
            lines.append(f"DIVERGENCES ({len(self.divergences)}):")
            for dv in self.divergences:
                lines.append(f"  {dv.kind}: {short_id(dv.event_id)} {humanize(dv.summary)}"
                             + (f" ({dv.detail})" if dv.detail else ""))
        else:
            lines.append("no divergence: every recorded decision/alert was reproduced, "
                         "and nothing else")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _when(d: DerivedRecord) -> int:
    return d.log_time_ms if d.log_time_ms >= 0 else d.time_ms


def _entry_when(e: TimelineEntry) -> int:
    return e.log_time_ms if e.log_time_ms >= 0 else e.time_ms


def _day(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d")


def _clock(ms: int, day: str | None) -> str:
    """``22:33:31.695`` (with the date in front when it is not ``day``)."""
    t = datetime.fromtimestamp(ms / 1000, tz=UTC)
    text = t.strftime("%H:%M:%S.") + f"{t.microsecond // 1000:03d}"
    return text if _day(ms) == day else f"{_day(ms)} {text}"


def causal_order(items: Sequence[ExplainedItem]) -> list[ExplainedItem]:
    """Items by the time they were written, except that an item citing another (its
    ``cause_event_ids``) always comes after it."""
    by_time = sorted(items, key=lambda it: (_when(it.derived), it.derived.event_id))
    ids = {it.derived.event_id: it for it in by_time}
    out: list[ExplainedItem] = []
    placed: set[str] = set()

    def place(it: ExplainedItem, visiting: set[str]) -> None:
        eid = it.derived.event_id
        if eid in placed or eid in visiting:
            return
        visiting.add(eid)
        for cid in it.derived.cause_event_ids:
            if cid in ids:
                place(ids[cid], visiting)
        placed.add(eid)
        out.append(it)

    for it in by_time:
        place(it, set())
    return out


@dataclass
class _Rerun:
    name: str
    input_topics: list[str]
    pattern: str | None
    factory: Callable[[], Any]
    global_state: bool


def _reruns(settings: Settings, notes: list[str]) -> list[_Rerun]:
    from trajbus.consumers.engine import processors

    out = []
    sspec = processors.scheduler_spec(settings)
    out.append(_Rerun("scheduler", sspec.input_topics, sspec.input_pattern, sspec.factory,
                      sspec.global_state))
    wspec_fn = getattr(processors, "watchdog_spec", None)
    wcls = getattr(processors, "WatchdogProcessor", None)
    if wspec_fn is not None:
        w = wspec_fn(settings)
        out.append(_Rerun("watchdog", w.input_topics, w.input_pattern, w.factory,
                          w.global_state))
    elif wcls is not None:
        out.append(_Rerun("watchdog", Topics(settings).input_topics, None,
                          lambda: wcls(settings), False))
    else:
        notes.append("watchdog not re-run: trajbus.consumers.engine.processors has no "
                     "WatchdogProcessor yet; recorded watchdog alerts/decisions are listed "
                     "as 'unchecked'")
    return out


def processor_inputs(input_topics: Sequence[str], pattern: str | None,
                     parts: dict[TopicPartition, list[InRecord]],
                     upto: dict[TopicPartition, int] | None = None
                     ) -> dict[TopicPartition, list[InRecord]]:
    """The partitions of ``parts`` a processor reads (its input topics and the topics matching
    its pattern), cut to the records below ``upto`` (a group's committed offsets: what the
    live group processed) when given."""
    mine = {tp: recs for tp, recs in parts.items()
            if tp.topic in input_topics or (pattern is not None and re.match(pattern, tp.topic))}
    if upto is None:
        return mine
    return {tp: [r for r in recs if r.offset < upto.get(tp, 0)] for tp, recs in mine.items()}


def feed_processor(factory: Callable[[], Any], global_state: bool,
                   records: Iterable[InRecord],
                   on_record: Callable[[int], None] | None = None
                   ) -> list[tuple[OutRecord, int]]:
    """Feed one processor kind a merged log exactly as the runner would: one adapter for every
    partition (global) or one per partition number (as ``Runner._slot`` does). Returns each
    output with the log time of the record that produced it. ``on_record(n)`` is called every
    4096 records (progress)."""
    cores: dict[int, Any] = {}
    outs: list[tuple[OutRecord, int]] = []
    n = 0
    for rec in records:
        slot = 0 if global_state else rec.partition
        core = cores.get(slot)
        if core is None:
            core = cores[slot] = factory()
        outs.extend((out, rec.timestamp_ms) for out in core.handle(rec))
        n += 1
        if on_record is not None and not n & 4095:
            on_record(n)
    return outs


def _run_adapter(run: _Rerun, parts: dict[TopicPartition, list[InRecord]],
                 upto: dict[TopicPartition, int]) -> list[tuple[OutRecord, int]]:
    """Feed one processor kind the merged log (:func:`merge_by_timestamp`) up to ``upto``."""
    mine = processor_inputs(run.input_topics, run.pattern, parts, upto)
    return feed_processor(run.factory, run.global_state,
                          merge_by_timestamp(mine, run.input_topics))


async def explain(settings: Settings, sandbox: str, *, timeout_s: float = 300.0) -> Explanation:
    """Re-run the scheduler (and the watchdog, when present) over the whole log, keep what they
    derive about ``sandbox`` and compare it by event id with ``Topics.decisions`` and
    ``Topics.alerts``. Reads every input of those processors (the scheduler is global: one
    sandbox's decisions depend on the fleet), so it costs a full read of the retained log."""
    await check_broker(settings.kafka)
    topics = Topics(settings)
    codec = default_codec()
    notes = ["replay order: partitions merged by record timestamp (each partition in offset "
             "order), the best available approximation of the live consumption order"]
    runs = _reruns(settings, notes)
    wanted = list(dict.fromkeys(t for r in runs for t in r.input_topics))
    pattern = "|".join(f"(?:{r.pattern})" for r in runs if r.pattern) or None
    parts, recorded_parts = await asyncio.gather(
        read_records(settings, wanted, pattern=pattern, timeout_s=timeout_s),
        read_records(settings, [topics.decisions, topics.alerts], timeout_s=timeout_s),
    )
    inputs_read: dict[str, int] = defaultdict(int)
    for tp, recs in parts.items():
        inputs_read[tp.topic] += len(recs)

    # every input event, by id, for resolving causes
    index: dict[str, TimelineEntry] = {}
    for tp in sorted(parts, key=lambda tp: (tp.topic, tp.partition)):
        for rec, d in _decode_all(parts[tp], codec):
            eid = d.header.get("event_id")
            if isinstance(eid, str) and eid not in index:
                index[eid] = entry_from_decoded(d, rec)

    reproduced: dict[str, DerivedRecord] = {}
    ran: set[str] = set()
    for run in runs:
        group = f"{settings.topics.prefix}.{run.name}"
        upto = await group_offsets(settings, group)
        if not upto:
            notes.append(f"{run.name}: not re-run, its consumer group {group} has committed "
                         "nothing (the processor has not run); its recorded outputs, if any, "
                         "are listed as 'unchecked'")
            continue
        ran.add(run.name)
        notes.append(f"{run.name}: re-ran over the input records up to the offsets group "
                     f"{group} has committed, i.e. what the live worker has processed")
        for out, log_time in _run_adapter(run, parts, upto):
            if out.topic not in (topics.decisions, topics.alerts):
                continue
            dr = DerivedRecord.from_decoded(codec.decode(out.value), log_time)
            if dr.record["header"]["sandbox"] == sandbox:
                reproduced.setdefault(dr.event_id, dr)

    recorded: dict[str, DerivedRecord] = {}
    for tp in sorted(recorded_parts, key=lambda tp: (tp.topic, tp.partition)):
        for rec, d in _decode_all(recorded_parts[tp], codec):
            if d.kind in ("SchedulingDecision", "WatchdogAlert") \
                    and d.header.get("sandbox") == sandbox:
                dr = DerivedRecord.from_decoded(d, rec.timestamp_ms)
                recorded.setdefault(dr.event_id, dr)

    skipped = ({r.name for r in runs} - ran) | ({"watchdog"} if len(runs) == 1 else set())
    items: list[ExplainedItem] = []
    divergences: list[Divergence] = []
    for eid in sorted(set(recorded) | set(reproduced),
                      key=lambda i: ((recorded.get(i) or reproduced[i]).time_ms, i)):
        rec_d, rep_d = recorded.get(eid), reproduced.get(eid)
        status: Status
        if rec_d is not None and rep_d is not None:
            status = "reproduced"
            if rec_d.comparable() != rep_d.comparable():
                status = "differs"
                divergences.append(Divergence(
                    "content_differs", eid, f"{rec_d.label} at {_iso(rec_d.time_ms)}",
                    "same event id, different content"))
        elif rec_d is not None:
            status = "recorded_only"
            if rec_d.producer_id.removeprefix("trajbus.") in skipped:
                status = "unchecked"
            else:
                divergences.append(Divergence(
                    "recorded_not_reproduced", eid,
                    f"{rec_d.label} at {_iso(rec_d.time_ms)} by {rec_d.producer_id}: "
                    f"{rec_d.reason}"))
        else:
            assert rep_d is not None
            status = "reproduced_only"
            divergences.append(Divergence(
                "reproduced_not_recorded", eid,
                f"{rep_d.label} at {_iso(rep_d.time_ms)}: {rep_d.reason}"))
        derived = rec_d or rep_d
        assert derived is not None
        causes, unresolved = _causes(derived, index)
        items.append(ExplainedItem(derived, status, tuple(causes), tuple(unresolved)))
    if not items and not any(e.sandbox == sandbox for e in index.values()):
        raise NotFoundError(f"no events of sandbox {sandbox!r} in the processors' inputs "
                            "and no decision or alert about it",
                            hint=existing("sandboxes", {e.sandbox for e in index.values()
                                                        if e.kind != "Tick"}))
    return Explanation(sandbox, causal_order(items), divergences, notes, sorted(ran),
                       dict(inputs_read))


def _causes(d: DerivedRecord, index: dict[str, TimelineEntry]
            ) -> tuple[list[TimelineEntry], list[str]]:
    found, missing = [], []
    for cid in dict.fromkeys(d.cause_event_ids):
        if cid in index:
            found.append(index[cid])
        else:
            missing.append(cid)
    if d.kind == "WatchdogAlert":  # alerts cite their evidence by seq range, not by id
        h = d.record["header"]
        lo, hi = d.record.get("first_seq", -1), d.record.get("last_seq", -1)
        found.extend(sorted(
            (e for e in index.values()
             if e.sandbox == h["sandbox"] and e.episode == h.get("episode")
             and e.seq in (lo, hi) and e.kind in ("ToolCall", "ToolResult")),
            key=lambda e: (e.seq, e.kind)))
    return found, missing
