"""How often a worker heartbeats to its group (issue 18, item 3): it learns of a rebalance from
a heartbeat's answer, so the interval bounds how long a joining worker waits for the others and
how long the partitions of a worker that left go unserved (bench/bench_rebalance.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from trajbus.bus import clients as clients_mod
from trajbus.bus.settings import KafkaSettings, Settings
from trajbus.consumers.engine import runner as runner_mod
from trajbus.consumers.engine.runner import ProcessorSpec, Runner


def test_default_is_half_a_second_within_the_default_session() -> None:
    k = KafkaSettings()
    assert k.heartbeat_interval_ms == 500
    assert k.session_timeout_ms == 10_000


def test_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJBUS_KAFKA__HEARTBEAT_INTERVAL_MS", "1500")
    assert Settings().kafka.heartbeat_interval_ms == 1500


def test_more_than_a_third_of_the_session_is_refused() -> None:
    assert KafkaSettings(session_timeout_ms=45_000, heartbeat_interval_ms=15_000)
    with pytest.raises(ValidationError, match="a third of session_timeout_ms"):
        KafkaSettings(heartbeat_interval_ms=4_000)


class _Built(Exception):
    pass


def test_the_worker_consumer_heartbeats_at_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def nothing(*_a: Any, **_k: Any) -> None:
        return None

    class Producer:
        def __init__(self, **_kw: Any) -> None:
            pass

    def consumer(**kw: Any) -> None:
        seen.update(kw)
        raise _Built

    monkeypatch.setattr(runner_mod, "check_broker", nothing)
    monkeypatch.setattr(Runner, "_prepare_topics", nothing)
    monkeypatch.setattr(clients_mod, "AIOKafkaProducer", Producer)
    monkeypatch.setattr(clients_mod, "AIOKafkaConsumer", consumer)
    settings = Settings(kafka=KafkaSettings(heartbeat_interval_ms=700))
    r = Runner(settings, ProcessorSpec(name="hb", input_topics=["in"], factory=lambda: None))
    with pytest.raises(_Built):
        asyncio.run(r.run())
    assert seen["heartbeat_interval_ms"] == 700
    assert seen["session_timeout_ms"] == 10_000
