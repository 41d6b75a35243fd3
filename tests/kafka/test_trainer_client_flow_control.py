"""The trainer client's flow control never hangs a loop silently (against a real broker).

Issue #41, item 1: the README's batch loop -- take N episodes, ``break``, train, acknowledge
the batch, ask again -- hung for good, silently, once the episodes taken held
``max_in_flight`` (256) segments. A live episode's segments hold one event each, so 7
episodes of 42 events were enough: the iterator waited for acknowledgements the trainer
would only give once it had its N episodes. A loop that never acknowledges hung the same
way. Now a loop is never held back by what it has itself handed out and not acknowledged
(it cannot acknowledge them while it waits for the next one); what earlier loops handed out
and the trainer has not acknowledged counts, and a wait for it that does not end is logged
(WARNING, naming ``max_in_flight``) and then raised (``FlowControlError``).

Item 3, in part: ``max_staleness`` dropped the events of stale segments and handed out the
empty shells; now stale episodes (segments) are dropped whole, counted, and acknowledged."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from replay_support import check_whole_once, left_over, publish_live, wait_until
from support import Episode, make_episodes, settings_for

import trajbus.consumers.replay.client as client_mod
from trajbus.consumers.replay import fetching
from trajbus.consumers.replay.client import ReplayClient, SyncReplayClient

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

TASK = "web-shop"
MAX_IN_FLIGHT = 256  # the default
BATCH = 16  # episodes per training step: ~370 live segments, more than MAX_IN_FLIGHT


def _episodes(n: int, seed: int, **kw: Any) -> list[Episode]:
    """``n`` episodes of 20 to 42 events: any BATCH of them holds more than MAX_IN_FLIGHT
    live segments, whichever come first."""
    eps = [ep for ep in make_episodes(3 * n, seed=seed, task=TASK, steps=20, **kw)
           if ep.n >= 20][:n]
    assert len(eps) == n and BATCH * 20 > MAX_IN_FLIGHT
    return eps


def _batch_segments(batch: list[Any]) -> int:
    return sum(len(ep.segments) for ep in batch)


async def test_readme_batch_loop_takes_batches_bigger_than_max_in_flight(
        kafka_broker: Any, unique_name: str) -> None:
    """The README's loop, live-sized segments, batches of more than ``max_in_flight``."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(3 * BATCH + 5, seed=41)
    await publish_live(settings, TASK, published)
    group = f"{unique_name}-batches"
    received: list[Any] = []
    biggest = 0
    async with ReplayClient(TASK, group, settings, max_in_flight=MAX_IN_FLIGHT) as client:

        async def train() -> None:
            nonlocal biggest
            while True:
                batch = []
                async for ep in client.episodes(idle_timeout=3):
                    batch.append(ep)
                    if len(batch) == BATCH:
                        break
                if not batch:
                    return
                biggest = max(biggest, _batch_segments(batch))  # the training step
                for ep in batch:
                    await client.ack(ep)
                received.extend(batch)

        await asyncio.wait_for(train(), 90)
        assert client._in_flight == 0
    assert biggest > MAX_IN_FLIGHT, "the test needs batches bigger than max_in_flight"
    check_whole_once(published, received)
    assert await left_over(settings, TASK, group) == 0  # every acknowledgement committed


@pytest.mark.timeout(120)  # the old client hung here: this bounds it
def test_sync_readme_batch_loop_takes_batches_bigger_than_max_in_flight(
        kafka_broker: Any, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(3 * BATCH + 5, seed=42)
    asyncio.run(publish_live(settings, TASK, published))
    group = f"{unique_name}-sync-batches"
    received: list[Any] = []
    biggest = 0
    with SyncReplayClient(TASK, group, settings, max_in_flight=MAX_IN_FLIGHT) as client:
        while True:
            batch = []
            for ep in client.episodes(idle_timeout=3):
                batch.append(ep)
                if len(batch) == BATCH:
                    break
            if not batch:
                break
            biggest = max(biggest, _batch_segments(batch))
            for ep in batch:
                client.ack(ep)
            received.extend(batch)
    assert biggest > MAX_IN_FLIGHT
    check_whole_once(published, received)
    assert asyncio.run(left_over(settings, TASK, group)) == 0


async def test_a_loop_that_never_acknowledges_still_gets_everything(
        kafka_broker: Any, unique_name: str) -> None:
    """One loop, no ``ack()`` at all: it is not held back by what it holds itself (it could
    never release it); nothing is committed, so another member reads it all again."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(2 * BATCH, seed=43)
    total = await publish_live(settings, TASK, published)
    assert total > MAX_IN_FLIGHT
    group = f"{unique_name}-never-acks"
    received: list[Any] = []
    async with ReplayClient(TASK, group, settings, max_in_flight=MAX_IN_FLIGHT) as client:

        async def read_all() -> None:
            async for ep in client.episodes(idle_timeout=3):
                received.append(ep)

        await asyncio.wait_for(read_all(), 60)
    check_whole_once(published, received)
    assert await left_over(settings, TASK, group) == total


async def test_batches_never_acknowledged_raise_a_clear_error_instead_of_hanging(
        kafka_broker: Any, unique_name: str) -> None:
    """Batches taken with ``break`` and never acknowledged: once earlier batches hold
    ``max_in_flight``, the next loop waits for their acknowledgements; none comes, so after
    ``flow_control_timeout_s`` it raises, naming the setting and the count."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(4 * BATCH, seed=44)
    await publish_live(settings, TASK, published)
    received: list[Any] = []
    async with ReplayClient(TASK, f"{unique_name}-batches-never-acked", settings,
                            max_in_flight=MAX_IN_FLIGHT, flow_control_timeout_s=2) as client:

        async def train() -> None:
            for _ in range(len(published)):
                batch = []
                async for ep in client.episodes(idle_timeout=3):
                    batch.append(ep)
                    if len(batch) == 4:
                        break
                received.extend(batch)  # trained on, never acknowledged

        with pytest.raises(client_mod.FlowControlError) as raised:
            await asyncio.wait_for(train(), 60)
    message = str(raised.value)
    assert f"max_in_flight={MAX_IN_FLIGHT}" in message, message
    held = _batch_segments(received)
    assert held >= MAX_IN_FLIGHT
    assert f"{held} segments" in message, message
    assert "ack()" in message, message
    assert isinstance(raised.value, RuntimeError)


async def test_a_wait_for_an_earlier_batch_is_logged_and_ends_with_its_ack(
        kafka_broker: Any, unique_name: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that trains on a batch while the next is collected (one step off-policy)
    asks for the next batch before acknowledging the last: the new loop waits for those
    acknowledgements (backpressure) -- logging a WARNING naming ``max_in_flight`` while it
    waits -- and goes on once they come."""
    monkeypatch.setattr(fetching, "_FLOW_WARN_AFTER_S", 0.2)  # the fetch loop's room
    monkeypatch.setattr(fetching, "_FLOW_WARN_EVERY_S", 0.5)
    caplog.set_level(logging.WARNING, logger=client_mod.__name__)
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(3 * BATCH, seed=45)
    await publish_live(settings, TASK, published)
    group = f"{unique_name}-off-policy"
    received: list[Any] = []
    async with ReplayClient(TASK, group, settings, max_in_flight=MAX_IN_FLIGHT,
                            flow_control_timeout_s=None) as client:

        async def take(n: int) -> list[Any]:
            batch = []
            async for ep in client.episodes(idle_timeout=3):
                batch.append(ep)
                if len(batch) == n:
                    break
            return batch

        first = await asyncio.wait_for(take(BATCH), 60)
        assert _batch_segments(first) >= MAX_IN_FLIGHT
        received.extend(first)
        second = asyncio.create_task(take(1))

        def warned() -> bool:
            return sum("max_in_flight=256" in r.getMessage() for r in caplog.records) >= 2

        await wait_until(warned, "the wait was logged twice")
        assert not second.done()
        warning = next(r for r in caplog.records if "max_in_flight" in r.getMessage())
        assert warning.levelno == logging.WARNING
        assert f"{_batch_segments(first)} segments" in warning.getMessage()
        for ep in first:  # the training step on the first batch ends
            await client.ack(ep)
        got = await asyncio.wait_for(second, 30)
        for ep in got:
            await client.ack(ep)
        received.extend(got)
        while True:
            batch = await asyncio.wait_for(take(BATCH), 60)
            if not batch:
                break
            for ep in batch:
                await client.ack(ep)
            received.extend(batch)
    check_whole_once(published, received)
    assert await left_over(settings, TASK, group) == 0


async def test_a_trainer_acknowledging_beside_its_loop_keeps_backpressure(
        kafka_broker: Any, unique_name: str) -> None:
    """Episodes handed to another task that acknowledges them: once the client has seen an
    acknowledgement made while the loop waited for the next episode, what the loop handed
    out counts, and the loop waits at ``max_in_flight`` for that task (regression guard of
    the old behaviour, which the fix keeps for such trainers)."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(3 * BATCH, seed=46)
    await publish_live(settings, TASK, published)
    longest = max(ep.n for ep in published)
    received: list[Any] = []
    pending: asyncio.Queue[Any] = asyncio.Queue()
    resume = asyncio.Event()  # the other task's training steps take long after its first
    held = 0
    most_held = 0
    async with ReplayClient(TASK, f"{unique_name}-beside", settings,
                            max_in_flight=MAX_IN_FLIGHT) as client:

        async def acker() -> None:
            nonlocal held
            acked = 0
            while True:
                ep = await pending.get()
                if acked == 1:
                    await resume.wait()
                await client.ack(ep)  # the loop has no await: it runs while the loop fetches
                acked += 1
                held -= len(ep.segments)

        async def loop() -> None:
            nonlocal held, most_held
            async for ep in client.episodes(idle_timeout=3):
                received.append(ep)
                held += len(ep.segments)
                most_held = max(most_held, held)
                pending.put_nowait(ep)

        acks = asyncio.create_task(acker())
        reading = asyncio.create_task(loop())
        try:
            await wait_until(lambda: client.stats["flow_control_waits"] > 0, "it waits")
            assert not reading.done()
            # handed out before it waited: up to max_in_flight of its own before the
            # client gives the other task a turn, the fetch then, the episodes it completed
            assert MAX_IN_FLIGHT <= most_held < 2 * MAX_IN_FLIGHT + 2 * longest, most_held
            resume.set()
            await asyncio.wait_for(reading, 90)
            await wait_until(pending.empty, "every episode acknowledged")
        finally:
            acks.cancel()
            reading.cancel()
    check_whole_once(published, received)


def test_max_staleness_without_a_policy_version_is_refused() -> None:
    settings = settings_for("127.0.0.1:9", "t-staleness")
    with pytest.raises(ValueError, match="current_policy_version"):
        ReplayClient(TASK, "g", settings, max_staleness=2)


@pytest.mark.parametrize("unit", ["episodes", "segments"])
async def test_stale_episodes_are_dropped_whole_counted_and_committed(
        kafka_broker: Any, unique_name: str, unit: str) -> None:
    """Episodes of a policy more than ``max_staleness`` versions behind the trainer's are
    dropped whole (never handed out as empty shells), counted, and acknowledged."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    fresh = _episodes(6, seed=47, policy_version=5)
    stale = make_episodes(6, seed=48, task=TASK, steps=20, policy_version=1)
    mixed = [ep for pair in zip(fresh, stale, strict=True) for ep in pair]
    await publish_live(settings, TASK, mixed)
    group = f"{unique_name}-stale"
    received: list[Any] = []
    async with ReplayClient(TASK, group, settings, max_staleness=2,
                            current_policy_version=lambda: 6) as client:

        async def read_all() -> None:
            items = client.episodes(idle_timeout=3) if unit == "episodes" else \
                client.segments(idle_timeout=3)
            async for item in items:
                assert item.events, "an empty shell was handed out"
                received.append(item)
                await client.ack(item)

        await asyncio.wait_for(read_all(), 60)
        stats = dict(client.stats)
    if unit == "episodes":
        check_whole_once(fresh, received)
        assert stats["stale_episodes_dropped"] == len(stale)
    else:
        assert {seg.episode for seg in received} == {ep.episode for ep in fresh}
        assert len(received) == sum(ep.n for ep in fresh)
        assert stats["stale_segments_dropped"] == sum(ep.n for ep in stale)
    assert stats["stale_dropped"] == sum(ep.n for ep in stale)  # events
    assert await left_over(settings, TASK, group) == 0  # the dropped ones are committed too
