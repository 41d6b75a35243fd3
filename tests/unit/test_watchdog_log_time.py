"""The watchdog's timers count from the log, never from a clock that runs ahead of or behind it.

Issue 37, item 1. The watchdog's timers (idle eviction, the stall alert, the end of a loop by
eviction) used to be judged by the runner's ticks: wall-clock times from the worker's ticker,
read from their own topic in whatever order the consumer interleaves it with the replay topics,
compared with the *sandboxes'* event times. A tick read between two segments of an episode --
after a restart (the tick topic read ahead of the replay backlog), or always, for a sandbox
whose clock lags the broker by more than the idle timeout -- evicted the stream as idle, and
the loop count started over: the planted loop was never caught. The same log replayed by
`trajbus replay explain` (partitions merged by timestamp) or `trajbus watchdog explain
--from-log` (no ticks) caught it: the tools contradicted each other.

Now a stream's timers are judged in the log time of its own replay partition (the records'
Kafka timestamps): decisions depend only on each partition's records in log order, wherever
ticks fall and whatever the sandboxes' clocks say.

Pure: the same WatchdogProcessor the runner and `replay explain` use, fed InRecords as a
consumer would hand them over. No broker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from typing import Any

import pytest
from aiokafka import TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajbus.bus.settings import Settings
from trajbus.consumers.engine.processors import WatchdogProcessor, watchdog_spec
from trajbus.consumers.engine.runner import InRecord, OutRecord
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

codec = default_codec()
REPLAY = "t.replay.task-a"
TICKS = "t.watchdog.ticks"
ALERTS, DECISIONS, DEADLETTER = "t.watchdog.alerts", "t.scheduler.decisions", "t.deadletter"
T0 = 1_767_225_600_000
SECOND, MINUTE, HOUR = 1000, 60_000, 3_600_000

# one (event time, encoded event) per event of an episode, in seq order
Events = list[tuple[int, bytes]]


def settings_t() -> Settings:
    s = Settings()
    s.topics.prefix = "t"
    return s


def processor() -> WatchdogProcessor:
    return WatchdogProcessor(settings_t())


# -- an episode's events ---------------------------------------------------------------------
class Ep:
    """Events of one episode on the sandbox's own clock (``t0``: its event time)."""

    def __init__(self, sandbox: str, episode: str, t0: int) -> None:
        self.sandbox, self.episode, self.t = sandbox, episode, t0
        self.seq = 0
        self.calls = 0
        self.events: Events = []

    def _h(self, dt: int) -> m.Envelope:
        self.t += dt
        h = m.Envelope(event_id=f"{self.sandbox}-{self.episode}-{self.seq}", task="task-a",
                       sandbox=self.sandbox, episode=self.episode, seq=self.seq,
                       event_time_ms=self.t, producer_id="sidecar")
        self.seq += 1
        return h

    def start(self) -> Ep:
        self.events.append((self.t, m.EpisodeStart(header=self._h(0)).encode()))
        return self

    def call(self, tool: str = "browser_click", args: str = "a", dt: int = 10 * SECOND) -> Ep:
        cid = f"c{self.calls}"
        self.calls += 1
        h = self._h(dt)
        self.events.append((self.t, m.ToolCall(header=h, call_id=cid, tool=tool,
                                               args_hash=args * 64).encode()))
        return self

    def result(self, res: str = "b", dt: int = 500) -> Ep:
        cid = f"c{self.calls - 1}"
        h = self._h(dt)
        self.events.append((self.t, m.ToolResult(header=h, call_id=cid, tool="browser_click",
                                                 status=m.ToolStatus.OK,
                                                 result_hash=res * 64).encode()))
        return self

    def pairs(self, n: int, *, args: str = "a", res: str = "b", dt: int = 10 * SECOND) -> Ep:
        for k in range(n):
            self.call(args=args if args != "*" else "0123456789abcdef"[k % 16], dt=dt)
            self.result(res)
        return self

    def end(self, dt: int = SECOND) -> Ep:
        h = self._h(dt)
        self.events.append((self.t, m.EpisodeEnd(header=h,
                                                 outcome=m.EpisodeOutcome.TERMINAL).encode()))
        return self


def loop_episode(sandbox: str = "sb-1", episode: str = "ep-loop", t0: int = T0,
                 calls: int = 24) -> Ep:
    """``calls`` identical clicks 10 s apart with identical results: a loop by the default
    rule (>= 20 repeats over >= 2 min, 0 result changes) from the 20th call on."""
    return Ep(sandbox, episode, t0).start().pairs(calls).end()


# -- the replay log ---------------------------------------------------------------------------
class Log:
    """Records as the watchdog's consumer hands them over (offsets per topic-partition)."""

    def __init__(self) -> None:
        self.offsets: dict[tuple[str, int], int] = {}
        self.index: dict[tuple[str, str], int] = {}

    def _rec(self, topic: str, partition: int, key: bytes, value: bytes, ts: int) -> InRecord:
        off = self.offsets.get((topic, partition), 0)
        self.offsets[(topic, partition)] = off + 1
        return InRecord(topic, partition, off, key, value, ts)

    def segment(self, ep: Ep, events: Events, log_time: int, partition: int = 0,
                last: bool = False) -> InRecord:
        """One ReplaySegment of ``ep`` carrying ``events``, written at ``log_time``."""
        i = self.index.get((ep.sandbox, ep.episode), 0)
        self.index[(ep.sandbox, ep.episode)] = i + 1
        first = codec.decode(events[0][1]).header["seq"]
        seg = m.ReplaySegment(
            header=m.Envelope(event_id=f"seg-{ep.sandbox}-{ep.episode}-{i}", task="task-a",
                              sandbox=ep.sandbox, episode=ep.episode, seq=i,
                              event_time_ms=events[-1][0], producer_id="trajbus.reorder"),
            first_seq=first, last_seq=first + len(events) - 1, events=[v for _, v in events],
            is_first=first == 0, is_last=last, is_terminal=last)
        return self._rec(REPLAY, partition, f"{ep.sandbox}/{ep.episode}".encode(),
                         seg.encode(), log_time)

    def tick(self, t: int, partition: int = 0) -> InRecord:
        return self._rec(TICKS, partition, b"_tick", _tick_value(t, partition), t)


@functools.cache
def _tick_value(t: int, partition: int) -> bytes:
    """The encoded Tick of time ``t``, built once: the property test reads hundreds of
    thousands of ticks, and the same (time, partition) twice is a re-delivered tick."""
    return m.Tick(header=m.Envelope(task="_tick", sandbox="_tick", seq=0, event_time_ms=t,
                                    producer_id="t.watchdog.w0")).encode()


def segments(log: Log, ep: Ep, *, lag: int = 0, per: int = 2, partition: int = 0,
             pauses: dict[int, int] | None = None) -> list[InRecord]:
    """``ep``'s events as segments of ``per`` events, each written when its last event
    happened on the broker's clock (event time + ``lag``: the sandbox's clock lags the broker
    by ``lag``) plus the pauses of ``pauses`` (segment index -> extra log delay from then on,
    e.g. a broker outage)."""
    out = []
    extra = 0
    evs = ep.events
    for i, k in enumerate(range(0, len(evs), per)):
        extra += (pauses or {}).get(i, 0)
        chunk = evs[k:k + per]
        out.append(log.segment(ep, chunk, chunk[-1][0] + lag + extra, partition,
                               last=k + per >= len(evs)))
    return out


def with_ticks(log: Log, records: list[InRecord], every: int = SECOND,
               partitions: Iterable[int] = (0,)) -> list[InRecord]:
    """An undisturbed run: a tick every ``every`` ms of log time in every tick partition, read
    in log-time order with the replay records (as a consumer that keeps up would)."""
    if not records:
        return []
    lo = min(r.timestamp_ms for r in records)
    hi = max(r.timestamp_ms for r in records)
    ticks = [log.tick(t, p) for t in range(lo - lo % every, hi + 2 * every, every)
             for p in partitions]
    return sorted(records + ticks, key=lambda r: (r.timestamp_ms, r.topic == REPLAY))


def feed(p: WatchdogProcessor, records: Iterable[InRecord]) -> list[OutRecord]:
    outs: list[OutRecord] = []
    for r in records:
        outs.extend(p.handle(r))
    return outs


def decided(outs: Iterable[OutRecord], *, times: bool = False) -> list[tuple[Any, ...]]:
    """What the outputs decide: alerts and decisions with their evidence and ids (and their
    stamped times only with ``times``: a lagging sandbox clock shifts them), dead letters."""
    out: list[tuple[Any, ...]] = []
    for o in outs:
        d = codec.decode(o.value)
        h, r = d.header, d.record
        stamp = (h["event_time_ms"],) if times else ()
        if d.kind == "WatchdogAlert":
            out.append(("alert", r["alert"], h["sandbox"], h["episode"], r["first_seq"],
                        r["last_seq"], r["repeat_count"], r["span_ms"], r["distinct_results"],
                        h["event_id"], *stamp))
        elif d.kind == "SchedulingDecision":
            out.append(("decision", r["decision"], h["sandbox"], h["episode"], h["event_id"],
                        tuple(sorted(r["details"].items())), *stamp))
        else:
            out.append((d.kind, o.topic))
    return out


def loops(outs: Iterable[OutRecord]) -> list[tuple[Any, ...]]:
    return [d for d in decided(outs) if d[:2] == ("alert", "LOOP")]


def restarted(p: WatchdogProcessor) -> WatchdogProcessor:
    """A new worker's processor, restored from the first one's changelog."""
    fresh = processor()
    for key, blob in p.take_dirty().items():
        fresh.restore(key, blob)
    return fresh


# -- 1. a tick between a loop's segments ------------------------------------------------------
@pytest.mark.parametrize("cut", [3, 10, 12, 13, 20, 24])
def test_a_tick_read_between_a_loops_segments_does_not_start_its_count_over(cut: int) -> None:
    """The watchdog was down for two hours while the reorder wrote an episode's 24 looping
    calls (one segment per call and result). Its restarted incarnation reads its tick topic
    ahead of the replay backlog: the first tick (two hours after the episode) is read between
    two of the episode's segments. The stream is not idle in its log (its segments are 10 s
    apart), so the loop is caught exactly once, as in an undisturbed run, and ends with the
    episode. Before: the tick evicted the stream as idle (1 h) and the count started over
    after it: a later LOOP with other evidence (cut 3), or none at all."""
    log = Log()
    ep = loop_episode()
    segs = segments(log, ep)
    undisturbed = decided(feed(processor(), with_ticks(log, segs)))
    assert [d[1] for d in undisturbed if d[0] == "alert"] == ["LOOP", "LOOP_ENDED"]
    assert [d[1] for d in undisturbed if d[0] == "decision"] == ["TERMINATE"]

    late = segs[-1].timestamp_ms + 2 * HOUR  # the restarted worker's wall clock
    records = [*segs[:cut], log.tick(late), log.tick(late + SECOND), *segs[cut:],
               log.tick(late + 2 * SECOND)]
    outs = feed(processor(), records)
    assert len(loops(outs)) == 1
    assert decided(outs) == undisturbed


def test_a_restored_worker_whose_first_tick_lands_mid_loop_still_catches_it_once() -> None:
    """The same, with the restart made explicit: the first worker processes 12 of the calls
    (ticks as it goes) and dies; the second restores its changelog, reads a tick of its own
    wall clock (an hour and a half later) before the rest of the episode."""
    log = Log()
    ep = loop_episode()
    segs = segments(log, ep)
    undisturbed = decided(feed(processor(), with_ticks(log, segs)))

    first = processor()
    head = with_ticks(log, segs[:7])
    outs = feed(first, head)
    second = restarted(first)
    late = segs[-1].timestamp_ms + 90 * MINUTE
    outs += feed(second, [log.tick(late), *segs[7:], log.tick(late + SECOND)])
    assert len(loops(outs)) == 1
    assert decided(outs) == undisturbed


# -- 2. a sandbox whose clock lags the broker by hours ----------------------------------------
def test_a_sandbox_clock_hours_behind_the_broker_gets_the_same_alerts() -> None:
    """The sandbox's clock is 3 hours behind the broker's; the watchdog keeps up (a tick every
    second, in log order). Its loop is caught once, exactly as for a sandbox with a right
    clock; and a call it waits on for 2 minutes (well under the 10 min stall threshold) raises
    no STALL. Before: every tick found the stream idle for 3 hours -- evicted it (the loop
    count started over every second: no LOOP) and flagged the open call as stalled."""
    def run(lag: int) -> list[OutRecord]:
        log = Log()
        ep = Ep("sb-1", "ep-loop", T0 - lag).start().call(args="5").result(dt=2 * MINUTE)
        ep.pairs(24).end()
        return feed(processor(), with_ticks(log, segments(log, ep, lag=lag)))

    right, lagging = run(0), run(3 * HOUR)
    assert len(loops(right)) == 1
    assert decided(lagging) == decided(right)
    # and the stamps differ by the lag only: the events' own times
    assert [d[-1] + 3 * HOUR for d in decided(lagging, times=True) if d[0] == "alert"] == [
        d[-1] for d in decided(right, times=True) if d[0] == "alert"]


def test_a_sandbox_clock_ahead_of_the_broker_is_still_evicted_after_an_hour_of_its_log() -> None:
    """The other direction: a sandbox clock 3 hours *ahead*. An abandoned episode (no end)
    is evicted after an hour of its partition's log, as for a right clock; before, no tick
    could ever reach its event time plus an hour in time, and it stayed tracked for 4 hours."""
    for lag in (0, -3 * HOUR):
        log = Log()
        abandoned = Ep("sb-1", "ep-gone", T0 - lag).start().call().result()
        busy = Ep("sb-2", "ep-busy", T0 - lag).start().pairs(400, args="*", dt=15 * SECOND)
        records = sorted(segments(log, abandoned, lag=lag) + segments(log, busy, lag=lag),
                         key=lambda r: r.timestamp_ms)
        p = processor()
        feed(p, with_ticks(log, records, every=10 * SECOND))
        assert [e.episode for e in p.core.explain("sb-1")] == [], lag
        assert [e.episode for e in p.core.explain("sb-2")] == ["ep-busy"], lag


# -- 3. determinism: wherever the ticks fall --------------------------------------------------
def _fleet_log(seed_pauses: list[int]) -> tuple[Log, list[InRecord]]:
    """Three sandboxes in two partitions: a loop, a cycle-free busy agent that waits 15 min on
    one call (a real STALL, in its partition's log), a loop split by a 70 min silence (evicted
    in the log: the count starts over, no alert), and a loop whose segments are delayed by
    ``seed_pauses`` (a broker outage between segments: the log shows it, alerts unchanged)."""
    log = Log()
    a = loop_episode("sb-a", "ep-1", T0)
    b = Ep("sb-b", "ep-1", T0).start().pairs(10, args="*").call(args="4")
    b.result(dt=15 * MINUTE).pairs(30, args="*").end()
    c = Ep("sb-c", "ep-1", T0).start().pairs(12).call(dt=70 * MINUTE).result().pairs(11).end()
    d = loop_episode("sb-d", "ep-2", T0 + 5 * SECOND, calls=30)
    pauses = {i: p for i, p in enumerate(seed_pauses)}
    records = (segments(log, a) + segments(log, b, partition=1) + segments(log, c)
               + segments(log, d, partition=1, pauses=pauses))
    return log, sorted(records, key=lambda r: (r.timestamp_ms, r.partition, r.offset))


def _partition_order(records: list[InRecord], order: list[int]) -> list[InRecord]:
    """Another interleaving of the partitions (each still in offset order), as a consumer may
    hand them over: ``order`` picks, at each step, which partition goes next."""
    queues: dict[tuple[str, int], list[InRecord]] = {}
    for r in records:
        queues.setdefault((r.topic, r.partition), []).append(r)
    keys = sorted(queues)
    out: list[InRecord] = []
    i = 0
    while any(queues.values()):
        live = [k for k in keys if queues[k]]
        k = live[order[i % len(order)] % len(live)] if order else live[0]
        out.append(queues[k].pop(0))
        i += 1
    return out


@pytest.mark.timeout(600)  # CPU-bound: 60 examples take ~25 s on a quiet box, 120+ at load 13
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ticks=st.lists(st.tuples(st.integers(0, 10_000), st.integers(-5 * HOUR, 5 * HOUR)),
                   max_size=12),
    order=st.lists(st.integers(0, 7), max_size=40),
    cut=st.integers(0, 10_000),
    pauses=st.lists(st.sampled_from([0, 0, 20 * SECOND, 2 * MINUTE]), max_size=8),
)
def test_decisions_do_not_depend_on_where_ticks_fall_nor_on_restarts(
        ticks: list[tuple[int, int]], order: list[int], cut: int, pauses: list[int]) -> None:
    """The same replay log, read (a) undisturbed: a tick every second in log order; (b) as after
    disruptions: the partitions interleaved otherwise, ticks of any time (hours ahead of or
    behind the records: a restarted worker's clock, a ticker read ahead) at any place, and the
    worker restarted from its changelog at any point. Same alerts and decisions, same ids."""
    log, records = _fleet_log(pauses)
    undisturbed = feed(processor(), with_ticks(log, records, partitions=(0, 1)))
    assert len(loops(undisturbed)) == 2

    disturbed = _partition_order(records, order)
    base = records[0].timestamp_ms
    for pos, dt in sorted(ticks, reverse=True):
        disturbed.insert(pos % (len(disturbed) + 1), log.tick(base + dt, pos % 2))
    at = cut % (len(disturbed) + 1)
    first = processor()
    outs = feed(first, disturbed[:at])
    outs += feed(restarted(first), disturbed[at:])

    def by_stream(outs: list[OutRecord]) -> dict[tuple[str, str], list[tuple[Any, ...]]]:
        got: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
        for d in decided(outs):
            got.setdefault((d[2], d[3]), []).append(d)
        return got

    # per stream, in order (streams of different partitions may interleave differently)
    assert by_stream(outs) == by_stream(undisturbed)


def test_the_fleet_log_exercises_every_timer() -> None:
    """The determinism test's log is not trivial: it has real STALLs (in the log), a stream
    evicted after 70 min of its partition's log with a call open (STALL, then evicted; its
    loop count starts over: no LOOP), and loops caught through an outage between segments."""
    log, records = _fleet_log([0, 0, 2 * MINUTE, 0, 20 * SECOND])
    got = decided(feed(processor(), with_ticks(log, records, partitions=(0, 1))))
    kinds = sorted((d[2], d[1]) for d in got if d[0] == "alert")
    assert kinds == [("sb-a", "LOOP"), ("sb-a", "LOOP_ENDED"), ("sb-b", "STALL"),
                     ("sb-c", "STALL"), ("sb-d", "LOOP"), ("sb-d", "LOOP_ENDED")]


# -- 4. the three operator tools agree ---------------------------------------------------------
def test_live_replay_explain_and_watchdog_explain_agree_on_a_log_with_a_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One log, a loop whose segments a restarted worker read around its first tick (two
    hours later). What the live worker wrote (what `trajbus alerts` lists), what `trajbus replay
    explain` re-derives (its re-run: the same adapter, partitions merged by record timestamp)
    and what `trajbus watchdog explain --from-log` tells (a fresh core over the sandbox's
    events) must agree: one LOOP, at the same seq, with the same id. Before: the live worker
    missed it while both tools found it."""
    from trajbus.consumers.operator import tools
    from trajbus.consumers.watchdog.core import output_event_id

    log = Log()
    ep = loop_episode()
    segs = segments(log, ep)
    late = segs[-1].timestamp_ms + 2 * HOUR
    live_order = [*segs[:9], log.tick(late), *segs[9:], log.tick(late + SECOND)]
    live = decided(feed(processor(), live_order))

    s = settings_t()
    spec = watchdog_spec(s)
    run = tools._Rerun("watchdog", spec.input_topics, spec.input_pattern, spec.factory, False)
    parts: dict[TopicPartition, list[InRecord]] = {}
    for r in live_order:
        parts.setdefault(TopicPartition(r.topic, r.partition), []).append(r)
    upto = {tp: len(recs) for tp, recs in parts.items()}
    rerun = decided(o for o, _ in tools._run_adapter(run, parts, upto))
    assert rerun == live  # `replay explain`: no divergence, and nothing missed

    entries = [tools.entry_from_decoded(codec.decode(v)) for _, v in ep.events]

    async def sandbox_log(*_: Any, **__: Any) -> list[Any]:
        return entries

    from trajbus.consumers.operator import watchdog_history

    monkeypatch.setattr(watchdog_history, "read_sandbox_log", sandbox_log)
    [history] = asyncio.run(tools.watchdog_history(s, "sb-1"))
    [loop] = [d for d in live if d[:2] == ("alert", "LOOP")]
    fired = [mo for mo in history.moments if mo.what == "LOOP"]
    assert [mo.seq for mo in fired] == [loop[5]]  # the seq that made it fire
    assert output_event_id("LOOP", "sb-1", "ep-loop", fired[0].alert["first_seq"], 1) == loop[9]


# -- the core's clocks, directly --------------------------------------------------------------
def _core_events(ep: Ep) -> list[tuple[str, dict[str, Any]]]:
    return [(d.kind, d.record) for d in (codec.decode(v) for _, v in ep.events)]


def test_each_log_has_its_own_clock() -> None:
    """A stream is judged by the log that carries it: another partition read two hours ahead
    does not make it idle; its own partition's log does, once it passes an hour."""
    from trajbus.consumers.watchdog.core import WatchdogCore

    core = WatchdogCore()
    core.advance("replay:0", T0)
    for kind, rec in _core_events(Ep("sb-1", "ep-1", T0).start().call().result()):
        assert core.handle(kind, rec) == []
    assert core.advance("replay:1", T0 + 2 * HOUR) == []  # another partition, far ahead
    assert core.advance("replay:0", T0 + HOUR - 1) == []
    assert [e.episode for e in core.explain("sb-1")] == ["ep-1"]
    assert core.advance("replay:0", T0 + HOUR + 10 * SECOND) == []  # no loop, no open call
    assert core.explain("sb-1") == []


def test_a_version_1_state_still_loads_and_is_timed_from_its_next_event() -> None:
    """A changelog written before the log clocks (state v1, 13 fields) still restores; such a
    stream's log is unknown, so no timer judges it until its next event is read."""
    import json

    from trajbus.consumers.watchdog.core import WatchdogCore

    core = WatchdogCore()
    ep = Ep("sb-1", "ep-1", T0).start().pairs(3)
    core.advance("replay:0", T0)
    for kind, rec in _core_events(ep):
        core.handle(kind, rec)
    [(key, blob)] = core.take_dirty().items()
    assert blob is not None
    v2 = json.loads(blob)
    assert v2[0] == 2 and v2[13:] == [T0, "replay:0"]
    v1 = json.dumps([1, *v2[1:13]]).encode()
    old = WatchdogCore()
    assert old.restore(key, v1) is None
    assert old.advance("replay:0", T0 + 5 * HOUR) == []
    assert [e.episode for e in old.explain("sb-1")] == ["ep-1"]
    more = Ep("sb-1", "ep-1", T0 + 5 * HOUR)
    more.seq, more.calls = ep.seq, ep.calls
    more.call()
    [(kind, rec)] = _core_events(more)
    assert old.handle(kind, rec) == []  # read at T0 + 5 h: timed from there
    assert old.advance("replay:0", T0 + 5 * HOUR + 30 * MINUTE) != []  # its open call: STALL
    assert [e.episode for e in old.explain("sb-1")] == ["ep-1"]
    assert old.advance("replay:0", T0 + 6 * HOUR + 20 * SECOND) == []
    assert old.explain("sb-1") == []  # evicted an hour after its event
