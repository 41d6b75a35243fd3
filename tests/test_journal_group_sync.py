"""The journals' group commit (issue 18, item 4): a sender round makes the journals it is about
to send from durable with one ``syncfs(2)`` per filesystem instead of one ``fdatasync`` each.

Specified on real files (no broker): journals sharing a filesystem get one ``syncfs``; a lone
journal, or one whose emitter asked for ``journal_sync="file"``, gets its own ``fdatasync``; a
failed ``syncfs`` counts as failed for every journal it covered (it cannot say whose pages were
lost); a ``syncfs`` slower than ``journal_syncfs_slow_ms`` (other dirty data on the filesystem)
turns that filesystem to per-file syncs for a cool-down, with a warning, then it is tried
again (each slow try in a row doubles the cool-down, up to an hour). The emitter-level
guarantee ("durable before sent") is checked against a broker in
``test_emitter_shared_sender.py`` for both modes."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trajbus.bus.settings import ProducerSideSettings
from trajbus.producers import sender as sender_mod
from trajbus.producers.journal import syncfs
from trajbus.producers.sender import SharedSender


class Calls:
    def __init__(self) -> None:
        self.fdatasync: list[int] = []  # inodes
        self.syncfs: list[int] = []  # st_dev
        self.fail_syncfs: OSError | None = None
        self.syncfs_takes = 0.0  # advances the fake clock

    def file(self, fd: int) -> None:
        self.fdatasync.append(os.fstat(fd).st_ino)
        os.fdatasync(fd)

    def fs(self, fd: int) -> None:
        self.syncfs.append(os.fstat(fd).st_dev)
        clock.now += self.syncfs_takes
        if self.fail_syncfs is not None:
            raise self.fail_syncfs


class Clock:
    now = 1000.0

    def monotonic(self) -> float:
        return self.now


clock = Clock()


@pytest.fixture
def calls(monkeypatch) -> Calls:
    monkeypatch.setattr(sender_mod.time, "monotonic", clock.monotonic)
    return Calls()


@pytest.fixture
def journals(tmp_path: Path) -> Iterator[list[int]]:
    fds = []
    for i in range(6):
        fd = os.open(tmp_path / f"seg-{i}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, b"x" * 390)
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


def _sender(calls: Calls) -> SharedSender:
    s = SharedSender(sync_fn=calls.file, syncfs_fn=calls.fs)
    s.syncfs_slow_s = ProducerSideSettings().journal_syncfs_slow_ms / 1000
    return s


def test_journals_on_one_filesystem_share_one_syncfs(calls, journals):
    s = _sender(calls)
    errors = s._sync_journals(journals, [True] * len(journals))
    assert errors == [None] * len(journals)
    assert calls.syncfs == [os.fstat(journals[0]).st_dev]
    assert calls.fdatasync == []
    assert s.syncfs_calls == 1


def test_a_lone_journal_and_per_file_journals_get_fdatasync(calls, journals):
    s = _sender(calls)
    assert s._sync_journals(journals[:1], [True]) == [None]
    assert calls.syncfs == [] and len(calls.fdatasync) == 1
    calls.fdatasync.clear()
    # two asked for per-file syncs; the other four still share one syncfs
    whole_fs = [False, True, False, True, True, True]
    assert s._sync_journals(journals, whole_fs) == [None] * 6
    assert calls.fdatasync == [os.fstat(journals[i]).st_ino for i in (0, 2)]
    assert len(calls.syncfs) == 1


def test_without_syncfs_every_journal_is_synced_on_its_own(calls, journals):
    s = SharedSender(sync_fn=calls.file, syncfs_fn=None)  # not Linux
    assert s._sync_journals(journals, [True] * 6) == [None] * 6
    assert calls.fdatasync == [os.fstat(fd).st_ino for fd in journals]


def test_a_failed_syncfs_fails_every_journal_it_covered(calls, journals):
    s = _sender(calls)
    calls.fail_syncfs = OSError(errno.EIO, "Input/output error (injected)")
    whole_fs = [True, True, True, True, False, True]
    errors = s._sync_journals(journals, whole_fs)
    assert [e is calls.fail_syncfs for e in errors] == [True, True, True, True, False, True]
    assert calls.fdatasync == [os.fstat(journals[4]).st_ino]  # synced on its own: fine


def test_a_slow_syncfs_turns_its_filesystem_to_per_file_syncs_for_a_while(calls, journals,
                                                                         caplog):
    s = _sender(calls)
    calls.syncfs_takes = s.syncfs_slow_s + 0.1
    with caplog.at_level(logging.WARNING, logger=sender_mod.__name__):
        assert s._sync_journals(journals, [True] * 6) == [None] * 6
    assert s.syncfs_slow == 1 and len(calls.syncfs) == 1
    assert "TRAJBUS_PRODUCER__JOURNAL_SYNC=file" in caplog.text
    calls.syncfs_takes = 0.0
    # during the cool-down: one fdatasync per journal, no syncfs
    clock.now += sender_mod.SYNCFS_COOLDOWN_S - 1
    assert s._sync_journals(journals, [True] * 6) == [None] * 6
    assert len(calls.syncfs) == 1 and len(calls.fdatasync) == 6
    # after it: one syncfs again
    clock.now += 2
    assert s._sync_journals(journals, [True] * 6) == [None] * 6
    assert len(calls.syncfs) == 2 and len(calls.fdatasync) == 6


def test_a_filesystem_that_stays_slow_is_tried_ever_less_often(calls, journals):
    s = _sender(calls)
    cooldowns = []
    calls.syncfs_takes = s.syncfs_slow_s + 0.1
    for _ in range(9):
        before = len(calls.syncfs)
        s._sync_journals(journals, [True] * 6)
        assert len(calls.syncfs) == before + 1  # tried, slow again
        cooldowns.append(round(s._syncfs_off_until[os.fstat(journals[0]).st_dev] - clock.now))
        clock.now = s._syncfs_off_until[os.fstat(journals[0]).st_dev] + 0.001
    assert cooldowns == [60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
    # a fast one resets it
    calls.syncfs_takes = 0.0
    s._sync_journals(journals, [True] * 6)
    calls.syncfs_takes = s.syncfs_slow_s + 0.1
    s._sync_journals(journals, [True] * 6)
    assert round(s._syncfs_off_until[os.fstat(journals[0]).st_dev] - clock.now) == 60


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs(2) is Linux's")
def test_the_real_syncfs_syncs_and_reports_errors(tmp_path):
    assert syncfs is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x")
        syncfs(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        syncfs(fd)  # closed
    assert info.value.errno == errno.EBADF
