"""Processor workers killed with SIGKILL mid-stream and restarted (issue 9, fault 2).

Reorder alone is covered by tests/faults/test_replay_e2e.py::test_worker_killed_mid_stream_still_
delivers_each_event_once; here: the watchdog (one LOOP alert per loop across restarts, counted
as records, never deduplicated by the test), the scheduler (decisions continue after the
restart, no event id twice) and a rebalance between two reorder workers when one is killed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
from faults_support import (
    diff_views,
    read_all,
    trainer_view,
    wait_caught_up,
)
from support import (
    Worker,
    consume_until,
    make_episodes,
    produce,
    settings_for,
    shuffled_with_duplicates,
)

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.topics import Topics
from trajbus.schemas import models as m
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]
codec = default_codec()


def _loop_episode(n_calls: int, t0: int) -> list[bytes]:
    """EpisodeStart, ``n_calls`` identical browser clicks with identical results 10 s apart
    (a true loop by the reference rule once >= 20 repeats span >= 2 min), EpisodeEnd."""
    sb, ep = "sb-loop", "ep-loop"

    def h(seq: int, t: int) -> m.Envelope:
        return m.Envelope(event_id=f"{ep}-{seq}", task="task-a", sandbox=sb, episode=ep,
                          seq=seq, event_time_ms=t, producer_id="test")

    evs = [m.EpisodeStart(header=h(0, t0)).encode()]
    for k in range(n_calls):
        t = t0 + 1000 + k * 10_000
        evs.append(m.ToolCall(header=h(2 * k + 1, t), call_id=f"c{k}", tool="browser_click",
                              args_hash="a" * 64).encode())
        evs.append(m.ToolResult(header=h(2 * k + 2, t + 500), call_id=f"c{k}",
                                tool="browser_click", status=m.ToolStatus.OK,
                                result_hash="b" * 64).encode())
    evs.append(m.EpisodeEnd(header=h(2 * n_calls + 1, t0 + 1000 + n_calls * 10_000),
                            outcome=m.EpisodeOutcome.TERMINAL).encode())
    return evs


def _alerts(values: list[bytes]) -> Counter[str]:
    got: Counter[str] = Counter()
    for v in values:
        d = codec.decode(v)
        if d.kind == "WatchdogAlert" and d.record["header"]["episode"] == "ep-loop":
            got[d.record["alert"]] += 1
    return got


async def test_watchdog_killed_mid_loop_emits_exactly_one_loop_alert(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    replay = topics.replay("task-a")
    evs = _loop_episode(40, int(time.time() * 1000))
    items = [("sb-loop", v) for v in evs]
    reorder = Worker(settings, "reorder", "wr", log_path=tmp_path / "reorder.log").start()

    def watchdog() -> Worker:
        return Worker(settings, "watchdog", "ww", log_path=tmp_path / "watchdog.log").start()

    async def settled() -> None:
        await wait_caught_up(settings, f"{unique_name}.reorder", topics.input_topics)
        await wait_caught_up(settings, f"{unique_name}.watchdog", [replay])

    wd = watchdog()
    try:
        # 1) 10 repetitions (no loop yet) are processed, then the watchdog dies.
        await produce(settings, topics.sandbox_events, items[:21])
        await settled()
        wd.kill()
        # 2) the loop completes while it is down; the restarted watchdog raises the alert,
        #    and is killed again at once (the loop is still going on).
        await produce(settings, topics.sandbox_events, items[21:61])
        wd = watchdog()
        await consume_until(settings, topics.alerts, lambda v: _alerts(v)["LOOP"] >= 1,
                            timeout=90)
        wd.kill()
        # 3) ten more identical calls and the episode's end; a third incarnation finishes.
        await produce(settings, topics.sandbox_events, items[61:])
        wd = watchdog()
        await settled()
        assert wd.proc is not None and wd.proc.poll() is None
    finally:
        wd.stop()
        reorder.stop()
    alerts = _alerts([r.value for r in await read_all(settings, [topics.alerts]) if r.value])
    assert alerts["LOOP"] == 1, alerts
    assert alerts["LOOP_ENDED"] <= 1, alerts
    # read_uncommitted too: an aborted duplicate may exist there, but never a committed one
    raw = _alerts([r.value for r in await read_all(settings, [topics.alerts],
                                                   read_committed=False) if r.value])
    assert raw["LOOP"] >= 1


async def test_watchdog_restarted_between_a_loops_segments_of_a_lagging_sandbox_catches_it(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    """Issue 37: a sandbox whose clock is 3 hours behind the broker loops (25 identical calls,
    10 s apart on its clock); the watchdog is SIGKILLed after the first 12 and restarted for
    the rest. Exactly one LOOP, as in an undisturbed run. Before, every tick (the worker's
    wall clock) found the stream idle for 3 hours and evicted it: the count started over
    after the restart (13 calls, under the 20 of the rule) and the loop was never caught."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    replay = topics.replay("task-a")
    evs = _loop_episode(25, int(time.time() * 1000) - 3 * 3_600_000)
    items = [("sb-loop", v) for v in evs]
    reorder = Worker(settings, "reorder", "wr", log_path=tmp_path / "reorder.log").start()

    def watchdog() -> Worker:
        return Worker(settings, "watchdog", "ww", log_path=tmp_path / "watchdog.log").start()

    async def settled() -> None:
        await wait_caught_up(settings, f"{unique_name}.reorder", topics.input_topics)
        await wait_caught_up(settings, f"{unique_name}.watchdog", [replay])

    wd = watchdog()
    try:
        await produce(settings, topics.sandbox_events, items[:25])  # start + 12 calls
        await settled()
        await asyncio.sleep(2)  # a few ticks (every 0.5 s) between the loop's segments
        wd.kill()
        await produce(settings, topics.sandbox_events, items[25:])
        wd = watchdog()
        await settled()
        assert wd.proc is not None and wd.proc.poll() is None
    finally:
        wd.stop()
        reorder.stop()
    alerts = _alerts([r.value for r in await read_all(settings, [topics.alerts]) if r.value])
    assert alerts == Counter({"LOOP": 1, "LOOP_ENDED": 1}), alerts


async def test_scheduler_killed_and_restarted_continues_without_duplicate_decisions(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    from trajbus.bus.producer import close_producer
    from trajbus.producers.simulator import simulate

    settings = settings_for(kafka_broker.bootstrap, unique_name)
    tasks = ["swe-bench", "web-shop", "math-proofs"]
    await ensure_base_topics(settings, tasks)
    topics = Topics(settings)
    sched_inputs = [topics.control, topics.nodes, topics.sandbox_events]

    def scheduler() -> Worker:
        return Worker(settings, "scheduler", "ws", log_path=tmp_path / "sched.log").start()

    def decisions_of(values: list[bytes], prefix: str) -> list[dict]:
        out = []
        for v in values:
            d = codec.decode(v)
            if d.kind == "SchedulingDecision" and d.record["header"]["sandbox"].startswith(
                    prefix):
                out.append(d.record)
        return out

    w = scheduler()
    try:
        await simulate(settings, sandboxes=6, episodes=1, seed=71, state_root=tmp_path / "a",
                       start_ms=int(time.time() * 1000), loop=0, cycle=0, crash=0, migrate=0,
                       wait_for_placement=False)
        await close_producer()
        await consume_until(settings, topics.decisions,
                            lambda v: len(decisions_of(v, "sb-71-")) >= 3, timeout=60)
        w.kill()  # the fleet below runs while no scheduler does (hence no waiting for placement)
        before = len(await read_all(settings, [topics.decisions]))
        await simulate(settings, sandboxes=6, episodes=1, seed=72, state_root=tmp_path / "b",
                       start_ms=int(time.time() * 1000), loop=0, cycle=0, crash=0, migrate=0,
                       wait_for_placement=False)
        await close_producer()
        w = scheduler()
        await wait_caught_up(settings, f"{unique_name}.scheduler", sched_inputs, timeout=90)
        assert w.proc is not None and w.proc.poll() is None
    finally:
        w.stop()
    recs = await read_all(settings, [topics.decisions])
    values = [r.value for r in recs if r.value]
    ids = Counter(codec.decode(v).record["header"]["event_id"] for v in values)
    assert [i for i, n in ids.items() if n > 1] == [], "a decision was committed twice"
    after = decisions_of(values, "sb-72-")
    assert len(values) > before and len(after) >= 6, (before, len(values), len(after))


async def test_two_reorder_workers_one_killed_trainer_sees_each_event_once(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=4)
    await ensure_base_topics(settings, ["task-a"])
    topics = Topics(settings)
    eps = make_episodes(120, seed=9)
    stream = shuffled_with_duplicates(eps, 9)
    half = len(stream) // 2
    w1 = Worker(settings, "reorder", "w1", log_path=tmp_path / "w1.log").start()
    w2 = Worker(settings, "reorder", "w2", log_path=tmp_path / "w2.log").start()
    try:
        await produce(settings, topics.sandbox_events, stream[:half])
        await consume_until(settings, topics.replay("task-a"), lambda v: len(v) >= 20,
                            timeout=60)
        w1.kill()  # its partitions move to w2 after the session timeout
        await produce(settings, topics.sandbox_events, stream[half:])
        expected = {(e.sandbox, e.episode): [(i, f"{e.episode}-{i}") for i in range(e.n)]
                    for e in eps}
        view = await trainer_view(settings, ["task-a"], f"{unique_name}-trainer",
                                  lambda v: v.complete(expected), timeout=120)
        assert w2.proc is not None and w2.proc.poll() is None
    finally:
        w2.stop()
    assert diff_views(expected, view) == []
