"""Timeouts of the reorder processor count from the log, never from a clock that lags it.

The processor's clock is the lowest tick watermark across its two input topics (sandbox events
and trace chunks). That clock can lag far behind the moment a record was written: when one topic
is read behind the other, and after a restore (the changelog's clock is the previous worker's
last tick, stale by the downtime). A gap opened by a record written at log time T must not close
before the clock passes T + gap timeout, wherever the clock stood when the record was read; the
recycle grace likewise counts from the RECYCLED record's log time. The decision stays
reproducible: it depends only on the records (their log timestamps and the ticks) in log order.

Also here: how the processor keys its replay records (one episode in one partition, a fleet's
episodes over all partitions).

Pure: the same ReorderProcessor the runner and `replay explain` use, fed InRecords as a consumer
would hand them over. No broker.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from trajbus.bus.settings import ReplaySettings, Settings
from trajbus.consumers.engine.processors import ReorderProcessor
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

codec = default_codec()
EVENTS, CHUNKS = "t.sandbox.events", "t.trace.chunks"
T0 = 1_767_225_600_000
TIMEOUT = 30_000


class Log:
    """Records of one input partition pair, in the order a consumer hands them over."""

    def __init__(self) -> None:
        self.offsets = {EVENTS: 0, CHUNKS: 0}

    def rec(self, topic: str, value: bytes, log_time: int, key: bytes = b"sb-1") -> InRecord:
        off = self.offsets[topic]
        self.offsets[topic] = off + 1
        return InRecord(topic, 0, off, key, value, log_time)

    def tick(self, topic: str, t: int) -> InRecord:
        tick = m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=0, event_time_ms=t,
                                        producer_id="test"))
        return self.rec(topic, tick.encode(), t, b"_tick")

    def ticks(self, topic: str, start: int, stop: int, every: int = 1000) -> list[InRecord]:
        return [self.tick(topic, t) for t in range(start, stop + 1, every)]


def _header(seq: int, t: int, episode: str | None = "ep-1") -> m.Envelope:
    return m.Envelope(event_id=f"e-{episode}-{seq}", task="task-a", sandbox="sb-1",
                      episode=episode, seq=seq, event_time_ms=t, producer_id="test")


def start(t: int) -> bytes:
    return m.EpisodeStart(header=_header(0, t)).encode()


def call(seq: int, t: int) -> bytes:
    return m.ToolCall(header=_header(seq, t), call_id=f"c{seq}", tool="exec",
                      args_hash=f"{seq:064x}").encode()


def chunk(seq: int, t: int) -> bytes:
    return m.TraceChunk(header=_header(seq, t), file_offset=seq * 10, length=3,
                        sha256=hashlib.sha256(b"abc").hexdigest(), data=b"abc").encode()


def end(seq: int, t: int) -> bytes:
    return m.EpisodeEnd(header=_header(seq, t), outcome=m.EpisodeOutcome.TERMINAL).encode()


def recycled(seq: int, t: int) -> bytes:
    return m.SandboxLifecycle(header=_header(seq, t, episode=None),
                              state=m.LifecycleState.RECYCLED).encode()


def processor() -> ReorderProcessor:
    s = Settings()
    s.topics.prefix = "t"
    s.replay = ReplaySettings(gap_timeout_ms=TIMEOUT)
    return ReorderProcessor(s)


def feed(p: ReorderProcessor, records: list[InRecord]) -> list[OutRecord]:
    outs: list[OutRecord] = []
    for r in records:
        outs.extend(p.handle(r))
    return outs


def replay_view(outs: list[OutRecord]) -> dict[str, Any]:
    """What the outputs say: replayed seqs in order, gap markers, late records."""
    seqs: list[int] = []
    gaps: list[tuple[int, int]] = []
    late = 0
    for o in outs:
        if o.topic == "t.late":
            late += 1
            continue
        if not o.topic.startswith("t.replay."):
            continue
        seg = codec.decode(o.value).record
        if seg["gap"] is not None:
            gaps.append((seg["gap"]["from_seq"], seg["gap"]["to_seq"]))
        seqs.extend(codec.decode(e).record["header"]["seq"] for e in seg["events"])
    return {"seqs": seqs, "gaps": gaps, "late": late}


def test_a_gap_opened_on_the_leading_topic_waits_for_the_lagging_one() -> None:
    """The chunks topic is read ~100 s behind the events topic. Seq 1 (a trace chunk) was
    written between seqs 0 and 2 but is read only when the chunks topic catches up: by then
    the clock (its watermark) has moved 99 s, far past "clock when the gap opened + timeout",
    yet the gap must still be open, because seq 2 was written only 0.1 s before seq 1."""
    log = Log()
    p = processor()
    t = T0 + 100_000
    records = [log.tick(EVENTS, T0), log.tick(CHUNKS, T0),
               *log.ticks(EVENTS, T0 + 1000, t),
               log.rec(EVENTS, start(t), t), log.rec(EVENTS, call(2, t + 200), t + 200),
               log.rec(EVENTS, end(3, t + 300), t + 300),
               *log.ticks(CHUNKS, T0 + 1000, t),  # the lagging topic catches up ...
               log.rec(CHUNKS, chunk(1, t + 100), t + 100),  # ... to the missing seq
               *log.ticks(CHUNKS, t + 1000, t + 2 * TIMEOUT),
               *log.ticks(EVENTS, t + 1000, t + 2 * TIMEOUT)]
    assert replay_view(feed(p, records)) == {"seqs": [0, 1, 2, 3], "gaps": [], "late": 0}


def test_after_a_restore_a_stale_clock_does_not_close_gaps_of_new_records() -> None:
    """A worker dies at T0+10 s; the next one restores the changelog (clock T0+10 s) and starts
    ticking two minutes later. Its first tick on the chunks topic moves the clock 2 minutes at
    once; a gap opened by a live record just before must not close then: seq 1 is the next
    record of the chunks topic."""
    log = Log()
    first = processor()
    feed(first, [*log.ticks(EVENTS, T0, T0 + 10_000), *log.ticks(CHUNKS, T0, T0 + 10_000)])
    second = processor()
    for key, blob in first.take_dirty().items():
        assert blob is not None
        second.restore(key, blob)

    t = T0 + 130_000  # the new worker's first ticks, then live traffic
    records = [*log.ticks(EVENTS, t, t + 5000),
               log.rec(EVENTS, start(t + 5000), t + 5000),
               log.rec(EVENTS, call(2, t + 5200), t + 5200),
               log.rec(EVENTS, end(3, t + 5300), t + 5300),
               log.tick(CHUNKS, t),  # the clock jumps 2 minutes here
               log.rec(CHUNKS, chunk(1, t + 5100), t + 5100),
               *log.ticks(CHUNKS, t + 1000, t + 2 * TIMEOUT),
               *log.ticks(EVENTS, t + 6000, t + 2 * TIMEOUT)]
    assert replay_view(feed(second, records)) == {"seqs": [0, 1, 2, 3], "gaps": [],
                                                  "late": 0}


def test_a_real_gap_still_closes_one_timeout_after_the_log_time_of_its_opening_record() -> None:
    """The same lagging-topic log without seq 1: the gap is declared once the clock passes
    (log time of seq 2) + timeout, not earlier and not later."""
    log = Log()
    p = processor()
    t = T0 + 100_000
    opened = t + 200
    outs = feed(p, [log.tick(EVENTS, T0), log.tick(CHUNKS, T0),
                    *log.ticks(EVENTS, T0 + 1000, t + 2 * TIMEOUT),
                    log.rec(EVENTS, start(t), t), log.rec(EVENTS, call(2, opened), opened),
                    *log.ticks(CHUNKS, T0 + 1000, opened + TIMEOUT - 200)])
    assert replay_view(outs)["gaps"] == []  # the clock is 200 ms short of the deadline
    outs += feed(p, [log.tick(CHUNKS, opened + TIMEOUT)])
    assert replay_view(outs) == {"seqs": [0, 2], "gaps": [(1, 1)], "late": 0}


def test_the_recycle_grace_counts_from_the_recycled_records_log_time() -> None:
    """RECYCLED is read from the leading events topic while the chunks topic lags 100 s; the
    episode's last trace chunk, written just before the recycle, is still in flight on the
    chunks topic. The grace (one gap timeout) must not run out before it is read."""
    log = Log()
    p = processor()
    t = T0 + 100_000
    records = [log.tick(EVENTS, T0), log.tick(CHUNKS, T0),
               *log.ticks(EVENTS, T0 + 1000, t),
               log.rec(EVENTS, start(t - 50_000), t - 50_000),
               log.rec(EVENTS, recycled(7, t + 300), t + 300),
               *log.ticks(CHUNKS, T0 + 1000, t),
               log.rec(CHUNKS, chunk(1, t + 100), t + 100),
               *log.ticks(CHUNKS, t + 1000, t + 2 * TIMEOUT),
               *log.ticks(EVENTS, t + 1000, t + 2 * TIMEOUT)]
    view = replay_view(feed(p, records))
    assert view["seqs"] == [0, 1] and view["late"] == 0


def test_replay_records_are_keyed_by_sandbox_and_episode_and_spread_over_partitions() -> None:
    """Episode ids repeat across sandboxes (every sandbox has an episode "00001"): replay
    records are keyed ``sandbox/episode``, so one episode stays in one partition while a
    fleet's episodes use every partition of the replay topic (keyed by the bare episode id,
    30 sandboxes' "00001" would all land in one partition)."""
    from aiokafka.partitioner import DefaultPartitioner

    p = processor()
    log = Log()
    outs: list[OutRecord] = []
    for i in range(30):
        sb = f"sb-{i}"
        hdr = m.Envelope(event_id=f"{sb}-0", task="task-a", sandbox=sb, episode="00001", seq=0,
                         event_time_ms=T0, producer_id="test")
        outs += feed(p, [log.rec(EVENTS, m.EpisodeStart(header=hdr).encode(), T0, sb.encode())])
    replay = [o for o in outs if o.topic == "t.replay.task-a"]
    assert len(replay) == 30
    assert {o.key for o in replay} == {f"sb-{i}/00001".encode() for i in range(30)}
    partitions = list(range(6))
    used = {DefaultPartitioner()(o.key, partitions, partitions) for o in replay}
    assert used == set(partitions)


# -- the per-sandbox open-episode limit while one topic lags ---------------------------------
LIMIT = 3


def limited(limit: int = LIMIT) -> ReorderProcessor:
    s = Settings()
    s.topics.prefix = "t"
    s.replay = ReplaySettings(gap_timeout_ms=TIMEOUT, max_open_episodes_per_sandbox=limit)
    return ReorderProcessor(s)


def _ep_header(episode: str, seq: int, t: int) -> m.Envelope:
    return m.Envelope(event_id=f"{episode}-{seq}", task="task-a", sandbox="sb-1",
                      episode=episode, seq=seq, event_time_ms=t, producer_id="test")


def sequential_episodes(log: Log, n: int, t0: int, every: int) -> tuple[list[InRecord],
                                                                          list[InRecord]]:
    """One sandbox running ``n`` episodes one after the other, one every ``every`` ms: start
    and tool call on the events topic, the end on the chunks topic. Returns the records of
    each topic (with a tick every second), in log order."""
    evs: list[tuple[int, bytes]] = []
    chs: list[tuple[int, bytes]] = []
    for i in range(n):
        t, ep = t0 + i * every, f"ep-{i}"
        evs.append((t, m.EpisodeStart(header=_ep_header(ep, 0, t)).encode()))
        evs.append((t + 1, m.ToolCall(header=_ep_header(ep, 1, t + 1), call_id="c",
                                      tool="exec", args_hash="0" * 64).encode()))
        chs.append((t + 2, m.EpisodeEnd(header=_ep_header(ep, 2, t + 2),
                                        outcome=m.EpisodeOutcome.TERMINAL).encode()))
    stop = t0 + n * every + 2 * TIMEOUT
    out = []
    for topic, items in ((EVENTS, evs), (CHUNKS, chs)):
        ticks = [(t, None) for t in range(t0, stop, 1000)]
        merged = sorted(ticks + items, key=lambda x: (x[0], x[1] is not None))
        out.append([log.tick(topic, t) if v is None else log.rec(topic, v, t)
                    for t, v in merged])
    return out[0], out[1]


def delivered(outs: list[OutRecord]) -> dict[str, list[int]]:
    """Episode -> seqs replayed, for the episodes whose last segment was written."""
    seqs: dict[str, list[int]] = {}
    ended = set()
    for o in outs:
        if o.topic.startswith("t.replay."):
            seg = codec.decode(o.value).record
            ep = seg["header"]["episode"]
            seqs.setdefault(ep, []).extend(codec.decode(e).record["header"]["seq"]
                                           for e in seg["events"])
            if seg["is_last"]:
                ended.add(ep)
    return {ep: s for ep, s in seqs.items() if ep in ended}


def dead_letters(outs: list[OutRecord]) -> list[Any]:
    return [codec.decode(o.value).record for o in outs if o.topic == "t.deadletter"]


def test_a_lagging_topic_does_not_make_a_sandbox_look_over_its_open_episode_limit() -> None:
    """A sandbox runs 20 short episodes one after the other; their ends travel on the chunks
    topic, which the worker reads only after the whole events topic (a fetch of one topic
    stalled, as under load). Read that way, the sandbox seems to have 20 episodes open at once,
    far over its limit of 3 -- but never more than one was open in the log. Every episode is
    replayed whole; nothing is dead-lettered."""
    from trajbus.consumers.engine import metrics

    log = Log()
    events, chunks = sequential_episodes(log, 20, T0, every=100)
    p = limited()
    outs = feed(p, [*events, chunks[0]])  # the chunks topic's first tick: the clock at T0
    assert metrics.REORDER_HELD._value.get() > 0  # the operator's view: events are held
    outs += feed(p, chunks[1:])
    assert metrics.REORDER_HELD._value.get() == 0
    assert dead_letters(outs) == []
    assert delivered(outs) == {f"ep-{i}": [0, 1, 2] for i in range(20)}
    counters = p.core.counters()
    assert counters["held_events"] > 0 and counters["held"] == 0  # held, then all admitted
    assert counters["episodes_refused"] == 0


def test_a_flood_of_open_episodes_is_still_refused_and_names_its_records() -> None:
    """A sandbox opens 8 episodes it never ends, both topics read in step: the first 3 (the
    limit) are replayed, the other 5 are dead letters ``too_many_open_episodes`` once the clock
    reaches them, each naming its own source record (topic, offset), which `deadletters
    redrive` sends back."""
    log = Log()
    p = limited()
    t = T0 + 10_000
    # healthy partitions: a tick a second on each (a silent stretch would be an outage, which
    # stops the clock: engine/log_silence.py)
    ticks = [r for pair in zip(log.ticks(EVENTS, T0, t - 1000), log.ticks(CHUNKS, T0, t - 1000),
                               strict=True) for r in pair]
    starts = [log.rec(EVENTS, m.EpisodeStart(header=_ep_header(f"ep-{i}", 0, t + i)).encode(),
                      t + i) for i in range(8)]
    outs = feed(p, [*ticks, *starts])
    assert dead_letters(outs) == []  # ahead of the clock: held, not yet judged
    outs += feed(p, [log.tick(EVENTS, t + 1000)])
    assert dead_letters(outs) == []  # the chunks topic has not been read that far
    outs += feed(p, [log.tick(CHUNKS, t + 1000)])
    dls = dead_letters(outs)
    assert [d["header"]["episode"] for d in dls] == [f"ep-{i}" for i in range(3, 8)]
    assert {d["reason_code"] for d in dls} == {"too_many_open_episodes"}
    assert [(d["source_topic"], d["source_offset"]) for d in dls] == [
        (EVENTS, r.offset) for r in starts[3:]]
    assert [(d["original_key"], d["original_value"]) for d in dls] == [
        (r.key, r.value) for r in starts[3:]]
    replayed = {codec.decode(o.value).record["header"]["episode"] for o in outs
                if o.topic.startswith("t.replay.")}
    assert replayed == {"ep-0", "ep-1", "ep-2"}


def test_held_events_survive_a_restore_with_the_same_decisions_and_timers() -> None:
    """Cut the lagging-topic log while events are held: a processor restored from the first
    one's changelog ends with the same outputs and the same internal sizes (held events,
    timers) as an uninterrupted run."""
    log = Log()
    events, chunks = sequential_episodes(log, 20, T0, every=100)
    records = [*events, *chunks]
    cut = len(events) * 2 // 3  # the chunks topic not read yet: events are held
    whole = limited()
    expected = feed(whole, records)

    first = limited()
    head = feed(first, records[:cut])
    assert first.core.counters()["held"] > 0
    second = limited()
    for key, blob in first.take_dirty().items():
        second.restore(key, blob)
    tail = feed(second, records[cut:])
    assert [(o.topic, o.key, o.value) for o in head + tail] == [
        (o.topic, o.key, o.value) for o in expected]
    gauges = ("held", "episodes_open", "tombstones", "buffered", "buffered_bytes")
    assert {g: second.core.counters()[g] for g in gauges} == {
        g: whole.core.counters()[g] for g in gauges}
    assert len(second.core._timers) == len(whole.core._timers)


def test_a_corrupt_held_events_record_fails_the_restore_with_its_key() -> None:
    """A changelog record of held events this version cannot read stops the restore (the
    worker fails fast at start-up) and names the key, like a corrupt episode record."""
    p = limited()
    for blob in (b"\x01Hgarbage", b"\x09Hx", b"\x01H" + b"\x00" * 3):
        with pytest.raises(ValueError, match="@held/sb-1"):
            p.restore("@held/sb-1", blob)


# -- held events, at the core: order among a sandbox's episodes ------------------------------
def _core(limit: int) -> Any:
    from trajbus.consumers.replay.core import ReorderCore

    return ReorderCore(ReplaySettings(gap_timeout_ms=1000, max_open_episodes_per_sandbox=limit),
                       event_time_clock=False)


def _ev(episode: str, seq: int, log_time: int, end: bool = False) -> Any:
    from trajbus.consumers.replay.core import InEvent

    kind = "EpisodeStart" if seq == 0 else "EpisodeEnd" if end else "ToolCall"
    return InEvent("task-a", "sb-1", episode, seq, log_time, kind, f"{episode}/{seq}".encode(),
                   "TERMINAL" if end else None, log_time_ms=log_time)


def _verdicts(outs: list[Any]) -> list[tuple[str, str, int]]:
    from trajbus.consumers.replay.core import DeadLetterOut, SegmentOut

    return [("segment" if isinstance(o, SegmentOut) else o.reason_code
             if isinstance(o, DeadLetterOut) else "late", o.episode,
             o.first_seq if isinstance(o, SegmentOut) else o.seq) for o in outs]


def test_a_later_episode_does_not_take_the_slot_of_an_earlier_held_one() -> None:
    """Limit 1, the events topic read ahead: ep1 (log time 2 s) is held while ep0 looks open;
    ep0's end (1.01 s) frees the slot, then ep2 (3 s) arrives. ep1 came first in the log, so
    ep2 queues behind it: all three episodes are replayed, one open at a time."""
    c = _core(limit=1)
    c.tick(1000)
    outs = []
    for ev in (_ev("ep0", 0, 1000), _ev("ep1", 0, 2000), _ev("ep0", 1, 1010, end=True),
               _ev("ep2", 0, 3000), _ev("ep1", 1, 2010, end=True)):
        outs += c.handle(ev)
    outs += c.tick(2500)  # ep1 is judged while ep2 has begun (and not ended)
    outs += c.handle(_ev("ep2", 1, 3010, end=True)) + c.tick(5000)
    assert sorted(_verdicts(outs)) == [("segment", ep, s) for ep in ("ep0", "ep1", "ep2")
                                       for s in (0, 1)]


def test_an_episode_is_judged_as_one_whatever_the_log_times_of_its_events() -> None:
    """ep1's seq 1 was written (1.5 s) before its seq 0 (2 s), read after it: it joins its held
    episode and is judged with it, never refused on its own while seq 0 is admitted."""
    c = _core(limit=1)
    c.tick(1000)
    outs = c.handle(_ev("epA", 0, 1000)) + c.handle(_ev("ep1", 0, 2000))
    outs += c.tick(1600) + c.handle(_ev("ep1", 1, 1500))
    outs += c.handle(_ev("epA", 1, 1700, end=True)) + c.tick(2100)
    outs += c.handle(_ev("ep1", 2, 2200, end=True)) + c.tick(3000)
    assert [v for v in _verdicts(outs) if v[1] == "ep1"] == [
        ("segment", "ep1", 0), ("segment", "ep1", 1), ("segment", "ep1", 2)]


def test_a_drained_final_seq_of_a_held_episode_is_applied_when_it_is_admitted() -> None:
    """A sandbox drains while its second episode is held: the Drained's final seq for it is
    held too and applied once the episode is admitted, which then ends truncated instead of
    staying open (and taking the sandbox's one slot) until the idle timeout."""
    from trajbus.consumers.replay.core import InEvent

    c = _core(limit=1)
    c.tick(1000)
    outs = c.handle(_ev("ep0", 0, 1000)) + c.handle(_ev("ep1", 0, 2000))
    outs += c.handle(_ev("ep1", 1, 2001))
    drained = InEvent("task-a", "sb-1", None, 7, 2100, "Drained", b"drained", None,
                      final_seqs=(("ep1", 1),), log_time_ms=2100)
    outs += c.handle(drained)
    outs += c.handle(_ev("ep0", 1, 1010, end=True)) + c.tick(3000)
    ends = [o for o in outs if getattr(o, "is_last", False)]
    assert [(o.episode, o.is_terminal) for o in ends] == [("ep0", True), ("ep1", False)]
    assert c.counters()["episodes_open"] == 0


# -- an input partition's outage (a dead leader) stops the clock ------------------------------
OUTAGE_TIMEOUT = 5_000  # the default gap timeout: shorter than a leader failover


def outage_processor() -> ReorderProcessor:
    s = Settings()
    s.topics.prefix = "t"
    s.replay = ReplaySettings(gap_timeout_ms=OUTAGE_TIMEOUT)
    return ReorderProcessor(s)


def leader_failover_log(log: Log, *, lost: bool = False) -> tuple[list[InRecord], list[InRecord]]:
    """The shape measured on a 3-node cluster (2026-12-05) when the leader of both input
    partitions was SIGKILLed: chunks 1 and 3 are written just before the crash; chunk 4,
    produced before the crash too, sits in its producer's retries through the 5.5 s failover
    and is written after the six ticks queued meanwhile (which claim times up to 0.1 s before
    it) and after seqs 2 and 5 on the events partition. ``lost``: chunk 4 never comes (a real
    gap). Returns (events, chunks) records."""
    crash, back = T0 + 9_600, T0 + 15_100
    events = [*log.ticks(EVENTS, T0, T0 + 9_000), log.rec(EVENTS, start(T0 + 500), T0 + 9_100)]
    chunks = [*log.ticks(CHUNKS, T0, T0 + 9_000),
              log.rec(CHUNKS, chunk(1, T0 + 9_400), T0 + 9_400),
              log.rec(CHUNKS, chunk(3, T0 + 9_500), T0 + 9_500)]
    # the queued ticks (created during the outage) and what follows, written from `back` on
    for topic, out in ((EVENTS, events), (CHUNKS, chunks)):
        for tick_time in range(crash + 400, back, 1_000):
            tick = log.tick(topic, tick_time)
            out.append(InRecord(*tick[:5], back))
    if not lost:
        chunks.append(log.rec(CHUNKS, chunk(4, T0 + 9_550), back + 100))
    events.append(log.rec(EVENTS, call(2, T0 + 9_300), back + 150))
    events.append(log.rec(EVENTS, end(5, back + 200), back + 200))
    events += log.ticks(EVENTS, back + 900, back + 30_000)
    chunks += log.ticks(CHUNKS, back + 900, back + 30_000)
    return events, chunks


@pytest.mark.parametrize("order", ["events first", "chunks first", "interleaved by log time"])
def test_a_record_delayed_by_a_leader_failover_is_no_gap(order: str) -> None:
    """Before the fix (timers on log time alone) the live order -- the events partition read
    ahead -- closed seq 4 as a gap and sent it late: chunk 3 restarted the stall at its
    pre-crash log time, and the queued ticks moved the clock past that deadline while chunk 4
    was still in its producer. Time stands still while an input partition is silent, so
    chunk 4 has the gap timeout after the failover to arrive."""
    log = Log()
    events, chunks = leader_failover_log(log)
    if order == "events first":
        records = events + chunks
    elif order == "chunks first":
        records = chunks + events
    else:
        records = sorted(events + chunks, key=lambda r: (r.timestamp_ms, r.topic))
    view = replay_view(feed(outage_processor(), records))
    assert view == {"seqs": [0, 1, 2, 3, 4, 5], "gaps": [], "late": 0}


def test_a_real_gap_still_closes_after_an_outage() -> None:
    """The clock stops during the silence, not for good: a seq that never comes is declared
    missing once the partitions have served the gap timeout again."""
    log = Log()
    events, chunks = leader_failover_log(log, lost=True)
    view = replay_view(feed(outage_processor(), events + chunks))
    assert view == {"seqs": [0, 1, 2, 3, 5], "gaps": [(4, 4)], "late": 0}


def test_the_silences_survive_a_restore() -> None:
    """A worker that restores from the changelog mid-way decides exactly as one that ran
    through: the silences are part of the processor's state."""
    log = Log()
    events, chunks = leader_failover_log(log)
    records = events + chunks
    whole = replay_view(feed(outage_processor(), records))
    cut = len(events) + 14  # in the chunks' outage burst, before chunk 4
    first = outage_processor()
    outs = feed(first, records[:cut])
    changelog = first.take_dirty()
    second = outage_processor()
    for key, blob in changelog.items():
        second.restore(key, blob)
    outs += feed(second, records[cut:])
    assert replay_view(outs) == whole == {"seqs": [0, 1, 2, 3, 4, 5], "gaps": [], "late": 0}


def test_log_silences_merge_and_measure() -> None:
    from trajbus.consumers.engine.log_silence import LogSilences

    s = LogSilences(allowance_ms=2_000)
    for t in (0, 1_000, 2_000):
        s.observe("a", t)
        s.observe("b", t)
    assert s.serving(2_500) == 2_500  # healthy: serving time is log time
    s.observe("a", 10_000)  # a was silent from 4,000 (2,000 + allowance) to 10,000
    assert s.serving(10_000) == 4_000 and s.serving(3_000) == 3_000
    s.observe("b", 12_000)  # b's silence [4,000, 12,000) overlaps a's: counted once
    assert s.silent_before(12_000) == 8_000 and s.serving(13_000) == 5_000
    s.observe("a", 9_000)  # older than a's latest: not a silence
    assert s.silent_before(20_000) == 8_000
    restored = LogSilences(allowance_ms=2_000)
    restored.unpack(s.pack())
    assert restored.serving(13_000) == 5_000 and restored.last == s.last
    s.fold(12_000 + 3_600_000 + 1)  # long past: folded into one total, same serving times
    assert s.starts == [] and s.serving(3_700_000) == 3_700_000 - 8_000
    with pytest.raises(ValueError):
        restored.unpack(b"{not json")
