"""File descriptors stay flat: 1,000 emitters created and closed in one process share the one
producer, and a broker restart does not leak connections."""

from __future__ import annotations

import asyncio

import pytest

from trajbus.bus import producer as producer_mod
from trajbus.bus.producer import close_producer
from trajbus.infra.broker import LocalBroker, free_port
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.testing import create_topics, make_settings, open_fds, read_topics

pytestmark = [pytest.mark.kafka]


@pytest.fixture(autouse=True)
async def _close_shared_producer():
    yield
    if producer_mod._loop is asyncio.get_running_loop():
        await close_producer()


@pytest.mark.timeout(300)
async def test_fds_flat_over_1000_emitters(kafka_broker, unique_name, tmp_path):
    s = make_settings(kafka_broker.bootstrap, unique_name, tmp_path)
    await create_topics(s)
    builds = producer_mod.builds
    async with SandboxEmitter("warm", "task-a", settings=s) as em:
        await em.heartbeat()
    base = open_fds()
    peak = base
    for i in range(1000):
        em = SandboxEmitter(f"sb-{i}", "task-a", settings=s, durability="os")
        await em.start()
        await em.heartbeat()
        await em.close(30)
        if i % 100 == 0:
            peak = max(peak, open_fds())
    after = open_fds()
    assert after <= base + 3, (base, after)
    assert peak <= base + 8, (base, peak)
    assert producer_mod.builds - builds <= 1  # one shared producer for all of them
    seen = await read_topics(s, [em.topics.sandbox_events], lambda xs: len(xs) >= 1001,
                             timeout=60)
    assert len({x.header["sandbox"] for x in seen}) == 1001


@pytest.mark.timeout(300)
async def test_fds_flat_across_broker_restart(unique_name, tmp_path):
    broker = LocalBroker(data_dir=tmp_path / "kafka", port=free_port(),
                         controller_port=free_port())
    await asyncio.to_thread(broker.start, 120)
    try:
        s = make_settings(broker.bootstrap, unique_name, tmp_path / "state")
        await create_topics(s)
        emitters = [SandboxEmitter(f"sb-{i}", "task-a", settings=s, queue_policy="spill")
                    for i in range(50)]
        for em in emitters:
            await em.start()
            await em.heartbeat()
        assert all([await em.flush(30) for em in emitters])
        base = open_fds()
        await asyncio.to_thread(broker.stop, 30)
        for _ in range(3):  # keep producing while the broker is down
            for em in emitters:
                await em.heartbeat()
            await asyncio.sleep(1.0)
        during = open_fds()
        await asyncio.to_thread(broker.start, 120)
        for em in emitters:
            await em.heartbeat()
        assert all([await em.flush(90) for em in emitters])
        after = open_fds()
        for em in emitters:
            await em.close(10)
        seen = await read_topics(s, [emitters[0].topics.sandbox_events],
                                 lambda xs: len(xs) >= 50 * 5, timeout=60)
        per: dict[str, set[int]] = {}
        for x in seen:
            per.setdefault(x.header["sandbox"], set()).add(x.header["seq"])
        assert all(v == set(range(5)) for v in per.values()) and len(per) == 50
        assert during <= base + 10, (base, during)
        assert after <= base + 5, (base, after)
    finally:
        await close_producer()
        await asyncio.to_thread(broker.stop, 30)
