"""A restore's offset lookup rides out a partition leader that moves (a rolling restart): it is
asked again with fresh metadata every few seconds instead of waiting out aiokafka's request
timeout (30 s) on the old leader -- in the cluster soak a worker's restore took 42 s so."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError

from trajbus.consumers.engine import restore

TPS = [TopicPartition("t", 0)]


class _Client:
    def __init__(self) -> None:
        self.refreshes = 0

    async def force_metadata_update(self) -> bool:
        self.refreshes += 1
        return True


class _Consumer:
    def __init__(self) -> None:
        self._client = _Client()


async def test_a_lookup_that_hangs_on_the_old_leader_is_asked_again(monkeypatch) -> None:
    monkeypatch.setattr(restore, "OFFSET_LOOKUP_TRY_S", 0.1)
    calls = 0

    async def lookup(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        nonlocal calls
        calls += 1
        if calls < 3:
            await asyncio.sleep(3600)  # the request sits with a leader that is going away
        return dict.fromkeys(tps, 7)

    consumer: Any = _Consumer()
    got = await asyncio.wait_for(restore._offsets_riding_out_failover(lookup, TPS, consumer), 5)
    assert got == {TPS[0]: 7} and calls == 3 and consumer._client.refreshes == 2


async def test_a_lookup_never_answered_fails_after_the_patience(monkeypatch) -> None:
    monkeypatch.setattr(restore, "OFFSET_LOOKUP_TRY_S", 0.05)
    monkeypatch.setattr(restore, "TOPIC_SETUP_PATIENCE_S", 0.3)

    async def lookup(tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        raise KafkaTimeoutError("Failed to get offsets by times in 30000 ms")

    with pytest.raises(KafkaTimeoutError, match="not answered"):
        await asyncio.wait_for(restore._offsets_riding_out_failover(lookup, TPS, _Consumer()),
                               5)
