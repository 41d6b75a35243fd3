"""What a trainer's commits cost and what ``stats`` counts (issue 41, item 4).

* ``SyncReplayClient.commit()`` makes every acknowledgement durable before a checkpoint (it
  had no ``commit()``: a sync trainer with coalesced commits could not flush them).
* With coalesced commits (``commit_every_ms`` > 0) an asyncio trainer whose training step
  blocks (CPU work, no ``await``) still commits every interval: the background committer
  got no turn while the loop handed out records already fetched, so a crash re-delivered the
  whole backlog read so far, not "at most ``commit_every_ms``" (bench_trainer_commit: one
  commit -- the final one -- over a 21,900-segment catch-up).
* ``stats["segments"]`` / ``["events"]`` count what the trainer received, each once: a batch
  loop (``break`` after N episodes) made ``episodes()`` read the segments of the episodes it
  had not completed again, and counted them again.
* The default commit style, chosen by bench/bench_trainer_commit.py (BENCHMARKS.md): see
  :data:`DEFAULT_COMMIT_EVERY_MS`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from faults_support import committed_offsets, end_offsets
from replay_support import publish_replay
from support import make_episodes, settings_for
from test_trainer_client_early_exit import TASK, _episodes, _publish_interleaved

from trajbus.bus.topics import Topics
from trajbus.consumers.replay import client as client_module
from trajbus.consumers.replay.client import ReplayClient, SyncReplayClient

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(180)]


async def test_stats_count_each_delivered_event_once_in_a_batch_loop(
        kafka_broker: Any, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    published = _episodes(8, seed=41)
    await _publish_interleaved(settings, published)  # every episode open when one completes
    received = []
    async with ReplayClient(TASK, f"{unique_name}-batches", settings) as client:
        for _ in range(30):
            batch = []
            async for ep in client.episodes(idle_timeout=3):
                batch.append(ep)
                if len(batch) == 2:
                    break
            if not batch:
                break
            for ep in batch:
                await client.ack(ep)
            received += batch
        stats = dict(client.stats)
    assert client.stats["records_read_again_after_early_exit"] > 0  # the case in question
    assert len(received) == len(published)
    assert stats["events"] == sum(len(ep.events) for ep in received) \
        == sum(ep.n for ep in published)
    assert stats["segments"] == sum(len(ep.segments) for ep in received)


def test_sync_client_commit_makes_acknowledgements_durable(kafka_broker: Any,
                                                           unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    asyncio.run(publish_replay(settings, "web-shop",
                               make_episodes(6, seed=42, task="web-shop")))
    group = f"{unique_name}-sync-commit"
    topic = Topics(settings).replay("web-shop")
    with SyncReplayClient("web-shop", group, settings, commit_every_ms=600_000) as client:
        for ep in client.episodes(idle_timeout=3):
            client.ack(ep)
        client.commit()  # before a checkpoint: everything acknowledged is committed now
        committed = asyncio.run(committed_offsets(settings, group))
        ends = asyncio.run(end_offsets(settings, [topic]))
    assert {tp: off for tp, off in ends.items() if off} == committed


class _Counting(ReplayClient):
    commits_made = 0

    async def _commit(self) -> None:
        await super()._commit()
        self.commits_made += 1


async def test_coalesced_commits_go_on_while_a_blocking_training_step_runs(
        kafka_broker: Any, unique_name: str) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=1)
    await publish_replay(settings, "web-shop", make_episodes(30, seed=43, task="web-shop"))
    client = _Counting("web-shop", f"{unique_name}-busy", settings, commit_every_ms=50)
    await client.start()
    try:
        started = time.monotonic()
        n = 0
        async for ep in client.episodes(idle_timeout=3):
            time.sleep(0.02)  # a training step: CPU work, no await
            await client.ack(ep)
            n += 1
            if n == 30:
                break
        took = time.monotonic() - started
        during = client.commits_made
    finally:
        await client.stop()
    assert n == 30
    # ~0.6 s of training with a commit due every 50 ms: the committer got its turns
    assert during >= max(2, took / 0.05 / 5), (during, took)


def test_the_default_commit_style_is_the_measured_one() -> None:
    """bench/bench_trainer_commit.py (BENCHMARKS.md "trainer_commit"): with live-sized
    segments acknowledged one by one, a commit per ack made catch-up 9.5x-17x slower than a
    commit every 100 ms (1.4k-1.5k vs 13k-28k events/s here) and spent 90 % of the time in
    ``ack()``; per episode up to ~1.8x. The default is the coalesced style;
    ``commit_every_ms=0`` keeps the per-ack one (a crash then re-delivers nothing
    acknowledged)."""
    assert client_module.DEFAULT_COMMIT_EVERY_MS == 100
    import inspect

    for cls in (ReplayClient, SyncReplayClient):
        default = inspect.signature(cls.__init__).parameters["commit_every_ms"].default
        assert default == client_module.DEFAULT_COMMIT_EVERY_MS, cls
