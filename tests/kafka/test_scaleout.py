"""Scale-out of the reorder processor: two workers in one consumer group split the input
partitions (co-partitioned: partition p of both input topics to the same worker), and together
deliver every episode of a backlog, spread over both topics, in order, exactly once.

Speed-up is asserted only on a machine with room for it (>= 4 cores): the broker, the test's
producer/consumer and two workers share this project's 2-core CI machine, where one worker
already saturates what the broker leaves free, so the measured times are recorded (in
``bench/results/scaleout.json`` and the test's properties) but not compared; SCALING.md uses the
per-worker CPU figure instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from faults_support import committed_offsets, end_offsets
from support import Worker, make_episodes, produce, settings_for, shuffled_with_duplicates

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.settings import Settings
from trajbus.bus.topics import Topics
from trajbus.consumers.operator.deadletters import read_dead_letters
from trajbus.consumers.replay.client import ReplayClient
from trajbus.schemas.codec import default_codec

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(420)]

PARTITIONS = 3  # odd: a round-robin assignment would split partition p of the two input topics
EPISODES = 1000  # ~12,000 events with duplicates: seconds of one worker's CPU
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


Episodes = dict[tuple[str, str], list[bytes]]


async def _all_assigned(logs: list[Path], timeout: float = 90) -> None:
    """Wait until every worker logged the restore of its first assignment (incremental
    rebalancing moves partitions to a joining member in a second round)."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() and "for partitions" in p.read_text(errors="replace")
                  for p in logs):
        if time.monotonic() > deadline:
            raise TimeoutError("not every worker was given partitions: "
                               + " | ".join(p.read_text(errors="replace")[-500:]
                                            for p in logs if p.exists()))
        await asyncio.sleep(0.2)


async def _drain_backlog(settings: Settings, name: str, produce_backlog: Any,
                         expected: Episodes) -> tuple[float, Episodes]:
    """Produce the backlog to the running workers; seconds until the trainer holds every
    episode."""
    got: Episodes = {}
    codec = default_codec()
    async with ReplayClient(["task-a"], f"{name}-trainer", settings,
                            max_in_flight=100_000) as client:
        t0 = time.monotonic()
        await produce_backlog()

        async def loop() -> None:
            async for ep in client.episodes():
                got[(ep.sandbox, ep.episode)] = [codec.encode(e.kind, e.record)
                                                 for e in ep.events]
                await client.ack(ep)
                if len(got) >= len(expected):
                    return

        try:
            await asyncio.wait_for(loop(), 300)
        except TimeoutError:
            missing = sorted(set(expected) - set(got))
            dls = await read_dead_letters(settings)
            reasons = Counter(f"{d.stage}/{d.reason_code}" for d in dls)
            raise AssertionError(
                f"the trainer holds {len(got)} of {len(expected)} episodes after 300 s; "
                f"missing e.g. {missing[:5]}; dead letters: {dict(reasons) or 'none'}"
                + "".join(f"\n  {d.reason}" for d in dls[:3])) from None
        took = time.monotonic() - t0
    return took, got


async def _run(kafka_broker: Any, unique_name: str, tmp_path: Path, n_workers: int
               ) -> tuple[float, list[str]]:
    prefix = f"{unique_name}-{n_workers}w"
    settings = settings_for(kafka_broker.bootstrap, prefix, partitions=PARTITIONS)
    await ensure_base_topics(settings, ["task-a"])
    eps = make_episodes(EPISODES, seed=7, steps=8)
    logs = [tmp_path / f"{prefix}-w{i}.log" for i in range(n_workers)]
    workers = [Worker(settings, "reorder", worker_id=f"w{i}", log_path=logs[i])
               for i in range(n_workers)]

    async def backlog() -> None:
        # Half of the records on the trace-chunk topic: an episode's records arrive on
        # partition p of both input topics, and only a worker that owns partition p of both
        # (co-partitioned assignment) sees the whole episode.
        # Written in alternating slices, as sandboxes write both topics at once: a record's
        # neighbours in seq order are written within well under the gap timeout.
        items = shuffled_with_duplicates(eps, 7, dup_rate=0.05)
        topics = Topics(settings)
        for i in range(0, len(items), 1000):
            part = items[i:i + 1000]
            await produce(settings, topics.sandbox_events, part[0::2])
            await produce(settings, topics.trace_chunks, part[1::2])

    try:
        for w in workers:
            w.start()
        await _all_assigned(logs)
        try:
            took, got = await _drain_backlog(settings, prefix, backlog,
                                             {(e.sandbox, e.episode): e.events for e in eps})
        except AssertionError as exc:  # say what the workers did (their logs are in tmp_path)
            tails = [p.read_text(errors="replace")[-4000:] for p in logs if p.exists()]
            raise AssertionError(f"{exc}\nworker logs ({tmp_path}):\n" + "\n---\n".join(tails)
                                 ) from None
    finally:
        for w in workers:
            w.stop()
    assert got == {(e.sandbox, e.episode): e.events for e in eps}, \
        "every episode in order, exactly once"
    return took, [p.read_text(errors="replace") if p.exists() else "" for p in logs]


async def test_two_workers_split_the_partitions_and_deliver_each_episode_once(
        kafka_broker: Any, unique_name: str, tmp_path: Path, record_property: Any) -> None:
    one, _ = await _run(kafka_broker, unique_name, tmp_path, 1)
    two, logs = await _run(kafka_broker, unique_name, tmp_path, 2)
    # Both workers of the group were given input partitions (the restore log line names them).
    assert all("for partitions" in log for log in logs), logs
    figures = {"episodes": EPISODES, "partitions": PARTITIONS, "cpus": os.cpu_count(),
               "load_average_1m": round(os.getloadavg()[0], 2),
               "one_worker_s": round(one, 2), "two_workers_s": round(two, 2),
               "speedup": round(one / two, 2)}
    record_property("scaleout", figures)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaleout.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"scale-out: {figures}")
    if (os.cpu_count() or 1) >= 4:
        assert two < one, f"two workers were not faster than one: {figures}"


async def test_a_worker_reading_one_topic_far_ahead_of_the_other_delivers_every_episode(
        kafka_broker: Any, unique_name: str, tmp_path: Path) -> None:
    """Consumers give no order across topics: a stalled fetch lets a worker read one input
    topic thousands of records ahead of the other (the cause of this file's first test failing
    in CI, 950 of 1,000 episodes). Its sandboxes then seem to have many episodes open, their
    ends unread on the other topic. Forced here: the trace-chunk records are written, as a
    sandbox writes them, right after their episodes' other records, but inside a transaction
    that stays open until the worker has read and committed the whole events topic (a
    read_committed consumer stops at an open transaction). With a per-sandbox limit of 8 open
    episodes and 28 sequential episodes per sandbox, every episode still reaches the trainer,
    in order, exactly once; none is dead-lettered as ``too_many_open_episodes``."""
    from aiokafka import AIOKafkaProducer

    from trajbus.bus.producer import producer_options

    prefix = f"{unique_name}-lag"
    settings = settings_for(kafka_broker.bootstrap, prefix, partitions=PARTITIONS)
    await ensure_base_topics(settings, ["task-a"])
    eps = make_episodes(200, seed=11, steps=8)
    items = shuffled_with_duplicates(eps, 11, dup_rate=0.0)
    topics = Topics(settings)
    log = tmp_path / f"{prefix}.log"
    worker = Worker(settings, "reorder", log_path=log, extra_env={
        "TRAJBUS_REPLAY__MAX_OPEN_EPISODES_PER_SANDBOX": "8"})

    async def lead_then_lag() -> None:
        held_back = AIOKafkaProducer(**producer_options(settings.kafka),
                                     transactional_id=f"{prefix}-held-back")
        await held_back.start()
        try:
            await held_back.begin_transaction()
            for i in range(0, len(items), 50):  # both topics written together, in slices
                part = items[i:i + 50]
                await produce(settings, topics.sandbox_events, part[0::2])
                await asyncio.gather(*[await held_back.send(topics.trace_chunks, v,
                                                            key=k.encode())
                                       for k, v in part[1::2]])
            leading = await end_offsets(settings, [topics.sandbox_events])
            deadline = time.monotonic() + 120
            while True:  # the worker has read and committed the whole events topic
                done = await committed_offsets(settings, f"{prefix}.reorder")
                if all(done.get(tp, 0) >= n for tp, n in leading.items()):
                    break
                assert time.monotonic() < deadline, f"the worker did not read {leading}: {done}"
                await asyncio.sleep(0.2)
            await held_back.commit_transaction()  # the chunks topic can now be read
        finally:
            await held_back.stop()

    worker.start()
    try:
        await _all_assigned([log])
        try:
            _, got = await _drain_backlog(settings, prefix, lead_then_lag,
                                          {(e.sandbox, e.episode): e.events for e in eps})
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nworker log:\n{log.read_text(errors='replace')[-4000:]}"
                                 ) from None
    finally:
        worker.stop()
    assert got == {(e.sandbox, e.episode): e.events for e in eps}, \
        "every episode in order, exactly once"
