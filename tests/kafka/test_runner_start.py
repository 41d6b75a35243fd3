"""A worker whose broker restarts while it starts its clients waits for it (soak, 2026-12-01).

Under 6 CPU hogs a worker took seconds to reach its clients' start; the soak restarted the
broker meanwhile, the transactional producer's coordinator look-up lost its connection
(aiokafka raises that as a plain ``KafkaError`` wrapping ``KafkaConnectionError``), and the
worker exited 1 ("unexpected worker exit"). The broker had answered ``check_broker`` a moment
before: a restart is to be ridden out (as topic set-up does), a broker that never answers still
fails fast, and an error that is not about reaching the broker is not retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    LeaderNotAvailableError,
    NodeNotReadyError,
    TransactionalIdAuthorizationFailed,
)
from support import QuietCore, settings_for

from trajbus.bus.admin import ensure_topics
from trajbus.bus.kafka import broker_went_away
from trajbus.bus.topics import TopicSpec
from trajbus.consumers.engine import runner as runner_module
from trajbus.consumers.engine.runner import ProcessorSpec, Runner

PARTITIONS = 2


def _lost_connection() -> KafkaError:
    """What aiokafka's transactional producer raises when the broker goes away while it looks
    up its transaction coordinator (producer/sender.py, _find_coordinator)."""
    cause = KafkaConnectionError("Connection at 127.0.0.1:9092 closed")
    try:
        raise KafkaError(repr(cause)) from cause
    except KafkaError as exc:
        return exc


def test_errors_of_a_broker_that_went_away_are_told_from_other_errors() -> None:
    assert broker_went_away(_lost_connection())
    assert broker_went_away(KafkaConnectionError("Unable to bootstrap"))
    assert broker_went_away(NodeNotReadyError("node 1"))
    assert broker_went_away(LeaderNotAvailableError())  # a batch expired during a long restart
    assert not broker_went_away(KafkaError("something else"))
    assert not broker_went_away(TransactionalIdAuthorizationFailed())
    assert not broker_went_away(ValueError("bad setting"))


@pytest.fixture
def transactional_start_fails(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The worker's transactional producer's start fails ``times`` times with ``error()``."""
    plan: dict[str, Any] = {"times": 0, "error": _lost_connection, "calls": 0}
    real_start = AIOKafkaProducer.start

    async def start(self: AIOKafkaProducer) -> None:
        if getattr(self._txn_manager, "transactional_id", None):  # the worker's, not the ticker
            plan["calls"] += 1
            if plan["times"] > 0:
                plan["times"] -= 1
                raise plan["error"]()
        await real_start(self)

    monkeypatch.setattr(AIOKafkaProducer, "start", start)
    yield plan


async def _run(kafka_broker: Any, unique_name: str) -> Runner:
    settings = settings_for(kafka_broker.bootstrap, unique_name, partitions=PARTITIONS)
    in_topic = f"{unique_name}.in"
    await ensure_topics(settings, [TopicSpec(in_topic, PARTITIONS, "test input", "key")])
    runner = Runner(settings, ProcessorSpec(name="quiet", input_topics=[in_topic],
                                            factory=QuietCore), "w0")
    await asyncio.wait_for(runner.run(until_idle=2.0), timeout=60)
    return runner


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_a_broker_restart_while_the_worker_starts_its_clients_is_ridden_out(
        kafka_broker, unique_name, transactional_start_fails) -> None:
    transactional_start_fails["times"] = 2
    runner = await _run(kafka_broker, unique_name)  # raised KafkaError before the fix
    assert transactional_start_fails["calls"] == 3
    assert runner._consumer is not None and runner._consumer._closed


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_an_error_that_is_not_about_the_broker_is_not_retried(
        kafka_broker, unique_name, transactional_start_fails, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "TOPIC_SETUP_PATIENCE_S", 30.0)
    transactional_start_fails["times"] = 1_000
    transactional_start_fails["error"] = TransactionalIdAuthorizationFailed
    with pytest.raises(TransactionalIdAuthorizationFailed):
        await _run(kafka_broker, unique_name)
    assert transactional_start_fails["calls"] == 1
