"""The journals' group commit (issue 18, item 4): a sender round makes the journals it is about
to send from durable with one ``syncfs(2)`` per filesystem instead of one ``fdatasync`` each.

Specified on real files (no broker): journals sharing a filesystem get one ``syncfs``; a lone
journal, or one whose emitter asked for ``journal_sync="file"``, gets its own ``fdatasync``; a
failed ``syncfs`` counts as failed for every journal it covered (it cannot say whose pages were
lost); a slow sync round (a busy disk) is logged with what to do, at most every few minutes. The
emitter-level guarantee ("durable before sent") is checked against a broker in
``test_emitter_shared_sender.py`` for both modes."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from trajbus.producers import sender as sender_mod
from trajbus.producers.journal import syncfs
from trajbus.producers.sender import SharedSender


class Calls:
    def __init__(self) -> None:
        self.fdatasync: list[int] = []  # inodes
        self.syncfs: list[int] = []  # st_dev
        self.fail_syncfs: OSError | None = None

    def file(self, fd: int) -> None:
        self.fdatasync.append(os.fstat(fd).st_ino)
        os.fdatasync(fd)

    def fs(self, fd: int) -> None:
        self.syncfs.append(os.fstat(fd).st_dev)
        if self.fail_syncfs is not None:
            raise self.fail_syncfs


@pytest.fixture
def calls() -> Calls:
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
    return SharedSender(sync_fn=calls.file, syncfs_fn=calls.fs)


def test_journals_on_one_filesystem_share_one_syncfs(calls, journals):
    s = _sender(calls)
    errors = s._sync_journals(journals, [True] * len(journals))
    assert errors == [None] * len(journals)
    assert calls.syncfs == [os.fstat(journals[0]).st_dev]
    assert calls.fdatasync == []
    assert (s.syncfs_calls, s.fdatasyncs) == (1, 0)


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


def test_slow_sync_rounds_are_logged_with_what_to_do_at_most_every_few_minutes(caplog,
                                                                              tmp_path):
    s = SharedSender(sync_fn=os.fdatasync, syncfs_fn=None)
    em = SimpleNamespace(sender_journal_dir=tmp_path / "sb-1" / "journal")  # a SenderMember
    syncing = [(em, 3), (em, 4)]
    with caplog.at_level(logging.WARNING, logger=sender_mod.__name__):
        s._slow_sync(1.5, syncing, [True, True], now=100.0)
        assert len(caplog.records) == 1
        first = caplog.records[0].getMessage()
        assert "1 over 1 s" in first and "the longest 1.5 s" in first
        assert str(tmp_path) in first and "filesystem of its own" in first
        assert "emits are not held up" in first
        s._slow_sync(4.0, syncing, [True, True], now=200.0)  # within the quiet period
        s._slow_sync(2.0, syncing, [True, True], now=300.0)
        assert len(caplog.records) == 1
        s._slow_sync(1.2, syncing, [True, True], now=100.0 + sender_mod.SLOW_SYNC_WARN_EVERY_S)
        assert len(caplog.records) == 2
        second = caplog.records[1].getMessage()
        assert "3 over 1 s" in second and "the longest 4.0 s" in second
    assert s.slow_sync_rounds == 4


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
