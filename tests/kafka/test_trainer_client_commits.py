"""The trainer client's commit policies (issue 17, item 3: live latency), against a real broker.

With ``commit_every_ms=0`` every ``ack()`` returns once its commit is done. With
``commit_every_ms`` > 0 (the default is 100, issue 41) it does not wait: a committer task
commits in the background, one commit in flight, every acknowledgement made meanwhile in the
next (before, the ack that found a commit due waited for it). ``commit()`` (and ``stop()``)
return once everything acknowledged is committed, so a trainer restarted in the same group
sees nothing it acknowledged before. A background commit that fails is raised by the
trainer's next call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from replay_support import left_over, publish_replay, settings_with_replay
from support import make_episodes, settings_for

from trajbus.bus.settings import Settings
from trajbus.consumers.replay.client import ReplayClient

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]

EPISODES = 12


class Counting(ReplayClient):
    """Counts the commits sent and how many acks returned while their commit was pending."""

    commits = 0
    acks_before_commit = 0

    async def _commit(self) -> None:
        self.commits += 1
        await asyncio.sleep(0.05)  # a slow broker round trip
        await super()._commit()

    async def ack(self, item: object) -> None:  # type: ignore[override]
        before = self.commits
        await super().ack(item)  # type: ignore[arg-type]
        if self.commits == before or self._dirty or self._commit_lock.locked():
            self.acks_before_commit += 1


async def _read_all(client: ReplayClient, want: int) -> int:
    segments = 0
    async for seg in client.segments(idle_timeout=3):
        segments += 1
        await client.ack(seg)
        if segments >= want:
            break
    return segments


async def _left_over(settings: Settings, group: str) -> int:
    return await left_over(settings, "web-shop", group)


async def _published(kafka_broker: Any, unique_name: str, episodes: int, seed: int) -> Settings:
    """This test's settings, with ``episodes`` whole episodes in web-shop's replay topic."""
    return await settings_with_replay(kafka_broker.bootstrap, unique_name, "web-shop",
                                      episodes, seed)


@asynccontextmanager
async def _until_a_crash(client: ReplayClient) -> AsyncIterator[ReplayClient]:
    """``client`` started; on leaving, its consumer stops as in a crash: no committer left
    running, no final commit."""
    await client.start()
    try:
        yield client
    finally:
        committer = client._committer
        if committer is not None:
            committer.cancel()
        assert client._consumer is not None
        await client._consumer.stop()
        client._consumer = None


async def test_acks_do_not_wait_for_commits_and_commit_makes_them_durable(
        kafka_broker: object, unique_name: str) -> None:
    settings = await _published(kafka_broker, unique_name, EPISODES, seed=1)
    group = f"{unique_name}-bg"
    # a crash right after commit(): the consumer goes without stop()'s final commit
    async with _until_a_crash(Counting("web-shop", group, settings, commit_every_ms=1)) as client:
        assert await _read_all(client, EPISODES) == EPISODES
        # acks returned without their round trip, and the commits were coalesced
        assert client.acks_before_commit >= EPISODES // 2
        assert client.commits < EPISODES
        await client.commit()
        committed = client.commits
    assert committed >= 1
    assert await _left_over(settings, group) == 0  # nothing acknowledged comes again


async def test_with_commit_every_ms_0_every_ack_returns_committed(kafka_broker: object,
                                                                  unique_name: str) -> None:
    settings = await _published(kafka_broker, unique_name, EPISODES, seed=2)
    group = f"{unique_name}-strict"
    # a crash at the end: no final commit, none needed
    async with _until_a_crash(Counting("web-shop", group, settings, commit_every_ms=0)) as client:
        assert await _read_all(client, EPISODES) == EPISODES
        assert client.commits >= EPISODES  # one per ack that moved the offset (one partition
        assert client.acks_before_commit == 0  # ... or more); each ack returned committed
        assert client._committer is None  # the per-ack style never starts one
    assert await _left_over(settings, group) == 0


async def test_a_failed_background_commit_is_raised_by_the_next_call(
        kafka_broker: object, unique_name: str) -> None:
    settings = await _published(kafka_broker, unique_name, 4, seed=3)

    class Failing(ReplayClient):
        async def _commit(self) -> None:
            raise RuntimeError("commit refused")

    client = Failing("web-shop", f"{unique_name}-fail", settings, commit_every_ms=1)
    await client.start()
    try:
        with pytest.raises(RuntimeError, match="commit refused"):
            async for seg in client.segments(idle_timeout=3):
                await client.ack(seg)
                await asyncio.sleep(0.05)  # the committer runs meanwhile
    finally:
        await client.stop()  # does not raise again: the trainer has seen the failure


@pytest.mark.parametrize("commit_every_ms", [0, 1], ids=["per-ack", "coalesced"])
async def test_a_commit_refused_because_the_group_rebalanced_is_made_again(
        kafka_broker: object, unique_name: str, commit_every_ms: int) -> None:
    """After a broker outage longer than the session timeout the consumer rejoins its group;
    a commit sent meanwhile carries the old generation and is refused (CommitFailedError).
    That is no reason to stop the trainer (soak run 14339, 2026-12-03: its ``ack`` raised it
    and it received nothing more): the client commits again once the group has settled, and
    every acknowledgement is committed in the end (a fresh member has nothing left)."""
    from aiokafka.errors import CommitFailedError

    settings = await _published(kafka_broker, unique_name, 4, seed=4)

    class RefusedThrice(ReplayClient):
        refusals = 0

        async def _commit(self) -> None:
            if self.refusals < 3:
                self.refusals += 1
                raise CommitFailedError("the group has already rebalanced (injected)")
            await super()._commit()

    group = f"{unique_name}-rebalanced"
    client = RefusedThrice("web-shop", group, settings, commit_every_ms=commit_every_ms)
    async with client:
        assert await _read_all(client, 4) == 4
        await client.commit()
    assert client.refusals == 3
    # counted per commit, not per attempt: the per-ack one, or (coalesced) the committer's
    # and the explicit commit() that ran beside it
    assert 1 <= client.stats["commits_retried_after_rebalance"] <= 2
    assert await _left_over(settings, group) == 0


async def test_a_commit_waits_while_the_partitions_are_revoked_and_not_yet_assigned(
        kafka_broker: object, unique_name: str) -> None:
    """Between a revocation and the next assignment a commit would be refused: a per-ack
    ``ack()`` returns once the partitions are assigned again and the commit is made. The
    progress of a partition that went to another member is dropped: acknowledging a segment
    of it afterwards is counted, not an error, and commits go on for the others."""
    from trajbus.consumers.replay.client import _StartAt

    settings = await _published(kafka_broker, unique_name, 8, seed=5)
    group = f"{unique_name}-revoked"
    async with ReplayClient("web-shop", group, settings, commit_every_ms=0) as client:
        got = [seg async for seg in _take(client, 8)]
        by_partition = {seg.partition for seg in got}
        assert len(by_partition) == 2, "the test needs segments in both partitions"
        assert client._consumer is not None
        assigned = sorted(client._consumer.assignment())
        listener = _StartAt(client)  # what aiokafka calls around a rejoin
        await listener.on_partitions_revoked(assigned)
        ack = asyncio.create_task(client.ack(got[0]))
        await asyncio.sleep(0.6)
        assert not ack.done(), "acknowledged as committed while no partition was assigned"
        await listener.on_partitions_assigned(assigned)
        await asyncio.wait_for(ack, 10)
        assert client.stats["commits_retried_after_rebalance"] == 1
        # one partition moves to another member: its progress goes
        moved, kept = assigned
        await listener.on_partitions_revoked(assigned)
        await listener.on_partitions_assigned([kept])
        for seg in got[1:]:
            await client.ack(seg)
        moved_acks = sum(1 for seg in got[1:] if seg.partition == moved.partition)
        assert client.stats["acks_after_partition_moved"] == moved_acks > 0
        assert set(client._progress) == {kept}


async def test_segments_read_again_after_a_rejoin_are_not_committed_before_their_ack(
        kafka_broker: object, unique_name: str) -> None:
    """After a rejoin the consumer reads again from the group's committed offset. Segments
    already handed to the trainer but not acknowledged come back as duplicates: they are not
    delivered twice, and not taken as consumed either -- the commit stays before them until
    the trainer acknowledges the first delivery (a crash meanwhile re-delivers them)."""
    settings = await _published(kafka_broker, unique_name, 8, seed=6)
    group = f"{unique_name}-reread"
    async with ReplayClient("web-shop", group, settings) as client:
        got = [seg async for seg in _take(client, 8)]
        held = [seg for seg in got if seg.partition == got[-1].partition][-2:]
        for seg in got:
            if seg not in held:
                await client.ack(seg)
        assert client._consumer is not None
        for tp in client._consumer.assignment():  # what a rejoin does: back to the commit
            committed = await client._consumer.committed(tp)
            client._consumer.seek(tp, committed or 0)
        again = [seg async for seg in client.segments(idle_timeout=2)]
        assert again == []  # nothing delivered twice
        tp = next(tp for tp in client._progress if tp.partition == held[0].partition)
        assert client._progress[tp].committed <= held[0].offset
        for seg in held:
            await client.ack(seg)
        assert client._progress[tp].committed > held[-1].offset
    assert await _left_over(settings, group) == 0


async def _take(client: ReplayClient, n: int) -> AsyncIterator[Any]:
    got = 0
    async for seg in client.segments(idle_timeout=5):
        yield seg
        got += 1
        if got >= n:
            return


@pytest.mark.timeout(240)
@pytest.mark.parametrize("commit_every_ms", [0, 1], ids=["per-ack", "coalesced"])
async def test_a_trainer_keeps_running_while_another_member_joins_and_leaves(
        kafka_broker: object, unique_name: str, commit_every_ms: int) -> None:
    """A real rebalance each way (a second trainer of the group joins, takes a partition,
    then leaves): the first one never raises, every episode reaches one of them, and all
    that was acknowledged is committed (a fresh member has nothing left)."""
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    # enough that neither partition is drained by the time b is in (a join waits for a's
    # next heartbeat, ~3 s, at ~20 segments/s): b must get a partition with records left
    episodes = make_episodes(400, seed=7, task="web-shop")
    await publish_replay(settings, "web-shop", episodes)
    group = f"{unique_name}-members"
    seen: dict[str, set[tuple[str, str]]] = {"a": set(), "b": set()}
    b_left = asyncio.Event()

    async def trainer(name: str, stop: asyncio.Event, idle_s: float) -> ReplayClient:
        async with ReplayClient("web-shop", group, settings,
                                commit_every_ms=commit_every_ms) as client:
            async for seg in client.segments(idle_timeout=idle_s):
                seen[name].add((seg.sandbox, seg.episode))
                await client.ack(seg)
                if not b_left.is_set():  # a trainer's work: the rebalances come mid-stream
                    await asyncio.sleep(0.05)
                if stop.is_set():
                    break
        return client

    never = asyncio.Event()
    a = asyncio.create_task(trainer("a", never, idle_s=8))
    deadline = asyncio.get_running_loop().time() + 60
    while len(seen["a"]) < 10 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    b_stop = asyncio.Event()
    b = asyncio.create_task(trainer("b", b_stop, idle_s=30))
    while not seen["b"] and not b.done() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    b_stop.set()  # b leaves after its first segment: a takes its partition back
    client_b = await asyncio.wait_for(b, 60)
    b_left.set()
    client_a = await asyncio.wait_for(a, 120)
    assert seen["b"], "the second trainer got no segment"
    assert seen["a"] | seen["b"] == {(e.sandbox, e.episode) for e in episodes}
    assert client_a.stats["segments"] >= 10 and client_b.stats["segments"] >= 1
    assert await _left_over(settings, group) == 0


async def test_an_ack_beyond_an_unacknowledged_segment_is_committed_at_once(
        kafka_broker: object, unique_name: str) -> None:
    """Episodes finish out of order: a segment acknowledged after one still held is beyond
    the commit point. Per-ack commits record it at once (in the commit's metadata), so a
    trainer that crashes then gets only the held segment again."""
    settings = await _published(kafka_broker, unique_name, 8, seed=8)
    group = f"{unique_name}-beyond"
    async with _until_a_crash(ReplayClient("web-shop", group, settings,
                                           commit_every_ms=0)) as client:
        got = [seg async for seg in _take(client, 8)]
        held = min(got, key=lambda seg: (seg.partition, seg.offset))
        # the held segment's partition last: its acks move no commit point
        for seg in sorted(got, key=lambda seg: seg.partition == held.partition):
            if seg is not held:
                await client.ack(seg)
    assert await _left_over(settings, group) == 1


async def test_the_commit_point_passes_the_markers_of_a_transactional_replay_topic(
        kafka_broker: object, unique_name: str) -> None:
    """The worker writes replay topics in transactions: every transaction leaves a commit
    marker at an offset no reader gets. The commit point passes those (and aborted records):
    it reaches the last record, and a restarted trainer gets nothing again -- before, it
    stopped at the first marker, the acknowledgements beyond it overflowed the commit's
    metadata, and a restart delivered most of the topic a second time (finding AE)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from replay_support import create_replay_topic, whole_episode_segment

    from trajbus.bus.topics import episode_record_key

    settings = settings_for(kafka_broker.bootstrap, unique_name,  # type: ignore[attr-defined]
                            partitions=1)
    topic = await create_replay_topic(settings, "web-shop")
    episodes = make_episodes(600, seed=11, task="web-shop", steps=2)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                transactional_id=f"{unique_name}-worker")
    await producer.start()
    try:
        for i in range(0, len(episodes), 2):  # 300 transactions, a marker after each
            async with producer.transaction():
                for ep in episodes[i:i + 2]:
                    await producer.send(topic, whole_episode_segment(ep),
                                        key=episode_record_key(ep.sandbox, ep.episode))
        aborted = make_episodes(3, seed=13, task="web-shop", steps=2)
        await producer.begin_transaction()  # and an aborted one: its records are holes too
        for ep in aborted:
            await producer.send(topic, whole_episode_segment(ep),
                                key=episode_record_key(ep.sandbox, ep.episode))
        await producer.abort_transaction()
        async with producer.transaction():
            ep = make_episodes(1, seed=12, task="web-shop", steps=2)[0]
            await producer.send(topic, whole_episode_segment(ep),
                                key=episode_record_key(ep.sandbox, ep.episode))
    finally:
        await producer.stop()

    group = f"{unique_name}-markers"
    assert await _left_over(settings, group) == len(episodes) + 1  # the first trainer
    tp = TopicPartition(topic, 0)
    probe = AIOKafkaConsumer(bootstrap_servers=settings.kafka.bootstrap_servers,
                             group_id=group, isolation_level="read_committed")
    await probe.start()
    try:
        committed, end = await probe.committed(tp), (await probe.end_offsets([tp]))[tp]
    finally:
        await probe.stop()
    assert committed == end - 1  # past the last record; only its transaction's marker is left
    assert await _left_over(settings, group) == 0  # a restarted trainer: nothing again
