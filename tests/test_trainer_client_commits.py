"""The trainer client's commit policies (issue 17, item 3: live latency), against a real broker.

By default every ``ack()`` returns once its commit is done. With ``commit_every_ms`` > 0 it
does not wait: a committer task commits in the background, one commit in flight, every
acknowledgement made meanwhile in the next (before, the ack that found a commit due waited
for it). ``commit()`` (and ``stop()``) return once everything acknowledged is committed, so a
trainer restarted in the same group sees nothing it acknowledged before. A background commit
that fails is raised by the trainer's next call."""

from __future__ import annotations

import asyncio

import pytest
from replay_support import publish_replay
from support import make_episodes, settings_for

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


async def _left_over(settings: object, group: str) -> int:
    async with ReplayClient("web-shop", group, settings) as c:  # type: ignore[arg-type]
        n = 0
        async for seg in c.segments(idle_timeout=3):
            n += 1
            await c.ack(seg)
        return n


async def test_acks_do_not_wait_for_commits_and_commit_makes_them_durable(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    await publish_replay(settings, "web-shop", make_episodes(EPISODES, seed=1, task="web-shop"))
    group = f"{unique_name}-bg"
    client = Counting("web-shop", group, settings, commit_every_ms=1)
    await client.start()
    try:
        assert await _read_all(client, EPISODES) == EPISODES
        # acks returned without their round trip, and the commits were coalesced
        assert client.acks_before_commit >= EPISODES // 2
        assert client.commits < EPISODES
        await client.commit()
        committed = client.commits
    finally:
        # a crash right after commit(): the consumer goes without stop()'s final commit
        committer = client._committer
        if committer is not None:
            committer.cancel()
        assert client._consumer is not None
        await client._consumer.stop()
        client._consumer = None
    assert committed >= 1
    assert await _left_over(settings, group) == 0  # nothing acknowledged comes again


async def test_by_default_every_ack_returns_committed(kafka_broker: object,
                                                      unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    await publish_replay(settings, "web-shop", make_episodes(EPISODES, seed=2, task="web-shop"))
    group = f"{unique_name}-strict"
    client = Counting("web-shop", group, settings)
    await client.start()
    try:
        assert await _read_all(client, EPISODES) == EPISODES
        assert client.commits >= EPISODES  # one per ack that moved the offset (one partition
        assert client.acks_before_commit == 0  # ... or more); each ack returned committed
    finally:
        committer = client._committer
        assert committer is None  # the default never starts one
        assert client._consumer is not None
        await client._consumer.stop()  # a crash: no final commit, none needed
        client._consumer = None
    assert await _left_over(settings, group) == 0


async def test_a_failed_background_commit_is_raised_by_the_next_call(
        kafka_broker: object, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    await publish_replay(settings, "web-shop", make_episodes(4, seed=3, task="web-shop"))

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

    settings = settings_for(kafka_broker.bootstrap, unique_name)  # type: ignore[attr-defined]
    await publish_replay(settings, "web-shop", make_episodes(4, seed=4, task="web-shop"))

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
    assert client.stats["commits_retried_after_rebalance"] >= 3
    assert await _left_over(settings, group) == 0
