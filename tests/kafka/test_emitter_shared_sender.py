"""The shared sender (issue 18, item 4): every emitter of an event loop sends through one task.

Checked against a real broker: many emitters sharing it deliver every event exactly once, each
sandbox's events in seq order (Kafka offset order of its partition); every event is sent only
after a journal sync that started after it was appended ("durable before sent"); a journal whose
sync fails stops only its own emitter (reported in ``last_error``; its events stay journaled and
the next emitter on the directory sends them); one emitter closing while the others keep
sending; the ack records ride along with the next event's write."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer, get_producer
from trajbus.bus.topics import Topics
from trajbus.producers.emitter import AckInfo, SandboxEmitter
from trajbus.producers.journal import Journal
from trajbus.producers.journal import syncfs as journal_syncfs
from trajbus.producers.sender import shared_sender
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


def _sender_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "trajbus-emitter-sender"]


def _by_sandbox_in_offset_order(seen):
    out = defaultdict(list)
    for x in sorted(seen, key=lambda x: (x.topic, x.partition, x.offset)):
        out[x.header["sandbox"]].append(x.header["seq"])
    return out


async def test_many_emitters_share_one_sender_exactly_once_in_seq_order(
        kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path, partitions=3)
    await create_topics(s)
    n_em, per = 40, 30
    acks: dict[str, tuple[str, int, int]] = {}  # event id -> where on_ack says it is

    def on_ack(a: AckInfo) -> None:
        assert a.event_id not in acks
        acks[a.event_id] = (a.topic, a.partition, a.offset)

    ems = [await SandboxEmitter(f"sb-{i}", "task-a", settings=s, on_ack=on_ack).start()
           for i in range(n_em)]
    assert len(_sender_tasks()) == 1
    sender = shared_sender()
    rounds0 = sender.rounds

    async def drive(em: SandboxEmitter) -> None:
        await em.start_episode("e")
        for i in range(per):
            await em.tool_call("e", "t", {"i": i})
            if i % 7 == 0:
                await asyncio.sleep(0.001)
        await em.end_episode("e")

    await asyncio.gather(*(drive(em) for em in ems))
    assert all(await asyncio.gather(*(em.flush(60) for em in ems)))
    total = n_em * (per + 2)
    assert sum(em.acked_count for em in ems) == total
    # rounds are shared: far fewer rounds than events
    assert sender.rounds - rounds0 < total / 3, (sender.rounds - rounds0, total)
    assert len(_sender_tasks()) == 1
    for em in ems:
        assert await em.close(10)
    await asyncio.sleep(0.05)
    assert _sender_tasks() == []  # the task ends with its last emitter
    seen = await read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= total)
    assert len(seen) == total and len({x.header["event_id"] for x in seen}) == total
    assert check_streams(seen).problems() == []
    for sandbox, seqs in _by_sandbox_in_offset_order(seen).items():
        assert seqs == list(range(per + 2)), sandbox
    # each acknowledgement names where the record is
    assert {x.header["event_id"]: (x.topic, x.partition, x.offset) for x in seen} == acks


@pytest.mark.parametrize("journal_sync", ["file", "filesystem"])
async def test_every_event_is_sent_after_a_sync_of_its_append(kafka_broker, unique_name,
                                                             tmp_path, monkeypatch,
                                                             journal_sync):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    s.producer.journal_sync = journal_sync
    await create_topics(s)
    sender = shared_sender()
    synced: dict[int, int] = defaultdict(int)  # inode -> file size when a sync started

    def sync(fd: int) -> None:
        st = os.fstat(fd)
        os.fdatasync(fd)
        synced[st.st_ino] = max(synced[st.st_ino], st.st_size)

    def sync_filesystem(fd: int) -> None:
        # a syncfs makes every file of the filesystem durable as of its start: every journal
        sizes = {st.st_ino: st.st_size
                 for st in (p.stat() for p in tmp_path.rglob("seg-*.log"))}
        assert journal_syncfs is not None
        journal_syncfs(fd)
        for ino, size in sizes.items():
            synced[ino] = max(synced[ino], size)

    monkeypatch.setattr(sender, "_sync_fn", sync)
    monkeypatch.setattr(sender, "_syncfs_fn", sync_filesystem)
    syncfs_before = sender.syncfs_calls
    producer = await get_producer(s.kafka)
    appended: dict[bytes, list[tuple[int, int]]] = defaultdict(list)  # key -> (inode, size)
    sends: dict[bytes, int] = defaultdict(int)
    late: list[str] = []
    real_send = producer.send

    async def send(topic, value, key=None, **kw):
        i = sends[key]
        sends[key] += 1
        if i < len(appended[key]):
            ino, size = appended[key][i]
            if synced[ino] < size:
                late.append(f"{key!r} #{i}: synced {synced[ino]} < appended {size}")
        else:
            late.append(f"{key!r} #{i}: sent before its emit returned")
        return await real_send(topic, value, key=key, **kw)

    monkeypatch.setattr(producer, "send", send)
    ems = [await SandboxEmitter(f"sb-{i}", "task-a", settings=s).start() for i in range(10)]

    async def drive(em: SandboxEmitter) -> None:
        for _ in range(25):
            # the emit's append and the record of its size happen in one loop step
            task = asyncio.ensure_future(em.heartbeat())
            await asyncio.sleep(0)
            j = em._journal
            assert j is not None
            appended[em._key].append((os.fstat(j._fd).st_ino, j._size))
            await task

    await asyncio.gather(*(drive(em) for em in ems))
    assert all(await asyncio.gather(*(em.flush(60) for em in ems)))
    assert late == []
    assert sum(sends.values()) == 250
    if journal_sync == "filesystem":  # rounds of several journals shared a syncfs
        assert sender.syncfs_calls > syncfs_before
    else:
        assert sender.syncfs_calls == syncfs_before
    for em in ems:
        await em.close(10)


async def test_a_failing_journal_sync_stops_only_its_emitter(kafka_broker, unique_name,
                                                            tmp_path, monkeypatch):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    sender = shared_sender()
    bad = SandboxEmitter("sb-bad", "task-a", settings=s)
    good = [SandboxEmitter(f"sb-good-{i}", "task-a", settings=s) for i in range(5)]
    assert bad._journal is not None
    bad_ino = os.fstat(bad._journal._fd).st_ino

    def sync(fd: int) -> None:
        if os.fstat(fd).st_ino == bad_ino:
            raise OSError(5, "Input/output error (injected)")
        os.fdatasync(fd)

    monkeypatch.setattr(sender, "_sync_fn", sync)
    monkeypatch.setattr(sender, "_syncfs_fn", None)  # per file: the bad one fails alone
    for em in [bad, *good]:
        await em.start()
    for _ in range(10):
        for em in [bad, *good]:
            await em.heartbeat()
    assert all(await asyncio.gather(*(em.flush(30) for em in good)))
    assert not await bad.flush(1.0)
    assert bad.pending_count == 10 and bad.acked_count == 0
    assert bad.last_error is not None and "journal sync failed" in bad.last_error
    for _ in range(3):  # the others keep going
        for em in good:
            await em.heartbeat()
    assert all(await asyncio.gather(*(em.flush(30) for em in good)))
    report = await bad.drain(2.0)
    assert not report.complete and report.unflushed_count == 11  # 10 + its Drained
    assert "journal sync failed" in (report.error or "")
    await bad.abort()
    monkeypatch.setattr(sender, "_sync_fn", os.fdatasync)  # the disk is fine again
    async with SandboxEmitter("sb-bad", "task-a", settings=s) as again:
        assert again.pending_count == 11
        assert await again.flush(30)
    for em in good:
        assert await em.close(10)
    seen = await read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= 11 + 65)
    assert len(seen) == 11 + 65
    assert check_streams(seen).problems() == []


async def test_one_emitter_closes_while_the_others_keep_sending(kafka_broker, unique_name,
                                                               tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    ems = [await SandboxEmitter(f"sb-{i}", "task-a", settings=s).start() for i in range(8)]
    stop = asyncio.Event()
    counts = [0] * len(ems)

    async def drive(i: int, em: SandboxEmitter) -> None:
        while not stop.is_set():
            await em.heartbeat()
            counts[i] += 1
            await asyncio.sleep(0.002)

    drivers = [asyncio.create_task(drive(i, em)) for i, em in enumerate(ems[1:], start=1)]
    for _ in range(40):
        await ems[0].heartbeat()
        counts[0] += 1
    assert await ems[0].close(10)  # everything of it acknowledged, the others unaffected
    assert ems[0].pending_count == 0
    before = list(counts)
    await asyncio.sleep(0.5)
    assert all(counts[i] > before[i] for i in range(1, len(ems)))
    assert len(_sender_tasks()) == 1
    stop.set()
    await asyncio.gather(*drivers)
    for em in ems[1:]:
        assert await em.close(10)
    total = sum(counts)
    seen = await read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= total)
    assert len(seen) == total and check_streams(seen).problems() == []
    # a new emitter on the closed one's directory starts with nothing to re-send
    em0 = SandboxEmitter("sb-0", "task-a", settings=s)
    assert em0.pending_count == 0 and em0.next_seq() == 40
    await em0.abort()


def test_acks_ride_along_with_the_next_event_in_one_write(tmp_path: Path):
    j = Journal(tmp_path / "journal")
    j.open_new_segment({"rid": 0})
    for rid in range(3):
        j.append({"t": "E", "rid": rid, "s": "", "q": rid, "id": f"e{rid}", "k": "Heartbeat",
                  "tp": "x"}, b"v%d" % rid, [rid - 1] if rid else None)
    seg, off, length = j.append({"t": "E", "rid": 3, "s": "", "q": 3, "id": "e3",
                                 "k": "Heartbeat", "tp": "x"}, b"body", [2])
    assert j.read(seg, off, length) == b"body"
    j.close()
    rec = Journal(tmp_path / "journal").recover()
    assert [r.rid for r in rec.events] == [0, 1, 2, 3]
    assert rec.acked == {0, 1, 2}


def test_ack_header_text_is_what_json_dumps_writes() -> None:
    import json
    import random

    from trajbus.producers.journal import _header_json, _ranges

    rng = random.Random(7)
    for _ in range(5000):
        h: dict[str, object] = {"t": "A", "r": _ranges(
            [rng.randint(0, 10**13) for _ in range(rng.randint(1, 8))])}
        if rng.random() < 0.2:
            h = dict(reversed(list(h.items())))
        if rng.random() < 0.1:
            h["r"] = [*h["r"], [True, 3]]  # type: ignore[list-item]
        if rng.random() < 0.05:
            h["r"] = [[1, 2, 3]]
        assert _header_json(h) == json.dumps(h, separators=(",", ":")), h


async def test_a_backlog_larger_than_a_round_is_sent_in_full(kafka_broker, unique_name, tmp_path,
                                                             monkeypatch):
    """More pending events than one round takes (SEND_BATCH) -- a journal recovered after a
    restart, or a burst -- are all sent without waiting for another emit."""
    from trajbus.producers import sender as sender_mod

    monkeypatch.setattr(sender_mod, "SEND_BATCH", 50)
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    em = await SandboxEmitter("sb-b", "task-a", settings=s).start()
    assert em._sender is not None
    em._sender.cancel()  # journaled only
    for _ in range(230):
        await em.heartbeat()
    await em.abort()
    other = await SandboxEmitter("sb-o", "task-a", settings=s).start()  # a second member
    again = await SandboxEmitter("sb-b", "task-a", settings=s).start()
    assert again.pending_count == 230
    assert await again.flush(30)  # recovered backlog: 5 rounds, no emit needed
    for _ in range(170):  # a live burst larger than a round
        await other.heartbeat()
    assert await other.flush(30)
    await again.close(10)
    await other.close(10)
    seen = await read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= 400)
    assert len(seen) == 400 and check_streams(seen).problems() == []


async def test_the_round_interval_grows_with_the_emitters_open_up_to_its_cap() -> None:
    """A lone emitter never waits; up to 100 emitters a round starts at most every
    send_round_ms; beyond, send_round_ms per 100 open emitters, capped at send_round_max_ms,
    so a round keeps serving many emitters' events (issue 18: 1,000 emitters in one process)."""
    from types import SimpleNamespace

    from trajbus.producers.sender import SharedSender

    def member(round_ms: float, max_ms: float) -> object:
        return SimpleNamespace(settings=SimpleNamespace(producer=SimpleNamespace(
            send_round_ms=round_ms, send_round_max_ms=max_ms, timer_slack_max_ms=0)))

    sender = SharedSender()
    intervals = {}
    for n in range(1, 1001):
        sender.join(member(10, 50))  # type: ignore[arg-type]
        intervals[n] = sender.round_interval()
    assert intervals[1] == 0.0
    assert intervals[2] == intervals[100] == pytest.approx(0.010)
    assert intervals[200] == pytest.approx(0.020)
    assert intervals[500] == intervals[1000] == pytest.approx(0.050)
    # the strictest member decides: one emitter asking for rounds every 0 ms (as soon as due)
    sender.join(member(0, 0))  # type: ignore[arg-type]
    assert sender.round_interval() == 0.0
    for _ in range(1001):
        sender.leave(None)  # type: ignore[arg-type]
    assert sender._task is not None
    await asyncio.wait_for(sender._task, 5)  # no member left: its task ends


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl timer slack: Linux")
async def test_beyond_100_emitters_the_loop_thread_gets_a_timer_slack_and_gets_its_own_back(
) -> None:
    """With more than 100 emitters open the loop's thread gets a timer slack of the round
    interval, capped at timer_slack_max_ms, so the callers' timed wake-ups coalesce (issue 18);
    with 100 or fewer the thread's own slack is back, and 0 leaves the thread alone."""
    from types import SimpleNamespace

    from trajbus.producers.sender import SharedSender
    from trajbus.producers.timerslack import get_timer_slack_ns, set_timer_slack_ns

    def member(slack_max_ms: float) -> object:
        return SimpleNamespace(settings=SimpleNamespace(producer=SimpleNamespace(
            send_round_ms=10, send_round_max_ms=50, timer_slack_max_ms=slack_max_ms)))

    own = get_timer_slack_ns()
    assert own is not None and own < 10_000_000
    try:
        sender = SharedSender()
        slack = {}
        for n in range(1, 1001):
            sender.join(member(30))  # type: ignore[arg-type]
            slack[n] = get_timer_slack_ns()
        assert slack[1] == slack[100] == own
        assert slack[101] == pytest.approx(10_100_000, abs=1)  # the round interval at 101 open
        assert slack[200] == pytest.approx(20_000_000, abs=1)
        assert slack[300] == slack[1000] == 30_000_000  # capped at timer_slack_max_ms
        for n in range(1000, 0, -1):
            sender.leave(None)  # type: ignore[arg-type]
            if n == 151:
                assert get_timer_slack_ns() == pytest.approx(15_000_000, abs=1)
        assert get_timer_slack_ns() == own
        assert sender._task is not None
        await asyncio.wait_for(sender._task, 5)

        off = SharedSender()
        for _ in range(300):
            off.join(member(0))  # type: ignore[arg-type]
        assert get_timer_slack_ns() == own and off.timer_slack_ns is None
        for _ in range(300):
            off.leave(None)  # type: ignore[arg-type]
        assert off._task is not None
        await asyncio.wait_for(off._task, 5)

        # the loop ending with emitters still open (its sender task cancelled): slack given back
        ended = SharedSender()
        for _ in range(200):
            ended.join(member(30))  # type: ignore[arg-type]
        assert get_timer_slack_ns() == 20_000_000
        assert ended._task is not None
        ended._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ended._task
        assert get_timer_slack_ns() == own and ended.timer_slack_ns is None

        # someone else set the thread's slack meanwhile: theirs is kept
        other = SharedSender()
        for _ in range(200):
            other.join(member(30))  # type: ignore[arg-type]
        assert set_timer_slack_ns(7_000_000)
        for _ in range(200):
            other.leave(None)  # type: ignore[arg-type]
        assert get_timer_slack_ns() == 7_000_000
        assert other._task is not None
        await asyncio.wait_for(other._task, 5)
    finally:  # never leave the test thread slowed for the tests after this one
        set_timer_slack_ns(own)


async def test_a_shared_producer_that_can_no_longer_deliver_is_replaced_and_nothing_is_lost(
        kafka_broker, unique_name, tmp_path, monkeypatch):
    """RELIABILITY finding Y: an idempotent producer that lost a sequence has every later
    batch of that partition refused (OutOfOrderSequenceNumber), and an emitter re-sent its
    events through it for ever. The shared sender replaces it; every event arrives."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import OutOfOrderSequenceNumber

    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path, partitions=3)
    await create_topics(s)
    ems = [await SandboxEmitter(f"sb-{i}", "task-a", settings=s).start() for i in range(4)]
    broken = await get_producer(s.kafka)
    builds = producer_mod.builds
    real_send = AIOKafkaProducer.send

    async def send(self: AIOKafkaProducer, *args, **kwargs):
        if self is broken:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(OutOfOrderSequenceNumber())
            return failed
        return await real_send(self, *args, **kwargs)

    monkeypatch.setattr(AIOKafkaProducer, "send", send)
    for em in ems:
        await em.start_episode("e")
        for i in range(5):
            await em.tool_call("e", "t", {"i": i})
        await em.end_episode("e")
    assert all(await asyncio.gather(*(em.flush(30) for em in ems)))  # False before the fix
    assert shared_sender().replacements == 1
    assert producer_mod.builds == builds + 1
    assert all(em._producer is not broken for em in ems)
    total = 4 * 7
    seen = await read_topics(s, [Topics(s).sandbox_events], lambda xs: len(xs) >= total)
    assert len({x.header["event_id"] for x in seen}) == total
    assert check_streams(seen).problems() == []
    for em in ems:
        assert await em.close(10)
