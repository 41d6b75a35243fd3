"""The closed-loop fleet simulator (issue 14, finding 4): like a real runtime, a simulated
sandbox sends its SandboxRequest and starts only once the scheduler placed it; a queued one
waits. Against a real broker and a real scheduler worker."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from support import Worker, settings_for

from trajbus.bus import producer as producer_mod
from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.kafka import connection_options
from trajbus.bus.producer import close_producer
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.producers.simulator import Manifest, PlacementError, simulate
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

TASKS = ["swe-bench", "web-shop", "math-proofs"]
# No loops (no watchdog runs here), no crashes (every episode ends: a Drained with no open
# episode confirms the drain without the replay stage), small episodes.
FLEET: dict[str, Any] = dict(loop=0, cycle=0, nonloop=0, crash=0, migrate=0.3, duplicate=0,
                             blob=0, steps_min=2, steps_max=4)
codec = default_codec()


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


async def _read_to_end(settings: Settings, topics: list[str]
                       ) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(topic, record timestamp, kind, record) of every committed record of ``topics`` up to
    the end offsets taken now."""
    consumer = AIOKafkaConsumer(**connection_options(settings.kafka), enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    out: list[tuple[str, int, str, dict[str, Any]]] = []
    try:
        tps = [TopicPartition(t, p) for t in topics
               for p in sorted(await consumer._client._wait_on_metadata(t))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if ends[tp] > 0}
        deadline = time.monotonic() + 60
        while pending:
            assert time.monotonic() < deadline, f"still reading {pending}"
            batch = await consumer.getmany(*pending, timeout_ms=300)
            for tp, msgs in batch.items():
                for m in msgs:
                    d = codec.decode(m.value or b"")
                    out.append((tp.topic, m.timestamp, d.kind, d.record))
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return out


async def _decisions_until(settings: Settings, done: Any, timeout: float
                           ) -> list[tuple[str, int, str, dict[str, Any]]]:
    deadline = time.monotonic() + timeout
    while True:
        recs = await _read_to_end(settings, [Topics(settings).decisions])
        if done(recs):
            return recs
        assert time.monotonic() < deadline, Counter(r[3]["decision"] for r in recs)
        await asyncio.sleep(0.5)


def _content(m: Manifest) -> list[Any]:
    return sorted((e.task, e.sandbox, e.episode, e.behaviour, e.outcome, sorted(e.acked))
                  for e in m.episodes)


async def test_queued_sandboxes_start_only_once_placed_and_every_lifecycle_ends_cleanly(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    """A tenant credit of 2 CPU (burst 3) admits one 2-CPU sandbox per tenant at a time: with
    8 sandboxes over 3 tenants some queue. Each sandbox emits nothing before its PLACE; the
    scheduler sees no dead letter and no anomaly; every sandbox is placed, drained and
    recycled exactly once; the events are the same as an open-loop run of the same seed."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, TASKS)
    topics = Topics(settings)
    n = 8
    worker = Worker(settings, "scheduler", "ws", log_path=tmp_path / "scheduler.log",
                    extra_env={"TRAJBUS_SCHEDULER__TENANT_DEFAULT_CREDIT_CPU": "2"}).start()
    try:
        closed = await simulate(settings, sandboxes=n, episodes=2, seed=41,
                                state_root=tmp_path / "closed", tasks=TASKS,
                                start_ms=int(time.time() * 1000), first_decision_timeout_s=60,
                                placement_timeout_s=120, **FLEET)
        await close_producer()

        def all_recycled(recs: list[tuple[str, int, str, dict[str, Any]]]) -> bool:
            return sum(r[3]["decision"] == "RECYCLE" for r in recs) >= n

        decisions = await _decisions_until(settings, all_recycled, timeout=90)
    finally:
        worker.stop()
    assert worker.proc is not None

    by_sb: dict[str, list[str]] = defaultdict(list)
    placed_at: dict[str, int] = {}
    for _, ts, _, d in decisions:
        by_sb[d["header"]["sandbox"]].append(d["decision"])
        if d["decision"] == "PLACE":
            placed_at[d["header"]["sandbox"]] = ts
    assert sorted(by_sb) == sorted(closed.placements) and len(by_sb) == n, by_sb
    for sb, kinds in by_sb.items():
        assert [k for k in kinds if k not in ("QUEUE", "ADMIT")] == \
            ["PLACE", "DRAIN", "RECYCLE"], (sb, kinds)
    queued = {sb for sb, kinds in by_sb.items() if "QUEUE" in kinds}
    assert queued, "the credit should have queued some sandboxes"
    assert {sb for sb, p in closed.placements.items() if "QUEUE" in p["decisions"]} == queued
    assert all(p["decisions"][-1] == "PLACE" for p in closed.placements.values())

    # nothing of a sandbox is on the log before its placement
    events = await _read_to_end(settings, [topics.sandbox_events, topics.trace_chunks])
    first_event: dict[str, int] = {}
    for _, ts, _, rec in events:
        sb = rec["header"]["sandbox"]
        if sb.startswith("sb-41-"):  # not the workers' tick watermarks
            first_event[sb] = min(ts, first_event.get(sb, ts))
    assert sorted(first_event) == sorted(by_sb)
    for sb in by_sb:
        assert first_event[sb] >= placed_at[sb], (sb, sb in queued)

    # a clean fleet: no dead letter from the scheduler
    assert await _read_to_end(settings, [topics.deadletter]) == []

    # waiting changes when a sandbox's events are sent, not what they are
    s2 = settings_for(kafka_broker.bootstrap, unique_name + "-open")
    await ensure_base_topics(s2, TASKS)
    opened = await simulate(s2, sandboxes=n, episodes=2, seed=41, state_root=tmp_path / "open",
                            tasks=TASKS, start_ms=closed.config["start_ms"],
                            wait_for_placement=False, **FLEET)
    assert _content(opened) == _content(closed) and opened.placements == {}


async def test_without_a_scheduler_the_closed_loop_fails_at_its_deadline_with_a_clear_error(
        kafka_broker, unique_name, tmp_path: Path) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    await ensure_base_topics(settings, TASKS)
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        await simulate(settings, sandboxes=3, episodes=1, seed=5, state_root=tmp_path / "s",
                       tasks=TASKS, first_decision_timeout_s=3, **FLEET)
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert "no scheduling decision" in msg and "sb-5-" in msg and "wait_for_placement" in msg
    # no sandbox started: only the requests were sent
    assert await _read_to_end(settings, [Topics(settings).sandbox_events]) == []
