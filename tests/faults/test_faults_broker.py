"""The broker killed with SIGKILL and restarted while sandboxes emit and a worker processes
(issue 9, fault 1). Runs on a private broker: the session broker is shared by every test.

What must hold: per episode, the trainer receives exactly the events the emitters had
acknowledged -- none missing, none twice, in order -- and the worker process survives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from faults_support import PacedFleet, diff_views, own_broker, trainer_view
from support import Worker, consume_until, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


async def test_broker_sigkill_during_production_and_processing_loses_and_duplicates_nothing(
        tmp_path: Path) -> None:
    with own_broker(tmp_path / "kafka") as broker:
        settings = settings_for(broker.bootstrap, "bk", partitions=3)
        await ensure_base_topics(settings, ["task-a"])
        worker = Worker(settings, "reorder", "w0", log_path=tmp_path / "worker.log").start()
        fleet = PacedFleet(settings, tmp_path / "sandboxes", n=4, step_s=0.02,
                           steps_per_episode=25).start()
        try:
            # Production and processing are under way: kill the broker, keep emitting.
            await consume_until(settings, Topics(settings).replay("task-a"),
                                lambda v: len(v) >= 50, timeout=60)
            broker.kill()
            emitted_at_kill = fleet.emitted
            await asyncio.sleep(3)  # the outage: sandboxes keep emitting into their journals
            assert fleet.emitted > emitted_at_kill, "emitters blocked while the broker was down"
            broker.start(timeout=120)
            await asyncio.sleep(3)  # production continues on the restarted broker
            await fleet.stop()
            await close_producer()
            assert all(fleet.closed_ok), "an emitter could not flush after the restart"
            expected = dict(fleet.acked)
            view = await trainer_view(settings, ["task-a"], "bk-trainer",
                                      lambda v: v.complete(expected), timeout=150)
            assert worker.proc is not None and worker.proc.poll() is None, (
                "the worker died with the broker: " +
                (tmp_path / "worker.log").read_text()[-3000:])
        finally:
            worker.stop()
    assert len(expected) >= 8
    assert diff_views(expected, view) == []
