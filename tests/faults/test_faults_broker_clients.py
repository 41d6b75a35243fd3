"""Clients running *through* a broker SIGKILL and restart (issue 9, "not covered yet"): a
trainer's ReplayClient and the archiver, each started before the kill and kept running until
well after the restart. A private broker (the session broker is shared by every test).

What must hold: the trainer's view per episode equals exactly what the emitters acknowledged
(none missing, none twice, in order) and the trainer task survives; the archive holds every
record of the source topics exactly once, every acknowledged event is in it, and the
archiver's committed offsets reach the end of its topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import aiokafka.client as aiokafka_client
import duckdb
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from faults_support import (
    LiveTrainer,
    PacedFleet,
    TrainerView,
    committed_offsets,
    diff_views,
    end_offsets,
    own_broker,
    read_all,
    wait_caught_up,
)
from support import Worker, settings_for

from trajbus.archive.archiver import run_archiver
from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.kafka import connection_options
from trajbus.bus.producer import close_producer, producer_options
from trajbus.bus.reconnect import BACKOFF
from trajbus.bus.reconnect import install as install_reconnect_backoff
from trajbus.bus.settings import ArchiveSettings
from trajbus.bus.topics import Topics
from trajbus.infra.broker import LocalBroker

pytestmark = [pytest.mark.kafka]


@pytest.fixture(scope="module")
def killable_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """A private broker for this module's tests (each kills and restarts it; one broker
    start saved). Tests use their own topic prefixes and groups."""
    with own_broker(tmp_path_factory.mktemp("killable") / "kafka") as broker:
        yield broker


@contextlib.contextmanager
def _running(broker: LocalBroker) -> Iterator[LocalBroker]:
    """The broker, up (a previous test that failed mid-outage may have left it down)."""
    broker.start(timeout=120)
    yield broker


async def _kill_and_restart(broker: LocalBroker, fleet: PacedFleet, outage_s: float = 3.0) -> None:
    """SIGKILL the broker, keep the fleet emitting through an outage, restart it."""
    broker.kill()
    emitted_at_kill = fleet.emitted
    await asyncio.sleep(outage_s)  # the outage itself: its length is the fault's parameter
    assert fleet.emitted > emitted_at_kill, "emitters blocked while the broker was down"
    await asyncio.to_thread(broker.start, 120)


def _received(view: TrainerView) -> int:
    return sum(map(len, view.events.values()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outage_s", [3.0, 13.0], ids=["short", "beyond-session-timeout"])
async def test_trainer_consuming_through_broker_sigkill_sees_each_acknowledged_event_once(
        killable_broker: LocalBroker, tmp_path: Path, unique_name: str,
        outage_s: float) -> None:
    """Two trainers (own groups) through the same kill: one acknowledges each segment at
    once, the other holds its last 16 segments unacknowledged (so across the outage). An
    outage longer than the group session timeout (10 s) makes each trainer's consumer rejoin
    its group after the restart: a commit made meanwhile is refused (soak run 14339,
    2026-12-03: the trainer's ``ack`` raised it and the trainer stopped)."""
    with _running(killable_broker) as broker:
        settings = settings_for(broker.bootstrap, unique_name, partitions=2)
        await ensure_base_topics(settings, ["task-a"])
        worker = Worker(settings, "reorder", "w0", log_path=tmp_path / "worker.log").start()
        fleet = PacedFleet(settings, tmp_path / "sandboxes", n=3, step_s=0.25,
                           steps_per_episode=10, name="tr").start()
        trainers = [LiveTrainer(settings, ["task-a"], f"{unique_name}-trainer-lag{lag}",
                                ack_lag=lag).start() for lag in (0, 16)]
        try:
            # The trainers are receiving segments: kill the broker under them.
            for t in trainers:
                await t.wait_until(lambda v: _received(v) >= 50, 90)
                assert _received(t.view) >= 50, "a trainer got nothing before the kill"
            before = [_received(t.view) for t in trainers]
            await _kill_and_restart(broker, fleet, outage_s)
            # production continues on the restarted broker and reaches the trainers
            for t, n in zip(trainers, before, strict=True):
                await t.wait_until(lambda v, n=n: _received(v) > n + 100, 90)
            await fleet.stop()
            await close_producer()
            assert all(fleet.closed_ok), "an emitter could not flush after the restart"
            expected = dict(fleet.acked)
            for t in trainers:
                await t.wait_until(lambda v: v.complete(expected), 150)
            await asyncio.gather(*(t.stop() for t in trainers))
            assert worker.proc is not None and worker.proc.poll() is None, (
                "the worker died with the broker: "
                + (tmp_path / "worker.log").read_text()[-3000:])
        finally:
            worker.stop()
    assert len(expected) >= 6
    for t in trainers:
        print(f"trainer ack_lag={t.ack_lag} stats: {t.client.stats if t.client else None}")
        assert t.error is None
        assert diff_views(expected, t.view) == [], f"ack_lag={t.ack_lag}"


@pytest.mark.timeout(300)
async def test_archiver_running_through_broker_sigkill_archives_each_record_once(
        killable_broker: LocalBroker, tmp_path: Path, unique_name: str) -> None:
    archive = tmp_path / "archive"
    with _running(killable_broker) as broker:
        settings = settings_for(
            broker.bootstrap, unique_name, partitions=2, archive=ArchiveSettings(
                url=str(archive), spool_dir=str(tmp_path / "spool"),
                target_object_bytes=20_000))  # small objects: batches commit all the time
        await ensure_base_topics(settings, ["task-a"])
        topics = Topics(settings)
        group = f"{unique_name}-archiver"
        # sandbox ids "ar-sb-0..2" land on both partitions of the events topic
        fleet = PacedFleet(settings, tmp_path / "sandboxes", n=3, step_s=0.25,
                           steps_per_episode=10, name="ar").start()
        stop = asyncio.Event()
        archiver = asyncio.create_task(run_archiver(settings, stop, group_id=group,
                                                    dead_letter=_no_dead_letters))
        try:
            # The archiver has committed batches: kill the broker under it.
            deadline = time.monotonic() + 90
            while not await committed_offsets(settings, group):
                assert not archiver.done(), archiver.exception()
                assert time.monotonic() < deadline, "the archiver never committed a batch"
                await asyncio.sleep(0.3)
            await _kill_and_restart(broker, fleet)
            # archival continues after the restart: commits move again
            before = await committed_offsets(settings, group)
            deadline = time.monotonic() + 90
            while (await committed_offsets(settings, group)) == before:
                assert not archiver.done(), archiver.exception()
                assert time.monotonic() < deadline, "no commit after the broker restart"
                await asyncio.sleep(0.3)
            await fleet.stop()
            await close_producer()
            assert all(fleet.closed_ok), "an emitter could not flush after the restart"
            # The same run keeps archiving after the restart: its commits reach the end of
            # the topics, short of one open batch per partition (below the object size).
            ends = await end_offsets(settings, topics.input_topics)
            deadline = time.monotonic() + 90
            trace = []
            while True:
                assert not archiver.done(), archiver.exception()
                committed = await committed_offsets(settings, group)
                trace.append((round(time.monotonic() - deadline + 90, 1), committed))
                if all(committed.get(tp, 0) >= end - 100 for tp, end in ends.items()):
                    break
                assert time.monotonic() < deadline, (
                    f"the archiver stopped progressing after the restart: ends {ends}, "
                    f"committed {trace[::10]}")
                await asyncio.sleep(0.3)
            # Stopping flushes the open batches and commits them; a second, until-idle run
            # of the same group archives whatever the first had not read yet (usually
            # nothing) -- exactly once across the two runs as well.
            stop.set()
            stats = await asyncio.wait_for(archiver, 120)
            rest = await run_archiver(settings, group_id=group, until_idle=True,
                                      dead_letter=_no_dead_letters)
            ends = await end_offsets(settings, topics.input_topics)
            committed = await committed_offsets(settings, group)
            await wait_caught_up(settings, group, topics.input_topics, timeout=30)
            records = await read_all(settings, topics.input_topics)
        finally:
            stop.set()
            if not archiver.done():
                archiver.cancel()
    print(f"archiver stats: {stats}; until-idle run after it: {rest}; ends {ends}; "
          f"committed {committed}")
    # every source record exactly once, by its Kafka position (the archiver's exactly-once key)
    rows = duckdb.sql(
        "SELECT kafka_topic, kafka_partition, kafka_offset, event_id, count(*) "
        f"FROM read_parquet('{archive}/events/**/*.parquet') "
        "GROUP BY ALL").fetchall()
    archived = Counter({(t, p, o): n for t, p, o, _, n in rows})
    assert [k for k, n in archived.items() if n > 1] == [], "a record was archived twice"
    assert len({(t, p) for t, p, _ in archived}) == 2  # both partitions of the events topic
    assert set(archived) == {(r.topic, r.partition, r.offset) for r in records}
    # every acknowledged event is there, once (counted, not deduplicated)
    by_event = Counter()
    for _, _, _, event_id, n in rows:
        by_event[event_id] += n
    acked = {eid for pairs in fleet.acked.values() for _, eid in pairs}
    assert len(acked) >= 200
    assert acked <= set(by_event), sorted(acked - set(by_event))[:5]
    assert {e: n for e, n in by_event.items() if n > 1} == {}, "an event was archived twice"


async def _no_dead_letters(*args: object) -> None:
    raise AssertionError(f"unexpected dead letter: {args[5:]}")


def _wait_for_log(path: Path, needles: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        if all(n in text for n in needles):
            return
        assert time.monotonic() < deadline, f"not in the log: {needles}\n{text[-3000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(240)
async def test_a_worker_told_to_stop_while_the_broker_is_away_exits_within_seconds(
        killable_broker: LocalBroker, tmp_path: Path, unique_name: str) -> None:
    """SIGTERM during a broker outage: the worker neither waits for deliveries that cannot
    happen (its tickers' ticks, an in-flight transaction) nor reaches the 60 s hard exit; it
    stops in seconds with exit code 0. It used to take 60 s and exit 1 with thread dumps: the
    main loop awaited its in-flight transaction (retried by aiokafka until the broker is
    back), and each ticker its producer's close (waiting to deliver the queued ticks)."""
    with _running(killable_broker) as broker:
        settings = settings_for(broker.bootstrap, unique_name, partitions=2)
        await ensure_base_topics(settings, ["task-a"])
        log_path = tmp_path / "worker.log"
        worker = Worker(settings, "reorder,watchdog,scheduler", "w-stop",
                        log_path=log_path).start()
        try:
            await asyncio.to_thread(_wait_for_log, log_path, [
                f"{name}: restored" for name in ("reorder", "watchdog", "scheduler")], 120)
            broker.kill()
            # the outage before the stop (the fault's parameter): ticks queue up meanwhile
            await asyncio.sleep(3)
            started = time.monotonic()
            code = await asyncio.to_thread(worker.stop, 90)
            took = time.monotonic() - started
        finally:
            if worker.proc is not None and worker.proc.poll() is None:
                worker.kill()
        log_text = log_path.read_text(errors="replace")
        assert "did not stop within" not in log_text, log_text[-3000:]
        assert code == 0, log_text[-3000:]
        # the in-flight transaction's 10 s (SETTLE_ON_STOP_S) and a few seconds of closing
        assert took < 30, f"stopped after {took:.1f} s"


@pytest.mark.timeout(240)
async def test_clients_of_an_absent_broker_back_off_their_reconnects_and_resume_when_it_returns(
        killable_broker: LocalBroker, unique_name: str) -> None:
    """aiokafka retries a lost broker on each retry of each of its routines: an idle worker
    opened ~190 connections a second during an outage (finding Z). With the reconnect backoff
    (trajbus.bus.reconnect) a producer and a group consumer of the dead broker try it about
    once a second once the backoff has grown, and resume by themselves when it is back: the
    send made during the outage is delivered and consumed. The same outage is also measured
    with the backoff turned off, side by side on the same box."""
    install_reconnect_backoff(50, 1000)  # first: the count below sits under its wrapper
    attempts: list[float] = []
    original = aiokafka_client.create_conn

    async def counting_create_conn(*args: Any, **kwargs: Any) -> Any:
        attempts.append(time.monotonic())
        return await original(*args, **kwargs)

    def count_over(seconds: float) -> float:
        start = len(attempts)
        time.sleep(seconds)  # the measuring window itself, not a wait for a condition
        return (len(attempts) - start) / seconds

    base, cap = BACKOFF.base_s, BACKOFF.max_s
    with _running(killable_broker) as broker, mock.patch.object(
            aiokafka_client, "create_conn", counting_create_conn):
        settings = settings_for(broker.bootstrap, unique_name, partitions=2)
        await ensure_base_topics(settings, ["task-a"])
        topic = Topics(settings).sandbox_events
        producer = AIOKafkaProducer(**producer_options(settings.kafka))
        consumer = AIOKafkaConsumer(topic, **connection_options(settings.kafka),
                                    group_id=f"{unique_name}-g", auto_offset_reset="earliest",
                                    enable_auto_commit=False)
        await producer.start()
        await consumer.start()
        try:
            await producer.send_and_wait(topic, b"before", key=b"k")
            assert (await asyncio.wait_for(consumer.getone(), 60)).value == b"before"
            broker.kill()
            during = asyncio.ensure_future(producer.send_and_wait(topic, b"during", key=b"k"))
            received = asyncio.ensure_future(consumer.getone())
            # The loop must keep running while we count, so the windows run in a thread.
            await asyncio.sleep(1)
            with_backoff = await asyncio.to_thread(count_over, 8)
            BACKOFF.configure(0, 0)
            without = await asyncio.to_thread(count_over, 4)
            BACKOFF.configure(base, cap)
            await asyncio.sleep(1.5)  # the next attempts are under the backoff again
            await asyncio.to_thread(broker.start, 120)
            back = time.monotonic()
            await asyncio.wait_for(during, 60)
            got = await asyncio.wait_for(received, 60)
            resumed = time.monotonic() - back
            # a connection that succeeds again resets the backoff of its address
            brokers = producer.client.cluster.brokers()
            assert brokers and [BACKOFF.failures((b.host, b.port)) for b in brokers] == [0]
        finally:
            BACKOFF.configure(base, cap)
            await producer.stop()
            await consumer.stop()
    print(f"connection attempts per second during the outage: {with_backoff:.1f} with the "
          f"backoff, {without:.1f} without; delivered {resumed:.1f} s after the broker was back")
    assert got.value == b"during"
    assert with_backoff <= 8, f"{with_backoff:.1f} connection attempts a second with the backoff"
    assert with_backoff * 5 <= without, (with_backoff, without)
    assert resumed < 15, f"the clients resumed {resumed:.1f} s after the broker was back"
