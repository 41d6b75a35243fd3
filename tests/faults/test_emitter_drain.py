"""drain(): delivers everything while the broker is slow, and when the deadline is too short
reports exactly the events that were not acknowledged (they stay journaled and are delivered
by the next emitter on the directory)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.infra.processes import freeze
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


@contextlib.contextmanager
def _paused(pid: int) -> Iterator[None]:
    freeze(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_drain_delivers_everything_through_a_slow_broker(kafka_broker, unique_name,
                                                                tmp_path):
    broker = kafka_broker.require_local()
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    pid = broker.pid()
    assert pid is not None
    async with SandboxEmitter("sb-slow", "task-a", settings=s) as em:
        await em.start_episode("e1")
        await em.start_episode("e2")
        freeze(pid)
        try:
            for i in range(300):
                await em.tool_call("e1" if i % 2 else "e2", "t", {"i": i})
            loop = asyncio.get_running_loop()
            loop.call_later(2.0, os.kill, pid, signal.SIGCONT)  # the broker is slow, not dead
            report = await em.drain(30)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert report.complete, report
        assert report.unflushed == [] and report.drained_acked
        assert report.final_seqs == {"e1": 150, "e2": 150}
        assert report.elapsed_s >= 1.5
    seen = await read_topics(s, [em.topics.sandbox_events],
                             lambda xs: any(x.kind == "Drained" for x in xs))
    assert sum(x.kind == "ToolCall" for x in seen) >= 300
    drained = next(x.record for x in seen if x.kind == "Drained")
    assert drained["complete"] is True
    assert sorted((f["episode"], f["final_seq"]) for f in drained["final_seqs"]) == [
        ("e1", 150), ("e2", 150)]
    await broker_ready(kafka_broker.bootstrap)


async def test_drain_deadline_reports_exactly_what_was_not_flushed(kafka_broker, unique_name,
                                                                   tmp_path):
    broker = kafka_broker.require_local()
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    pid = broker.pid()
    assert pid is not None
    em = SandboxEmitter("sb-dl", "task-a", settings=s)
    await em.start()
    await em.start_episode("e1")
    early = [await em.tool_call("e1", "t", {"i": i}) for i in range(10)]
    assert await em.flush(30)
    with _paused(pid):
        late_ids = []
        for i in range(50):
            await em.tool_call("e1", "t", {"late": i})
        late_ids = [x for x in range(11, 61)]
        report = await em.drain(1.5)
        assert not report.complete
        assert report.elapsed_s < 3.0
        # exactly the 50 late tool calls plus the Drained event itself are unflushed
        unflushed = {(u.kind, u.episode, u.seq) for u in report.unflushed}
        assert {(k, e, q) for k, e, q in unflushed if k == "ToolCall"} == {
            ("ToolCall", "e1", q) for q in late_ids}
        assert ("Drained", None, 0) in unflushed
        assert report.final_seqs == {"e1": 60}
        assert report.unflushed_count == 51
        await em.abort()
    # the next emitter on the directory delivers what drain could not
    async with SandboxEmitter("sb-dl", "task-a", settings=s) as em2:
        assert em2.pending_count <= 51
        assert await em2.flush(60)
    seen = await read_topics(s, [em.topics.sandbox_events],
                             lambda xs: sum(x.kind == "ToolCall" for x in xs) >= 60 and
                             any(x.kind == "Drained" for x in xs), timeout=60)
    assert check_streams(seen).problems() == []
    drained = next(x.record for x in seen if x.kind == "Drained")
    assert drained["complete"] is False and drained["unflushed"] == 50
    assert len(early) == 10


async def broker_ready(bootstrap: str) -> None:
    """The broker answers again (after SIGCONT) before the next test uses it."""
    from trajbus.infra.broker import probe_broker

    host, port = bootstrap.rsplit(":", 1)
    for _ in range(100):
        if await asyncio.to_thread(probe_broker, host, int(port), 2.0):
            return
        await asyncio.sleep(0.1)
