"""Planted logs for what-if tests: the records a live watchdog and scheduler would have read
(replay segments, sandbox lifecycle and heartbeats, ticks), and what they recorded from them.

A :class:`PlantedLog` records every input as the consumer hands it over (topic, partition,
offset, record timestamp). :meth:`PlantedLog.recorded` runs the live adapters over it, as the
live worker did, and returns the :class:`RecordedLog` with their outputs as recorded (the
alerts also as input of the scheduler, as the alerts topic is).
"""

from __future__ import annotations

from aiokafka import TopicPartition

from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.engine.processors import scheduler_spec, watchdog_spec
from trajbus.consumers.engine.runner import InRecord
from trajbus.consumers.operator.tools import (
    DerivedRecord,
    feed_processor,
    merge_by_timestamp,
    processor_inputs,
)
from trajbus.consumers.whatif import RecordedLog
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

codec = default_codec()
T0 = 1_767_225_600_000
SECOND, MINUTE = 1000, 60_000


def settings_t(prefix: str = "t") -> Settings:
    s = Settings()
    s.topics.prefix = prefix
    return s


class Episode:
    """Events of one episode (``task``), on the sandbox's clock starting at ``t0``."""

    def __init__(self, sandbox: str, episode: str, t0: int, task: str = "task-a") -> None:
        self.sandbox, self.episode, self.task, self.t = sandbox, episode, task, t0
        self.seq = 0
        self.calls = 0
        self.events: list[tuple[int, bytes]] = []

    def _h(self, dt: int) -> m.Envelope:
        self.t += dt
        h = m.Envelope(event_id=f"{self.sandbox}-{self.episode}-{self.seq}", task=self.task,
                       sandbox=self.sandbox, episode=self.episode, seq=self.seq,
                       event_time_ms=self.t, producer_id="sidecar")
        self.seq += 1
        return h

    def start(self) -> Episode:
        self.events.append((self.t, m.EpisodeStart(header=self._h(0)).encode()))
        return self

    def calls_(self, n: int, *, args: str = "a", result: str = "b",
               dt: int = 10 * SECOND) -> Episode:
        """``n`` calls ``dt`` apart, each answered 500 ms later; ``args="*"``: all different."""
        for k in range(n):
            cid = f"c{self.calls}"
            self.calls += 1
            a = args if args != "*" else "0123456789abcdef"[k % 16]
            self.events.append((self.t + dt, m.ToolCall(
                header=self._h(dt), call_id=cid, tool="browser_click",
                args_hash=a * 64).encode()))
            self.events.append((self.t + 500, m.ToolResult(
                header=self._h(500), call_id=cid, tool="browser_click",
                status=m.ToolStatus.OK, result_hash=result * 64).encode()))
        return self

    def end(self) -> Episode:
        self.events.append((self.t + SECOND, m.EpisodeEnd(
            header=self._h(SECOND), outcome=m.EpisodeOutcome.TERMINAL).encode()))
        return self


class PlantedLog:
    """Input records of the watchdog and the scheduler, per partition (added in any order;
:meth:`recorded` puts each partition in record-timestamp order, as a broker appends them)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or settings_t()
        self.topics = Topics(self.settings)
        self.parts: dict[TopicPartition, list[InRecord]] = {}
        self.seqs: dict[str, int] = {}
        self._segments: dict[tuple[str, str], int] = {}

    def add(self, topic: str, partition: int, key: bytes, value: bytes, ts: int) -> InRecord:
        recs = self.parts.setdefault(TopicPartition(topic, partition), [])
        rec = InRecord(topic, partition, len(recs), key, value, ts)
        recs.append(rec)
        return rec

    def episode(self, ep: Episode, per: int = 4, partition: int = 0) -> None:
        """``ep`` as replay segments of ``per`` events, each written when its last event
        happened."""
        evs = ep.events
        for k in range(0, len(evs), per):
            chunk = evs[k:k + per]
            i = self._segments.get((ep.sandbox, ep.episode), 0)
            self._segments[(ep.sandbox, ep.episode)] = i + 1
            first = codec.decode(chunk[0][1]).header["seq"]
            last = k + per >= len(evs)
            seg = m.ReplaySegment(
                header=m.Envelope(event_id=f"seg-{ep.sandbox}-{ep.episode}-{i}", task=ep.task,
                                  sandbox=ep.sandbox, episode=ep.episode, seq=i,
                                  event_time_ms=chunk[-1][0], producer_id="trajbus.reorder"),
                first_seq=first, last_seq=first + len(chunk) - 1,
                events=[v for _, v in chunk], is_first=first == 0, is_last=last,
                is_terminal=last)
            self.add(self.topics.replay(ep.task), partition,
                     f"{ep.sandbox}/{ep.episode}".encode(), seg.encode(), chunk[-1][0])

    def _sandbox_header(self, sb: str, t: int, task: str = "task-a") -> m.Envelope:
        seq = self.seqs.get(sb, 0)
        self.seqs[sb] = seq + 1
        return m.Envelope(event_id=f"{sb}-s{seq}", task=task, sandbox=sb, episode=None,
                          seq=seq, event_time_ms=t, producer_id="runtime")

    def lifecycle(self, sb: str, t: int, state: str, **kw: str) -> None:
        ev = m.SandboxLifecycle(header=self._sandbox_header(sb, t), state=m.LifecycleState(state),
                                node=kw.get("node"), tenant=kw.get("tenant"), reason="")
        self.add(self.topics.sandbox_events, 0, sb.encode(), ev.encode(), t)

    def active(self, sb: str, t: int) -> None:
        self.lifecycle(sb, t, "PROVISIONING", node="n1", tenant="acme")
        self.lifecycle(sb, t + SECOND, "ACTIVE")

    def heartbeat(self, sb: str, t: int, ttl: int = 600_000) -> None:
        """A heartbeat asking for a lease of ``ttl`` (the scheduler grants at most its own
        ``lease_ttl_ms`` and ``missed_heartbeats_to_reclaim`` x ``heartbeat_interval_ms``)."""
        ev = m.Heartbeat(header=self._sandbox_header(sb, t), lease_ttl_ms=ttl)
        self.add(self.topics.sandbox_events, 0, sb.encode(), ev.encode(), t)

    def ticks(self, start: int, end: int, every: int = 10 * SECOND) -> None:
        """Ticks on the control topic (the scheduler's timers) and the watchdog's tick topic."""
        for t in range(start, end + 1, every):
            tick = m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=0,
                                            event_time_ms=t, producer_id="t.ticker"))
            self.add(self.topics.control, 0, b"_tick", tick.encode(), t)
            self.add(f"{self.topics.prefix}.watchdog.ticks", 0, b"_tick", tick.encode(), t)

    def recorded(self) -> RecordedLog:
        """The log with what the live watchdog, then the live scheduler, recorded from it (the
        alerts written to the alerts topic, which the scheduler reads, at their trigger's log
        time + 5 ms)."""
        parts = {tp: [r._replace(offset=i) for i, r in enumerate(
                     sorted(recs, key=lambda r: r.timestamp_ms))]
                 for tp, recs in self.parts.items()}  # a partition is in log-time order
        recorded: list[DerivedRecord] = []
        for spec in (watchdog_spec(self.settings), scheduler_spec(self.settings)):
            mine = processor_inputs(spec.input_topics, spec.input_pattern, parts)
            for out, ts in feed_processor(spec.factory, spec.global_state,
                                          merge_by_timestamp(mine, spec.input_topics)):
                if out.topic not in (self.topics.alerts, self.topics.decisions):
                    continue
                recorded.append(DerivedRecord.from_decoded(codec.decode(out.value), ts + 5))
                if out.topic == self.topics.alerts:
                    recs = parts.setdefault(TopicPartition(out.topic, 0), [])
                    recs.append(InRecord(out.topic, 0, len(recs), out.key, out.value, ts + 5))
        return RecordedLog(parts, recorded, None)
