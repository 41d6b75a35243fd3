"""A rebalance does not restore the partitions a worker keeps (issue 18, item 3).

aiokafka's group protocol is eager: when a worker joins or leaves, every member gives up all
its partitions and is then given its new share. A worker that is given back a partition it
just had, with nobody having committed anything for it meanwhile, keeps the partition's core
as it was instead of re-reading its changelog; any other partition is restored, and while it
is, the kept partitions go on being served.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from faults_support import LiveTrainer, PacedFleet, diff_views
from support import Worker, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.consumers.engine.runner import reusable_slots

EV0, CH0, EV1 = (TopicPartition("events", 0), TopicPartition("chunks", 0),
                 TopicPartition("events", 1))


# -- the rule -----------------------------------------------------------------------------------
def test_a_slot_given_back_unchanged_is_kept() -> None:
    parked = {0: {EV0: 120, CH0: None}}
    assert reusable_slots(parked, {0: [EV0, CH0]}, {EV0: 120, CH0: None}) == {0}


def test_a_slot_another_member_committed_for_meanwhile_is_restored() -> None:
    parked = {0: {EV0: 120, CH0: 7}}
    assert reusable_slots(parked, {0: [EV0, CH0]}, {EV0: 120, CH0: 9}) == set()
    assert reusable_slots({0: {EV0: None}}, {0: [EV0]}, {EV0: 3}) == set()


def test_a_slot_with_other_input_partitions_than_when_parked_is_restored() -> None:
    # a new topic matched the subscription: its records were never seen by the parked core
    assert reusable_slots({0: {EV0: 5}}, {0: [EV0, CH0]}, {EV0: 5, CH0: None}) == set()
    assert reusable_slots({0: {EV0: 5, CH0: 1}}, {0: [EV0]}, {EV0: 5}) == set()


def test_a_slot_never_parked_is_restored() -> None:
    assert reusable_slots({0: {EV0: 5}}, {1: [EV1]}, {EV1: 5}) == set()


# -- a worker joining, then leaving ---------------------------------------------------------------
_KEPT = re.compile(r"kept the state of partitions \[([\d, ]*)\]")
_RESTORED = re.compile(r"restored \d+ state records for partitions \[([\d, ]*)\]")


def _partitions(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def _events(text: str) -> list[tuple[str, list[int]]]:
    """The worker's kept/restored decisions, in log order."""
    out = []
    for line in text.splitlines():
        if m := _KEPT.search(line):
            out.append(("kept", _partitions(m.group(1))))
        elif m := _RESTORED.search(line):
            out.append(("restored", _partitions(m.group(1))))
    return out


async def _wait_for(cond: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


@pytest.mark.kafka
@pytest.mark.timeout(240)
async def test_partitions_that_stay_put_are_kept_when_a_worker_joins_and_leaves(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=4)
    await ensure_base_topics(settings, ["task-a"])
    log1 = tmp_path / "w1.log"
    w1 = Worker(settings, "reorder", "w1", log_path=log1).start()
    w2 = Worker(settings, "reorder", "w2", log_path=tmp_path / "w2.log")
    trainer = LiveTrainer(settings, ["task-a"], f"{unique_name}-trainer").start()
    fleet = PacedFleet(settings, tmp_path / "fleet", n=8, step_s=0.05).start()

    def received() -> int:
        return sum(len(v) for v in trainer.view.events.values())

    def flowed(n: int) -> Callable[[], bool]:
        start = received()
        return lambda: received() >= start + n

    try:
        await _wait_for(flowed(200), "the first events at the trainer", 90)
        assert _events(log1.read_text()) == [("restored", [0, 1, 2, 3])]

        w2.start()  # joins: w1 gives up all four partitions and gets two of them back
        await _wait_for(lambda: len(_events(log1.read_text())) >= 2, "w1 to rebalance", 60)
        await _wait_for(flowed(200), "events after the join", 60)
        after_join = _events(log1.read_text())
        assert after_join[1][0] == "kept", after_join
        mine = after_join[1][1]
        assert len(mine) == 2, after_join
        assert after_join[2:] == [], f"w1 restored partitions it kept: {after_join}"

        assert w2.stop() == 0  # leaves cleanly: w1 gets all four again
        await _wait_for(lambda: len(_events(log1.read_text())) >= 4, "w1 to take over", 60)
        await _wait_for(flowed(200), "events after the leave", 60)
        after_leave = _events(log1.read_text())[2:]
        others = sorted(set(range(4)) - set(mine))
        # its own two kept; the two w2 served are restored from the changelog, never taken
        # from the cores w1 set aside at the join (w2 has moved them on since)
        assert after_leave == [("kept", mine), ("restored", others)], after_leave
        # ... while the kept two went on being served (restored in the background)
        assert f"restoring partitions {others} while serving the kept ones" in log1.read_text()

        await fleet.stop()
        assert all(fleet.closed_ok), "an emitter could not deliver every event"
        await trainer.wait_until(lambda v: v.complete(fleet.acked), timeout=90)
        await trainer.stop()
    finally:
        if not fleet._stop.is_set():
            await fleet.stop()
        w1.stop()
        if w2.proc is not None:
            w2.stop()
    assert diff_views(dict(fleet.acked), trainer.view) == []
    assert not any(trainer.view.gaps.values()), dict(trainer.view.gaps)
