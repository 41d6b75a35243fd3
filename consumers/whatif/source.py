"""Where a what-if run reads its past log: the processors' inputs and their recorded outputs.

:class:`RecordedLog` is the whole question's material, independent of where it came from:
every input record of the watchdog and the scheduler per partition (offset order), the
recorded decisions and alerts, and, per processor, how far the live processor had got (its
consumer group's committed offsets). :func:`read_kafka_log` fills one from the live topics with
the operator tools' bounded reads (:func:`~trajbus.consumers.operator.tools.read_records`);
tests and notebooks can build one directly.

:class:`LogFilter` narrows the *question*, not the input: the scheduler is global (one
sandbox's lease or placement depends on the fleet), and a core's state at the start of a time
range depends on everything before it, so the cores always run over the whole retained log;
the filter selects which sandboxes, tasks and event times the self-check and the diff report.

:func:`read_kafka_log` holds the whole retained input in memory (as ``replay explain`` does);
the replay topics carry the trace chunks too, so this bounds the log a run can take.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from trajbus.bus.errors import NotFoundError, UserError, existing
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.runner import InRecord
from trajbus.consumers.operator.tools import DerivedRecord
from trajbus.schemas.codec import DecodeError, default_codec

__all__ = ["PROCESSORS", "LogFilter", "RecordedLog", "read_kafka_log"]

#: The processors a what-if run re-runs, in pipeline order (the scheduler reads the alerts).
PROCESSORS = ("watchdog", "scheduler")
_PRODUCERS = {f"trajbus.{p}" for p in PROCESSORS}


@dataclass(frozen=True)
class LogFilter:
    """Which part of the log a question is about. Times are event times, epoch ms, inclusive;
    None: unbounded."""

    task: str | None = None
    sandbox: str | None = None
    from_ms: int | None = None
    to_ms: int | None = None

    def matches(self, header: Mapping[str, Any], time_ms: int | None = None) -> bool:
        t = header.get("event_time_ms") if time_ms is None else time_ms
        return ((self.task is None or header.get("task") == self.task)
                and (self.sandbox is None or header.get("sandbox") == self.sandbox)
                and (self.from_ms is None or (isinstance(t, int) and t >= self.from_ms))
                and (self.to_ms is None or (isinstance(t, int) and t <= self.to_ms)))

    def describe(self) -> str:
        from trajbus.bus.positions import iso

        parts = []
        if self.task is not None:
            parts.append(f"task {self.task}")
        if self.sandbox is not None:
            parts.append(f"sandbox {self.sandbox}")
        if self.from_ms is not None or self.to_ms is not None:
            lo = iso(self.from_ms) if self.from_ms is not None else "the start"
            hi = iso(self.to_ms) if self.to_ms is not None else "the end"
            parts.append(f"event time {lo} .. {hi}")
        return ", ".join(parts) or "the whole log"


@dataclass
class RecordedLog:
    """A past log: the processors' inputs and what they recorded.

    ``inputs``: every record of the processors' input topics, per partition in offset order.
    ``recorded``: the recorded decisions and alerts of the watchdog and the scheduler.
    ``processed``: per processor, the offsets its live consumer group had committed (a record
    below them was processed, and its outputs are in ``recorded``); a processor absent from it
    never committed, so its recorded outputs cannot be checked. None: every input was
    processed (a planted log)."""

    inputs: dict[TopicPartition, list[InRecord]]
    recorded: list[DerivedRecord] = field(default_factory=list)
    processed: dict[str, dict[TopicPartition, int]] | None = None

    def checked(self, processor: str) -> bool:
        """Whether ``processor``'s recorded outputs can be compared with a re-run."""
        return self.processed is None or processor in self.processed

    def upto(self, processor: str) -> dict[TopicPartition, int] | None:
        """The cut of the input ``processor`` is re-run over (None: all of it)."""
        if self.processed is None or processor not in self.processed:
            return None
        return self.processed[processor]

    def input_count(self) -> int:
        return sum(len(v) for v in self.inputs.values())

    def require(self, flt: LogFilter, settings: Settings) -> None:
        """Refuse a question the log cannot answer: no input at all, no input event in the
        time range, an unknown sandbox or task (naming the ones that exist)."""
        if not self.input_count():
            raise NotFoundError(
                f"the log under topic prefix {settings.topics.prefix!r} has no input records "
                "for the watchdog or the scheduler",
                hint="check TRAJBUS_TOPICS__PREFIX (a demo run prints its prefix)")
        if flt == LogFilter():
            return
        codec = default_codec()
        sandboxes: set[str] = set()
        tasks: set[str] = set()
        times: list[int] = []
        in_range = 0
        for recs in self.inputs.values():
            for rec in recs:
                try:
                    d = codec.decode(rec.value)
                except DecodeError:
                    continue
                if d.kind == "Tick":
                    continue
                heads = ([codec.decode(raw).header for raw in d.record["events"]]
                         if d.kind == "ReplaySegment" else [d.header])
                for h in heads:
                    sb, task, t = h.get("sandbox"), h.get("task"), h.get("event_time_ms")
                    if isinstance(sb, str):
                        sandboxes.add(sb)
                    if isinstance(task, str):
                        tasks.add(task)
                    if isinstance(t, int):
                        times.append(t)
                    if flt.matches(h):
                        in_range += 1
        if flt.sandbox is not None and flt.sandbox not in sandboxes:
            raise NotFoundError(f"no events of sandbox {flt.sandbox!r} in the log",
                                hint=existing("sandboxes", sandboxes))
        if flt.task is not None and flt.task not in tasks:
            raise NotFoundError(f"no events of task {flt.task!r} in the log",
                                hint=existing("tasks", tasks))
        if not in_range:
            from trajbus.bus.positions import iso

            span = (f"the log's events run from {iso(min(times))} to {iso(max(times))}"
                    if times else "the log has no timed events")
            raise UserError(f"no input event matches {flt.describe()}", hint=span)


async def read_kafka_log(settings: Settings, *, timeout_s: float = 300.0,
                         progress: Callable[[str], None] | None = None) -> RecordedLog:
    """The processors' inputs and recorded outputs from the live topics (bounded reads: the end
    offsets taken at the start), with each processor's committed offsets."""
    from trajbus.bus.kafka import check_broker
    from trajbus.consumers.engine import processors
    from trajbus.consumers.operator.tools import group_offsets, read_records

    await check_broker(settings.kafka)
    topics = Topics(settings)
    specs = [processors.watchdog_spec(settings), processors.scheduler_spec(settings)]
    wanted = list(dict.fromkeys(t for s in specs for t in s.input_topics))
    pattern = "|".join(f"(?:{s.input_pattern})" for s in specs if s.input_pattern) or None
    if progress:
        progress("reading the processors' inputs and recorded outputs from Kafka")
    inputs, outputs, *offsets = await asyncio.gather(
        read_records(settings, wanted, pattern=pattern, timeout_s=timeout_s),
        read_records(settings, [topics.decisions, topics.alerts], timeout_s=timeout_s),
        *(group_offsets(settings, f"{settings.topics.prefix}.{p}") for p in PROCESSORS),
    )
    codec = default_codec()
    recorded: list[DerivedRecord] = []
    seen: set[str] = set()
    for tp in sorted(outputs, key=lambda tp: (tp.topic, tp.partition)):
        for rec in outputs[tp]:
            try:
                d = codec.decode(rec.value)
            except DecodeError:
                continue
            if d.kind not in ("SchedulingDecision", "WatchdogAlert") \
                    or d.header.get("producer_id") not in _PRODUCERS:
                continue
            dr = DerivedRecord.from_decoded(d, rec.timestamp_ms)
            if dr.event_id not in seen:
                seen.add(dr.event_id)
                recorded.append(dr)
    processed = {p: upto for p, upto in zip(PROCESSORS, offsets, strict=True) if upto}
    log = RecordedLog(inputs, recorded, processed)
    if progress:
        progress(f"read {log.input_count()} input records and {len(recorded)} recorded "
                 "decisions/alerts")
    return log
