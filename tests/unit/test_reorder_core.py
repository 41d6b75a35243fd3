"""Specification of the replay reorder core (trajbus.consumers.replay.core.ReorderCore).

The core turns shuffled, duplicated episode events into ordered, deduplicated replay
segments; it is pure (time only from event times and ticks) and its state round-trips
through changelog blobs.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajbus.bus.settings import ReplaySettings
from trajbus.consumers.replay.core import (
    CLOCK_KEY,
    DeadLetterOut,
    InEvent,
    LateOut,
    Output,
    ReorderCore,
    SegmentOut,
    content_digest,
    segment_event_id,
    segment_record,
)

TIMEOUT = 1_000


def core(**kw: Any) -> ReorderCore:
    s = ReplaySettings(
        gap_timeout_ms=kw.pop("gap_timeout_ms", TIMEOUT),
        max_buffered_per_episode=kw.pop("max_buffered_per_episode", 10_000),
        max_buffered_total=kw.pop("max_buffered_total", 2_000_000),
        max_open_episodes_per_sandbox=kw.pop("max_open_episodes_per_sandbox", 64),
    )
    return ReorderCore(s, **kw)


def ev(seq: int, ep: str = "e1", sb: str = "sb1", t: int = 0, *, kind: str = "ToolCall",
       outcome: str | None = None, raw: bytes | None = None, task: str = "task") -> InEvent:
    if outcome is not None:
        kind = "EpisodeEnd"
    elif seq == 0 and kind == "ToolCall":
        kind = "EpisodeStart"
    raw = raw if raw is not None else f"{sb}|{ep}|{seq}".encode()
    return InEvent(task, sb, ep, seq, t, kind, raw, outcome)


def end(seq: int, ep: str = "e1", sb: str = "sb1", t: int = 0, outcome: str = "TERMINAL"
        ) -> InEvent:
    return ev(seq, ep, sb, t, outcome=outcome)


def recycled(sb: str = "sb1", t: int = 0) -> InEvent:
    raw = f"recycled|{sb}".encode()
    return InEvent("task", sb, None, 7, t, "SandboxLifecycle", raw, None, "RECYCLED")


def drained(sb: str, finals: dict[str, int], t: int = 0) -> InEvent:
    raw = f"drained|{sb}".encode()
    return InEvent("task", sb, None, 6, t, "Drained", raw, None, None, tuple(finals.items()))


def run(c: ReorderCore, events: list[InEvent]) -> list[Output]:
    out: list[Output] = []
    for e in events:
        out.extend(c.handle(e))
    return out


def segs(out: list[Output]) -> list[SegmentOut]:
    return [o for o in out if isinstance(o, SegmentOut)]


def by_episode(out: list[Output]) -> dict[tuple[str, str], list[SegmentOut]]:
    res: dict[tuple[str, str], list[SegmentOut]] = defaultdict(list)
    for s in segs(out):
        res[(s.sandbox, s.episode)].append(s)
    return res


def check_segment_invariants(ss: list[SegmentOut]) -> None:
    """Indexes count from 0 without holes; seq ranges are contiguous (gaps are declared);
    only the final segment is last; is_first only on segment 0."""
    assert [s.segment_index for s in ss] == list(range(len(ss)))
    expect = 0
    for s in ss:
        if s.gap is not None:
            assert s.gap[0] == expect
            expect = s.gap[1] + 1
        assert s.first_seq == expect
        assert s.last_seq == s.first_seq + len(s.events) - 1
        expect = s.last_seq + 1
        assert s.is_first == (s.segment_index == 0)
    assert all(not s.is_last for s in ss[:-1])


# -- ordering and exactly-once -----------------------------------------------------------
def test_in_order_events_stream_one_segment_each_and_end_is_last_and_terminal() -> None:
    c = core()
    out = run(c, [ev(0), ev(1), ev(2), end(3)])
    ss = segs(out)
    assert [(s.first_seq, s.last_seq) for s in ss] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert ss[0].is_first and not ss[1].is_first
    assert [s.is_last for s in ss] == [False, False, False, True]
    assert ss[-1].is_terminal
    check_segment_invariants(ss)


def test_out_of_order_events_are_buffered_and_released_as_one_batched_segment() -> None:
    c = core()
    out = run(c, [ev(0), ev(3), ev(2), ev(4)])
    assert [(s.first_seq, s.last_seq) for s in segs(out)] == [(0, 0)]
    assert c.counters()["buffered"] == 3
    out = c.handle(ev(1))
    (s,) = segs(out)
    assert (s.first_seq, s.last_seq, s.segment_index) == (1, 4, 1)
    assert s.events == [b"sb1|e1|1", b"sb1|e1|2", b"sb1|e1|3", b"sb1|e1|4"]
    assert c.counters()["buffered"] == 0


episode_plan = st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=episode_plan, seed=st.integers(0, 2**32 - 1),
       dup_rate=st.floats(0.0, 0.6), window=st.integers(1, 40),
       cap=st.integers(1, 5))
def test_shuffled_duplicated_input_comes_out_in_order_exactly_once(
    lengths: list[int], seed: int, dup_rate: float, window: int, cap: int
) -> None:
    rng = random.Random(seed)
    events: list[InEvent] = []
    for i, n in enumerate(lengths):
        sb, ep = f"sb{i % 3}", f"ep{i}"
        events += [ev(s, ep, sb) for s in range(n)] + [end(n, ep, sb)]
    events += [rng.choice(events) for _ in range(int(len(events) * dup_rate))]
    # shuffle within sliding windows (bounded disorder) and sometimes fully
    if window >= 40:
        rng.shuffle(events)
    else:
        events = [e for _, e in sorted(
            ((i + rng.uniform(0, window), e) for i, e in enumerate(events)),
            key=lambda p: p[0])]
    c = core(max_segment_events=cap)
    out = run(c, events)
    assert not [o for o in out if not isinstance(o, SegmentOut)]
    got = by_episode(out)
    assert len(got) == len(lengths)
    for i, n in enumerate(lengths):
        ss = got[(f"sb{i % 3}", f"ep{i}")]
        check_segment_invariants(ss)
        flat = [raw for s in ss for raw in s.events]
        assert flat == [f"sb{i % 3}|ep{i}|{s}".encode() for s in range(n + 1)]
        assert all(len(s.events) <= cap for s in ss)
        assert ss[-1].is_last and ss[-1].is_terminal and ss[-1].last_seq == n
    k = c.counters()
    assert k["duplicates"] + k["duplicates_unverified"] == len(events) - sum(
        n + 1 for n in lengths)
    assert k["buffered"] == 0 and k["episodes_open"] == 0 and k["conflicts"] == 0


# -- duplicates --------------------------------------------------------------------------
def test_exact_duplicates_are_dropped_silently_and_counted() -> None:
    c = core()
    out = run(c, [ev(0), ev(0), ev(2), ev(2), ev(1), ev(1), ev(2)])
    assert [(s.first_seq, s.last_seq) for s in segs(out)] == [(0, 0), (1, 2)]
    assert len(out) == 2
    assert c.counters()["duplicates"] == 4


def test_conflicting_duplicate_of_a_buffered_event_is_dead_lettered_with_both_versions() -> None:
    c = core()
    run(c, [ev(0), ev(2, raw=b"first")])
    (dl,) = c.handle(ev(2, raw=b"second"))
    assert isinstance(dl, DeadLetterOut)
    assert dl.reason_code == "conflicting_duplicate"
    assert (dl.raw, dl.conflicting_with) == (b"second", b"first")
    (s,) = segs(c.handle(ev(1)))
    assert s.events[-1] == b"first"  # the first version wins
    assert c.counters()["conflicts"] == 1


def test_conflicting_duplicate_of_an_emitted_event_is_dead_lettered() -> None:
    c = core()
    run(c, [ev(0), ev(1)])
    (dl,) = c.handle(ev(1, raw=b"other"))
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "conflicting_duplicate"
    assert dl.raw == b"other" and dl.seq == 1 and "already emitted" in dl.reason


def test_duplicates_older_than_the_dedupe_window_are_still_compared() -> None:
    """Issue 37: a conflicting copy far behind the window was dropped with no dead letter.
    Beyond the window the episode's 16-bit digest history decides: an exact copy is a
    duplicate, a conflicting one a dead letter; both survive a restore from the changelog."""
    c = core(dedupe_window=4)
    run(c, [ev(0), ev(1)] + [ev(s) for s in range(3, 10)] + [ev(2)])  # buffered path too
    assert c.handle(ev(1)) == [] and c.handle(ev(2)) == []  # exact copies, 8 and 7 back
    (dl,) = c.handle(ev(1, raw=b"whatever"))
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "conflicting_duplicate"
    assert "beyond the dedupe window" in dl.reason and dl.raw == b"whatever" and dl.seq == 1
    k = c.counters()
    assert (k["duplicates"], k["conflicts"], k["duplicates_unverified"]) == (2, 1, 0)
    fresh = core(dedupe_window=4)
    for key, blob in c.take_dirty().items():
        if blob is not None:
            fresh.restore(key, blob)
    assert fresh.handle(ev(2)) == []
    (dl,) = fresh.handle(ev(2, raw=b"other"))
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "conflicting_duplicate"


def test_a_duplicate_older_than_the_history_is_an_unverified_dead_letter() -> None:
    """State from a changelog written before the history existed: an old copy cannot be
    compared, and is a dead letter saying so (not dropped silently)."""
    c = core(dedupe_window=4)
    run(c, [ev(s) for s in range(10)])
    (blob,) = (v for k, v in c.take_dirty().items() if k == "sb1/e1")
    assert blob is not None
    old = blob[: -(12 + 2 * 10)]  # the blob as written before the history
    fresh = core(dedupe_window=4)
    fresh.restore("sb1/e1", old)
    (dl,) = fresh.handle(ev(1))
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "unverified_duplicate"
    assert fresh.counters()["duplicates_unverified"] == 1
    assert segs(fresh.handle(ev(10)))[0].first_seq == 10  # the history starts again
    assert fresh.handle(ev(9)) == []  # within the window


# -- gaps --------------------------------------------------------------------------------
def test_gap_closes_after_timeout_by_tick_with_marker_and_late_event_goes_to_late() -> None:
    c = core()
    run(c, [ev(0, t=100), ev(3, t=200), ev(4, t=300)])  # stall observed at clock 200
    assert c.tick(1_199) == []
    (s,) = segs(c.tick(1_200))
    assert s.gap == (1, 2) and (s.first_seq, s.last_seq) == (3, 4)
    assert s.segment_index == 1 and s.event_time_ms == 300
    (late,) = c.handle(ev(2, t=1_300))
    assert isinstance(late, LateOut) and late.reason_code == "after_gap" and late.seq == 2
    (s2,) = segs(c.handle(ev(5, t=1_400)))
    assert (s2.first_seq, s2.gap) == (5, None)
    k = c.counters()
    assert (k["gaps"], k["gap_seqs"], k["late"]) == (1, 2, 1)


def test_gap_closes_by_event_time_of_any_later_event() -> None:
    c = core()
    run(c, [ev(0, t=0), ev(2, t=10)])
    out = c.handle(ev(0, "other", t=1_010))  # another episode's event moves the clock
    gap_seg = [s for s in segs(out) if s.episode == "e1"]
    assert len(gap_seg) == 1 and gap_seg[0].gap == (1, 1) and gap_seg[0].events == [b"sb1|e1|2"]


def test_stall_timer_restarts_when_the_episode_makes_progress() -> None:
    c = core()
    run(c, [ev(0, t=0), ev(2, t=0), ev(4, t=0)])  # missing 1 and 3; stalled at 0
    c.tick(900)
    (s,) = segs(c.handle(ev(1, t=900)))  # progress: 1..2 out; still missing 3
    assert (s.first_seq, s.last_seq, s.gap) == (1, 2, None)
    assert c.tick(1_500) == []  # the new stall began at 900
    (s,) = segs(c.tick(1_900))
    assert s.gap == (3, 3) and s.first_seq == 4


def test_late_event_for_a_gap_older_than_the_dedupe_window_is_still_late() -> None:
    c = core(dedupe_window=2)
    run(c, [ev(0, t=0), ev(3, t=0)])
    c.tick(TIMEOUT)  # declares 1..2 missing
    run(c, [ev(s, t=TIMEOUT) for s in range(4, 10)])
    (late,) = c.handle(ev(1, t=TIMEOUT))
    assert isinstance(late, LateOut) and late.reason_code == "after_gap"


def test_time_never_goes_backwards_and_wall_clock_is_not_used() -> None:
    c = core()
    run(c, [ev(0, t=5_000), ev(2, t=5_000)])
    assert c.tick(10) == [] and c.clock_ms == 5_000
    assert c.handle(ev(3, t=1)) == []  # an old event time does not move the clock back
    assert segs(c.tick(6_000))[0].gap == (1, 1)


# -- episode end, truncation, recycle ------------------------------------------------------
def test_truncated_outcome_gives_is_last_without_is_terminal() -> None:
    c = core()
    out = run(c, [ev(0), ev(1), end(2, outcome="TRUNCATED")])
    assert segs(out)[-1].is_last and not segs(out)[-1].is_terminal


def test_end_arriving_early_waits_for_the_missing_events() -> None:
    c = core()
    out = run(c, [ev(0), end(3), ev(2)])
    assert [s.last_seq for s in segs(out)] == [0]
    (s,) = segs(c.handle(ev(1)))
    assert (s.first_seq, s.last_seq, s.is_last, s.is_terminal) == (1, 3, True, True)


def test_gap_before_the_end_closes_by_timeout_and_ends_the_episode() -> None:
    c = core()
    run(c, [ev(0, t=0), end(2, t=0)])
    (s,) = segs(c.tick(TIMEOUT))
    assert s.gap == (1, 1) and s.is_last and s.is_terminal
    assert c.counters()["episodes_open"] == 0


def test_events_after_the_end_are_dead_letters_and_late_duplicates_are_dropped() -> None:
    c = core()
    run(c, [ev(0), ev(1), end(2)])
    (dl,) = c.handle(ev(3))
    assert isinstance(dl, DeadLetterOut) and dl.reason_code == "seq_after_end"
    assert c.handle(ev(1)) == []  # a late duplicate of a finished episode
    assert c.counters()["duplicates"] == 1
    # events buffered beyond an EpisodeEnd that arrives later are dead-lettered too
    c2 = core()
    out = run(c2, [ev(0), ev(5), end(2)])
    assert [o.reason_code for o in out if isinstance(o, DeadLetterOut)] == ["seq_after_end"]
    (dl2,) = c2.handle(end(3))
    assert isinstance(dl2, DeadLetterOut) and dl2.reason_code == "seq_after_end"


def test_recycled_sandbox_truncates_open_episodes_after_the_grace() -> None:
    c = core()
    run(c, [ev(0, "a", t=0), ev(1, "a", t=0), ev(0, "b", t=0), ev(2, "b", t=0)])
    run(c, [ev(0, "other", sb="sb2", t=0)])
    assert c.handle(recycled("sb1", t=100)) == []
    # trace chunks still in flight on the other topic are accepted during the grace
    assert segs(c.handle(ev(2, "a", t=150)))[0].last_seq == 2
    (b_gap,) = segs(c.tick(TIMEOUT))  # b's own stall (since t=0) times out first
    assert b_gap.gap == (1, 1) and b_gap.events == [b"sb1|b|2"] and not b_gap.is_last
    c.handle(ev(4, "b", t=1_050))  # stalls b again, buffered at the recycle deadline
    out = c.tick(100 + TIMEOUT)
    finals = {s.episode: s for s in segs(out)}
    assert set(finals) == {"a", "b"}
    a, b = finals["a"], finals["b"]
    assert a.events == [] and a.is_last and not a.is_terminal and a.first_seq == 3
    assert a.last_seq == 2 and a.segment_index == 3
    # pending events are flushed behind a gap marker and the flush is the final segment
    assert b.gap == (3, 3) and b.events == [b"sb1|b|4"] and b.is_last and not b.is_terminal
    (late,) = c.handle(ev(3, "a", t=1_200))
    assert isinstance(late, LateOut) and late.reason_code == "after_close"
    (late2,) = c.handle(ev(0, "new", t=1_200))
    assert isinstance(late2, LateOut) and late2.reason_code == "sandbox_recycled"
    assert c.counters()["episodes_open"] == 1  # sb2/other is untouched


def test_drained_final_seq_ends_the_episode_truncated_once_complete() -> None:
    c = core()
    run(c, [ev(0), ev(2)])
    assert c.handle(drained("sb1", {"e1": 2})) == []
    (s,) = segs(c.handle(ev(1)))
    assert (s.last_seq, s.is_last, s.is_terminal) == (2, True, False)
    c2 = core()
    run(c2, [ev(0), ev(1)])
    (s2,) = segs(c2.handle(drained("sb1", {"e1": 1})))
    assert s2.events == [] and s2.is_last and not s2.is_terminal
    # recycled with the drained tail never arriving: the final marker declares it missing
    c3 = core()
    run(c3, [ev(0), drained("sb1", {"e1": 4}), recycled("sb1")])
    (s3,) = segs(c3.tick(TIMEOUT))
    assert s3.gap == (1, 4) and s3.events == [] and s3.is_last and not s3.is_terminal


def test_idle_episode_is_truncated_when_an_idle_timeout_is_configured() -> None:
    c = core(idle_timeout_ms=10_000)
    run(c, [ev(0, t=0), ev(1, t=5_000)])
    assert c.tick(14_999) == []
    (s,) = segs(c.tick(15_000))
    assert s.is_last and not s.is_terminal and s.events == []
    assert c.counters()["idle_truncated"] == 1


# -- memory bounds -----------------------------------------------------------------------
def test_per_episode_bound_force_closes_the_oldest_gap() -> None:
    c = core(max_buffered_per_episode=3)
    out = run(c, [ev(0), ev(2), ev(3), ev(5)])
    assert segs(out)[-1].last_seq == 0
    (s,) = segs(c.handle(ev(7)))  # 4 buffered > 3: give up on seq 1
    assert s.gap == (1, 1) and (s.first_seq, s.last_seq) == (2, 3)
    k = c.counters()
    assert k["buffered"] == 2 and k["forced_gap_closes"] == 1


def test_per_episode_byte_bound_force_closes_too() -> None:
    c = core(max_buffered_bytes_per_episode=100)
    run(c, [ev(0), ev(2, raw=b"x" * 60)])
    (s,) = segs(c.handle(ev(3, raw=b"y" * 60)))
    assert s.gap == (1, 1) and s.last_seq == 3


def test_total_bound_force_closes_the_longest_stalled_episode() -> None:
    c = core(max_buffered_total=4)
    run(c, [ev(0, "old", t=0), ev(2, "old", t=0), ev(3, "old", t=0)])
    run(c, [ev(0, "new", t=10), ev(2, "new", t=10), ev(3, "new", t=10)])
    out = c.handle(ev(4, "new", t=20))  # 5 buffered > 4
    (s,) = segs(out)
    assert s.episode == "old" and s.gap == (1, 1)
    assert c.counters()["buffered"] == 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), per_ep=st.integers(0, 6), total=st.integers(0, 12))
def test_buffer_bounds_always_hold_and_every_event_is_emitted_or_late(
    seed: int, per_ep: int, total: int
) -> None:
    rng = random.Random(seed)
    events = [ev(s, f"e{i}") for i in range(4) for s in range(15)]
    rng.shuffle(events)
    c = core(max_buffered_per_episode=per_ep, max_buffered_total=total)
    out = []
    for e in events:
        out += c.handle(e)
        k = c.counters()
        assert k["buffered"] <= total
    emitted = {raw for s in segs(out) for raw in s.events}
    late = {o.raw for o in out if isinstance(o, LateOut)}
    assert emitted | late | {raw for e in events
                             for raw in [e.raw] if e.raw in _still_buffered(c)} == {
        e.raw for e in events}
    assert not emitted & late


def _still_buffered(c: ReorderCore) -> set[bytes]:
    return {raw for ep in c._eps.values() for raw, _, _ in (ep.buf or {}).values()}


# -- bad input ---------------------------------------------------------------------------
def test_invalid_input_becomes_a_dead_letter_and_never_raises() -> None:
    c = core()
    cases = {
        "invalid_seq": ev(-1),
        "missing_episode": ev(1, ep=""),
        "missing_sandbox": ev(1, sb=""),
        "bad_start_seq": ev(3, kind="EpisodeStart"),
        "missing_outcome": ev(2, kind="EpisodeEnd"),
    }
    for code, e in cases.items():
        (dl,) = c.handle(e)
        assert isinstance(dl, DeadLetterOut) and dl.reason_code == code, code
        assert dl.reason
    # seq -1 on an episode whose fast path is off (stalled, ended or closed: expect == -1)
    stalled = [ev(0, ep="s"), ev(2, ep="s")]
    ended = [ev(0, ep="d"), end(1, ep="d")]
    run(c, stalled + ended)
    for e in ("s", "d"):
        (dl,) = c.handle(ev(-1, ep=e))
        assert isinstance(dl, DeadLetterOut) and dl.reason_code == "invalid_seq", e
    assert [s.first_seq for s in segs(run(c, [ev(1, ep="s")]))] == [1]  # the stream goes on
    garbage = InEvent(None, ["x"], {}, "1", "t", 3, "raw")
    (dl,) = c.handle(garbage)
    assert isinstance(dl, DeadLetterOut)
    assert c.counters()["dead_letters"] == 8


@settings(max_examples=200, deadline=None)
@given(st.tuples(
    st.one_of(st.none(), st.text(max_size=3)), st.one_of(st.none(), st.text(max_size=3)),
    st.one_of(st.none(), st.text(max_size=3), st.integers()),
    st.one_of(st.integers(-3, 5), st.none(), st.floats(), st.text(max_size=2)),
    st.one_of(st.integers(-10, 10**13), st.none()), st.sampled_from(
        ["ToolCall", "EpisodeStart", "EpisodeEnd", "SandboxLifecycle", "Drained", ""]),
    st.one_of(st.binary(max_size=10), st.none(), st.integers(), st.text(max_size=3)),
    st.sampled_from([None, "TERMINAL", "TRUNCATED", "bogus"]),
    st.sampled_from([None, "RECYCLED", "ACTIVE"]),
))
def test_arbitrary_input_fields_never_raise(fields: tuple[Any, ...]) -> None:
    c = core()
    c.handle(ev(0, ep="e", sb="s"))
    out = c.handle(InEvent(*fields))
    out += c.tick(10**13)
    assert isinstance(out, list)


# -- persistence -------------------------------------------------------------------------
def _workload(rng: random.Random, n_eps: int) -> list[InEvent | int]:
    """Shuffled, duplicated events with gaps (some seqs never sent), ends, a recycle,
    and ticks (ints)."""
    items: list[InEvent | int] = []
    t = 0
    per_ep: list[list[InEvent]] = []
    for i in range(n_eps):
        sb, ep = f"sb{i % 2}", f"e{i}"
        n = rng.randint(1, 10)
        evs = [ev(s, ep, sb) for s in range(n) if rng.random() > 0.1]
        if rng.random() < 0.7:
            evs.append(end(n, ep, sb, outcome=rng.choice(["TERMINAL", "TRUNCATED"])))
        per_ep.append(evs)
    flat = [e for evs in per_ep for e in evs]
    flat += [rng.choice(flat) for _ in range(len(flat) // 5)] if flat else []
    rng.shuffle(flat)
    for e in flat:
        t += rng.randint(0, 120)
        items.append(e._replace(event_time_ms=t))
        r = rng.random()
        if r < 0.05:
            items.append(t + rng.randint(0, 2_000))
        elif r < 0.07:
            items.append(recycled(f"sb{rng.randint(0, 1)}", t))
    items.append(t + 10 * TIMEOUT)
    return items


def _drive(c: ReorderCore, item: InEvent | int) -> list[Output]:
    return c.tick(item) if isinstance(item, int) else c.handle(item)


def _new(**kw: Any) -> ReorderCore:
    return core(max_buffered_per_episode=4, max_buffered_total=10, tombstone_ttl_ms=3_000,
                dedupe_window=8, max_segment_events=3, **kw)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_eps=st.integers(1, 6),
       cuts=st.lists(st.floats(0, 1), max_size=4), idle=st.booleans(),
       full_snapshot=st.booleans())
def test_snapshot_restore_mid_stream_equals_the_uninterrupted_run(
    seed: int, n_eps: int, cuts: list[float], idle: bool, full_snapshot: bool
) -> None:
    kw = {"idle_timeout_ms": 2_500} if idle else {}
    items = _workload(random.Random(seed), n_eps)
    ref = _new(**kw)
    expected = [o for it in items for o in _drive(ref, it)]

    restart_at = {int(f * len(items)) for f in cuts}
    changelog: dict[str, bytes] = {}
    c = _new(**kw)
    got: list[Output] = []
    for i, it in enumerate(items):
        if i in restart_at:  # crash after the transaction that persisted take_dirty()
            if full_snapshot:
                changelog = c.snapshot()
            for k, v in c.take_dirty().items():
                if v is None:
                    changelog.pop(k, None)
                else:
                    changelog[k] = v
            c = _new(**kw)
            for k, v in changelog.items():
                c.restore(k, v)
        got += _drive(c, it)
    assert got == expected


def test_take_dirty_reports_changes_once_and_deletes_expired_tombstones() -> None:
    c = core(tombstone_ttl_ms=5_000)
    run(c, [ev(0, t=10), end(1, t=20)])
    d = c.take_dirty()
    assert set(d) == {CLOCK_KEY, "sb1/e1"} and d["sb1/e1"]
    assert c.take_dirty() == {}
    c.tick(5_019)
    assert c.take_dirty() == {CLOCK_KEY: d[CLOCK_KEY][:2] + (5_019).to_bytes(8, "little")}
    assert c.tick(5_020) == []
    assert c.take_dirty()["sb1/e1"] is None
    assert c.counters()["tombstones"] == 0


def test_restore_accepts_deletes_and_rejects_garbage() -> None:
    c = core()
    c.restore("sb1/e1", None)
    try:
        c.restore("sb1/e1", b"\x01Egarbage")
    except ValueError:
        pass
    else:  # pragma: no cover
        raise AssertionError("corrupt blob accepted")


# -- determinism and records -----------------------------------------------------------------
def test_same_log_gives_identical_outputs_and_segment_bytes() -> None:
    from trajbus.schemas.codec import default_codec

    items = _workload(random.Random(7), 8)
    a_core = _new()
    a = [o for it in items for o in _drive(a_core, it)]
    b_core = _new()
    b = [o for it in items for o in _drive(b_core, it)]
    assert a == b
    codec = default_codec()
    enc_a = [codec.encode("ReplaySegment", segment_record(s, "w1")) for s in segs(a)]
    enc_b = [codec.encode("ReplaySegment", segment_record(s, "w1")) for s in segs(b)]
    assert enc_a == enc_b
    s0 = segs(a)[0]
    assert segment_record(s0, "w1")["header"]["event_id"] == segment_event_id(
        s0.sandbox, s0.episode, s0.segment_index)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.text(max_size=12), st.integers(-10, 2**63))
def test_segment_event_ids_are_uuid5_of_the_segment_name(sandbox: str, episode: str,
                                                         index: int) -> None:
    import uuid

    from trajbus.consumers.replay.core import SEGMENT_NAMESPACE

    name = f"{sandbox}/{episode}/{index}"
    try:
        want = uuid.uuid5(SEGMENT_NAMESPACE, name).hex
    except UnicodeEncodeError:  # a lone surrogate: neither can encode it
        with pytest.raises(UnicodeEncodeError):
            segment_event_id(sandbox, episode, index)
        return
    assert segment_event_id(sandbox, episode, index) == want


def test_from_decoded_and_replay_segment_model_round_trip() -> None:
    from trajbus.consumers.replay.core import replay_segment
    from trajbus.schemas.codec import default_codec
    from trajbus.schemas.models import (
        Drained,
        Envelope,
        EpisodeEnd,
        EpisodeFinalSeq,
        EpisodeStart,
        SandboxLifecycle,
        ToolCall,
        decode_event,
    )

    def h(seq: int, episode: str | None = "e1") -> Envelope:
        return Envelope(task="t", sandbox="s1", episode=episode, seq=seq, event_time_ms=1_000 + seq,
                        producer_id="p")

    raws = [
        EpisodeStart(header=h(0)).encode(),
        ToolCall(header=h(1), call_id="c", tool="x", args_hash="a").encode(),
        EpisodeEnd(header=h(2), outcome="TERMINAL").encode(),
    ]
    codec = default_codec()
    ins = [InEvent.from_decoded(codec.decode(r), r) for r in raws]
    assert ins[2].outcome == "TERMINAL" and ins[0].kind == "EpisodeStart"
    c = core()
    out = run(c, [ins[2], ins[1], ins[0]])
    (s,) = segs(out)
    assert s.events == raws and s.is_last and s.is_terminal and s.event_time_ms == 1_002
    model = replay_segment(s, "worker-1")
    assert model.header.seq == 0 and model.header.event_id == segment_event_id("s1", "e1", 0)
    back = decode_event(model.encode())
    assert back == model
    lc = SandboxLifecycle(header=h(3, None), state="RECYCLED").encode()
    assert InEvent.from_decoded(codec.decode(lc), lc).state == "RECYCLED"
    dr = Drained(header=h(2, None), complete=True,
                 final_seqs=[EpisodeFinalSeq(episode="e1", final_seq=9)]).encode()
    assert InEvent.from_decoded(codec.decode(dr), dr).final_seqs == (("e1", 9),)


def test_the_content_digest_is_computed_only_where_a_duplicate_seq_can_need_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per event that is emitted or buffered (a later duplicate is compared with it) and
    per duplicate compared; never for sandbox-level events, dead letters or late events."""
    import trajbus.consumers.replay.reorder.machine as core_module

    digested: list[bytes] = []

    def counting(raw: bytes) -> int:
        digested.append(raw)
        return content_digest(raw)

    monkeypatch.setattr(core_module, "content_digest", counting)
    c = core(gap_timeout_ms=100)
    run(c, [ev(0), ev(1), ev(3), ev(1), ev(3)])  # emitted 0, 1; buffered 3; two duplicates
    assert digested == [ev(s).raw for s in (0, 1, 3, 1, 3)]
    digested.clear()
    run(c, [recycled("sb2"), drained("sb2", {"e9": 4}), ev(-1), ev(1, sb="")])
    c.tick(1_000)  # closes the gap at 2: 3 was digested when buffered
    run(c, [ev(2)])  # late after the gap
    assert digested == []


def test_counters_expose_metrics() -> None:
    c = core()
    run(c, [ev(0), ev(0), ev(2)])
    k = c.counters()
    for name in ("duplicates", "conflicts", "gaps", "late", "buffered", "forced_gap_closes",
                 "dead_letters", "episodes_open", "segments", "events"):
        assert name in k
    assert (k["duplicates"], k["buffered"], k["episodes_open"], k["segments"]) == (1, 1, 1, 1)


def test_a_sandbox_opening_more_episodes_than_its_limit_gets_the_excess_dead_lettered() -> None:
    c = core(max_open_episodes_per_sandbox=3)
    out = run(c, [ev(0, ep=f"e{i}") for i in range(5)] + [ev(1, ep="e4")]
              + [ev(0, ep="other", sb="sb2")])
    assert {s.episode for s in segs(out) if s.sandbox == "sb1"} == {"e0", "e1", "e2"}
    dead = [o for o in out if isinstance(o, DeadLetterOut)]
    assert [(d.episode, d.seq, d.reason_code) for d in dead] == [
        ("e3", 0, "too_many_open_episodes"), ("e4", 0, "too_many_open_episodes"),
        ("e4", 1, "too_many_open_episodes")]
    assert dead[0].raw == b"sb1|e3|0"  # the original bytes
    assert "max_open_episodes_per_sandbox=3" in dead[0].reason
    assert any(s.sandbox == "sb2" for s in segs(out))  # other sandboxes are not affected
    assert c.counters()["episodes_refused"] == 3
    # sandbox-level events (episode None) do not count, and an ended episode frees a slot
    out = run(c, [recycled(), end(1, ep="e0"), ev(0, ep="e5")])
    assert not [o for o in out if isinstance(o, DeadLetterOut)]
    assert "e5" in {s.episode for s in segs(out)}


def test_the_open_episode_limit_survives_a_restore_from_the_changelog() -> None:
    c = core(max_open_episodes_per_sandbox=2)
    run(c, [ev(0, ep="e0"), ev(0, ep="e1")])
    restored = core(max_open_episodes_per_sandbox=2)
    for key, blob in c.take_dirty().items():
        if blob is not None:
            restored.restore(key, blob)
    out = run(restored, [ev(0, ep="e2")])
    assert [o.reason_code for o in out if isinstance(o, DeadLetterOut)] == [
        "too_many_open_episodes"]


def _timer_entries(c: ReorderCore) -> int:
    return len(c._timers) + len(c._gap_heap)


def test_restoring_a_key_many_times_leaves_the_timers_of_one_restore() -> None:
    """A changelog not yet compacted holds many records per key; the restored core must not
    keep one timer per record (422 MB after a restore at scale), but what restoring the latest
    record alone leaves."""
    c = core(idle_timeout_ms=60_000)
    blobs: list[tuple[str, bytes]] = []
    run(c, [ev(0, t=1), ev(2, t=2)])  # a stalled episode: gap, idle timers
    run(c, [recycled("sb1", t=3)])  # and a recycle deadline, on a second sandbox key
    for i in range(1_000):  # the episode's state written many times
        run(c, [ev(3 + i, t=3)])
        blobs += [(k, v) for k, v in c.take_dirty().items() if v is not None]
    once = core(idle_timeout_ms=60_000)
    for k, v in c.snapshot().items():
        once.restore(k, v)
    many = core(idle_timeout_ms=60_000)
    for k, v in blobs:
        many.restore(k, v)
    for k, v in c.snapshot().items():
        many.restore(k, v)
    assert many.tick(0) == once.tick(0) == []  # timers are armed before the first input
    assert c.counters()["episodes_open"] == 1 and c.counters()["buffered"] == 1_001
    assert _timer_entries(many) == _timer_entries(once) == 4  # gap, idle, recycle, sandbox
    assert _timer_entries(once) <= _timer_entries(c)  # no more than the uninterrupted run
    # and the restored timers fire as the uninterrupted run's do
    assert many.tick(10**9) == once.tick(10**9) == c.tick(10**9)
