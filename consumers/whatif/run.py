"""Running the processors over a recorded log, with given settings, and checking a run against
what was recorded.

The cores are run through the very adapters the live worker uses
(:mod:`trajbus.consumers.engine.processors`), fed as ``trajbus replay explain`` feeds them
(:func:`~trajbus.consumers.operator.tools.feed_processor`: partitions merged by record
timestamp, each in offset order; one watchdog per partition number, one global scheduler):

1. the watchdog over the recorded replay topics (the reorder stage's output) and its ticks;
2. the scheduler over its inputs -- lifecycle, heartbeats, probes, node reports, requests,
   replay progress (its own reorder core puts each sandbox's stream back in order) and the
   watchdog's alerts.

Step 2 reads the alerts topic. With the recorded rules it reads the recorded alerts, exactly as
the live scheduler did. With changed rules the watchdog's alerts change, so the scheduler is
given :func:`substitute_alerts`: the recorded alerts the changed watchdog no longer raises are
taken out, and the ones it newly raises are put in at the log time of the replay record that
triggered them (the live watchdog wrote its alerts some milliseconds later; that latency is not
modelled). A scheduler that had not yet processed a log time is not given alerts after it.

Each processor is re-run only over the input its live consumer group had committed
(:class:`~trajbus.consumers.whatif.source.RecordedLog`), so the recorded run and the re-run saw
the same records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.runner import InRecord
from trajbus.consumers.operator.tools import (
    DerivedRecord,
    feed_processor,
    merge_by_timestamp,
    processor_inputs,
)
from trajbus.consumers.whatif.source import PROCESSORS, LogFilter, RecordedLog
from trajbus.schemas.codec import DecodeError, default_codec

__all__ = ["Mismatch", "PipelineRun", "SelfCheck", "run_pipeline", "self_check",
           "substitute_alerts"]

Progress = Callable[[str, int, int], None]
"""``progress(stage, records done, records in the stage)``."""

_SYNTHETIC_PARTITION = 1_000_000  # where substituted alerts go (never a real partition)


@dataclass
class PipelineRun:
    """What one run derived: every decision and alert, with the log time of the input record
    that produced it, in production order; and how much it read."""

    outputs: list[DerivedRecord]
    records: dict[str, int] = field(default_factory=dict)  # per processor: input records fed
    events: int = 0  # events fed to the cores (a replay segment counts its events)
    seconds: float = 0.0  # CPU time spent in the cores and adapters

    def by_producer(self, processor: str) -> list[DerivedRecord]:
        return [d for d in self.outputs if d.producer_id == f"trajbus.{processor}"]

    def plus(self, other: PipelineRun) -> PipelineRun:
        """This run's outputs and counts followed by ``other``'s (the next stage)."""
        return PipelineRun(self.outputs + other.outputs, {**self.records, **other.records},
                           self.events + other.events, self.seconds + other.seconds)


def run_pipeline(log: RecordedLog, settings: Settings, *,
                 scheduler_alerts: dict[TopicPartition, list[InRecord]] | None = None,
                 only: Iterable[str] = PROCESSORS,
                 progress: Progress | None = None) -> PipelineRun:
    """Re-run the watchdog, then the scheduler (those of them in ``only``), over ``log`` with
    ``settings``' rules. ``scheduler_alerts``: the alerts topic's partitions to give the
    scheduler instead of the recorded ones (:func:`substitute_alerts`)."""
    from trajbus.consumers.engine import processors

    topics = Topics(settings)
    codec = default_codec()
    run = PipelineRun([])
    started = time.process_time()
    wanted = set(only)
    for name in (p for p in PROCESSORS if p in wanted):
        spec = (processors.watchdog_spec(settings) if name == "watchdog"
                else processors.scheduler_spec(settings))
        mine = processor_inputs(spec.input_topics, spec.input_pattern, log.inputs,
                                log.upto(name))
        if name == "scheduler" and scheduler_alerts is not None:
            mine = {tp: recs for tp, recs in mine.items() if tp.topic != topics.alerts}
            mine.update(scheduler_alerts)
        total = sum(len(v) for v in mine.values())
        if name == "watchdog":
            run.events += _events_in(mine, codec)
        else:
            run.events += total
        run.records[name] = total
        report = None
        if progress is not None:
            def report(n: int, name: str = name, total: int = total) -> None:
                progress(name, n, total)
        outs = feed_processor(spec.factory, spec.global_state,
                              merge_by_timestamp(mine, spec.input_topics), report)
        if progress is not None:
            progress(name, total, total)
        for out, log_time in outs:
            if out.topic not in (topics.decisions, topics.alerts):
                continue
            run.outputs.append(DerivedRecord.from_decoded(codec.decode(out.value), log_time))
    run.seconds = time.process_time() - started
    return run


def _events_in(parts: dict[TopicPartition, list[InRecord]], codec: object) -> int:
    """Events carried by replay segments (the watchdog core's unit of work), from the
    segments' first/last seq without decoding the events."""
    n = 0
    for recs in parts.values():
        for rec in recs:
            try:
                d = codec.decode(rec.value)  # type: ignore[attr-defined]
            except DecodeError:
                continue
            if d.kind == "ReplaySegment":
                n += len(d.record["events"])
    return n


def substitute_alerts(log: RecordedLog, settings: Settings, baseline: PipelineRun,
                      changed: PipelineRun) -> dict[TopicPartition, list[InRecord]]:
    """The alerts topic as the scheduler would have read it had the watchdog run with the
    changed rules: the recorded alert records the scheduler processed, minus those the
    recorded-rules watchdog raises and the changed one does not raise identically, plus the
    changed watchdog's new or changed alerts (encoded as it would write them) at their
    trigger's log time, up to the last log time the scheduler processed."""
    topics = Topics(settings)
    codec = default_codec()
    upto = log.upto("scheduler")
    parts = {tp: recs for tp, recs in log.inputs.items() if tp.topic == topics.alerts}
    if upto is not None:
        parts = {tp: [r for r in recs if r.offset < upto.get(tp, 0)]
                 for tp, recs in parts.items()}
    before = {d.event_id: d for d in baseline.by_producer("watchdog")
              if d.kind == "WatchdogAlert"}
    after = {d.event_id: d for d in changed.by_producer("watchdog")
             if d.kind == "WatchdogAlert"}
    # an alert the changed rules raise differently (the same loop caught at another seq keeps
    # its id) is replaced too
    same = {eid for eid, d in before.items()
            if eid in after and after[eid].comparable() == d.comparable()}
    gone = set(before) - same
    out: dict[TopicPartition, list[InRecord]] = {}
    for tp, recs in parts.items():
        kept = []
        for rec in recs:
            try:
                eid = codec.decode(rec.value).header.get("event_id")
            except DecodeError:
                eid = None
            if eid not in gone:
                kept.append(rec)
        out[tp] = kept
    horizon = _last_log_time(log, settings)
    new = sorted((d for eid, d in after.items() if eid not in same
                  and (horizon is None or d.log_time_ms <= horizon)),
                 key=lambda d: (d.log_time_ms, d.event_id))
    if new:
        from trajbus.schemas import models

        tp = TopicPartition(topics.alerts, _SYNTHETIC_PARTITION)
        out[tp] = [InRecord(topics.alerts, _SYNTHETIC_PARTITION, i,
                            d.record["header"]["sandbox"].encode(),
                            models.WatchdogAlert.model_validate(d.record).encode(),
                            d.log_time_ms)
                   for i, d in enumerate(new)]
    return out


def _last_log_time(log: RecordedLog, settings: Settings) -> int | None:
    """The latest record timestamp the scheduler processed (None: all the log)."""
    upto = log.upto("scheduler")
    if upto is None:
        return None
    latest = [r.timestamp_ms for tp, recs in log.inputs.items() for r in recs
              if r.offset < upto.get(tp, 0)]
    return max(latest, default=0)


# -- self-check ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    """A recorded output the recorded-rules run did not reproduce exactly, or the reverse."""

    kind: str  # recorded_not_reproduced | reproduced_not_recorded | content_differs
    event_id: str
    sandbox: str
    label: str
    time_ms: int
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "event_id": self.event_id, "sandbox": self.sandbox,
                "label": self.label, "time_ms": self.time_ms, "detail": self.detail}


@dataclass
class SelfCheck:
    """Did the recorded rules reproduce every recorded decision and alert (within the filter),
    and nothing else?"""

    compared: int
    reproduced: int
    mismatches: list[Mismatch]
    unchecked: list[str]  # processors whose live group never committed

    @property
    def passed(self) -> bool:
        return not self.mismatches

    def headline(self) -> str:
        if self.passed:
            text = (f"self-check passed: the recorded rules reproduce all {self.compared} "
                    "recorded decisions/alerts exactly, and nothing else")
        else:
            text = (f"SELF-CHECK FAILED: {len(self.mismatches)} mismatch(es) between the "
                    f"recorded decisions/alerts ({self.compared}) and their re-run "
                    f"({self.reproduced} reproduced exactly) -- the diff below is not to be "
                    "trusted")
        if self.unchecked:
            text += (f" (not checked: {', '.join(self.unchecked)}, whose consumer group "
                     "never committed)")
        return text

    def to_dict(self) -> dict[str, object]:
        return {"passed": self.passed, "compared": self.compared,
                "reproduced": self.reproduced, "unchecked": self.unchecked,
                "mismatches": [m.to_dict() for m in self.mismatches]}


def self_check(log: RecordedLog, run: PipelineRun, flt: LogFilter) -> SelfCheck:
    """Compare the recorded-rules run with the recorded outputs by event id and content
    (:meth:`DerivedRecord.comparable`: all but the producer id and the scheduler's decision
    counter), within ``flt``, for the processors whose live group committed."""
    checked = [p for p in PROCESSORS if log.checked(p)]
    mine = {f"trajbus.{p}" for p in checked}

    def wanted(ds: Iterable[DerivedRecord]) -> dict[str, DerivedRecord]:
        out: dict[str, DerivedRecord] = {}
        for d in ds:
            if d.producer_id in mine and flt.matches(d.record["header"]):
                out.setdefault(d.event_id, d)
        return out

    recorded, reproduced = wanted(log.recorded), wanted(run.outputs)
    mismatches = []
    same = 0
    for eid in sorted(set(recorded) | set(reproduced),
                      key=lambda i: ((recorded.get(i) or reproduced[i]).time_ms, i)):
        a, b = recorded.get(eid), reproduced.get(eid)
        d = a or b
        assert d is not None
        sandbox = str(d.record["header"]["sandbox"])
        if a is not None and b is not None:
            if a.comparable() == b.comparable():
                same += 1
                continue
            diff = sorted(k for k in set(a.comparable()) | set(b.comparable())
                          if a.comparable().get(k) != b.comparable().get(k))
            mismatches.append(Mismatch("content_differs", eid, sandbox, d.label, d.time_ms,
                                       "fields differ: " + ", ".join(diff)))
        elif a is not None:
            mismatches.append(Mismatch("recorded_not_reproduced", eid, sandbox, a.label,
                                       a.time_ms, f"{a.producer_id}: {a.reason}"))
        else:
            assert b is not None
            mismatches.append(Mismatch("reproduced_not_recorded", eid, sandbox, b.label,
                                       b.time_ms, f"{b.producer_id}: {b.reason}"))
    return SelfCheck(len(recorded), same, mismatches,
                     [p for p in PROCESSORS if p not in checked])
