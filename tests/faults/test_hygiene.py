"""Resource hygiene (issue 9): a worker's open file descriptors and RSS stay flat over a
simulated run with two broker restarts (SIGKILL), read from /proc/<pid>/fd and status; so do
the fds of the emitting process (four sandboxes' emitters and their one shared producer, the
field lesson: per-attempt clients leaked thousands of fds)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from faults_support import (
    PacedFleet,
    diff_views,
    own_broker,
    proc_fds,
    proc_rss_kb,
    start_worker,
    trainer_view,
)
from support import consume_until, settings_for

from trajbus.bus.admin import ensure_base_topics
from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(420)]


async def test_worker_fds_and_rss_stay_flat_across_two_broker_restarts(tmp_path: Path) -> None:
    with own_broker(tmp_path / "kafka") as broker:
        settings = settings_for(broker.bootstrap, "hy", partitions=3)
        await ensure_base_topics(settings, ["task-a"])
        worker = start_worker(settings, "reorder,watchdog,scheduler", "w0",
                              tmp_path / "worker.log")
        pid = worker.proc.pid
        fleet = PacedFleet(settings, tmp_path / "sb", n=4, step_s=0.02,
                           steps_per_episode=25).start()
        samples: list[tuple[str, int, int]] = []
        emitter_fds: list[tuple[str, int]] = []  # this process: the fleet's emitters

        async def sample(label: str, seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                samples.append((label, proc_fds(pid), proc_rss_kb(pid)))
                emitter_fds.append((label, proc_fds(os.getpid())))
                await asyncio.sleep(1)

        try:
            await consume_until(settings, Topics(settings).replay("task-a"),
                                lambda v: len(v) >= 50, timeout=60)
            await sample("warm-up", 15)
            for _ in range(2):
                broker.kill()
                await asyncio.sleep(3)
                broker.start(timeout=120)
                await sample("after restart", 15)
            await fleet.stop()
            await close_producer()
            view = await trainer_view(settings, ["task-a"], "hy-trainer",
                                      lambda v: v.complete(fleet.acked), timeout=150)
            await sample("end", 5)
            assert worker.proc.poll() is None
        finally:
            worker.stop()
    assert diff_views(dict(fleet.acked), view) == []
    base_fds = max(f for label, f, _ in samples if label == "warm-up")
    base_rss = max(r for label, _, r in samples if label == "warm-up")
    end_fds = [f for label, f, _ in samples if label == "end"]
    end_rss = [r for label, _, r in samples if label == "end"]
    print(f"fds warm-up max {base_fds}, end {end_fds}; rss warm-up max {base_rss} kB, "
          f"end {end_rss}; all samples {samples}")
    assert max(end_fds) <= base_fds + 10, samples
    # the emitters' side, sampled while they emit (warm-up, after each restart)
    base_emit = max(f for label, f in emitter_fds if label == "warm-up")
    assert max(f for label, f in emitter_fds if label == "after restart") <= base_emit + 10, (
        emitter_fds)
    assert max(end_rss) <= base_rss * 1.3 + 30_000, samples
