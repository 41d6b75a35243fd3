"""Topic set-up against a broker that is restarting (the short soak's failure of 2026-12-01).

A worker started just before its broker was restarted got "All brokers are currently fenced"
back from topic creation (KRaft fences a broker in controlled shutdown), raised it as an error
and exited with a traceback, while the same outage a second later was ridden out. Such answers
are transient: set-up waits for the broker (bounded), and only a real refusal, or a broker
that never answered, fails, each with a message that says what to do.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from support import QuietCore, settings_for

from trajbus.bus.admin import ReplicationFactorError, ensure_topics
from trajbus.bus.kafka import BrokerUnavailableError
from trajbus.bus.settings import KafkaSettings, Settings, TopicSettings
from trajbus.bus.topics import TopicSpec
from trajbus.infra.broker import free_port

FENCED = ["Unable to replicate the partition 1 time(s): All brokers are currently fenced, or "
          "have all their log directories cordoned."]


class _FencedAnswer:
    def __init__(self, name: str) -> None:
        self.topic_errors = [(name, 38, *FENCED)]


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_topic_creation_waits_out_a_broker_that_is_fenced_while_restarting(
        kafka_broker, unique_name, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(kafka_broker.bootstrap, unique_name)
    real = AIOKafkaAdminClient.create_topics
    calls: list[str] = []

    async def fenced_twice(self: AIOKafkaAdminClient, topics: list[Any], *a: Any,
                           **k: Any) -> Any:
        calls.append(topics[0].name)
        if len(calls) <= 2:  # what the broker answered during its controlled shutdown
            return _FencedAnswer(topics[0].name)
        return await real(self, topics, *a, **k)

    monkeypatch.setattr(AIOKafkaAdminClient, "create_topics", fenced_twice)
    topic = f"{unique_name}.fenced"
    created, _ = await ensure_topics(settings, [TopicSpec(topic, 1, "test", "key")])
    assert created == [topic]
    assert calls == [topic] * 3


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_replication_factor_the_cluster_cannot_meet_says_what_to_set(
        kafka_broker, unique_name, caplog) -> None:
    """Waited for (a node of a cluster may be down: it looks the same), each try logged with
    what to set, then ReplicationFactorError -- not Kafka's bare "error 38"."""
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=kafka_broker.bootstrap),
                        topics=TopicSettings(prefix=unique_name, replication_factor=3))
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="trajbus.kafka"), \
            pytest.raises(ReplicationFactorError) as info:
        await ensure_topics(settings, [TopicSpec(f"{unique_name}.rf3", 1, "test", "key")],
                            patience_s=3)
    assert "TRAJBUS_TOPICS__REPLICATION_FACTOR=1 or less" in caplog.text  # said at once
    assert not isinstance(info.value, BrokerUnavailableError)
    # it says what to set, not Kafka's bare "error 38"
    assert "TRAJBUS_TOPICS__REPLICATION_FACTOR=3" in str(info.value)
    assert "has 1 live broker" in str(info.value)
    assert "TRAJBUS_TOPICS__REPLICATION_FACTOR=1 or less" in str(info.value)
    assert time.monotonic() - started < 10


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_broker_fenced_between_the_check_and_the_creation_is_waited_for(
        kafka_broker, unique_name, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster fault suite (2026-12-05, run 18, a rolling restart): the metadata still
    listed the node being restarted, so the replication-factor check passed, and the
    controller refused the creation with error 38 ("only 2 broker(s) are registered"); the
    worker stopped on a RuntimeError. That refusal is waited for like the check's."""
    from trajbus.bus import admin

    async def sees_enough_brokers(*_: object) -> None:
        return None

    monkeypatch.setattr(admin, "_check_replication_factor", sees_enough_brokers)
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=kafka_broker.bootstrap),
                        topics=TopicSettings(prefix=unique_name, replication_factor=3))
    started = time.monotonic()
    with pytest.raises(ReplicationFactorError) as info:
        await ensure_topics(settings, [TopicSpec(f"{unique_name}.rf3", 1, "test", "key")],
                            patience_s=3)
    assert time.monotonic() - started >= 2.5  # waited, not refused at once
    assert "TRAJBUS_TOPICS__REPLICATION_FACTOR=3" in str(info.value)


@pytest.mark.timeout(60)
async def test_a_broker_that_never_answered_fails_as_fast_as_the_start_up_check() -> None:
    settings = Settings(kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}",
                                            connect_timeout_s=2))
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match="did not answer topic set-up") as info:
        await ensure_topics(settings, [TopicSpec("never.created", 1, "test", "key")])
    assert "TRAJBUS_KAFKA__BOOTSTRAP_SERVERS" in str(info.value)
    assert time.monotonic() - started < 10


@pytest.mark.kafka
@pytest.mark.timeout(60)
async def test_a_running_worker_waits_out_a_restart_longer_than_the_start_up_check(
        kafka_broker, unique_name, monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak of 2026-12-01 (run 5): a worker's first output to a new replay topic came
    during a 20 s broker restart; topic set-up gave up after connect_timeout_s (10 s) as for a
    broker that never answered, and the worker exited. A running worker has seen its broker:
    it waits (up to TOPIC_SETUP_PATIENCE_S)."""
    from aiokafka.errors import KafkaConnectionError

    from trajbus.consumers.engine.runner import ProcessorSpec, Runner

    settings = settings_for(kafka_broker.bootstrap, unique_name)
    settings.kafka.connect_timeout_s = 1.0
    real_start = AIOKafkaAdminClient.start
    back_at = time.monotonic() + 3.0  # the broker is "away" for 3 s: longer than 1 s

    async def away_for_a_while(self: AIOKafkaAdminClient) -> None:
        if time.monotonic() < back_at:
            raise KafkaConnectionError("Unable to bootstrap (broker restarting)")
        await real_start(self)

    monkeypatch.setattr(AIOKafkaAdminClient, "start", away_for_a_while)
    with pytest.raises(BrokerUnavailableError):  # as at start-up: fail fast
        await ensure_topics(settings, [TopicSpec(f"{unique_name}.early", 1, "test", "key")])
    runner = Runner(settings, ProcessorSpec(name="out", input_topics=[], factory=QuietCore), "w0")
    topic = f"{unique_name}.replay.new-task"
    await runner._ensure_output_topic(topic)  # raised BrokerUnavailableError before the fix
    assert time.monotonic() >= back_at
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    await real_start(admin)
    try:
        assert topic in await admin.list_topics()
    finally:
        await admin.close()
