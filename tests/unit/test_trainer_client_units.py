"""The trainer client's parts that need no broker: its sync iterator's closing and its start
positions (see tests/kafka/test_trainer_client_early_exit.py for the same behaviour on a broker)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition

from trajbus.consumers.replay.client import ReplayClient, SyncReplayClient


def _sync_wrapper() -> SyncReplayClient:
    """A SyncReplayClient's loop thread without a client (its iterator plumbing only)."""
    import threading

    wrapper = object.__new__(SyncReplayClient)
    wrapper._loop = asyncio.new_event_loop()
    wrapper._thread = threading.Thread(target=wrapper._loop.run_forever, daemon=True)
    wrapper._thread.start()
    return wrapper


def _stop(wrapper: SyncReplayClient) -> None:
    wrapper._loop.call_soon_threadsafe(wrapper._loop.stop)
    wrapper._thread.join(5)


@pytest.mark.timeout(30)
def test_sync_iterator_left_early_is_closed_on_the_loop() -> None:
    closed: list[str] = []

    async def numbers() -> Any:
        try:
            for i in range(10):
                yield i
        finally:
            closed.append("closed")

    wrapper = _sync_wrapper()
    try:
        for n in wrapper._iterate(numbers()):
            if n == 2:
                break
        assert closed == ["closed"]  # at once, not whenever a collection finds it
    finally:
        _stop(wrapper)


@pytest.mark.timeout(30)
def test_sync_iterator_left_after_the_loop_stopped_does_not_hang() -> None:
    """An iterator left open until its client's loop has stopped (a trainer that closed the
    client first) is not waited for: closing it would never end."""

    async def numbers() -> Any:
        for i in range(10):
            yield i

    wrapper = _sync_wrapper()
    it = wrapper._iterate(numbers())
    assert next(it) == 0
    _stop(wrapper)
    it.close()  # returns at once


class _PositionsOnly:
    """The consumer calls the start-position logic makes (no broker needed)."""

    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = assigned
        self.sought: list[tuple[TopicPartition, int]] = []
        self.paused: set[TopicPartition] = set()

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self.sought.append((partition, offset))

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self.paused.difference_update(partitions)

    def assignment(self) -> set[TopicPartition]:
        return self.assigned


@pytest.mark.timeout(30)
async def test_a_start_position_that_failed_to_resolve_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving the start position can fail in the assignment callback (the broker slow or
    away), where aiokafka only logs the error and would read the partitions from the group's
    commit -- for a new group, the history the trainer asked to skip. They wait, paused, and
    the fetch loop positions them; a partition counts as positioned only once sought."""
    from trajbus.consumers.replay import client as client_module
    from trajbus.consumers.replay import positions

    fresh, known = TopicPartition("replay.new", 0), TopicPartition("replay.t", 0)
    consumer = _PositionsOnly({fresh, known})
    attempts: list[list[TopicPartition]] = []

    async def resolve(_: Any, tps: Any, start: Any) -> dict[TopicPartition, int]:
        attempts.append(list(tps))
        assert start == "earliest"  # latest: a topic created after start() is read whole
        if len(attempts) == 1:
            raise RuntimeError("ListOffsets timed out")
        return {t: 7 for t in tps}

    monkeypatch.setattr(positions, "resolve_offsets", resolve)
    client = ReplayClient("t", "g", start="latest")
    client._consumer = consumer
    client._latest_at_start = {known: 42}
    listener = client_module._StartAt(client)
    await listener.on_partitions_revoked([])
    await listener.on_partitions_assigned([fresh, known])

    assert consumer.sought == [(known, 42)]  # what is known is sought at once
    assert consumer.paused == {fresh}  # not read from the group's commit meanwhile
    assert client._settled.is_set() and not client._rebalancing
    assert client.stats["start_positions_retried"] == 1

    await client._position_pending()
    assert consumer.sought == [(known, 42), (fresh, 7)] and not consumer.paused
    await listener.on_partitions_revoked([])
    await listener.on_partitions_assigned([fresh, known])  # positioned: left where it reads
    assert consumer.sought == [(known, 42), (fresh, 7)] and len(attempts) == 2


def test_the_commit_point_passes_holes_but_never_an_unacknowledged_record() -> None:
    """Offsets skipped between records read in order (transaction markers, aborted records)
    are passed by the commit point; a record handed out and not acknowledged holds it; a
    re-read after a seek back learns the holes again from there."""
    from trajbus.consumers.replay.client import _PartitionProgress

    p = _PartitionProgress(10)
    for offset in (11, 12, 14, 15):  # 10 and 13: markers
        p.note_read(offset)
    for offset in (11, 14, 15):  # 12 handed out, not acknowledged
        p.ack(offset)
    p.advance()
    assert p.committed == 12  # over the marker at 10, stopped by 12
    p.note_read(12)  # a re-read after a seek back: the holes from here are learnt again
    assert 13 not in p.holes
    p.note_read(14)
    p.ack(12)
    p.advance()
    assert p.committed == 16 and not p.acked
