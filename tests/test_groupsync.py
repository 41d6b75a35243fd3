"""Group commit of journal syncs (issue 18): the emitters of a process share fdatasync rounds,
and each caller still returns only after a sync that started after its call."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from trajbus.producers.groupsync import GroupSync, group_sync

pytestmark = pytest.mark.timeout(60)


class RecordingSync:
    """A sync function that records when each round's syncs start (a global counter)."""

    def __init__(self, delay_s: float = 0.02, failing: set[int] | None = None) -> None:
        self.delay_s = delay_s
        self.failing = failing or set()
        self.lock = threading.Lock()
        self.clock = 0
        self.started: dict[int, list[int]] = {}  # fd -> clock values at which its syncs began

    def tick(self) -> int:
        with self.lock:
            self.clock += 1
            return self.clock

    def __call__(self, fd: int) -> None:
        self.started.setdefault(fd, []).append(self.tick())
        threading.Event().wait(self.delay_s)
        if fd in self.failing:
            raise OSError(5, "injected EIO")


async def test_concurrent_callers_share_rounds_and_each_gets_a_sync_started_after_its_call(
        ) -> None:
    fn = RecordingSync()
    gs = GroupSync(fn)
    called_at: dict[int, int] = {}

    async def caller(fd: int, delay: float) -> None:
        await asyncio.sleep(delay)
        called_at[fd] = fn.tick()
        await gs.sync(fd)
        # the caller's fd was synced by a sync that began after the call
        assert any(t > called_at[fd] for t in fn.started[fd]), (fd, called_at, fn.started)

    await asyncio.gather(*(caller(fd, (fd % 7) * 0.005) for fd in range(100, 300)))
    assert gs.syncs == 200
    assert gs.rounds < 40, f"{gs.rounds} rounds for 200 calls: the syncs were not grouped"


async def test_a_caller_arriving_during_a_round_waits_for_the_next_one() -> None:
    fn = RecordingSync(delay_s=0.2)
    gs = GroupSync(fn)
    first = asyncio.create_task(gs.sync(1))
    await asyncio.sleep(0.05)  # round 1 is syncing fd 1 now
    second = asyncio.create_task(gs.sync(1))
    await asyncio.gather(first, second)
    assert gs.rounds == 2 and len(fn.started[1]) == 2  # fd 1 synced again for the late caller


async def test_a_failed_sync_fails_only_its_caller() -> None:
    gs = GroupSync(RecordingSync(failing={7}))
    results = await asyncio.gather(gs.sync(6), gs.sync(7), gs.sync(8), return_exceptions=True)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], OSError) and "injected" in str(results[1])


async def test_the_shared_syncer_syncs_real_files(tmp_path: Path) -> None:
    fds = [os.open(tmp_path / f"j{i}", os.O_WRONLY | os.O_CREAT | os.O_APPEND) for i in range(20)]
    try:
        for fd in fds:
            os.write(fd, b"x" * 400)
        gs = group_sync()
        assert gs is group_sync()  # one per event loop
        before = gs.rounds
        await asyncio.gather(*(gs.sync(fd) for fd in fds))
        assert gs.rounds - before <= 2  # 20 journals, one or two rounds
    finally:
        for fd in fds:
            os.close(fd)
