"""Adapters between the runner (Kafka records) and the pure cores (decoded events).

Each adapter decodes a record once, routes undecodable bytes to the dead-letter topic with the
reason (never dropping them, never crashing), feeds the core and encodes the core's outputs.
The same adapters serve offline replay (`trajbus replay explain`), so live and replayed
decisions come from identical code.
"""

from __future__ import annotations

import re
from typing import Any

from trajbus.bus import deadletter
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics, TopicSpec, episode_record_key, validate_name
from trajbus.consumers.engine import metrics
from trajbus.consumers.engine.log_silence import SILENCES_KEY, LogSilences
from trajbus.consumers.engine.runner import InRecord, OutRecord, ProcessorSpec
from trajbus.consumers.outputs import DeadLetterOut, DecisionOut
from trajbus.consumers.replay.core import (
    InEvent,
    LateOut,
    ReorderCore,
    SegmentOut,
    segment_record,
)
from trajbus.schemas.codec import Codec, Decoded, DecodeError, Head, default_codec


class _Adapter:
    """Common decode and dead-letter handling."""

    stage = "processor"

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        self.settings = settings
        self.topics = Topics(settings)
        self.codec = codec or default_codec()
        self.producer_id = f"trajbus.{self.stage}"

    def decode(self, rec: InRecord, outs: list[OutRecord]) -> Decoded | None:
        try:
            return self.codec.decode(rec.value)
        except DecodeError as exc:
            outs.append(self.dead_letter(rec, exc.reason_code, str(exc)))
            return None

    def dead_letter(self, rec: InRecord, code: str, reason: str, *,
                    value: bytes | None = None, header: dict[str, Any] | None = None,
                    conflicting: bytes | None = None) -> OutRecord:
        """The dead letter of ``rec`` (or of ``value``, the record's bytes as the core saw
        them), with ``conflicting`` (the version kept instead) for a conflicting duplicate.
        Never a poison pill: what does not fit the derived topics' record limit is truncated,
        and the reason says where the whole bytes are."""
        deadletter.count(self.stage, code)  # also trajbus_dead_letters_total
        if code == "conflicting_duplicate":
            metrics.CONFLICTS.inc()
        h = header or {}
        original = rec.value if value is None else value
        room = self.topics.derived_max_bytes - 64 * 1024
        if len(original) > room:  # the full record stays in its topic
            reason += (f" (original of {len(original)} bytes truncated to {room}; the whole "
                       f"record is at {rec.topic}/{rec.partition}@{rec.offset})")
            original = original[:room]
        if conflicting is not None and len(original) + len(conflicting) > room:
            keep = room - len(original)
            reason += (f" (kept version of {len(conflicting)} bytes truncated to {keep}; it "
                       "is replayed whole in its episode's replay segment)")
            conflicting = conflicting[:keep]
        event = deadletter.dead_letter_event(
            stage=self.stage, reason_code=code, reason=reason, source_topic=rec.topic,
            source_partition=rec.partition, source_offset=rec.offset, key=rec.key,
            value=original, producer_id=self.producer_id,
            task=h.get("task") or "_unknown", sandbox=h.get("sandbox") or "_unknown",
            episode=h.get("episode"), event_time_ms=h.get("event_time_ms") or rec.timestamp_ms,
            conflicting=conflicting,
        )
        return OutRecord(self.topics.deadletter, rec.key, event.encode())

    def dead_out(self, out: DeadLetterOut, rec: InRecord | None,
                 header: dict[str, Any] | None = None) -> OutRecord | None:
        """The dead letter of a core's :class:`DeadLetterOut`: of the record it names
        (``origin``), else of ``rec`` (the record fed to the core), else, when it carries its
        bytes, of a ``_core`` placeholder; None when it names no record (a dead letter of a
        tick). ``header``: the envelope fields to name, by default the ones the core read."""
        raw = out.raw
        if out.origin is not None:  # an event the core held: judged after its own record
            src: InRecord = InRecord(*out.origin[:4], raw or b"", out.origin[4])
        elif rec is not None:
            src = rec
        elif raw is not None:
            src = InRecord("_core", -1, -1, None, raw, 0)
        else:
            return None
        if header is None:
            header = {"task": out.task, "sandbox": out.sandbox, "episode": out.episode}
        return self.dead_letter(src, out.reason_code, out.reason, value=raw, header=header,
                                conflicting=out.conflicting_with)

    def decision_out(self, out: DecisionOut) -> OutRecord:
        """The SchedulingDecision record of a core's :class:`DecisionOut`, keyed by its
        header's sandbox."""
        metrics.DECISIONS.labels(out.decision).inc()
        event = out.to_model(self.producer_id)
        return OutRecord(self.topics.decisions, event.header.sandbox.encode(), event.encode())


# -- reorder -----------------------------------------------------------------------------
#: How much longer than the tick interval an input partition may go without a record before
#: the stretch counts as a silence (a ticker delayed by a busy CPU is not an outage).
SILENCE_SLACK_MS = 1_000


class ReorderProcessor(_Adapter):
    """Raw sandbox events and trace chunks -> ordered replay segments per task."""

    stage = "reorder"

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        super().__init__(settings, codec)
        # Gap timeouts count processing time, not producers' clocks: the core's clock is the
        # lowest tick seen across the input topics (a watermark). Events of a sandbox arrive
        # on two topics (events and trace chunks); a gap can only close once *both* topics
        # have been read past its deadline. The deadline counts from the log time of the
        # record that opened the gap (InEvent.log_time_ms), not from that clock: the clock
        # lags the leading topic (and a restored one lags by the downtime), and a deadline
        # armed from it would pass before the lagging topic reached the records written
        # just after the opening one.
        self.core = ReorderCore(
            settings.replay, event_time_clock=False,
            max_buffered_bytes_per_episode=settings.replay.max_buffered_bytes_per_episode
            or settings.topics.max_message_bytes + 512 * 1024)
        self.inputs = tuple(self.topics.input_topics)
        self.watermarks: dict[str, int] = {}
        # Timeouts count serving time: log time with the input partitions' silences (an
        # outage: a dead leader, a lost ISR majority) taken out; see engine/log_silence.py.
        self.silences = LogSilences(settings.scheduler.tick_interval_ms + SILENCE_SLACK_MS)

    def handle(self, rec: InRecord) -> list[OutRecord]:
        """One record, one segment per released run (no coalescing): the faust engine and
        `trajbus replay explain` call this; the runner calls :meth:`handle_batch`."""
        outs: list[OutRecord] = []
        self._handle(rec, outs, None)
        return outs

    def _handle(self, rec: InRecord, outs: list[OutRecord],
                merger: _SegmentMerger | None) -> None:
        self.silences.observe(rec.topic, rec.timestamp_ms)
        head = self._decode_head(rec, outs)
        if head is None:
            return
        kind, header = head.kind, head.header
        if kind == "Tick":
            t = header["event_time_ms"]
            if t > self.watermarks.get(rec.topic, 0):
                self.watermarks[rec.topic] = t
            if all(topic in self.watermarks for topic in self.inputs):
                now = min(self.watermarks[topic] for topic in self.inputs)
                self.silences.fold(now)
                self._convert(self.core.tick(self.silences.serving(now)), outs, None, merger)
                self._gauges()
            return
        if kind not in _REORDERED:
            return
        bad = _invalid_ids(header)
        if bad is not None:  # a replay topic name / archive path must never come from it
            outs.append(self.dead_letter(rec, "invalid_id", bad, header=header))
            return
        if kind in _EPISODE_KINDS and header.get("episode") is None:
            outs.append(self.dead_letter(rec, "missing_episode", f"{kind} without an "
                                         "episode id", header=header))
            return
        if self.core.clock_ms == 0:  # before the first watermark: start from the log's time
            self.core.tick(self.silences.serving(rec.timestamp_ms))
        self._convert(self.core.handle(self._event(rec, head), rec), outs, rec, merger)

    def _decode_head(self, rec: InRecord, outs: list[OutRecord]) -> Head | None:
        """The record's kind and header, its body checked whole (codec.decode_head: what a
        full decode gives, without building the body); a dead letter if it does not decode."""
        try:
            return self.codec.decode_head(rec.value)
        except DecodeError as exc:
            outs.append(self.dead_letter(rec, exc.reason_code, str(exc)))
            return None

    def _event(self, rec: InRecord, head: Head) -> InEvent:
        """The core's input for a decoded record. Drained is the one kind whose body the core
        reads beyond enums (its final seqs): it is decoded whole (once per sandbox drain)."""
        fields = self.codec.decode(rec.value).record if head.kind == "Drained" else head.enums
        return InEvent.from_head(head.kind, head.header, fields, rec.value,
                                 self.silences.serving(rec.timestamp_ms))

    def handle_batch(self, records: list[InRecord]) -> list[OutRecord]:
        """Process several records (of this core's partition, in log order) for ONE
        transaction, coalescing each episode's consecutive segments into one ReplaySegment.

        The core releases one segment per in-order event (its fast path); encoding, sending
        and the trainer's decoding and offset commit are per segment, so writing one segment
        per episode per batch instead of one per event is most of the worker's and the
        trainer's cost saved. A coalesced segment is exactly what the core itself emits for
        events released together: contiguous seqs, the first segment's ``gap``, ``is_first``
        and index (its event id), the last one's ``is_last``, ``is_terminal`` and event time,
        within the core's segment caps (``max_segment_events`` / ``max_segment_bytes``). A
        segment that carries a gap marker always starts a new one. Segment indexes on the
        wire therefore increase per episode but may skip numbers.
        """
        outs: list[OutRecord] = []
        merger = _SegmentMerger(self.settings.replay, outs)
        for rec in records:
            self._handle(rec, outs, merger)
        self._finish(merger)
        return outs

    def tick(self, now_ms: int) -> list[OutRecord]:
        outs: list[OutRecord] = []
        self._convert(self.core.tick(now_ms), outs, None)
        self._gauges()
        return outs

    def _gauges(self) -> None:
        """Once a tick: the core's buffered and held events."""
        counters = self.core.counters()
        metrics.REORDER_BUFFERED.set(counters.get("buffered", 0))
        metrics.REORDER_HELD.set(counters.get("held", 0))

    def _segment(self, seg: Any) -> OutRecord:
        value = self.codec.encode("ReplaySegment", segment_record(seg, self.producer_id))
        return OutRecord(self.topics.replay(seg.task),
                         episode_record_key(seg.sandbox, seg.episode), value)

    def _finish(self, merger: _SegmentMerger) -> None:
        """Encode the (coalesced) segments into their reserved places in ``outs``."""
        for i, seg in merger.built():
            merger.outs[i] = self._segment(seg)

    def _convert(self, results: list[Any], outs: list[OutRecord], rec: InRecord | None,
                 merger: _SegmentMerger | None = None) -> None:
        for r in results:
            if isinstance(r, SegmentOut):
                if r.gap is not None:
                    metrics.GAPS.inc()
                if merger is None:
                    outs.append(self._segment(r))
                else:
                    merger.add(r)
            elif isinstance(r, LateOut):
                metrics.LATE.inc()
                outs.append(OutRecord(self.topics.late, episode_record_key(r.sandbox, r.episode),
                                      r.raw))
            elif isinstance(r, DeadLetterOut) and (dead := self.dead_out(r, rec)) is not None:
                outs.append(dead)

    def take_dirty(self) -> dict[str, bytes | None]:
        dirty = self.core.take_dirty()
        if self.silences.dirty:
            dirty[SILENCES_KEY] = self.silences.pack()
        return dirty

    def restore(self, key: str, blob: bytes | None) -> None:
        if key == SILENCES_KEY:
            self.silences.unpack(blob)
        else:
            self.core.restore(key, blob)


_RESERVED = OutRecord("", None, b"")


class _Run:
    """One coalesced segment under construction (see :meth:`ReorderProcessor.handle_batch`)."""

    __slots__ = ("events", "first", "last", "nbytes")

    def __init__(self, seg: Any) -> None:
        self.first = seg
        self.last = seg
        self.events: list[bytes] = list(seg.events)
        self.nbytes = sum(map(len, seg.events))


class _SegmentMerger:
    """Coalesces each episode's consecutive SegmentOuts; reserves each resulting segment's
    position in ``outs`` (filled by :meth:`ReorderProcessor._finish`), so outputs keep the
    order in which their first part was released."""

    def __init__(self, replay: Any, outs: list[OutRecord]) -> None:
        self.max_events = max(1, int(replay.max_segment_events or 1))
        self.max_bytes = max(1, int(replay.max_segment_bytes or 1))
        self.outs = outs
        self.runs: list[tuple[int, _Run]] = []
        self.open: dict[tuple[str, str], _Run] = {}

    def add(self, seg: Any) -> None:
        key = (seg.sandbox, seg.episode)
        run = self.open.get(key)
        if run is not None:
            n = len(seg.events)
            size = sum(len(e) for e in seg.events) if n != 1 else len(seg.events[0])
            if (seg.gap is None and not run.last.is_last
                    and seg.first_seq == run.last.last_seq + 1
                    and seg.segment_index > run.last.segment_index
                    and len(run.events) + n <= self.max_events
                    and run.nbytes + size <= self.max_bytes):
                run.events.extend(seg.events)
                run.nbytes += size
                run.last = seg
                return
        run = _Run(seg)
        self.open[key] = run
        self.runs.append((len(self.outs), run))
        self.outs.append(_RESERVED)  # replaced by ReorderProcessor._finish

    def built(self) -> list[tuple[int, Any]]:
        res = []
        for i, run in self.runs:
            first, last = run.first, run.last
            if first is last:
                res.append((i, first))
            else:
                res.append((i, first._replace(
                    last_seq=last.last_seq, events=run.events, is_last=last.is_last,
                    is_terminal=last.is_terminal, event_time_ms=last.event_time_ms)))
        return res


_VALID_IDS: dict[tuple[str, str], None] = {}  # (task, sandbox) pairs that passed (bounded)


def _invalid_ids(h: dict[str, Any]) -> str | None:
    """Why the envelope's ids are unusable, or None. The task names a replay topic and
    archive paths, so it must pass :func:`validate_name`; so must a sandbox id when present
    (an empty one is the core's ``missing_sandbox``); an event id must not be empty."""
    ids = (h.get("task") or "", h.get("sandbox") or "")
    if ids not in _VALID_IDS:  # validate_name is pure: remember the pairs that passed
        try:
            validate_name("task", ids[0])
            if ids[1]:
                validate_name("sandbox", ids[1])
        except ValueError as exc:
            return str(exc)
        if len(_VALID_IDS) >= 100_000:
            _VALID_IDS.clear()
        _VALID_IDS[ids] = None
    if not h.get("event_id"):
        return "empty event_id"
    return None


_EPISODE_KINDS = frozenset({"EpisodeStart", "EpisodeEnd", "ToolCall", "ToolResult", "TraceChunk"})
_REORDERED = frozenset({
    "EpisodeStart", "EpisodeEnd", "ToolCall", "ToolResult", "TraceChunk", "SandboxLifecycle",
    "Drained", "Heartbeat", "LivenessProbe", "DecisionAck",
})


def reorder_spec(settings: Settings) -> ProcessorSpec:
    topics = Topics(settings)
    return ProcessorSpec(
        name="reorder",
        input_topics=topics.input_topics,
        factory=lambda: ReorderProcessor(settings),
        output_topics=lambda: [TopicSpec(topics.late, settings.topics.partitions, "late",
                                         "episode")],
    )


# -- scheduler ---------------------------------------------------------------------------
class SchedulerProcessor(_Adapter):
    """Lifecycle, heartbeats, probes, requests, node reports, watchdog alerts and replay
    acknowledgements -> scheduling decisions. Global: one instance sees every input."""

    stage = "scheduler"
    INPUT_KINDS = frozenset({
        "SandboxLifecycle", "Heartbeat", "LivenessProbe", "NodeReport", "SandboxRequest",
        "TrainerRelease", "Drained", "WatchdogAlert", "DecisionAck",
    })

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        from trajbus.consumers.replay.core import ReorderCore
        from trajbus.consumers.scheduler.core import SchedulerCore

        super().__init__(settings, codec)
        s = settings.scheduler
        self.core = SchedulerCore(s, node_stale_ms=s.node_stale_ms,
                                  lease_warning_ms=s.lease_warning_ms)
        # Sandboxes publish concurrently, so a sandbox's own stream (lifecycle, heartbeats,
        # probes, drained; gapless seqs) can arrive out of order: put it back in order with
        # the same reorder core the trainers' replay uses, before the rules see it.
        self.sandbox_order = ReorderCore(settings.replay, event_time_clock=False)

    def handle(self, rec: InRecord) -> list[OutRecord]:
        outs: list[OutRecord] = []
        decoded = self.decode(rec, outs)
        if decoded is None:
            return outs
        kind, record = decoded.kind, decoded.record
        if kind == "Tick":
            now = record["header"]["event_time_ms"]
            results = self.core.tick(now, record["header"]["event_id"])
            self._convert(results, outs, rec, decoded.header)
            self._in_order(self.sandbox_order.tick(now), rec, outs)
            return outs
        if kind in _SANDBOX_STREAM and (bad := _invalid_ids(decoded.header)) is not None:
            # the reorder stage refuses it for the same reason: one permanent verdict, not
            # an "unknown sandbox" that redrive would take for transient
            outs.append(self.dead_letter(rec, "invalid_id", bad, header=decoded.header))
            return outs
        if kind in _SANDBOX_STREAM and record["header"]["episode"] is None:
            from trajbus.consumers.replay.core import InEvent

            if self.sandbox_order.clock_ms == 0:
                self.sandbox_order.tick(rec.timestamp_ms)
            ev = InEvent.from_decoded(decoded, rec.value, rec.timestamp_ms)._replace(
                episode=_SANDBOX_EPISODE)
            self._in_order(self.sandbox_order.handle(ev, rec), rec, outs)
            return outs
        if kind == "ReplaySegment":
            if record["gap"] is not None or not record["events"]:
                return outs  # only gap-free progress confirms delivery
            h = record["header"]
            results = self.core.handle("ReplayAck", {
                "sandbox": h["sandbox"], "episode": h["episode"],
                "last_seq": record["last_seq"], "event_time_ms": rec.timestamp_ms,
                "event_id": h["event_id"]})
        elif kind in self.INPUT_KINDS:
            # The scheduler's clock is the log's record timestamp (ingestion time): it is in the
            # log, so replays decide the same, and one producer's skewed clock cannot expire
            # every other sandbox's lease.
            record = {**record, "header": {**record["header"], "event_time_ms": rec.timestamp_ms}}
            results = self.core.handle(kind, record)
        else:
            return outs
        self._convert(results, outs, rec, decoded.header)
        return outs

    def tick(self, now_ms: int) -> list[OutRecord]:
        outs: list[OutRecord] = []
        self._convert(self.core.tick(now_ms), outs, None, {})
        return outs

    def _in_order(self, results: list[Any], rec: InRecord, outs: list[OutRecord]) -> None:
        """Feed the rules the sandbox-stream events the reorder core released, in order.
        Events late after a closed gap are still applied (the rules judge legality)."""
        released: list[bytes] = []
        for r in results:
            if isinstance(r, SegmentOut):
                released.extend(r.events)
            elif isinstance(r, LateOut):
                released.append(r.raw)
            elif isinstance(r, DeadLetterOut):
                # the sandbox stream is a pseudo-episode of the core: its dead letters name
                # no episode, nor a kept version
                dead = self.dead_out(r._replace(conflicting_with=None), rec,
                                     header={"task": r.task, "sandbox": r.sandbox})
                if dead is not None:
                    outs.append(dead)
        for raw in released:
            event = self.codec.decode(raw)
            record = {**event.record,
                      "header": {**event.record["header"], "event_time_ms": rec.timestamp_ms}}
            self._convert(self.core.handle(event.kind, record), outs, rec, record["header"])

    def _convert(self, results: list[Any], outs: list[OutRecord], rec: InRecord | None,
                 header: dict[str, Any]) -> None:
        for r in results:
            if isinstance(r, DecisionOut):
                outs.append(self.decision_out(r))
            elif (dead := self.dead_out(r, rec, header)) is not None:
                outs.append(dead)

    def take_dirty(self) -> dict[str, bytes | None]:
        dirty = self.core.take_dirty()
        dirty.update({f"order/{k}": v for k, v in self.sandbox_order.take_dirty().items()})
        return dirty

    def restore(self, key: str, blob: bytes | None) -> None:
        if key.startswith("order/"):
            self.sandbox_order.restore(key[len("order/"):], blob)
        else:
            self.core.restore(key, blob)


_SANDBOX_STREAM = frozenset({"SandboxLifecycle", "Heartbeat", "LivenessProbe", "Drained",
                            "DecisionAck"})
_SANDBOX_EPISODE = "\x00sandbox"  # the sandbox-level stream, as a pseudo-episode of the core


def scheduler_spec(settings: Settings) -> ProcessorSpec:
    topics = Topics(settings)
    return ProcessorSpec(
        name="scheduler",
        input_topics=[topics.control, topics.nodes, topics.sandbox_events, topics.alerts],
        input_pattern=replay_topics_pattern(topics),
        factory=lambda: SchedulerProcessor(settings),
        global_state=True,
        # Decisions depend on how its topics interleave: merge them by record timestamp, the
        # order `trajbus replay explain` re-creates from the log. Ticks go into every input
        # partition so the merge never waits long for a quiet one.
        ordered=True,
    )


# -- watchdog ----------------------------------------------------------------------------
class WatchdogProcessor(_Adapter):
    """Ordered replay segments -> loop and stall alerts (+ TERMINATE decisions unless dry run).

    The watchdog reads the reorder processor's output, not the raw topics: sandboxes publish
    concurrently, so raw tool events arrive out of order and with duplicates, while the rule
    ("the same call 20 times in a row") is about the agent's actual order of calls."""

    stage = "watchdog"

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        from trajbus.consumers.watchdog.core import WatchdogCore

        super().__init__(settings, codec)
        self.core = WatchdogCore(settings.watchdog, settings.watchdog.per_task)

    def handle(self, rec: InRecord) -> list[OutRecord]:
        outs: list[OutRecord] = []
        decoded = self.decode(rec, outs)
        if decoded is None:
            return outs
        if decoded.kind != "ReplaySegment":
            return outs  # Ticks too: see tick()
        # The record's partition is the log that times its streams (the core's "Time"): its
        # timers due by this record's log time fire first, then its events count from it.
        self._convert(self.core.advance(f"{rec.topic}:{rec.partition}", rec.timestamp_ms),
                      outs, None, {})
        for raw in decoded.record["events"]:
            try:
                event = self.codec.decode(raw)
            except DecodeError as exc:  # cannot happen for reorder output; never crash
                outs.append(self.dead_letter(rec, exc.reason_code, str(exc), value=raw))
                continue
            self._convert(self.core.handle(event.kind, event.record), outs, rec, event.header)
        return outs

    def tick(self, now_ms: int) -> list[OutRecord]:
        """Nothing: the watchdog judges no timer by a tick. A tick (the runner's wall clock, read
        from its own topic in whatever order the consumer interleaves it with the replay
        partitions) can run ahead of a partition read behind it, or hours ahead of or behind a
        sandbox's clock; judged by it, a tick read between an episode's segments would evict
        the stream as idle and start its loop count over. The timers run on each replay
        partition's own log time instead (``WatchdogCore.advance``), so the decisions depend
        on the log alone: replays and restarts decide the same
        (docs/decisions/0018-watchdog-timers-on-log-time.md)."""
        return []

    def _convert(self, results: list[Any], outs: list[OutRecord], rec: InRecord | None,
                 header: dict[str, Any]) -> None:
        if not results:  # most events: nothing to convert (and no import to look up)
            return
        from trajbus.consumers.watchdog.core import AlertOut, to_model

        for r in results:
            if isinstance(r, AlertOut):
                metrics.ALERTS.labels(r.alert).inc()
                outs.append(OutRecord(self.topics.alerts, r.sandbox.encode(),
                                      to_model(r, self.producer_id).encode()))
            elif isinstance(r, DecisionOut):
                outs.append(self.decision_out(r))
            elif (dead := self.dead_out(r, rec, header)) is not None:
                outs.append(dead)

    def take_dirty(self) -> dict[str, bytes | None]:
        return self.core.take_dirty()

    def restore(self, key: str, blob: bytes | None) -> None:
        self.core.restore(key, blob)  # a corrupt blob is refused by the core, state unchanged


def replay_topics_pattern(topics: Topics) -> str:
    """Every per-task replay topic (trajbus.replay.<task>), except operators' debug
    republications (trajbus.replay.debug-<task>), which must not feed live decisions."""
    return re.escape(f"{topics.prefix}.replay.") + r"(?!debug-)[^.]+$"


def watchdog_spec(settings: Settings) -> ProcessorSpec:
    topics = Topics(settings)
    ticks = f"{topics.prefix}.watchdog.ticks"
    return ProcessorSpec(
        name="watchdog",
        input_topics=[ticks],
        input_pattern=replay_topics_pattern(topics),
        tick_topics=[ticks],
        factory=lambda: WatchdogProcessor(settings),
    )
