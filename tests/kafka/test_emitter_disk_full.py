"""An emitter whose journal disk fills up (issue 9: disk full on an emitter's journal).

The journal lives on a real, tiny tmpfs (mounted by the test; it needs root, as CI has). When
the disk is full an emit raises :class:`JournalError` naming the file and the OS error: the
event was not accepted and consumed no sequence number. Events accepted before still reach
Kafka; once space is freed, emitting resumes with the next sequence number, and Kafka holds
exactly the accepted events, gapless, once each. A journal segment roll that hits the full
disk is refused the same way and leaves no half-written segment behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from trajbus.bus.producer import close_producer
from trajbus.bus.topics import Topics
from trajbus.producers.emitter import SandboxEmitter
from trajbus.producers.journal import Journal, JournalError
from trajbus.producers.testing import check_streams, create_topics, make_settings, read_topics

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]


@pytest.fixture
def small_disk(tmp_path: Path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave: int, name: str = "filler") -> Path:
    """Fill ``disk`` with a filler file until about ``leave`` bytes remain."""
    filler = disk / name
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


@pytest.mark.parametrize("segment_bytes", [256 * 1024, 16 * 1024])
async def test_full_journal_disk_refuses_events_without_losing_or_reusing_sequences(
        kafka_broker, unique_name, small_disk: Path, segment_bytes: int) -> None:
    settings = make_settings(kafka_broker.bootstrap, unique_name, small_disk)
    await create_topics(settings)
    topic = Topics(settings).sandbox_events
    em = SandboxEmitter("sb-disk", "task-a", settings=settings, segment_bytes=segment_bytes,
                        state_dir=small_disk / "sb-disk")
    await em.start()
    accepted: list[tuple[int, str]] = []
    refused = 0
    try:
        await em.start_episode("ep-1")
        accepted.append((0, "start"))
        filler = fill(small_disk, leave=48 * 1024)
        payload = {"cmd": "x" * 1500}
        error = ""
        for _ in range(200):  # ~2 KiB a record: 48 KiB fills within ~30 emits
            seq = em.next_seq("ep-1")
            try:
                await em.tool_call("ep-1", "bash", payload)
            except JournalError as exc:
                refused += 1
                error = str(exc)
                assert em.next_seq("ep-1") == seq, "a refused event consumed a sequence"
                if refused == 3:
                    break
                continue
            accepted.append((seq, "call"))
        assert refused == 3, "the disk never filled"
        assert "No space left on device" in error and str(small_disk) in error, error
        # a trace chunk (another topic, bigger) is refused the same way
        last_page = fill(small_disk, leave=0, name="filler-2")  # not one page left
        seq = em.next_seq("ep-1")
        with pytest.raises(JournalError, match="No space left on device"):
            await em.trace_chunk("ep-1", os.urandom(segment_bytes // 2), file_offset=0)
        assert em.next_seq("ep-1") == seq
        assert await em.flush(30), "events accepted before the disk filled were not delivered"
        filler.unlink()  # the operator frees space
        last_page.unlink()
        for _ in range(20):
            seq = em.next_seq("ep-1")
            await em.tool_call("ep-1", "bash", payload)
            accepted.append((seq, "call"))
        seq = em.next_seq("ep-1")
        await em.end_episode("ep-1")
        accepted.append((seq, "end"))
        assert await em.close(30)
    finally:
        await em.abort()
        await close_producer()

    n = len(accepted)
    assert [s for s, _ in accepted] == list(range(n)), accepted  # gapless, never reused
    seen = await read_topics(settings, [topic], lambda s: len(
        [x for x in s if x.header["episode"] == "ep-1"]) >= n, timeout=30)
    streams = check_streams(x for x in seen if x.header["episode"] == "ep-1")
    seqs = streams.streams[("sb-disk", "ep-1")]
    assert sorted(seqs) == list(range(n))
    assert all(len(ids) == 1 for ids in seqs.values())  # one event id per seq: nothing twice
    assert len([x for x in seen if x.header["episode"] == "ep-1"]) == n  # no duplicate record


def test_segment_roll_on_a_full_disk_is_refused_and_leaves_no_partial_segment(
        small_disk: Path) -> None:
    journal = Journal(small_disk / "journal", segment_bytes=4096)
    journal.open_new_segment({"state": "first"})
    journal.append({"t": "E", "rid": 0}, b"x" * 100)
    before = sorted(p.name for p in journal.dir.iterdir())
    fill(small_disk, leave=0)  # not one page left for a new segment file
    with pytest.raises(JournalError, match="No space left on device"):
        journal.open_new_segment({"state": "x" * 8192})
    assert sorted(p.name for p in journal.dir.iterdir()) == before
    assert journal.active == 1  # still appending to the old segment
    (small_disk / "filler").unlink()
    journal.open_new_segment({"state": "after"})  # works again once space is freed
    assert journal.active == 2
