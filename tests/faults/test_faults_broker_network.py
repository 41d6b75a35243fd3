"""The network to the broker hangs, then turns slow, while sandboxes emit and a worker
processes (issue 9: a partitioned / slow broker, as opposed to a dead one).

Every client (emitters' shared producer, the worker's consumer and transactional producer,
the trainer) reaches a private broker only through a :class:`faults_support.PausableProxy`:
the broker has a second listener whose advertised address is the proxy, so metadata sends
clients back through it. The proxy first holds every connection for 15 s (longer than the
consumer group's session timeout: the broker expires the worker, whose open transaction
must then be aborted and redone, not committed twice), then forwards with 20 ms of delay per
chunk, then recovers. What must hold, as for a dead broker: per episode the trainer receives
exactly what the emitters had acknowledged, none missing, none twice, in order, and the
worker process survives.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from faults_support import PacedFleet, PausableProxy, diff_views, own_broker, trainer_view
from support import Worker, consume_until, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.infra.broker import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(360)]


async def test_hung_then_slow_network_to_the_broker_loses_and_duplicates_nothing(
        tmp_path: Path) -> None:
    client_port = free_port()
    proxy = PausableProxy("127.0.0.1", client_port).start()
    extra = {  # a CLIENT listener advertised at the proxy; PLAINTEXT stays inter-broker
        "listeners": "PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport},"
                     f"CLIENT://127.0.0.1:{client_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{{port}},CLIENT://127.0.0.1:{proxy.port}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
                                          "CLIENT:PLAINTEXT",
    }
    port, cport = free_port(), free_port()
    extra = {k: v.format(port=port, cport=cport) for k, v in extra.items()}
    try:
        with own_broker(tmp_path / "kafka", port=port, controller_port=cport,
                        extra_properties=extra):
            settings = settings_for(f"127.0.0.1:{proxy.port}", "net", partitions=3)
            await ensure_base_topics(settings, ["task-a"])
            worker = Worker(settings, "reorder", "w0", log_path=tmp_path / "worker.log").start()
            fleet = PacedFleet(settings, tmp_path / "sandboxes", n=4, step_s=0.02,
                               steps_per_episode=25).start()
            try:
                await consume_until(settings, Topics(settings).replay("task-a"),
                                    lambda v: len(v) >= 50, timeout=60)
                assert proxy.stats["bytes_down"] > 0  # the clients do go through the proxy
                proxy.hold()
                emitted_at_hold = fleet.emitted
                t0 = time.monotonic()
                while time.monotonic() - t0 < 15:  # the partition
                    await asyncio.sleep(0.5)
                assert fleet.emitted > emitted_at_hold, "emitters blocked while cut off"
                proxy.slow(0.02)
                await asyncio.sleep(5)  # slow network: everything continues, slowly
                proxy.slow(0.0)
                await asyncio.sleep(3)
                await fleet.stop()
                await close_producer()
                assert all(fleet.closed_ok), "an emitter could not flush after the partition"
                expected = dict(fleet.acked)
                view = await trainer_view(settings, ["task-a"], "net-trainer",
                                          lambda v: v.complete(expected), timeout=150)
                assert worker.proc is not None and worker.proc.poll() is None, (
                    "the worker died: " + (tmp_path / "worker.log").read_text()[-3000:])
            finally:
                worker.stop()
    finally:
        proxy.stop()
    assert len(expected) >= 8
    assert diff_views(expected, view) == [], (tmp_path / "worker.log").read_text()[-3000:]
